"""The one timing rule: how long an action holds its rank and what runs beside what, against per-stage Costs.

Every engine times a plan by this module: simulate (messages matched by tag), simulate_order (matched by
order), the synthesizer's list scheduler and its fast simulator (which read it as tables, action_times and
hops, so they agree with simulate to the last bit by construction), and lowering's eager timeline.

- Compute (F, B, I, W) runs on its rank's compute line, one action at a time in plan order, for
  compute_time(): its share of the stage's work plus, for F and the input-gradient backward (B or I), the
  stage's tensor-parallel all-reduces and its expert all-to-alls (a2a_comm), which hold the line.
- A composite pair runs on the line as one action. Its halves' pieces (a layer each) run in turns, each
  half's all-to-all posted and waited for just before the piece that consumes it, under the other half's
  compute: summed over the pieces, each half holds the line for max(its compute, the other half's
  all-to-all) (composite_spans, the halves' events back to back). A dense pair (no all-to-all) costs its
  halves' sum. Both parts' outputs are there when the pair ends.
- A message between stages on two ranks runs off the line: a consumer may start hop() after its producer
  ended; a stage's input from the same rank is there at once. (Under order matching a message also waits
  for both ends' batches to start: schedule.simulate.simulate_order.)
- A REDUCE_GRAD runs off the line, on its rank's one reduction channel, one after another: queued() from
  where it is launched, for dp_comm[stage]; the step ends when the last one does.
- An UNSHARD runs off the line, on its rank's gather channel (queued() from where the rank reaches it, for
  gather_comm[stage]); the stage's next compute action waits for it. A RESHARD takes no time.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from fractions import Fraction
from numbers import Real

from .actions import Action, Kind, Plan, ScheduleError


def compute_time(costs: "Costs", kind: Kind, stage: int) -> Real:
    """How long a compute action of this kind on this stage holds its rank's compute line, alone: its work,
    then its all-to-all (nothing to hide it under). A dense stage's a2a_comm is 0, and x + 0 is x to the bit."""
    if kind is Kind.W:
        return costs.weight[stage]
    return work_time(costs, kind, stage) + comm_inside(costs, kind, stage)


def work_time(costs: "Costs", kind: Kind, stage: int) -> Real:
    """What an action computes (with its tensor-parallel all-reduces, which hold the line even in a pair)."""
    if kind is Kind.F:
        return costs.forward[stage] + costs.tp_comm[stage]
    if kind is Kind.B:
        return costs.backward[stage] + costs.tp_comm[stage]
    if kind is Kind.I:
        return costs.backward[stage] - costs.weight[stage] + costs.tp_comm[stage]
    if kind is Kind.W:
        return costs.weight[stage]
    return 0


def comm_inside(costs: "Costs", kind: Kind, stage: int) -> Real:
    """The communication inside an action that another action's compute can hide: the stage's expert all-to-alls
    (dispatch and combine; a backward, B or I, makes as many as the forward, W none)."""
    return costs.a2a_comm[stage] if kind in (Kind.F, Kind.B, Kind.I) else 0


def part_comm(costs: "Costs", part: Action) -> Real:
    """The communication of a composite's part that the other part's compute hides."""
    return comm_inside(costs, part.kind, part.stage)


def composite_spans(start: Real, compute: tuple, comm: tuple) -> list[tuple[Real, Real]]:
    """(start, end) of each part of a composite pair starting at `start`: the parts back to back, each for
    max(its compute, the other part's communication)."""
    spans = []
    for i, took in enumerate(compute):
        hidden = comm[1 - i]
        end = start + (took if took >= hidden else hidden)
        spans.append((start, end))
        start = end
    return spans


def spans_of(costs: "Costs", composite, start: Real) -> list[tuple[Real, Real]]:
    """composite_spans for a Composite at these costs."""
    parts = composite.parts
    return composite_spans(start, tuple(work_time(costs, p.kind, p.stage) for p in parts),
                           tuple(part_comm(costs, p) for p in parts))


def duration(costs: "Costs", action) -> Real:
    """How long an action holds its rank's compute line (0 for messages and collectives: off the line)."""
    if action.kind is Kind.OVERLAP:
        return spans_of(costs, action, 0)[-1][1]
    return compute_time(costs, action.kind, action.stage)


def action_times(costs: "Costs", kinds) -> list[list[Real]]:
    """duration by [kind][stage], for engines that time integer-coded actions."""
    return [[compute_time(costs, kind, s) for s in range(costs.num_stages)] for kind in kinds]


def hop(comm: Real, from_rank: int, to_rank: int) -> Real:
    """What a message adds between its producer's end and its consumer's start: the latency between two
    ranks (costs.comm), nothing on one rank."""
    return comm if from_rank != to_rank else 0


def hops(costs: "Costs", stage_to_rank) -> list[Real]:
    """hop between stage s and s + 1 (either way), by s; 0 after the last stage."""
    n = len(stage_to_rank)
    return [hop(costs.comm, stage_to_rank[s], stage_to_rank[s + 1]) if s + 1 < n else 0 for s in range(n)]


def queued(channel_free: Real, at: Real, took: Real) -> Real:
    """When a job launched at `at` on a channel that runs one job at a time (free from channel_free) ends."""
    return max(channel_free, at) + took


# Keys accepted by Costs.parse / Costs.from_json (lower case) and the field each fills.
_KEYS = {"f": "forward", "b": "backward", "w": "weight", "comm": "comm",
         "act_bytes": "activation_bytes", "activation_bytes": "activation_bytes",
         "tp_comm": "tp_comm", "dp_comm": "dp_comm", "gather_comm": "gather_comm", "a2a": "a2a_comm",
         "a2a_comm": "a2a_comm"}
_SHOWN = {"forward": "F", "backward": "B", "weight": "W", "comm": "comm", "activation_bytes": "act_bytes",
          "tp_comm": "tp_comm", "dp_comm": "dp_comm", "gather_comm": "gather_comm", "a2a_comm": "a2a"}
_VALID_KEYS = "F, B, W, comm, act_bytes, tp_comm, dp_comm, gather_comm, a2a"
_PER_STAGE = ("tp_comm", "dp_comm", "gather_comm", "a2a_comm")  # absent means free


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
    a2a_comm[s] is the time of stage s's expert all-to-alls (dispatch and combine)
    in one microbatch's forward; its backward (B or I) makes as many, W none.
    Alone an action waits for them; in a pair the other half's compute hides them.
    """

    forward: tuple
    backward: tuple
    weight: tuple
    comm: Real = 0
    activation_bytes: tuple | None = None
    tp_comm: tuple | None = None
    dp_comm: tuple | None = None
    gather_comm: tuple | None = None
    a2a_comm: tuple | None = None

    def __post_init__(self):
        for name in _PER_STAGE:
            if getattr(self, name) is None:
                object.__setattr__(self, name, (0,) * len(self.forward))
        for name in ("forward", "backward", "weight", "activation_bytes") + _PER_STAGE:
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        n = len(self.forward)
        if n < 1:
            raise ScheduleError("costs: need at least one stage")
        optional = ("activation_bytes",) if self.activation_bytes is not None else ()
        for name in ("backward", "weight") + _PER_STAGE + optional:
            if len(getattr(self, name)) != n:
                raise ScheduleError(f"costs: {name} has {len(getattr(self, name))} values but forward has {n}; "
                                    f"give one per stage")
        for name in ("forward", "backward", "weight") + _PER_STAGE + optional:
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

    def duration(self, action) -> Real:
        """How long the action holds its rank's compute line: the timing rule's duration()."""
        return duration(self, action)

    def scaled(self, factor: Real) -> "Costs":
        """Compute costs and activation bytes times factor (comm unchanged): a stage holding 1/v of the layers."""
        return replace(self, forward=tuple(x * factor for x in self.forward),
                       backward=tuple(x * factor for x in self.backward),
                       weight=tuple(x * factor for x in self.weight),
                       tp_comm=tuple(x * factor for x in self.tp_comm),
                       dp_comm=tuple(x * factor for x in self.dp_comm),
                       gather_comm=tuple(x * factor for x in self.gather_comm),
                       a2a_comm=tuple(x * factor for x in self.a2a_comm),
                       activation_bytes=None if self.activation_bytes is None
                       else tuple(x * factor for x in self.activation_bytes))

    def as_dict(self) -> dict:
        out = {"F": list(self.forward), "B": list(self.backward), "W": list(self.weight), "comm": self.comm}
        if self.activation_bytes is not None:
            out["act_bytes"] = list(self.activation_bytes)
        for name in _PER_STAGE:
            if any(getattr(self, name)):
                out[_SHOWN[name]] = list(getattr(self, name))
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
                   fields.get("tp_comm"), fields.get("dp_comm"), fields.get("gather_comm"), fields.get("a2a_comm"))


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

