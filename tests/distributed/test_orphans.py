"""No orphans, ever: the driver SIGKILLed while its workers start takes them (and multiprocessing's
resource tracker) with it within seconds.

The moment that used to leave orphans is the first one: a spawned worker spends seconds importing torch
before it could ask for a parent-death signal, and a driver killed then left it waiting in init_rpc for
minutes. The driver is stopped (SIGSTOP) the instant its first worker process exists, so that it can
start nothing more, its descendants are read from /proc (pid and start time, so a recycled pid is not
mistaken for one of them), then it is killed. Only those pids are cleaned up afterwards. Workers forked by the
preload server (pipegpt.comm.preload) are the driver's grandchildren: killed as they start, too.
(tests/distributed/test_failures.py kills a driver in the middle of training.)
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from helpers import PIPEGPT, ROOT, clean_env, proc_cmdline
from pipegpt.comm import preload

GONE_WITHIN_S = 5.0
START_LIMIT_S = 120.0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, starttime) of a process, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[19])


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def _descendants(pid: int) -> dict[int, int]:
    """pid -> starttime of every process below pid."""
    found, todo = {}, _children(pid)
    while todo:
        child = todo.pop()
        st = _stat(child)
        if st is not None and child not in found:
            found[child] = st[1]
            todo += _children(child)
    return found


def _alive(pid: int, starttime: int) -> bool:
    """The same process as the one seen (start time), and not a zombie (those hold nothing, and reaping
    them is init's business)."""
    st = _stat(pid)
    return st is not None and st[0] not in "ZXx" and st[1] == starttime


def _is_worker(pid: int) -> bool:
    return "spawn_main" in proc_cmdline(pid)


def _start_driver(tmp_path) -> tuple[subprocess.Popen, object]:
    """A long `pipegpt run` of two workers, and the file its stderr goes to."""
    stderr = tmp_path / "stderr"  # a file: an orphan holding a pipe would keep a reader waiting
    env = clean_env()
    env.pop(preload.SHARED_ADDRESS, None)  # the driver's own preload server, as a user's run has: its family
    with open(stderr, "w") as err:
        driver = subprocess.Popen([PIPEGPT, "run", "--stages", "2", "--microbatches", "2", "--steps", "1000",
                                   "--threads-per-worker", "1", "--run-dir", str(tmp_path / "run")],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    return driver, stderr


def _end(family: dict[int, int], driver: subprocess.Popen) -> None:
    """After the test: kill whatever of the driver's family is left, and the driver."""
    for pid, start in family.items():
        if _alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if driver.poll() is None:
        driver.kill()
        driver.wait(timeout=10)


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
@pytest.mark.parametrize("after_s", [0.0, 1.5], ids=["at-once", "while-importing"])
def test_killing_the_driver_while_workers_start_leaves_no_process(tmp_path, after_s):
    """after_s: how long after the first worker process exists the driver is killed (at once: before the
    worker could run any code of ours; 1.5 s: while it imports torch)."""
    driver, stderr = _start_driver(tmp_path)
    family: dict[int, int] = {}
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while not any(_is_worker(c) for c in _children(driver.pid)):
            assert driver.poll() is None, f"the driver exited ({driver.returncode}): {stderr.read_text()}"
            assert time.monotonic() < deadline, "no worker process started"
            time.sleep(0.002)
        time.sleep(after_s)
        os.kill(driver.pid, signal.SIGSTOP)  # it starts nothing more while its family is read
        family = _descendants(driver.pid)
        kinds = {pid: proc_cmdline(pid) for pid in family}
        os.kill(driver.pid, signal.SIGKILL)
        killed = time.monotonic()
        driver.wait(timeout=10)
        assert any("spawn_main" in cmd for cmd in kinds.values()), kinds
        while any(_alive(pid, start) for pid, start in family.items()) and time.monotonic() < killed + GONE_WITHIN_S:
            time.sleep(0.05)
        left = {pid: kinds[pid] for pid, start in family.items() if _alive(pid, start)}
        print(f"\ndriver killed {after_s:.1f}s after its first worker existed; {len(family)} descendants "
              f"({', '.join('tracker' if 'resource_tracker' in c else 'worker' for c in kinds.values())}) "
              f"gone {time.monotonic() - killed:.2f}s later")
        assert not left, f"alive {GONE_WITHIN_S:.0f}s after the driver was killed: {left}"
    finally:
        _end(family, driver)


def _forked_workers(pid: int) -> list[int]:
    """The driver's grandchildren that are workers forked by its preload server (pipegpt.comm.preload): the
    server's command line, or their title."""
    return [grandchild for child in _children(pid) for grandchild in _children(child)
            if _is_worker(grandchild) or proc_cmdline(grandchild).startswith("pipegpt: rank")]


@pytest.mark.parametrize("after_s", [0.0, 0.3], ids=["at-fork", "while-joining"])
def test_killing_the_driver_while_forked_workers_start_leaves_no_process(tmp_path, after_s):
    """The workers forked by the preload server are the server's children, not the driver's: the driver's death
    kills the server, whose death kills them. after_s: how long after the first forked worker exists the driver
    is killed (at once: before it could arm its own parent-death signal; 0.3 s: while it joins RPC)."""
    driver, stderr = _start_driver(tmp_path)
    family: dict[int, int] = {}
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while not _forked_workers(driver.pid):
            assert driver.poll() is None, f"the driver exited ({driver.returncode}): {stderr.read_text()}"
            assert time.monotonic() < deadline, "no worker was forked"
            time.sleep(0.002)
        time.sleep(after_s)
        os.kill(driver.pid, signal.SIGSTOP)
        family = _descendants(driver.pid)
        forked = set(_forked_workers(driver.pid))
        os.kill(driver.pid, signal.SIGKILL)
        killed = time.monotonic()
        driver.wait(timeout=10)
        assert forked and forked <= set(family), family
        while any(_alive(pid, start) for pid, start in family.items()) and time.monotonic() < killed + GONE_WITHIN_S:
            time.sleep(0.05)
        left = {pid: proc_cmdline(pid) for pid, start in family.items() if _alive(pid, start)}
        print(f"\ndriver killed {after_s:.1f}s after its first forked worker existed; {len(family)} descendants "
              f"({len(forked)} forked) gone {time.monotonic() - killed:.2f}s later")
        assert not left, f"alive {GONE_WITHIN_S:.0f}s after the driver was killed: {left}"
    finally:
        _end(family, driver)
