"""Step time with messages matched by order (NCCL's behaviour, forced on CPU) beside by tag (gloo's eager sends).

    .venv/bin/python benchmarks/bench_p2p_matching.py                                  # 1f1b, zb-h1, interleaved
    .venv/bin/python benchmarks/bench_p2p_matching.py --schedules zbv --stages 2 --rounds 20

Under order a send leaves at its SEND, so this measures where the lowering put each SEND (`pipegpt simulate
--p2p-matching order` predicts it). The setting is not a `pipegpt run` flag (on CUDA only order is right; a
--config file can set it), so one job per stage count runs here (the driver's Job, as `pipegpt run` starts it,
gloo, one thread per rank) and is rebuilt in turn for tag and for order: each round times --steps steps of
each, the matching that goes first alternating, after a step left out per rebuild. A cell is the median of every
timed step; order / tag their ratio, and beside it the median of the per-round ratios (the machine's drift
hits both halves of a round alike).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODEL = dict(vocab_size=256, seq_len=64, n_layer=8, n_head=4, n_embd=128, tie_embeddings=False)


def timed_steps(job, cfg, steps: int) -> list[float]:
    job.build(cfg)
    job.step(0)  # left out: the first step after a build
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        job.step(step)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.train.driver import Job

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedules", default="1f1b,zb-h1,interleaved-1f1b")
    ap.add_argument("--stages", default="2,4", help="comma list (a process each: RPC starts once per process)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per matching per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.no_header:
        print(f"model {MODEL}; microbatch 1, {args.microbatches} microbatches; {args.rounds} rounds x {args.steps} "
              f"steps per matching, alternated")
        print(f"{'schedule':18} {'p':>2} {'tag ms':>8} {'order ms':>9} {'order/tag':>9} {'per round':>10}", flush=True)
    counts = [int(s) for s in args.stages.split(",")]
    if len(counts) > 1:
        for stages in counts:
            subprocess.run([sys.executable, __file__, "--schedules", args.schedules, "--stages", str(stages),
                            "--microbatches", str(args.microbatches), "--steps", str(args.steps),
                            "--rounds", str(args.rounds), "--no-header"], check=True, timeout=3600)
        return 0
    stages = counts[0]
    base = TrainConfig.build(ModelConfig(**MODEL), stages=stages, microbatches=args.microbatches,
                             microbatch_size=1, device="cpu", lr=1e-4)
    job = Job(base, threads_per_worker=1)
    job.say = lambda line: None
    job.start()
    try:
        for schedule in args.schedules.split(","):
            per: dict[str, list[float]] = {"tag": [], "order": []}
            ratios = []
            for k in range(args.rounds):
                medians = {}
                for matching in (("tag", "order") if k % 2 == 0 else ("order", "tag")):
                    times = timed_steps(job, base.replace(schedule=schedule, p2p_matching=matching), args.steps)
                    per[matching] += times
                    medians[matching] = statistics.median(times)
                ratios.append(medians["order"] / medians["tag"])
            tag, order = statistics.median(per["tag"]) * 1e3, statistics.median(per["order"]) * 1e3
            print(f"{schedule:18} {stages:>2} {tag:>8.1f} {order:>9.1f} {order / tag:>9.3f} "
                  f"{statistics.median(ratios):>10.3f}", flush=True)
    finally:
        job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
