"""The schedules by name, each declaring its placement and options.

A caller asks the entry how many model stages a schedule makes, which rank
holds each and whether --virtual-stages applies, without generating a plan
and without knowing schedule names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .actions import Plan, ScheduleError
from .generators import dualpipev, gpipe, interleaved_1f1b, looped, one_f_one_b, v_shape, zb_h1, zbv


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    generate: Callable[..., Plan]  # (ranks, microbatches[, virtual_stages]) -> compute-only Plan
    placement: Callable[[int, int], tuple[int, ...]] = looped  # (ranks, stages per rank) -> stage_to_rank
    default_virtual_stages: int = 1  # model stages per rank
    takes_virtual_stages: bool = False  # whether --virtual-stages may change that number

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

    def build(self, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None) -> Plan:
        v = self.virtual_stages(virtual_stages)
        return self.generate(num_ranks, num_microbatches, *((v,) if self.takes_virtual_stages else ()))


SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec("gpipe", gpipe),
    ScheduleSpec("1f1b", one_f_one_b),
    ScheduleSpec("interleaved-1f1b", interleaved_1f1b, default_virtual_stages=2, takes_virtual_stages=True),
    ScheduleSpec("zb-h1", zb_h1),
    ScheduleSpec("zbv", zbv, v_shape, default_virtual_stages=2),
    ScheduleSpec("dualpipev", dualpipev, v_shape, default_virtual_stages=2),
)}


def schedule_spec(name: str) -> ScheduleSpec:
    """The registry entry for a schedule name; a ScheduleError listing the known names otherwise."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def schedule_names(text: str) -> list[str]:
    """A --schedule value: one name, a comma list, or 'all' (every schedule, in the registry's order)."""
    if text.strip().lower() == "all":
        return list(SCHEDULES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ScheduleError(f"--schedule is empty; known schedules: {', '.join(SCHEDULES)} (or 'all')")
    for n in names:
        if n not in SCHEDULES:
            raise ScheduleError(f"unknown schedule {n!r}; known schedules: {', '.join(SCHEDULES)} (or 'all')")
    return names


def build_plan(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int | None = None) -> Plan:
    """Look a schedule up by name and generate its compute plan."""
    return schedule_spec(name).build(num_ranks, num_microbatches, virtual_stages)


def _virtual_stages_error(given: int, name: str) -> ScheduleError:
    takers = " and ".join(s.name for s in SCHEDULES.values() if s.takes_virtual_stages)
    fixed: dict[int, list[str]] = {}
    for s in SCHEDULES.values():
        if not s.takes_virtual_stages and s.default_virtual_stages > 1:
            fixed.setdefault(s.default_virtual_stages, []).append(s.name)
    always = "; ".join(f"{' and '.join(names)} always use {v}" for v, names in fixed.items())
    return ScheduleError(f"virtual-stages={given} only applies to {takers} ({always}); leave it out for {name}")
