"""Targets of the workers tests/distributed/test_preload.py forks: what a worker sees of its driver, an exit, a wait."""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time


def report(path: str) -> None:
    """Write what this process was given (environment, directory, cores, name, parent) to path; say so on stdout."""
    with open(path, "w") as f:
        json.dump({"probe": os.environ.get("PIPEGPT_PROBE"), "cwd": os.getcwd(),
                   "cores": sorted(os.sched_getaffinity(0)), "name": multiprocessing.current_process().name,
                   "ppid": os.getppid(), "torch": "torch" in sys.modules}, f)
    print(f"reported to {path}", flush=True)


def exit_with(code: int) -> None:
    sys.exit(code)


def wait() -> None:
    while True:
        time.sleep(1)
