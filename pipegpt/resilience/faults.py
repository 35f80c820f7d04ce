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
compute action (the runtime's per-action device marks are stood in for: pipegpt.stages.timing.device_marker).
"""
from __future__ import annotations

import math
import os
import signal
import time
from typing import Callable, Mapping

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
    restarts: each restart of --max-restarts drops the first (later_faults); torchrun's restarts run the same
    command again, so there the attempt is torchrun's restart count."""
    planned = env.get(FAULT_ENV, "").split(",")
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    spec = planned[attempt] if attempt < len(planned) else ""
    if not spec:
        return None
    kind, fault_rank, step = spec.split(":")
    if kind not in KINDS:
        raise ValueError(f"{FAULT_ENV} kind {kind!r} is not one of {', '.join(KINDS)}")
    return (kind, int(step)) if int(fault_rank) == rank else None


def check_faults(world_size: int, steps: int, env: Mapping[str, str] = os.environ) -> None:
    """Every fault of PIPEGPT_FAULT is KIND:RANK:STEP with a known kind, a rank of this job and a step it runs;
    else one ValueError line naming the bad entry and what would be valid (checked before any worker starts)."""
    value = env.get(FAULT_ENV, "")
    if not value:
        return
    for spec in value.split(","):
        parts = spec.split(":")
        if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts[1:]):
            raise ValueError(f"{FAULT_ENV}={value!r}: {spec!r} is not KIND:RANK:STEP (e.g. raise:1:3; a comma list "
                             f"plans one fault per attempt)")
        kind, rank, step = parts[0], int(parts[1]), int(parts[2])
        if kind not in KINDS:
            raise ValueError(f"{FAULT_ENV}={value!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"{FAULT_ENV}={value!r}: rank {rank} is not one of this job's ranks 0..{world_size - 1}")
        if not 1 <= step <= steps:
            raise ValueError(f"{FAULT_ENV}={value!r}: step {step} is not one this run takes (1..{steps})")


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


def _forever(*args, **kwargs) -> None:
    while True:
        time.sleep(1.0)


class _Mark:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def _gpu_stuck_marker():
    """gpu-stuck's marks: the device never got past the step's first compute action."""
    seen = {"compute": False}

    def marker(action):
        seen["compute"] = seen["compute"] or (action is not None and action.kind.is_compute)
        return _Mark(not seen["compute"])

    return marker


class FaultHook:
    """A rank's rehearsed fault, called at the points of a step where one can strike. It reaches into the runtime
    only through the runtime's own hook points (PipelineRuntime.intercept); with no fault planned every call is
    a comparison."""

    def __init__(self, fault: tuple[str, int] | None):
        self.fault = fault

    @classmethod
    def planned(cls, rank: int, env: Mapping[str, str] = os.environ) -> "FaultHook":
        return cls(planned_fault(rank, env))

    def on_build(self, engine) -> None:
        """A rebuilt engine has fresh runtimes: nothing is intercepted until the fault's step."""

    def at_step_start(self, number: int, engine) -> None:
        """Step `number` (from 1) begins: fail now, or make the runtime stick (stuck: its first compute action
        never returns, in Python, so the RPC threads keep answering; gpu-stuck: the host launches everything
        and waits at the step's end while the device marks say it never left the first compute action)."""
        if self.fault is None or self.fault[1] != number:
            return
        kind = self.fault[0]
        if kind not in NOT_FAILURES:
            fail_now(kind, number)
        if kind == STUCK:
            engine.runtime.intercept(before_compute=_forever)
        if kind == GPU_STUCK:
            engine.runtime.intercept(marker=_gpu_stuck_marker(), before_settle=_forever)

    def after_gradients(self, number: int, losses: list[float], named_params) -> None:
        """The step's gradients are final (after every sync): poison the loss or a gradient."""
        if self.fault == (NAN_LOSS, number) and losses:
            losses[0] = math.nan
        if self.fault == (NAN_GRAD, number):
            next(p for _, p in named_params if p.grad is not None).grad.view(-1)[0] = math.nan

    def in_save(self, step: int, write_half: Callable[[], object]) -> None:
        """kill-in-save: half a file written, then SIGKILL."""
        if self.fault == (IN_SAVE, step):
            write_half()
            fail_now(IN_SAVE, step)


def later_faults(env: Mapping[str, str] = os.environ) -> str | None:
    """PIPEGPT_FAULT for the next attempt after a restart: the list less its first fault (None: no more)."""
    rest = env.get(FAULT_ENV, "").split(",")[1:]
    return ",".join(rest) or None
