"""Each traced step simulated at the costs calibrated from itself: does the simulator give back the step?

    .venv/bin/python benchmarks/bench_fidelity.py                        # 7 layouts x 6 steps, about a minute
    .venv/bin/python benchmarks/bench_fidelity.py --keep DIR             # keep the runs
    .venv/bin/python benchmarks/bench_fidelity.py --runs DIR             # read runs kept before (no new runs)

Every layout runs once (`pipegpt run --trace-steps all`); each of its steps after the first is calibrated from
its own trace and its plan simulated at those costs (`pipegpt simulate --trace RUN --trace-step N`). Fidelity is
the predicted makespan over the measured span of the step's actions. A step is its own reference, so the
machine's drift between runs and between steps (this 2-core machine's step times move 20-40% between runs of one
command) is out of the figure: what is left is what the simulator does not see. `--runs` reads the runs of an
earlier `--keep`, so two versions of the calibration can be compared on the same traces.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_plan_order import measure  # its model and batch, run as `pipegpt run` runs them

LAYOUTS = [(1, "1f1b", 8), (2, "gpipe", 8), (2, "1f1b", 4), (2, "1f1b", 8), (2, "zb-h1", 8),
           (2, "interleaved-1f1b", 8), (4, "1f1b", 8)]


def name(pp: int, schedule: str, m: int) -> str:
    return f"pp{pp}-{schedule}-m{m}"


def fidelities(run_dir: Path) -> list[float]:
    from pipegpt.schedule.calibrate import compare

    steps = sorted(int(p.stem.split("-")[1]) for p in (run_dir / "traces").glob("step-*.json"))
    return [compare(run_dir, step).fidelity for step in steps[1:]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=7, help="steps per run (the first left out) [7]")
    ap.add_argument("--keep", help="keep the runs in this directory")
    ap.add_argument("--runs", help="read the runs of an earlier --keep instead of running")
    args = ap.parse_args(argv)
    root = Path(args.runs or args.keep or tempfile.mkdtemp(prefix="bench_fidelity-"))
    rows = []
    for pp, schedule, m in LAYOUTS:
        run_dir = root / name(pp, schedule, m)
        if not args.runs:
            measure(run_dir, pp, schedule, m, args.steps, threads="default", traced=True)
        f = fidelities(run_dir)
        rows.append((name(pp, schedule, m), statistics.median(f), min(f), max(f), len(f)))
    print(f"{'layout':24s} {'median':>7s} {'least':>7s} {'most':>7s} steps")
    for layout, median, low, high, n in rows:
        print(f"{layout:24s} {median:7.3f} {low:7.3f} {high:7.3f} {n:5d}")
    every = [x for row in rows for x in row[2:4]]
    print(f"fidelity = predicted makespan / measured span, each step at its own calibrated costs; "
          f"over every layout's medians {min(r[1] for r in rows):.3f}-{max(r[1] for r in rows):.3f}, "
          f"every step {min(every):.3f}-{max(every):.3f}; runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
