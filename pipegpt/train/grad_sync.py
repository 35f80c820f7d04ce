"""Gradient synchronisation, one object per parallelism: what it reduces once a step's actions are done, which
of this rank's parameters it keeps out of the gradient norm (another rank counts the same values), and which
it keeps out of this rank's part of a checkpoint (another rank stores them).

The training role asks each sync in turn (make_syncs gives the order, which is the order of the sums, so the
numerics are those of one fixed sequence); a new parallelism adds one class here, not a clause in the worker.
"""
from __future__ import annotations

import torch.distributed as dist

from pipegpt.data_parallel.buckets import sum_in_buckets
from pipegpt.config import TrainConfig
from pipegpt.data_parallel import ONE_RANK, DataParallel, DataParallelFamilies
from pipegpt.engine.engine import Engine
from pipegpt.schedule import Kind, ScheduleError
from pipegpt.tensor_parallel.layers import sum_replicated_kv_grads


class GradSync:
    """A parallelism's part of finishing a step's gradients. The defaults: nothing to reduce, every value counted
    and owned here."""

    def reduce_grad(self, stage: int) -> None:
        """The plan's REDUCE_GRAD for a stage: its gradients on this rank are complete (its last B or W ran)."""

    def unshard(self, stage: int) -> None:
        """The plan's UNSHARD: the stage's parameters are needed from here (ZeRO-3 gathers them)."""

    def reshard(self, stage: int) -> None:
        """The plan's RESHARD: the stage's parameters are not needed until its next UNSHARD."""

    def ready(self, stage: int, backward: bool) -> None:
        """The stage computes next (after an UNSHARD; before its first backward of the step): what it reads is there."""

    def reduce(self) -> None:
        """Complete what this parallelism sums or averages, in place, before clipping."""

    def not_counted(self) -> set[int]:
        """ids of parameters whose values another rank counts in the global norm."""
        return set()

    def not_owned(self) -> set[int]:
        """ids of parameters whose values another rank stores in a checkpoint."""
        return set()


class DataParallelSync(GradSync):
    """Replicas (and cp ranks) average their gradients, each stage's buckets started at the stage's REDUCE_GRAD
    (placed by the plan right after the stage's last backward), so they overlap with the rest of the step; with
    ZeRO each rank keeps its shard (pipegpt.data_parallel). Replica 0 stores the parameters (with ZeRO-3 each
    rank its shard; optimizer state: see the role). With experts over ep, the experts are a family of their own
    over edp (pipegpt.parallelisms' "experts" reduction), beside the dense parameters over dp x cp."""

    def __init__(self, engine: Engine, cfg: TrainConfig, experts: frozenset = frozenset()):
        """experts: ids of the parameters summed over edp (expert parallelism's), not over dp x cp."""
        mesh = engine.mesh
        if cfg.parallel.zero >= 3:  # a stage the plan never gathers would compute on empty parameters
            actions = engine.plan.ranks[mesh.pp_index]
            gathered = {a.stage for a in actions if a.kind is Kind.UNSHARD}
            for s in sorted(engine.stages):
                if s not in gathered:
                    raise ScheduleError(f"rank {engine.rank}: the plan has no {s}UNSHARD, and --zero 3 shards "
                                        f"stage {s}'s parameters")

        def family(keep, group: str, divisor=None) -> DataParallel:
            return DataParallel({s: [p for p in ps if keep(p)] for s, ps in engine.params_by_stage().items()},
                                {s: [p for p in stage.module.parameters() if keep(p)]
                                 for s, stage in engine.stages.items()},
                                mesh.group(group) if len(mesh.members[group]) > 1 else ONE_RANK,
                                mesh.members[group].index(engine.rank), cfg.parallel.zero,
                                engine.rank, cfg.runtime.wait_timeout_s,
                                alone=frozenset(id(p) for p in engine.tied_copies()), divisor=divisor)

        dense = family(lambda p: id(p) not in experts, "dp_cp")
        self.dp = dense if not experts else DataParallelFamilies(
            [dense, family(lambda p: id(p) in experts, "edp", engine.parallelism.gradient_ranks)])

    def reduce_grad(self, stage: int) -> None:
        self.dp.reduce_grad(stage)

    def unshard(self, stage: int) -> None:
        self.dp.unshard(stage)

    def reshard(self, stage: int) -> None:
        self.dp.reshard(stage)

    def ready(self, stage: int, backward: bool) -> None:
        self.dp.ready(stage, backward)

    def reduce(self) -> None:
        self.dp.finish()


class ExpertParallelSync(GradSync):
    """Experts spread over ep ranks: their gradients are DataParallelSync's family over edp (summed, divided by
    dp x cp). The norm sums over every rank (norm_group: the world); without ZeRO replica 0 of dp x cp counts
    and stores the dense values and edp index 0 the experts' slices (with ZeRO each rank its pieces)."""

    norm_group_world = True

    def __init__(self, engine: Engine, zero: int):
        layout, mesh = engine.parallelism, engine.mesh
        named = [(engine.full_names[id(p)], p) for _, p in engine.named_params]
        self.experts = frozenset(id(p) for name, p in named if layout.expert(name))
        replica = mesh.members["dp_cp"].index(engine.rank)
        self.elsewhere = set() if zero else {id(p) for name, p in named
                                             if not layout.stored_by(name, replica, mesh.edp_index)}

    def not_counted(self) -> set[int]:
        return self.elsewhere

    def not_owned(self) -> set[int]:
        return self.elsewhere


class TensorParallelSync(GradSync):
    """Replicated weights saw only this rank's part of the sequence under sequence parallelism: summed over tp.
    A kv head shared by tp/n_kv_head ranks got from each only its q heads' part: summed over them. Replicated
    values are counted and stored by tp rank 0, a shared kv head by the first rank of its group."""

    def __init__(self, engine: Engine, held=list):
        self.group, layout = engine.mesh.group("tp"), engine.parallelism
        self.kv_heads, self.tp, self.tp_index = layout.kv_heads, layout.tp, engine.mesh.tp_index
        stages = engine.parallelized.values()
        # `held`: what holds these parameters' gradients on this rank (under ZeRO the pieces of its shard: tp
        # peers' buffers have one layout, so their pieces line up and the sums act on them as on whole tensors)
        self.partial = held(p for stage in stages for p in stage.partial_params())
        self.shared_kv = held(p for stage in stages for p in stage.shared_kv_params())
        # By one-process name (a tied head's is wte.weight: split the same way): replicated values are stored by
        # tp rank 0, a shared kv head counted by the first rank of its group.
        names = [(id(p), engine.full_names[id(p)]) for _, p in engine.named_params]
        self.replicated = {i for i, name in names if not layout.owned(name, self.tp_index)}
        self.uncounted = self.replicated | {id(p) for stage in stages for name, p in stage.module.named_parameters()
                                            if not layout.counted(name, self.tp_index)}

    def reduce(self) -> None:
        if self.partial:
            sum_in_buckets([p.grad for p in self.partial], self.group)
        if self.shared_kv:
            sum_replicated_kv_grads(self.shared_kv, self.group, self.kv_heads, self.tp_index, self.tp)

    def not_counted(self) -> set[int]:
        return self.uncounted

    def not_owned(self) -> set[int]:
        return self.replicated


class TiedEmbeddingSync(GradSync):
    """The tied embedding's two copies (first and last stage) on different ranks sum their gradients; the rank
    holding stage 0 counts and stores the value."""

    def __init__(self, engine: Engine, held=list):
        self.copies, self.group = engine.tied_copies(), engine.mesh.group("embedding")
        self.first = 0 in engine.stages
        self.holders = held(self.copies)  # under ZeRO each copy's pieces: alone in a bucket, they line up

    def reduce(self) -> None:
        for holder in self.holders:
            dist.all_reduce(holder.grad, group=self.group)

    def not_counted(self) -> set[int]:
        return set() if self.first else {id(p) for p in self.copies}

    def not_owned(self) -> set[int]:
        return self.not_counted()


def make_syncs(engine: Engine, cfg: TrainConfig) -> list[GradSync]:
    """The syncs a built engine needs, in the order their sums run (engine.parallelism.reductions: data-parallel
    averages first, started during the step, then tensor parallelism's partial sums), then the tied embedding's
    copies (a pipeline's, not a stage's: it depends on the placement)."""
    syncs: list[GradSync] = []
    held = list
    layout = engine.parallelism
    experts = ExpertParallelSync(engine, cfg.parallel.zero) if layout.ep > 1 else None
    if layout.gradient_ranks > 1:  # cp ranks average their gradients as replicas do (experts: over edp)
        syncs.append(DataParallelSync(engine, cfg, experts.experts if experts else frozenset()))
        held = gradient_holders(syncs[0].dp)
    if experts is not None:
        syncs.append(experts)
    if layout.tp > 1:  # its sums (layout.reductions' tp ones), and who counts and stores replicated values
        syncs.append(TensorParallelSync(engine, held))
    if engine.tied_copies():
        syncs.append(TiedEmbeddingSync(engine, held))
    return syncs


def gradient_holders(dp: DataParallel | DataParallelFamilies):
    """params -> the tensors whose .grad is what the optimizer will read of them: the parameters themselves, or
    under ZeRO their pieces in this rank's shard (once the reductions are done)."""
    if not dp.zero:
        return list
    pieces: dict[int, list] = {}
    for held in dp.pieces():
        pieces.setdefault(id(held.param), []).append(held.value)
    return lambda params: [piece for p in params for piece in pieces.get(id(p), ())]


def data_parallel_of(syncs: list[GradSync]) -> DataParallel | DataParallelFamilies | None:
    return next((s.dp for s in syncs if isinstance(s, DataParallelSync)), None)


def not_counted(syncs: list[GradSync]) -> set[int]:
    return set().union(*(s.not_counted() for s in syncs))


def norm_over_world(syncs: list[GradSync]) -> bool:
    """Whether the gradient norm sums over every rank (each value counted once by the syncs' not_counted): the
    replicas hold different parts of the model (experts spread over ep)."""
    return any(getattr(s, "norm_group_world", False) for s in syncs)


def not_owned(syncs: list[GradSync]) -> set[int]:
    return set().union(*(s.not_owned() for s in syncs))


class PlanCollectives:
    """What the runtime calls for the plan's collective actions: every sync hears of a stage's REDUCE_GRAD,
    UNSHARD and RESHARD, and of the runtime's ready() before the stage computes."""

    def __init__(self, syncs: list[GradSync] | None = None):
        self.syncs = syncs or []

    def reduce_grad(self, stage: int) -> None:
        for sync in self.syncs:
            sync.reduce_grad(stage)

    def unshard(self, stage: int) -> None:
        for sync in self.syncs:
            sync.unshard(stage)

    def reshard(self, stage: int) -> None:
        for sync in self.syncs:
            sync.reshard(stage)

    def ready(self, stage: int, backward: bool) -> None:
        for sync in self.syncs:
            sync.ready(stage, backward)
