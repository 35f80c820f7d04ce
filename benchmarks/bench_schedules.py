"""Every schedule on one model, pipegpt's synthesized ones (auto, auto-v) included, beside
torch.distributed.pipelining's: tokens/s, the ratio to torch's fastest, predicted step time beside measured.

    .venv/bin/python benchmarks/bench_schedules.py                                  # the heavy-head model, 2 stages
    .venv/bin/python benchmarks/bench_schedules.py --vocab 4096,16384 --stages 2,4   # the whole table (~1.5 h on 2 cores)

The model is issue 17's: 8 layers, width 256, 8 heads, seq 256, microbatch 1, 16 microbatches, a core per rank
(threads = cores // stages). Every row is a fresh set of processes; rows are interleaved across repeats
(A B C .., A B C ..), so drift of the machine hits them alike. pipegpt rows run `pipegpt run` as a user does
(bench_pipeline.pipegpt_command), with `--balance cost` where the row says so; torch rows are bench_pipeline's
torch.distributed.pipelining contender (even split, the same model, batches, optimizer and clip). Where there
are as many cores as ranks, both sides pin each rank to a core of its own (--no-bind-cores: not).

predicted: for auto rows, the step compute the driver predicted before step 0 from the costs it measured
(`pipegpt: schedule auto ...: predicted compute X ms`); for every pipegpt row, also the last step's plan
simulated with costs calibrated from its own trace (`pipegpt simulate --trace`), beside the measured span.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline as bp  # noqa: E402  (the contenders, their specs and the torch worker)

FIXED = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"]
PIPEGPT_ROWS = [(s, "even") for s in FIXED + ["auto", "auto-v"]] + [("1f1b", "cost"), ("zb-h1", "cost"),
                                                                    ("auto", "cost"), ("auto-v", "cost")]
TORCH_ROWS = [s for s in FIXED if bp.TORCH_SCHEDULES.get(s)]
PREDICTED = re.compile(r"predicted compute ([0-9.]+) ms")
SPLIT = re.compile(r"balanced layers per stage ([0-9,]+)")
KEPT_ORDER = re.compile(r"schedule auto(?:-v)? = ([\w-]+)'s order")


def base_spec(args, stages: int, vocab: int) -> dict:
    from pipegpt.config import model_config

    model = model_config("tiny", n_layer=8, n_embd=256, n_head=8, seq_len=256, vocab_size=vocab)
    cores = os.cpu_count() or 1
    return {"preset": "tiny", "model": {k: getattr(model, k) for k in model.__dataclass_fields__},
            "stages": stages, "microbatches": args.microbatches, "microbatch_size": 1, "steps": args.steps,
            "warmup": args.warmup, "lr": 1e-3, "grad_clip": 1.0, "seed": 1337, "cores": cores,
            "threads_per_worker": max(1, cores // stages), "virtual_stages": None,
            # pinned where every rank gets a core of its own, both sides alike: runs spread less (README)
            "bind_cores": args.bind_cores and stages <= cores}


def run_pipegpt_row(spec: dict, balance: str, timeout: float) -> dict:
    workdir = tempfile.mkdtemp(prefix="bench-sched-")
    try:
        run_dir = os.path.join(workdir, "run")
        cmd = bp.pipegpt_command(spec, run_dir) + (["--balance", "cost"] if balance == "cost" else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)
        if proc.returncode != 0:
            raise RuntimeError(f"pipegpt run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line.strip()]
        found, split, kept = (rx.search(proc.stdout) for rx in (PREDICTED, SPLIT, KEPT_ORDER))
        sim = subprocess.run(bp.pipegpt_exe() + ["simulate", "--trace", run_dir, "--json"], capture_output=True,
                             text=True, timeout=timeout)
        trace = json.loads(sim.stdout) if sim.returncode == 0 else {}
        return {"step_times": [r["step_time_s"] for r in rows], "losses": [r["loss"] for r in rows],
                "wall_s": time.perf_counter() - t0,
                "predicted_ms": float(found.group(1)) if found else None,
                "split": split.group(1) if split else "even",
                "order": (kept.group(1) if kept else "written") if "--schedule auto" in " ".join(cmd) else "",
                "plan": plan_digest(Path(run_dir, "plan.txt")),
                "calibrated_ms": 1e3 * trace["predicted"]["makespan"] if "predicted" in trace else None,
                "span_ms": 1e3 * trace["measured"]["step_span"] if "measured" in trace else None}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def plan_digest(path: Path) -> str:
    """What every rank ran, whatever the schedule was called: the plan file's actions (its # lines name it)."""
    actions = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return hashlib.sha1("\n".join(actions).encode()).hexdigest()[:10]


def same_plan_as(label: str, results: dict) -> str:
    """For an auto row: the fixed row every one of whose runs ran the very plan, on the same split, that each
    of this row's runs ran."""
    ran = lambda rs: {(r.get("plan"), r.get("split")) for r in rs}  # noqa: E731
    mine = ran(results[label])
    for other, rs in results.items():
        if other.startswith("pipegpt") and "auto" not in other and rs and all(plan for plan, _ in mine) \
                and ran(rs) == mine:
            return f"; the plan {other.removeprefix('pipegpt ')} ran"
    return ""


def run_torch_row(spec: dict, timeout: float) -> dict:
    return bp.run_contender("torch", spec, timeout)


def refusal(spec: dict, schedule: str) -> str | None:
    return bp.check_schedule(spec, schedule)


def plans(rs: list[dict]) -> str:
    """Each repeat's layer split, and for auto rows the order it ran: 'written' by the synthesizer, or the name
    of the fixed schedule it kept because no written order was predicted faster."""
    return " ".join(sorted({f"{r['split']}" + (f" {r['order']}" if r.get("order") else "") for r in rs
                            if "split" in r}))


def table(stages: int, vocab: int, results: dict, warmup: int, tokens: int) -> list[list[str]]:
    # The median of the runs' medians: now and then a whole run is 15-20% slow, even pinned, and with runs of
    # one plan side by side that one run should not decide the row.
    medians = {label: statistics.median(statistics.median(r["step_times"][warmup:]) for r in rs)
               for label, rs in results.items() if rs}
    torch_best = min(((t, label) for label, t in medians.items() if label.startswith("torch")), default=(None, "-"))
    fixed_best = min(((t, label) for label, t in medians.items()
                      if label.startswith("pipegpt") and "auto" not in label), default=(None, "-"))
    rows = []
    for label, rs in results.items():
        if label not in medians:
            rows.append([f"p{stages} V{vocab}", label, "failed", "-", "-", "-", "-", "-", "-"])
            continue
        t = medians[label]

        def mid(key):
            values = [r[key] for r in rs if r.get(key) is not None]
            return f"{statistics.median(values):.0f}" if values else "-"
        rows.append([f"p{stages} V{vocab}", label, f"{tokens / t:,.0f}", f"{1e3 * t:.0f}",
                     f"x{torch_best[0] / t:.2f}" if torch_best[0] else "-",
                     f"x{fixed_best[0] / t:.2f}" if fixed_best[0] else "-", mid("predicted_ms"),
                     f"{mid('calibrated_ms')} / {mid('span_ms')}",
                     plans(rs) + (same_plan_as(label, results) if "auto" in label else "")])
    rows.append([f"p{stages} V{vocab}", f"(torch's fastest: {torch_best[1]}; pipegpt's fastest fixed: "
                                        f"{fixed_best[1]})", "", "", "", "", "", "", ""])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2", help="comma list [2]")
    ap.add_argument("--vocab", default="16384", help="comma list [16384]")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="leading steps left out: the first three run slower")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", default=None, help="only rows whose label contains one of these (comma list)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                    help="leave ranks unpinned (default: each rank on a core of its own where there are enough)")
    args = ap.parse_args(argv)
    wanted = [w.strip() for w in args.rows.split(",")] if args.rows else None
    out_rows = [["config", "row", "tokens/s", "step ms", "vs torch best", "vs pipegpt fixed best",
                 "predicted ms", "calibrated / span ms", "split / auto's order"]]
    everything = {}
    t_start = time.perf_counter()
    cpu_before = bp._cpu_accounting()
    for vocab in (int(v) for v in args.vocab.split(",")):
        for stages in (int(p) for p in args.stages.split(",")):
            base = base_spec(args, stages, vocab)
            jobs = []
            for schedule, balance in PIPEGPT_ROWS:
                label = f"pipegpt {schedule}" + (" --balance cost" if balance == "cost" else "")
                why = refusal(base, schedule)
                if why is None and (wanted is None or any(w in label for w in wanted)):
                    jobs.append((label, lambda s=schedule, b=balance: run_pipegpt_row(dict(base, schedule=s), b,
                                                                                     args.timeout)))
            for schedule in TORCH_ROWS:
                label = f"torch.pp {bp.TORCH_SCHEDULES[schedule]}"
                why = refusal(base, schedule)
                if why is None and (wanted is None or any(w in label for w in wanted)):
                    spec = dict(base, schedule=schedule, torch_schedule=bp.TORCH_SCHEDULES[schedule])
                    jobs.append((label, lambda sp=spec: run_torch_row(sp, args.timeout)))
            results = {label: [] for label, _ in jobs}
            for rep in range(args.repeats):
                for label, run in jobs:
                    try:
                        r = run()
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"  p{stages} V{vocab} {label}: FAILED {str(e).splitlines()[-1:]}", file=sys.stderr)
                        continue
                    results[label].append(r)
                    print(f"  p{stages} V{vocab} repeat {rep + 1}/{args.repeats} {label:<34} median step "
                          f"{1e3 * statistics.median(r['step_times'][args.warmup:]):8.1f} ms", file=sys.stderr,
                          flush=True)
            tokens = base["microbatches"] * base["microbatch_size"] * base["model"]["seq_len"]
            out_rows += table(stages, vocab, results, args.warmup, tokens)
            everything[f"p{stages}-V{vocab}"] = results
    from pipegpt.schedule.render import text_table

    print(f"8 layers, width 256, seq 256, microbatch 1, {args.microbatches} microbatches; {os.cpu_count()} cores, "
          f"threads per rank = cores // stages; {args.steps} steps per run, first {args.warmup} left out, "
          f"{args.repeats} repeats interleaved; median of the runs' medians; ranks pinned to a core each (both "
          f"sides) where there are as many cores as ranks" + ("" if args.bind_cores else " -- not in this run (--no-bind-cores)"))
    print(text_table(out_rows, right={2, 3, 4, 5, 6, 7}, rule=True))
    print(f"(wall {time.perf_counter() - t_start:.0f} s; vs torch best = torch's fastest schedule's step time / this "
          f"row's: > 1 is faster than torch)")
    print(bp._other_load(cpu_before, bp._cpu_accounting(), os.cpu_count() or 1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
