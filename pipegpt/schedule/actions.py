"""The action IR: what one rank does next, as plain data.

An action names a stage (a slice of layers), a kind and a microbatch, and
prints as "2F0" (stage 2, forward, microbatch 0) or "1SEND_B3". A collective
acts on a stage's whole step, not on one microbatch: it prints without one,
"1REDUCE_GRAD", and holds NO_MICROBATCH (-1). A composite runs two compute
actions of one rank as one, "(0F3;0B1)" (DualPipe's overlapped forward and
backward; also written "0F3&0B1"). A Plan holds, for every rank, its ordered list of actions, plus
where each stage lives.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple


class ScheduleError(ValueError):
    """A schedule, its arguments or a schedule file is not valid."""


class Category(enum.Enum):
    """What an action kind does: computes on a stage, moves one message between two ranks of a pipeline,
    or joins a collective over the stage's replicas (every replica runs the same plan, so every member of
    the group launches its collectives in the same order)."""

    COMPUTE = "compute"
    P2P = "point-to-point"
    COLLECTIVE = "collective"


class Kind(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # full backward: input and weight gradients together
    I = "I"  # noqa: E741 - backward for the input gradient only
    W = "W"  # backward for the weight gradient only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"  # launch the data-parallel reduction of the stage's gradients
    UNSHARD = "UNSHARD"  # gather the stage's sharded parameters (ZeRO-3)
    RESHARD = "RESHARD"  # free the gathered parameters again (ZeRO-3)
    OVERLAP = "OVERLAP"  # a Composite: two compute actions run as one

    @property
    def category(self) -> Category:
        return CATEGORY[self]

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_p2p(self) -> bool:
        return self in P2P_KINDS

    @property
    def is_collective(self) -> bool:
        return self in COLLECTIVE_KINDS


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP})
P2P_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
COLLECTIVE_KINDS = frozenset({Kind.REDUCE_GRAD, Kind.UNSHARD, Kind.RESHARD})
CATEGORY = {**dict.fromkeys(COMPUTE_KINDS, Category.COMPUTE), **dict.fromkeys(P2P_KINDS, Category.P2P),
            **dict.fromkeys(COLLECTIVE_KINDS, Category.COLLECTIVE)}
NO_MICROBATCH = -1  # a collective's microbatch: it acts on the stage's whole step
# Longest names first so that "SEND_F" is not read as "S" + ... by the regex.
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UNSHARD|RESHARD|F|B|I|W)(\d*)$")
_PART_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})  # what a composite's parts may be


class Action(NamedTuple):
    # A NamedTuple, not a dataclass: plans hold thousands and the validator and
    # lowering hash them constantly.
    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        if self.kind in COLLECTIVE_KINDS:
            return f"{self.stage}{self.kind.value}"
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> "Action | Composite":
        text = text.strip()
        if text.startswith("(") or "&" in text:
            return Composite.parse(text)
        match = _ACTION_RE.match(text)
        if match:
            stage, kind, microbatch = int(match.group(1)), Kind(match.group(2)), match.group(3)
            if kind in COLLECTIVE_KINDS and not microbatch:
                return cls(stage, kind, NO_MICROBATCH)
            if kind not in COLLECTIVE_KINDS and microbatch:
                return cls(stage, kind, int(microbatch))
        raise ScheduleError(
            f"bad action {text!r}: expected <stage><kind><microbatch> such as '2F0' or '1SEND_B3', "
            f"kind one of {', '.join(k.value for k in Kind if k not in COLLECTIVE_KINDS and k is not Kind.OVERLAP)}, "
            f"or <stage><collective> "
            f"such as '1REDUCE_GRAD', collective one of {', '.join(k.value for k in Kind if k in COLLECTIVE_KINDS)}"
        )


class Composite(NamedTuple):
    """Two compute actions of two microbatches on one rank, run as one action: DualPipe's overlapped forward
    and backward, or a combined 1F1B. Prints "(0F3;0B1)" (torch.distributed.pipelining's _Action with
    sub_actions), and parses from that or "0F3&0B1" (the pair's halves joined by "&"). `parts` are ordinary
    Actions: a runtime runs their pieces in turns; the validator checks each part's dependencies as if they ran
    in order, and that neither needs the other; lowering puts every message of a part before (receives) or
    after (sends) the composite, and the timing rule (timing_rule.composite_spans) charges it by its parts."""

    parts: tuple[Action, ...]
    kind = Kind.OVERLAP  # not a field: every composite has it
    microbatch = NO_MICROBATCH  # its parts hold theirs

    @property
    def stage(self) -> int:
        """Its first part's stage: the rank's, like every part's (where a caller needs one stage)."""
        return self.parts[0].stage

    def __str__(self) -> str:
        return "(" + ";".join(map(str, self.parts)) + ")"

    def __repr__(self) -> str:
        return f"Composite({self})"

    @classmethod
    def parse(cls, text: str) -> "Composite":
        text = text.strip()
        if text.startswith("(") and text.endswith(")"):
            halves = text[1:-1].split(";")
        elif "&" in text and not text.startswith("("):
            halves = text.split("&")
        else:
            raise ScheduleError(f"bad composite {text!r}: expected <action>&<action> such as '0F3&0B1' "
                                f"(or '(0F3;0B1)')")
        if any("&" in h or "(" in h for h in halves):
            raise ScheduleError(f"bad composite {text!r}: a pair's halves are plain compute actions")
        try:
            parts = [Action.parse(part) for part in halves]
        except ScheduleError as e:
            raise ScheduleError(f"bad composite {text!r}: {e}") from None
        return cls.of(*parts)

    @classmethod
    def of(cls, *parts: Action) -> "Composite":
        """A composite of these parts: two compute actions (F, B, I or W) of two microbatches."""
        if len(parts) != 2 or any(not isinstance(p, Action) or p.kind not in _PART_KINDS for p in parts):
            shown = ";".join(map(str, parts))
            raise ScheduleError(f"bad composite ({shown}): it pairs two compute actions (F, B, I or W), "
                                f"such as '(0F3;0B1)'")
        if parts[0].microbatch == parts[1].microbatch:
            raise ScheduleError(f"bad composite ({parts[0]};{parts[1]}): its parts are of two microbatches")
        return cls(tuple(parts))


def parts_of(action) -> tuple[Action, ...]:
    """A composite's parts, or the action itself."""
    return action.parts if action.kind is Kind.OVERLAP else (action,)


def flattened(actions) -> list[Action]:
    """A rank's actions with each composite replaced by its parts, in order."""
    return [p for a in actions for p in parts_of(a)]


def F(stage: int, mb: int) -> Action:
    return Action(stage, Kind.F, mb)


def B(stage: int, mb: int) -> Action:
    return Action(stage, Kind.B, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E743
    return Action(stage, Kind.I, mb)


def W(stage: int, mb: int) -> Action:
    return Action(stage, Kind.W, mb)


def REDUCE_GRAD(stage: int) -> Action:  # noqa: N802 - named like its kind, as F/B/I/W are
    return Action(stage, Kind.REDUCE_GRAD, NO_MICROBATCH)


@dataclass(frozen=True)
class Plan:
    """Per-rank ordered actions for one training step.

    stage_to_rank[s] is the rank that owns stage s. Stages are the model's
    slices in forward order: stage 0 holds the embedding, the last stage the
    head and the loss. A rank may own several stages (interleaved, V-shape).
    """

    name: str
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def is_lowered(self) -> bool:
        """Whether the point-to-point messages are in (collectives do not count)."""
        return any(a.kind in P2P_KINDS for actions in self.ranks for a in actions)

    @cached_property
    def split_pairs(self) -> frozenset[tuple[int, int]]:
        """(stage, microbatch) pairs whose backward is split into I and W."""
        return frozenset((a.stage, a.microbatch) for acts in self.ranks for a in flattened(acts) if a.kind is Kind.I)

    def backward_of(self, stage: int, mb: int) -> Action:
        """The action that produces a stage's input gradient: I where the plan splits, else B."""
        return Action(stage, Kind.I if (stage, mb) in self.split_pairs else Kind.B, mb)

    def compute_only(self) -> "Plan":
        """The plan without its messages and collectives."""
        return self.with_ranks([[a for a in acts if a.kind.is_compute] for acts in self.ranks])

    def forward_only(self) -> "Plan":
        """The plan's forwards alone, in its order (for evaluation): each rank's F order already
        respects every F dependency, so dropping the backwards leaves a valid plan to lower."""
        return replace(self.with_ranks([[a for a in flattened(acts) if a.kind is Kind.F] for acts in self.ranks]),
                       name=f"{self.name}-forward")

    @property
    def is_forward_only(self) -> bool:
        return all(a.kind in _FORWARD_KINDS for acts in self.ranks for a in acts)

    @property
    def has_composites(self) -> bool:
        return any(a.kind is Kind.OVERLAP for acts in self.ranks for a in acts)

    def flattened(self) -> "Plan":
        """The plan with each composite replaced by its parts, in order."""
        return self.with_ranks([flattened(acts) for acts in self.ranks]) if self.has_composites else self

    def with_ranks(self, ranks) -> "Plan":
        return replace(self, ranks=tuple(tuple(acts) for acts in ranks))

    def to_text(self) -> str:
        """One line per rank of action strings: the schedule-file format."""
        return "\n".join(" ".join(str(a) for a in acts) for acts in self.ranks) + "\n"

    def as_strings(self) -> list[list[str]]:
        return [[str(a) for a in acts] for acts in self.ranks]


_FORWARD_KINDS = frozenset({Kind.F, Kind.SEND_F, Kind.RECV_F, Kind.UNSHARD, Kind.RESHARD})  # gathers serve forwards too


class PlanError(ScheduleError):
    """A plan cannot run: names the rank and the step and shows the plan around it."""

    def __init__(self, plan: Plan, rank: int, step: int, problem: str):
        self.rank, self.step = rank, step
        super().__init__(f"rank {rank} step {step} ({_at(plan, rank, step)}): {problem}; plan around it: "
                         f"{context(plan, rank, step)}")


def _at(plan: Plan, rank: int, step: int) -> str:
    actions = plan.ranks[rank]
    return str(actions[step]) if 0 <= step < len(actions) else "end"


def context(plan: Plan, rank: int, step: int, radius: int = 4) -> str:
    actions = plan.ranks[rank]
    lo, hi = max(0, step - radius), min(len(actions), step + radius + 1)
    shown = [f"[{a}]" if i == step else str(a) for i, a in enumerate(actions[lo:hi], start=lo)]
    return f"rank {rank}: " + ("... " if lo else "") + " ".join(shown) + (" ..." if hi < len(actions) else "")
