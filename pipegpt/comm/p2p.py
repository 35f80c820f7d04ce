"""Batched non-blocking point-to-point between pipeline ranks, device-neutral, always with a timeout.

A batch (one run of comm actions in the plan) is posted at once; receives
are waited for before the next compute, sends only when their buffer is about
to be released or at the end of the step, so a send never stalls its rank.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    pass


class Message:
    """One tensor on its way to or from a peer rank."""

    __slots__ = ("tensor", "peer", "tag", "label", "work")

    def __init__(self, tensor: torch.Tensor, peer: int, tag: int, label: str):
        self.tensor, self.peer, self.tag, self.label, self.work = tensor, peer, tag, label, None


class PointToPoint:
    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        self.timeout = timedelta(seconds=timeout_s)

    def post(self, sends: list[Message], recvs: list[Message]) -> None:
        ops = [dist.P2POp(dist.isend, m.tensor, m.peer, tag=m.tag) for m in sends]
        ops += [dist.P2POp(dist.irecv, m.tensor, m.peer, tag=m.tag) for m in recvs]
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        for message, work in zip(sends + recvs, works):
            message.work = work

    def wait(self, message: Message) -> None:
        if message.work is None:
            return
        try:
            message.work.wait(self.timeout)
        except Exception as e:  # gloo raises RuntimeError on timeout or a dead peer
            raise CommError(f"rank {self.rank}: {message.label} with rank {message.peer} failed "
                            f"after at most {self.timeout.total_seconds():.0f}s: {e}") from None
        message.work = None

    @staticmethod
    def done(message: Message) -> bool:
        return message.work is None or message.work.is_completed()
