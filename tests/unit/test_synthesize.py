"""The schedule synthesizer (auto, auto-v): valid plans, never worse than the fixed schedules that fit the same
memory, within the memory limit, close to a lower bound no plan can beat."""
import itertools

import pytest

from pipegpt.schedule import ScheduleError, build_plan, lower, validate
from pipegpt.schedule.registry import SCHEDULES, fixed_plans
from pipegpt.schedule.simulate import Costs, simulate
from pipegpt.schedule.synthesis.synthesize import default_max_live, least_max_live, lower_bound

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


def bench_costs(name, p, cost_set):
    """benchmarks/bench_synthesize.py's cost sets: unit; comm (latency 0.2); head (a head worth 4 blocks)."""
    return per_stage_costs(name, p, head_blocks=4 if cost_set == "head" else 0, comm=0.2 if cost_set == "comm" else 0)


# The parent commit's makespans (python benchmarks/bench_synthesize.py's costs, default memory, default search),
# recorded before the synthesizer was made fast: no size may get slower.
RECORDED = [
    ("auto", 4, 16, "unit", 51.0), ("auto", 4, 16, "comm", 53.4), ("auto", 4, 16, "head", 243.0),
    ("auto", 6, 12, "unit", 41.0), ("auto", 6, 12, "comm", 45.0), ("auto", 6, 12, "head", 185.0),
    ("auto", 8, 32, "unit", 103.0), ("auto", 8, 32, "comm", 108.6), ("auto", 8, 32, "head", 487.0),
    ("auto-v", 4, 16, "unit", 49.5), ("auto-v", 4, 16, "comm", 53.5), ("auto-v", 4, 16, "head", 144.0),
    ("auto-v", 6, 12, "unit", 38.5), ("auto-v", 6, 12, "comm", 45.5), ("auto-v", 6, 12, "head", 108.0),
    ("auto-v", 8, 32, "unit", 99.5), ("auto-v", 8, 32, "comm", 109.4), ("auto-v", 8, 32, "head", 288.0),
]


@pytest.mark.parametrize("name,p,m,cost_set,recorded", RECORDED)
def test_no_slower_plan_than_the_recorded_one(name, p, m, cost_set, recorded):
    syn = SCHEDULES[name].synthesize(p, m, None, bench_costs(name, p, cost_set))
    assert syn.makespan <= recorded + 1e-9, (syn.makespan, recorded)
    assert simulate(syn.plan, bench_costs(name, p, cost_set)).makespan == syn.makespan


def test_fast_simulate_gives_the_simulators_makespan_and_peak_to_the_bit():
    from fractions import Fraction
    import random

    from pipegpt.schedule.synthesis.fast_simulate import evaluate
    from pipegpt.schedule.synthesis.list_scheduler import Problem

    rng = random.Random(1)
    checked = 0
    for name, p in itertools.product(("auto", "auto-v"), (2, 3)):
        placement = SCHEDULES[name].stage_to_rank(p)
        n = len(placement)
        for m in (1, 3, 2 * p):
            forward = tuple(rng.choice([0, 1, Fraction(1, 3), 0.7, 2]) for _ in range(n))
            backward = tuple(2 * f + rng.choice([0, 1]) for f in forward)
            costs = Costs(forward, backward, tuple(rng.choice([0, b / 2, b]) for b in backward),
                          rng.choice([0, 0.2, Fraction(1, 7)]), None, tuple(rng.choice([0, 0.1]) for _ in range(n)),
                          tuple(rng.choice([0, 0.5, 3]) for _ in range(n)))
            problem = Problem(placement, m, costs)
            for plan in fixed_plans(placement, p, m) + [SCHEDULES[name].synthesize(p, m, None, costs).plan]:
                timeline = simulate(plan, costs)
                got = evaluate(problem, problem.encode(plan))
                assert got == (timeline.makespan, max(timeline.peak_live_microbatches_per_rank)), (plan.name, got)
                assert type(got[0]) is type(timeline.makespan)
                checked += 1
    assert checked > 30


def random_plan(placement, m, rng):
    """A valid plan in a random order: each step one rank (at random) runs one action whose inputs are done."""
    from pipegpt.schedule.actions import Action, Kind, Plan

    n, num_ranks = len(placement), max(placement) + 1
    done, ranks = set(), [[] for _ in range(num_ranks)]
    todo = {(s, kind, mb) for s in range(n) for kind in (Kind.F, Kind.I, Kind.W) for mb in range(m)}
    while todo:
        ready = sorted(a for a in todo if all(
            d in done for d in ([(a[0] - 1, Kind.F, a[2])] if a[1] is Kind.F and a[0] else []) +
            ([(a[0], Kind.F, a[2])] + ([(a[0] + 1, Kind.I, a[2])] if a[0] + 1 < n else []) if a[1] is Kind.I else []) +
            ([(a[0], Kind.I, a[2])] if a[1] is Kind.W else [])))
        a = rng.choice(ready)
        todo.remove(a)
        done.add(a)
        ranks[placement[a[0]]].append(Action(*a))
    return Plan("random", m, placement, tuple(map(tuple, ranks)))


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_lower_bound_never_exceeds_any_plans_makespan_at_its_own_peak_memory():
    """Every fixed schedule, the synthesized ones at every memory limit and random valid orders: the bound for
    the plan's own peak live memory is never above the plan's makespan."""
    import random

    rng = random.Random(7)
    checked = 0
    for name, p, cost_set in itertools.product(("auto", "auto-v"), (2, 3, 4), ("unit", "comm", "head")):
        placement = SCHEDULES[name].stage_to_rank(p)
        costs = bench_costs(name, p, cost_set)
        least = least_max_live(placement)
        for m in microbatch_counts(p):
            plans = fixed_plans(placement, p, m) + [random_plan(placement, m, rng) for _ in range(2 if m <= p else 0)]
            plans += [SCHEDULES[name].synthesize(p, m, None, costs, limit, search_evaluations=0).plan
                      for limit in sorted({least, least + 1, default_max_live(placement)})]
            for plan in plans:
                timeline = simulate(plan, costs)
                peak = max(timeline.peak_live_microbatches_per_rank)
                assert lower_bound(placement, m, costs, peak) <= timeline.makespan + 1e-9, (name, p, m, plan.name)
                checked += 1
    assert checked > 250


# Optimal makespans proven by an exact solver (OR-Tools CP-SAT: F, I, W on each rank without overlap, every
# dependency with its message latency, live stage-microbatches from F's start to W's end within max_live),
# run offline; the bench's costs. name p m costs max_live optimum
EXACT = """
auto-v 2 2 comm 4 7.1    auto-v 2 3 comm 3 11.7   auto-v 2 4 comm 4 13.1   auto-v 2 4 comm 3 15.1
auto-v 2 4 unit 3 13.5   auto-v 2 6 head 3 54.5   auto-v 3 2 comm 6 9.2    auto-v 3 3 comm 3 17.2
auto-v 3 3 comm 6 11.2   auto-v 3 3 head 3 28.5   auto-v 3 4 unit 6 13.0   auto-v 3 4 head 6 36.5
auto-v 3 6 unit 6 19.0   auto-v 3 6 head 3 55.5   auto 2 4 comm 2 13.8     auto 2 6 comm 2 19.8
auto 3 3 comm 3 11.8     auto 3 4 comm 3 15.6     auto 3 6 comm 3 21.6     auto 3 6 unit 3 20.0
auto 3 6 unit 2 25.0     auto 3 4 head 2 62.0     auto 3 6 comm 1 46.8     auto 2 6 head 1 91.0
"""


def test_lower_bound_is_at_most_the_proven_optimum_and_meets_it_where_tight():
    fields = EXACT.split()
    cases = [fields[i:i + 6] for i in range(0, len(fields), 6)]
    met = 0
    for name, p, m, cost_set, max_live, optimum in cases:
        p, m, max_live, optimum = int(p), int(m), int(max_live), float(optimum)
        placement = SCHEDULES[name].stage_to_rank(p)
        bound = lower_bound(placement, m, bench_costs(name, p, cost_set), max_live)
        assert bound <= optimum + 1e-9, (name, p, m, cost_set, max_live, bound, optimum)
        syn = SCHEDULES[name].synthesize(p, m, None, bench_costs(name, p, cost_set), max_live)
        assert syn.makespan >= optimum - 1e-9  # and no plan beats the optimum either
        met += abs(bound - optimum) < 1e-9
    assert met >= 10


def test_memory_bound_for_ranks_with_several_stages():
    """auto-v, p 8, m 32, latency 0.2, 16 live stage-microbatches per rank: rank 7 (stages 7 and 8) starts at 4.9,
    and its first I can start only at 15.7 (the round trip below stage 8); until then it runs forwards alone, at
    most 16 of 0.5. So it idles at least 15.7 - 8 before its 96 units of work: 103.7, not the 100.9 of the
    bounds that ignore memory."""
    placement = SCHEDULES["auto-v"].stage_to_rank(8)
    costs = bench_costs("auto-v", 8, "comm")
    assert lower_bound(placement, 32, costs) == pytest.approx(100.9)
    assert lower_bound(placement, 32, costs, 16) == pytest.approx(103.7)
    assert lower_bound(placement, 32, costs, 32) == pytest.approx(100.9)  # memory enough: no stall to count


@pytest.mark.slow
def test_large_sizes_walk_a_bounded_number_of_actions(monkeypatch):
    """Issue 32's targets (p 32 and 64 at m = 4p, unit costs) counted in actions the synthesizer walks, not in
    seconds (a timed assertion fails on a loaded machine; benchmarks/bench_synthesize.py gives the seconds). The
    search's budgets hold it near a few passes over the plan plus SEARCH_ACTIONS and SAMPLE_ACTIONS."""
    from pipegpt.schedule.synthesis import synthesize as module

    walked = {"actions": 0}
    list_schedule, evaluate = module.list_schedule, module.evaluate

    def counting_list_schedule(problem, *args, **kwargs):
        walked["actions"] += sum(len(stages) for stages in problem.stages_of) * problem.m * 3
        return list_schedule(problem, *args, **kwargs)

    def counting_evaluate(problem, ranks):
        walked["actions"] += sum(map(len, ranks))
        return evaluate(problem, ranks)

    monkeypatch.setattr(module, "list_schedule", counting_list_schedule)
    monkeypatch.setattr(module, "evaluate", counting_evaluate)
    for name, p, m in (("auto", 32, 128), ("auto-v", 32, 128), ("auto", 64, 256), ("auto-v", 64, 256)):
        walked["actions"] = 0
        SCHEDULES[name].synthesize(p, m)
        plan_actions = 3 * p * m  # F, B and W of every microbatch on every rank
        budget = 8 * plan_actions + module.SEARCH_ACTIONS + module.SAMPLE_ACTIONS
        assert plan_actions <= walked["actions"] <= budget, (name, p, m, walked["actions"], budget)


def test_iterated_greedy_narrows_the_gap_at_p8_m32_with_latency():
    """Issue 32's case (auto-v, p 8, m 32, latency 0.2, default memory): the variants alone reach 108.1 (4.2% above
    the bound 103.7); turning a few of the list scheduler's choices finds 107.3 (3.5%), the same plan every run."""
    costs = bench_costs("auto-v", 8, "comm")
    syn = SCHEDULES["auto-v"].synthesize(8, 32, None, costs)
    assert syn.makespan == pytest.approx(107.3) and syn.lower_bound == pytest.approx(103.7)
    assert simulate(syn.plan, costs).makespan == syn.makespan
    assert SCHEDULES["auto-v"].synthesize(8, 32, None, costs).plan.ranks == syn.plan.ranks
