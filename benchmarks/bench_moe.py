"""A mixture of experts over ep ranks against the dense model of its active size: tokens per second and bytes
per rank, on CPU.

    python benchmarks/bench_moe.py                         # 12 steps, 3 rounds
    python benchmarks/bench_moe.py --steps 4 --rounds 1    # a quick look

Contenders (4 ranks each): tiny-moe (8 experts of width 96, top-2, one shared expert) at dp 4 x pp 1 with ep 1, 2
and 4, and at dp 2 x pp 2 with ep 2; beside them the dense model of the same active size: tiny-moe without
experts, its feed-forward (top-k + shared) x expert_hidden = 288 wide, at dp 4 x pp 1 and dp 2 x pp 2. Each
contender runs in a fresh process (torch.distributed.rpc initialises once per process), the contenders
alternated over --rounds rounds, each round's order rotated. Tokens/s: the step's tokens over the median step
time of the steps after --warmup, over every round. Bytes per rank (the most of any rank, after the last step):
the parameters it holds (Engine.describe's parameter_bytes: with ep its own experts only), the gradients (the
last step's, Worker.named_grads), the AdamW moments (Worker.describe's optimizer_state_bytes), and the peak RSS
the metrics report (WorkerStep.peak_memory: the process's max RSS on the CPU). CPU gloo on a shared machine:
absolute times move with its load; the last line says how busy the machine was.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CONTENDERS = [  # (name, experts, dp, pp, ep)
    ("dense", False, 4, 1, 1), ("moe ep 1", True, 4, 1, 1), ("moe ep 2", True, 4, 1, 2),
    ("moe ep 4", True, 4, 1, 4), ("dense pp 2", False, 2, 2, 1), ("moe ep 2 pp 2", True, 2, 2, 2)]


def model_of(experts: bool):
    import dataclasses

    from pipegpt.config import model_config

    moe = model_config("tiny-moe")
    if experts:
        return moe
    active = (moe.experts_per_token + moe.n_shared_experts) * moe.expert_width
    return dataclasses.replace(moe, n_experts=0, n_experts_per_token=None, n_shared_experts=0, expert_hidden=None,
                               router_aux_loss_coef=0.0, ffn_hidden=active).validate()


def measure(spec: dict) -> dict:
    """In a child process: `steps` steps of one contender; its step times, bytes per rank and peak RSS."""
    import time

    from pipegpt.config import TrainConfig
    from pipegpt.train.driver import Job

    model = model_of(spec["experts"])
    cfg = TrainConfig.build(model, dp=spec["dp"], stages=spec["pp"], ep=spec["ep"], microbatches=spec["m"],
                            microbatch_size=spec["mbs"], steps=spec["steps"], device="cpu", timeout_s=120).validate()
    times = []
    with Job(cfg, threads_per_worker=1) as job:
        job.start()
        for step in range(spec["steps"]):
            t0 = time.perf_counter()
            results = job.step(step)
            times.append(time.perf_counter() - t0)
        described = job.call("describe")
        grads = job.call("named_grads")
        job.close()
    grad_bytes = [sum(t.numel() * t.element_size() for t in g.values()) for g in grads]
    return {"times": times, "tokens_per_step": cfg.tokens_per_step,
            "parameters": [d["parameter_bytes"] for d in described], "gradients": grad_bytes,
            "optimizer": [d["optimizer_state_bytes"] for d in described],
            "peak_rss": [r.peak_memory for r in results]}


def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode:
        raise SystemExit(f"{spec}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (per job)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4, help="per replica")
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    from bench_zero import _cpu_jiffies, kib  # beside this file: on sys.path when run as a script
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    busy0, total0 = _cpu_jiffies()
    times: dict[str, list[float]] = {name: [] for name, *_ in CONTENDERS}
    first: dict[str, dict] = {}
    for r in range(args.rounds):
        order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[:r % len(CONTENDERS)]  # each round starts elsewhere
        for name, experts, dp, pp, ep in order:
            spec = {"experts": experts, "dp": dp, "pp": pp, "ep": ep, "steps": args.steps,
                    "m": args.microbatches, "mbs": args.microbatch_size}
            got = run_child(spec)
            times[name] += got["times"][args.warmup:]
            first.setdefault(name, got)
            print(f"measured {name} (round {r + 1})", file=sys.stderr)
    busy1, total1 = _cpu_jiffies()
    moe, dense = model_of(True), model_of(False)
    print(f"tiny-moe: {moe.n_layer} layers, width {moe.n_embd}, {moe.n_experts} experts of {moe.expert_width}, "
          f"top-{moe.experts_per_token} + {moe.n_shared_experts} shared; dense: ffn {dense.ffn_hidden}; "
          f"{args.microbatches} x {args.microbatch_size} sequences of {moe.seq_len} per replica, fp32, CPU gloo, "
          f"4 ranks, 1 thread each")
    print(f"tokens/s: median of steps {args.warmup + 1}..{args.steps} over {args.rounds} round(s) (a fresh job "
          f"each, the contenders alternated); KiB: the most any rank holds after the last step")
    header = f"{'contender':<16}{'dp x pp':>8}{'ep':>4}{'tokens/s':>10}{'x dense':>9}{'params':>9}{'grads':>9}" \
             f"{'Adam':>9}{'peak RSS':>11}"
    print(header)
    print("-" * len(header))
    base = {1: "dense", 2: "dense pp 2"}
    for name, experts, dp, pp, ep in CONTENDERS:
        got = first[name]
        rate = got["tokens_per_step"] / statistics.median(times[name])
        ref = first[base[pp]]["tokens_per_step"] / statistics.median(times[base[pp]])
        print(f"{name:<16}{f'{dp} x {pp}':>8}{ep:>4}{rate:>10,.0f}{rate / ref:>9.2f}{kib(max(got['parameters'])):>9}"
              f"{kib(max(got['gradients'])):>9}{kib(max(got['optimizer'])):>9}"
              f"{max(got['peak_rss']) / 2**20:>8,.0f} MiB")
    print(f"machine CPU busy while measuring: {100 * (busy1 - busy0) / max(1, total1 - total0):.0f}% of all cores "
          f"(this benchmark's ranks included: absolute times move with the load)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
