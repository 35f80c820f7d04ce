"""Batched non-blocking point-to-point between pipeline ranks, device-neutral, always bounded in time.

A batch (pipegpt.schedule.messages.comm_batches: a run of comm actions in the
plan, whose sends after its last receive go apart under order matching) is
posted at once; a receive is waited for at the compute that reads it
(messages.receive_waits), sends where the schedule says their receiver has them
(pipegpt.schedule.messages.release_points) or at the end of the step, so a
send never stalls its rank.

Two behaviours, chosen apart from the device (`matching`):
- "tag" (gloo): messages are matched by tag, so a send may be posted as soon as
  its tensor exists; every wait blocks the host, with the timeout.
- "order" (NCCL): messages are matched by order per pair of ranks, so sends keep
  the plan's places. `wait()` only orders the compute stream after the
  communication (the host runs on), and `settle()` at the end of the step
  blocks the host with the timeout, so a receive that never comes still ends
  in a CommError naming it. On CPU (the CUDA control path run there) `wait()`
  blocks the host instead, standing in for the stream wait.

Matched by order, a batch goes out per lane, a peer and a direction, each on
the process group of that direction of that pair of ranks alone where
comm/mesh.py made them (pair_groups: on CUDA, or runtime.p2p_groups "pairs").
NCCL runs a communicator's operations one after another on its stream, so on
one communicator for the whole pipeline a message queued behind every message
posted before it, to any neighbour, either way (schedule.simulate.simulate_order
models the lanes).

Backends differ in what a batch returns: gloo gives one Work per operation,
NCCL (which coalesces a batch into one group call) gives one Work for the
whole batch. So every message keeps the Works of its batch, and waiting for
a message waits for all of them: no receive can look complete early.

What is kept for settle() is the Works, never the tensors: a message's
tensor goes when the runtime drops the message. On CUDA the process group
keeps its own reference until the stream has waited (record_stream or its
stash), so the allocator cannot reuse the memory early; gloo's Work holds
its tensor until waited, and a host wait lets go of the Work.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

MATCHING = ("auto", "tag", "order")


class CommError(RuntimeError):
    pass


class Message:
    """One tensor on its way to or from a peer rank."""

    __slots__ = ("tensor", "peer", "tag", "label", "works")

    def __init__(self, tensor: torch.Tensor, peer: int, tag: int, label: str):
        self.tensor, self.peer, self.tag, self.label = tensor, peer, tag, label
        # Of the message's batch; emptied (in place: settle() may share the list) once the host waited.
        self.works: list = []


def attach_works(messages: list[Message], works: list) -> None:
    """Give each message the Works it must wait for: its own where the backend returned one per
    operation, else (a coalesced batch) all of the batch's."""
    if len(works) == len(messages):
        for message, work in zip(messages, works):
            message.works = [work]
    else:
        for message in messages:
            message.works = list(works)


def resolve_matching(matching: str, device_type: str) -> str:
    """"tag" or "order" for a device: auto is order on CUDA (NCCL), tag elsewhere (gloo)."""
    if matching not in MATCHING:
        raise ValueError(f"p2p matching {matching!r} is not one of {', '.join(MATCHING)}")
    if matching == "auto":
        return "order" if device_type == "cuda" else "tag"
    if matching == "tag" and device_type == "cuda":
        raise ValueError("p2p matching 'tag' needs gloo: NCCL matches point-to-point messages by order")
    return matching


class PointToPoint:
    def __init__(self, rank: int, timeout_s: float, device_type: str = "cpu", matching: str = "auto",
                 pairs: dict | None = None):
        """pairs: a pipeline neighbour's rank -> (the process group of messages to it, of messages from it)
        (comm/mesh.py pair_groups), where messages matched by order go; a peer without them: the default group."""
        self.rank = rank
        self.pairs = pairs or {}
        self.timeout = timedelta(seconds=timeout_s)
        self.matching = resolve_matching(matching, device_type)
        self.matches_by_tag = self.matching == "tag"
        # Only a CUDA stream can wait for the host: elsewhere the host itself waits before a buffer is read.
        self.host_waits = device_type != "cuda"
        # "order": what was posted since the last settle(), as (works, peer, label): Works, not tensors.
        self.unsettled: list[tuple[list, int, str]] = []
        self.world, self.world_known = None, False  # the default process group, where it is gloo's

    def post(self, sends: list[Message], recvs: list[Message]) -> None:
        if not self.world_known and dist.is_initialized():  # decided once, with the default group there
            self.world_known = True
            self.world = dist.group.WORLD if dist.get_backend() == "gloo" else None
        if self.pairs and not self.matches_by_tag:  # a batch per lane (peer, direction), on the lane's group
            for peer in dict.fromkeys(m.peer for m in sends + recvs):
                to_peer = [m for m in sends if m.peer == peer]
                from_peer = [m for m in recvs if m.peer == peer]
                if peer in self.pairs:
                    self._post(to_peer, [], self.pairs[peer][0])
                    self._post([], from_peer, self.pairs[peer][1])
                else:  # one batch on the default group, as without pairs
                    self._post(to_peer, from_peer, None)
        else:
            self._post(sends, recvs, None)
        if not self.matches_by_tag:
            self.unsettled += [(m.works, m.peer, m.label) for m in sends + recvs]

    def _post(self, sends: list[Message], recvs: list[Message], group) -> None:
        """One batch on `group` (None: the default group)."""
        if self.world is not None:
            # gloo coalesces nothing (a Work per operation), so each goes straight to the process group:
            # what dist.isend / irecv would call, without their checks and wrappers, per message. A pair's
            # group holds the two ranks sorted.
            pg = self.world if group is None else group
            for m in sends:
                m.works = [pg.send([m.tensor], self._group_rank(m.peer, group), m.tag)]
            for m in recvs:
                m.works = [pg.recv([m.tensor], self._group_rank(m.peer, group), m.tag)]
            return
        ops = [dist.P2POp(dist.isend, m.tensor, m.peer, group=group, tag=m.tag) for m in sends]
        ops += [dist.P2POp(dist.irecv, m.tensor, m.peer, group=group, tag=m.tag) for m in recvs]
        if ops:
            attach_works(sends + recvs, dist.batch_isend_irecv(ops))

    def _group_rank(self, peer: int, group) -> int:
        return peer if group is None else int(peer > self.rank)

    def wait(self, message: Message) -> None:
        """What follows may use the message's tensor, or drop it (the stream waits on CUDA, the host elsewhere)."""
        if self.host_waits:
            self._wait_host(message.works, message.peer, message.label)
            return
        for work in message.works:
            work.wait()  # NCCL: the current stream waits for the batch; the host does not

    def settle(self) -> None:
        """Block the host until everything posted has completed, within the timeout (end of step)."""
        for works, peer, label in self.unsettled:
            self._wait_host(works, peer, label)
        self.unsettled.clear()

    def unsettled_peers(self) -> tuple[int, ...]:
        """The ranks settle() would still wait for."""
        return tuple(sorted({peer for works, peer, _ in self.unsettled if works}))

    def _wait_host(self, works: list, peer: int, label: str) -> None:
        try:
            for work in works:
                work.wait(self.timeout)
        except Exception as e:  # gloo and NCCL raise on timeout or a dead peer
            raise CommError(f"rank {self.rank}: {label} with rank {peer} failed "
                            f"after at most {self.timeout.total_seconds():.0f}s: {e}") from None
        works.clear()  # a gloo Work must not be waited twice, and it holds its tensor

    @staticmethod
    def done(message: Message) -> bool:
        return all(work.is_completed() for work in message.works)
