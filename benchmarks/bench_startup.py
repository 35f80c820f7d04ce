"""A 1-step tiny `pipegpt run` from the shell's point of view: workers forked from the preload server (one torch
import per driver) against workers spawned one interpreter each (PIPEGPT_WORKER_START=spawn, as before).

    .venv/bin/python benchmarks/bench_startup.py                       # 2 stages, 5 rounds alternated
    .venv/bin/python benchmarks/bench_startup.py --stages 4 --rounds 7

Each round runs both, in alternating order; the table gives medians of the wall time and of the CPU time of the
whole process tree (user + system, children included), and their ratio.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--vocab-size", "256"]  # and a layer a stage
STARTS = ("fork", "spawn")


def one_run(start: str, stages: int, run_dir: str) -> tuple[float, float]:
    """(wall s, CPU s of the process tree) of one `pipegpt run` with workers started this way."""
    env = {**os.environ, "PIPEGPT_WORKER_START": start}
    exe = str(Path(sys.executable).with_name("pipegpt"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([exe, "run", "--stages", str(stages), "--microbatches", str(stages), "--steps", "1",
                           "--n-layer", str(max(2, stages)), *TINY, "--run-dir", run_dir, "--overwrite"],
                          env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{start}: pipegpt run failed:\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    times: dict[str, list[tuple[float, float]]] = {s: [] for s in STARTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for start in (STARTS if r % 2 == 0 else STARTS[::-1]):
                times[start].append(one_run(start, args.stages, f"{tmp}/{start}"))
    med = {s: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for s, v in times.items()}
    print(f"1-step tiny run, {args.stages} stages, {args.rounds} rounds alternated, medians")
    print(f"| workers | wall s | CPU s (all processes) |\n|---|---:|---:|")
    for s in STARTS:
        print(f"| {'forked (preload server)' if s == 'fork' else 'spawned (one import each)'} | "
              f"{med[s][0]:.2f} | {med[s][1]:.2f} |")
    (fork_wall, fork_cpu), (spawn_wall, spawn_cpu) = med["fork"], med["spawn"]
    print(f"forked / spawned: wall x{fork_wall / spawn_wall:.2f}, CPU x{fork_cpu / spawn_cpu:.2f}")


if __name__ == "__main__":
    main()
