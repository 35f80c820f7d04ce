"""What recording a step's per-action timeline costs (`pipegpt run --trace-steps`), on CPU, in one process.

    .venv/bin/python benchmarks/bench_trace_cost.py                       # tiny model, 1 rank, 1f1b, 8 microbatches
    .venv/bin/python benchmarks/bench_trace_cost.py --n-layer 1 --n-embd 32 --seq-len 16 --microbatch-size 1

Two measurements:

1. The recording itself: the operations PipelineRuntime.step adds per action when it records (two clock
   marks and one list append), timed in a loop of 10^6, times the rank's actions per step. This is the cost,
   free of the step's noise.
2. A/B: PipelineRuntime.step of a one-rank plan (every action computes; no other process shares the
   measurement) with record=True and record=False, alternated step by step: medians of wall time and of
   the thread's CPU time (which leaves out other processes taking the core), and 10th percentiles. On a
   shared machine the difference is within the steps' noise; it is printed to show that, not as the cost.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def recording_ns_per_action(n: int = 1_000_000) -> float:
    """Nanoseconds per action of exactly what recording adds in PipelineRuntime.step on CPU."""
    from pipegpt.stages.timing import HostClock

    clock, name = HostClock().mark, "0F1"
    best = float("inf")
    for _ in range(5):
        events = []
        t = time.perf_counter()
        for _ in range(n):
            t0 = clock()
            events.append((name, t0, clock()))
        with_recording = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(n):  # the loop's own cost, subtracted
            pass
        best = min(best, (with_recording - (time.perf_counter() - t)) / n)
    return best * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200, help="Steps in all (half with recording, alternating).")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from pipegpt.comm.p2p import PointToPoint
    from pipegpt.config import ModelConfig
    from pipegpt.model.gpt import GPT
    from pipegpt.stages.runtime import PipelineRuntime
    from pipegpt.schedule import build_plan, lower
    from pipegpt.stages import Stage

    torch.set_num_threads(args.threads)
    cfg = ModelConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len)
    plan = lower(build_plan(args.schedule, 1, args.microbatches))
    if plan.num_stages != 1:
        raise SystemExit(f"{args.schedule} puts {plan.num_stages} stages on a rank: use one with one stage per rank")
    stages = {0: Stage(0, 1, GPT(cfg, init_seed=0), plan.num_microbatches)}
    runtime = PipelineRuntime(plan, 0, stages, PointToPoint(0, 60.0), [0],
                              (args.microbatch_size, cfg.seq_len, cfg.n_embd), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = [torch.randint(0, cfg.vocab_size, (args.microbatch_size, cfg.seq_len), generator=g)
         for _ in range(plan.num_microbatches)]
    params = [p for st in stages.values() for p in st.module.parameters()]

    def one_step(record: bool) -> tuple[float, float]:
        """(wall, this thread's CPU time) of one step: with one intra-op thread the step runs on this thread,
        and CPU time leaves out the time other processes of a shared machine take the core."""
        for p in params:
            p.grad = None
        t, c = time.perf_counter(), time.thread_time()
        result = runtime.step(x, x, record=record)
        elapsed = time.perf_counter() - t, time.thread_time() - c
        assert bool(result.events) == record
        return elapsed

    for _ in range(5):  # warm-up
        one_step(True)
        one_step(False)
    times = {True: [], False: []}
    for i in range(args.steps):
        record = i % 2 == 0
        times[record].append(one_step(record))
    wall = {k: [w for w, _ in v] for k, v in times.items()}
    cpu = {k: [c for _, c in v] for k, v in times.items()}
    on, off = statistics.median(wall[True]), statistics.median(wall[False])
    actions = len(runtime.actions)
    per_action = recording_ns_per_action()
    cost = actions * per_action * 1e-9
    spread = statistics.quantiles(wall[False], n=4)
    cpu_on, cpu_off = statistics.median(cpu[True]), statistics.median(cpu[False])
    p10_on, p10_off = (statistics.quantiles(cpu[k], n=10)[0] for k in (True, False))
    print(f"plan {plan.name}, 1 rank, {plan.num_microbatches} microbatches x {args.microbatch_size} x {cfg.seq_len} "
          f"tokens; model n_layer={cfg.n_layer} n_embd={cfg.n_embd}; {actions} actions per step; "
          f"{torch.get_num_threads()} thread(s)")
    print(f"recording: {per_action:.0f} ns per action x {actions} actions = {cost * 1e6:.1f} us per step "
          f"= {100 * cost / off:.3f}% of the median step ({off * 1e3:.2f} ms)")
    print(f"A/B over {args.steps} alternating steps: median step {on * 1e3:.3f} ms recording, {off * 1e3:.3f} ms not "
          f"({100 * (on - off) / off:+.2f}%); interquartile range without recording "
          f"{spread[0] * 1e3:.3f}..{spread[2] * 1e3:.3f} ms ({100 * (spread[2] - spread[0]) / off:.1f}% of the median)")
    print(f"  thread CPU time: median {cpu_on * 1e3:.3f} ms recording, {cpu_off * 1e3:.3f} ms not "
          f"({100 * (cpu_on - cpu_off) / cpu_off:+.2f}%); 10th percentile {p10_on * 1e3:.3f} vs {p10_off * 1e3:.3f} ms "
          f"({100 * (p10_on - p10_off) / p10_off:+.2f}%)")


if __name__ == "__main__":
    main()
