"""`pipegpt simulate`'s work: each schedule simulated into a record, the records as a summary or a comparison
table, the pictures, and (--trace) a run's measured timeline beside its plan simulated with calibrated costs.

Text goes out through `echo(text, err=False)` (the command passes click.echo), so the pictures' "wrote"
lines reach stderr as each file is written.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from numbers import Real
from typing import Callable

from pipegpt.config import ConfigError

from pipegpt.schedule import render
from pipegpt.schedule.actions import Kind, Plan, ScheduleError
from pipegpt.schedule.generators import DECODE_GROUPS, decode_plan
from pipegpt.schedule.registry import schedule_names, schedule_spec
from pipegpt.schedule.render import human_bytes
from pipegpt.schedule.schedule_file import check_against_file, load_schedule_file
from pipegpt.schedule.simulate import _ratio, costs_for_plan, simulate_matching

DEFAULT_COSTS = "F=1,B=2,W=1,comm=0"


@dataclass(frozen=True)
class SimulateOptions:
    """`pipegpt simulate`'s options, named as the command names them (None: not given)."""

    schedule: str | None = None
    stages: int | None = None
    microbatches: int | None = None
    costs_spec: str | None = None
    virtual_stages: int | None = None
    schedule_file: str | None = None
    trace_dir: str | None = None
    trace_step: int | None = None
    breakdown: bool = False  # with --trace: the whole step in its parts (pipegpt.observe.step_time)
    out: str | None = None
    as_json: bool = False
    no_chart: bool = False
    width: int | None = None
    layer_costs_spec: str | None = None
    n_layers: int | None = None
    balance: str | None = None
    max_live: int | None = None
    forward_only: bool = False
    decode_steps: int | None = None
    p2p_matching: str | None = None  # "tag" (None) or "order": how messages are matched (schedule/simulate.py)
    overlap: str | None = None  # "on" (None) or "off": a plan's pairs as one action each, or their halves apart


def simulate_command(opts: SimulateOptions, echo: Callable, read_layer_costs: Callable) -> None:
    """Simulate the schedules (or the schedule file, or the traced run) and echo what the options ask for.

    read_layer_costs(spec, n_layers) reads --layer-costs (pipegpt.costs.balance.parse_layer_costs: the
    planner sits above this package, so the command hands it in)."""
    if opts.trace_dir is not None:
        given = [flag for flag, value in (("--schedule", opts.schedule), ("--schedule-file", opts.schedule_file),
                                          ("--costs", opts.costs_spec), ("--virtual-stages", opts.virtual_stages),
                                          ("--layer-costs", opts.layer_costs_spec), ("--layers", opts.n_layers),
                                          ("--balance", opts.balance), ("--p2p-matching", opts.p2p_matching))
                 if value is not None]
        if given:
            raise ScheduleError(f"--trace simulates the run's own plan with costs calibrated from its trace; "
                                f"leave out {' and '.join(given)}")
        return simulate_trace(opts, echo)
    if opts.breakdown:
        raise ScheduleError("--breakdown breaks a traced step into its parts: give it with --trace RUN_DIR")
    if opts.trace_step is not None:
        raise ScheduleError("--trace-step N picks a traced step of a run: give it with --trace RUN_DIR")
    layer_costs = _layer_costs(opts, read_layer_costs)
    jobs = _jobs(opts)
    several = len(jobs) > 1

    def costs_of(plan):
        if layer_costs is None:
            return costs_for_plan(opts.costs_spec, plan), {}
        costs, split = layer_costs.plan_costs(plan, opts.balance or "even")
        return costs, {"layers_per_stage": split, "balance": opts.balance or "even"}

    records, timelines = [], []
    for name, make in jobs:
        try:
            plan, costs, extra = make(costs_of)
            if opts.overlap == "off":
                plan = plan.flattened()
            elif plan.has_composites:
                extra = {**extra, **overlap_record(plan, costs, opts.p2p_matching or "tag")}
            timeline = simulate_matching(plan, costs, opts.p2p_matching or "tag")
            peak = max(timeline.peak_live_microbatches_per_rank)
            if opts.max_live is not None and peak > opts.max_live:
                raise ScheduleError(f"peak live {peak} is above --max-live {opts.max_live}")
        except (ScheduleError, ConfigError) as e:  # ConfigError: the planner's, splitting the layer costs
            if not several:
                raise
            records.append({"schedule": name, "applies": False, "reason": " ".join(str(e).split())})
            timelines.append(None)
            continue
        matching = {"p2p_matching": opts.p2p_matching} if opts.p2p_matching == "order" else {}
        records.append({**record(plan, timeline, costs), **extra, **decode_record(plan, timeline), **matching})
        timelines.append(timeline)

    if opts.out is not None:
        for rec, timeline in zip(records, timelines):
            if timeline is not None:
                path = _out_path(opts.out, rec["schedule"], several)
                render.write(timeline, path)
                echo(f"wrote {path}", err=True)
    if opts.as_json:
        echo(json.dumps(records if several else records[0], indent=None))
    elif several:
        if layer_costs is not None:
            costs_text = (f"{len(layer_costs.blocks)} layers costing {opts.layer_costs_spec}, split "
                          f"{opts.balance or 'even'} per schedule")
        else:
            costs_text = (f"costs {opts.costs_spec or DEFAULT_COSTS} per rank's share of the model "
                          f"(v stages per rank: 1/v each)")
        matched = "; messages matched by order (NCCL)" if opts.p2p_matching == "order" else ""
        echo(f"{opts.stages} ranks, {opts.microbatches} microbatches; {costs_text}{matched}")
        echo(table(records))
    else:
        if not opts.no_chart:
            echo(render.ascii_gantt(timelines[0], width=opts.width))
        echo(summary_text(records[0]))


def _layer_costs(opts: SimulateOptions, read_layer_costs: Callable):
    """--layer-costs (with --layers, --balance) read, or None; the options' misfits refused."""
    if opts.layer_costs_spec is None:
        if opts.n_layers is not None or opts.balance is not None:
            raise ScheduleError(f"{'--layers' if opts.n_layers is not None else '--balance'} goes with "
                                f"--layer-costs (e.g. --layer-costs embed=0.1,block=1,head=3 --layers 8)")
        return None
    if opts.costs_spec is not None:
        raise ScheduleError("give --costs (the same F, B, W for every stage) or --layer-costs (each stage's "
                            "from its layers), not both")
    return read_layer_costs(opts.layer_costs_spec, opts.n_layers)


def _jobs(opts: SimulateOptions) -> list[tuple[str, Callable]]:
    """(name, a function making the plan) per schedule: the file's plan, or each generator's; with --forward-only
    their forwards alone (evaluation's plans); with --decode-steps generation's decode loop."""
    if opts.decode_steps is not None:
        return _decode_job(opts)
    jobs = _schedule_jobs(opts)
    if not opts.forward_only:
        return jobs

    def forwards(make):
        def make_forward_only(costs_of):
            plan, costs, extra = make(costs_of)
            return plan.compute_only().forward_only(), costs, extra
        return make_forward_only

    return [(f"{name}-forward", forwards(make)) for name, make in jobs]


def _decode_job(opts: SimulateOptions) -> list[tuple[str, Callable]]:
    """--decode-steps K: generation's plan for --stages ranks and --microbatches prompt groups."""
    given = [flag for flag, value in (("--schedule", opts.schedule), ("--schedule-file", opts.schedule_file),
                                      ("--virtual-stages", opts.virtual_stages), ("--max-live", opts.max_live))
             if value is not None]
    if given:
        raise ScheduleError(f"--decode-steps simulates generation's own order (each prompt group through every "
                            f"stage, step after step): leave out {' and '.join(given)}")
    if opts.stages is None or opts.microbatches is None:
        raise ScheduleError("--decode-steps needs --stages (pipeline ranks) and --microbatches (prompt groups)")
    plan = decode_plan(opts.stages, opts.microbatches, opts.decode_steps)
    return [(plan.name, lambda costs_of: (plan, *costs_of(plan)))]


def decode_record(plan: Plan, timeline) -> dict:
    """What a decode plan adds to its record: the steady state's bubble (a decode step late in the loop)."""
    if DECODE_GROUPS not in plan.meta:
        return {}
    per_rank = steady_state_bubble(timeline, plan)
    return {"decode_groups": plan.meta["decode_groups"], "decode_steps": plan.meta["decode_steps"],
            "steady_state_bubble": None if per_rank is None else float(sum(per_rank) / len(per_rank)),
            "steady_state_bubble_per_rank": None if per_rank is None else [float(b) for b in per_rank]}


def _schedule_jobs(opts: SimulateOptions) -> list[tuple[str, Callable]]:
    """(name, a function making the plan) per schedule: the file's plan, or each generator's."""
    if opts.schedule_file is not None:
        if opts.schedule is not None:
            raise ScheduleError("give either --schedule or --schedule-file, not both")
        if opts.virtual_stages is not None:
            raise ScheduleError("--virtual-stages does not apply to --schedule-file (the file fixes the stages)")
        if opts.max_live is not None:
            raise ScheduleError("--max-live is the memory limit auto and auto-v schedule to; a schedule file's "
                                "order is fixed: leave it out")
        plan = load_schedule_file(opts.schedule_file)
        check_against_file(plan, opts.schedule_file, opts.stages, opts.microbatches)
        return [(plan.name, lambda costs_of: (plan, *costs_of(plan)))]
    if opts.stages is None or opts.microbatches is None:
        raise ScheduleError("--stages and --microbatches are required (or give --schedule-file)")
    names = schedule_names(opts.schedule or "1f1b")
    if opts.max_live is not None and not any(schedule_spec(n).synthesized for n in names):
        raise ScheduleError(f"--max-live is the memory limit auto and auto-v schedule to; {', '.join(names)} "
                            f"{'is' if len(names) == 1 else 'are'} fixed: add auto or auto-v to --schedule")

    def job(name):
        spec = schedule_spec(name)
        # Among several schedules, --virtual-stages goes to those it applies to; alone, a misfit is an error.
        v = opts.virtual_stages if (spec.takes_virtual_stages or len(names) == 1) else None
        if not spec.synthesized:
            def make(costs_of):
                plan = spec.build(opts.stages, opts.microbatches, v)
                return (plan, *costs_of(plan))
            return make

        def synthesized(costs_of):  # the costs first (from the placement), then the plan written for them
            placement = spec.stage_to_rank(opts.stages, v)
            costs, extra = costs_of(Plan(name, opts.microbatches, placement, ((),) * opts.stages))
            synthesis = spec.synthesize(opts.stages, opts.microbatches, v, costs, opts.max_live,
                                        matching=opts.p2p_matching or "tag")
            return synthesis.plan, costs, {**extra, **synthesis_record(synthesis)}
        return synthesized

    return [(name, job(name)) for name in names]


def overlap_record(plan, costs, matching: str) -> dict:
    """What a plan's pairs gain: how many, and the makespan of the same order with each pair's halves apart
    (--overlap off), for `simulate` to show beside the paired one."""
    apart = simulate_matching(plan.flattened(), costs, matching).makespan
    return {"pairs": sum(a.kind is Kind.OVERLAP for acts in plan.ranks for a in acts),
            "makespan_without_pairs": float(apart)}


def synthesis_record(synthesis) -> dict:
    """What `simulate --json` adds for a synthesized schedule: its bound, the gap and the fixed one it beat."""
    plain = lambda x: None if x is None else float(x)  # noqa: E731
    return {"lower_bound": plain(synthesis.lower_bound), "gap": synthesis.gap, "max_live": synthesis.max_live,
            "best_fixed": synthesis.best_fixed, "best_fixed_makespan": plain(synthesis.best_fixed_makespan),
            "chosen_from": synthesis.plan.meta.get("from")}


def _out_path(out: str, name: str, several: bool) -> str:
    """Among several schedules each picture gets its own file: out.1f1b.svg."""
    if not several:
        return out
    stem, ext = os.path.splitext(out)
    return f"{stem}.{name}{ext}"


def record(plan, timeline, costs) -> dict:
    """One simulated schedule as `simulate --json` prints it."""
    s = timeline.summary()
    rec = {
        "schedule": plan.name,
        "applies": True,
        "stages": plan.num_ranks,
        "microbatches": plan.num_microbatches,
        "model_stages": plan.num_stages,
        "stage_to_rank": list(plan.stage_to_rank),
        "virtual_stages": plan.meta.get("virtual_stages", plan.num_stages // plan.num_ranks),
        "costs": {k: (list(map(float, v)) if isinstance(v, list) else float(v)) for k, v in costs.as_dict().items()},
    }
    rec.update({k: s[k] for k in ("makespan", "bubble_fraction", "bubble_fraction_per_rank", "busy_per_rank",
                                  "peak_live_microbatches_per_rank", "peak_activation_bytes_per_rank")})
    if plan.is_forward_only:  # nothing waits for a backward: a forward's activations go when it ends
        rec["peak_live_microbatches_per_rank"] = rec["peak_activation_bytes_per_rank"] = None
    rec["plan"] = plan.compute_only().as_strings()
    return rec


def summary_text(rec: dict) -> str:
    """One schedule's makespan, bubble, peak live microbatches (and bytes, and its layer split)."""
    pct = ", ".join(f"{100 * b:.1f}%" for b in rec["bubble_fraction_per_rank"])
    lines = [
        f"schedule {rec['schedule']}: {rec['stages']} ranks, {rec['model_stages']} stages, "
        f"{rec['microbatches']} microbatches",
        f"makespan          {rec['makespan']:g}",
        f"bubble            {100 * rec['bubble_fraction']:.1f}%  (per rank: {pct})",
    ]
    if rec.get("steady_state_bubble") is not None:
        lines.append(f"steady state      {100 * rec['steady_state_bubble']:.1f}% bubble  (decode step "
                     f"{rec['decode_steps'] - 2} of 1..{rec['decode_steps'] - 1}; {rec['decode_groups']} prompt "
                     f"groups in flight; step 0 is the prefill)")
    if rec["peak_live_microbatches_per_rank"] is None:
        lines.append("peak live         forward only: no activations are kept for a backward")
    else:
        lines.append("peak live         " + " ".join(map(str, rec["peak_live_microbatches_per_rank"]))
                     + "  stage-microbatches per rank")
    if rec["peak_activation_bytes_per_rank"] is not None:
        lines.append("peak activations  " + ", ".join(human_bytes(b) for b in rec["peak_activation_bytes_per_rank"]))
    if "lower_bound" in rec:
        fixed = (f"; best fixed schedule that fits: {rec['best_fixed']} {rec['best_fixed_makespan']:g}"
                 if rec["best_fixed"] else "; no fixed schedule of this placement fits")
        lines.append(f"lower bound       {rec['lower_bound']:g}  (gap {100 * rec['gap']:.1f}%; max live "
                     f"{rec['max_live']}{fixed})")
        if rec.get("chosen_from") not in (None, "synthesized"):
            lines.append(f"order             {rec['chosen_from']}'s (no synthesized order was faster)")
    if "makespan_without_pairs" in rec:
        apart = rec["makespan_without_pairs"]
        gain = f": pairs save {100 * (1 - rec['makespan'] / apart):.1f}%" if apart else ""
        lines.append(f"overlap           {rec['pairs']} pairs, each half's all-to-all under the other's compute; "
                     f"without pairs (--overlap off) {apart:g}{gain}")
    if rec.get("p2p_matching") == "order":
        lines.append("messages          matched by order (NCCL): each send leaves at its SEND, a batch completes "
                     "together, a run's sends after its last receive are a batch of their own")
    if "layers_per_stage" in rec:
        lines.append(f"layers per stage  {','.join(map(str, rec['layers_per_stage']))}  (balance {rec['balance']})")
    return "\n".join(lines)


def table(records: list[dict]) -> str:
    """Several schedules side by side; one that does not apply says why."""
    has_bytes = any(r.get("peak_activation_bytes_per_rank") for r in records)
    head = ["schedule", "makespan", "bubble", "peak live max/min"] + (["peak bytes max"] if has_bytes else []) \
        + ["applies"]
    rows = []
    for r in records:
        if not r["applies"]:
            rows.append([r["schedule"], "-", "-", "-"] + (["-"] if has_bytes else []) + ["no: " + r["reason"]])
            continue
        live = r["peak_live_microbatches_per_rank"] or ["-"]
        row = [r["schedule"], f"{r['makespan']:g}", f"{100 * r['bubble_fraction']:.1f}%",
               f"{max(live)}/{min(live)}" if live != ["-"] else "-"]
        if has_bytes:
            pb = r["peak_activation_bytes_per_rank"]
            row.append(human_bytes(max(pb)) if pb else "-")
        rows.append(row + ["yes" if "lower_bound" not in r
                           else f"yes (lower bound {r['lower_bound']:g}, gap {100 * r['gap']:.1f}%)"])
    return render.text_table([head] + rows, right=set(range(1, len(head))), free_last=True)


def simulate_trace(opts: SimulateOptions, echo: Callable) -> None:
    """`simulate --trace RUN_DIR`: the run's measured timeline beside its plan simulated with calibrated costs."""
    from pipegpt.schedule.calibrate import compare, comparison_text  # only --trace reads a run

    run_dir, out = opts.trace_dir, opts.out
    comparison = compare(run_dir, opts.trace_step)
    plan = comparison.plan
    check_against_file(plan, f"the run in {run_dir}", opts.stages, opts.microbatches)
    measured, predicted = comparison.measured, comparison.predicted
    span = max(measured.makespan, predicted.makespan)  # one time scale: a shorter prediction ends early
    text = comparison_text(comparison)
    if out is not None:
        stem, ext = os.path.splitext(out)
        if ext.lower() in (".html", ".htm"):
            html = render.to_html_side_by_side([("measured", measured), ("predicted", predicted)], text=text,
                                               title=f"{plan.name}: measured vs predicted ({run_dir})")
            _write_text(out, html)
            echo(f"wrote {out}", err=True)
        else:
            for name, timeline in (("measured", measured), ("predicted", predicted)):
                path = f"{stem}.{name}{ext}"
                if ext.lower() == ".svg":
                    _write_text(path, render.to_svg(timeline, span=span))
                else:
                    render.write(timeline, path)
                echo(f"wrote {path}", err=True)
    parts = step_parts(comparison, run_dir) if opts.breakdown else None
    if opts.as_json:
        echo(json.dumps({**comparison.summary(), **({"step": parts} if opts.breakdown else {})}))
        return
    if not opts.no_chart:
        for name, timeline in (("measured", measured), ("predicted (calibrated costs)", predicted)):
            echo(f"{name}:")
            echo(render.ascii_gantt(timeline, width=opts.width, span=span))
    echo(text)
    if opts.breakdown:
        echo("")
        echo(parts["text"])


def step_parts(comparison, run_dir: str) -> dict:
    """--breakdown: the traced step's parts beside their prediction (pipegpt.observe.step_time.step_report)."""
    from pipegpt.observe.step_time import step_report

    return step_report(comparison, run_dir)


def _write_text(path: str, text: str) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as e:
        raise ScheduleError(f"cannot write {path}: {e.strerror}") from None


def steady_state_bubble(timeline, plan: Plan) -> list[Real] | None:
    """Per rank, the idle share of one decode step late in the loop (its steady state): from the rank's start of
    step k's first group to its start of step k + 1's, k = steps - 2. None below 3 steps (step 0 is the prefill,
    so no decode step is both entered and left inside the loop)."""
    groups, steps = plan.meta.get(DECODE_GROUPS), plan.meta.get("decode_steps", 0)
    if not groups or steps < 3:
        return None
    k = steps - 2
    starts, busy = {}, [0] * timeline.num_ranks
    for e in timeline.events:
        if e.action.kind is not Kind.F:
            continue
        step, _ = divmod(e.action.microbatch, groups)
        if step == k:
            busy[e.rank] += e.end - e.start
        if step in (k, k + 1):
            starts[(e.rank, step)] = min(starts.get((e.rank, step), e.start), e.start)
    bubbles = []
    for r in range(timeline.num_ranks):
        period = starts[(r, k + 1)] - starts[(r, k)]
        bubbles.append(1 - _ratio(busy[r], period) if period else 0)
    return bubbles
