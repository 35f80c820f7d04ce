"""Context parallelism as a setting on a plain GPT slice: shard_for_cp tells every attention layer (and the
embedding's positions) where this rank's tokens sit and how to see the others'. Parameters are untouched: every cp
rank of a stage holds the same weights, and their gradients are averaged with the data-parallel replicas'
(pipegpt.comm.mesh's dp_cp group), so nothing here changes a checkpoint. A mixture-of-experts layer routes this
rank's tokens; its aux loss, a product of means over the call's tokens, sums them over cp (MoE.token_sums).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pipegpt.config import CP_COMM, ConfigError
from pipegpt.context_parallel.attention import context_parallel_attention, set_timeout
from pipegpt.context_parallel.chunks import local_positions
from pipegpt.model.gpt import GPT
from pipegpt.model.moe import moe_layers
from pipegpt.tensor_parallel.collectives import sum_used_by_all


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """One rank's place in its cp group: what the model's attention and position embedding ask of it."""

    rank: int
    size: int
    group: object
    comm: str

    def positions(self, length: int, device) -> torch.Tensor:
        """The global positions of this rank's `length` local tokens (two load-balanced chunks)."""
        return _positions(length * self.size, self.rank, self.size, torch.device(device))

    def attend(self, q, k, v, documents: torch.Tensor | None) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.group, self.rank, self.size, self.comm, documents)


@functools.lru_cache(maxsize=64)
def _positions(seq_len: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    return local_positions(seq_len, rank, size, device)


def shard_for_cp(module: GPT, cp_rank: int, cp_size: int, group, comm: str = "ring",
                 timeout_s: float | None = None) -> GPT:
    """Make `module` one rank of a cp group of cp_size (in place; its inputs then hold this rank's chunks of every
    sequence, pipegpt.context_parallel.chunks). Returns `module`; cp_size 1 leaves it as it is.
    timeout_s: how long attention waits for a peer's K/V (the run's communication timeout)."""
    if comm not in CP_COMM:
        raise ConfigError(f"cp_comm={comm!r} is not valid: use one of {', '.join(CP_COMM)}")
    if not 0 <= cp_rank < cp_size:
        raise ConfigError(f"cp_rank={cp_rank} must be in [0, {cp_size})")
    if cp_size == 1:
        return module
    if timeout_s is not None:
        set_timeout(timeout_s)
    layout = ContextParallel(cp_rank, cp_size, group, comm)
    module.context_parallel = layout
    for block in module.blocks.values():
        block.attn.context_parallel = layout
    for layer in moe_layers(module):
        # each cp rank routes its own tokens of the call: the aux loss sums over cp, and every cp rank's gradient
        # of it (averaged over dp x cp as the parameters' are) flows to every rank's scores
        layer.token_sums.append(functools.partial(sum_used_by_all, group=group))
    return module
