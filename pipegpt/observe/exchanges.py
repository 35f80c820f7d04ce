"""The expert-parallel all-to-alls of a traced step, as trace events of their own beside the plan's actions.

A MoE layer's dispatch and combine (pipegpt.expert_parallel) run inside a compute action, forward and backward,
so they are not actions of the plan. While a traced step runs, `recording_exchanges` installs a recorder in
pipegpt.expert_parallel.all_to_all: each exchange (the counts, the dispatch, the combine, and in backward the
reverse of each, "(backward)") is a span from its post to the end of its wait, on the runtime's clock (on CUDA
its events on the compute stream, resolved after the step as the actions' are). `trace_events` writes them into
trace.json on threads of their own under each rank's actions: "B"/"E" pairs, not "X" events, since the X events
of a trace are the plan's actions, which `pipegpt simulate --trace` and the planner's --calibrate read back.
"""
from __future__ import annotations

import contextlib
import importlib

CATEGORY = "expert all-to-all"
FIRST_TID = 1  # the actions are on thread 0


class ExchangeRecorder:
    """What the all-to-all hook calls: mark() at a post, add(what, posted, rows) at the end of its wait."""

    def __init__(self, mark):
        self.mark, self.spans = mark, []

    def add(self, what: str, posted, rows: int) -> None:
        self.spans.append(((what, rows), posted, self.mark()))


@contextlib.contextmanager
def recording_exchanges(clock, on: bool = True):
    """Record the exchanges the block runs (on: else nothing is recorded and it yields None); yields the
    recorder, whose spans `resolved` reads once the step is done."""
    if not on:
        yield None
        return
    hook = importlib.import_module("pipegpt.expert_parallel.all_to_all")  # the module: the package's
    recorder = ExchangeRecorder(clock.mark)                                # all_to_all is its function
    hook.recorder = recorder
    try:
        yield recorder
    finally:
        hook.recorder = None


def resolved(recorder: ExchangeRecorder | None, clock) -> list[tuple[str, float, float, int]]:
    """(what, start_s, end_s, rows received) of each recorded exchange, on perf_counter's time line."""
    if recorder is None or not recorder.spans:
        return []
    return [(what, start, end, rows) for (what, rows), start, end in clock.resolve(recorder.spans)]


def trace_events(exchanges_per_rank: list[tuple[int, list]], t0: float) -> list[dict]:
    """Chrome trace events of every rank's exchanges (rank, [(what, start_s, end_s, rows)]), times from t0 (the
    step's first action's start) in microseconds. Spans that overlap on a rank (a schedule that posts one and
    waits later) go on separate threads, so every B/E pair nests."""
    events = []
    for rank, exchanges in exchanges_per_rank:
        lanes: list[float] = []  # each thread's last end
        for what, start, end, rows in sorted(exchanges, key=lambda e: (e[1], e[2])):
            lane = next((i for i, free in enumerate(lanes) if free <= start), len(lanes))
            if lane == len(lanes):
                lanes.append(end)
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": FIRST_TID + lane,
                               "args": {"name": CATEGORY if lane == 0 else f"{CATEGORY} {lane + 1}"}})
            lanes[lane] = end
            where = {"pid": rank, "tid": FIRST_TID + lane, "cat": CATEGORY, "name": what}
            events.append({**where, "ph": "B", "ts": (start - t0) * 1e6, "args": {"rows_received": rows}})
            events.append({**where, "ph": "E", "ts": (end - t0) * 1e6})
    return events
