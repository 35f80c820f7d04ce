"""Rehearsed failures: PIPEGPT_FAULT=KIND:RANK:STEP makes RANK fail at the start of STEP (counted from 1, as
the console and metrics.jsonl count: 1 is the first step).

KIND is raise (an exception), exit (the process dies), freeze (the process stops: SIGSTOP), or
kill-in-save (SIGKILL halfway through writing the checkpoint taken after STEP steps), or stuck (the
rank stays alive and answering, heartbeats and all, but its first compute action of STEP never returns:
the stall watchdog must name it, though its pipeline neighbours are the ones seen waiting).
The failure tests use it to prove that every kind brings the whole job down, naming the rank.
Two kinds poison a value instead, for the non-finite guard: nan-loss (the rank's first loss of STEP is
reported as nan; its gradients stay finite) and nan-grad (one of the rank's gradients becomes nan once
the step's gradients are final, after the data-parallel average).
lose is exit, but the rank's device counts as gone for good: a restart goes on without it (--min-ranks).
gpu-stuck rehearses the CUDA form of stuck on any device: the rank's host launches every action of STEP
and then waits at the step's end (as it would in settle()), while its "GPU" never finishes the first
compute action (the runtime's per-action device marks are stood in for: pipegpt.timing.device_marker).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Mapping

FAULT_ENV = "PIPEGPT_FAULT"
KINDS = ("raise", "exit", "freeze", "kill-in-save", "stuck", "nan-loss", "nan-grad", "gpu-stuck", "lose")
LOSE = "lose"
# A rehearsed `lose` exits with this code: the rank's device is gone for good (a dead GPU or host), so a restart
# (--max-restarts) must go on without it (--min-ranks) rather than in the same layout.
LOST_DEVICE_EXIT = 75
IN_SAVE = "kill-in-save"
STUCK = "stuck"
NAN_LOSS, NAN_GRAD = "nan-loss", "nan-grad"
GPU_STUCK = "gpu-stuck"
NOT_FAILURES = (IN_SAVE, STUCK, NAN_LOSS, NAN_GRAD, GPU_STUCK)  # kinds that do not fail at the start of their step


def planned_fault(rank: int, env: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """(kind, step) if this rank is to fail, else None. A comma list plans one fault per attempt of a run that
    restarts (--max-restarts): each restart drops the first (later_faults)."""
    spec = env.get(FAULT_ENV, "").split(",")[0]
    if not spec:
        return None
    kind, fault_rank, step = spec.split(":")
    if kind not in KINDS:
        raise ValueError(f"{FAULT_ENV} kind {kind!r} is not one of {', '.join(KINDS)}")
    return (kind, int(step)) if int(fault_rank) == rank else None


def fail_now(kind: str, step: int) -> None:
    if kind == IN_SAVE:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV} at step {step}")
    if kind == "exit":
        os._exit(13)
    if kind == LOSE:
        os._exit(LOST_DEVICE_EXIT)
    while True:  # freeze: stay stopped even if something sends SIGCONT
        os.kill(os.getpid(), signal.SIGSTOP)


def get_stuck(stages) -> None:
    """Make the rank's next compute action (at a step's start, always a forward) sleep forever, in
    Python, so its RPC threads keep answering. Only a faulty rank's stages are touched."""
    for stage in stages:
        stage.forward = _forever


def _forever(*args, **kwargs) -> None:
    while True:
        time.sleep(1.0)


class _Mark:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def get_gpu_stuck(runtime, p2p) -> None:
    """gpu-stuck: marks that say the device never got past the step's first compute action, and a settle()
    that never returns (the host waiting for that device), on this rank's runtime and point-to-point only."""
    seen = {"compute": False}

    def marker(action):
        seen["compute"] = seen["compute"] or action.kind.is_compute
        return _Mark(not seen["compute"])

    runtime.marker = marker
    p2p.settle = _forever


def later_faults(env: Mapping[str, str] = os.environ) -> str | None:
    """PIPEGPT_FAULT for the next attempt after a restart: the list less its first fault (None: no more)."""
    rest = env.get(FAULT_ENV, "").split(",")[1:]
    return ",".join(rest) or None
