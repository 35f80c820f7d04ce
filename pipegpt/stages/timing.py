"""Per-action timestamps that mean what they say on every device.

On CPU an action's end is when its Python call returns. On CUDA that is only
when its kernels were launched, so the clock there records CUDA events on the
compute stream and, after the step, places them on the host's perf_counter
time line (one clock for every process of a machine, so ranks line up).
"""
from __future__ import annotations

import time

import torch


class HostClock:
    """perf_counter marks: the step's events need no resolving."""

    def start(self) -> None:
        pass

    mark = staticmethod(time.perf_counter)

    def resolve(self, events: list) -> list[tuple[str, float, float]]:
        return events


class CudaClock:
    """CUDA event marks, anchored to perf_counter by one synchronisation at the start of the step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.anchor_s, self.anchor = 0.0, None

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self.anchor_s = time.perf_counter()
        self.anchor = self.mark()

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, events: list) -> list[tuple[str, float, float]]:
        if not events:
            return []
        events[-1][2].synchronize()  # events complete in stream order: the last one covers all
        at = lambda e: self.anchor_s + self.anchor.elapsed_time(e) / 1e3  # noqa: E731 - ms -> s
        return [(name, at(start), at(end)) for name, start, end in events]


def clock_for(device: torch.device) -> HostClock | CudaClock:
    return CudaClock(device) if device.type == "cuda" else HostClock()


def _cuda_mark(action):
    event = torch.cuda.Event()  # no timing: only query()
    event.record()
    return event


def device_marker(device: torch.device):
    """What the runtime calls after launching each action, for the stall watchdog: on CUDA an event on the
    compute stream (its query() says whether the GPU got past the action; None for a phase after the plan's
    actions); None where the host's position is the device's (the CPU). A test may stand in any
    callable(action) -> object with query()."""
    return _cuda_mark if device.type == "cuda" else None
