"""A local worker process's tie to its driver: it dies when the driver does, at any moment.

A worker (LocalCluster) is a spawned interpreter, or a process forked by the preload server
(pipegpt.comm.preload, itself spawned by the driver and bound to it here): it starts, imports torch (seconds;
the server once for all), then serves RPC until the driver shuts it down. If the driver is killed meanwhile, nothing else would ever end it: it
waits in init_rpc or in a step until a timeout, or forever. So the very first thing the new process
runs, before torch is imported, is bind_to_parent():

  - on Linux, the parent-death signal (prctl PR_SET_PDEATHSIG): the kernel sends SIGKILL when the driver
    exits, whatever the cause, SIGKILL included;
  - then a check that the driver is still its parent: one killed between the spawn and the prctl has
    already handed this process to init, and no signal would ever come;
  - where there is no prctl, a daemon thread that watches the parent pid and exits the process once the
    driver is gone.

multiprocessing's resource tracker, which the spawn starts beside the workers, holds no reference of
its own: it exits when the driver and every worker have closed its pipe, that is when they are gone.

Torch-free on purpose: this module is what the spawned process imports to run its target.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_EVERY_S = 0.5


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    # The symbols the interpreter already has (libc's among them): find_library("c") would run `ldconfig -p`
    # in a subprocess, a child of every worker (and of the preload server) for a few milliseconds.
    return ctypes.CDLL(None, use_errno=True)


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux only); whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _libc().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def bind_to_parent(parent_pid: int) -> None:
    """End this process when the process `parent_pid` (its parent, the driver) ends, starting now."""
    signalled = parent_death_signal()
    if os.getppid() != parent_pid:  # the driver died before the signal was armed: no one would send it
        os._exit(1)
    if not signalled:
        threading.Thread(target=_watch, args=(parent_pid,), name="pipegpt-lifeline", daemon=True).start()


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_EVERY_S)
    os._exit(1)


def run_worker(parent_pid: int, target: str, *args) -> None:
    """A LocalCluster worker's process target: bound to the driver first, then `target` ("module:function",
    which imports torch) runs with args. Named, not imported here: this module must stay light."""
    bind_to_parent(parent_pid)
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(*args)
