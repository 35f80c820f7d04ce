"""The synthesizer's list scheduler and its compact plans: actions as integers, times in flat lists.

An action is the code (kind * stages + stage) * microbatches + microbatch, kind F=0, I=1, W=2, B=3, so
that a few dozen variants of a 100,000-action schedule take seconds, not minutes; a composite pair is
4 * stages * microbatches + its number in Problem.composites. Problem holds what every variant and every
evaluation of one synthesis shares, its times read from the timing rule (timing_rule.py).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from numbers import Real

from ..actions import Action, Composite, Kind, Plan
from ..timing_rule import Costs, action_times, hops

KINDS = (Kind.F, Kind.I, Kind.W, Kind.B)
F_, I_, W_, B_ = range(4)


@dataclass(frozen=True)
class Variant:
    """One way to break ties in the list scheduler."""

    split: bool  # backward as I then W (W free to fill gaps) or one B
    forward_first: bool  # take a ready forward before a ready backward (while memory allows)
    deep_first: bool  # among ready actions of one kind on a rank, the deepest stage first
    w_policy: str  # "fill": W when nothing else is ready; "patient": like fill, but wait for a backward
    #                arriving before the W would end
    reserve: bool  # a microbatch entering a rank reserves memory for every later stage it has there
    limit: int  # the memory limit this variant schedules to (at most the caller's)
    entering: int = 0  # if not 0, instead of reserve: at most this many microbatches on a rank's first stage at
    #                    once, and a slot kept free for each later stage there (some may share it)


class Problem:
    """A placement, a microbatch count and costs, as the flat tables the scheduler and evaluator read."""

    def __init__(self, stage_to_rank: tuple[int, ...], m: int, costs: Costs):
        self.stage_to_rank, self.m, self.costs = stage_to_rank, m, costs
        n = self.n = len(stage_to_rank)
        self.num_ranks = max(stage_to_rank) + 1
        self.stages_of = [[s for s in range(n) if stage_to_rank[s] == r] for r in range(self.num_ranks)]
        # duration[kind][stage] and hop[s] (a message between stage s and s + 1): the timing rule's own values
        self.duration = action_times(costs, KINDS)
        self.hop = hops(costs, stage_to_rank)
        self.composite_base = len(KINDS) * n * self.m  # codes from here on are composites
        self.composites: list[tuple[int, ...]] = []  # each composite's parts, as codes
        self._composite_codes: dict[tuple[int, ...], int] = {}
        self.evaluation_tables = None  # fast_simulate's per-code tables, made on its first call

    def code(self, action: Action | Composite) -> int:
        if action.kind is Kind.OVERLAP:
            parts = tuple(map(self.code, action.parts))
            if parts not in self._composite_codes:
                self._composite_codes[parts] = self.composite_base + len(self.composites)
                self.composites.append(parts)
            return self._composite_codes[parts]
        return (KINDS.index(action.kind) * self.n + action.stage) * self.m + action.microbatch

    def action(self, code: int) -> Action | Composite:
        if code >= self.composite_base:
            return Composite(tuple(map(self.action, self.composites[code - self.composite_base])))
        rest, mb = divmod(code, self.m)
        kind, stage = divmod(rest, self.n)
        return Action(stage, KINDS[kind], mb)

    def encode(self, plan: Plan) -> list[list[int]]:
        return [[self.code(a) for a in acts] for acts in plan.ranks]

    def decode(self, ranks) -> tuple[tuple[Action, ...], ...]:
        return tuple(tuple(map(self.action, acts)) for acts in ranks)


def list_schedule(problem: Problem, v: Variant, pivots: set | None = None, give_up_at: Real | None = None,
                  flips: frozenset = frozenset()) -> tuple[list[list[int]], Real, int] | None:
    """Event-driven list scheduling at the problem's costs: the plan, with the makespan and peak live memory
    simulate() gives it (without dp_comm's all-reduces); None where the variant stalls on memory, or where
    its plan cannot finish before give_up_at.

    Each free rank takes, by the variant's priorities, a ready backward (input gradient first), a forward
    that fits its memory, or a pending W; a rank with nothing ready waits for the next arrival it knows of,
    or, knowing none, for any other rank to finish something. `pivots` collects the flags (forward_first,
    deep_first, patient, reserve) whose other value would have decided differently somewhere in this run:
    flipping any of the others gives this very plan (only of a run that finished).

    Beside the scheduler's own clock, each action also gets the time simulate() will give it: as early as its
    rank and its inputs allow in the order made so far (the scheduler can start it later, when it learns of
    an arrival late). Those times decide the makespan, and a rank that cannot end before give_up_at even
    working without a gap ends the run.

    `flips` turns single choices the other way: the k-th time a rank chooses, 3k in flips takes the second stage
    with a ready backward, 3k + 1 the second with a ready forward, 3k + 2 a forward over a backward (or the
    reverse), or a W over waiting (or the reverse)."""
    n, m, num_ranks, hop = problem.n, problem.m, problem.num_ranks, problem.hop
    stage_to_rank, stages_of = problem.stage_to_rank, problem.stages_of
    last = n - 1
    order = [sorted(st, reverse=v.deep_first) for st in stages_of]
    later_here = [len([t for t in stages_of[stage_to_rank[s]] if t > s]) for s in range(n)]  # same rank, deeper
    first_here = [not any(t < s for t in stages_of[stage_to_rank[s]]) for s in range(n)]
    back = I_ if v.split else B_
    dur_f, dur_back, dur_w = problem.duration[F_], problem.duration[back], problem.duration[W_]
    code_f = [s * m for s in range(n)]
    code_back = [(back * n + s) * m for s in range(n)]
    code_w = [(W_ * n + s) * m for s in range(n)]
    end_f = [[None] * m for _ in range(n)]
    end_back = [[None] * m for _ in range(n)]
    next_f, next_b = [0] * n, [0] * n
    pending_w: list[deque] = [deque() for _ in range(num_ranks)]  # (stage, microbatch) whose I ran, W not yet
    live, reserved = [0] * num_ranks, [0] * num_ranks
    free: list[Real] = [0] * num_ranks
    plan: list[list[int]] = [[] for _ in range(num_ranks)]
    remaining = [len(st) * m * (3 if v.split else 2) for st in stages_of]
    # simulate()'s times: ends by stage and microbatch, each rank's free moment, the work it has left
    sim_f = [[None] * m for _ in range(n)]
    sim_back = [[None] * m for _ in range(n)]
    sim_free: list[Real] = [0] * num_ranks
    work_left = [m * sum(dur_f[s] + dur_back[s] + (dur_w[s] if v.split else 0) for s in st) for st in stages_of]
    level, peak, level_at = [0] * num_ranks, [0] * num_ranks, [None] * num_ranks
    first_start = last_end = None
    if give_up_at is not None:
        give_up_at = give_up_at + abs(give_up_at) * 1e-9  # work_left is a running difference: rounding
    limit, reserve, forward_first = v.limit, v.reserve, v.forward_first
    patient = v.w_policy == "patient"
    entering = v.entering
    entered = [0] * num_ranks  # microbatches on the rank's first stage: F run, W not yet
    heappush, heappop = heapq.heappush, heapq.heappop

    pivot_ff = pivot_deep = pivot_patient = pivot_reserve = False
    choice = 0
    heap = [(0, r) for r in range(num_ranks)]
    idle: set[int] = set()  # ranks waiting for another rank to finish something
    while heap:
        t, r = heappop(heap)
        if remaining[r] == 0 or t < free[r]:
            continue
        ready_b, ready_f = [], []  # stages with a backward (a forward that fits) ready now, in the rank's order
        fits_any = False
        soon = None  # the earliest arrival after t
        for s in order[r]:
            mb = next_b[s]
            if mb < next_f[s]:
                at = end_f[s][mb]
                if s != last:
                    down = end_back[s + 1][mb]
                    if down is None:
                        at = None
                    else:
                        down = down + hop[s]
                        if down > at:
                            at = down
                if at is not None:
                    if at <= t:
                        ready_b.append(s)
                    elif soon is None or at < soon:
                        soon = at
            mb = next_f[s]
            if mb < m:
                if s == 0:
                    at = 0
                else:
                    at = end_f[s - 1][mb]
                    if at is not None:
                        at = at + hop[s - 1]
                if at is None:
                    continue
                fits_plain = live[r] + 1 <= limit
                fits_reserved = not first_here[s] or live[r] + reserved[r] + 1 + later_here[s] <= limit
                if entering:
                    fits_plain = fits_reserved = fits_plain and not first_here[s] or (
                        entered[r] < entering and live[r] + 1 + later_here[s] <= limit)
                if fits_plain != fits_reserved:
                    pivot_reserve = True
                if fits_reserved if reserve else fits_plain:
                    fits_any = True
                    if at <= t:
                        ready_f.append(s)
                    elif soon is None or at < soon:
                        soon = at
        waiting_w = pending_w[r]
        now_b = ready_b[0] if ready_b else None
        now_f = ready_f[0] if ready_f else None
        flip = False
        if flips:
            if len(ready_b) > 1 and choice in flips:
                now_b = ready_b[1]
            if len(ready_f) > 1 and choice + 1 in flips:
                now_f = ready_f[1]
            flip = choice + 2 in flips
        choice += 3
        if ready_f and ready_b:
            pivot_ff = True
        if forward_first != flip:
            kind, s = (F_, now_f) if now_f is not None else (back, now_b) if now_b is not None else (None, None)
        else:
            kind, s = (back, now_b) if now_b is not None else (F_, now_f) if now_f is not None else (None, None)
        if len(ready_f if kind == F_ else ready_b) > 1:
            pivot_deep = True
        if kind is None and waiting_w:
            if soon is not None and t + dur_w[waiting_w[0][0]] > soon:
                pivot_patient = True  # a backward arrives before this W would end: patient waits for it
                if patient == flip:
                    kind = W_
            else:
                kind = W_
        if kind is None:
            if soon is not None:
                heappush(heap, (soon, r))
            else:
                idle.add(r)
            continue
        start = sim_free[r]
        if kind == F_:
            mb = next_f[s]
            end = t + dur_f[s]
            end_f[s][mb] = end
            plan[r].append(code_f[s] + mb)
            next_f[s] = mb + 1
            live[r] += 1
            reserved[r] += later_here[s] if first_here[s] else -1
            entered[r] += first_here[s]
            if s:
                a = sim_f[s - 1][mb]
                if hop[s - 1]:
                    a = a + hop[s - 1]
                if a > start:
                    start = a
            took = dur_f[s]
            sim_end = sim_f[s][mb] = start + took
            when = start  # memory rises as an F starts
        elif kind == W_:
            s, mb = waiting_w.popleft()
            entered[r] -= first_here[s]
            end = t + dur_w[s]
            plan[r].append(code_w[s] + mb)
            live[r] -= 1
            a = sim_back[s][mb]
            if a > start:
                start = a
            took = dur_w[s]
            when = sim_end = start + took  # and falls as a W ends
        else:
            mb = next_b[s]
            end = t + dur_back[s]
            end_back[s][mb] = end
            plan[r].append(code_back[s] + mb)
            next_b[s] = mb + 1
            if back == I_:
                waiting_w.append((s, mb))
            else:
                live[r] -= 1
                entered[r] -= first_here[s]
            a = sim_f[s][mb]
            if a > start:
                start = a
            if s != last:
                a = sim_back[s + 1][mb]
                if hop[s]:
                    a = a + hop[s]
                if a > start:
                    start = a
            took = dur_back[s]
            sim_end = sim_back[s][mb] = start + took
            when = sim_end if back == B_ else None
        sim_free[r] = sim_end
        work_left[r] -= took
        if first_start is None or start < first_start:
            first_start = start
        if last_end is None or sim_end > last_end:
            last_end = sim_end
        if when is not None:  # simulate() counts releases before allocations at one time: see fast_simulate
            if level_at[r] is not None and when != level_at[r] and level[r] > peak[r]:
                peak[r] = level[r]
            level_at[r] = when
            level[r] += 1 if kind == F_ else -1
        if give_up_at is not None and sim_end + work_left[r] - first_start >= give_up_at:
            break
        remaining[r] -= 1
        free[r] = end
        heappush(heap, (end, r))
        for q in idle:  # what this action produces may be what they wait for
            heappush(heap, (end if end >= free[q] else free[q], q))
        idle.clear()
    if pivots is not None:
        pivots.update(name for name, flag in (("forward_first", pivot_ff), ("deep_first", pivot_deep),
                                              ("patient", pivot_patient), ("reserve", pivot_reserve)) if flag)
    if any(remaining):  # stalled, or given up on
        return None
    return plan, last_end - first_start, max(max(level[r], peak[r]) for r in range(num_ranks))
