"""ZeRO 0-3: what a rank holds and how long a step takes, beside torch's FSDP2 under torch.distributed.pipelining.

    python benchmarks/bench_zero.py                       # bytes at dp 2 x pp 2 and dp 4; step time at dp 2 x pp 2
    python benchmarks/bench_zero.py --steps 10 --n-embd 256

Bytes: per rank, after a step, the parameters, gradients and Adam moments a rank holds, counted from the
storages of its flat buffers and optimizer state (Worker.describe's held_bytes), beside the planner's count of
what stays between steps (pipegpt.costs.memory.state_bytes(between_steps=True)) and its count at the step's
peak. Step time: the median over the steps after the first two of each ZeRO level, the levels interleaved over
--repeats rounds, each layout in a fresh set of processes (torch.distributed.rpc initialises once per process).
Beside them, interleaved in each round: torch.distributed.pipelining's Schedule1F1B (pipegpt's default schedule
here is 1f1b) with FSDP2 at the same dp 2 x pp 2, as torchtitan runs it (fully_shard per block and per stage,
reshard_after_forward=False, force-sum reduction on gloo): benchmarks/fsdp_pipeline.py. Its first round checks
that it trains as pipegpt does: its step-1 loss against pipegpt's and its parameters after step 1 against one
AdamW step of the one-process model.
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
    times, losses = [], []
    with Job(cfg, threads_per_worker=1) as job:
        job.start()
        for step in range(spec["steps"]):
            t0 = time.perf_counter()
            results = job.step(step)
            times.append(time.perf_counter() - t0)
            per_microbatch = [v for r in results for v in r.losses]
            losses.append(sum(per_microbatch) / len(per_microbatch))
        described = job.call("describe")
        job.close()
    return {"held": [d.get("held_bytes") for d in described], "times": times, "losses": losses,
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


FSDP2 = "FSDP2"  # the torch side's key beside pipegpt's zero levels


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
        spec = json.loads(args.one)
        if spec.get("side") == "fsdp2":
            import fsdp_pipeline

            print(json.dumps(fsdp_pipeline.measure(spec)))
        else:
            print(json.dumps(measure(spec)))
        return
    base = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": args.seq_len,
            "m": args.microbatches, "mbs": args.microbatch_size, "steps": args.steps}
    busy0, total0 = _cpu_jiffies()
    rows, fsdp_first, losses, fsdp_pipeline_times = [], None, {}, []
    times: dict[int | str, list[float]] = {z: [] for z in (*range(4), FSDP2)}
    for repeat in range(args.repeats):
        for dp, pp in ((2, 2), (4, 1)) if repeat == 0 else ((2, 2),):
            sides = [*range(4), FSDP2] if (dp, pp) == (2, 2) else list(range(4))
            for zero in sides[repeat % len(sides):] + sides[:repeat % len(sides)]:  # each round starts elsewhere
                spec = {**base, "dp": dp, "pp": pp, "zero": 3 if zero == FSDP2 else zero}
                if zero == FSDP2:
                    spec.update(side="fsdp2", check=repeat == 0)
                got = run_child(spec)
                if dp == 2 and pp == 2:
                    times[zero] += got["times"][2:]
                    losses.setdefault(zero, got["losses"])
                if zero == FSDP2:
                    fsdp_first = fsdp_first or got
                    fsdp_pipeline_times += got["pipeline_times"][2:]
                if repeat == 0:
                    rows.append((spec, got, planned(spec)))
                print(f"measured dp {dp} x pp {pp} {zero if zero == FSDP2 else f'zero {zero}'} "
                      f"(round {repeat + 1})", file=sys.stderr)
    busy1, total1 = _cpu_jiffies()
    print(f"GPT-2 shape: {args.n_layer} layers, width {args.n_embd}, vocab 256, seq {args.seq_len}; "
          f"{args.microbatches} x {args.microbatch_size} sequences per replica, fp32, CPU gloo, 1 thread per rank")
    print("\nKiB per rank after a step, from the storages (measured) beside the planner (between steps; at the "
          "step's peak in brackets)")
    print(f"{'layout':<16}{'zero':>7}{'rank':>5}{'params':>9}{'planned':>16}{'grads':>9}{'planned':>16}"
          f"{'Adam':>9}{'planned':>16}")
    for spec, got, plan in rows:
        for rank, held in enumerate(got["held"][:spec["pp"]]):  # replica 0's pipeline ranks; the others alike
            p = plan[rank]
            cells = []
            for k, part in enumerate(("parameters", "gradients", "optimizer")):
                cells += [f"{kib(held[part]):>9}", f"{kib(p['rest'][k]) + ' (' + kib(p['peak'][k]) + ')':>16}"]
            zero = "FSDP2" if spec.get("side") == "fsdp2" else spec["zero"]  # planned: as zero 3, --unshard step
            print(f"{'dp %d x pp %d' % (spec['dp'], spec['pp']):<16}{zero:>7}{rank:>5}" + "".join(cells))
    print(f"\nstep time at dp 2 x pp 2 (1f1b), median of steps 3..{args.steps} over {args.repeats} rounds (each a "
          f"fresh job; pipegpt's levels and FSDP2 interleaved, each round's order rotated); mean loss of steps 1 and "
          f"{args.steps}")
    base_ms = statistics.median(times[0])
    for zero, ts in times.items():
        name = "torch pipelining + FSDP2" if zero == FSDP2 else f"pipegpt zero {zero}"
        print(f"  {name:<25}{1e3 * statistics.median(ts):8.1f} ms  x{statistics.median(ts) / base_ms:5.2f}   "
              f"(min {1e3 * min(ts):.1f}, max {1e3 * max(ts):.1f})   loss {losses[zero][0]:.6f} -> "
              f"{losses[zero][-1]:.4f}")
    print(f"  (FSDP2: {1e3 * statistics.median(fsdp_pipeline_times):.1f} ms of its median step inside "
          f"schedule.step, the rest the tied-gradient sum, clipping and AdamW over DTensor shards)")
    check = fsdp_first["check"]
    print(f"FSDP2 check, step 1: loss {check['loss']:.7f} (pipegpt zero 0: {losses[0][0]:.7f}, one process: "
          f"{check['ref_loss']:.7f}); gradient norm {check['norm']:.6f} (one process {check['ref_norm']:.6f}); "
          f"{check['tensors']} parameters against one AdamW step of the one-process model: max |diff| "
          f"{check['max_diff']:.1e} where the gradient carries signal, {check['max_diff_noise']:.1e} elsewhere "
          f"(lr {check['lr']:g}): " + ("equal within fp32 tolerance" if check["ok"] else f"DIFFERENT: {check['bad']}"))
    others = (busy1 - busy0) / max(1, total1 - total0)
    print(f"machine CPU busy while measuring: {100 * others:.0f}% of all cores (this benchmark's ranks included: "
          f"the machine is shared, absolute times move with its load)")
    if not check["ok"]:
        raise SystemExit("FSDP2 does not train as the one-process model: its comparison above is not a fair one")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
