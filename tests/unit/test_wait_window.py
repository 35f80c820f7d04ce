"""A driver stopped for 40 s (SIGSTOP) must not blame a worker: the windows of its waits (deadline, stall
check, heartbeats) start again after a pause of its own (pipegpt.comm.wait_window), on an injected clock here;
a real SIGSTOP of a driver is tests/distributed/test_failures.py's slow test."""
from __future__ import annotations

import threading
import time
import types

import pytest

from pipegpt.comm import wait_window
from pipegpt.comm.wait_window import PAUSE_S, WaitWindow


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def run(self, window, seconds, poll_s=0.05):
        """The driver polling for `seconds`: pauses seen on the way."""
        seen = []
        for _ in range(round(seconds / poll_s)):
            self.t += poll_s
            if (paused := window.poll()) is not None:
                seen.append(paused)
        return seen


def test_a_pause_of_the_driver_starts_every_window_again():
    clock = Clock()
    window = WaitWindow(timeout_s=60, stall_after_s=10, ranks=[0, 1], clock=clock)
    clock.run(window, 9.5)  # 9.5 s into a step: nothing due yet
    window.heard_from(0)
    assert not window.stall_due() and window.silent_for(1) == pytest.approx(9.5)
    clock.t += 40  # SIGSTOP ... SIGCONT: the clock jumped between two polls
    assert window.poll() == pytest.approx(40)
    assert not window.timed_out() and not window.stall_due()
    assert window.silent_for(0) == window.silent_for(1) == 0 and window.waited() == 0
    clock.run(window, 9.9)
    assert not window.stall_due() and window.silent_for(1) < 10  # the worker gets its whole window again
    clock.run(window, 0.2)
    assert window.stall_due() and window.silent_for(1) > 10  # ... and no more


def test_without_a_pause_the_windows_run_out_as_before():
    clock = Clock()
    window = WaitWindow(timeout_s=60, stall_after_s=10, ranks=[0], clock=clock)
    assert clock.run(window, 10.1) == []
    assert window.stall_due() and window.waited() == pytest.approx(10.1)
    window.stall_checked()
    assert not window.stall_due()
    clock.run(window, 10.1)
    assert window.stall_due()
    clock.run(window, 40)
    assert window.timed_out()


def test_a_slow_poll_is_not_a_pause():
    """The stall watchdog's where() inside a poll takes up to 3 s: time the workers are given, not a pause."""
    clock = Clock()
    window = WaitWindow(timeout_s=5, clock=clock)
    clock.t += PAUSE_S - 0.1
    assert window.poll() is None
    clock.t += 0.2
    window.poll()
    assert window.timed_out()


# --------------------------------------------------------------------------------------------------------------
# Cluster.call over fake actors, its clock jumping 40 s as a stopped driver's does

class _Future:
    def __init__(self, ready_at=None, value=None):
        self.ready_at, self.value, self.callbacks = ready_at, value, []

    def done(self):
        return self.ready_at is not None and time.monotonic() >= self.ready_at

    def wait(self):
        return self.value

    def add_done_callback(self, fn):
        self.callbacks.append(fn)


class _Actor:
    def __init__(self, rank, answer_after_s):
        self.rank, self.answer_after_s = rank, answer_after_s

    def rpc_async(self, timeout):
        assert timeout == 0  # RPC's own timer would count the driver's pause against the worker
        return types.SimpleNamespace(step=lambda: _Future(time.monotonic() + self.answer_after_s, self.rank))


def test_a_stopped_driver_blames_no_worker(monkeypatch, capsys):
    from pipegpt.comm import rpc

    real = time.monotonic
    began = real()
    jumped = lambda: real() + (40.0 if real() - began > 0.1 else 0.0)  # noqa: E731 - stopped 0.1 s in
    monkeypatch.setattr(wait_window, "time", types.SimpleNamespace(monotonic=jumped))
    monkeypatch.setattr(rpc.rpc, "rpc_async", lambda *a, **k: _Future(None))  # heartbeats unread until the end
    cluster = rpc.Cluster()
    cluster.world_size, cluster.timeout_s = 2, 10.0
    cluster.actors = [_Actor(0, 0.3), _Actor(1, 0.4)]
    stalled = threading.Event()
    assert cluster.call("step", stall_after_s=5.0, on_stall=lambda waited: stalled.set()) == [0, 1]
    assert not stalled.is_set()
    assert capsys.readouterr().err.splitlines() == [wait_window.pause_line(40.0)]


def test_the_fake_cluster_does_blame_a_late_worker(monkeypatch):
    """The check above can fail: the same cluster, a worker that never answers, no pause."""
    from pipegpt.comm import rpc

    monkeypatch.setattr(rpc.rpc, "rpc_async", lambda *a, **k: _Future(time.monotonic()))
    cluster = rpc.Cluster()
    cluster.world_size, cluster.timeout_s = 2, 0.5
    cluster.actors = [_Actor(0, 0.1), _Actor(1, 1e9)]
    with pytest.raises(rpc.WorkerFailure, match=r"^rank 1 failed: no answer to step\(\) within 0s \(ranks \[1\] "
                       r"pending; --timeout sets the limit\)$"):
        cluster.call("step")
