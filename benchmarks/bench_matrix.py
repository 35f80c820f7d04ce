"""pipegpt against torch.distributed.pipelining over schedules x pipeline depths x microbatch counts, one table.

    .venv/bin/python benchmarks/bench_matrix.py                    # gpipe,1f1b,interleaved-1f1b,zbv x P=2,4 x M=8,16
    .venv/bin/python benchmarks/bench_matrix.py --schedules 1f1b --stages 4 --microbatches 16 --repeats 3

Each row is one (schedule, P, M): pipegpt and torch.pp run alternately (fresh processes each run, same model,
split, batches and weights; see bench_pipeline.py for how each contender is set up), `--repeats` times.
Per row:

  tok/s         median over the timed steps of every run
  x torch       pipegpt's tokens/s over torch.pp's: the median of the per-repeat ratios (runs side by side)
  floor         the same step's work done by one process on one thread (gradient accumulation over the same
                microbatches), divided by the machine's cores: no runtime on this machine can step faster
  of floor      floor / pipegpt's step time (1.00 = no overhead and no bubble left)
  RSS           the largest worker's peak RSS, pipegpt / torch.pp (MiB)
  fidelity      `pipegpt simulate --trace` on pipegpt's last step: predicted makespan / measured span
  loop us       the runtime loop's own time per action: the median gap between one action's end and the next one's start on a rank
  control       metrics.jsonl control_s: the step's time outside the slowest worker's step() (RPC round trip)
  CPU/rank      each worker process's CPU time over the step time (all its threads; 1.0 = one core)
  driver        the driver's CPU over the step time

This file's parent never imports torch: every contender runs in its own processes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # noqa: E402


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def timed(result: dict, warmup: int, key: str = "step_times") -> list:
    return result[key][warmup:]


def base_spec(args, cores: int, bind_cores: bool = False) -> tuple[dict, list[str]]:
    """bench_pipeline's spec of the model args name (n_layer, n_embd, n_head, seq_len, vocab_size; untied), with
    their microbatch size, steps, warmup and schedules (bench_pipeline.build_specs), and the schedules."""
    bench_args = argparse.Namespace(model="tiny", n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                                    seq_len=args.seq_len, vocab_size=args.vocab_size, untied=True, cores=cores,
                                    stages=2, microbatches=8, microbatch_size=args.microbatch_size,
                                    steps=args.steps, warmup=args.warmup, lr=6e-4, grad_clip=1.0, seed=1337,
                                    threads_per_worker=None, virtual_stages=None, schedules=args.schedules,
                                    schedule=None, bind_cores=bind_cores)
    return bp.build_specs(bench_args)


def floor_spec(base: dict, microbatches: int) -> dict:
    """The floor's run: the step's work (the same microbatches, optimizer and clip) in one process on one thread."""
    return dict(base, microbatches=microbatches, schedule=None, torch_schedule=None, single_threads=1)


def floor_seconds(runs: list[dict], warmup: int, cores: int, key: str = "step_times") -> float:
    """The floor: the one-thread runs' median (of `key`: the step, or its forward and backward) over the cores;
    no runtime on this machine can step faster."""
    return median([t for r in runs for t in timed(r, warmup, key)]) / cores


def row_figures(runs: dict[str, list[dict]], spec: dict, floor_s: float) -> dict:
    w = spec["warmup"]
    tokens = spec["microbatches"] * spec["microbatch_size"] * spec["model"]["seq_len"]
    step = {k: median([t for r in rs for t in timed(r, w)]) for k, rs in runs.items()}
    ratios = [median(timed(t, w)) / median(timed(p, w)) for p, t in zip(runs["pipegpt"], runs["torch"])]
    per_rank = lambda r, key: [median(col) for col in zip(*[v for v in timed(r, w, key) if v])]  # noqa: E731
    cpu = {k: [median(col) for col in zip(*[per_rank(r, "cpu_per_rank") for r in rs])] for k, rs in runs.items()}
    return {
        "tokens_per_s": {k: tokens / v for k, v in step.items()}, "step_s": step,
        "ratio": median(ratios), "ratio_range": (min(ratios), max(ratios)),
        "floor_s": floor_s, "of_floor": floor_s / step["pipegpt"],
        "peak_mib": {k: max(max(r["peak_memory_per_rank"]) for r in rs) / 2**20 for k, rs in runs.items()},
        "fidelity": median([r.get("fidelity") for r in runs["pipegpt"]]),
        "action_gap_us": median([r.get("action_gap_us") for r in runs["pipegpt"]]),
        "control_ms": 1000 * median([c for r in runs["pipegpt"] for c in timed(r, w, "control_s")]),
        "cpu_per_rank": cpu,
        "driver_cpu": median([c for r in runs["pipegpt"] for c in timed(r, w, "driver_cpu")]),
        "loss_last": {k: rs[0]["losses"][-1] for k, rs in runs.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zbv")
    ap.add_argument("--stages", default="2,4", help="pipeline depths P, comma-separated [2,4]")
    ap.add_argument("--microbatches", default="8,16", help="microbatch counts M, comma-separated [8,16]")
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", dest="json_out", default=None, help="also write every measurement to this file")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    base, schedules = base_spec(args, cores)
    depths = [int(x) for x in args.stages.split(",")]
    counts = [int(x) for x in args.microbatches.split(",")]
    m = base["model"]
    print(f"pipegpt vs torch.distributed.pipelining -- CPU, gloo, {cores} cores; model n_layer={m['n_layer']} "
          f"n_embd={m['n_embd']} n_head={m['n_head']} seq_len={m['seq_len']} vocab={m['vocab_size']} untied; "
          f"microbatch size {args.microbatch_size}; {args.steps} steps per run, the first {args.warmup} untimed; "
          f"{args.repeats} alternated repeats", flush=True)

    t_start, cpu_before = time.perf_counter(), bp._cpu_accounting()
    floors = {}
    for M in counts:  # the floor: the step's work on one thread, spread perfectly over the cores
        runs = [bp.run_contender("single", floor_spec(base, M), args.timeout) for _ in range(args.repeats)]
        floors[M] = floor_seconds(runs, args.warmup, cores)
        print(f"  floor M={M}: one thread {floors[M] * cores * 1000:.0f} ms / {cores} cores", file=sys.stderr, flush=True)

    rows, skipped = [], []
    for s in schedules:
        for P in depths:
            for M in counts:
                spec = dict(base, stages=P, microbatches=M, threads_per_worker=max(1, cores // P), schedule=s,
                            torch_schedule=bp.TORCH_SCHEDULES[s], analyse=True)
                why = bp.check_schedule(spec, s)
                if why or not bp.TORCH_SCHEDULES[s]:
                    skipped.append(f"{s} P={P} M={M}: {why or 'torch.distributed.pipelining has no counterpart'}")
                    continue
                runs: dict[str, list[dict]] = {"pipegpt": [], "torch": []}
                for rep in range(args.repeats):
                    for kind in runs:
                        r = bp.run_contender(kind, spec, args.timeout)
                        runs[kind].append(r)
                        print(f"  {s} P={P} M={M} repeat {rep + 1} {kind:<8} median step "
                              f"{1000 * median(timed(r, args.warmup)):7.1f} ms", file=sys.stderr, flush=True)
                rows.append(((s, P, M), row_figures(runs, spec, floors[M]), runs))

    head = ["schedule", "P x M", "tok/s pipegpt", "tok/s torch.pp", "x torch (range)", "floor ms", "of floor",
            "RSS MiB p/t", "fidelity", "loop us", "control ms", "CPU/rank pipegpt", "CPU/rank torch.pp", "driver"]
    table = [head]
    for (s, P, M), f, _ in rows:
        lo, hi = f["ratio_range"]
        table.append([s, f"{P} x {M}", f"{f['tokens_per_s']['pipegpt']:,.0f}", f"{f['tokens_per_s']['torch']:,.0f}",
                      f"{f['ratio']:.2f} ({lo:.2f}-{hi:.2f})", f"{1000 * f['floor_s']:.0f}", f"{f['of_floor']:.2f}",
                      f"{f['peak_mib']['pipegpt']:.0f}/{f['peak_mib']['torch']:.0f}", f"{f['fidelity']:.2f}",
                      f"{f['action_gap_us']:.0f}", f"{f['control_ms']:.1f}",
                      " ".join(f"{c:.2f}" for c in f["cpu_per_rank"]["pipegpt"]),
                      " ".join(f"{c:.2f}" for c in f["cpu_per_rank"]["torch"]), f"{f['driver_cpu']:.3f}"])
    from pipegpt.schedule.render import text_table

    print()
    print(text_table(table, right={2, 3, 5, 6, 8, 9, 10}, rule=True))
    for line in skipped:
        print(f"skipped {line}")
    ratios = [f["ratio"] for _, f, _ in rows]
    if ratios:
        print(f"\nx torch over all rows: median {median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f}; "
              f"losses agree: {all(abs(f['loss_last']['pipegpt'] - f['loss_last']['torch']) < 1e-3 for _, f, _ in rows)}")
    print(f"(total wall time {time.perf_counter() - t_start:.0f} s)")
    print(bp._other_load(cpu_before, bp._cpu_accounting(), cores))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": base, "floors": floors, "rows": [
            {"schedule": s, "stages": P, "microbatches": M, "figures": f, "runs": r} for (s, P, M), f, r in rows]},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
