"""Bucketed sums: one collective per bucket of tensors, not one per tensor (the latency of a collective is paid
per call). The bucket size is also the flat buffers' (buffers.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

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
