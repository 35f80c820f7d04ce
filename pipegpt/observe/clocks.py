"""Ranks' trace events on one time line across machines.

Workers stamp actions with time.perf_counter(), CLOCK_MONOTONIC on Linux: one clock for every process
of a machine, but another machine's counts from its own boot. At start the driver samples each worker's
clock over RPC and keeps, per rank, the offset that maps it onto the driver's: zero for a worker that
shares the driver's clock (same boot), else Cristian's estimate from the fastest of a few round trips
(error at most half that round trip). Torch-free.
"""
from __future__ import annotations

import socket
import time
from typing import Callable

SAMPLES = 5  # round trips per rank; the fastest one bounds the error best


def clock_domain() -> str:
    """Processes with the same answer read the same perf_counter: the machine and its boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: assume one clock per host name
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def clock_reading() -> tuple[str, float]:
    """What a worker answers the driver's clock sample: (its clock domain, its perf_counter now)."""
    return clock_domain(), time.perf_counter()


def estimate_offset(samples: list[tuple[float, float, float]]) -> float:
    """Seconds to add to a remote clock to put it on the local one, from (local_before, remote, local_after)
    samples: the remote reading is taken as the midpoint of the fastest round trip."""
    before, remote, after = min(samples, key=lambda s: s[2] - s[0])
    return (before + after) / 2 - remote


def measure_offsets(ask: Callable[[int], tuple[str, float]], ranks: range,
                    local: Callable[[], float] = time.perf_counter, domain: str | None = None) -> list[float]:
    """Per rank, the offset onto this process's clock: `ask(rank)` returns that rank's clock_reading()."""
    domain = clock_domain() if domain is None else domain
    offsets = []
    for rank in ranks:
        samples = []
        for _ in range(SAMPLES):
            before = local()
            their_domain, remote = ask(rank)
            samples.append((before, remote, local()))
            if their_domain == domain:  # one clock: nothing to estimate, and no error to add
                break
        offsets.append(0.0 if their_domain == domain else estimate_offset(samples))
    return offsets


def shift_events(events: list[tuple[str, float, float]], offset: float) -> list[tuple[str, float, float]]:
    if not offset:
        return events
    return [(name, start + offset, end + offset) for name, start, end in events]
