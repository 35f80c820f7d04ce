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
    gradients   over dp x cp   average every parameter (a cp rank holds the whole stage, like a replica); with
                               ep, every dense one
    experts     over edp       with ep: sum each expert's gradient over its replicas and divide by dp x cp. Each
                               expert's rank already holds the sum over its ep group's tokens (the combine's
                               backward brings every source's gradient), so the edp sum completes the sum over all
                               dp x cp ranks' tokens, and dp x cp is one process's divisor (ZeRO shards each
                               family over its own group: pipegpt.data_parallel.families; under sequence
                               parallelism ep is carved out of dp x cp x tp, so edp spans tp too and its sum also
                               adds the tp ranks' sequence chunks: the divisor stays dp x cp)
    partial     over tp        sum the replicated parameters' gradients under sequence parallelism (each rank
                               saw only its part of the sequence): a MoE layer's router, shared experts and, without
                               ep, its experts (whole on every tp rank, fed its chunk); not the experts with ep,
                               which edp sums. Without sequence parallelism every tp rank computes the MoE layer on
                               the same tokens: equal gradients, summed nowhere. Also, whatever the sequence
                               split, the q/k norms' gains, whole on every tp rank and applied to its heads only:
                               qk_norm head's [head_dim] one (Qwen3) serves every head, qk_norm projection's
                               (OLMoE) is applied by columns, so each rank's gradient is its heads' part (a shared
                               kv head's k gets from each of its ranks that rank's q heads' part, so the sum over
                               tp counts each once)
    shared kv   over tp        sum a key/value head's gradients over the tp/n_kv_head ranks sharing it
Ownership: a tp-replicated parameter is counted in the gradient norm and stored by tp rank 0; a shared kv head by
the first rank of its group. With ep, replica 0 of dp x cp counts and stores the dense parameters, edp index 0 the
experts (as the slice [ep_i E/ep, (ep_i + 1) E/ep) of each one-process [E, ...] tensor), and the norm sums over
every rank; with ep carved over tp (sequence parallelism) every tp rank holds experts of its own, so owns them.
The MoE layers' loads (the router bias update) are summed over LOAD_GROUPS: the ranks that saw other tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipegpt.dims import GROUP_AXES, REPLICAS, Sharding, expert_axes
from pipegpt.tensor_parallel.layout import KV_DIM0, REPLICATED, kv_replicas, qk_norm_param, tp_shard_spec

EXPERT_PARAMS = ("experts_gate", "experts_up", "experts_fc", "experts_proj")  # pipegpt.model.moe's stacked experts
ORDER = ("tp", "ep", "cp", "recompute", "compile", "dp")  # how a stage is parallelized, first to last
GRADIENT_AXES = GROUP_AXES[REPLICAS]  # the ranks of a stage that average its gradients: comm.mesh's REPLICAS group


def expert_param(name: str) -> bool:
    """The parameter (by one-process name) is a MoE layer's stacked experts (cut over ep along dim 0)."""
    return name.rsplit(".", 1)[-1] in EXPERT_PARAMS


@dataclass(frozen=True)
class Reduction:
    """One sum a stage's gradients need once a step's backward is done: over which group, of which parameters
    (a rule over one-process names: "all", "replicated", "qk-norms" or "shared-kv"), and whether it averages."""

    name: str
    group: str  # a pipegpt.comm.mesh group name
    params: str  # "all", "dense" (all but the experts), "experts", "replicated", "qk-norms" or "shared-kv"
    average: bool = False
    divisor: int | None = None  # averaging: over this many ranks (None: the group's size)


@dataclass(frozen=True)
class StageParallelism:
    """One layout's parallelisms as every stage of it gets them (the sizes, not a rank's place)."""

    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    cp_comm: str = "ring"
    dp: int = 1
    ep: int = 1
    kv_heads: int = 1
    qk_norms: bool = False  # the model has q/k norms (qk_norm): under tp their gains' gradients are partial
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
        if self.ep > 1:
            out.append(Reduction("gradients", REPLICAS, "dense", average=True))
            out.append(Reduction("experts", "edp", "experts", average=True, divisor=self.gradient_ranks))
        elif self.gradient_ranks > 1:
            out.append(Reduction("gradients", REPLICAS, "all", average=True))
        if self.splits_sequence:  # the head norms' gains among the replicated parameters
            out.append(Reduction("partial", "tp", "replicated"))
        elif self.sums_qk_norms:
            out.append(Reduction("partial", "tp", "qk-norms"))
        if self.shares_kv:
            out.append(Reduction("shared kv", "tp", "shared-kv"))
        return tuple(out)

    @property
    def sums_qk_norms(self) -> bool:
        """tp > 1 splits the heads that the q/k norms' gains serve: their gradients are summed over tp."""
        return self.tp > 1 and self.qk_norms

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (edp): dp x cp / ep."""
        return self.gradient_ranks // self.ep

    def expert(self, name: str) -> bool:
        return expert_param(name)

    @property
    def experts_over_tp(self) -> bool:
        """ep is carved out of dp x cp x tp (pipegpt.dims.expert_axes): each tp rank holds experts of its own."""
        return self.ep > 1 and "tp" in expert_axes(self.ep, tensor_parallel=not self.splits_sequence).over

    @property
    def load_groups(self) -> tuple[str, ...]:
        """The groups over which a MoE layer's loads are summed for the bias update: the ranks that routed other
        tokens (dp x cp, and tp under sequence parallelism; not tp without it, whose ranks route the same)."""
        return (REPLICAS, "tp") if self.splits_sequence else (REPLICAS,)

    def expert_slice(self, name: str, n_experts: int, ep_rank: int) -> slice | None:
        """The rows of the one-process tensor `name` that ep rank ep_rank holds (None: all of it)."""
        if self.ep == 1 or not self.expert(name):
            return None
        per = n_experts // self.ep
        return slice(ep_rank * per, (ep_rank + 1) * per)

    def stored_by(self, name: str, replica_index: int, edp_index: int) -> bool:
        """This rank (at replica_index of dp x cp and edp_index of edp) stores and counts the parameter's value,
        as far as data and expert parallelism go: replica 0 a dense one, edp index 0 an expert's slice."""
        return (edp_index if self.ep > 1 and self.expert(name) else replica_index) == 0

    def checkpoint_shard(self, name: str, tp_rank: int, ep_rank: int) -> list[int]:
        """[rank, ranks] of the part of `name` this rank writes in a checkpoint: an expert's slice over ep, else
        its tp shard ([0, 1]: whole, a tp-replicated tensor)."""
        if self.ep > 1 and self.expert(name):
            return [ep_rank, self.ep]
        return [0, 1] if self.tp == 1 or tp_shard_spec(name) == REPLICATED else [tp_rank, self.tp]

    def partial(self, name: str) -> bool:
        """The parameter's gradient is partial on each tp rank (sequence parallelism's replicated ones; the per-head
        q/k norms' gains whenever tp > 1)."""
        if self.sums_qk_norms and qk_norm_param(name):
            return True
        return (self.splits_sequence and tp_shard_spec(name) == REPLICATED
                and not (self.experts_over_tp and self.expert(name)))

    def shared_kv(self, name: str) -> bool:
        """The parameter is a kv head's shared by several tp ranks (its gradient summed over them)."""
        return self.shares_kv and tp_shard_spec(name) == KV_DIM0

    def owned(self, name: str, tp_rank: int) -> bool:
        """This tp rank stores the parameter's value in a checkpoint (a replicated one: tp rank 0)."""
        return (self.tp == 1 or tp_rank == 0 or tp_shard_spec(name) != REPLICATED
                or (self.experts_over_tp and self.expert(name)))

    def counted(self, name: str, tp_rank: int) -> bool:
        """This tp rank counts the parameter in the gradient norm (a shared kv head: its group's first rank)."""
        if not self.owned(name, tp_rank):
            return False
        return not self.shared_kv(name) or tp_rank % kv_replicas(self.kv_heads, self.tp) == 0


def stage_parallelism(sharding: Sharding, kv_heads: int = 1, recompute: str = "none", cp_comm: str = "ring",
                      compile: bool = False, qk_norm: str = "none") -> StageParallelism:
    """A layout's description (sharding: its axes and sequence parallelism; kv_heads and qk_norm: the model's)."""
    ep = next((c.size for c in sharding.carved if c.name == "ep"), 1)
    return StageParallelism(tp=sharding.tp, sequence_parallel=bool(sharding.sequence_parallel), cp=sharding.cp,
                            cp_comm=cp_comm, dp=sharding.dp, ep=ep, kv_heads=kv_heads, qk_norms=qk_norm != "none",
                            recompute=recompute, compile=compile)
