"""The windows of a wait on the workers (its deadline, the stall watchdog's check, each rank's heartbeat), on a
clock that knows when this process itself was not running.

A driver stopped for 40 s (SIGSTOP, Ctrl-Z, a suspended VM) sees time.monotonic jump by 40 s between two polls
of a loop that polls every 50 ms. Counted against the workers, those seconds would make a heartbeat late, a step
stalled and an answer past the timeout, and a worker would be blamed for the driver's pause; meanwhile the
workers' answers sit unread in the driver's sockets. A gap between two polls far longer than a poll takes is a
pause of this process: every window starts again after it. Torch-free, the clock injectable (the unit tests).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

# A gap this long between two polls is a pause of this process: a poll takes ~50 ms, the stall watchdog's
# where() inside one at most 3 s; a worker is blamed only after 10 s (heartbeat, stall floor).
PAUSE_S = 5.0


class WaitWindow:
    """One wait's windows: call poll() once per poll, then ask timed_out(), stall_due(), silent_for(rank).

    timeout_s: the wait gives up after this long; stall_after_s (None: never): the stall check is due after
    this long, and again as long after each check; ranks: those whose heartbeats are timed."""

    def __init__(self, timeout_s: float, stall_after_s: float | None = None, ranks: Iterable[int] = (),
                 clock: Callable[[], float] | None = None, pause_s: float = PAUSE_S):
        self.timeout_s, self.stall_after_s, self.pause_s = timeout_s, stall_after_s, pause_s
        self._clock = clock or time.monotonic
        self.ranks = list(ranks)
        self.now = self._clock()
        self._start(self.now)

    def _start(self, now: float) -> None:
        self.started = now
        self.stall_at = now + self.stall_after_s if self.stall_after_s else float("inf")
        self.heard = {r: now for r in self.ranks}  # when each rank last answered a heartbeat

    def poll(self) -> float | None:
        """Read the clock; where this process was paused since the last poll, start every window again and
        return the pause's seconds (else None)."""
        now = self._clock()
        gap, self.now = now - self.now, now
        if gap > self.pause_s:
            self._start(now)
            return gap
        return None

    def waited(self) -> float:
        """Seconds the wait has run since it began (or since this process's last pause)."""
        return self.now - self.started

    def timed_out(self) -> bool:
        return self.waited() > self.timeout_s

    def stall_due(self) -> bool:
        return self.now > self.stall_at

    def stall_checked(self) -> None:
        """The stall check ran and returned: the next one is due stall_after_s from now."""
        self.now = self._clock()
        self.stall_at = self.now + self.stall_after_s

    def heard_from(self, rank: int) -> None:
        self.heard[rank] = self.now

    def silent_for(self, rank: int) -> float:
        """Seconds since `rank` last answered a heartbeat (or the window began)."""
        return self.now - self.heard[rank]


def pause_line(seconds: float) -> str:
    return (f"pipegpt: the driver was paused for {seconds:.0f}s (stopped, or not scheduled); its waits on the "
            f"workers start again")
