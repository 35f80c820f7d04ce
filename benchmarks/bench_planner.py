"""How long the planner's pieces take: the search, the memory model, the stage balancer.

    .venv/bin/python benchmarks/bench_planner.py               # each case 3 times, the least time shown
    .venv/bin/python benchmarks/bench_planner.py --repeat 5

Cases (the sizes the tests once held to seconds; they now hold the work, these give the time):
  search       `pipegpt plan`'s search: GPT-3 175B on 1,000 A100-80GB, batch 1536, top 5
  plan_memory  the memory model per call: gpt2-medium over 1f1b, zb-h1, zbv at p 2, 4, 8, m 16, tp 1, 2, 4, three
               recompute modes, microbatch sizes 1..8 (324 calls)
  balance      the stage balancer on 100 layers: 1f1b on 64 ranks, interleaved 1f1b and zbv on 32 (uniform), and
               a chain of uneven layers on 32 ranks
seconds is wall time (time.perf_counter) of one case, the least of --repeat runs: other processes only add time.
The synthesizer has its own: bench_synthesize.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipegpt.config import MODEL_PRESETS, ModelConfig  # noqa: E402
from pipegpt.costs.balance import balance  # noqa: E402
from pipegpt.costs.cost import AnalyticalCosts  # noqa: E402
from pipegpt.costs.devices import make_cluster  # noqa: E402
from pipegpt.costs.memory import plan_memory  # noqa: E402
from pipegpt.dims import Sharding  # noqa: E402
from pipegpt.planner.candidates import Request  # noqa: E402
from pipegpt.planner.search import search  # noqa: E402
from pipegpt.schedule import SCHEDULES, build_plan  # noqa: E402
from pipegpt.stages import partition_layers  # noqa: E402

GPT3 = ModelConfig(vocab_size=51200, seq_len=2048, n_layer=96, n_head=96, n_embd=12288)


def case_search() -> tuple[int, str]:
    cluster = make_cluster(1000, 8, "a100-80gb")
    res = search(Request(GPT3, 1536, cluster, AnalyticalCosts(cluster), top=5))
    layout = res.best[0].layout
    return 1, (f"{res.stats['layouts']} layouts, {res.stats['simulated']} simulated; best "
               f"{layout.dp} x {layout.pp} x {layout.tp} {layout.schedule}")


def case_plan_memory() -> tuple[int, str]:
    gpt2 = dataclasses.replace(MODEL_PRESETS["gpt2-medium"], pad_vocab_to=64)
    calls = 0
    for schedule in ("1f1b", "zb-h1", "zbv"):
        for p in (2, 4, 8):
            plan = build_plan(schedule, p, 16)
            counts = [len(r) for r in partition_layers(gpt2.n_layer, plan.num_stages)]
            for tp in (1, 2, 4):
                for recompute in ("none", "selective", "full"):
                    for b in (1, 2, 4, 8):
                        plan_memory(gpt2, plan, counts, microbatch_size=b, sharding=Sharding(dp=2, tp=tp, zero=True),
                                    recompute=recompute, precision="bf16")
                        calls += 1
    return calls, "calls"


def _placement(schedule: str, ranks: int) -> tuple[int, ...]:
    spec = SCHEDULES[schedule]
    return spec.stage_to_rank(ranks, 2 if spec.takes_virtual_stages else None)


def case_balance() -> tuple[int, str]:
    methods = [balance([0.7] * 100, 0.2, 5.0, _placement(schedule, ranks)).method
               for schedule, ranks in (("1f1b", 64), ("interleaved-1f1b", 32), ("zbv", 32))]
    methods.append(balance([1 + (i % 3) / 10 for i in range(100)], 0.2, 5.0, _placement("1f1b", 32)).method)
    return len(methods), "balances (" + ", ".join(methods) + ")"


CASES = {"search": case_search, "plan_memory": case_plan_memory, "balance": case_balance}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"among {', '.join(CASES)}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the least time is shown")
    args = ap.parse_args(argv)
    print(f"{'case':12} {'seconds':>8} {'per item ms':>12}  what")
    for name in args.cases.split(","):
        if name not in CASES:
            sys.exit(f"unknown case {name!r}: choose among {', '.join(CASES)}")
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            items, what = CASES[name]()
            times.append(time.perf_counter() - start)
        best = min(times)
        print(f"{name:12} {best:8.2f} {1000 * best / items:12.2f}  {items} {what}")


if __name__ == "__main__":
    main()
