"""A schedule's structure for the planner, independent of the costs and built once per (schedule, p, m, v):
its compute plan, its placement, whether it splits backward, and the moments its ranks' held activations
may peak."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pipegpt.schedule import SCHEDULES, build_plan
from pipegpt.schedule.actions import Kind, ScheduleError


@dataclass
class Structure:
    """A schedule's compute plan for (p, m, v), built once: the simulator and the memory model read it."""

    plan: object  # pipegpt.schedule.Plan, compute only
    split: bool  # whether it splits backward into I and W


@lru_cache(maxsize=256)
def structure(schedule: str, p: int, m: int, v: int | None) -> Structure:
    spec = SCHEDULES[schedule]
    # auto / auto-v: written for unit costs here (the planner's memory model reads the plan before the costs);
    # `pipegpt run --schedule auto` writes it again for the costs it measures, so the estimate is cautious.
    plan = spec.synthesize(p, m, v, search_evaluations=0).plan if spec.synthesized else build_plan(schedule, p, m, v)
    return Structure(plan, any(a.kind is Kind.W for r in plan.ranks for a in r))


@lru_cache(maxsize=None)
def schedulable(schedule: str, p: int, m: int, v: int | None) -> bool:
    """Whether structure() builds (p, m, v) rather than raising ScheduleError: the planner asks for thousands of
    structures, more than their cache keeps, and a refusal can take as long as a build."""
    try:
        structure(schedule, p, m, v)
    except ScheduleError:
        return False
    return True


@lru_cache(maxsize=8192)
def live_sets(schedule: str, p: int, m: int, v: int | None) -> tuple:
    """Per rank, (its stages, a matrix whose rows are the count vectors at which its held activations may peak).

    pipegpt.costs.memory counts saved[s] from a stage-microbatch's F to its B, or to its I and then
    deferred[s] until its W; a rank's level changes only at its own actions, so it peaks right after one of
    its F or I actions whatever the costs and the bytes. The distinct (saved counts, deferred counts)
    vectors of those moments give every rank's peak for any bytes as one matrix-vector product (held_peaks)."""
    import numpy as np

    plan = structure(schedule, p, m, v).plan.flattened()  # a pair's halves in order: its F counts before its B frees
    out = []
    for r, actions in enumerate(plan.ranks):
        stages = plan.stages_of(r)
        index = {s: i for i, s in enumerate(stages)}
        k = len(stages)
        live = [0] * (2 * k)
        seen = set()
        for a in actions:
            i = index[a.stage]
            if a.kind is Kind.F:
                live[i] += 1
                seen.add(tuple(live))
            elif a.kind is Kind.B:
                live[i] -= 1
            elif a.kind is Kind.I:
                live[i] -= 1
                live[k + i] += 1
                seen.add(tuple(live))
            elif a.kind is Kind.W:
                live[k + i] -= 1
        rows = np.array(sorted(seen), dtype=np.float64).reshape(-1, 2 * k)
        if k == 1 and len(rows) > 1:  # two columns: keep the undominated rows (few)
            rows = rows[np.lexsort((-rows[:, 1], -rows[:, 0]))]
            keep = rows[:, 1] > np.maximum.accumulate(np.concatenate(([-1.0], rows[:-1, 1])))
            rows = rows[keep]
        out.append((tuple(stages), rows))
    return tuple(out)


def held_peaks(schedule: str, p: int, m: int, v: int | None, saved, deferred) -> list:
    """Each rank's peak of held activation bytes: memory.peak_activation_bytes(plan, saved, deferred)."""
    import numpy as np

    out = []
    for stages, rows in live_sets(schedule, p, m, v):
        if not len(rows):
            out.append(0)
            continue
        weights = np.array([saved[s] for s in stages] + [deferred[s] for s in stages], dtype=np.float64)
        out.append(float((rows @ weights).max()))
    return out


@lru_cache(maxsize=512)
def compute_groups(schedule: str, p: int, m: int, v: int | None) -> tuple:
    """Per rank, its runs of one stage's consecutive compute actions in order (the groups ZeRO-3's microbatch
    policy gathers around: pipegpt.schedule.lowering.add_unshard_reshard) as (stages, counts): the run's stage
    and a [runs x 4] matrix of its F, B, I and W counts."""
    import numpy as np

    kinds = {Kind.F: 0, Kind.B: 1, Kind.I: 2, Kind.W: 3}
    out = []
    for actions in structure(schedule, p, m, v).plan.flattened().ranks:  # a pair: its halves in order
        stages, counts = [], []
        for a in actions:
            if a.kind not in kinds:
                continue
            if not stages or stages[-1] != a.stage:
                stages.append(a.stage)
                counts.append([0, 0, 0, 0])
            counts[-1][kinds[a.kind]] += 1
        out.append((np.array(stages, dtype=np.int64), np.array(counts, dtype=np.float64).reshape(-1, 4)))
    return tuple(out)


@lru_cache(maxsize=None)
def stage_placement(schedule: str, p: int, v: int | None) -> tuple:
    """Stage -> rank: the schedule's placement, whatever the microbatches."""
    return SCHEDULES[schedule].stage_to_rank(p, v)


@lru_cache(maxsize=None)
def splits_backward(schedule: str) -> bool:
    return structure(schedule, 2, 4, None).split
