"""A tp rank's own dropout stream in a sharded region (pipegpt.tensor_parallel.rng), on one process: derived from the
shared stream, so it differs per tp rank, leaves the shared stream alike on every rank, and replays whenever the
shared stream is restored (recomputation). The one-process oracle with two ranks: tests/distributed/test_tp_dropout.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipegpt.tensor_parallel import rng as tp_rng
from pipegpt.tensor_parallel.rng import ShardedDropout, sharded_region

CPU = torch.device("cpu")


def region_mask(tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mask a sharded region draws on this tp rank, the shared stream's next draw after it)."""
    with sharded_region(tp_rank, CPU):
        mask = F.dropout(torch.ones(256), 0.5)
    return mask, torch.rand(4)


def test_each_tp_rank_draws_its_own_masks_and_the_shared_stream_stays_alike():
    torch.manual_seed(3)
    shared = torch.get_rng_state()
    rank0 = region_mask(0)
    torch.set_rng_state(shared)  # the other tp rank, seeded alike
    rank1 = region_mask(1)
    assert not torch.equal(rank0[0], rank1[0])
    assert torch.equal(rank0[1], rank1[1]), "the shared stream left the region differently on two tp ranks"
    torch.set_rng_state(shared)  # restored (recomputation's preserve_rng_state): the same masks again
    assert all(torch.equal(a, b) for a, b in zip(region_mask(0), rank0))
    torch.set_rng_state(shared)  # and two regions in a row draw different masks
    with sharded_region(0, CPU):
        first = F.dropout(torch.ones(256), 0.5)
    with sharded_region(0, CPU):
        second = F.dropout(torch.ones(256), 0.5)
    assert not torch.equal(first, second)


def test_sharded_dropout_draws_nothing_when_off():
    torch.manual_seed(4)
    drop, x = ShardedDropout(0.5, tp_rank=1), torch.ones(8)
    before = torch.get_rng_state()
    assert drop.eval()(x) is x and ShardedDropout(0.0, 1)(x) is x
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(drop.train()(x), x)


class FakeCudaGenerator:
    """A CUDA generator's seed and Philox offset (torch.cuda's default generator), without a GPU."""

    device = torch.device("cuda", 0)

    def __init__(self, seed: int, offset: int):
        self.seed, self.offset = seed, offset

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        assert offset % 4 == 0, "Philox offsets move in multiples of 4"
        self.offset = offset


def test_on_a_gpu_the_key_is_the_streams_point_reached_with_no_kernel_and_skipped_past():
    g = FakeCudaGenerator(7, 12)
    keys = [tp_rng._key(g), tp_rng._key(g)]
    assert g.offset == 12 + 2 * tp_rng.CUDA_OFFSET_STEP and keys[0] != keys[1]
    assert tp_rng._key(FakeCudaGenerator(7, 12)) == keys[0]  # the same point of the stream: the same key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's own generator")
def test_on_a_gpu_each_tp_rank_draws_its_own_masks_and_recomputation_replays_them():
    gpu = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.manual_seed(3)
    shared = torch.cuda.get_rng_state(gpu)
    masks = []
    for tp_rank in (0, 1, 0):
        torch.cuda.set_rng_state(shared, gpu)
        with sharded_region(tp_rank, gpu):
            masks.append(F.dropout(torch.ones(1024, device=gpu), 0.5))
        masks.append(torch.rand(4, device=gpu))
    assert not torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3])
    assert torch.equal(masks[0], masks[4]) and torch.equal(masks[1], masks[5])
