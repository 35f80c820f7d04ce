"""A rank's random streams (dropout): how they are seeded and how a checkpoint keeps them.

Seeded as Megatron seeds its default generator: one stream per (pipeline rank, data-parallel replica), the same on
every tensor-parallel rank of them, so dropout in the replicated regions (embedding, residual branches after the
row-parallel all-reduce) draws one mask on all of them, as it must for the replicas to stay equal. Replicas and
pipeline stages draw different masks. Dropout in sharded regions (attention heads under tp; the sequence chunks
under sequence parallelism) draws from the same stream, so its masks repeat across tp ranks: correct in
expectation, not independent (Megatron forks a per-tp-rank stream there; that would also need recomputation to
restore it).

A checkpoint keeps each rank's CPU state ("rng/<rank>") and, on a GPU, its device generator's state
("cuda_rng/<rank>"); a resume under the same world size restores both, so it continues the same streams.
"""
from __future__ import annotations

import zlib

import torch


def rank_seed(seed: int, pp_index: int, dp_index: int) -> int:
    """The seed of the stream of pipeline rank pp_index in replica dp_index (not of the tp rank)."""
    return (seed * 1_000_003 + zlib.crc32(f"dropout/pp{pp_index}/dp{dp_index}".encode())) % 2**63


def seed_rank(seed: int, pp_index: int, dp_index: int, device: torch.device, cuda=torch.cuda) -> None:
    """Seed this process's CPU generator and, on a GPU, its device's generator."""
    s = rank_seed(seed, pp_index, dp_index)
    torch.random.default_generator.manual_seed(s)  # the CPU one only: torch.manual_seed would seed every GPU
    if device.type == "cuda":
        cuda.manual_seed(s)  # the current device, the worker's


def rng_state(rank: int, device: torch.device, cuda=torch.cuda) -> dict[str, torch.Tensor]:
    """This rank's generator states, as checkpoint tensors (`cuda` is a parameter so a test can stand one in)."""
    states = {f"rng/{rank}": torch.get_rng_state()}
    if device.type == "cuda":
        states[f"cuda_rng/{rank}"] = cuda.get_rng_state(device)
    return states


def is_rng_key(key: str) -> bool:
    return key.startswith(("rng/", "cuda_rng/"))


def restore_rng(states: dict[str, torch.Tensor], rank: int, device: torch.device, cuda=torch.cuda) -> None:
    """Set this rank's generators from a checkpoint's states (those present: a CPU run's checkpoint resumed on a
    GPU leaves the device generator as seeded)."""
    if f"rng/{rank}" in states:
        torch.set_rng_state(states[f"rng/{rank}"])
    if device.type == "cuda" and f"cuda_rng/{rank}" in states:
        cuda.set_rng_state(states[f"cuda_rng/{rank}"], device)
