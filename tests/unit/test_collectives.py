"""Collectives in the action IR: kinds by category, the REDUCE_GRAD pass (placement, idempotence, lowering
keeps it), its text form, validation, its cost in the simulator, and the runtime dispatching it.
(That a dp run gives the one-process gradients is tests/distributed/test_pipeline_oracle.py's data-parallel
cases.)"""
from __future__ import annotations

import pytest

from pipegpt.schedule import (SCHEDULES, Action, Kind, ScheduleError, add_reduce_grad, build_plan,
                              last_gradient_actions, lower, validate, without_reduce_grad)
from pipegpt.schedule.actions import NO_MICROBATCH, REDUCE_GRAD, Category, Plan
from pipegpt.schedule.messages import comm_batches, message_peaks
from pipegpt.schedule.render import to_chrome_trace
from pipegpt.schedule.schedule_file import dump_schedule_text, parse_schedule_text
from pipegpt.schedule.simulate import Costs, Event, simulate


def valid_plans():
    for name in sorted(SCHEDULES):
        for p, m in ((2, 4), (3, 6), (4, 8)):
            try:
                yield name, validate(lower(build_plan(name, p, m)))
            except ScheduleError:
                continue


def with_actions(plan: Plan, rank: int, actions: str) -> Plan:
    ranks = list(plan.ranks)
    ranks[rank] = tuple(Action.parse(t) for t in actions.split())
    return plan.with_ranks(ranks)


def test_each_kind_has_its_category():
    assert {k.value: k.category for k in Kind} == {
        "F": Category.COMPUTE, "B": Category.COMPUTE, "I": Category.COMPUTE, "W": Category.COMPUTE,
        "SEND_F": Category.P2P, "RECV_F": Category.P2P, "SEND_B": Category.P2P, "RECV_B": Category.P2P,
        "REDUCE_GRAD": Category.COLLECTIVE, "UNSHARD": Category.COLLECTIVE, "RESHARD": Category.COLLECTIVE,
        "OVERLAP": Category.COMPUTE}  # a composite pair holds the compute line
    for k in Kind:
        assert [k.is_compute, k.is_p2p, k.is_collective].count(True) == 1


def test_a_collective_is_never_batched_with_messages():
    actions = [Action.parse(t) for t in "1F0 1SEND_F0 1REDUCE_GRAD 1RECV_B0 1B0 1UNSHARD".split()]
    assert comm_batches(actions) == [(1, 2), (3, 4)]


def test_a_plan_with_collectives_only_is_not_lowered():
    plan = add_reduce_grad(build_plan("1f1b", 1, 2))
    assert plan.to_text() == "0F0 0B0 0F1 0B1 0REDUCE_GRAD\n"
    assert not plan.is_lowered and plan.compute_only() == build_plan("1f1b", 1, 2)


# REDUCE_GRAD right after each stage's last B or W on its rank.
PLACEMENT = {
    ("1f1b", 2, 3): ["0F0 0F1 0B0 0F2 0B1 0B2 0REDUCE_GRAD",
                     "1F0 1B0 1F1 1B1 1F2 1B2 1REDUCE_GRAD"],
    ("zb-h1", 2, 3): ["0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2 0REDUCE_GRAD",
                      "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2 1REDUCE_GRAD"],
    # Rank 0 holds both ends of the V: stage 3 is done first, stage 0 (the tied embedding's owner) last.
    ("zbv", 2, 2): ["0F0 0F1 3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 3REDUCE_GRAD 0W0 0W1 0REDUCE_GRAD",
                    "1F0 2F0 1F1 2F1 2I0 1I0 2I1 1I1 2W0 1W0 2W1 2REDUCE_GRAD 1W1 1REDUCE_GRAD"],
    ("interleaved-1f1b", 2, 4): [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 2REDUCE_GRAD 0B2 0B3 0REDUCE_GRAD",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 3REDUCE_GRAD 1B2 1B3 1REDUCE_GRAD"],
}


@pytest.mark.parametrize("name,p,m", list(PLACEMENT))
def test_reduce_grad_follows_each_stages_last_gradient(name, p, m):
    plan = add_reduce_grad(build_plan(name, p, m))
    assert plan.as_strings() == [line.split() for line in PLACEMENT[(name, p, m)]]
    assert validate(plan) is plan


@pytest.mark.parametrize("name,plan", list(valid_plans()), ids=lambda x: x if isinstance(x, str) else "")
def test_the_pass_on_lowered_plans(name, plan):
    reduced = validate(add_reduce_grad(plan))
    assert add_reduce_grad(reduced) is reduced  # idempotent
    assert lower(add_reduce_grad(plan.compute_only())) == reduced  # the passes commute
    assert without_reduce_grad(reduced) == plan
    # messages batched as before, holding as many buffers
    assert [len(comm_batches(a)) for a in reduced.ranks] == [len(comm_batches(a)) for a in plan.ranks]
    assert message_peaks(reduced) == message_peaks(plan)
    for r, actions in enumerate(reduced.ranks):
        done = last_gradient_actions(actions)
        reductions = [(i, a.stage) for i, a in enumerate(actions) if a.kind is Kind.REDUCE_GRAD]
        assert sorted(s for _, s in reductions) == plan.stages_of(r)
        assert all(done[s] == i - 1 for i, s in reductions)
        # the worker gives a tensor shared by two stages of a rank to the one finishing last
        assert [s for _, s in reductions] == sorted(done, key=done.get)


def test_a_forward_only_plan_gets_none():
    plan = lower(build_plan("1f1b", 2, 4).forward_only())
    assert add_reduce_grad(plan) is plan


def test_lowering_keeps_a_collective_where_it_stands():
    plan = build_plan("1f1b", 2, 3)
    late = with_actions(plan, 0, "0F0 0F1 0B0 0F2 0B1 0B2 0REDUCE_GRAD")
    late = with_actions(late, 1, "1REDUCE_GRAD 1F0 1B0 1F1 1B1 1F2 1B2")  # invalid, but placement is kept
    lowered = lower(late)
    assert lowered.ranks[1][0] == REDUCE_GRAD(1)
    assert lowered.ranks[0][lowered.ranks[0].index(Action.parse("0B2")) + 1] == REDUCE_GRAD(0)


# text form


def test_text_form_round_trips():
    a = Action.parse("12REDUCE_GRAD")
    assert a == REDUCE_GRAD(12) == Action(12, Kind.REDUCE_GRAD, NO_MICROBATCH) and str(a) == "12REDUCE_GRAD"
    assert str(Action.parse("0UNSHARD")) == "0UNSHARD" and Action.parse("3RESHARD").kind is Kind.RESHARD
    plan = validate(add_reduce_grad(lower(build_plan("zbv", 2, 4))))
    assert parse_schedule_text(dump_schedule_text(plan)) == plan
    assert parse_schedule_text(plan.to_text(), default_name="zbv") == plan  # m counted from compute alone


@pytest.mark.parametrize("text", ["1REDUCE_GRAD0", "1UNSHARD3", "REDUCE_GRAD", "2F", "1REDUCE_GRAD-1"])
def test_bad_text_is_refused(text):
    with pytest.raises(ScheduleError, match="bad action"):
        Action.parse(text)


# validation


def test_validate_refuses_a_missing_reduction():
    plan = add_reduce_grad(lower(build_plan("1f1b", 2, 4)))
    missing = plan.with_ranks([plan.ranks[0], [a for a in plan.ranks[1] if a.kind is not Kind.REDUCE_GRAD]])
    with pytest.raises(ScheduleError, match=r"rank 1 .*missing 1REDUCE_GRAD: the plan reduces other stages'"):
        validate(missing)


def test_validate_refuses_a_reduction_before_the_last_gradient():
    plan = build_plan("1f1b", 2, 3)
    early = add_reduce_grad(with_actions(plan, 0, "0F0 0F1 0B0 0F2 0B1 0REDUCE_GRAD 0B2"))
    with pytest.raises(ScheduleError, match=r"rank 0 step 5 \(0REDUCE_GRAD\): reduces stage 0's gradients before 0B2"):
        validate(early)
    later = add_reduce_grad(with_actions(build_plan("zbv", 2, 2), 0,
                                         "0F0 0F1 3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 0W0 0W1 0REDUCE_GRAD 3REDUCE_GRAD"))
    assert validate(later) is later  # any place after the last gradient is valid


def test_validate_refuses_twice_and_a_microbatch_and_a_forward_only_reduction():
    plan = build_plan("1f1b", 2, 3)
    with pytest.raises(ScheduleError, match="0REDUCE_GRAD appears twice"):
        validate(add_reduce_grad(with_actions(plan, 0, "0F0 0F1 0B0 0F2 0B1 0B2 0REDUCE_GRAD 0REDUCE_GRAD")))
    numbered = add_reduce_grad(plan).with_ranks([plan.ranks[0] + (Action(0, Kind.REDUCE_GRAD, 0),),
                                                 add_reduce_grad(plan).ranks[1]])
    with pytest.raises(ScheduleError, match="REDUCE_GRAD acts on a whole stage: it takes no microbatch"):
        validate(numbered)
    forward = plan.forward_only()
    with pytest.raises(ScheduleError, match="missing 0B0"):  # reducing gradients makes it a training plan
        validate(forward.with_ranks([acts + (REDUCE_GRAD(r),) for r, acts in enumerate(forward.ranks)]))


def test_validate_unshard_and_reshard():
    plan = build_plan("1f1b", 2, 2)
    wrapped = with_actions(plan, 0, "0UNSHARD 0F0 0F1 0B0 0B1 0RESHARD")
    assert validate(wrapped) is wrapped
    for actions, problem in (("0F0 0UNSHARD 0F1 0B0 0B1 0RESHARD", "gathers stage 0's parameters after 0F0"),
                             ("0UNSHARD 0F0 0F1 0B0 0RESHARD 0B1", "frees stage 0's parameters before 0B1"),
                             ("0F0 0F1 0B0 0B1 0RESHARD", "has no 0UNSHARD to go with it")):
        with pytest.raises(ScheduleError, match=problem):
            validate(with_actions(plan, 0, actions))


# simulation


@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 8), ("zbv", 2, 4), ("interleaved-1f1b", 2, 4)])
def test_a_free_reduction_changes_no_simulation(name, p, m):
    plan = lower(build_plan(name, p, m))
    costs = Costs.uniform(plan.num_stages, comm=0.5)
    plain, reduced = simulate(plan, costs), simulate(add_reduce_grad(plan), costs)
    assert plain.events == reduced.events and plain.meta == reduced.meta and plain.summary() == reduced.summary()


def test_the_cost_is_charged_where_the_reduction_stands():
    plan = build_plan("zbv", 2, 2)
    costs = Costs.uniform(4, F=1, B=2, W=1)
    free = simulate(plan, costs)
    charged = Costs(costs.forward, costs.backward, costs.weight, dp_comm=(3, 1, 1, 5))
    assert free.makespan == 13  # rank 0's 3W1 ends at 11, its 0W1 at 13; rank 1's 2W1 at 12, 1W1 at 13
    # A plan without REDUCE_GRAD is charged as the pass places them: each after its stage's last B/W, one
    # reduction at a time per rank: rank 0 runs 3's from 11 to 16, then 0's to 19 (rank 1: 12-13, 13-14).
    assert simulate(plan, charged).makespan == 19 == simulate(add_reduce_grad(plan), charged).makespan
    late = add_reduce_grad(with_actions(plan, 0, "0F0 0F1 3F0 3I0 3F1 3I1 0I0 3W0 0I1 3W1 0W0 0W1 0REDUCE_GRAD "
                                                 "3REDUCE_GRAD"))
    timeline = simulate(late, charged)  # both launched at 13, one after the other
    assert timeline.makespan == 13 + 3 + 5 and timeline.meta["step_end"] == 21
    assert timeline.events == simulate(plan, charged).events  # launching takes no compute time


# the other readers of a timeline


def test_a_measured_reduction_is_traced_and_calibrates_nothing(tmp_path):
    from pipegpt.schedule.calibrate import compare
    from test_calibrate import write_run

    plan = add_reduce_grad(lower(build_plan("1f1b", 2, 4)))
    costs = Costs((1, 1.5), (2, 3), (1, 1.5))
    timeline = simulate(plan, costs)
    ends = {e.action: e.end for e in timeline.events}
    for r, actions in enumerate(plan.ranks):  # a measured launch: after the last B, 1/4 long
        for i, a in enumerate(actions):
            if a.kind is Kind.REDUCE_GRAD:
                timeline.events.append(Event(r, a, ends[actions[i - 1]], ends[actions[i - 1]] + 0.25))
    trace = to_chrome_trace(timeline)
    launch = [e for e in trace["traceEvents"] if e.get("cat") == "REDUCE_GRAD"]
    assert [(e["name"], e["args"]) for e in launch] == [("REDUCE_GRAD", {"stage": 0, "action": "0REDUCE_GRAD"}),
                                                       ("REDUCE_GRAD", {"stage": 1, "action": "1REDUCE_GRAD"})]
    c = compare(write_run(tmp_path / "run", plan, trace))
    got = c.calibration.costs
    assert (got.forward, got.backward, got.dp_comm) == (costs.forward, costs.backward, (0, 0))
    assert c.summary()["measured"]["comm_overhead_per_rank"] is None  # no messages in this trace
    assert c.fidelity == 1.0  # the launch after rank 0's last B does not lengthen the measured step
