"""The schedule synthesizer (auto, auto-v): valid plans, never worse than the fixed schedules that fit the same
memory, within the memory limit, close to a lower bound no plan can beat."""
import itertools

import pytest

from pipegpt.schedule import ScheduleError, build_plan, lower, validate
from pipegpt.schedule.registry import SCHEDULES, fixed_plans
from pipegpt.schedule.simulate import Costs, simulate
from pipegpt.schedule.synthesize import default_max_live, lower_bound

FIXED = {"auto": ("gpipe", "1f1b", "zb-h1"), "auto-v": ("zbv", "dualpipev")}


def microbatch_counts(p):
    return sorted({max(1, p // 2), p, 2 * p, 4 * p})


def per_stage_costs(name, p, head_blocks=0, comm=0):
    """A rank's share costs F=1, B=2, W=1 (split over its stages); the last stage also carries a head worth
    head_blocks of them."""
    placement = SCHEDULES[name].stage_to_rank(p)
    v = len(placement) // p
    forward = [1 / v] * len(placement)
    forward[-1] += head_blocks / v
    return Costs(tuple(forward), tuple(2 * f for f in forward), tuple(forward), comm)


def fixed_makespans(name, p, m, costs, max_live):
    """The makespan of every fixed schedule of the placement that fits max_live."""
    out = {}
    for plan in fixed_plans(SCHEDULES[name].stage_to_rank(p), p, m):
        timeline = simulate(plan, costs)
        if max(timeline.peak_live_microbatches_per_rank) <= max_live:
            out[plan.name] = timeline.makespan
    return out


@pytest.mark.parametrize("name", ["auto", "auto-v"])
def test_unit_costs_no_worse_than_fixed_and_within_two_percent_of_the_bound(name):
    worst_small_m = 0.0
    for p in range(2, 9):
        for m in microbatch_counts(p):
            costs = per_stage_costs(name, p)
            syn = SCHEDULES[name].synthesize(p, m, None, costs, search_evaluations=0)
            validate(lower(syn.plan))
            timeline = simulate(syn.plan, costs)
            assert timeline.makespan == syn.makespan
            assert max(timeline.peak_live_microbatches_per_rank) <= default_max_live(syn.plan.stage_to_rank)
            fixed = fixed_makespans(name, p, m, costs, syn.max_live)
            assert all(syn.makespan <= t + 1e-9 for t in fixed.values()), (p, m, syn.makespan, fixed)
            assert syn.lower_bound <= syn.makespan + 1e-9
            if m >= p:
                assert syn.gap <= 0.02, (p, m, syn.makespan, syn.lower_bound)
            else:
                worst_small_m = max(worst_small_m, syn.gap)
    assert worst_small_m <= 0.02  # reported in the closing note; at unit costs it is 0


@pytest.mark.parametrize("name,comm", [("auto", 0), ("auto-v", 0), pytest.param("auto-v", 0.3, marks=pytest.mark.slow)])
def test_heavy_last_stage_beats_every_fixed_schedule_that_is_not_near_the_bound(name, comm):
    for p in (2, 3, 4, 6, 8):
        for m in microbatch_counts(p):
            costs = per_stage_costs(name, p, head_blocks=4, comm=comm)
            syn = SCHEDULES[name].synthesize(p, m, None, costs)
            fixed = fixed_makespans(name, p, m, costs, syn.max_live)
            best = min(fixed.values())
            assert syn.makespan <= best + 1e-9, (p, m)
            if best > 1.02 * syn.lower_bound:
                assert syn.makespan < best - 1e-9, (p, m, syn.makespan, best, syn.lower_bound)


def test_a_named_order_is_that_schedule_action_for_action():
    """What run and simulate say ("auto = zb-h1's order", chosen_from) is the fixed plan itself: once the local
    search moves an action, the order is the synthesizer's own. The first costs (4 stages of 2, 3, 2 and 1
    blocks, a head worth one block) are ones where the search starts from zb-h1's plan and improves on it."""
    forward = (2.1, 3.0, 2.0, 2.0)
    cases = [(4, 16, Costs(forward, tuple(2.1 * f for f in forward), tuple(0.84 * f for f in forward)))]
    cases += [(p, m, per_stage_costs("auto", p, head_blocks=h)) for p in (2, 4) for m in (p, 4 * p) for h in (0, 4)]
    named = written = 0
    for p, m, costs in cases:
        syn = SCHEDULES["auto"].synthesize(p, m, None, costs)
        chosen = syn.plan.meta["from"]
        if chosen == "synthesized":
            written += 1
            assert all(syn.plan.ranks != plan.ranks for plan in fixed_plans(syn.plan.stage_to_rank, p, m)), (p, m)
        else:
            named += 1
            assert syn.plan.ranks == build_plan(chosen, p, m).ranks, (p, m, chosen)
    assert named and written  # both kinds of answer were checked
    assert SCHEDULES["auto"].synthesize(4, 16, None, cases[0][2]).plan.meta["from"] == "synthesized"


def test_message_latency_never_worse_than_fixed():
    for name, p in itertools.product(("auto", "auto-v"), (2, 5)):
        for m in microbatch_counts(p):
            costs = per_stage_costs(name, p, comm=0.3)
            syn = SCHEDULES[name].synthesize(p, m, None, costs, search_evaluations=0)
            fixed = fixed_makespans(name, p, m, costs, syn.max_live)
            assert syn.makespan <= min(fixed.values()) + 1e-9


@pytest.mark.parametrize("name,p,m", [("auto", 4, 8), ("auto", 3, 7), ("auto-v", 4, 8), ("auto-v", 3, 5)])
def test_memory_limit_is_never_exceeded(name, p, m):
    costs = per_stage_costs(name, p, head_blocks=2)
    least = len(SCHEDULES[name].stage_to_rank(p)) // p
    for max_live in range(least, 2 * p * least + 1):
        syn = SCHEDULES[name].synthesize(p, m, None, costs, max_live, search_evaluations=20)
        peak = max(simulate(syn.plan, costs).peak_live_microbatches_per_rank)
        assert peak <= max_live, (max_live, peak)
        assert syn.lower_bound <= syn.makespan + 1e-9


def test_more_memory_never_slower():
    costs = per_stage_costs("auto", 4, head_blocks=4, comm=0.3)
    times = [SCHEDULES["auto"].synthesize(4, 8, None, costs, limit, search_evaluations=0).makespan
             for limit in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and times[-1] < times[0]


def test_max_live_below_the_least_is_one_line_naming_it():
    with pytest.raises(ScheduleError, match="least that works is 2"):
        SCHEDULES["auto-v"].synthesize(4, 8, None, None, max_live=1)
    with pytest.raises(ScheduleError, match="least that works is 1"):
        SCHEDULES["auto"].synthesize(4, 8, None, None, max_live=0)


def test_lower_bound_is_tight_where_the_answer_is_known():
    # One rank: its work, nothing else. Unit costs, p stages: ZB-H1's 3m + p - 1 is optimal.
    assert lower_bound((0,), 5, Costs.uniform(1)) == 15
    assert lower_bound(tuple(range(4)), 8, Costs.uniform(4)) == 3 * 8 + 3
    # A heavy last stage: its arrival plus its own work.
    costs = Costs((1, 1, 5), (2, 2, 10), (1, 1, 5))
    assert lower_bound((0, 1, 2), 4, costs) == 2 + 4 * 15


def test_interleaved_placement_and_the_generators_agree():
    plan = build_plan("auto", 4, 8, 2)
    assert plan.stage_to_rank == SCHEDULES["interleaved-1f1b"].stage_to_rank(4, 2)
    validate(lower(plan))
    interleaved = simulate(build_plan("interleaved-1f1b", 4, 8, 2), Costs.uniform(8, 0.5, 1, 0.5))
    assert simulate(plan, Costs.uniform(8, 0.5, 1, 0.5)).makespan <= interleaved.makespan


def test_same_inputs_same_plan():
    costs = per_stage_costs("auto-v", 4, head_blocks=4, comm=0.3)
    a = SCHEDULES["auto-v"].synthesize(4, 8, None, costs)
    b = SCHEDULES["auto-v"].synthesize(4, 8, None, costs)
    assert a.plan.ranks == b.plan.ranks


def test_flexible_interleaving_runs_any_m_its_rounds_divide():
    costs = Costs.uniform(8, 0.5, 1, 0.5)
    for m in (1, 2, 3, 5, 6, 7, 10, 12):  # rounds m // 4 (at least 1) divide m
        validate(lower(build_plan("interleaved-1f1b", 4, m, 2)))
        simulate(build_plan("interleaved-1f1b", 4, m, 2), costs)
    for m in (9, 11, 13):
        with pytest.raises(ScheduleError, match=f"microbatches={m} does not divide"):
            build_plan("interleaved-1f1b", 4, m, 2)
