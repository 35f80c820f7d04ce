"""A schedule written for given costs and a memory limit: `--schedule auto` (one stage per rank, or
interleaved with --virtual-stages) and `auto-v` (two stages per rank in a V).

The fixed generators assume every action costs the same. Here the plan is made for the costs at
hand: an event-driven list scheduler (the zero-bubble paper's heuristic, generalised to real costs,
message latency and per-stage memory) runs in a few dozen priority variants, the fixed schedules
of the same placement that fit the limit join as candidates, the simulator times them all and the
fastest within the limit wins, so the result is never worse than the best fixed schedule. On small plans an
iterated greedy then reruns the winning variant with a few of its choices turned (_sample), and a local
search tries moving single actions earlier while the simulator says that helps. Where the costs have
all-to-alls inside actions (a2a_comm: MoE stages), adjacent forwards and backwards of two microbatches are then
paired (_pair_up) where the pair, its halves' communication hidden under each other's compute, makes the plan faster.

lower_bound() says how far from optimal the winner can be: no schedule of that placement, in any
order, with any split of the backward, finishes sooner.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field, replace
from numbers import Real

from ..actions import Action, Composite, Kind, Plan, ScheduleError
from ..lowering import lower
from ..simulate import simulate_order
from .fast_simulate import evaluate
from .list_scheduler import Problem, Variant, list_schedule
from ..timing_rule import Costs, hops, work_time

# Simulations the local search may spend after the list scheduler (a count, not seconds, so that every
# process that synthesizes the same inputs gets the same plan); it stops earlier once a pass over
# every rank finds nothing to move.
SEARCH_EVALUATIONS = 300
# ... and at most this many actions simulated in all, so that a large plan's search stays a fraction of a second.
SEARCH_ACTIONS = 300_000
# Runs of the iterated greedy (_sample; a seeded generator: the same plan every time), and the actions they may
# schedule in all; a plan too large for SAMPLES // 4 runs is not sampled (at p 16 and up a few dozen found nothing).
SAMPLES = 200
SAMPLE_ACTIONS = 300_000
FLIPS = 8  # at most this many choices turned at once
PAIR_REACH = 4  # how far after a forward (or backward) _pair_up looks for the other half of a pair
ORDER_CANDIDATES = 8  # plans timed under order matching (lowered and simulated in full) besides the winner
ENTERING = (4, 6)  # caps on a rank's microbatches in flight (Variant.entering), in eighths of the limit


@dataclass(frozen=True)
class Synthesis:
    """The synthesized plan and what it was measured against (all times in the costs' unit)."""

    plan: Plan
    makespan: Real
    lower_bound: Real
    max_live: int
    best_fixed: str | None  # the fastest fixed schedule of this placement that fits, if any
    best_fixed_makespan: Real | None
    variants_tried: int = 0
    notes: dict = field(default_factory=dict)

    @property
    def gap(self) -> float:
        """How far above the lower bound: 0.02 is 2%."""
        return float(self.makespan / self.lower_bound - 1) if self.lower_bound else 0.0


def stages_per_rank(stage_to_rank: tuple[int, ...]) -> int:
    return max(stage_to_rank.count(r) for r in set(stage_to_rank))


def least_max_live(stage_to_rank: tuple[int, ...]) -> int:
    """The smallest memory limit any schedule of this placement runs in: one microbatch per stage a rank owns."""
    return stages_per_rank(stage_to_rank)


def default_max_live(stage_to_rank: tuple[int, ...]) -> int:
    """1F1B's memory: p microbatches of a 1F1B stage, i.e. p x v stage-microbatches at v stages per rank."""
    return (max(stage_to_rank) + 1) * stages_per_rank(stage_to_rank)


def check_max_live(max_live: int, stage_to_rank: tuple[int, ...]) -> None:
    least = least_max_live(stage_to_rank)
    if max_live < least:
        raise ScheduleError(f"max-live={max_live} is below what any schedule of this placement runs in: each rank "
                            f"holds at least one microbatch per stage it owns, so the least that works is {least}")


def lower_bound(stage_to_rank: tuple[int, ...], num_microbatches: int, costs: Costs,
                max_live: int | None = None) -> Real:
    """No valid plan of this placement finishes sooner, whatever its order or backward split.

    Five bounds, the largest wins: (1) a rank has all its work to do, and until the first microbatch's
    forward reaches one of its stages it can only run forwards of its earlier stages; (2) the last
    backward-input of a stage ends after all of that stage's F and I, and the upstream chain of input
    gradients and stage 0's W still follows it; (3) the same from a stage's last forward, with the whole
    downstream path after it; (4) with a memory limit, a rank with one stage runs at most max_live forwards
    before its first backward, which comes back only after microbatch 0's round trip through the later
    stages; (5) the same for a rank with several stages (_memory_start_bound). Every action counts at its work
    alone (timing_rule.work_time): in a pair the other half's compute may hide its all-to-all (without
    all-to-alls, that is its duration to the bit).
    """
    m, n = num_microbatches, len(stage_to_rank)

    def d(action):
        return work_time(costs, action.kind, action.stage)
    fwd = [d(Action(s, Kind.F, 0)) for s in range(n)]
    inp = [d(Action(s, Kind.I, 0)) for s in range(n)]
    wgt = [d(Action(s, Kind.W, 0)) for s in range(n)]
    hop = hops(costs, stage_to_rank)
    arrive = [0] * n  # when microbatch 0's input can reach stage s
    for s in range(1, n):
        arrive[s] = arrive[s - 1] + fwd[s - 1] + hop[s - 1]
    # After stage s's last I: the input gradients still flow down to stage 0, whose W ends the step.
    upstream = [0] * n
    for s in range(1, n):
        upstream[s] = upstream[s - 1] + hop[s - 1] + inp[s - 1]
    upstream = [u + wgt[0] for u in upstream]
    upstream[0] = wgt[0]
    # After stage s's last F: the forward to the loss and the input gradients back to s.
    downstream = [0] * n
    for s in range(n - 2, -1, -1):
        downstream[s] = downstream[s + 1] + hop[s] + fwd[s + 1] + inp[s + 1] + hop[s]
    bound = 0
    for r in set(stage_to_rank):
        mine = [s for s in range(n) if stage_to_rank[s] == r]
        work = m * sum(fwd[s] + inp[s] + wgt[s] for s in mine)
        for s in mine:
            # Before microbatch 0 reaches stage s, only forwards of this rank's earlier stages can run
            # (every backward waits for the last stage, which waits for s).
            early = m * sum(fwd[t] for t in mine if t < s)
            bound = max(bound, arrive[s] + work - min(arrive[s], early))
        if max_live is not None and len(mine) == 1:
            s, ahead = mine[0], min(max_live, m)
            first_back = arrive[s] + fwd[s] + downstream[s]
            bound = max(bound, max(first_back, arrive[s] + ahead * fwd[s]) + work - ahead * fwd[s])
        if max_live is not None:
            first_input = {s: arrive[s] + fwd[s] + downstream[s] for s in mine}
            bound = max(bound, _memory_start_bound(mine, m, max_live, work, fwd, inp, wgt, arrive, first_input))
    for s in range(n):
        bound = max(bound, arrive[s] + m * (fwd[s] + inp[s]) + upstream[s],
                    arrive[s] + m * fwd[s] + downstream[s] + inp[s] + upstream[s])
    return bound


def _memory_start_bound(mine, m, max_live, work, fwd, inp, wgt, arrive, first_input) -> Real:
    """Bound (5): a rank frees no memory before its first W (or B) can end, at first_free; until then it
    starts at most max_live forwards. So in [0, T) for T <= first_free it can do at most the max_live longest
    forwards, and of each stage's forwards, I and W only what fits after the first could start (forwards
    from arrive[s], I from first_input[s], W an I later): the rest of its work, at least, follows T."""
    first_free = min(first_input[s] + inp[s] + wgt[s] for s in mine)
    longest = sorted((fwd[s] for s in mine), reverse=True)
    ahead, most_forward = max_live, 0  # the max_live longest forwards: m of each stage, longest first
    for f in longest:
        most_forward += f * min(ahead, m)
        ahead -= min(ahead, m)
    bound = 0
    for t in sorted({first_input[s] for s in mine} | {first_free}):
        if t > first_free:
            break
        forward = sum(min(m * fwd[s], max(0, t - arrive[s])) for s in mine)
        backward = sum(min(m * inp[s], max(0, t - first_input[s])) +
                       min(m * wgt[s], max(0, t - first_input[s] - inp[s])) for s in mine)
        bound = max(bound, t + work - min(t, min(forward, most_forward) + backward))
    return bound


def _variants(max_live: int, least: int) -> list[Variant]:
    limits = sorted({max_live, max(least, max_live - 1), max(least, (max_live + least) // 2)}, reverse=True)
    # An unsplit B never won over a grid of p, m, costs and message latencies: every variant splits. (A third
    # W policy, "early" (W before F when memory is full), chose as "fill" does in every state: dropped.)
    variants = []
    if least > 1:  # several stages per rank: also let more microbatches in than one slot each for later stages
        # (tried first: at p >= 8 with message latency these win, and the sooner a good plan is found, the
        # sooner list_schedule gives up on the others)
        for eighths in ENTERING:
            variants += [Variant(True, *flags, False, limit, max(1, -(-limit * eighths // 8))) for limit in limits
                         for flags in itertools.product((True, False), (True, False), ("fill", "patient"))]
    variants += [Variant(True, *flags, limit) for limit in limits
                 for flags in itertools.product((False, True), (True, False), ("fill", "patient"), (True, False))]
    return variants


def _same_plans(v: Variant, pivots: set) -> set[Variant]:
    """The variants that schedule exactly as v did: v with any of the flags that decided nothing flipped."""
    free = [f for f in ("forward_first", "deep_first", "patient", "reserve") if f not in pivots]
    same = set()
    for flips in itertools.product((False, True), repeat=len(free)):
        changes = {}
        for flag, flip in zip(free, flips):
            if flip and flag == "patient":
                changes["w_policy"] = "fill" if v.w_policy == "patient" else "patient"
            elif flip:
                changes[flag] = not getattr(v, flag)
        same.add(replace(v, **changes))
    return same


def synthesize(stage_to_rank: tuple[int, ...], num_microbatches: int, costs: Costs, max_live: int | None = None,
               name: str = "auto", fixed: list[Plan] = (), search_evaluations: int = SEARCH_EVALUATIONS,
               matching: str = "tag") -> Synthesis:
    """The fastest plan found for these costs whose simulated peak live stage-microbatches stay within max_live
    on every rank (default: 1F1B's memory). `fixed` are the fixed schedules of this placement to beat.

    matching "order" (NCCL) times the candidates as they will run there when messages have a latency: the
    search's winner and the fastest few it found are lowered for the costs and simulated with messages matched
    by order (simulate_order); the fastest of those wins, and the makespans are order's."""
    stage_to_rank = tuple(stage_to_rank)
    m = num_microbatches
    if m < 1:
        raise ScheduleError(f"microbatches={m} must be at least 1")
    if costs.num_stages != len(stage_to_rank):
        raise ScheduleError(f"costs are for {costs.num_stages} stages but the placement has {len(stage_to_rank)}")
    max_live = default_max_live(stage_to_rank) if max_live is None else max_live
    check_max_live(max_live, stage_to_rank)
    meta = {"max_live": max_live}
    if stages_per_rank(stage_to_rank) > 1:
        meta["virtual_stages"] = stages_per_rank(stage_to_rank)
    problem = Problem(stage_to_rank, m, costs)
    bound = lower_bound(stage_to_rank, m, costs, max_live)
    by_order = matching == "order" and costs.comm > 0  # without latency order costs what tag costs

    best_plan = best_ranks = best_time = None  # a fixed Plan, or the codes of a synthesized order
    best_fixed = best_fixed_time = None
    candidates: list[tuple[Real, Plan | None, list]] = []  # (tag makespan, the fixed Plan or None, codes)
    for plan in fixed:
        ranks = problem.encode(plan)
        makespan, peak = evaluate(problem, ranks)
        if peak <= max_live:
            candidates.append((makespan, plan, ranks))
        if peak <= max_live and (best_fixed_time is None or makespan < best_fixed_time):
            best_fixed, best_fixed_time = plan.name, makespan
            best_plan, best_ranks, best_time = plan, ranks, makespan
    seen, same, tried = set(), set(), 0
    winners: list[Variant] = []  # the variants that bettered the best so far, in turn
    for variant in _variants(max_live, least_max_live(stage_to_rank)):
        if best_time is not None and best_time <= bound:
            break  # nothing beats the bound
        tried += 1
        if variant in same:
            continue  # a variant already run scheduled exactly this way
        pivots: set[str] = set()
        result = list_schedule(problem, variant, pivots, best_time)
        same |= _same_plans(variant, pivots)  # a run given up on is given up on with any of them too
        if result is None:
            continue
        ranks, makespan, peak = result
        key = tuple(map(tuple, ranks))
        if key in seen:
            continue
        seen.add(key)
        if any(costs.dp_comm):  # the all-reduces after the last W/B may end the step
            makespan, peak = evaluate(problem, ranks)
        if peak <= max_live:
            candidates.append((makespan, None, ranks))
        if peak <= max_live and (best_time is None or makespan < best_time):
            best_plan, best_ranks, best_time = None, ranks, makespan
            winners.append(variant)
    if best_ranks is None:
        raise ScheduleError(f"no schedule found within max-live={max_live}; raise --max-live")
    samples = min(SAMPLES, SAMPLE_ACTIONS // max(1, sum(map(len, best_ranks))))
    if winners and best_time > bound and samples >= SAMPLES // 4:
        sampled, best_time = _sample(problem, winners[-1], best_time, max_live, bound, samples)
        if sampled is not None:
            best_plan, best_ranks = None, sampled
    evaluations = min(search_evaluations, SEARCH_ACTIONS // max(1, sum(map(len, best_ranks))))
    if best_time > bound and evaluations > 0:
        improved, best_time = _improve(problem, best_ranks, best_time, max_live, bound, evaluations)
        if improved is not None:  # actions moved: an order of its own, not the fixed one it started from
            best_plan, best_ranks = None, improved
    if any(costs.a2a_comm) and best_time > bound:
        paired, best_time = _pair_up(problem, best_ranks, best_time, max_live)
        if paired is not None:
            best_plan, best_ranks = None, paired
    if best_plan is None:
        best_plan = Plan("synthesized", m, stage_to_rank, problem.decode(best_ranks))
    if by_order:
        best_plan, best_time, best_fixed_time = _fastest_by_order(problem, [best_plan], candidates, best_fixed)
        meta["p2p_matching"] = "order"
    plan = replace(best_plan, name=name, meta={**dict(meta), "from": best_plan.name})
    return Synthesis(plan, best_time, bound, max_live, best_fixed, best_fixed_time, tried)


def _fastest_by_order(problem: Problem, winners: list[Plan], candidates: list, best_fixed: str | None):
    """(plan, its makespan, the best fixed one's) under order matching, among the searches' winners and the
    ORDER_CANDIDATES other candidates the search found fastest; each lowered for the costs, as a run lowers it."""
    costs, m, placement = problem.costs, problem.m, problem.stage_to_rank
    plans = winners + [fixed if fixed is not None else Plan("synthesized", m, placement, problem.decode(ranks))
                      for _, fixed, ranks in sorted(candidates, key=lambda c: c[0])[:ORDER_CANDIDATES]]
    timed, fixed_time = {}, None
    for plan in plans:
        if plan.ranks in timed:
            continue
        timed[plan.ranks] = (simulate_order(lower(plan, costs), costs).makespan, plan)
        if plan.name == best_fixed:
            fixed_time = timed[plan.ranks][0]
    makespan, plan = min(timed.values(), key=lambda t: t[0])
    return plan, makespan, fixed_time


def _sample(problem: Problem, base: Variant, makespan: Real, max_live: int, bound: Real,
            runs: int) -> tuple[list[list[int]] | None, Real]:
    """Iterated greedy over the list scheduler's choices: from the best variant's run, turn a few more choices
    the other way (list_schedule's flips) and keep the set when the plan is faster. (Keeping equal ones walks
    onto plateaus of choices that decide nothing and found less.) The best order found (None if none beat
    makespan) and its makespan."""
    jitter, best, kept = random.Random(0), None, frozenset()
    choices = 3 * sum(len(st) for st in problem.stages_of) * problem.m * 3  # about 3 per action
    for _ in range(runs):
        if makespan <= bound:
            break
        flips = kept | {jitter.randrange(choices) for _ in range(jitter.randint(1, FLIPS))}
        result = list_schedule(problem, base, None, makespan, flips)
        if result is None:
            continue
        ranks, time, peak = result
        if any(problem.costs.dp_comm):
            time, peak = evaluate(problem, ranks)
        if peak <= max_live and time < makespan:
            best, makespan, kept = ranks, time, flips
    return best, makespan


def _improve(problem: Problem, ranks: list[list[int]], makespan: Real, max_live: int, bound: Real,
                   evaluations: int) -> tuple[list[list[int]] | None, Real]:
    """First improvement over every rank and place: move one action one place earlier. The moved order (None
    if nothing moved) and its makespan."""
    ranks = [list(acts) for acts in ranks]
    m = problem.m
    improved, moved = True, False
    while improved and evaluations > 0 and makespan > bound:
        improved = False
        for acts in ranks:
            for k in range(1, len(acts)):
                if evaluations <= 0:
                    break
                a, b = acts[k - 1], acts[k]
                if a // m == b // m:
                    continue  # a stage keeps its microbatch order
                acts[k - 1], acts[k] = b, a
                evaluations -= 1
                result = evaluate(problem, ranks)
                if result is not None and result[0] < makespan and result[1] <= max_live:
                    makespan, improved, moved = result[0], True, True
                else:
                    acts[k - 1], acts[k] = a, b
    return (ranks if moved else None), makespan


def _pair_up(problem: Problem, ranks: list[list[int]], makespan: Real,
             max_live: int) -> tuple[list[list[int]] | None, Real]:
    """Each rank's forward and a backward (B or I) of another microbatch at most PAIR_REACH places after it (or
    the other way round) as one pair (forward first) where it stands, the actions between moving after it; kept
    where the simulator says the plan is then faster within the memory limit (a pair holds both halves'
    microbatches at once). The paired order (None if no pair paid) and its makespan."""
    ranks = [list(acts) for acts in ranks]
    budget = SEARCH_ACTIONS // max(1, sum(map(len, ranks)))
    paired = False
    for acts in ranks:
        k = 0
        while k + 1 < len(acts) and budget > 0:
            for j in range(k + 1, min(len(acts), k + 1 + PAIR_REACH)):
                pair = _pair_code(problem, acts[k], acts[j])
                if pair is None or budget <= 0:
                    continue
                budget -= 1
                before = acts[:]
                acts[:] = acts[:k] + [pair] + acts[k + 1:j] + acts[j + 1:]
                result = evaluate(problem, ranks)
                if result is not None and result[0] < makespan and result[1] <= max_live:
                    makespan, paired = result[0], True
                    break
                acts[:] = before
            k += 1
    return (ranks if paired else None), makespan


def _pair_code(problem: Problem, first: int, second: int) -> int | None:
    """The code of the pair of these two actions, forward first, where one is a forward and the other a backward
    (B or I) of another microbatch; None otherwise."""
    if first >= problem.composite_base or second >= problem.composite_base:
        return None
    a, b = problem.action(first), problem.action(second)
    if b.kind is Kind.F:
        a, b = b, a
    if a.kind is not Kind.F or b.kind not in (Kind.B, Kind.I) or a.microbatch == b.microbatch:
        return None
    return problem.code(Composite.of(a, b))
