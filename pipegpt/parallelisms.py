"""What a model stage's parallelisms do to it, as data (torch-free): the one description that
pipegpt.engine.parallelize applies to a stage's module, that the gradient syncs (pipegpt.train.grad_sync) and the
checkpoint read to know which group reduces which parameters and who owns what, and that the planner's memory and
costs (pipegpt.costs) read for the same facts.

A stage's parallelisms are applied in one order (ORDER), torchtitan's (models/*/infra/parallelize.py): tensor
parallelism first (it replaces the block's linears, which everything after wraps), expert parallelism next
(where it will go: it shards experts the tensor-parallel linears leave whole), context parallelism (a setting on
attention that reads the layers as they are now), recomputation (checkpointing whole blocks, whatever they
became), compilation (of the finished module), and data parallelism last: its buffers cover every stage of a
rank and follow the plan, so the gradient syncs build them from this description (GRADIENT_AXES).

Gradient reductions (Reduction), in the order their sums run (the numerics are those of one fixed sequence):
    gradients   over dp x cp   average every parameter (a cp rank holds the whole stage, like a replica)
    partial     over tp        sum the replicated parameters' gradients under sequence parallelism (each rank
                               saw only its part of the sequence)
    shared kv   over tp        sum a key/value head's gradients over the tp/n_kv_head ranks sharing it
Ownership: a tp-replicated parameter is counted in the gradient norm and stored by tp rank 0; a shared kv head by
the first rank of its group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipegpt.dims import GROUP_AXES, REPLICAS, Sharding
from pipegpt.tensor_parallel.layout import KV_DIM0, REPLICATED, kv_replicas, tp_shard_spec

ORDER = ("tp", "ep", "cp", "recompute", "compile", "dp")  # how a stage is parallelized, first to last
GRADIENT_AXES = GROUP_AXES[REPLICAS]  # the ranks of a stage that average its gradients: comm.mesh's REPLICAS group


@dataclass(frozen=True)
class Reduction:
    """One sum a stage's gradients need once a step's backward is done: over which group, of which parameters
    (a rule over one-process names: "all", "replicated" or "shared-kv"), and whether it averages."""

    name: str
    group: str  # a pipegpt.comm.mesh group name
    params: str
    average: bool = False


@dataclass(frozen=True)
class StageParallelism:
    """One layout's parallelisms as every stage of it gets them (the sizes, not a rank's place)."""

    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_comm: str = "ring"
    dp: int = 1
    kv_heads: int = 1
    recompute: str = "none"
    compile: bool = False

    @property
    def gradient_ranks(self) -> int:
        """Ranks that average a stage's gradients, and over which ZeRO shards its state: dp x cp."""
        return math.prod(getattr(self, axis) for axis in GRADIENT_AXES)

    @property
    def splits_sequence(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    @property
    def shares_kv(self) -> bool:
        """tp > n_kv_head: each kv head is held by tp/n_kv_head ranks, each with a partial gradient."""
        return self.tp > 1 and kv_replicas(self.kv_heads, self.tp) > 1

    @property
    def reductions(self) -> tuple[Reduction, ...]:
        """The gradient sums this layout needs, in the order they run (see the module docstring)."""
        out = []
        if self.gradient_ranks > 1:
            out.append(Reduction("gradients", REPLICAS, "all", average=True))
        if self.splits_sequence:
            out.append(Reduction("partial", "tp", "replicated"))
        if self.shares_kv:
            out.append(Reduction("shared kv", "tp", "shared-kv"))
        return tuple(out)

    def partial(self, name: str) -> bool:
        """The parameter's gradient is partial on each tp rank (sequence parallelism's replicated ones)."""
        return self.splits_sequence and tp_shard_spec(name) == REPLICATED

    def shared_kv(self, name: str) -> bool:
        """The parameter is a kv head's shared by several tp ranks (its gradient summed over them)."""
        return self.shares_kv and tp_shard_spec(name) == KV_DIM0

    def owned(self, name: str, tp_rank: int) -> bool:
        """This tp rank stores the parameter's value in a checkpoint (a replicated one: tp rank 0)."""
        return self.tp == 1 or tp_rank == 0 or tp_shard_spec(name) != REPLICATED

    def counted(self, name: str, tp_rank: int) -> bool:
        """This tp rank counts the parameter in the gradient norm (a shared kv head: its group's first rank)."""
        if not self.owned(name, tp_rank):
            return False
        return not self.shared_kv(name) or tp_rank % kv_replicas(self.kv_heads, self.tp) == 0


def stage_parallelism(sharding: Sharding, kv_heads: int = 1, recompute: str = "none", cp_comm: str = "ring",
                      compile: bool = False) -> StageParallelism:
    """A layout's description (sharding: its axes and sequence parallelism; kv_heads: the model's)."""
    return StageParallelism(tp=sharding.tp, sequence_parallel=bool(sharding.sequence_parallel), cp=sharding.cp,
                            cp_comm=cp_comm, dp=sharding.dp, kv_heads=kv_heads, recompute=recompute, compile=compile)
