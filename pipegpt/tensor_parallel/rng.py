"""Dropout's masks under tensor parallelism (Megatron's get_cuda_rng_tracker idea).

The tp ranks of a stage share one random stream (pipegpt.state.rng), so dropout in a replicated region (the
embedding's output, each residual branch after its row-parallel all-reduce) draws one mask on all of them, as it
must. In a sharded region (the attention probabilities of this rank's heads; under sequence parallelism every
dropout, over this rank's sequence chunk) the shared stream would repeat each rank's mask on the others: there each
tp rank draws from a stream of its own (`sharded_region`).

Megatron keeps that stream as a second generator state per rank, swapped in around the region, and its
checkpointed recomputation saves and restores it too. Here the rank's stream is derived, on entering a region, from
the shared one: a key taken from it (advancing it alike on every tp rank) and the tp rank seed the generator for
the region, and the shared state comes back on leaving it. Nothing else is kept, so what restores the shared stream
(recomputation's preserve_rng_state, a checkpoint's RNG states) restores the sharded masks with it.
"""
from __future__ import annotations

import contextlib
import zlib

import torch
import torch.nn as nn

CUDA_OFFSET_STEP = 4  # Philox's offset advances in multiples of 4 (set_offset refuses others)


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator dropout draws from on this device (the current GPU's where the index is not given)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return torch.random.default_generator


def _key(generator: torch.Generator) -> int:
    """A number taken from the shared stream, which it advances alike on every tp rank: on a GPU the point the
    stream has reached (its seed and offset: no kernel, no synchronisation), skipped past; on the CPU a draw."""
    if generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + CUDA_OFFSET_STEP)
        return generator.initial_seed() * 1_000_003 + offset
    return int(torch.randint(0, 2**62, (1,), generator=generator))


@contextlib.contextmanager
def sharded_region(tp_rank: int, device: torch.device):
    """Inside: dropout on `device` draws this tp rank's own masks; on leaving, the shared stream is where the
    key left it, the same on every tp rank."""
    generator = _default_generator(device)
    key = _key(generator)
    shared = generator.get_state()
    generator.manual_seed((key * 1_000_003 + zlib.crc32(f"tp{tp_rank}".encode())) % 2**63)
    try:
        yield
    finally:
        generator.set_state(shared)


class ShardedDropout(nn.Dropout):
    """Dropout over this tp rank's shard of a tensor (a sequence chunk under sequence parallelism): its own masks."""

    def __init__(self, p: float, tp_rank: int):
        super().__init__(p)
        self.tp_rank = tp_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:  # nothing drawn: the shared stream stays where it is
            return x
        with sharded_region(self.tp_rank, x.device):
            return super().forward(x)
