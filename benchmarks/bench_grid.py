"""Memory and speed of dp x pp x tp layouts: per-rank parameter and optimizer-state bytes, tokens/s.

    python benchmarks/bench_grid.py                 # the layouts that fit a small CPU machine
    python benchmarks/bench_grid.py --steps 8 --layouts 1x2x1,1x2x2,2x2x1:zero1

Each layout runs in its own process (torch.distributed.rpc initialises once per process), one after
another, on the same model and global batch. Bytes are exact (tensor sizes, not RSS); tokens/s is the
median over the steps after the first two.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = "1x2x1,1x2x1:zero1,1x2x2,2x2x1,2x2x1:zero1,2x1x2,2x2x2,2x2x2:zero1"


def parse_layout(text: str) -> dict:
    grid, _, option = text.partition(":")
    dp, pp, tp = (int(x) for x in grid.split("x"))
    return {"dp": dp, "stages": pp, "tp": tp, "zero": int(option == "zero1")}


def measure(layout: str, steps: int, microbatches: int, global_batch: int) -> dict:
    """Runs in a child process: train `steps` steps of the tiny model and describe every rank."""
    import time

    from pipegpt.config import TrainConfig, microbatch_size_for
    from pipegpt.train.driver import Job
    from pipegpt.observe.metrics import step_metrics

    layout_kw = parse_layout(layout)
    mbs = microbatch_size_for(global_batch, layout_kw["dp"], microbatches)
    cfg = TrainConfig.build(microbatches=microbatches, microbatch_size=mbs, steps=steps, device="cpu", **layout_kw)
    with Job(cfg) as job:
        job.start()
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            results = job.step(step)
            times.append(step_metrics(step, results, cfg, time.perf_counter() - t0).tokens_per_s)
        described = job.call("describe")  # after a step: Adam's state exists
        job.close()
    return {"layout": layout, "world": cfg.world_size, "tokens_per_s": statistics.median(times[2:] or times),
            "param_bytes": [d["parameter_bytes"] for d in described],
            "optim_bytes": [d["optimizer_state_bytes"] for d in described]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=LAYOUTS, help=f"comma list of DPxPPxTP[:zero1] (default {LAYOUTS})")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="global batch in sequences (same for every layout)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.microbatches, args.batch)))
        return
    rows = []
    for layout in args.layouts.split(","):
        with tempfile.TemporaryDirectory():
            out = subprocess.run([sys.executable, __file__, "--one", layout, "--steps", str(args.steps),
                                  "--microbatches", str(args.microbatches), "--batch", str(args.batch)],
                                 capture_output=True, text=True)
        if out.returncode:
            rows.append({"layout": layout, "error": (out.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"measured {layout}", file=sys.stderr)
    print(f"tiny GPT (4 layers, width 128, vocab 256, seq 64), global batch {args.batch} sequences, "
          f"{args.microbatches} microbatches per replica, {args.steps} steps (median of steps 3..), CPU gloo")
    print(f"{'layout dp x pp x tp':<22}{'ranks':>6}{'tokens/s':>10}{'params/rank KiB (max)':>23}"
          f"{'Adam state/rank KiB (max)':>27}")
    base = next((r for r in rows if "error" not in r), None)
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:<22} failed: {r['error']}")
            continue
        pb, ob = max(r["param_bytes"]) / 1024, max(r["optim_bytes"]) / 1024
        ratio = f" ({pb / (max(base['param_bytes']) / 1024):.2f}x, {ob / (max(base['optim_bytes']) / 1024):.2f}x)"
        print(f"{r['layout']:<22}{r['world']:>6}{r['tokens_per_s']:>10,.0f}{pb:>23,.0f}{ob:>27,.0f}{ratio}")
    print(f"(ratios: per-rank parameter and Adam-state bytes against {base['layout'] if base else '-'})")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
