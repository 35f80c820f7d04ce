"""Inference's plans are data: the decode loop (generation) with its token feedback as a dependency the validator and
the simulator see, its steady state's bubble against the closed form, and evaluation's forward-only plans; both
shown by `pipegpt simulate`."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest

from helpers import assert_one_line_error, invoke
from pipegpt.schedule import Plan, PlanError, lower, schedule_spec, validate
from pipegpt.schedule.actions import F
from pipegpt.schedule.generators import decode_plan, decode_position
from pipegpt.observe.simulate_report import steady_state_bubble
from pipegpt.schedule.simulate import Costs, simulate
from pipegpt.schedule.validate import dependencies


def test_the_decode_plan_runs_every_group_once_per_step_and_feeds_tokens_back():
    plan = validate(decode_plan(3, 2, 4))
    assert plan.num_microbatches == 8 and plan.stage_to_rank == (0, 1, 2)
    assert [str(a) for a in plan.ranks[1][:4]] == ["1F0", "1F1", "1F2", "1F3"]
    assert decode_position(plan, 5) == (2, 1)
    assert dependencies(F(0, 3), plan) == [F(2, 1)]  # group 1's step 1 starts from its step 0's token
    assert dependencies(F(0, 1), plan) == [] and dependencies(F(1, 3), plan) == [F(0, 3)]


def test_the_validator_sees_the_token_feedback():
    """An order that is only circular through the feedback (rank 0 starts group 0's next step before group 1's
    prefill, rank 1 serves group 1 first) is refused; without the feedback it would pass."""
    ranks = ((F(0, 0), F(0, 2), F(0, 1), F(0, 3)), (F(1, 1), F(1, 0), F(1, 2), F(1, 3)))
    looped = Plan("decode", 4, (0, 1), ranks, meta={"decode_groups": 2, "decode_steps": 2})
    with pytest.raises(PlanError, match="circular wait"):
        validate(looped)
    validate(Plan("decode", 4, (0, 1), ranks))


@pytest.mark.parametrize("stages,groups,comm", [(4, 4, 0), (4, 6, 0), (4, 2, 0), (4, 1, 0), (2, 1, 0), (4, 4, 1),
                                                 (3, 5, Fraction(1, 2)), (1, 1, 0)])
def test_the_steady_state_bubble_is_the_closed_form(stages, groups, comm):
    """A decode step lasts a group's round trip through the stages (S x (F + comm), the feedback hop included) or
    the G forwards a rank works, whichever is longer: the bubble is 1 - G F / max(G F, S (F + comm))."""
    plan = decode_plan(stages, groups, 6)
    costs = Costs.uniform(stages, F=2, B=4, comm=comm)
    timeline = simulate(plan, costs)
    hop = comm if stages > 1 else 0
    expected = 1 - Fraction(groups * 2) / max(groups * 2, stages * (2 + hop))
    assert steady_state_bubble(timeline, plan) == [expected] * stages
    assert steady_state_bubble(simulate(decode_plan(stages, groups, 2), costs), decode_plan(stages, groups, 2)) \
        is None  # no decode step both entered and left inside the loop


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_forward_only_plan_has_the_pipelines_fill_and_drain(schedule):
    p, m = 4, 8
    plan = validate(lower(schedule_spec(schedule).build(p, m, None).compute_only().forward_only()))
    timeline = simulate(plan, Costs.uniform(p, F=1, B=2))
    assert timeline.bubble_fraction == Fraction(p - 1, m + p - 1)


def test_simulate_shows_the_decode_loop_and_forward_only_plans():
    decode = invoke("simulate", "--decode-steps", "6", "-p", "4", "-m", "2", "--costs", "F=1,comm=0", "--json")
    assert decode.exit_code == 0, decode.output
    rec = json.loads(decode.stdout)
    assert (rec["schedule"], rec["decode_groups"], rec["decode_steps"]) == ("decode", 2, 6)
    assert rec["steady_state_bubble"] == 0.5 and rec["steady_state_bubble_per_rank"] == [0.5] * 4
    text = invoke("simulate", "--decode-steps", "6", "-p", "4", "-m", "4").stdout
    assert "steady state      0.0% bubble" in text and "peak live         forward only" in text
    forward = invoke("simulate", "--forward-only", "-p", "4", "-m", "8", "-s", "1f1b", "--json")
    rec = json.loads(forward.stdout)
    assert rec["schedule"] == "1f1b-forward" and rec["bubble_fraction"] == pytest.approx(3 / 11)
    assert rec["peak_live_microbatches_per_rank"] is None
    assert all(a.endswith(tuple("0123456789")) and "F" in a for acts in rec["plan"] for a in acts)
    assert_one_line_error(invoke("simulate", "--decode-steps", "4", "-p", "2", "-m", "2", "-s", "1f1b"),
                          "--decode-steps", "leave out --schedule")
    assert_one_line_error(invoke("simulate", "--decode-steps", "4", "-p", "2"), "--microbatches (prompt groups)")
