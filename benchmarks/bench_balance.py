"""Even vs cost-balanced stages with a heavy head: `pipegpt run --balance even` against `--balance cost`.

    .venv/bin/python benchmarks/bench_balance.py                      # vocab 16384, 8 layers, width 256, seq 256
    .venv/bin/python benchmarks/bench_balance.py --vocab-size 32768 --repeats 5 --json out.json

Each run is `pipegpt run ... --device cpu --run-dir TMP` as a user runs it (a fresh set of processes); the two
contenders alternate (even, cost, even, cost, ...) so slow drift of the machine hits them alike. Per run, the
step times of metrics.jsonl after `--warmup` steps; per contender, the median over every timed step of every
run, and the smallest and largest per-run median (the spread). A cost run also records the split it chose and
the costs it measured (config.json); the simulator's prediction for both splits with those costs (F = a third
of the measured forward + backward, B = 2F) is printed beside the measurement. Both contenders train the same
model from the same weights on the same batches: the losses printed must agree.

Columns: step ms (median), the run medians' range, tok/s, speedup (even's step time / this one's), busiest rank
ms (the largest per-rank compute time in the last step's measured timeline, trace.json: the quantity balancing
minimises), calibrated ms (that step's plan simulated with costs calibrated from its own trace, as `pipegpt
simulate --trace` does), simulated ms (the plan simulated from the measured per-layer costs alone).

The wall-clock gain needs a core per rank: with fewer cores than ranks (or other processes taking them) the ranks
time-share the cores, a step takes about the total work over the cores available, and moving work between ranks
changes little; the last line says how much CPU other processes took meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import _cpu_accounting, _other_load  # noqa: E402  (how much CPU others took meanwhile)

PIPEGPT = str(Path(sys.executable).with_name("pipegpt"))
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_USE_AGENT_STORE")


def one_run(args, balance: str, run_dir: Path) -> dict:
    before = _cpu_accounting()
    cmd = [PIPEGPT, "run", "--device", "cpu", "--balance", balance, "--schedule", args.schedule,
           "--stages", str(args.stages), "--microbatches", str(args.microbatches),
           "--microbatch-size", str(args.microbatch_size), "--steps", str(args.steps),
           "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
           "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size), "--run-dir", str(run_dir),
           "--log-every", str(args.steps)]
    if args.threads_per_worker:
        cmd += ["--threads-per-worker", str(args.threads_per_worker)]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and k != "PIPEGPT_FAULT"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    parallel = json.loads((run_dir / "config.json").read_text())["parallel"]
    timed = [m["step_time_s"] for m in metrics[args.warmup:]]
    after = _cpu_accounting()
    from pipegpt.schedule.calibrate import compare

    traced = compare(str(run_dir)).summary()  # the last step's measured timeline, and its plan simulated with
    # costs calibrated from it (what `pipegpt simulate --trace RUN_DIR` shows)
    wall, other = after[0] - before[0], max(0.0, (after[1] - before[1]) - (after[2] - before[2]))
    return {"balance": balance, "other_cpu_share": other / (wall * (os.cpu_count() or 1)), "step_times_s": timed, "median_s": statistics.median(timed),
            "layers": parallel["layers_per_stage"], "costs_s": parallel["balanced_costs"],
            "busy_ms": [b * 1e3 for b in traced["measured"]["busy_per_rank"]],
            "span_ms": traced["measured"]["step_span"] * 1e3, "calibrated_ms": traced["predicted"]["makespan"] * 1e3,
            "loss_first": metrics[0]["loss"], "loss_last": metrics[-1]["loss"],
            "tokens_per_step": args.microbatches * args.microbatch_size * args.seq_len}


def predicted(args, costs_s, layers) -> float:
    """The simulator's makespan (ms) of the plan with these per-layer costs and this split."""
    from pipegpt.costs.balance import LayerCosts
    from pipegpt.schedule import build_plan
    from pipegpt.schedule.simulate import Costs, simulate

    embed, block, head = (c / 3 * 1e3 for c in costs_s)  # F of each piece: F + B = 3F
    layer_costs = LayerCosts(embed, (block,) * args.n_layer, head)
    forward = layer_costs.stage_forward(layers)
    plan = build_plan(args.schedule, args.stages, args.microbatches)
    return float(simulate(plan, Costs(forward, [2 * f for f in forward], list(forward))).makespan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out of the timing")
    ap.add_argument("--repeats", type=int, default=3, help="runs per contender, alternating")
    ap.add_argument("--threads-per-worker", type=int, default=None)
    ap.add_argument("--json", default=None, help="write every measurement here")
    args = ap.parse_args()

    from pipegpt.costs.balance import even_layers

    print(f"{args.schedule}, {args.stages} stages x {args.microbatches} microbatches x {args.microbatch_size} "
          f"sequences x {args.seq_len} tokens; GPT {args.n_layer} layers, width {args.n_embd}, {args.n_head} heads, "
          f"vocabulary {args.vocab_size}; {args.steps} steps per run ({args.warmup} left out), {args.repeats} runs "
          f"per contender, alternating; CPU, {os.cpu_count()} cores", flush=True)
    runs: list[dict] = []
    start = _cpu_accounting()
    tmp = Path(tempfile.mkdtemp(prefix="bench_balance_"))
    try:
        for k in range(args.repeats):
            for balance in ("even", "cost"):
                run = one_run(args, balance, tmp / f"{balance}-{k}")
                runs.append(run)
                split = run["layers"] or even_layers(args.n_layer, args.stages)
                print(f"  run {k + 1} {balance:4s}: split {','.join(map(str, split))}  median step "
                      f"{run['median_s'] * 1e3:8.1f} ms  loss {run['loss_first']:.4f} -> {run['loss_last']:.4f}  "
                      f"(other processes: {run['other_cpu_share']:.0%} of the CPU); last step's compute per rank "
                      f"{', '.join(f'{b:.0f}' for b in run['busy_ms'])} ms", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    cost_runs = [r for r in runs if r["balance"] == "cost"]
    costs = [statistics.median(r["costs_s"][i] for r in cost_runs) for i in range(3)]
    splits = sorted({tuple(r["layers"]) for r in cost_runs})
    print(f"measured (median of the cost runs, forward + backward of one microbatch): embed {costs[0] * 1e3:.2f} ms, "
          f"block {costs[1] * 1e3:.2f} ms, head+loss {costs[2] * 1e3:.2f} ms; cost split(s) "
          f"{' / '.join(','.join(map(str, s)) for s in splits)}")
    rows, even_median = [], None
    for balance in ("even", "cost"):
        mine = [r for r in runs if r["balance"] == balance]
        steps = [t for r in mine for t in r["step_times_s"]]
        median = statistics.median(steps)
        even_median = even_median or median
        layers = list(splits[0]) if balance == "cost" else even_layers(args.n_layer, args.stages)
        busiest = statistics.median(max(r["busy_ms"]) for r in mine)
        rows.append([balance, ",".join(map(str, layers)), f"{median * 1e3:.1f}",
                     f"{min(r['median_s'] for r in mine) * 1e3:.1f}..{max(r['median_s'] for r in mine) * 1e3:.1f}",
                     f"{mine[0]['tokens_per_step'] / median:,.0f}", f"{even_median / median:.3f}", f"{busiest:.0f}",
                     f"{statistics.median(r['calibrated_ms'] for r in mine):.0f}",
                     f"{predicted(args, costs, layers):.0f}"])
    head = ["balance", "split", "step ms", "(run medians)", "tok/s", "speedup", "busiest rank ms",
            "calibrated ms", "simulated ms"]
    widths = [max(len(str(row[i])) for row in [head] + rows) for i in range(len(head))]
    for row in [head] + rows:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(_other_load(start, _cpu_accounting(), os.cpu_count() or 1))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
