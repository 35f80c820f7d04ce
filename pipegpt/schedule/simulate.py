"""Simulate a plan: per-stage costs in, a Timeline of when every action ran out.

Costs are plain data (per-stage F, B, W seconds or units, one comm latency),
so a calibration step can fill them from a measured run. A Timeline is just
events (rank, action, start, end) plus a little metadata; the runtime's
measured traces build the same type, so every metric and renderer works on
both.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field, replace
from fractions import Fraction
from numbers import Real

from .actions import COMPUTE_KINDS, Action, Kind, Plan, ScheduleError
from .lowering import last_gradient_actions
from .validate import dependencies, validate

# Keys accepted by Costs.parse / Costs.from_json (lower case) and the field each fills.
_KEYS = {"f": "forward", "b": "backward", "w": "weight", "comm": "comm",
         "act_bytes": "activation_bytes", "activation_bytes": "activation_bytes",
         "tp_comm": "tp_comm", "dp_comm": "dp_comm", "gather_comm": "gather_comm"}
_SHOWN = {"forward": "F", "backward": "B", "weight": "W", "comm": "comm", "activation_bytes": "act_bytes",
          "tp_comm": "tp_comm", "dp_comm": "dp_comm", "gather_comm": "gather_comm"}
_VALID_KEYS = "F, B, W, comm, act_bytes, tp_comm, dp_comm, gather_comm"


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ScheduleError(f"costs: {name}={value!r} must be a number >= 0")
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ScheduleError(f"costs: {name}={value!r} must be a finite number >= 0")


@dataclass(frozen=True)
class Costs:
    """How long each action takes, per stage, and how long a message between ranks takes.

    forward[s], backward[s] (the full B) and weight[s] (the W part of B when a
    plan splits it; I then costs backward[s] - weight[s]) are in any time unit.
    comm is the latency of one point-to-point message between two ranks;
    messages between stages on the same rank are free. activation_bytes[s],
    when given, is what one microbatch's saved activations take on stage s.

    The other parallel axes: tp_comm[s] is the time stage s spends in its
    tensor-parallel all-reduces for one microbatch's forward; its backward (B or
    I) makes as many, W none. dp_comm[s] is the time to all-reduce stage s's
    gradients across data-parallel replicas, the cost of its REDUCE_GRAD: it
    starts where the plan's REDUCE_GRAD stands (a plan without them is charged
    as add_reduce_grad places them: when the stage's last B/W ends), overlaps
    compute, and a rank's reductions run one after another. gather_comm[s] is
    the time to all-gather stage s's parameters (ZeRO-3), the cost of its
    UNSHARD: it starts where the rank reaches it (after the gathers posted
    before it), overlaps the compute that follows, and the stage's next compute
    action waits for it (a gather posted a compute ahead is hidden by that compute).
    """

    forward: tuple
    backward: tuple
    weight: tuple
    comm: Real = 0
    activation_bytes: tuple | None = None
    tp_comm: tuple | None = None
    dp_comm: tuple | None = None
    gather_comm: tuple | None = None

    def __post_init__(self):
        for name in ("tp_comm", "dp_comm", "gather_comm"):  # absent means free
            if getattr(self, name) is None:
                object.__setattr__(self, name, (0,) * len(self.forward))
        for name in ("forward", "backward", "weight", "activation_bytes", "tp_comm", "dp_comm", "gather_comm"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        n = len(self.forward)
        if n < 1:
            raise ScheduleError("costs: need at least one stage")
        optional = ("activation_bytes",) if self.activation_bytes is not None else ()
        for name in ("backward", "weight", "tp_comm", "dp_comm", "gather_comm") + optional:
            if len(getattr(self, name)) != n:
                raise ScheduleError(f"costs: {name} has {len(getattr(self, name))} values but forward has {n}; "
                                    f"give one per stage")
        for name in ("forward", "backward", "weight", "tp_comm", "dp_comm", "gather_comm") + optional:
            for s, value in enumerate(getattr(self, name)):
                _check_number(f"{name}[{s}]", value)
        _check_number("comm", self.comm)
        for s, (b, w) in enumerate(zip(self.backward, self.weight)):
            if w > b:
                raise ScheduleError(f"costs: W={w} > B={b} on stage {s}; W is the weight-gradient part of B, "
                                    f"so 0 <= W <= B")

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    def duration(self, action: Action) -> Real:
        s, kind = action.stage, action.kind
        if kind is Kind.F:
            return self.forward[s] + self.tp_comm[s]
        if kind is Kind.B:
            return self.backward[s] + self.tp_comm[s]
        if kind is Kind.I:
            return self.backward[s] - self.weight[s] + self.tp_comm[s]
        if kind is Kind.W:
            return self.weight[s]
        return 0

    def scaled(self, factor: Real) -> "Costs":
        """Compute costs and activation bytes times factor (comm unchanged): a stage holding 1/v of the layers."""
        return replace(self, forward=tuple(x * factor for x in self.forward),
                       backward=tuple(x * factor for x in self.backward),
                       weight=tuple(x * factor for x in self.weight),
                       tp_comm=tuple(x * factor for x in self.tp_comm),
                       dp_comm=tuple(x * factor for x in self.dp_comm),
                       gather_comm=tuple(x * factor for x in self.gather_comm),
                       activation_bytes=None if self.activation_bytes is None
                       else tuple(x * factor for x in self.activation_bytes))

    def as_dict(self) -> dict:
        out = {"F": list(self.forward), "B": list(self.backward), "W": list(self.weight), "comm": self.comm}
        if self.activation_bytes is not None:
            out["act_bytes"] = list(self.activation_bytes)
        for name in ("tp_comm", "dp_comm", "gather_comm"):
            if any(getattr(self, name)):
                out[name] = list(getattr(self, name))
        return out

    @classmethod
    def uniform(cls, num_stages: int, F: Real = 1.0, B: Real = 2.0, W: Real | None = None, comm: Real = 0,
                activation_bytes: Real | None = None) -> "Costs":
        """The same F, B, W on every stage; W defaults to B/2 (I and W then cost the same)."""
        if num_stages < 1:
            raise ScheduleError(f"costs: num_stages={num_stages} must be at least 1")
        for name, value in (("F", F), ("B", B), ("comm", comm)):
            _check_number(name, value)
        W = B / 2 if W is None else W
        return cls((F,) * num_stages, (B,) * num_stages, (W,) * num_stages, comm,
                   None if activation_bytes is None else (activation_bytes,) * num_stages)

    @classmethod
    def parse(cls, text: str, num_stages: int) -> "Costs":
        """Read "F=1,B=2,W=1,comm=0.1" (keys case-insensitive; act_bytes= too); the same values on every stage."""
        values = {}
        for item in text.replace(";", ",").split(","):
            if not item.strip():
                continue
            key, sep, raw = item.partition("=")
            key = key.strip().lower()
            if not sep or not raw.strip():
                raise ScheduleError(f"costs: {item.strip()!r} is not KEY=VALUE; write e.g. 'F=1,B=2,W=1,comm=0.1'")
            if key in values:
                raise ScheduleError(f"costs: {key!r} given twice in {text!r}")
            values[key] = _parse_number(_SHOWN.get(_KEYS.get(key), key), raw.strip())
        return cls._from_mapping(values, num_stages)

    @classmethod
    def from_json(cls, source, num_stages: int) -> "Costs":
        """Read costs from a JSON file path or an already-loaded dict.

        Each of F, B, W, act_bytes is a number (every stage) or a list with one
        number per stage; comm is a number. E.g. {"F": [1.2, 1, 1, 1.5], "B": 2, "comm": 0.1}.
        """
        data = load_costs_json(source) if isinstance(source, (str, os.PathLike)) else source
        if not isinstance(data, dict):
            raise ScheduleError(f"costs: expected a JSON object with keys {_VALID_KEYS}, got {type(data).__name__}")
        lowered = {str(k).lower(): v for k, v in data.items()}
        if len(lowered) != len(data):
            raise ScheduleError(f"costs: a key is given twice (keys are case-insensitive): {', '.join(map(str, data))}")
        return cls._from_mapping(lowered, num_stages)

    @classmethod
    def _from_mapping(cls, values: dict, num_stages: int) -> "Costs":
        fields = {}
        for key, value in values.items():
            if key not in _KEYS:
                raise ScheduleError(f"costs: unknown key {key!r}; valid keys: {_VALID_KEYS}")
            name = _KEYS[key]
            shown = _SHOWN[name]
            if name in fields:
                raise ScheduleError(f"costs: {shown} given twice")
            if isinstance(value, (list, tuple)):
                if name == "comm":
                    raise ScheduleError(f"costs: comm must be one number (the latency of any message between ranks), "
                                        f"got a list")
                if len(value) != num_stages:
                    raise ScheduleError(f"costs: {shown} has {len(value)} values but the plan has {num_stages} stages; "
                                        f"give {num_stages} values or one number")
                for s, x in enumerate(value):
                    _check_number(f"{shown}[{s}]", x)
                fields[name] = tuple(value)
            else:
                _check_number(shown, value)
                fields[name] = value if name == "comm" else (value,) * num_stages
        if num_stages < 1:
            raise ScheduleError(f"costs: num_stages={num_stages} must be at least 1")
        forward = fields.get("forward", (1.0,) * num_stages)
        backward = fields.get("backward", (2.0,) * num_stages)
        weight = fields.get("weight", tuple(b / 2 for b in backward))
        return cls(forward, backward, weight, fields.get("comm", 0), fields.get("activation_bytes"),
                   fields.get("tp_comm"), fields.get("dp_comm"), fields.get("gather_comm"))


def load_costs_json(path) -> dict:
    """The raw dict of a costs JSON file (Costs.from_json checks it)."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except OSError as e:
        raise ScheduleError(f"costs: cannot read {os.fspath(path)}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ScheduleError(f"costs: {os.fspath(path)} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ScheduleError(f"costs: {os.fspath(path)} must hold a JSON object with keys {_VALID_KEYS}")
    return data


def costs_for_plan(spec: str | None, plan: Plan) -> Costs:
    """Costs for this plan from `simulate --costs` text or a .json path.

    Numbers are for one rank's share of the model (a 1F1B stage): a plan with
    v stages per rank (interleaved, zbv, dualpipev) runs each stage at 1/v of
    them, so every schedule does the same total work and makespans compare.
    Per-stage lists (JSON) are taken as they are, one value per stage of the plan.
    """
    factor = Fraction(plan.num_ranks, plan.num_stages)
    factor = 1 if factor == 1 else float(factor)
    spec = spec or ""
    if spec.lower().endswith(".json") or (spec and os.path.isfile(spec)):
        data = load_costs_json(spec)
        scaled = {k: (v if isinstance(v, list) or str(k).lower() == "comm" or isinstance(v, bool)
                      or not isinstance(v, (int, float)) else v * factor)
                  for k, v in data.items()}
        return Costs.from_json(scaled, plan.num_stages)
    costs = Costs.parse(spec, plan.num_stages)
    return costs if factor == 1 else costs.scaled(factor)


def _parse_number(key: str, raw: str) -> Real:
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        raise ScheduleError(f"costs: {key}={raw!r} is not a number") from None
    _check_number(key, value)
    return value


@dataclass
class Event:
    """One action on one rank, from start to end (simulated units or measured seconds)."""

    rank: int
    action: Action
    start: Real
    end: Real

    @property
    def duration(self) -> Real:
        return self.end - self.start


@dataclass
class Timeline:
    """What ran where and when. Built by simulate() or from a measured trace.

    Metrics count compute actions (F, B, I, W) as busy; comm events, which a
    measured trace may hold, are kept but count as neither busy nor live.
    """

    events: list[Event]
    num_ranks: int
    schedule: str = ""
    num_microbatches: int = 0
    stage_to_rank: tuple[int, ...] = ()
    activation_bytes: tuple | None = None  # per stage, for one microbatch
    time_unit: str = "unit"  # "unit" (simulated) or "s" (measured)
    meta: dict = field(default_factory=dict)

    def compute_events(self) -> list[Event]:
        return [e for e in self.events if e.action.kind.is_compute]

    def events_of(self, rank: int) -> list[Event]:
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: (e.start, e.end))

    @property
    def start_time(self) -> Real:
        return min((e.start for e in self.events), default=0)

    @property
    def end_time(self) -> Real:
        return max((e.end for e in self.events), default=0)

    @property
    def makespan(self) -> Real:
        """Until the step ends: the last action, or the last gradient all-reduce if later (meta step_end)."""
        return max(self.end_time, self.meta.get("step_end", self.end_time)) - self.start_time

    @property
    def busy_per_rank(self) -> list[Real]:
        busy = [0] * self.num_ranks
        for e in self.compute_events():
            busy[e.rank] += e.end - e.start
        return busy

    @property
    def bubble_fraction(self) -> Real:
        """Idle share of all ranks' time: 1 - total busy / (num_ranks * makespan)."""
        span = self.makespan
        if not span:
            return 0
        return 1 - _ratio(sum(self.busy_per_rank), self.num_ranks * span)

    @property
    def bubble_fraction_per_rank(self) -> list[Real]:
        span = self.makespan
        return [1 - _ratio(busy, span) if span else 0 for busy in self.busy_per_rank]

    @property
    def idle_time(self) -> Real:
        """Total idle time over all ranks (the bubble, in time units)."""
        return self.num_ranks * self.makespan - sum(self.busy_per_rank)

    def live_intervals(self) -> list[tuple[int, int, int, Real, Real]]:
        """(rank, stage, microbatch, start, end): from the start of F to the end of its last backward piece.

        A stage-microbatch with no backward event (a cut-off trace) stays live to the end.
        """
        first: dict[tuple[int, int], Event] = {}
        last_end: dict[tuple[int, int], Real] = {}
        for e in self.compute_events():
            key = (e.action.stage, e.action.microbatch)
            if e.action.kind is Kind.F:
                first[key] = e
            else:
                last_end[key] = max(last_end.get(key, e.end), e.end)
        end = self.end_time
        return [(f.rank, s, mb, f.start, last_end.get((s, mb), end)) for (s, mb), f in first.items()]

    def _peak_per_rank(self, weight) -> list:
        changes: list[list[tuple]] = [[] for _ in range(self.num_ranks)]
        for rank, stage, _, start, end in self.live_intervals():
            w = weight(stage)
            changes[rank].append((start, 1, w))   # at equal times releases (0) sort before allocations (1)
            changes[rank].append((end, 0, -w))
        peaks = []
        for ch in changes:
            level = peak = 0
            for _, _, delta in sorted(ch, key=lambda c: (c[0], c[1])):
                level += delta
                peak = max(peak, level)
            peaks.append(peak)
        return peaks

    @property
    def peak_live_microbatches_per_rank(self) -> list[int]:
        """Most stage-microbatches whose activations a rank holds at once (F started, backward not finished)."""
        return self._peak_per_rank(lambda stage: 1)

    @property
    def peak_activation_bytes_per_rank(self) -> list | None:
        """Like peak_live_microbatches_per_rank, weighted by activation_bytes[stage]; None when unknown."""
        if self.activation_bytes is None:
            return None
        return self._peak_per_rank(lambda stage: self.activation_bytes[stage])

    def summary(self) -> dict:
        """Plain numbers (floats) for printing or JSON."""
        peak_bytes = self.peak_activation_bytes_per_rank
        return {
            "schedule": self.schedule,
            "ranks": self.num_ranks,
            "stages": len(self.stage_to_rank) or None,
            "microbatches": self.num_microbatches,
            "time_unit": self.time_unit,
            "makespan": float(self.makespan),
            "bubble_fraction": float(self.bubble_fraction),
            "bubble_fraction_per_rank": [float(x) for x in self.bubble_fraction_per_rank],
            "busy_per_rank": [float(x) for x in self.busy_per_rank],
            "peak_live_microbatches_per_rank": self.peak_live_microbatches_per_rank,
            "peak_activation_bytes_per_rank": None if peak_bytes is None else [_plain(x) for x in peak_bytes],
        }


def _ratio(a, b):
    """a / b, exact (a Fraction) when both are integers."""
    return Fraction(a, b) if isinstance(a, int) and isinstance(b, int) else a / b


def _plain(x):
    return int(x) if x == int(x) else float(x)


def simulate(plan: Plan, costs: Costs) -> Timeline:
    """Run the plan's compute actions against the costs and return when each ran.

    Each rank runs its compute actions in plan order (SEND/RECV are ignored:
    messages are modelled as latency; collectives take no compute time, see
    _gradient_sync_end). An action starts when its rank is free
    and every dependency (validate.dependencies) is available: at once on the
    same rank, costs.comm after it ended on another. The times are computed
    in dependency order, which gives exactly what an event-driven run gives.
    Integer or Fraction costs give exact times (and an exact Fraction bubble).
    """
    validate(plan)  # an unrunnable plan fails here, naming the rank and step
    return simulate_unchecked(plan, costs)


def simulate_unchecked(plan: Plan, costs: Costs) -> Timeline:
    """simulate() without validating first, for a caller that trusts the plan's counts (the synthesizer's
    local search: a reordering that deadlocks still raises ScheduleError, naming where it stuck)."""
    if costs.num_stages != plan.num_stages:
        raise ScheduleError(f"costs are for {costs.num_stages} stages but plan {plan.name!r} has "
                            f"{plan.num_stages}; give one cost per stage")
    actions = plan.compute_only().ranks
    launches, waits = _gathers(plan, costs)
    gathered: dict[tuple[int, int], tuple[Action, Real]] = {}  # (rank, index of an UNSHARD) -> it, when done
    channel: list[Real] = [0] * plan.num_ranks  # when each rank's gathers posted so far are done
    rank_of = plan.stage_to_rank
    ends: dict[Action, Real] = {}
    waiters: dict[Action, list[int]] = defaultdict(list)
    pos = [0] * plan.num_ranks
    free: list[Real] = [0] * plan.num_ranks
    events: list[Event] = []
    todo = list(range(plan.num_ranks))
    while todo:
        r = todo.pop()
        while pos[r] < len(actions[r]):
            action = actions[r][pos[r]]
            deps = dependencies(action, plan)
            missing = next((d for d in deps if d not in ends), None)
            if missing is not None:
                waiters[missing].append(r)
                break
            start = free[r]
            for key, unshard, duration in launches.get(action, ()):  # posted where the rank reached them
                channel[r] = max(channel[r], free[r]) + duration
                gathered[key] = unshard, channel[r]
            for key in waits.get(action, ()):  # its stage's gathers: the rank's wait for them is their event
                unshard, done = gathered.pop(key)
                if done > start:
                    events.append(Event(r, unshard, start, done))
                    start = done
            for d in deps:
                available = ends[d]
                if costs.comm and rank_of[d.stage] != r:
                    available = available + costs.comm
                if available > start:
                    start = available
            end = start + costs.duration(action)
            ends[action] = end
            free[r] = end
            events.append(Event(r, action, start, end))
            pos[r] += 1
            todo.extend(waiters.pop(action, ()))
    stuck = [r for r in range(plan.num_ranks) if pos[r] < len(actions[r])]
    if stuck:  # validate() proves this cannot happen; kept so a validator bug cannot pass silently
        r = stuck[0]
        raise ScheduleError(f"rank {r} step {pos[r]} ({actions[r][pos[r]]}): simulation cannot progress")
    events.sort(key=lambda e: e.rank)  # stable: each rank keeps its plan order
    meta = {**plan.meta, "costs": costs.as_dict()}
    if any(costs.dp_comm):
        meta["step_end"] = _gradient_sync_end(plan, ends, costs)
    return Timeline(events, plan.num_ranks, schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=tuple(plan.stage_to_rank), activation_bytes=costs.activation_bytes, meta=meta)


def _gathers(plan: Plan, costs: Costs) -> tuple[dict[Action, list], dict[Action, list]]:
    """Per compute action, the UNSHARDs its rank posts just before it (since its previous compute action), as
    ((rank, index), UNSHARD, gather time), and the UNSHARDs it waits for (its stage's since the stage's previous
    compute action), as (rank, index)."""
    launches: dict[Action, list] = {}
    waits: dict[Action, list] = {}
    for r, actions in enumerate(plan.ranks):
        posted: list = []
        pending: dict[int, list[tuple[int, int]]] = {}
        for i, a in enumerate(actions):
            if a.kind is Kind.UNSHARD:
                posted.append(((r, i), a, costs.gather_comm[a.stage]))
                pending.setdefault(a.stage, []).append((r, i))
            elif a.kind in COMPUTE_KINDS:
                if posted:
                    launches[a], posted = posted, []
                if a.stage in pending:
                    waits[a] = pending.pop(a.stage)
    return launches, waits


def _gradient_sync_end(plan: Plan, ends: dict[Action, Real], costs: Costs) -> Real:
    """When the last data-parallel gradient reduction ends. A REDUCE_GRAD is launched where it stands: once
    its rank has finished the compute action before it; launching takes no compute time (the reduction is
    asynchronous), and it then takes dp_comm[stage] on its rank's one reduction channel, after the reductions
    launched before it. A rank without REDUCE_GRAD launches where add_reduce_grad would put them."""
    end = 0
    for actions in plan.ranks:
        placed = [i for i, a in enumerate(actions) if a.kind is Kind.REDUCE_GRAD]
        if placed:
            launches = [(_reached(actions, i, ends), actions[i].stage) for i in placed]
        else:
            after = last_gradient_actions(actions)
            launches = [(ends[actions[i]], s) for s, i in sorted(after.items(), key=lambda item: item[1])]
        channel = 0
        for at, stage in launches:
            channel = max(channel, at) + costs.dp_comm[stage]
        end = max(end, channel)
    return end


def _reached(actions, i: int, ends: dict[Action, Real]) -> Real:
    """When a rank reaches step i of its actions: the end of the compute action before it (0 if none)."""
    for k in range(i - 1, -1, -1):
        if actions[k].kind in COMPUTE_KINDS:
            return ends[actions[k]]
    return 0
