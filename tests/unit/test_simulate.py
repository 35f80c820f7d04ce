"""The simulator against the schedule layer's oracles: closed-form bubbles and peak live activations.

Costs are integers or Fractions, so times and bubble fractions are exact and the closed forms are checked with ==.
"""
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipegpt.schedule import SCHEDULES, Action, Kind, Plan, ScheduleError, build_plan, lower, validate
from pipegpt.schedule.simulate import Costs, Event, Timeline, simulate
from pipegpt.schedule.validate import dependencies

PS = range(1, 9)
MS = range(1, 33)
FAST = settings(max_examples=40, deadline=None)


def exact(num_stages, F=1, B=2, W=1):
    """Integer costs: exact times and a Fraction bubble, and much faster than Fraction costs."""
    return Costs.uniform(num_stages, F, B, W)


# ---------------------------------------------------------------------------------------------------------
# closed forms


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_and_peak_live_are_exact_closed_forms(name):
    for p in PS:
        for m in MS:
            tl = simulate(build_plan(name, p, m), exact(p))
            assert tl.bubble_fraction == Fraction(p - 1, m + p - 1), (name, p, m)
            assert tl.makespan == (m + p - 1) * 3
            # GPipe holds every microbatch on every rank; 1F1B holds p - r on rank r
            want = [m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)]
            assert tl.peak_live_microbatches_per_rank == want, (name, p, m)


@FAST
@given(name=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(1, 8), m=st.integers(1, 32),
       f=st.fractions(Fraction(1, 10), 10), b=st.fractions(Fraction(1, 10), 10))
def test_gpipe_and_1f1b_bubble_at_any_uniform_cost(name, p, m, f, b):
    tl = simulate(build_plan(name, p, m), Costs.uniform(p, f, b))
    assert tl.bubble_fraction == Fraction(p - 1, m + p - 1)


@FAST
@given(p=st.integers(1, 8), m=st.integers(1, 32), f=st.floats(0.01, 100), b=st.floats(0.01, 100))
def test_1f1b_bubble_with_float_costs(p, m, f, b):
    tl = simulate(build_plan("1f1b", p, m), Costs.uniform(p, f, b))
    assert math.isclose(tl.bubble_fraction, (p - 1) / (m + p - 1), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble_is_exact_closed_form(v):
    for p in PS:
        for m in range(p, 33, p):
            plan = build_plan("interleaved-1f1b", p, m, v)
            tl = simulate(plan, exact(plan.num_stages))
            assert tl.bubble_fraction == Fraction(p - 1, v * m + p - 1), (p, m, v)


@FAST
@given(p=st.integers(1, 8), k=st.integers(1, 4), v=st.integers(1, 4),
       f=st.fractions(Fraction(1, 10), 10), b=st.fractions(Fraction(1, 10), 10))
def test_interleaved_bubble_at_any_uniform_cost(p, k, v, f, b):
    m = k * p
    plan = build_plan("interleaved-1f1b", p, m, v)
    assert simulate(plan, Costs.uniform(plan.num_stages, f, b)).bubble_fraction == Fraction(p - 1, v * m + p - 1)


def _zb_vs_1f1b(p, m):
    costs = Costs.uniform(p, 1, 2, 1)  # F = I = W = 1
    return simulate(build_plan("zb-h1", p, m), costs), simulate(build_plan("1f1b", p, m), costs)


def test_zb_h1_peak_live_equals_1f1b_and_bubble_is_a_third():
    for p in PS:
        for m in MS:
            zb, ofob = _zb_vs_1f1b(p, m)
            assert max(zb.peak_live_microbatches_per_rank) == max(ofob.peak_live_microbatches_per_rank), (p, m)
            if m >= p:  # the paper's one third
                assert 3 * zb.idle_time <= ofob.idle_time, (p, m)
            else:  # too few microbatches to fill with W: m = 1 cannot do better than two thirds
                assert 3 * zb.idle_time <= 2 * ofob.idle_time, (p, m)


# ---------------------------------------------------------------------------------------------------------
# the event model


def test_comm_latency_between_ranks():
    c = Fraction(1, 3)
    tl = simulate(build_plan("1f1b", 2, 1), Costs.uniform(2, 1, 2, comm=c))
    times = {(e.rank, str(e.action)): (e.start, e.end) for e in tl.events}
    assert times == {(0, "0F0"): (0, 1), (1, "1F0"): (1 + c, 2 + c), (1, "1B0"): (2 + c, 4 + c),
                     (0, "0B0"): (4 + 2 * c, 6 + 2 * c)}
    assert tl.makespan == 6 + 2 * c


def test_messages_between_stages_on_one_rank_are_free():
    plan = build_plan("zbv", 1, 4)  # both stages of the V on rank 0
    assert simulate(plan, Costs.uniform(2, 1, 2, comm=5)).makespan == simulate(plan, Costs.uniform(2, 1, 2)).makespan


def test_split_backward_costs():
    tl = simulate(build_plan("zb-h1", 2, 2), Costs.uniform(2, 1, 2, Fraction(1, 2)))
    durations = {e.action.kind: e.end - e.start for e in tl.events}
    assert durations == {Kind.F: 1, Kind.I: Fraction(3, 2), Kind.W: Fraction(1, 2)}


def test_per_stage_costs_and_activation_bytes():
    costs = Costs.from_json({"F": [1, 2, 1, 1], "B": [2, 4, 2, 2], "act_bytes": [10, 20, 30, 40]}, 4)
    tl = simulate(build_plan("1f1b", 4, 8), costs)
    assert tl.peak_live_microbatches_per_rank == [4, 3, 2, 1]
    assert tl.peak_activation_bytes_per_rank == [40, 60, 60, 40]
    assert simulate(build_plan("1f1b", 4, 8), Costs.uniform(4)).peak_activation_bytes_per_rank is None


def test_lowered_plan_simulates_like_the_compute_plan():
    for name in SCHEDULES:
        plan = build_plan(name, 3, 6)
        costs = Costs.uniform(plan.num_stages, 1, 2, 1, comm=Fraction(1, 4))
        a, b = simulate(plan, costs), simulate(lower(plan), costs)
        assert [(e.rank, e.action, e.start, e.end) for e in a.events] == \
               [(e.rank, e.action, e.start, e.end) for e in b.events]


def test_events_follow_plan_order_and_dependencies():
    plan = build_plan("dualpipev", 3, 7)
    costs = Costs.uniform(plan.num_stages, 1, 3, 1, comm=Fraction(1, 2))
    tl = simulate(plan, costs)
    assert [[e.action for e in tl.events_of(r)] for r in range(3)] == [list(a) for a in plan.flattened().ranks]
    end = {e.action: e.end for e in tl.events}
    for e in tl.events:
        for d in dependencies(e.action, plan):
            assert e.start >= end[d] + (costs.comm if plan.stage_to_rank[d.stage] != e.rank else 0)
        assert e.end - e.start == costs.duration(e.action)


def test_bad_plan_names_rank_and_step():
    ok = build_plan("1f1b", 2, 2)
    swapped = ok.with_ranks([ok.ranks[0], (ok.ranks[1][1], ok.ranks[1][0]) + ok.ranks[1][2:]])  # 1B0 before 1F0
    with pytest.raises(ScheduleError, match=r"rank 1 step 0"):
        simulate(swapped, Costs.uniform(2))


def test_costs_must_match_stage_count():
    with pytest.raises(ScheduleError, match="costs are for 4 stages.*8"):
        simulate(build_plan("zbv", 4, 8), Costs.uniform(4))


# ---------------------------------------------------------------------------------------------------------
# Timeline on its own (as a measured trace would build it)


def test_timeline_metrics_from_hand_built_events():
    A = Action.parse
    events = [Event(0, A("0F0"), 10.0, 11.0), Event(1, A("1F0"), 11.5, 12.5), Event(1, A("1B0"), 12.5, 14.5),
              Event(0, A("0F1"), 11.0, 12.0), Event(0, A("0B0"), 15.0, 17.0), Event(0, A("0B1"), 17.0, 19.0)]
    tl = Timeline(events, 2, schedule="measured", num_microbatches=2, stage_to_rank=(0, 1),
                  activation_bytes=(100, 7), time_unit="s")
    assert tl.makespan == 9.0
    assert tl.busy_per_rank == [6.0, 3.0]
    assert tl.bubble_fraction == pytest.approx(1 - 9 / 18)
    assert tl.bubble_fraction_per_rank == pytest.approx([1 - 6 / 9, 1 - 3 / 9])
    assert tl.peak_live_microbatches_per_rank == [2, 1]
    assert tl.peak_activation_bytes_per_rank == [200, 7]
    s = tl.summary()
    assert s["makespan"] == 9.0 and s["peak_live_microbatches_per_rank"] == [2, 1]


def test_live_until_w_when_backward_is_split():
    A = Action.parse
    events = [Event(0, A("0F0"), 0, 1), Event(0, A("0I0"), 1, 2), Event(0, A("0F1"), 2, 3),
              Event(0, A("0W0"), 3, 4), Event(0, A("0I1"), 4, 5), Event(0, A("0W1"), 5, 6)]
    assert Timeline(events, 1).peak_live_microbatches_per_rank == [2]
    # back to back: one ends exactly when the next starts, so never two live at once
    events = [Event(0, A("0F0"), 0, 1), Event(0, A("0B0"), 1, 2), Event(0, A("0F1"), 2, 3), Event(0, A("0B1"), 3, 4)]
    assert Timeline(events, 1).peak_live_microbatches_per_rank == [1]


# ---------------------------------------------------------------------------------------------------------
# every generated plan, and its lowering, validates and simulates


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(1, 6), m=st.integers(1, 16),
       v=st.integers(1, 3), comm=st.fractions(0, 2))
def test_generated_and_lowered_plans_validate(name, p, m, v, comm):
    try:
        plan = build_plan(name, p, m, v if name == "interleaved-1f1b" else None)
    except ScheduleError:
        assert (name == "interleaved-1f1b" and m % p) or (name == "dualpipev" and m < 2 * p)
        return
    validate(plan)
    lowered = lower(plan)
    validate(lowered)
    assert lowered.compute_only() == plan
    costs = Costs.uniform(plan.num_stages, 1, 2, 1, comm=comm)
    tl = simulate(lowered, costs)
    assert sum(tl.busy_per_rank) == sum(costs.duration(a) for acts in plan.ranks for a in acts)
    assert 0 <= tl.bubble_fraction < 1


# ---------------------------------------------------------------------------------------------------------
# costs


def test_costs_uniform_defaults():
    c = Costs.uniform(3)
    assert c.forward == (1.0,) * 3 and c.backward == (2.0,) * 3 and c.weight == (1.0,) * 3 and c.comm == 0
    assert c.activation_bytes is None
    assert Costs.uniform(2, F=2, B=4, W=1, comm=0.5, activation_bytes=8).activation_bytes == (8, 8)


def test_costs_parse():
    c = Costs.parse("F=1, b=3 ,W=0.5,COMM=0.1,act_bytes=1e6", 2)
    assert c == Costs((1, 1), (3, 3), (0.5, 0.5), 0.1, (1e6, 1e6))
    assert Costs.parse("", 2) == Costs.uniform(2, 1.0, 2.0)
    assert Costs.parse("B=4", 1).weight == (2.0,)


def test_costs_from_json(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text('{"F": [1.2, 1, 1, 1.5], "B": [2, 2, 2, 3], "W": 1, "comm": 0.1}')
    c = Costs.from_json(path, 4)
    assert c.forward == (1.2, 1, 1, 1.5) and c.weight == (1, 1, 1, 1) and c.comm == 0.1
    assert Costs.from_json(str(path), 4) == c


@pytest.mark.parametrize("make,pattern", [
    (lambda: Costs.parse("F=1,X=2", 2), r"unknown key 'x'; valid keys: F, B, W, comm, act_bytes"),
    (lambda: Costs.parse("F=-1", 2), r"F=-1 must be a finite number >= 0"),
    (lambda: Costs.parse("F=nan", 2), r"F=nan"),
    (lambda: Costs.parse("F=abc", 2), r"F='abc' is not a number"),
    (lambda: Costs.parse("F", 2), r"'F' is not KEY=VALUE"),
    (lambda: Costs.parse("B=2,W=3", 2), r"W=3 > B=2 on stage 0"),
    (lambda: Costs.parse("F=1,f=2", 2), r"'f' given twice"),
    (lambda: Costs.from_json({"F": 1, "f": 2}, 2), r"given twice \(keys are case-insensitive\)"),
    (lambda: Costs.from_json({"F": [1, 2, 3]}, 4), r"F has 3 values but the plan has 4 stages"),
    (lambda: Costs.from_json({"B": [2, 2], "W": [1, 3]}, 2), r"W=3 > B=2 on stage 1"),
    (lambda: Costs.from_json({"comm": [1, 2]}, 2), r"comm must be one number"),
    (lambda: Costs.from_json({"F": "fast"}, 2), r"F='fast' must be a number"),
    (lambda: Costs.from_json({"F": [1, float("nan")]}, 2), r"F\[1\]=nan"),
    (lambda: Costs.from_json({"speed": 1}, 2), r"unknown key 'speed'"),
    (lambda: Costs.from_json("/nonexistent/costs.json", 2), r"cannot read /nonexistent/costs.json"),
    (lambda: Costs.uniform(2, F=-1), r"F=-1"),
])
def test_costs_errors_are_one_line_schedule_errors(make, pattern):
    with pytest.raises(ScheduleError, match=pattern) as info:
        make()
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# the other parallel axes


def test_tensor_parallel_comm_lengthens_forward_and_input_backward_not_weight():
    plan = build_plan("zb-h1", 2, 4)
    tl = simulate(plan, Costs.parse("F=1,B=2,W=1,tp_comm=1", 2))
    durations = {e.action.kind.value: e.end - e.start for e in tl.events}
    assert durations == {"F": 2, "I": 2, "W": 1}


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_tensor_parallel_comm_keeps_the_1f1b_closed_form(p, m):
    tl = simulate(build_plan("1f1b", p, m), Costs.parse("F=1,B=2,tp_comm=1", p))
    assert tl.makespan == (m + p - 1) * (1 + 2 + 2 * 1)


def test_data_parallel_allreduce_starts_when_each_stage_is_done_and_can_end_the_step():
    plan = build_plan("1f1b", 2, 4)
    free = simulate(plan, Costs.parse("F=1,B=2", 2))
    assert free.makespan == 15  # rank 1's last B ends at 14, rank 0's at 15
    assert simulate(plan, Costs.parse("F=1,B=2,dp_comm=1", 2)).makespan == 16  # hidden on rank 1, not rank 0
    tl = simulate(plan, Costs.parse("F=1,B=2,dp_comm=3", 2))
    assert tl.makespan == 18 and tl.bubble_fraction > free.bubble_fraction


def test_bad_axis_costs_are_named():
    with pytest.raises(ScheduleError, match="dp_comm"):
        Costs.parse("F=1,dp_comm=-1", 2)
