"""Sequence parallelism's replicated gradients are summed over tp in buckets: one all-reduce per bucket, not one
per tensor (pipegpt.buckets.buckets.sum_in_buckets; the oracle checks the sums in a real run)."""
from __future__ import annotations

import torch

from pipegpt.data_parallel import buckets


def test_one_all_reduce_per_bucket(monkeypatch):
    calls = []

    def all_reduce(flat, group=None):  # two ranks holding the same values
        calls.append(flat.numel())
        flat.mul_(2)

    monkeypatch.setattr(buckets.dist, "all_reduce", all_reduce)
    grads = [torch.full((n,), float(n)) for n in (3, 5, 7, 2)]
    want = [2 * g for g in grads]
    buckets.sum_in_buckets(grads, group="tp")
    assert calls == [17] and all(torch.equal(g, w) for g, w in zip(grads, want))
    calls.clear()
    buckets.sum_in_buckets(grads, group="tp", bucket_bytes=4 * 8)  # a bucket closes at >= 8 values
    assert calls == [8, 9] and all(torch.equal(g, 2 * w) for g, w in zip(grads, want))
