"""How long the schedule synthesizer (auto, auto-v) takes and how good its plans are, p 4..64.

    .venv/bin/python benchmarks/bench_synthesize.py                      # p 4..64 at m = 4p, three cost sets
    .venv/bin/python benchmarks/bench_synthesize.py --sizes 8x32,32x64 --costs comm --repeat 3

Costs (a rank's share of the model, split over its stages, as `simulate --costs` does): unit is F=1, B=2, W=1;
comm adds a message latency of 0.2; head puts a head worth 4 blocks on the last stage (the tests' heavy head).
seconds is CPU time (time.process_time, the least of --repeat runs: the machine may be shared); makespan, lower
bound and gap are the synthesizer's; best fixed is the fastest fixed schedule of the placement within the same
memory limit.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipegpt.schedule.registry import SCHEDULES  # noqa: E402
from pipegpt.schedule.simulate import Costs  # noqa: E402

SIZES = [(4, 16), (8, 32), (16, 64), (32, 128), (64, 256)]
COSTS = {"unit": (0, 0), "comm": (0, 0.2), "head": (4, 0)}  # name -> (head blocks, comm latency)


def costs_for(name: str, p: int, cost_set: str) -> Costs:
    head_blocks, comm = COSTS[cost_set]
    stages = len(SCHEDULES[name].stage_to_rank(p))
    v = stages // p
    forward = [1 / v] * stages
    forward[-1] += head_blocks / v
    return Costs(tuple(forward), tuple(2 * f for f in forward), tuple(forward), comm)


def measure(name: str, p: int, m: int, cost_set: str, repeat: int) -> dict:
    costs = costs_for(name, p, cost_set)
    seconds = []
    for _ in range(repeat):
        start = time.process_time()
        syn = SCHEDULES[name].synthesize(p, m, None, costs)
        seconds.append(time.process_time() - start)
    return {"seconds": min(seconds), "makespan": float(syn.makespan), "bound": float(syn.lower_bound),
            "gap": syn.gap, "best_fixed": syn.best_fixed,
            "best_fixed_makespan": None if syn.best_fixed_makespan is None else float(syn.best_fixed_makespan)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(f"{p}x{m}" for p, m in SIZES), help="PxM list, e.g. 8x32,32x64")
    ap.add_argument("--costs", default=",".join(COSTS), help=f"cost sets among {', '.join(COSTS)}")
    ap.add_argument("--schedules", default="auto,auto-v")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row; the least CPU time is shown")
    args = ap.parse_args(argv)
    sizes = [tuple(int(x) for x in item.split("x")) for item in args.sizes.split(",")]
    print(f"{'schedule':8} {'p':>3} {'m':>4} {'costs':6} {'seconds':>8} {'makespan':>10} {'bound':>10} "
          f"{'gap':>6}  best fixed")
    for cost_set in args.costs.split(","):
        for p, m in sizes:
            for name in args.schedules.split(","):
                r = measure(name, p, m, cost_set, args.repeat)
                fixed = "-" if r["best_fixed"] is None else f"{r['best_fixed']} {r['best_fixed_makespan']:g}"
                print(f"{name:8} {p:3d} {m:4d} {cost_set:6} {r['seconds']:8.2f} {r['makespan']:10.4g} "
                      f"{r['bound']:10.4g} {100 * r['gap']:5.1f}%  {fixed}", flush=True)


if __name__ == "__main__":
    main()
