"""ZeRO 0-3: what a rank holds and how long a step takes.

    python benchmarks/bench_zero.py                       # bytes at dp 2 x pp 2 and dp 4; step time at dp 2 x pp 2
    python benchmarks/bench_zero.py --steps 10 --n-embd 256

Bytes: per rank, after a step, the parameters, gradients and Adam moments a rank holds, counted from the
storages of its flat buffers and optimizer state (Worker.describe's held_bytes), beside the planner's count of
what stays between steps (pipegpt.costs.memory.state_bytes(between_steps=True)) and its count at the step's
peak. Step time: the median over the steps after the first two of each ZeRO level, the levels interleaved over
--repeats rounds, each layout in a fresh set of processes (torch.distributed.rpc initialises once per process).
CPU gloo: on a shared machine the absolute times move with the load; the last line says how much CPU others
took meanwhile.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def measure(spec: dict) -> dict:
    """In a child process: `steps` steps of the layout, then every rank's held bytes and the step times."""
    import time

    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.train.driver import Job

    model = ModelConfig(vocab_size=256, seq_len=spec["seq_len"], n_layer=spec["n_layer"], n_head=spec["n_head"],
                        n_embd=spec["n_embd"])
    cfg = TrainConfig.build(model, dp=spec["dp"], stages=spec["pp"], zero=spec["zero"], microbatches=spec["m"],
                            microbatch_size=spec["mbs"], steps=spec["steps"], device="cpu", timeout_s=120)
    times = []
    with Job(cfg, threads_per_worker=1) as job:
        job.start()
        for step in range(spec["steps"]):
            t0 = time.perf_counter()
            job.step(step)
            times.append(time.perf_counter() - t0)
        described = job.call("describe")
        job.close()
    return {"held": [d.get("held_bytes") for d in described], "times": times,
            "stages": [d["stages"] for d in described]}


def planned(spec: dict) -> list[dict]:
    """The planner's bytes per pipeline rank: between steps and at the peak."""
    from pipegpt.config import ModelConfig
    from pipegpt.costs.memory import state_bytes
    from pipegpt.dims import Sharding
    from pipegpt.model.partition import partition_layers

    model = ModelConfig(vocab_size=256, seq_len=spec["seq_len"], n_layer=spec["n_layer"], n_head=spec["n_head"],
                        n_embd=spec["n_embd"])
    layers = [len(r) for r in partition_layers(model.n_layer, spec["pp"])]
    out = []
    for r in range(spec["pp"]):
        stages = [(layers[r], r == 0, r == spec["pp"] - 1)]
        sharding = Sharding(dp=spec["dp"], pp=spec["pp"], zero=spec["zero"])
        rest, peak = (state_bytes(model, stages, sharding=sharding, between_steps=b) for b in (True, False))
        out.append({"rest": (rest.weights, rest.gradients, rest.optimizer),
                    "peak": (peak.weights, peak.gradients, peak.optimizer)})
    return out


def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                         timeout=1200)
    if out.returncode:
        raise SystemExit(f"{spec}: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4, help="per replica")
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    base = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": args.seq_len,
            "m": args.microbatches, "mbs": args.microbatch_size, "steps": args.steps}
    busy0, total0 = _cpu_jiffies()
    rows = []
    times: dict[int, list[float]] = {z: [] for z in range(4)}
    for repeat in range(args.repeats):
        for dp, pp in ((2, 2), (4, 1)) if repeat == 0 else ((2, 2),):
            for zero in range(4):
                spec = {**base, "dp": dp, "pp": pp, "zero": zero}
                got = run_child(spec)
                if dp == 2 and pp == 2:
                    times[zero] += got["times"][2:]
                if repeat == 0:
                    rows.append((spec, got, planned(spec)))
                print(f"measured dp {dp} x pp {pp} zero {zero} (round {repeat + 1})", file=sys.stderr)
    busy1, total1 = _cpu_jiffies()
    print(f"GPT-2 shape: {args.n_layer} layers, width {args.n_embd}, vocab 256, seq {args.seq_len}; "
          f"{args.microbatches} x {args.microbatch_size} sequences per replica, fp32, CPU gloo, 1 thread per rank")
    print("\nKiB per rank after a step, from the storages (measured) beside the planner (between steps; at the "
          "step's peak in brackets)")
    print(f"{'layout':<16}{'zero':>5}{'rank':>5}{'params':>9}{'planned':>16}{'grads':>9}{'planned':>16}"
          f"{'Adam':>9}{'planned':>16}")
    for spec, got, plan in rows:
        for rank, held in enumerate(got["held"][:spec["pp"]]):  # replica 0's pipeline ranks; the others alike
            p = plan[rank]
            cells = []
            for k, part in enumerate(("parameters", "gradients", "optimizer")):
                cells += [f"{kib(held[part]):>9}", f"{kib(p['rest'][k]) + ' (' + kib(p['peak'][k]) + ')':>16}"]
            print(f"{'dp %d x pp %d' % (spec['dp'], spec['pp']):<16}{spec['zero']:>5}{rank:>5}" + "".join(cells))
    print(f"\nstep time at dp 2 x pp 2 (1f1b), median of steps 3..{args.steps} over {args.repeats} rounds "
          f"(each zero level a fresh job; levels interleaved)")
    for zero, ts in times.items():
        print(f"  zero {zero}: {1e3 * statistics.median(ts):8.1f} ms   (min {1e3 * min(ts):.1f}, "
              f"max {1e3 * max(ts):.1f})")
    others = (busy1 - busy0) / max(1, total1 - total0)
    print(f"machine CPU busy while measuring: {100 * others:.0f}% of all cores (this benchmark's ranks included: "
          f"the machine is shared, absolute times move with its load)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
