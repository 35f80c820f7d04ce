"""The heavy-head model's pipelined step against the physical floor, and where the rest of the step goes.

    .venv/bin/python benchmarks/bench_floor.py                                      # 3 rounds, m 8 and 16
    .venv/bin/python benchmarks/bench_floor.py --rounds 1 --steps 5 --warmup 3 --microbatches 8

The model is issue 48's heavy head: 8 layers x 256, 4 heads, seq 256, vocabulary 16,384, untied, microbatch 1
(its head costs 4.4-5.3 blocks), 2 stages, a core per rank (pinned where there are as many cores as ranks;
--no-bind-cores: not). Contenders, alternated in every round, each a fresh set of processes:

  floor        bench_matrix's floor: the step's work (the same microbatches, optimizer and clip) in one process on
               one thread (bench_pipeline's one-process contender), its median step over the cores
  floor, every the same in as many processes at once as there are cores, each with its share of the
  core         microbatches (where they divide): the floor's compute with every core busy, as a pipeline's are
  auto         `pipegpt run --schedule auto --balance cost`
  --fixed      the fixed schedules (zb-h1), `--balance cost` as well

Per contender and microbatch count: the step (median of every run's timed steps) and of floor = floor / step (its
range: each round's floor run over that round's step).

The gap, per pipegpt row. Its timed steps are traced (--trace-steps); each step's time S (the driver's call, from
the trace's step parts: pipegpt.observe.step_time) splits into parts that sum to it, averaged over the traced steps:

  floor        Fc + Fo: the floor's forwards and backwards (Fc) and the rest of its step (Fo: zeroing, the batch,
               the clip and the optimizer), each over the cores
  (e) compute  Fc (e - 1), e = the ranks' mean compute / Fc. A rank's compute is its compute actions' time less
               each one's wait for its input from the other rank (inside the action: the runtime waits for a
               receive at the compute that reads it), the wait being from the action's start to the end of the
               action it depends on there. Two ranks on two cores compute slower than one process alone. In two:
               (e1) Fc (s - 1), s = the floor's compute with every core busy / Fc: the machine shared (memory,
               caches, clocks), which no runtime avoids; (e2) Fc (e - s): the ranks beyond that (gloo's and the
               driver's threads, the runtime's work inside an action)
  (a) split    Fc e (a - 1), a = the busiest rank's work over the mean rank's, for the run's split and the costs
               it measured before step 0 (config.json): --balance cost's split, the best of whole layers
  (b) bubble   Fc e a (b - 1), b = the plan (plan.txt) simulated with those costs: makespan / busiest rank's work
  (f) run's    P - Fc e a b, P = the plan replayed at the run's own compute times (each compute action's time
      costs    with its wait taken out, messages free): where the costs in the run differ from those measured
               before step 0 (a heavier head, the spread between microbatches and the interference that makes it)
  (c) runtime  A - P: the actions' measured span A beyond P: the runtime between actions (its loop, posting
               messages, each message's way to the other rank)
  (d) outside  S - A - Fo: the step outside the actions' span (the driver's round trip, the batch, the gradient
               sync, clip, optimizer) beyond the floor's own
  sum          floor + (e1) + (e2) + (a) + (b) + (f) + (c) + (d) = S

And a split finer than a layer, computed (no run does it): a's cap if a stage boundary could fall between a
block's attention and its MLP (each half's share of the block's cost from their FLOPs), or anywhere (a = 1), and
the of floor each would give with every other part as measured: how much of the gap the layer granularity holds.
Beside them the bound (Fc + Fo) / (Fc a b + Fo): of floor were the ranks to compute as fast as the floor, the run
to cost what its plan costs and the runtime and the rest of the step nothing beyond the floor's own; and zb-h1's
plan, simulated with each row's costs at 8 to 64 microbatches, with its bound (Fc scaled by the microbatches):
how far more microbatches move it.

This file's parent never imports torch: every contender runs in its own processes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_matrix as bm  # noqa: E402  (the model's spec and the floor)
import bench_pipeline as bp  # noqa: E402  (the contenders)

BOUND_MICROBATCHES = (8, 16, 32, 64)
GAP_PARTS = ("floor", "(e1) cores shared", "(e2) ranks", "(a) split", "(b) bubble", "(f) run's costs",
             "(c) runtime", "(d) outside")


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


# ----------------------------------------------------------------------------------------------------------
# the arithmetic (torch-free, no timing: tests/unit/test_bench_floor.py works it by hand)

def gap_parts(step: float, span: float, compute_span: float, floor_compute: float, floor_outside: float,
              inflation: float, cap: float, bubble: float, shared: float = 1.0) -> list[tuple[str, float]]:
    """The step S in parts that sum to it (the module's docstring): the floor (Fc + Fo), then (e1) Fc (s - 1),
    (e2) Fc (e - s), (a) Fc e (a - 1), (b) Fc e a (b - 1), (f) P - Fc e a b, (c) A - P, (d) S - A - Fo, where s is
    the floor's compute with every core busy over Fc (`shared`; 1 where not measured), A the actions' measured
    span and P the plan's span with the run's own compute times."""
    fc, e, a, b = floor_compute, inflation, cap, bubble
    return [("floor", fc + floor_outside), ("(e1) cores shared", fc * (shared - 1)),
            ("(e2) ranks", fc * (e - shared)), ("(a) split", fc * e * (a - 1)),
            ("(b) bubble", fc * e * a * (b - 1)), ("(f) run's costs", compute_span - fc * e * a * b),
            ("(c) runtime", span - compute_span), ("(d) outside", step - span - floor_outside)]


def split_cap(layer_costs: list[float], embed: float, head: float, stage_to_rank, layers=None) -> float:
    """The busiest rank's work over the mean rank's: for `layers` (blocks per stage), or the best split of
    these pieces (pipegpt.costs.balance, exact for one stage per rank)."""
    from pipegpt.costs.balance import balance, rank_loads

    if layers is None:
        layers = balance(layer_costs, embed, head, stage_to_rank).layers
    loads = rank_loads(layers, layer_costs, embed, head, stage_to_rank)
    return max(loads) / mean(loads)


def attention_share(model: dict) -> float:
    """A block's attention's share of the block's training FLOPs (nanoGPT's count, pipegpt.model.flops): its
    linears' 6 x weights plus the scores' and weighted sum's 12 x width x seq, against the MLP's 6 x weights."""
    from pipegpt.arch import block_linears
    from pipegpt.config import ModelConfig

    cfg = ModelConfig(**model)
    linears = block_linears(cfg)
    attention = 6 * sum(x.rows * x.cols for x in linears if x.name.startswith("attn.")) + \
        12 * cfg.attention_width * cfg.seq_len
    mlp = 6 * sum(x.rows * x.cols for x in linears if x.name.startswith("mlp."))
    return attention / (attention + mlp)


def finer_caps(block: float, embed: float, head: float, n_layer: int, share: float, stage_to_rank) -> dict:
    """a for the best split of whole layers, of half layers (a boundary between a block's attention, `share` of
    its cost, and its MLP), and of anything (1: the work halved exactly)."""
    halves = [x for _ in range(n_layer) for x in (share * block, (1 - share) * block)]
    return {"layers": split_cap([block] * n_layer, embed, head, stage_to_rank),
            "attention | MLP": split_cap(halves, embed, head, stage_to_rank), "anywhere": 1.0}


def without_waits(timeline, plan):
    """The timeline with each compute action's wait for its input from another rank taken out: it starts at the
    end of the action it depends on there, where that is later than its start (the runtime waits for a receive
    inside the compute that reads it)."""
    from dataclasses import replace

    from pipegpt.schedule.validate import dependencies

    ends = {e.action: e.end for e in timeline.compute_events()}
    events = []
    for e in timeline.events:
        if e.action.kind.is_compute:
            arrived = max((ends[d] for d in dependencies(e.action, plan)
                           if plan.stage_to_rank[d.stage] != e.rank and d in ends), default=e.start)
            e = replace(e, start=min(max(e.start, arrived), e.end))
        events.append(e)
    return replace(timeline, events=events)


def compute_span(plan, computing) -> float:
    """The plan replayed at each compute action's own time in a run (a timeline without waits), messages free:
    each rank's compute actions in plan order, each from when its rank is free and its inputs are done."""
    from pipegpt.schedule.validate import dependencies

    took = {e.action: e.end - e.start for e in computing.compute_events()}
    queues = [[a for a in actions if a.kind.is_compute] for actions in plan.ranks]
    ends, free, done = {}, [0.0] * len(queues), [0] * len(queues)
    moved = True
    while moved:
        moved = False
        for r, queue in enumerate(queues):
            while done[r] < len(queue) and all(d in ends for d in dependencies(queue[done[r]], plan)):
                action = queue[done[r]]
                start = max([free[r]] + [ends[d] for d in dependencies(action, plan)])
                ends[action] = free[r] = start + took[action]
                done[r], moved = done[r] + 1, True
    if done != [len(q) for q in queues]:
        raise ValueError(f"the plan's compute does not replay: stuck at {done} of {[len(q) for q in queues]}")
    return max(free)


def planned_factors(parallel: dict, plan, model: dict) -> dict:
    """From the costs the run measured before step 0 (config.json's "parallel"): a (its split's cap), b (its plan
    simulated: makespan / busiest rank's work) and a for finer splits."""
    from pipegpt.planner.run_plan import stage_costs_for
    from pipegpt.schedule import build_plan

    embed, block, head = parallel["balanced_costs"]
    layers = parallel["layers_per_stage"]
    # auto's nine numbers; a fixed schedule's split alone was measured: B = 2F, W = F, as run_plan.lowering_costs
    pieces = parallel.get("schedule_costs") or [x for t in (embed, block, head) for x in (t / 3, 2 * t / 3, t / 3)]
    costs = stage_costs_for(layers, pieces)
    return {"cap": split_cap([block] * sum(layers), embed, head, plan.stage_to_rank, layers),
            "bubble": bubble(plan, costs), "layers": list(layers), "head_blocks": head / block,
            "finer": finer_caps(block, embed, head, sum(layers), attention_share(model), plan.stage_to_rank),
            # zb-h1's bubble at more microbatches, for these costs: how far the bound moves with m
            "zb-h1 bubble by m": {m: bubble(build_plan("zb-h1", plan.num_ranks, m), costs)
                                  for m in BOUND_MICROBATCHES} if plan.num_stages == plan.num_ranks else {}}


def bubble(plan, costs) -> float:
    """The plan simulated with these costs: its makespan over the busiest rank's work."""
    from pipegpt.schedule.simulate import simulate

    timeline = simulate(plan, costs)
    return timeline.makespan / max(timeline.busy_per_rank)


# ----------------------------------------------------------------------------------------------------------
# a pipegpt run and its traced steps

def traced_step(run_dir: str, step: int) -> dict:
    """One traced step's figures: S, the actions' span A, the parts outside it, per rank compute, waits,
    message batches, gaps (idle within the span), clip and optimizer."""
    from pipegpt.run_files import read_measured_run
    from pipegpt.schedule import calibrate
    from pipegpt.schedule.schedule_file import load_schedule_file

    measured = read_measured_run(run_dir, step)
    plan = load_schedule_file(measured.plan_path)
    parts = calibrate.breakdown(measured.trace)
    timeline = calibrate.trace_timeline(measured.trace, plan)
    computing = without_waits(timeline, plan)
    compute = [float(x) for x in computing.busy_per_rank]
    per_rank = [parts.per_rank[r] for r in range(plan.num_ranks)]
    return {"step": parts.total, "span": parts.part(calibrate.ACTIONS), "compute_span": compute_span(plan, computing),
            "parts": dict(parts.parts), "compute": compute,
            "waits": [float(b) - c for b, c in zip(timeline.busy_per_rank, compute)],
            "messages": [r["messages"] for r in per_rank],
            "gaps": [r["idle"] for r in per_rank], "clip": [r.get(calibrate.CLIP, 0.0) for r in per_rank],
            "optimizer": [r.get(calibrate.OPTIMIZER, 0.0) for r in per_rank]}


def run_pipegpt(spec: dict, timeout: float) -> dict:
    """bench_pipeline's pipegpt contender with --balance cost and its timed steps traced; the run's figures."""
    from pipegpt.run_files import read_json
    from pipegpt.schedule.schedule_file import load_schedule_file

    workdir = tempfile.mkdtemp(prefix="bench-floor-")
    try:
        t0 = time.perf_counter()
        result = bp.run_pipegpt(spec, workdir, timeout)
        run_dir = os.path.join(workdir, "run")
        parallel = read_json(os.path.join(run_dir, "config.json"), "config")["parallel"]
        plan = load_schedule_file(os.path.join(run_dir, "plan.txt"))
        result["planned"] = planned_factors(parallel, plan, spec["model"])
        result["traced"] = [traced_step(run_dir, n) for n in range(spec["warmup"] + 1, spec["steps"] + 1)]
        result["wall_s"] = time.perf_counter() - t0
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_shared(spec: dict, cores: int, timeout: float) -> dict:
    """The floor's contender in `cores` processes at once, each on one thread with its share of the microbatches
    (spec's): per step, the slowest process's step and compute (the machine's step)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(cores) as pool:
        processes = list(pool.map(lambda _: bp.run_contender("single", spec, timeout), range(cores)))
    return {key: [max(times) for times in zip(*(r[key] for r in processes))]
            for key in ("step_times", "compute_times")}


def run_gap(run: dict, floor_compute: float, floor_outside: float, shared: float = 1.0) -> dict:
    """A run's gap parts (gap_parts over its traced steps' means) and the factors they came from."""
    steps = run["traced"]
    ranks = len(steps[0]["compute"])
    step, span, at_compute = (mean(s[k] for s in steps) for k in ("step", "span", "compute_span"))
    rank_compute = [mean(s["compute"][r] for s in steps) for r in range(ranks)]
    inflation = mean(rank_compute) / floor_compute
    planned = run["planned"]
    parts = gap_parts(step, span, at_compute, floor_compute, floor_outside, inflation, planned["cap"],
                      planned["bubble"], shared)
    per_rank = {k: [mean(s[k][r] for s in steps) for r in range(ranks)]
                for k in ("compute", "waits", "messages", "gaps", "clip", "optimizer")}
    outside = {k: mean(s["parts"].get(k, 0.0) for s in steps) for k in steps[0]["parts"]}
    return {"parts": dict(parts), "step": step, "span": span, "inflation": inflation,
            "cap": planned["cap"], "bubble": planned["bubble"], "measured_cap": max(rank_compute) / mean(rank_compute),
            "per_rank": per_rank, "outside": outside}


def bound(floor_compute: float, floor_outside: float, cap: float, bubble: float) -> float:
    """Of floor with no compute inflation, the run's costs as planned, no runtime and nothing outside the
    actions beyond the floor's own: (Fc + Fo) / (Fc a b + Fo)."""
    return (floor_compute + floor_outside) / (floor_compute * cap * bubble + floor_outside)


def finer_savings(gap: dict, planned: dict, floor_compute: float) -> dict:
    """What each finer split's a would take off the step, every other factor as measured: Fc e b (a - a')."""
    lost = floor_compute * gap["inflation"] * gap["bubble"]
    return {name: lost * (gap["cap"] - cap) for name, cap in planned["finer"].items()}


# ----------------------------------------------------------------------------------------------------------
# the parent: rounds of alternated contenders, the tables

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--microbatches", default="8,16", help="microbatch counts, comma-separated [8,16]")
    ap.add_argument("--fixed", default="zb-h1", help="fixed schedules beside auto, comma-separated [zb-h1]")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of alternated contenders [3]")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3, help="leading steps left out: the first ones run slower [3]")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                    help="leave ranks unpinned (default: a core each where there are as many cores as ranks)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", dest="json_out", default=None, help="also write every measurement to this file")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    cores = os.cpu_count() or 1
    args.schedules = ",".join(["auto"] + [s for s in args.fixed.split(",") if s])
    base, schedules = bm.base_spec(args, cores, bind_cores=args.bind_cores and 2 <= cores)
    counts = [int(x) for x in args.microbatches.split(",")]
    traced = ",".join(str(n) for n in range(args.warmup + 1, args.steps + 1))
    m = base["model"]
    print(f"the floor -- CPU, gloo, {cores} cores; model {m['n_layer']} x {m['n_embd']}, {m['n_head']} heads, seq "
          f"{m['seq_len']}, vocab {m['vocab_size']}, untied; microbatch {args.microbatch_size}; 2 stages, "
          f"{base['threads_per_worker']} thread(s) per rank{', pinned' if base['bind_cores'] else ''}; "
          f"{args.steps} steps per run, the first {args.warmup} untimed; {args.rounds} rounds alternated; "
          f"load average at the start {os.getloadavg()[0]:.1f}", flush=True)

    jobs = []
    for M in counts:
        jobs.append((("floor", M), "single", bm.floor_spec(base, M)))
        if cores > 1 and M % cores == 0:  # the floor's compute with every core busy (e1)
            jobs.append((("floor, every core", M), "shared", bm.floor_spec(base, M // cores)))
        for s in schedules:
            spec = dict(base, microbatches=M, schedule=s, extra_args=["--balance", "cost", "--trace-steps", traced])
            jobs.append(((f"{s} --balance cost", M), "pipegpt", spec))
    runs: dict = {key: [] for key, _, _ in jobs}
    t_start, cpu_before = time.perf_counter(), bp._cpu_accounting()
    for rnd in range(args.rounds):
        for key, kind, spec in jobs:
            try:
                r = run_pipegpt(spec, args.timeout) if kind == "pipegpt" else \
                    run_shared(spec, cores, args.timeout) if kind == "shared" else \
                    bp.run_contender(kind, spec, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # one failed run must not lose the others
                print(f"  round {rnd + 1} {key[0]} m={key[1]} FAILED: {str(e).splitlines()[-1:]}", file=sys.stderr)
                continue
            r["round"] = rnd
            runs[key].append(r)
            print(f"  round {rnd + 1}/{args.rounds} {key[0]:<24} m={key[1]:<3} median step "
                  f"{1e3 * statistics.median(r['step_times'][args.warmup:]):8.1f} ms", file=sys.stderr, flush=True)

    report = tables(runs, counts, args.warmup, cores)
    print()
    print(report["text"])
    print(f"(total wall time {time.perf_counter() - t_start:.0f} s)")
    print(bp._other_load(cpu_before, bp._cpu_accounting(), cores))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": base, "runs": {f"{k[0]} m{k[1]}": v
                                                                             for k, v in runs.items()},
                                                   "rows": report["rows"]}, indent=1))
    return 0


def tables(runs: dict, counts: list[int], warmup: int, cores: int) -> dict:
    """The tables' text, and their figures per row."""
    from pipegpt.schedule.render import text_table

    step_rows = [["contender", "m", "step ms", "of floor", "(rounds)", "split (the costs measured before step 0)"]]
    gap_rows = [["row", "m", "S ms"] + list(GAP_PARTS) + ["e / a / b", "a in the run"]]
    rank_rows = [["row", "m", "rank", "compute", "waits", "messages", "gaps", "clip", "optimizer"]]
    finer_rows = [["row", "m", "a: layers", "a: attention | MLP", "of floor", "with attention | MLP", "anywhere",
                   "bound: layers", "attention | MLP", "anywhere"]]
    by_m_rows = [["row", "m"] + [f"b / bound at m {m}" for m in BOUND_MICROBATCHES]]
    figures, notes = {}, []
    for M in counts:
        floors = runs.get(("floor", M)) or []
        if not floors:
            continue
        floor_s, floor_compute = (bm.floor_seconds(floors, warmup, cores, key)
                                  for key in ("step_times", "compute_times"))
        floor_by_round = {r["round"]: statistics.median(r["step_times"][warmup:]) / cores for r in floors}
        step_rows.append(["floor (one thread / cores)", M, f"{1e3 * floor_s:.0f}", "1.000", "", ""])
        shared_runs = runs.get(("floor, every core", M)) or []
        shared = bm.floor_seconds(shared_runs, warmup, 1, "compute_times") / floor_compute if shared_runs else 1.0
        notes.append(f"m {M}: the floor's compute, one process alone {1e3 * floor_compute:.0f} ms a core; "
                     + (f"{cores} processes at once, each with {M // cores} microbatches, "
                        f"{1e3 * floor_compute * shared:.0f} ms (x{shared:.3f}: (e1))" if shared_runs
                        else "with every core busy not measured ((e1) counted as 0)"))
        for (label, m), rs in runs.items():
            if m != M or label.startswith("floor") or not rs:
                continue
            step = statistics.median([t for r in rs for t in r["step_times"][warmup:]])
            ratios = [floor_by_round[r["round"]] / statistics.median(r["step_times"][warmup:])
                      for r in rs if r["round"] in floor_by_round]
            splits = sorted({",".join(map(str, r["planned"]["layers"])) for r in rs})
            heads = [r["planned"]["head_blocks"] for r in rs]
            step_rows.append([label, M, f"{1e3 * step:.0f}", f"{floor_s / step:.3f}",
                              f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-",
                              f"{' '.join(splits)}, head {min(heads):.2f}-{max(heads):.2f} blocks"])
            gaps = [run_gap(r, floor_compute, floor_s - floor_compute, shared) for r in rs]
            parts = {p: mean(g["parts"][p] for g in gaps) for p in GAP_PARTS}
            S = mean(g["step"] for g in gaps)
            f = {k: mean(g[k] for g in gaps) for k in ("inflation", "cap", "bubble", "measured_cap")}
            gap_rows.append([label, M, f"{1e3 * S:.0f}"]
                            + [f"{1e3 * parts[p]:.0f} ({100 * parts[p] / S:.1f}%)" for p in GAP_PARTS]
                            + [f"{f['inflation']:.3f} / {f['cap']:.3f} / {f['bubble']:.3f}",
                               f"{f['measured_cap']:.3f}"])
            for rank in range(len(gaps[0]["per_rank"]["compute"])):
                rank_rows.append([label, M, rank] + [f"{1e3 * mean(g['per_rank'][k][rank] for g in gaps):.1f}"
                                                     for k in ("compute", "waits", "messages", "gaps", "clip",
                                                               "optimizer")])
            saved = [finer_savings(g, r["planned"], floor_compute) for g, r in zip(gaps, rs)]
            caps = {k: mean(r["planned"]["finer"][k] for r in rs) for k in ("layers", "attention | MLP", "anywhere")}
            fo = floor_s - floor_compute
            bounds = {k: bound(floor_compute, fo, cap, f["bubble"]) for k, cap in caps.items()}
            finer_rows.append([label, M, f"{caps['layers']:.3f}", f"{caps['attention | MLP']:.3f}",
                               f"{floor_s / S:.3f}"]
                              + [f"{floor_s / (S - mean(x[k] for x in saved)):.3f}"
                                 for k in ("attention | MLP", "anywhere")]
                              + [f"{bounds[k]:.3f}" for k in caps])
            by_m = {n: mean(r["planned"]["zb-h1 bubble by m"].get(n, math.nan) for r in rs) for n in BOUND_MICROBATCHES}
            by_m_rows.append([label, M] + [f"{b:.3f} / {bound(floor_compute * n / M, fo, caps['layers'], b):.3f}"
                                           for n, b in by_m.items()])
            figures[f"{label} m{M}"] = {"step_s": step, "floor_s": floor_s, "floor_compute_s": floor_compute,
                                        "of_floor": floor_s / step, "of_floor_rounds": ratios, "gap": parts,
                                        "traced_step_s": S, **f, "shared": shared, "caps": caps, "bounds": bounds,
                                        "zb-h1 bubble by m": by_m}
    text = "\n\n".join([
        text_table(step_rows, right={1, 2, 3}, rule=True) + "\n" + "\n".join(notes),
        "where the step goes (ms, share of the step; means over the traced steps; the parts sum to S):\n"
        + text_table(gap_rows, right=set(range(1, len(gap_rows[0]))), rule=True),
        "per rank, from the traces (ms a step: compute less waits, waits inside compute, message batches, gaps "
        "within the actions' span, then clip and optimizer):\n" + text_table(rank_rows, right=set(range(1, 9)),
                                                                              rule=True),
        "a split finer than a layer (computed): a with a boundary between a block's attention and its MLP (their "
        "FLOPs); of floor now, with that a, with a = 1 (anywhere), every other part as measured; the bound "
        "(Fc + Fo) / (Fc a b + Fo) "
        "(compute as fast as the floor's, no runtime, nothing outside the actions) for each:\n"
        + text_table(finer_rows, right=set(range(1, len(finer_rows[0]))), rule=True),
        "zb-h1's plan with each row's costs at more microbatches: its bubble b and the bound, whole layers:\n"
        + text_table(by_m_rows, right=set(range(1, len(by_m_rows[0]))), rule=True)])
    return {"text": text, "rows": figures}


if __name__ == "__main__":
    sys.exit(main())
