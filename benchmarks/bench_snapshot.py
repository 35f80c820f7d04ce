"""What --snapshot-every 1 costs per step: `pipegpt run` with and without it, runs alternated, on CPU.

    .venv/bin/python benchmarks/bench_snapshot.py                      # 8 layers x 256 wide, 2 stages, 3 pairs
    .venv/bin/python benchmarks/bench_snapshot.py --n-layer 4 --n-embd 128 --repeats 5

Both arms run with --max-restarts 1 (snapshots need it; without a failure it does nothing). Per run: the median
step time after the first two steps, and with snapshots the median snapshot_s (the time until every rank had
copied its state; the writing into /dev/shm goes on in the background, during the next step). The table gives
the medians over the runs of each arm and the ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIPEGPT = REPO / ".venv" / "bin" / "pipegpt"


def one_run(args, snapshots: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [str(PIPEGPT), "run", "--stages", str(args.stages), "--microbatches", str(args.microbatches),
               "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--max-restarts", "1",
               "--run-dir", str(run_dir), "--log-every", "1000000"]
        if snapshots:
            cmd += ["--snapshot-every", "1"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
        return {"step_s": statistics.median(r["step_time_s"] for r in rows),
                "snapshot_s": statistics.median([r["snapshot_s"] for r in rows if r.get("snapshot_s")] or [0.0])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    arms = {False: [], True: []}
    for _ in range(args.repeats):
        for snapshots in (False, True):  # alternated: drifts in the machine's speed fall on both arms alike
            arms[snapshots].append(one_run(args, snapshots))
    plain = statistics.median(r["step_s"] for r in arms[False])
    snap = statistics.median(r["step_s"] for r in arms[True])
    copy = statistics.median(r["snapshot_s"] for r in arms[True])
    params = 12 * args.n_layer * args.n_embd ** 2  # blocks' weights; with Adam's two moments, 3x that in fp32
    print(f"{args.n_layer} layers x {args.n_embd}, {args.stages} stages x {args.microbatches} microbatches, "
          f"~{3 * 4 * params / 2**20:.0f} MiB of weights and moments in all; {args.repeats} runs per arm, "
          f"{args.steps} steps each (median after the first two)")
    print(f"{'':28}{'step':>10}{'copy (snapshot_s)':>20}")
    print(f"{'--max-restarts 1':28}{plain * 1e3:>8.1f}ms{'':>20}")
    print(f"{'  + --snapshot-every 1':28}{snap * 1e3:>8.1f}ms{copy * 1e3:>18.1f}ms")
    print(f"ratio {snap / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
