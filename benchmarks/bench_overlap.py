"""An MoE model with ep 2 x pp 2 on CPU: its pairs overlapped (--overlap on) against the same schedule without pairs
(--overlap off), measured beside the simulator's prediction of both.

    .venv/bin/python benchmarks/bench_overlap.py                        # dualpipev, 3 rounds of 6 steps
    .venv/bin/python benchmarks/bench_overlap.py --schedule 1f1b-overlap --rounds 5 --steps 10
    .venv/bin/python benchmarks/bench_overlap.py --run-args '--n-embd 256 --seq-len 128'   # more to exchange

Each round runs `pipegpt run --model tiny-moe --stages 2 --dp 2 --ep 2` (8 gloo processes' worth of work on 4
ranks, one thread each) with --overlap on and off, which goes first alternating; a cell is the median of every
step but each run's first. The all-to-all's share of the step is measured against a run with --ep 1 (same
tokens per rank and the same expert compute per rank on balanced loads, no exchange): share = 1 - ep1 / off.
The simulator is given costs F=1,B=2,W=1 per rank with a2a set so that the all-to-all is that share of an
unpaired microbatch (F + B + W + 2 a2a), and predicts both; its seconds are scaled so that off's prediction is
off's measurement (the ratio on / off is what it predicts).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPEGPT = [sys.executable, "-m", "pipegpt"]


def step_times(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["step_time_s"]) for r in rows if "step_time_s" in r][1:]  # the first step: warm-up


def run(args, work: Path, name: str, *extra: str) -> list[float]:
    run_dir = work / name
    cmd = [*PIPEGPT, "run", "--model", "tiny-moe", "--stages", "2", "--dp", "2", "--schedule", args.schedule,
           "--microbatches", str(args.microbatches), "--microbatch-size", str(args.microbatch_size),
           "--steps", str(args.steps + 1), "--device", "cpu", "--threads-per-worker", "1", "--seed", "1",
           "--run-dir", str(run_dir), "--overwrite", *shlex.split(args.run_args), *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=1800)
    return step_times(run_dir)


def simulate(args, a2a: float, overlap: str) -> float:
    out = subprocess.run([*PIPEGPT, "simulate", "-s", args.schedule, "-p", "2", "-m", str(args.microbatches),
                          "--costs", f"F=1,B=2,W=1,a2a={a2a:.4f}", "--overlap", overlap, "--json"],
                         check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return float(json.loads(out.stdout)["makespan"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="dualpipev")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (one more is run and left out)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--run-args", default="", help="more `pipegpt run` options for every run, e.g. '--seq-len 256'")
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {"on": [], "off": [], "ep1": []}
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        work = Path(tmp)
        for k in range(args.rounds):
            order = ("on", "off") if k % 2 == 0 else ("off", "on")
            for overlap in order:
                times[overlap] += run(args, work, f"{overlap}-{k}", "--ep", "2", "--overlap", overlap)
            times["ep1"] += run(args, work, f"ep1-{k}", "--ep", "1", "--overlap", "off")
    on, off, ep1 = (statistics.median(times[k]) for k in ("on", "off", "ep1"))
    share = max(0.0, 1 - ep1 / off)
    a2a = 2 * share / (1 - share) if share < 1 else 0.0  # per rank's F=1: share = 2 a2a / (F + B + W + 2 a2a)
    sim_on, sim_off = simulate(args, a2a, "on"), simulate(args, a2a, "off")
    scale = off / sim_off
    print(f"tiny-moe, {args.schedule}, dp 2 x ep 2 x pp 2 on CPU (gloo, a thread per rank); m {args.microbatches} "
          f"x {args.microbatch_size} sequences; {args.rounds} rounds x {args.steps} steps, alternated")
    print(f"all-to-all share of an unpaired step: {share:.1%} (ep 1: {ep1 * 1e3:.0f} ms; simulated a2a={a2a:.3f} "
          f"per rank's F=1,B=2,W=1)")
    print(f"{'':14} {'measured ms':>12} {'predicted ms':>13}")
    print(f"{'overlap off':14} {off * 1e3:>12.0f} {sim_off * scale * 1e3:>13.0f}")
    print(f"{'overlap on':14} {on * 1e3:>12.0f} {sim_on * scale * 1e3:>13.0f}")
    print(f"{'on / off':14} {on / off:>12.3f} {sim_on / sim_off:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
