"""Trace events of ranks on different machines land on one time line (pipegpt.observe.clocks)."""
from __future__ import annotations

import itertools

from pipegpt.observe.clocks import clock_domain, estimate_offset, measure_offsets, shift_events


class SimulatedNode:
    """A machine whose perf_counter started `skew` seconds before the driver's; each sample's round trip
    takes `rtt` seconds of the driver's time, split evenly either side of the reading."""

    def __init__(self, domain: str, skew: float, rtts):
        self.domain, self.skew, self.rtts = domain, skew, iter(rtts)

    def ask(self, driver_clock):
        rtt = next(self.rtts)
        driver_clock.advance(rtt / 2)
        reading = driver_clock.now + self.skew
        driver_clock.advance(rtt / 2)
        return self.domain, reading


class DriverClock:
    def __init__(self):
        self.now = 100.0

    def advance(self, s):
        self.now += s

    def __call__(self):
        return self.now


def test_two_simulated_nodes_whose_clocks_differ_share_one_time_line():
    clock = DriverClock()
    here = SimulatedNode("node-a/boot-1", 0.0, itertools.repeat(1e-3))
    there = SimulatedNode("node-b/boot-7", 3600.0, [5e-3, 1e-3, 9e-3, 2e-3, 4e-3])  # an hour's more uptime
    nodes = [here, there]
    offsets = measure_offsets(lambda r: nodes[r].ask(clock), range(2), local=clock, domain="node-a/boot-1")
    assert offsets[0] == 0.0  # same machine, same clock: nothing estimated
    assert abs(offsets[1] + 3600.0) < 1e-9  # symmetric round trips: the midpoint is exact
    # An action that ran on both nodes at the same driver time t reads t there + 3600; shifted, they agree.
    t = clock.now
    [(name, start, end)] = shift_events([("1F0", t + 3600.0, t + 3600.5)], offsets[1])
    assert name == "1F0" and abs(start - t) < 1e-9 and abs(end - (t + 0.5)) < 1e-9


def test_the_fastest_round_trip_bounds_the_error():
    # Asymmetric delays: the reading came late in a slow round trip, early in the fast one.
    samples = [(0.0, 10.009, 0.010), (1.0, 11.0004, 1.001)]
    offset = estimate_offset(samples)
    assert abs(offset - (-10.0)) <= 0.001 / 2 + 1e-12


def test_this_machine_is_one_clock_domain():
    assert clock_domain() == clock_domain()
    assert shift_events([("0F0", 1.0, 2.0)], 0.0) == [("0F0", 1.0, 2.0)]
