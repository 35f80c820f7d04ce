"""Which token positions a context-parallel rank holds.

A sequence of T tokens is cut into 2 x cp chunks of T / (2 cp); rank r holds chunk r followed by chunk 2cp-1-r.
Under a causal mask a query attends to the keys before it, so a rank holding only the last chunk would do cp
times the work of the first: pairing an early chunk with its mirror gives every rank the same work
(Megatron-Core's and torchtitan's "load-balanced" sharding).
"""
from __future__ import annotations

import torch


def chunk_indices(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp_size) rank cp_rank holds, in its local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside cp = {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """The global positions [seq_len / cp_size] of rank cp_rank's tokens, in its local order."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len {seq_len} does not cut into 2 x cp = {2 * cp_size} chunks")
    size = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunk_indices(cp_rank, cp_size)])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """Rank cp_rank's part of x along `dim` (the sequence): its two chunks, concatenated."""
    if cp_size == 1:
        return x
    parts = x.chunk(2 * cp_size, dim)
    if len(parts) != 2 * cp_size or x.size(dim) % (2 * cp_size):
        raise ValueError(f"a sequence of {x.size(dim)} does not cut into 2 x cp = {2 * cp_size} equal chunks")
    first, second = chunk_indices(cp_rank, cp_size)
    return torch.cat((parts[first], parts[second]), dim).contiguous()


def join_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard_sequence part, in cp rank order (the inverse)."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for r, shard in enumerate(shards):
        a, b = shard.chunk(2, dim)
        first, second = chunk_indices(r, cp_size)
        chunks[first], chunks[second] = a, b
    return torch.cat(chunks, dim)
