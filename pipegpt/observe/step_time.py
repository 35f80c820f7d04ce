"""A measured step's whole time, beyond its actions: the parts a worker's step() spends outside the plan's actions,
the driver's round trip, as trace events of their own, and the step broken down into them.

A traced step's trace.json holds the plan's actions as "X" events (what `pipegpt simulate --trace` and the
planner's --calibrate read back). Beside them, as "B"/"E" pairs that those readers skip:

* on each rank, on a thread of its own, the parts of its step() on the host (StepPhases): before the actions
  (zeroing the gradients, the batch), the actions (the engine's train_step), the gradient sync (the data-parallel
  reduction's wait, after the schedule's last action), the clip (the global norm's all-reduce), the optimizer
  (its step and ZeRO's all-gather), the end of the step (the router's loads, the device's synchronize). On a GPU
  these are host times: a part ends when the host is done with it, which for the sync (a stream's wait)
  may be before its kernels are; the clip's norm and, on a traced step, a synchronize before the optimizer's
  end bring the host level with the device, so the parts from the clip on are the device's too;
* with one step a call, the driver's call as a process of its own: from sending the step to receiving every
  rank's answer (a call of several steps has no per-step send and receipt: it is left out).

pipegpt.schedule.calibrate's `breakdown` reads them back (the planner's --calibrate reads them too); `breakdown_text`
prints it (`pipegpt simulate --trace RUN_DIR --breakdown`).
"""
from __future__ import annotations

import math
import time

from pipegpt.run_files import read_json
from pipegpt.schedule.calibrate import (ACTIONS, BEFORE, CLIP, DRIVER_CATEGORY, END, OPTIMIZER, PART_CATEGORY,
                                        PART_TID, SYNC, StepBreakdown, breakdown)


class StepPhases:
    """A worker's step() split at its marks: mark(part) ends `part` now (perf_counter), the next begins."""

    def __init__(self, start: float):
        self.last, self.spans = start, []

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.spans.append((part, self.last, now))
        self.last = now


def trace_events(phases_per_rank: list[tuple[int, list]], t0: float, call: tuple | None = None) -> list[dict]:
    """Chrome trace events of every rank's step parts (rank, [(part, start_s, end_s)]) and, with `call` (the
    driver's (send_s, receipt_s, steps)) of one step, the driver's call; times from t0 (the step's first action's
    start) in microseconds."""
    events = []
    ranks = [rank for rank, _ in phases_per_rank]
    for rank, phases in phases_per_rank:
        if phases:
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": PART_TID,
                           "args": {"name": "step parts"}})
        for part, start, end in phases:
            where = {"pid": rank, "tid": PART_TID, "cat": PART_CATEGORY, "name": part}
            events += [{**where, "ph": "B", "ts": (start - t0) * 1e6}, {**where, "ph": "E", "ts": (end - t0) * 1e6}]
    if call is not None and call[2] == 1:
        pid = max(ranks, default=-1) + 1
        where = {"pid": pid, "tid": 0, "cat": DRIVER_CATEGORY, "name": "step call"}
        events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "driver"}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
                   {**where, "ph": "B", "ts": (call[0] - t0) * 1e6}, {**where, "ph": "E", "ts": (call[1] - t0) * 1e6}]
    return events


def step_report(comparison, run_dir: str) -> dict:
    """`simulate --trace RUN_DIR --breakdown`: the traced step's parts (StepBreakdown.as_dict), the whole step
    predicted -- the simulated makespan with the costs calibrated from the trace, plus the parts outside the
    actions, which calibrate from this same step and so predict themselves -- and the text of both."""
    source = comparison.measured.meta.get("source") or run_dir
    parts = breakdown(read_json(source, "trace"))
    if parts is None:
        return {"text": f"{source} has no step parts (a trace from before they were recorded): no breakdown",
                "parts": None}
    makespan = float(comparison.predicted.makespan)
    outside = parts.total - parts.part(ACTIONS)
    predicted = makespan + outside
    text = "\n".join([breakdown_text(parts), f"predicted: makespan {makespan * 1e3:.3f} ms (simulated, calibrated "
                      f"costs) + {outside * 1e3:.3f} ms outside the actions (calibrated from this step) = "
                      f"{predicted * 1e3:.3f} ms; whole step measured / predicted "
                      f"{parts.total / predicted if predicted else math.nan:.3f}"])
    return {**parts.as_dict(), "predicted": predicted, "text": text}


def breakdown_text(b: StepBreakdown) -> str:
    """The breakdown as tables: the step's parts (ms, share of the step), then each rank's actions and parts."""
    from pipegpt.schedule.render import text_table

    total = b.total
    rows = [["part", "measured", "share"]]
    for name, x in b.parts:
        rows.append([name, f"{x * 1e3:.3f} ms", f"{100 * x / total:.1f}%" if total else "-"])
    rows.append(["step" if b.driver else "step (no driver's call in the trace)", f"{total * 1e3:.3f} ms", "100.0%"])
    lines = ["the step's parts (each from the previous instant: the driver's send, the first rank's start, the "
             "first action, the last action's end, the last rank's sync, clip, optimizer and end, the receipt):",
             text_table(rows, right={1, 2}, rule=True)]
    names = [n for n in (BEFORE, ACTIONS, SYNC, CLIP, OPTIMIZER, END) if any(n in r for r in b.per_rank.values())]
    rows = [["rank", "compute", "messages", "idle"] + names]
    for rank, r in b.per_rank.items():
        rows.append([rank] + [f"{r.get(k, 0.0) * 1e3:.3f}" for k in ["compute", "messages", "idle"] + names])
    lines += ["per rank, ms (compute, message batches and idle within the actions' span; then each part of its "
              "step()):", text_table(rows, right=set(range(len(rows[0]))))]
    return "\n".join(lines)
