"""Evaluation's forward-only plan: every schedule has one, valid, on the same ranks, with the plan's forwards.
(That the runtime running it gives the one-process validation loss is tests/distributed/test_evaluate.py.)"""
from __future__ import annotations

import pytest

from pipegpt.schedule import SCHEDULES, ScheduleError, build_plan, lower, validate
from pipegpt.planner.run_plan import evaluation_plan


@pytest.mark.parametrize("name,p,m", [(n, p, m) for n in SCHEDULES for p, m in ((2, 4), (4, 8))])
def test_every_schedule_has_a_valid_forward_only_plan(name, p, m):
    try:
        plan = validate(lower(build_plan(name, p, m)))
    except ScheduleError:
        pytest.skip(f"{name} does not take {p} x {m}")
    forward = evaluation_plan(plan)
    assert forward.is_forward_only and forward.stage_to_rank == plan.stage_to_rank
    assert sorted(str(a) for acts in forward.compute_only().ranks for a in acts) == \
        sorted(str(a) for acts in plan.flattened().ranks for a in acts if a.kind.value == "F")  # pairs: halves
