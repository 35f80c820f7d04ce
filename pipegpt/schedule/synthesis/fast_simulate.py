"""simulate() for the synthesizer's candidates: the same makespan and peak live, on integer-coded plans.

A candidate is a list per rank of list_scheduler codes. evaluate() computes what simulate(plan, costs)
would say of its makespan and max(peak_live_microbatches_per_rank), to the last bit, without building
events or validating: a plan that cannot run gives None. Both charge every action by the timing rule
(timing_rule.py: the same durations, latencies, channels and composite spans, summed in the same order).
"""
from __future__ import annotations

from ..timing_rule import queued, spans_of
from .list_scheduler import B_, F_, I_, W_, Problem


def evaluate(problem: Problem, ranks: list[list[int]]) -> tuple | None:
    """(makespan, peak live stage-microbatches on any rank), or None where the plan deadlocks."""
    n, m, num_ranks = problem.n, problem.m, problem.num_ranks
    nm = n * m
    hop = problem.hop
    # ends[slot] for F, ends[nm + slot] for I or B, ends[2 nm + slot] for W, where slot = stage * m + microbatch;
    # needs[kind][stage]: (offset from the action's own index to a dependency's, message latency on the way)
    ends: list = [None] * (3 * nm)
    needs = [[((-m, hop[s - 1]),) if s else () for s in range(n)],
             [((-nm, 0), (m, hop[s])) if s + 1 < n else ((-nm, 0),) for s in range(n)],
             [((-nm, 0),)] * n]
    needs.append(needs[I_])
    slot_of, waits_for, took, kind_of = _tables(problem, needs)
    base = problem.composite_base
    pos = [0] * num_ranks
    free = [0] * num_ranks
    level, peak, level_at = [0] * num_ranks, [0] * num_ranks, [None] * num_ranks
    waiters: dict[int, list[int]] = {}
    first_start = last_end = None
    todo = list(range(num_ranks))
    while todo:
        r = todo.pop()
        acts, k, start_free = ranks[r], pos[r], free[r]
        while k < len(acts):
            code = acts[k]
            if code >= base:  # a composite pair: rare, so out of this loop
                spans = _composite(problem, code, start_free, needs, ends, waiters, r)
                if spans is None:
                    break
                # The live level and span as below, per part: repeated, not shared, since a call or a loop per
                # action costs the hot path below more than this copy does.
                for (kind, index), (start, end) in spans:
                    when = start if kind == F_ else end if kind != I_ else None
                    if when is not None:
                        if level_at[r] is not None and when != level_at[r] and level[r] > peak[r]:
                            peak[r] = level[r]
                        level_at[r] = when
                        level[r] += 1 if kind == F_ else -1
                    if first_start is None or start < first_start:
                        first_start = start
                    if last_end is None or end > last_end:
                        last_end = end
                start_free = end
                k += 1
                for (_, index), _ in spans:
                    woken = waiters.pop(index, None)
                    if woken:
                        todo.extend(woken)
                continue
            index = slot_of[code]
            start = start_free
            for dependency, latency in waits_for[code]:
                a = ends[dependency]
                if a is None:
                    waiters.setdefault(dependency, []).append(r)
                    break
                if latency:
                    a = a + latency
                if a > start:
                    start = a
            else:
                end = start + took[code]
                start_free = ends[index] = end
                kind = kind_of[code]
                k += 1
                # Live stage-microbatches: up at an F's start, down at the end of its W (or B). Times along a
                # rank never decrease, and at one time the simulator counts releases before allocations, so
                # the level after each run of equal times is what can peak.
                when = start if kind == F_ else end if kind != I_ else None
                if when is not None:
                    if level_at[r] is not None and when != level_at[r] and level[r] > peak[r]:
                        peak[r] = level[r]
                    level_at[r] = when
                    level[r] += 1 if kind == F_ else -1
                if first_start is None or start < first_start:
                    first_start = start
                if last_end is None or end > last_end:
                    last_end = end
                woken = waiters.pop(index, None)
                if woken:
                    todo.extend(woken)
                continue
            break  # waiting for another rank
        pos[r], free[r] = k, start_free
    if any(pos[r] < len(ranks[r]) for r in range(num_ranks)):
        return None
    for r in range(num_ranks):
        if level[r] > peak[r]:
            peak[r] = level[r]
    if first_start is None:
        return 0, 0
    step_end = last_end
    if any(problem.costs.dp_comm):
        step_end = max(last_end, _gradient_sync_end(problem, ranks, ends))
    return step_end - first_start, max(peak)


def _tables(problem: Problem, needs: list) -> tuple:
    """Per code of a plain action, what evaluate() would otherwise work out on every visit: its slot in ends,
    (slot, message latency) of each action it waits for, its duration and its kind; built once per problem."""
    if problem.evaluation_tables is None:
        n, m, nm = problem.n, problem.m, problem.n * problem.m
        slot_of, waits_for, took, kind_of = [], [], [], []
        for code in range(problem.composite_base):
            rest, mb = divmod(code, m)
            kind, s = divmod(rest, n)
            index = (kind if kind != B_ else I_) * nm + s * m + mb
            slot_of.append(index)
            waits_for.append(tuple((index + offset, latency) for offset, latency in needs[kind][s]))
            took.append(problem.duration[kind][s])
            kind_of.append(kind)
        problem.evaluation_tables = slot_of, waits_for, took, kind_of
    return problem.evaluation_tables


def _composite(problem: Problem, code: int, start, needs, ends: list, waiters: dict, r: int):
    """A composite pair's parts as ((kind, index in ends), (start, end)), timed by the timing rule from `start`
    (its rank free) once every part's dependencies but those on each other have ended (their ends set
    to the pair's end); None where one has not (the rank then waits for it)."""
    n, m = problem.n, problem.m
    codes = problem.composites[code - problem.composite_base]
    parts = []
    for part in codes:
        rest, mb = divmod(part, m)
        kind, s = divmod(rest, n)
        parts.append((kind, s, (kind if kind != B_ else I_) * n * m + s * m + mb))
    own = {index for _, _, index in parts}
    for kind, s, index in parts:
        for offset, latency in needs[kind][s]:
            if index + offset in own:
                continue
            a = ends[index + offset]
            if a is None:
                waiters.setdefault(index + offset, []).append(r)
                return None
            if latency:
                a = a + latency
            if a > start:
                start = a
    spans = spans_of(problem.costs, problem.action(code), start)
    for _, _, index in parts:
        ends[index] = spans[-1][1]
    return [((kind, index), span) for (kind, _, index), span in zip(parts, spans)]


def _gradient_sync_end(problem: Problem, ranks, ends):
    """simulate._gradient_sync_end on codes: each stage's all-reduce starts when its last B/W ends, one at a
    time per rank, stages taken by (time, rank) and, at equal keys, in the order the simulator meets them."""
    n, m = problem.n, problem.m
    ready: dict[int, tuple] = {}
    base, composites = problem.composite_base, problem.composites
    for r, acts in enumerate(ranks):
        if composites:  # their parts
            acts = [c for a in acts for c in (composites[a - base] if a >= base else (a,))]
        for code in acts:
            rest, mb = divmod(code, m)
            kind, s = divmod(rest, n)
            if kind == W_ or kind == B_:
                end = ends[(kind if kind == W_ else I_) * n * m + s * m + mb]
                ready[s] = max(ready.get(s, (end, r)), (end, r))
    channel_free = [0] * problem.num_ranks
    for stage, (at, rank) in sorted(ready.items(), key=lambda item: item[1]):
        channel_free[rank] = queued(channel_free[rank], at, problem.costs.dp_comm[stage])
    return max(channel_free)
