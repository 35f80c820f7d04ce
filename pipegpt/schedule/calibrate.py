"""Measured beside predicted: calibrate the simulator from a run and simulate the plan that run ran.

A `pipegpt run` leaves in its run directory plan.txt (the lowered plan every rank ran, in the
schedule-file format), trace.json (the last step's measured per-action timeline, a Chrome trace; the steps
`--trace-steps` named also as traces/step-N.json, which `--trace-step N` reads) and config.json.
pipegpt.run_files reads them; this module turns them into a measured timeline, fills a Costs from the measured
durations, simulates the same plan with it and compares the two timelines: fidelity = predicted makespan /
measured step span.

How the costs are calibrated (the simulator's meaning of each, measured where it can be seen):

* F, B, W of stage s: the mean measured duration of stage s's actions of that kind (a busy rank's step is
  the sum of its actions: n times their mean, which the median of a skewed spread under-states). In a trace
  the runtime recorded, each counts from the end of its rank's previous compute: the host's time between
  two computes (the message batches, the dispatch; a few tenths of a millisecond on a CPU) holds the rank
  as compute does, and the simulator has no other place for it. The runtime waits for a received input
  inside the compute that reads it: where the input's producer (the last action on another rank whose
  output it reads) ended after the rank was free, the compute counts from that end, or from its own start
  where later. That wait is the message's, except its last leg (from the producer's end to the arrival),
  which stays in the compute. In a simulation's trace a gap between computes is a wait, and each counts
  from its start. A stage whose backward is split gets B = mean(I) + mean(W) (the simulator runs I for
  B - W, W for W); W of a stage without W actions is B/2 (the simulator never uses it).
* The host's time per compute: the mean over computes of what F, B, W count before each compute's own start (0
  in a simulation's trace). Calibration.compute holds the costs without it: the planner scales those with
  tokens and threads, and charges the host's time once per action (pipegpt.costs.calibrated_costs.CalibratedCosts).
* comm: in the simulator, an action whose input comes from another rank can start `comm` after the
  producing action ended (a per-message latency; the receiver spends no time on it). So: on every
  cross-rank dependency (0F2 -> 1F2, 1B2 -> 0B2, ...) whose consumer's rank had finished its previous
  compute before the producer ended -- its start waited on that message -- take consumer start minus
  producer end (or its end less its calibrated duration, where later: a compute that waited inside); comm
  is the mean of those samples (a few messages wait far longer than most). This folds in all that lies
  between the two computes: the sender posting its SEND (the lowered plan may place it after later
  compute), the transfer, the receiver waking up. No such dependency (one rank, or no rank ever waited): comm = 0.
* A REDUCE_GRAD's event (with data parallelism) is its launch, not the reduction: it is left out of the
  measured timeline, so it calibrates nothing (dp_comm stays 0) and the step span stays the pipeline's.

What the simulator does not model shows up as a fidelity away from 1: skew between the ranks' starts, the
spread of the actions around their means, and a message delayed by its sender's compute. Ranks on different
machines have different clocks (perf_counter), so cross-rank gaps, and with them comm, are only meaningful for
a trace from one machine.

With data or tensor parallelism the trace holds every global rank; the pipeline of dp index 0, tp
index 0 is read: pipeline rank r is global rank r * tp (global = (dp_index * pp + r) * tp + tp_index).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from pipegpt.run_files import MeasuredRun, RunReadError, read_json, read_measured_run

from .actions import Action, Kind, Plan, ScheduleError, parts_of
from .messages import peer
from .render import _US_PER
from .schedule_file import load_schedule_file
from .simulate import Costs, Event, Timeline, simulate
from .validate import dependencies


@dataclass
class Calibration:
    """Costs filled from a measured timeline, and how many measurements each figure rests on."""

    costs: Costs
    samples: dict  # "F"/"B"/"I"/"W": per-stage counts; "comm": number of waits measured
    # costs without the host's time before each compute (its own span, or from its wait's end), and that time's
    # mean per compute: the planner scales the one with tokens and threads and charges the other per action
    compute: Costs | None = None
    host: float = 0.0

    def as_dict(self) -> dict:
        return {"costs": {k: ([float(x) for x in v] if isinstance(v, list) else float(v))
                          for k, v in self.costs.as_dict().items()},
                "samples": self.samples, "host_per_action": float(self.host)}


@dataclass
class Comparison:
    """A run's measured timeline beside the simulation of its plan with calibrated costs."""

    run_dir: str
    plan: Plan
    measured: Timeline
    predicted: Timeline
    calibration: Calibration
    global_ranks: tuple[int, ...] = ()  # pipeline rank r was read from the trace's process global_ranks[r]
    notes: list[str] = field(default_factory=list)

    @property
    def fidelity(self) -> float:
        """Predicted makespan / measured step span: 1.0 is a perfect prediction, below 1 too optimistic."""
        span = float(self.measured.makespan)
        return float(self.predicted.makespan) / span if span else math.nan

    def summary(self) -> dict:
        """Plain numbers (floats) for printing or JSON."""
        def side(t: Timeline, span_key: str) -> dict:
            span = float(t.makespan)
            busy = [float(b) for b in t.busy_per_rank]
            return {span_key: span, "bubble_fraction": float(t.bubble_fraction),
                    "bubble_fraction_per_rank": [float(x) for x in t.bubble_fraction_per_rank],
                    "busy_per_rank": busy, "idle_per_rank": [span - b for b in busy]}

        measured = side(self.measured, "step_span")
        overhead = comm_overhead_per_rank(self.plan, self.measured)
        measured["comm_overhead_per_rank"] = None if overhead is None else [float(x) for x in overhead]

        return {
            "run_dir": self.run_dir,
            "schedule": self.plan.name,
            "ranks": self.plan.num_ranks,
            "stages": self.plan.num_stages,
            "microbatches": self.plan.num_microbatches,
            "stage_to_rank": list(self.plan.stage_to_rank),
            "global_ranks": list(self.global_ranks),
            "time_unit": self.measured.time_unit,
            **self.calibration.as_dict(),
            "measured": measured,
            "predicted": side(self.predicted, "makespan"),
            "fidelity": self.fidelity,
            "notes": list(self.notes),
            **({"pairs": pairs} if (pairs := pair_times(self.measured, self.predicted, self.calibration.costs))
               else {}),
        }


# ---------------------------------------------------------------------------------------------------------
# a run's files as a measured timeline (pipegpt.run_files reads them)


def pipeline_global_ranks(config: dict | None, num_ranks: int) -> tuple[int, ...]:
    """The global rank of each pipeline rank of replica dp 0, tp 0, from config.json's "parallel" section.

    global rank = (dp_index * pp + pp_index) * tp + tp_index, so pipeline rank r is global rank r * tp.
    Without a config every global rank is a pipeline rank (dp = tp = 1).
    """
    parallel = (config or {}).get("parallel") or {}
    pp, tp = parallel.get("stages", num_ranks), parallel.get("tp", 1)
    if not isinstance(pp, int) or not isinstance(tp, int) or tp < 1:
        raise ScheduleError(f"config.json: 'parallel' has stages={pp!r}, tp={tp!r}; expected positive integers")
    if pp != num_ranks:
        raise ScheduleError(f"config.json says stages={pp} but plan.txt has {num_ranks} ranks; "
                            f"they are not from the same run")
    return tuple(r * tp for r in range(num_ranks))


def read_trace(path, plan: Plan, global_ranks: tuple[int, ...] | None = None) -> Timeline:
    """A Chrome trace file (trace.json of a run, or `simulate --out x.json`) as a Timeline of `plan`'s ranks
    (trace_timeline)."""
    path = os.fspath(path)
    try:
        data = read_json(path, "trace")
    except RunReadError as e:
        raise ScheduleError(str(e)) from None
    return trace_timeline(data, plan, global_ranks, path)


def trace_timeline(data, plan: Plan, global_ranks: tuple[int, ...] | None = None, path: str = "trace") -> Timeline:
    """A Chrome trace's contents as a Timeline of `plan`'s ranks (`path` names it in errors).

    "X" events whose pid is global_ranks[r] become events of pipeline rank r (global_ranks defaults to
    0..ranks-1); the action comes from args.action. Times are in the trace's otherData.time_unit ("s"
    for a measured run). The events must be the plan's: per rank, exactly its compute actions, and
    comm actions only among its own.
    """
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise ScheduleError(f"{path}: expected a Chrome trace (an object with a 'traceEvents' list)")
    other = data.get("otherData") if isinstance(data, dict) else None
    other = other if isinstance(other, dict) else {}
    unit = str(other.get("time_unit") or "s")
    if unit not in _US_PER:
        raise ScheduleError(f"{path}: unknown time_unit {unit!r}; expected one of {', '.join(_US_PER)}")
    us = _US_PER[unit]
    global_ranks = tuple(range(plan.num_ranks)) if global_ranks is None else tuple(global_ranks)
    rank_of = {g: r for r, g in enumerate(global_ranks)}
    events = []
    for e in raw:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("pid") not in rank_of:
            continue
        name = (e.get("args") or {}).get("action")
        try:
            action = Action.parse(str(name))
            start, end = float(e["ts"]) / us, (float(e["ts"]) + float(e["dur"])) / us
        except (KeyError, TypeError, ValueError):
            raise ScheduleError(f"{path}: event {json.dumps(e)[:120]} has no action (args.action such as "
                                f"'1F3') or no ts/dur") from None
        if action.kind.is_collective:  # a launch (REDUCE_GRAD): see the module docstring
            continue
        events.append(Event(rank_of[e["pid"]], action, start, end))
    _check_matches(events, plan, path, global_ranks)
    return Timeline(events, plan.num_ranks, schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=tuple(plan.stage_to_rank), time_unit=unit,
                    meta={"source": path, "global_ranks": list(global_ranks),
                          "recorded": bool(other.get("recorded"))})


def _check_matches(events: list[Event], plan: Plan, path: str, global_ranks) -> None:
    ran: list[Counter] = [Counter() for _ in range(plan.num_ranks)]
    for e in events:
        ran[e.rank][e.action] += 1
    where = [f"rank {r}" + (f" (global rank {g})" if g != r else "") for r, g in enumerate(global_ranks)]
    for r in range(plan.num_ranks):
        if not ran[r]:
            raise ScheduleError(f"{path} has no events for {where[r]}; is it a trace of this plan "
                                f"({plan.num_ranks} ranks)?")
    for r, actions in enumerate(plan.ranks):
        planned = Counter(actions)
        compute = Counter({a: n for a, n in ran[r].items() if a.kind.is_compute})
        extra = (ran[r] - planned) if any(a.kind.is_p2p for a in ran[r]) else (compute - planned)
        missing = Counter({a: n for a, n in planned.items() if a.kind.is_compute}) - compute
        if extra or missing:
            problem = (f"it has {sorted(extra, key=str)[0]}, which the plan does not have there" if extra else
                       f"the plan's {sorted(missing, key=str)[0]} is not in it")
            raise ScheduleError(f"{path} is not a trace of this plan ({plan.name}, {plan.num_ranks} ranks, "
                                f"{plan.num_microbatches} microbatches): on {where[r]} {problem}")


def measured_run(plan: Plan, run: MeasuredRun) -> Timeline:
    """A run's measured step as a timeline of its plan's ranks (plan.txt's, parsed; config.json, when there,
    says which processes to read)."""
    return trace_timeline(run.trace, plan, pipeline_global_ranks(run.config, plan.num_ranks), run.trace_path)


def load_run(run_dir, step: int | None = None) -> tuple[Plan, Timeline]:
    """plan.txt and trace.json of a run directory (with a step, traces/step-N.json instead of trace.json): the
    plan and its measured timeline."""
    try:
        run = read_measured_run(run_dir, step)
    except RunReadError as e:
        raise ScheduleError(str(e)) from None
    plan = load_schedule_file(run.plan_path)
    return plan, measured_run(plan, run)


def calibrate_run(plan: Plan, run: MeasuredRun) -> tuple[Timeline, Calibration]:
    """A run's measured timeline of `plan` (its plan.txt's) and the costs calibrated from it (the planner's
    --calibrate)."""
    measured = measured_run(plan, run)
    return measured, calibrate(plan, measured)


# ---------------------------------------------------------------------------------------------------------
# calibration


def calibrate(plan: Plan, measured: Timeline) -> Calibration:
    """Per-stage F, B, W and one comm latency from a measured timeline of `plan` (see the module docstring)."""
    durations: dict[tuple[Kind, int], list] = defaultdict(list)
    own: dict[tuple[Kind, int], list] = defaultdict(list)  # the same without the host's time before each
    inputs_ready = cross_rank_inputs_ready(plan, measured)
    # The runtime waits for a message inside the compute that reads it: in a trace it recorded, time between
    # two computes is the host's (message batches, the dispatch) and holds the rank as compute does. In a
    # simulation's, a gap is a wait. (A run's trace from before otherData said "recorded" has message events.)
    host_gaps = measured.meta.get("recorded") or any(e.action.kind.is_p2p for e in measured.events)
    for r in range(measured.num_ranks):
        events = measured.events_of(r)
        free = events[0].start if events else 0  # the end of the rank's previous compute, or its step's start
        for e in events:
            if not e.action.kind.is_compute:
                continue
            # a compute whose inputs were there when its rank became free counts from then; one that waited
            # for a message, from its producer's end (the wait inside) or its own start, where later
            since, ready = free if host_gaps else e.start, inputs_ready.get(e.action)
            start = since if ready is None or ready <= since else max(e.start, min(ready, e.end))
            durations[(e.action.kind, e.action.stage)].append(e.end - start)
            own[(e.action.kind, e.action.stage)].append(e.end - max(start, e.start))
            free = e.end

    waits = comm_samples(plan, measured, {key: statistics.fmean(v) for key, v in durations.items()})
    samples = {k.value: [len(durations.get((k, s), ())) for s in range(plan.num_stages)]
               for k in (Kind.F, Kind.B, Kind.I, Kind.W)}
    samples["comm"] = len(waits)
    comm = max(statistics.fmean(waits), 0) if waits else 0
    before = [x - y for key in durations for x, y in zip(durations[key], own[key])]
    S = plan.num_stages
    return Calibration(_stage_costs(durations, S, comm), samples, _stage_costs(own, S, comm),
                       statistics.fmean(before) if before else 0.0)


def _stage_costs(durations: dict, num_stages: int, comm) -> Costs:
    """Per-stage F, B, W: the means of each kind's durations; a split backward's B = I + W (module docstring)."""
    def mean(kind: Kind, stage: int):
        values = durations.get((kind, stage))
        return statistics.fmean(values) if values else None

    forward, backward, weight = [], [], []
    for s in range(num_stages):
        f, b, i, w = (mean(k, s) for k in (Kind.F, Kind.B, Kind.I, Kind.W))
        full = i + (w or 0) if i is not None else (b if b is not None else 0)
        forward.append(max(f or 0, 0))
        backward.append(max(full, 0))
        weight.append(min(max(w, 0), backward[-1]) if w is not None else backward[-1] / 2)
    return Costs(tuple(forward), tuple(backward), tuple(weight), comm)


def median_calibration(calibrations: list[Calibration]) -> Calibration:
    """One calibration from several steps' of the same plan: each figure the median over the steps (one step's
    time moves by a few percent from the next's on a CPU), the samples they rest on summed."""
    if len(calibrations) == 1:
        return calibrations[0]
    def median_costs(costs: list[Costs]) -> Costs:
        per_stage = (tuple(map(statistics.median, zip(*column))) for column in
                     ([c.forward for c in costs], [c.backward for c in costs], [c.weight for c in costs]))
        return Costs(*per_stage, statistics.median(c.comm for c in costs))

    samples = {k: [sum(n) for n in zip(*(c.samples[k] for c in calibrations))] for k in ("F", "B", "I", "W")}
    samples["comm"] = sum(c.samples["comm"] for c in calibrations)
    compute = [c.compute for c in calibrations]
    return Calibration(median_costs([c.costs for c in calibrations]), samples,
                       None if None in compute else median_costs(compute),
                       statistics.median(c.host for c in calibrations))


def cross_rank_inputs_ready(plan: Plan, measured: Timeline) -> dict:
    """Per compute action with an input from another rank, when the last such input's producer ended: a
    compute measured from its start holds its wait for that input (the runtime waits inside the compute that
    reads a message), and from here it holds the compute and the message's last leg only."""
    ends = {e.action: e.end for e in measured.compute_events()}
    rank_of = plan.stage_to_rank
    out = {}
    for e in measured.compute_events():
        mine = rank_of[e.action.stage]
        ready = [ends[dep] for dep in dependencies(e.action, plan) if rank_of[dep.stage] != mine and dep in ends]
        if ready:
            out[e.action] = max(ready)
    return out


def comm_samples(plan: Plan, measured: Timeline, compute_time: dict | None = None) -> list:
    """Consumer start - producer end on each cross-rank dependency that its consumer's rank waited for.

    Waited for: the consumer's rank had finished its previous compute (or, for its first, started its
    step: its first event of any kind) no later than the producer ended. compute_time ((kind, stage) ->
    the calibrated duration): the consumer's start is taken as its end less that where later, as the runtime
    waits for a received input inside the compute that reads it.
    """
    ends: dict[Action, object] = {}
    for e in measured.compute_events():
        ends[e.action] = e.end
    rank_of = plan.stage_to_rank
    out = []
    for r in range(measured.num_ranks):
        events = measured.events_of(r)
        ready = events[0].start if events else 0
        for e in events:
            if not e.action.kind.is_compute:
                continue
            for dep in dependencies(e.action, plan):
                if rank_of[dep.stage] != r and dep in ends and ends[dep] >= ready:
                    own = (compute_time or {}).get((e.action.kind, e.action.stage))
                    began = e.start if own is None else max(e.start, e.end - own)
                    out.append(began - ends[dep])
            ready = e.end
    return out


def comm_overhead_per_rank(plan: Plan, measured: Timeline) -> list | None:
    """Per rank, time spent in comm batches after every message it receives there had been sent.

    The simulator has no such time apart (a rank waits for a message or runs on); calibration counts it in
    the compute that follows (see the module docstring). A batch's wait lasts until the last of its RECVs'
    peers posted the matching SEND (the start of the peer's batch); the rest of the batch is overhead. None
    for a trace without comm events (one written from a simulation).
    """
    batches: dict[tuple[int, object, object], list[Action]] = defaultdict(list)
    posted: dict[Action, object] = {}
    for e in measured.events:
        if e.action.kind.is_p2p:
            batches[(e.rank, e.start, e.end)].append(e.action)
            posted[e.action] = e.start
    if not batches:
        return None
    out = [0.0] * measured.num_ranks
    for (rank, start, end), actions in batches.items():
        sent = [posted.get(peer(a, plan)[1]) for a in actions if a.kind in (Kind.RECV_F, Kind.RECV_B)]
        waited_until = max([start] + [t for t in sent if t is not None])
        out[rank] += max(0.0, end - min(max(start, waited_until), end))
    return out


def pair_times(measured: Timeline, predicted: Timeline, costs: Costs) -> dict | None:
    """A paired run's pairs (None without): how many, their time in all measured and predicted, and what their
    halves take apart at the calibrated costs (the lone actions' means): measured against apart is the overlap
    the run achieved."""
    def pairs(t: Timeline) -> list[Event]:  # a trace's pair is one event; the simulator draws its halves
        return [e for e in t.compute_events() if e.action.kind is Kind.OVERLAP or e.pair is not None]

    ran = pairs(measured)
    if not ran:
        return None
    return {"count": len(ran), "measured": float(sum(e.end - e.start for e in ran)),
            "predicted": float(sum(e.end - e.start for e in pairs(predicted))),
            "apart": float(sum(costs.duration(part) for e in ran for part in parts_of(e.action)))}


def compare(run_dir, step: int | None = None) -> Comparison:
    """Read a run directory (its trace.json, or traces/step-N.json), calibrate, simulate its plan with the
    calibrated costs."""
    plan, measured = load_run(run_dir, step)
    calibration = calibrate(plan, measured)
    predicted = simulate(plan, calibration.costs)
    predicted.time_unit = measured.time_unit
    notes = []
    if plan.num_ranks > 1 and not calibration.samples["comm"]:
        notes.append("no rank ever waited on a message, so comm could not be measured; it is 0")
    return Comparison(os.fspath(run_dir), plan, measured, predicted, calibration,
                      tuple(measured.meta.get("global_ranks", ())), notes)


# ---------------------------------------------------------------------------------------------------------
# text


def format_time(x, unit: str) -> str:
    """A measured time in ms ('12.34 ms'), a simulated one as it is."""
    x = float(x)
    if unit == "s":
        return f"{x * 1e3:.4g} ms"
    return f"{x:.4g}" + ("" if unit == "unit" else f" {unit}")


def comparison_text(comparison: Comparison) -> str:
    """The measured-versus-predicted table, the fidelity and the calibrated costs, for the terminal."""
    from .render import text_table

    s = comparison.summary()
    unit, m, p = s["time_unit"], s["measured"], s["predicted"]
    t = lambda x: format_time(x, unit)  # noqa: E731
    rows = [["", "measured", "predicted"],
            ["step span / makespan", t(m["step_span"]), t(p["makespan"])],
            ["bubble", f"{100 * m['bubble_fraction']:.1f}%", f"{100 * p['bubble_fraction']:.1f}%"]]
    for r in range(s["ranks"]):
        rows.append([f"idle r{r}", t(m["idle_per_rank"][r]), t(p["idle_per_rank"][r])])
    lines = [f"{s['run_dir']}: {s['schedule']}, {s['ranks']} ranks, {s['stages']} stages, "
             f"{s['microbatches']} microbatches" + (f"; global ranks {s['global_ranks']}"
                                                    if s["global_ranks"] != list(range(s["ranks"])) else ""),
             text_table(rows, right={1, 2}, rule=True),
             f"fidelity {s['fidelity']:.3f}  (predicted makespan / measured step span)"]
    if "pairs" in s:
        pairs = s["pairs"]
        ratio = pairs["measured"] / pairs["apart"] if pairs["apart"] else math.nan
        lines.append(f"pairs {pairs['count']}: measured {t(pairs['measured'])} in all, predicted "
                     f"{t(pairs['predicted'])}; their halves apart at the calibrated costs {t(pairs['apart'])} "
                     f"(measured / apart {ratio:.3f}; below 1 where the pairs hid communication)")
    lines += ["", "calibrated costs (means of the measured actions):"]
    costs, n = s["costs"], s["samples"]
    split = any(n["I"]) or any(n["W"])
    head = ["stage", "rank", "F", "B"] + (["W"] if split else []) + ["measured F/B/I/W"]
    rows = [head]
    for st in range(s["stages"]):
        rows.append([st, s["stage_to_rank"][st], t(costs["F"][st]), t(costs["B"][st])]
                    + ([t(costs["W"][st])] if split else [])
                    + ["/".join(str(n[k][st]) for k in "FBIW")])
    lines.append(text_table(rows, right=set(range(2, len(head) - 1)), free_last=True))
    lines.append(f"comm {t(costs['comm'])} per message (mean of {n['comm']} waits: consumer start - "
                 f"producer end where the consumer's rank was waiting)")
    if m["comm_overhead_per_rank"] is not None:
        lines.insert(3, "in comm batches after the peer's send was posted (in the next compute's time): " + ", ".join(
            f"r{r} {t(x)}" for r, x in enumerate(m["comm_overhead_per_rank"])))
    lines.extend("note: " + x for x in s["notes"])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# the whole step: its parts beyond the actions (pipegpt.observe.step_time writes them into the trace)
#
# A traced step's trace holds, besides the actions ("X"), "B"/"E" pairs that the readers above skip: each rank's
# step() cut into parts on the host (category PART_CATEGORY) and, with one step a call, the driver's call
# (DRIVER_CATEGORY). `breakdown` reads them back into a chain of instants on one clock -- the driver's send, the
# first rank's start, the first action, the last action's end, the last rank's sync, clip, optimizer and end, the
# driver's receipt -- each part the time from the previous instant to the next (never negative but for the
# receipt, where a clock error would show), so the parts sum to the driver's step time.

PART_CATEGORY = "step part"
DRIVER_CATEGORY = "driver"
PART_TID = 100  # beside the actions (thread 0) and the expert all-to-alls (threads from 1)

BEFORE, ACTIONS, SYNC, CLIP, OPTIMIZER, END = ("before the actions", "actions", "gradient sync", "clip",
                                               "optimizer", "end of the step")
OUTBOUND, RETURN = "driver -> workers", "workers -> driver"
MODELLED = {ACTIONS: "the schedule's makespan", SYNC: "the sync's tail (data parallelism)",
            OPTIMIZER: "the optimizer (per parameter byte)"}  # the rest: calibrated as a time per step


@dataclass
class StepBreakdown:
    """A measured step's parts in seconds, in order (they sum to `total`), and per rank what it spent."""

    parts: list[tuple[str, float]]
    per_rank: dict = field(default_factory=dict)  # rank -> {"compute", "messages", "idle", and each part's seconds}
    driver: bool = False  # whether the trace has the driver's call (then total is the driver's step time)

    @property
    def total(self) -> float:
        return sum(x for _, x in self.parts)

    def part(self, name: str) -> float:
        return sum(x for label, x in self.parts if label == name)

    @property
    def round_trip(self) -> float:
        return self.part(OUTBOUND) + self.part(RETURN)

    @property
    def rest(self) -> float:
        """What the cost model counts as a time per step: the parts but the actions, the sync and the optimizer."""
        return self.total - sum(self.part(p) for p in MODELLED)

    def as_dict(self) -> dict:
        return {"parts": {k: v for k, v in self.parts}, "total": self.total, "driver": self.driver,
                "per_rank": {str(r): v for r, v in self.per_rank.items()}}


def _spans(raw: list, category: str) -> dict:
    """{pid: [(name, start_us, end_us)]} of the B/E pairs of `category`, each E closing its thread's open B."""
    open_: dict = defaultdict(list)
    out: dict = defaultdict(list)
    for e in raw:
        if not isinstance(e, dict) or e.get("cat") != category:
            continue
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "B":
            open_[key].append(e)
        elif e.get("ph") == "E" and open_[key]:
            b = open_[key].pop()
            out[e.get("pid")].append((b.get("name"), float(b["ts"]), float(e["ts"])))
    return out


def breakdown(trace: dict) -> StepBreakdown | None:
    """The step of a trace.json's contents broken into its parts (the module docstring); None for a trace
    without step parts (one from before they were recorded, or written from a simulation)."""
    raw = trace.get("traceEvents") if isinstance(trace, dict) else trace
    parts_of = _spans(raw or [], PART_CATEGORY)
    if not parts_of:
        return None
    actions: dict = defaultdict(list)
    for e in raw:
        if isinstance(e, dict) and e.get("ph") == "X" and "action" in (e.get("args") or {}):
            actions[e.get("pid")].append((Action.parse(e["args"]["action"]), float(e["ts"]),
                                          float(e["ts"]) + float(e["dur"])))
    first = min(s for events in actions.values() for _, s, _ in events)
    last = max(t for events in actions.values() for _, _, t in events)
    driver = next(iter(_spans(raw, DRIVER_CATEGORY).values()), [])
    ends = {name: max(t for spans in parts_of.values() for n, _, t in spans if n == name)
            for name in (SYNC, CLIP, OPTIMIZER, END) if any(n == name for s in parts_of.values() for n, _, _ in s)}
    start = min(s for spans in parts_of.values() for _, s, _ in spans)
    chain = [(BEFORE, first), (ACTIONS, last)] + [(name, ends[name]) for name in (SYNC, CLIP, OPTIMIZER, END)
                                                 if name in ends]
    now, parts = start, []
    if driver:
        now, parts = driver[0][1], [(OUTBOUND, max(0.0, start - driver[0][1]))]
        now = max(now, start)
    for name, t in chain:
        parts.append((name, max(0.0, t - now)))
        now = max(now, t)
    if driver:
        parts.append((RETURN, driver[0][2] - now))  # negative only if the clocks disagree
    per_rank = {}
    for pid, spans in sorted(parts_of.items()):
        events = actions.get(pid, [])
        # a batch's sends and receives are events of one span each, and may run beside compute: their union
        compute = _covered([(s, t) for a, s, t in events if a.kind.is_compute])
        busy = _covered([(s, t) for _, s, t in events])
        row = {"compute": compute / 1e6, "messages": (busy - compute) / 1e6, "idle": ((last - first) - busy) / 1e6}
        for name, s, t in spans:
            row[name] = row.get(name, 0.0) + (t - s) / 1e6
        per_rank[pid] = row
    return StepBreakdown([(name, x / 1e6) for name, x in parts], per_rank, bool(driver))


def _covered(spans: list) -> float:
    """The length of the union of (start, end) spans."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
