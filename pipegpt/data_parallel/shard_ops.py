"""The two collectives ZeRO needs, per backend: a reduce-scatter (each rank gets the sum of its chunk) and an
all-gather (each rank's chunk to every rank), one call per bucket, on flat tensors.

NCCL has both, and gloo has had them since torch 2.x (torch 2.13's tensor-parallel code uses them on gloo):
torch's own single-tensor calls. For a backend without them, the same results from what every backend has:
an all-reduce of the whole bucket, of which the rank keeps its chunk (the traffic of an all-reduce, twice a
reduce-scatter's), and an all-gather into the chunks' views. choose_shard_ops picks one; both are tested on
gloo (tests/unit/test_data_parallel_layout.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from pipegpt.tensor_parallel.collectives import _all_gather_single, _reduce_scatter_single

NATIVE_BACKENDS = frozenset({"nccl", "gloo"})


class _Done:
    """A Work whose completion runs `then` once (the all-reduce form's copy of the rank's chunk)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self, timeout=None):
        result = self.work.wait(timeout) if timeout is not None else self.work.wait()
        if self.then is not None:
            self.then()
            self.then = None
        return result


class ShardOps(NamedTuple):
    name: str
    reduce_scatter: object  # (chunk_out, bucket_in, group, index) -> Work; sums over the group
    all_gather: object  # (bucket_out, chunk_in, group, index) -> Work


def _native_reduce_scatter(out: torch.Tensor, bucket: torch.Tensor, group, index: int):
    return _reduce_scatter_single(out, bucket, group=group, async_op=True)


def _native_all_gather(bucket: torch.Tensor, chunk: torch.Tensor, group, index: int):
    return _all_gather_single(bucket, chunk, group=group, async_op=True)


def _all_reduce_then_keep(out: torch.Tensor, bucket: torch.Tensor, group, index: int):
    n = out.numel()
    work = dist.all_reduce(bucket, group=group, async_op=True)  # in place: the bucket is this rank's to spend
    return _Done(work, lambda: out.copy_(bucket[index * n:(index + 1) * n]))


def _all_gather_into_views(bucket: torch.Tensor, chunk: torch.Tensor, group, index: int):
    views = list(bucket.chunk(dist.get_world_size(group)))
    if chunk.data_ptr() == views[index].data_ptr():  # in place: gather from a copy, not from what is written
        chunk = chunk.clone()
    return dist.all_gather(views, chunk, group=group, async_op=True)


class _Finished:
    """The Work of a collective over a group of one: done when made."""

    def wait(self, timeout=None):
        return True


def _keep_all(out: torch.Tensor, bucket: torch.Tensor, group, index: int):
    out.copy_(bucket)
    return _Finished()


def _gather_own(bucket: torch.Tensor, chunk: torch.Tensor, group, index: int):
    if chunk.data_ptr() != bucket.data_ptr():
        bucket.copy_(chunk)
    return _Finished()


ONE_RANK = "one rank"  # a group of one, for DataParallel (where None is torch's: the world)


def all_reduce(tensor: torch.Tensor, group):
    """An asynchronous sum over the group (ONE_RANK: nothing to sum): its Work."""
    return _Finished() if group is ONE_RANK else dist.all_reduce(tensor, group=group, async_op=True)


NATIVE = ShardOps("reduce-scatter / all-gather", _native_reduce_scatter, _native_all_gather)
ALL_REDUCE = ShardOps("all-reduce, keep the shard / all-gather into views", _all_reduce_then_keep,
                      _all_gather_into_views)


ALONE = ShardOps("a group of one: the shard is the bucket", _keep_all, _gather_own)


def choose_shard_ops(backend: str, native: frozenset = NATIVE_BACKENDS) -> ShardOps:
    """The ops for a process group's backend ("gloo", "nccl", ...; ONE_RANK: a group of one)."""
    if backend is ONE_RANK:
        return ALONE
    return NATIVE if str(backend) in native else ALL_REDUCE
