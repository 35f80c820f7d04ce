"""Data parallelism on one rank: its stages' flat buffers, the gradient reductions the plan launches (REDUCE_GRAD),
and ZeRO's shards over the data-parallel group (dp x cp: context-parallel ranks hold the same weights).

    zero 0  each REDUCE_GRAD all-reduces the stage's gradient buckets (averaged: divided first), in place
    zero 1  it reduce-scatters them: the rank gets the average of its shard; the optimizer steps its pieces
            of the parameters, and the updated shards are all-gathered back into every replica's parameters
            (the traffic of one all-reduce; ZeroRedundancyOptimizer all-reduced, then broadcast)
    zero 2  as 1, and the full gradient buffer is freed once reduced: between steps only the shard lives
    zero 3  as 2, and the parameters too: a stage's full parameters exist only between the plan's UNSHARD
            (all-gather) and RESHARD (free); the optimizer updates the shard in place

Reductions run asynchronously where the plan puts them and are waited for in finish(), before clipping; at
zero >= 2 a stage's reduce-scatter is waited for at the rank's next REDUCE_GRAD instead, and its full gradient
buffer freed there (allocated at the stage's first backward: ready()), so with one microbatch a rank holds
two stages' full gradients at most. A gather (UNSHARD) runs asynchronously too: ready(), which the runtime
calls before the stage's compute, waits for it, so a gather the plan posts ahead (a prefetch) overlaps the
compute between. Every member of the group runs the same plan, so they launch the same collectives in the
same order.

At zero >= 2 a tensor two of the rank's stages compute with (the tied embedding when both ends are stages of
this rank: FSDP per block, a V) gets flat buffers of its own, reduced with the stage it was under: the other
stage's run then gathers (zero 3) and allocates gradients for that tensor alone, not for the whole of its
owner's stage (which held three stages' parameters gathered at the head's run, and the embedding's stage's full
gradients from the head's backward on).
"""
from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from pipegpt.comm.p2p import CommError
from pipegpt.data_parallel.buffers import StageBuffers
from pipegpt.data_parallel.shard_ops import ONE_RANK, all_reduce, choose_shard_ops


def merged_held(parts) -> dict[str, list[torch.Tensor]]:
    """Several {kind: tensors} as one."""
    out: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for kind, tensors in part.items():
            out.setdefault(kind, []).extend(tensors)
    return out


SHARED = "shared"  # the key of a stage's unit of tensors another of the rank's stages computes with: (stage, SHARED)


def shared_tensors(params_of_stage: dict[int, list[torch.Tensor]]) -> set[int]:
    """ids of the tensors more than one stage computes with."""
    seen: set[int] = set()
    shared: set[int] = set()
    for ps in params_of_stage.values():
        ids = {id(p) for p in ps}
        shared |= seen & ids
        seen |= ids
    return shared


class HeldPiece(NamedTuple):
    value: torch.Tensor  # 1-D: the parameter's elements [start, stop), flattened
    param: torch.Tensor
    start: int
    stop: int
    shape: torch.Size  # the parameter's (on this rank: its tp shard's), even while resharded


class DataParallel:
    def __init__(self, params_by_stage: dict[int, list[torch.Tensor]], params_of_stage: dict[int, list[torch.Tensor]],
                 group, index: int, zero: int, rank: int, timeout_s: float, alone: frozenset = frozenset(),
                 ops=None, divisor: int | None = None):
        """params_by_stage: each parameter under the stage whose REDUCE_GRAD carries it; params_of_stage: every
        parameter each stage computes with (a tensor two stages share is in both); alone: ids of tensors that
        get a bucket of their own (the tied embedding's copies: their shards then line up across ranks);
        group ONE_RANK: a group of one (experts no other rank holds); divisor: what the sum is divided by (default
        the group's size: an average; experts over ep: dp x cp)."""
        self.group, self.index, self.zero, self.rank = group, index, zero, rank
        self.timeout = timedelta(seconds=timeout_s)
        one = group is ONE_RANK
        self.size = 1 if one else dist.get_world_size(group)
        self.divisor = divisor or self.size
        self.ops = ops or choose_shard_ops(ONE_RANK if one else dist.get_backend(group))
        # Each unit of buffers by key: a stage's (key: the stage), or at zero >= 2 the tensors it shares with
        # another of the rank's stages (key: (stage, SHARED)); the stage's REDUCE_GRAD reduces both.
        self.buffers: dict = {}
        shared = shared_tensors(params_of_stage) if zero >= 2 else set()
        for s, ps in params_by_stage.items():
            for key, part in ((s, [p for p in ps if id(p) not in shared]),
                              ((s, SHARED), [p for p in ps if id(p) in shared])):
                if part:
                    self.buffers[key] = StageBuffers(s, part, zero, self.size, index, alone)
        self.reduced_with: dict[int, list] = {}  # stage -> the keys of the units its REDUCE_GRAD reduces
        for key, buf in self.buffers.items():
            self.reduced_with.setdefault(buf.stage, []).append(key)
        holder = {id(p): key for key, buf in self.buffers.items() for p in buf.params}
        # The units a stage's compute reads: gathered while any of its stages is unsharded (ZeRO-3).
        self.users = {s: list(dict.fromkeys(holder[id(p)] for p in ps if id(p) in holder))
                      for s, ps in params_of_stage.items()}
        self.unsharded: dict = {key: set() for key in self.buffers}  # unit -> stages holding it
        self.pending: list = []  # zero 0/1: the step's reductions, waited for in finish()
        self.reducing: dict = {}  # zero >= 2: unit -> its reduce-scatters in flight
        self.gathering: dict = {}  # zero 3: unit -> its all-gathers in flight, until ready()
        self.reduced: set[int] = set()

    # the plan's collectives

    def reduce_grad(self, stage: int) -> None:
        """Launch the reduction of the stage's gradient buckets (its last backward on this rank has run)."""
        self.reduced.add(stage)
        keys = self.reduced_with.get(stage, ())
        if keys and self.zero >= 2:
            self._settle_reductions()  # the earlier stages' full gradients go before this one's reduction runs
        for key in keys:
            self._reduce(key, self.buffers[key])

    def _reduce(self, key, buf: StageBuffers) -> None:
        stage = buf.stage
        if self.zero >= 2 and buf.grad_flat is None:
            raise ValueError(f"rank {self.rank}: {stage}REDUCE_GRAD with no gradient buffer: the runtime "
                             f"called no ready({stage}) before the stage's backward")
        works = []
        for k, b in enumerate(buf.layout.buckets):
            if self.zero:
                bucket = buf.bucket_view(buf.grad_flat, b).div_(self.divisor)
                out = buf.chunk(buf.grad_flat, b) if buf.grad_shard is None else buf.shard_chunk(buf.grad_shard, k)
                work = self.ops.reduce_scatter(out, bucket, self.group, self.index)  # zero 1: in place
            else:
                bucket = buf.bucket_view(buf.grad_flat, b, padded=False).div_(self.divisor)
                work = all_reduce(bucket, self.group)
            works.append(work)
        if self.zero >= 2:
            self.reducing[key] = works
        else:
            self.pending += works

    def _settle_reductions(self) -> None:
        """Zero >= 2: wait for the reduce-scatters in flight and free those units' full gradient buffers."""
        for key, works in self.reducing.items():
            buf = self.buffers[key]
            self._wait(works, f"gradient reduce-scatter of stage {buf.stage}")
            buf.free_grads()
        self.reducing.clear()

    def unshard(self, stage: int) -> None:
        """Launch the gather of the parameters the stage computes with (ZeRO-3); ready() waits for it."""
        for key in self.users.get(stage, ()):
            holders = self.unsharded[key]
            if not holders and self.zero >= 3:
                self.gathering[key] = self._gather(self.buffers[key])
            holders.add(stage)

    def ready(self, stage: int, backward: bool = False) -> None:
        """The stage computes next (the runtime calls this before its first compute after an UNSHARD, and before
        its first backward of a step): wait for the gathers of what it reads; before a backward, zero >= 2
        allocate the full gradient buffers it adds into. Nothing pending, nothing to allocate: a dict lookup."""
        if self.gathering:
            for key in self.users.get(stage, ()):
                works = self.gathering.pop(key, None)
                if works:
                    self._wait(works, f"parameter all-gather of stage {self.buffers[key].stage}")
        if backward and self.zero >= 2:
            for key in self.users.get(stage, ()):
                self.buffers[key].need_grads()

    def reshard(self, stage: int) -> None:
        for key in self.users.get(stage, ()):
            holders = self.unsharded[key]
            holders.discard(stage)
            if not holders and self.zero >= 3:
                works = self.gathering.pop(key, None)
                if works:  # gathered and freed with no compute between: the gather must not write a freed buffer
                    self._wait(works, f"parameter all-gather of stage {self.buffers[key].stage}")
                self.buffers[key].reshard()

    def _gather(self, buf: StageBuffers, full: torch.Tensor | None = None) -> list:
        """Launch the all-gather of every bucket's shard into a full buffer (a new one unless given)."""
        shard = buf.param_shard
        if full is None:
            full = buf.new_full()
            buf.unsharded(full)
        works = []
        for k, b in enumerate(buf.layout.buckets):
            chunk = buf.shard_chunk(shard, k) if shard is not None else buf.chunk(full, b)
            works.append(self.ops.all_gather(buf.bucket_view(full, b), chunk, self.group, self.index))
        return works

    # the step

    def zero_grad(self) -> None:
        for buf in self.buffers.values():
            buf.zero_grad()

    def finish(self) -> None:
        """Wait for the step's reductions; refuse a plan that reduced some stage's gradients nowhere."""
        missing = sorted(s for s in self.reduced_with if s not in self.reduced)
        self.reduced.clear()
        if missing:
            raise ValueError(f"rank {self.rank}: the plan has no {missing[0]}REDUCE_GRAD, so stage {missing[0]}'s "
                             f"gradients were not averaged over the data-parallel replicas")
        self._wait(self.pending, "data-parallel gradient reduction")
        self.pending = []
        self._settle_reductions()
        for buf in self.buffers.values():
            buf.free_grads()

    def after_update(self) -> None:
        """ZeRO-1/2: every replica's parameters from the updated shards (ZeRO-3 gathers at the next UNSHARD)."""
        if self.zero in (1, 2):
            works = [w for buf in self.buffers.values() for w in self._gather(buf, buf.param_flat)]
            self._wait(works, "parameter all-gather")

    def _wait(self, works: list, what: str) -> None:
        for work in works:
            try:
                work.wait(self.timeout)
            except Exception as e:
                raise CommError(f"rank {self.rank}: {what} failed: {e}") from None

    # what the optimizer, the norm and the checkpoints see

    def pieces(self) -> list[HeldPiece]:
        """ZeRO: each part of a parameter in this rank's shard; its value is a 1-D tensor of the shard's
        parameter values, with the averaged gradient as .grad once a step's reductions are done."""
        out = []
        for buf in self.buffers.values():
            for pc, value, grad in zip(buf.pieces, buf.param_pieces, buf.grad_pieces):
                value.grad = grad
                out.append(HeldPiece(value, buf.params[pc.param], pc.start, pc.stop, buf.shapes[pc.param]))
        return out

    def gather_pieces(self, values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{id(piece value): a tensor of its size} from every rank -> {id(parameter): the whole tensor}
        (a collective: every rank of the group calls it; padding gathers as zeros)."""
        out = {}
        for buf in self.buffers.values():
            shard = torch.zeros(buf.layout.shard_numel, dtype=buf.dtype, device=buf.device)
            for pc, value in zip(buf.pieces, buf.param_pieces):
                shard[pc.shard_offset:pc.shard_offset + pc.numel] = values[id(value)].reshape(-1)
            full = torch.empty(buf.layout.total, dtype=buf.dtype, device=buf.device)
            works = [self.ops.all_gather(buf.bucket_view(full, b), buf.shard_chunk(shard, k), self.group, self.index)
                     for k, b in enumerate(buf.layout.buckets)]
            self._wait(works, "all-gather")
            out.update({id(p): v for p, v in zip(buf.params, buf._views(full))})
        return out

    @contextmanager
    def whole(self):
        """Every parameter gathered for the duration (ZeRO-3; a collective over the group: every member calls it)."""
        stage = -1  # a holder that is no stage of the plan
        self.users[stage] = list(self.buffers)
        try:
            self.unshard(stage)
            self.ready(stage)
            yield
        finally:
            self.reshard(stage)
            self.users.pop(stage, None)

    def full_grads(self) -> dict[int, torch.Tensor]:
        """ZeRO: every parameter's averaged gradient (id -> tensor), gathered from the shards (for tests)."""
        return self.gather_pieces({id(h.value): h.value.grad for h in self.pieces()})

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every stage's buffers by kind (StageBuffers.held_tensors)."""
        return merged_held(buf.held_tensors() for buf in self.buffers.values())

    def storage_bytes(self) -> dict[str, int]:
        totals = {"parameters": 0, "gradients": 0}
        for buf in self.buffers.values():
            for key, n in buf.storage_bytes().items():
                totals[key] += n
        return totals
