"""Rehearsed failures: PIPEGPT_FAULT=KIND:RANK:STEP makes RANK fail at the start of STEP.

KIND is raise (an exception), exit (the process dies) or freeze (the process stops: SIGSTOP).
The failure tests use it to prove that every kind brings the whole job down, naming the rank.
"""
from __future__ import annotations

import os
import signal
from typing import Mapping

FAULT_ENV = "PIPEGPT_FAULT"
KINDS = ("raise", "exit", "freeze")


def planned_fault(rank: int, env: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """(kind, step) if this rank is to fail, else None."""
    spec = env.get(FAULT_ENV)
    if not spec:
        return None
    kind, fault_rank, step = spec.split(":")
    if kind not in KINDS:
        raise ValueError(f"{FAULT_ENV} kind {kind!r} is not one of {', '.join(KINDS)}")
    return (kind, int(step)) if int(fault_rank) == rank else None


def fail_now(kind: str, step: int) -> None:
    if kind == "raise":
        raise RuntimeError(f"fault injected by {FAULT_ENV} at step {step}")
    if kind == "exit":
        os._exit(13)
    while True:  # freeze: stay stopped even if something sends SIGCONT
        os.kill(os.getpid(), signal.SIGSTOP)
