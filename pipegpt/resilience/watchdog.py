"""The stall watchdog's pure logic: when a step has run too long, and which rank holds the others up.

A step that runs much longer than the steps before it is stalled: the driver then asks every rank
where it is (its action, and the ranks it waits for), prints the table and names the culprit, long
before the communication timeout would end the job with a less helpful message.

The culprit is found on the wait-for graph: a rank waiting on a receive (or a collective) points at
its peer(s); following the edges leads to a rank that waits for nobody though it is inside the step,
i.e. stuck in compute. If every rank in the step waits for another, the edges form a cycle: a deadlock,
named as such. On CUDA a rank's host runs ahead of its GPU (waits only order streams), so where the GPU is
(the first action whose event has not completed) stands for the rank where the worker knows it: a slow kernel
or a hung collective on one GPU is then named as such ("GPU busy in 1F0"), not as a cycle of hosts in settle().
Pure Python: the driver and the tests use it without torch.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

STALL_FACTOR = 5.0  # a step is stalled once it has run this many times the median of the recent steps ...
STALL_FLOOR_S = 10.0  # ... and at least this long (tiny steps jitter by more than 5x)
WARMUP_STEPS = 3  # until this many steps are timed, the first one (which includes warm-up) still counts
RECENT_STEPS = 20  # the median is over at most this many of the latest steps
WHERE_TIMEOUT_S = 3.0  # how long the driver waits for a rank to say where it is (its RPC threads answer at once)

BETWEEN_STEPS = "between steps"


def stall_threshold(step_times: Sequence[float], factor: float = STALL_FACTOR, floor_s: float = STALL_FLOOR_S,
                    warmup: int = WARMUP_STEPS, recent: int = RECENT_STEPS) -> float | None:
    """Seconds after which the next step counts as stalled, from the times of the steps before it.

    None for the first step: its warm-up (allocation, torch.compile) has no reference, and the
    communication timeout and heartbeats still bound it. Until `warmup` steps are timed, the first
    step's time stays in the median (it only raises the threshold); after that it is left out.
    """
    if not step_times:
        return None
    first = 1 if len(step_times) > warmup else 0
    timed = step_times[max(first, len(step_times) - recent):]  # the recent ones only: no copy of the whole run
    return max(factor * statistics.median(timed), floor_s)


@dataclass(frozen=True)
class Culprit:
    rank: int  # the rank named (the lowest of a cycle)
    cause: str  # one line, for `rank R stalled: <cause>`
    held_up: tuple[int, ...] = ()  # ranks that wait for it, directly or not
    cycle: tuple[int, ...] = ()  # a deadlock's ranks, in wait-for order


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def find_culprit(waits: Mapping[int, Sequence[int] | None], doing: Mapping[int, str] | None = None,
                 gpu: Mapping[int, str] | None = None) -> Culprit | None:
    """The rank that holds the others up, from each rank's wait-for edges.

    waits: rank -> the ranks it waits for (empty: nobody, it computes), or None if it is between steps.
    doing: rank -> what it is doing, for the cause ("1F0"). None if no rank is inside a step.
    gpu: rank -> where its host is, for the ranks whose waits and doing are their GPU's position.

    In order: a rank inside the step that waits for nobody (stuck in compute; the one most ranks wait
    for, the lowest on a tie); else a rank between steps that ranks inside it wait for (it finished, or
    never began, while they expect a message from it); else a cycle of ranks waiting for each other.
    """
    doing, gpu = doing or {}, gpu or {}
    in_step = {r: tuple(p for p in w if p in waits and p != r) for r, w in waits.items() if w is not None}
    if not in_step:
        return None
    waiters: dict[int, set[int]] = {r: set() for r in waits}  # rank -> who waits for it, transitively
    for start in in_step:
        seen, todo = {start}, list(in_step[start])
        while todo:
            r = todo.pop()
            if r in seen:
                continue
            seen.add(r)
            waiters[r].add(start)
            todo.extend(in_step.get(r, ()))
    for r in waiters:
        waiters[r].discard(r)

    def most_waited_for(candidates):
        return min(candidates, key=lambda r: (-len(waiters[r]), r))

    stuck = [r for r, peers in in_step.items() if not peers]
    if stuck:
        r = most_waited_for(stuck)
        held = tuple(sorted(waiters[r]))
        what = f" in {doing[r]}" if doing.get(r) else ""
        state = f"GPU busy{what} (its host is at {gpu[r]})" if r in gpu else f"stuck{what}"
        return Culprit(r, f"{state}, waiting for no other rank" +
                       (f"; {_ranks(held)} wait for it" if held else ""), held)
    idle = [r for r in waits if r not in in_step and waiters[r]]
    if idle:
        r = most_waited_for(idle)
        held = tuple(sorted(waiters[r]))
        return Culprit(r, f"is {BETWEEN_STEPS} while {_ranks(held)} wait for it", held)
    path, r = [], min(in_step)  # every rank in the step waits for another one in it: walk to a repeat
    while r not in path:
        path.append(r)
        r = min(in_step[r])
    cycle = tuple(path[path.index(r):])
    held = tuple(sorted(set().union(*(waiters[c] for c in cycle)) - set(cycle)))
    chain = " -> ".join(map(str, cycle + (cycle[0],)))
    return Culprit(min(cycle), f"deadlock: ranks {chain} wait for each other in a cycle", held, cycle)


def format_table(rows: Sequence[Mapping]) -> list[str]:
    """One line per rank: rank, pipeline position, the action it is on, what it waits for.

    A row: {"rank", "pp_index", "now", "device"}, where now is (action index or None, action, ranks waited
    for, what it waits for) or None between steps; a row without "now" did not answer; device, if given and
    not None, is where the rank's GPU is (the same form), shown instead with the host's action beside it.
    """
    lines = [f"{'rank':>6}  {'pp':>3}  {'action':<22}  waits for"]
    for row in sorted(rows, key=lambda row: row["rank"]):
        pp = row.get("pp_index")
        pp = "?" if pp is None else str(pp)
        if "now" not in row:
            action, what = "?", f"(no answer within {WHERE_TIMEOUT_S:.0f}s)"
        elif row["now"] is None:
            action, what = BETWEEN_STEPS, "-"
        else:
            index, name, _, what = row.get("device") or row["now"]
            action = name if index is None else f"#{index} {name}"
            if row.get("device"):
                action, what = f"GPU {action}", f"{what} (host: {row['now'][1]})"
        lines.append(f"{row['rank']:>6}  {pp:>3}  {action:<22}  {what}")
    return lines
