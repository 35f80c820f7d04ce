"""The schedules by name, each declaring its placement and options.

A caller asks the entry how many model stages a schedule makes, which rank
holds each and whether --virtual-stages applies, without generating a plan
and without knowing schedule names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .actions import Plan, ScheduleError
from .generators import (dualpipev, gpipe, interleaved_1f1b, looped, one_f_one_b, one_f_one_b_overlap, v_shape,
                         zb_h1, zbv)
from .simulate import Costs
from .synthesis.synthesize import SEARCH_EVALUATIONS, Synthesis, check_max_live, synthesize


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    generate: Callable[..., Plan] | None  # (ranks, microbatches[, virtual_stages]) -> compute-only Plan
    placement: Callable[[int, int], tuple[int, ...]] = looped  # (ranks, stages per rank) -> stage_to_rank
    default_virtual_stages: int = 1  # model stages per rank
    takes_virtual_stages: bool = False  # whether --virtual-stages may change that number
    synthesized: bool = False  # written for the costs and a memory limit (synthesize.py), not generated
    # written to hide communication inside actions (an MoE stage's all-to-all) under a pair's other half: the
    # planner, which does not cost that communication yet, leaves it out of its search
    for_overlap: bool = False

    def virtual_stages(self, given: int | None = None) -> int:
        """Model stages per rank for a --virtual-stages value (None: the default).

        Raises ScheduleError where the value does not apply to this schedule.
        """
        if self.takes_virtual_stages:
            v = given or self.default_virtual_stages  # 0 means the default, as it always has
            if v < 1:
                raise ScheduleError(f"virtual-stages={v} must be at least 1")
            return v
        # 1 is accepted everywhere: it is what "no virtual stages" means to a caller.
        if given not in (None, 1, self.default_virtual_stages):
            raise _virtual_stages_error(given, self.name)
        return self.default_virtual_stages

    def stage_to_rank(self, num_ranks: int, virtual_stages: int | None = None) -> tuple[int, ...]:
        """The rank holding each model stage, as in the plan build() makes."""
        if num_ranks < 1:
            raise ScheduleError(f"stages={num_ranks} must be at least 1")
        return self.placement(num_ranks, self.virtual_stages(virtual_stages))

    def num_stages(self, num_ranks: int, virtual_stages: int | None = None) -> int:
        return len(self.stage_to_rank(num_ranks, virtual_stages))

    def build(self, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None,
              costs: Costs | None = None, max_live: int | None = None) -> Plan:
        """The compute plan. costs and max_live shape a synthesized schedule (default: unit costs, 1F1B's
        memory); a fixed one ignores them."""
        if self.synthesized:
            return self.synthesize(num_ranks, num_microbatches, virtual_stages, costs, max_live).plan
        v = self.virtual_stages(virtual_stages)
        return self.generate(num_ranks, num_microbatches, *((v,) if self.takes_virtual_stages else ()))

    def synthesize(self, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None,
                   costs: Costs | None = None, max_live: int | None = None,
                   search_evaluations: int = SEARCH_EVALUATIONS, matching: str = "tag") -> Synthesis:
        """A synthesized schedule with its lower bound and the fixed schedules of its placement it beat."""
        placement = self.stage_to_rank(num_ranks, virtual_stages)
        v = len(placement) // num_ranks
        if costs is None:  # a rank's share of the model costs F=1, B=2, W=1, split over its v stages
            costs = Costs.uniform(len(placement), 1 / v, 2 / v, 1 / v) if v > 1 else Costs.uniform(len(placement))
        if max_live is not None:
            check_max_live(max_live, placement)
        if num_microbatches < 1:
            raise ScheduleError(f"microbatches={num_microbatches} must be at least 1")
        return synthesize(placement, num_microbatches, costs, max_live, name=self.name,
                          fixed=fixed_plans(placement, num_ranks, num_microbatches),
                          search_evaluations=search_evaluations, matching=matching)


SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("gpipe", gpipe),
    ScheduleSpec("1f1b", one_f_one_b),
    ScheduleSpec("1f1b-overlap", one_f_one_b_overlap, for_overlap=True),  # combined 1F1B: F and B as one pair
    ScheduleSpec("interleaved-1f1b", interleaved_1f1b, default_virtual_stages=2, takes_virtual_stages=True),
    ScheduleSpec("zb-h1", zb_h1),
    ScheduleSpec("zbv", zbv, v_shape, default_virtual_stages=2),
    ScheduleSpec("dualpipev", dualpipev, v_shape, default_virtual_stages=2),
    # Written for the costs: one stage per rank (interleaved with --virtual-stages), or a V.
    ScheduleSpec("auto", None, looped, default_virtual_stages=1, takes_virtual_stages=True, synthesized=True),
    ScheduleSpec("auto-v", None, v_shape, default_virtual_stages=2, synthesized=True),
)}


def fixed_plans(placement: tuple[int, ...], num_ranks: int, num_microbatches: int) -> list[Plan]:
    """The generated schedules that put the stages where `placement` does, for this many microbatches."""
    v = len(placement) // num_ranks
    plans = []
    for spec in SCHEDULES.values():
        if spec.synthesized or (not spec.takes_virtual_stages and spec.default_virtual_stages != v):
            continue
        try:
            if spec.stage_to_rank(num_ranks, v) == placement:
                plans.append(spec.build(num_ranks, num_microbatches, v))
        except ScheduleError:  # e.g. dualpipev below 2p microbatches
            continue
    return plans


def schedule_spec(name: str) -> ScheduleSpec:
    """The registry entry for a schedule name; a ScheduleError listing the known names otherwise."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def schedule_names(text: str, synthesized: bool = True) -> list[str]:
    """A --schedule value: one name, a comma list, or 'all' (every schedule, in the registry's order; only the
    generated ones where synthesized=False)."""
    if text.strip().lower() == "all":
        return [name for name, spec in SCHEDULES.items() if synthesized or not spec.synthesized]
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ScheduleError(f"--schedule is empty; known schedules: {', '.join(SCHEDULES)} (or 'all')")
    for n in names:
        if n not in SCHEDULES:
            raise ScheduleError(f"unknown schedule {n!r}; known schedules: {', '.join(SCHEDULES)} (or 'all')")
    return names


def build_plan(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None,
               costs: Costs | None = None, max_live: int | None = None) -> Plan:
    """Look a schedule up by name and generate (or synthesize) its compute plan."""
    return schedule_spec(name).build(num_ranks, num_microbatches, virtual_stages, costs, max_live)


def _virtual_stages_error(given: int, name: str) -> ScheduleError:
    takers = _and([s.name for s in SCHEDULES.values() if s.takes_virtual_stages])
    fixed: dict[int, list[str]] = {}
    for s in SCHEDULES.values():
        if not s.takes_virtual_stages and s.default_virtual_stages > 1:
            fixed.setdefault(s.default_virtual_stages, []).append(s.name)
    always = "; ".join(f"{_and(names)} always use {v}" for v, names in fixed.items())
    return ScheduleError(f"virtual-stages={given} only applies to {takers} ({always}); leave it out for {name}")


def _and(names: list[str]) -> str:
    return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"
