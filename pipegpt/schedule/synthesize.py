"""A schedule written for given costs and a memory limit: `--schedule auto` (one stage per rank, or
interleaved with --virtual-stages) and `auto-v` (two stages per rank in a V).

The fixed generators assume every action costs the same. Here the plan is made for the costs at
hand: an event-driven list scheduler (the zero-bubble paper's heuristic, generalised to real costs,
message latency and per-stage memory) runs in a few dozen priority variants, the fixed schedules
of the same placement that fit the limit join as candidates, the simulator times them all and the
fastest within the limit wins, so the result is never worse than the best fixed schedule. A local
search then tries moving single actions earlier while the simulator says that helps.

lower_bound() says how far from optimal the winner can be: no schedule of that placement, in any
order, with any split of the backward, finishes sooner.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from numbers import Real

from .actions import Action, Kind, Plan, ScheduleError
from .simulate import Costs, simulate, simulate_unchecked

# Simulations the local search may spend after the list scheduler (a count, not seconds, so that every
# process that synthesizes the same inputs gets the same plan); it stops earlier once a pass over
# every rank finds nothing to move.
SEARCH_EVALUATIONS = 300


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

    Four bounds, the largest wins: (1) a rank has all its work to do, and until the first microbatch's
    forward reaches one of its stages it can only run forwards of its earlier stages; (2) the last backward-input of a stage ends after
    all of that stage's F and I, and the upstream chain of input gradients and stage 0's W still
    follows it; (3) the same from a stage's last forward, with the whole downstream path after it;
    (4) with a memory limit, a rank with one stage runs at most max_live forwards before its first
    backward, which comes back only after microbatch 0's round trip through the later stages.
    """
    m, n = num_microbatches, len(stage_to_rank)
    d = costs.duration
    fwd = [d(Action(s, Kind.F, 0)) for s in range(n)]
    inp = [d(Action(s, Kind.I, 0)) for s in range(n)]
    wgt = [d(Action(s, Kind.W, 0)) for s in range(n)]
    hop = [costs.comm if s + 1 < n and stage_to_rank[s] != stage_to_rank[s + 1] else 0 for s in range(n)]
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
    for s in range(n):
        bound = max(bound, arrive[s] + m * (fwd[s] + inp[s]) + upstream[s],
                    arrive[s] + m * fwd[s] + downstream[s] + inp[s] + upstream[s])
    return bound


@dataclass(frozen=True)
class Variant:
    """One way to break ties in the list scheduler."""

    split: bool  # backward as I then W (W free to fill gaps) or one B
    forward_first: bool  # take a ready forward before a ready backward (while memory allows)
    deep_first: bool  # among ready actions of one kind on a rank, the deepest stage first
    w_policy: str  # "fill": W when nothing else is ready; "early": W before F when memory is at its limit;
    #                "patient": like fill, but wait for a backward arriving before the W would end
    reserve: bool  # a microbatch entering a rank reserves memory for every later stage it has there
    limit: int  # the memory limit this variant schedules to (at most the caller's)


def _variants(max_live: int, least: int) -> list[Variant]:
    limits = sorted({max_live, max(least, max_live - 1), max(least, (max_live + least) // 2)}, reverse=True)
    # An unsplit B never won over a grid of p, m, costs and message latencies: every variant splits.
    return [Variant(True, *flags, limit) for limit in limits
            for flags in itertools.product((False, True), (True, False), ("fill", "early", "patient"), (True, False))]


def _list_schedule(stage_to_rank: tuple[int, ...], m: int, costs: Costs, v: Variant) -> list[list[Action]] | None:
    """Event-driven list scheduling at the given costs; None where the variant stalls on memory."""
    n = len(stage_to_rank)
    num_ranks = max(stage_to_rank) + 1
    stages_of = [[s for s in range(n) if stage_to_rank[s] == r] for r in range(num_ranks)]
    order = [sorted(st, reverse=v.deep_first) for st in stages_of]
    later_here = [[t for t in stages_of[stage_to_rank[s]] if t > s] for s in range(n)]  # same rank, deeper
    first_here = [not any(t < s for t in stages_of[stage_to_rank[s]]) for s in range(n)]
    d = costs.duration
    backward_kind = Kind.I if v.split else Kind.B
    ends: dict[tuple[int, Kind, int], Real] = {}
    next_f, next_b = [0] * n, [0] * n
    pending_w: list[deque[Action]] = [deque() for _ in range(num_ranks)]
    live, reserved = [0] * num_ranks, [0] * num_ranks
    free: list[Real] = [0] * num_ranks
    plan: list[list[Action]] = [[] for _ in range(num_ranks)]
    remaining = [len(st) * m * (3 if v.split else 2) for st in stages_of]

    def arrival(s: int, kind: Kind, mb: int, dep_stage: int) -> Real | None:
        end = ends.get((dep_stage, kind, mb))
        if end is None:
            return None
        return end + (costs.comm if stage_to_rank[dep_stage] != stage_to_rank[s] else 0)

    def forward_ready(s: int) -> Real | None:
        mb = next_f[s]
        if mb >= m:
            return None
        return 0 if s == 0 else arrival(s, Kind.F, mb, s - 1)

    def backward_ready(s: int) -> Real | None:
        mb = next_b[s]
        if mb >= next_f[s]:
            return None
        own = ends.get((s, Kind.F, mb))
        if own is None:
            return None
        if s == n - 1:
            return own
        down = arrival(s, backward_kind, mb, s + 1)
        return None if down is None else max(own, down)

    def forward_fits(r: int, s: int, limit: int) -> bool:
        if not v.reserve:
            return live[r] + 1 <= limit
        if first_here[s]:
            return live[r] + reserved[r] + 1 + len(later_here[s]) <= limit
        return True  # its slot was reserved when the microbatch entered the rank

    heap = [(0, r) for r in range(num_ranks)]
    idle: set[int] = set()  # ranks waiting for another rank to finish something
    while heap:
        t, r = heapq.heappop(heap)
        if remaining[r] == 0 or t < free[r]:
            continue
        ready_b = [(s, at) for s in order[r] if (at := backward_ready(s)) is not None]
        fits = [(s, at) for s in order[r] if (at := forward_ready(s)) is not None and forward_fits(r, s, v.limit)]
        now_b = [s for s, at in ready_b if at <= t]
        now_f = [s for s, at in fits if at <= t]
        soon = [at for _, at in ready_b + fits if at > t]
        w = pending_w[r][0] if pending_w[r] else None
        choice = None
        if w is not None and v.w_policy == "early" and not now_b and not fits:
            choice = w  # memory is full: the W frees a slot
        if choice is None:
            groups = [(now_f, Kind.F), (now_b, backward_kind)]
            for group, kind in (groups if v.forward_first else groups[::-1]):
                if group:
                    s = group[0]
                    choice = Action(s, kind, next_f[s] if kind is Kind.F else next_b[s])
                    break
        if choice is None and w is not None and (v.w_policy != "patient" or not soon or t + d(w) <= min(soon)):
            choice = w
        if choice is None:
            if soon:
                heapq.heappush(heap, (min(soon), r))
            else:
                idle.add(r)
            continue
        s, kind, mb = choice
        end = t + d(choice)
        ends[(s, kind, mb)] = end
        plan[r].append(choice)
        remaining[r] -= 1
        free[r] = end
        if kind is Kind.F:
            next_f[s] += 1
            live[r] += 1
            if v.reserve:
                reserved[r] += len(later_here[s]) if first_here[s] else -1
        elif kind is Kind.I:
            next_b[s] += 1
            pending_w[r].append(Action(s, Kind.W, mb))
        else:
            if kind is Kind.B:
                next_b[s] += 1
            else:
                pending_w[r].popleft()
            live[r] -= 1
        heapq.heappush(heap, (end, r))
        for q in idle:  # what this action produces may be what they wait for
            heapq.heappush(heap, (max(end, free[q]), q))
        idle.clear()
    return None if any(remaining) else plan


def synthesize(stage_to_rank: tuple[int, ...], num_microbatches: int, costs: Costs, max_live: int | None = None,
               name: str = "auto", fixed: list[Plan] = (), search_evaluations: int = SEARCH_EVALUATIONS) -> Synthesis:
    """The fastest plan found for these costs whose simulated peak live stage-microbatches stay within max_live
    on every rank (default: 1F1B's memory). `fixed` are the fixed schedules of this placement to beat."""
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

    def fits(timeline) -> bool:
        return max(timeline.peak_live_microbatches_per_rank) <= max_live

    best_plan, best_time, tried = None, None, 0
    best_fixed = best_fixed_time = None
    for plan in fixed:
        timeline = simulate(plan, costs)
        if fits(timeline) and (best_fixed_time is None or timeline.makespan < best_fixed_time):
            best_fixed, best_fixed_time = plan.name, timeline.makespan
            best_plan, best_time = plan, timeline.makespan
    seen = set()
    for variant in _variants(max_live, least_max_live(stage_to_rank)):
        ranks = _list_schedule(stage_to_rank, m, costs, variant)
        tried += 1
        if ranks is None:
            continue
        key = tuple(map(tuple, ranks))
        if key in seen:
            continue
        seen.add(key)
        plan = Plan("synthesized", m, stage_to_rank, key, meta=dict(meta))
        timeline = simulate(plan, costs)
        if fits(timeline) and (best_time is None or timeline.makespan < best_time):
            best_plan, best_time = plan, timeline.makespan
    if best_plan is None:
        raise ScheduleError(f"no schedule found within max-live={max_live}; raise --max-live")
    bound = lower_bound(stage_to_rank, m, costs, max_live)
    if best_time > bound and search_evaluations > 0:
        start = best_plan
        best_plan, best_time = _improve(best_plan, best_time, costs, max_live, bound, search_evaluations)
        if best_plan is not start:  # actions moved: an order of its own, not the fixed one it started from
            best_plan = replace(best_plan, name="synthesized")
    plan = replace(best_plan, name=name, meta={**dict(meta), "from": best_plan.name})
    return Synthesis(plan, best_time, bound, max_live, best_fixed, best_fixed_time, tried)


def _improve(plan: Plan, makespan: Real, costs: Costs, max_live: int, bound: Real, evaluations: int):
    """First-improvement local search: move one action one place earlier on its rank while that shortens
    the simulated step and keeps the plan valid and within the memory limit."""
    ranks = [list(acts) for acts in plan.ranks]
    improved = True
    while improved and evaluations > 0 and makespan > bound:
        improved = False
        for r in range(len(ranks)):
            for k in range(1, len(ranks[r])):
                if evaluations <= 0:
                    break
                a, b = ranks[r][k - 1], ranks[r][k]
                if a.stage == b.stage and a.kind == b.kind:
                    continue  # a stage keeps its microbatch order
                ranks[r][k - 1], ranks[r][k] = b, a
                candidate = plan.with_ranks(ranks)
                evaluations -= 1
                try:
                    timeline = simulate_unchecked(candidate, costs)
                except ScheduleError:
                    timeline = None
                if timeline is not None and timeline.makespan < makespan and \
                        max(timeline.peak_live_microbatches_per_rank) <= max_live:
                    plan, makespan, improved = candidate, timeline.makespan, True
                else:
                    ranks[r][k - 1], ranks[r][k] = a, b
    return plan, makespan
