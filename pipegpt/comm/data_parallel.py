"""Data parallelism: average gradients across pipeline replicas, in buckets, overlapped with compute.

A stage's buckets are all-reduced asynchronously where the plan's REDUCE_GRAD
for the stage stands (right after its last backward action of the step: the
runtime calls reduce_grad); finish() waits for all of them before the optimizer.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipegpt.comm.p2p import CommError

BUCKET_BYTES = 25 * 2**20  # as DDP's default: large enough to amortise latency, small enough to overlap


def buckets(params: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    out, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def sum_in_buckets(tensors: list[torch.Tensor], group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum each tensor over the group, in place: one all-reduce per bucket of them, not one per tensor (the
    latency of a collective is paid per call; sequence parallelism's replicated gradients are many small ones)."""
    for bucket in buckets(tensors, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(reduced)


class GradientAverager:
    """The runtime's collectives with data parallelism: a REDUCE_GRAD averages the stage's gradients."""

    def __init__(self, params_by_stage: dict[int, list[torch.Tensor]], group, rank: int, timeout_s: float):
        self.group, self.rank, self.timeout = group, rank, timedelta(seconds=timeout_s)
        self.size = dist.get_world_size(group)
        self.buckets = {s: buckets(ps) for s, ps in params_by_stage.items()}
        self.pending: list = []
        self.reduced: set[int] = set()  # stages whose reduction this step launched

    def reduce_grad(self, stage: int) -> None:
        self.reduced.add(stage)
        for bucket in self.buckets.get(stage, []):
            grads = [p.grad for p in bucket]
            flat = _flatten_dense_tensors(grads).div_(self.size)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.pending.append((work, flat, grads))

    def finish(self) -> None:
        # A plan without a stage's REDUCE_GRAD would leave this replica's gradients unaveraged: refuse.
        missing = sorted(s for s, bs in self.buckets.items() if bs and s not in self.reduced)
        self.reduced.clear()
        if missing:
            raise ValueError(f"rank {self.rank}: the plan has no {missing[0]}REDUCE_GRAD, so stage {missing[0]}'s "
                            f"gradients were not averaged over the data-parallel replicas")
        for work, flat, grads in self.pending:
            try:
                work.wait(self.timeout)
            except Exception as e:
                raise CommError(f"rank {self.rank}: data-parallel gradient all-reduce failed: {e}") from None
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)
        self.pending.clear()
