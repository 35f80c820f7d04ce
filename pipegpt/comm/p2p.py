"""Batched non-blocking point-to-point between pipeline ranks, device-neutral, always bounded in time.

A batch (one run of comm actions in the plan) is posted at once; receives
are waited for before the next compute, sends only when their buffer is about
to be released or at the end of the step, so a send never stalls its rank.

Backends differ in what a batch returns: gloo gives one Work per operation,
NCCL (which coalesces a batch into one group call) gives one Work for the
whole batch. So every message keeps the Works of its batch, and waiting for
a message waits for all of them: no receive can look complete early.

Waiting differs too. On CPU the host blocks, with the timeout. On CUDA
`wait()` only orders the compute stream after the communication (the host
runs on), and `settle()` at the end of the step blocks the host with the
timeout, so a receive that never comes still ends in a CommError naming it.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class CommError(RuntimeError):
    pass


class Message:
    """One tensor on its way to or from a peer rank."""

    __slots__ = ("tensor", "peer", "tag", "label", "works")

    def __init__(self, tensor: torch.Tensor, peer: int, tag: int, label: str):
        self.tensor, self.peer, self.tag, self.label = tensor, peer, tag, label
        self.works: list = []  # of the message's batch; empty once waited for (or never posted)


def attach_works(messages: list[Message], works: list) -> None:
    """Give each message the Works it must wait for: its own where the backend returned one per
    operation, else (a coalesced batch) all of the batch's."""
    if len(works) == len(messages):
        for message, work in zip(messages, works):
            message.works = [work]
    else:
        for message in messages:
            message.works = list(works)


class PointToPoint:
    def __init__(self, rank: int, timeout_s: float, device_type: str = "cpu"):
        self.rank = rank
        self.timeout = timedelta(seconds=timeout_s)
        self.host_waits = device_type != "cuda"
        # gloo (CPU) matches point-to-point messages by tag, so a send may be posted before the sends the
        # plan puts ahead of it; NCCL (CUDA) matches them by order per pair of ranks.
        self.matches_by_tag = device_type != "cuda"
        self.unsettled: list[Message] = []  # posted since the last settle()

    def post(self, sends: list[Message], recvs: list[Message]) -> None:
        ops = [dist.P2POp(dist.isend, m.tensor, m.peer, tag=m.tag) for m in sends]
        ops += [dist.P2POp(dist.irecv, m.tensor, m.peer, tag=m.tag) for m in recvs]
        if not ops:
            return
        attach_works(sends + recvs, dist.batch_isend_irecv(ops))
        if not self.host_waits:
            self.unsettled += sends + recvs

    def wait(self, message: Message) -> None:
        """What follows may use the message's tensor (the stream waits on CUDA, the host on CPU)."""
        if self.host_waits:
            self._wait_host(message)
            return
        for work in message.works:
            work.wait()  # NCCL: the current stream waits for the batch; the host does not

    def settle(self) -> None:
        """Block the host until everything posted has completed, within the timeout (end of step)."""
        for message in self.unsettled:
            self._wait_host(message)
        self.unsettled.clear()

    def _wait_host(self, message: Message) -> None:
        try:
            for work in message.works:
                work.wait(self.timeout)
        except Exception as e:  # gloo and NCCL raise on timeout or a dead peer
            raise CommError(f"rank {self.rank}: {message.label} with rank {message.peer} failed "
                            f"after at most {self.timeout.total_seconds():.0f}s: {e}") from None
        message.works = []

    @staticmethod
    def done(message: Message) -> bool:
        return all(work.is_completed() for work in message.works)
