"""One step that parallelizes a model stage: parallelize(module, layout, mesh, ...) applies a layout's
parallelisms (pipegpt.parallelisms.StageParallelism) to a whole GPT slice, in pipegpt.parallelisms.ORDER, and
returns a Parallelized record that the gradient syncs and the checkpoint read (which parameters which group
sums, which this rank owns). torchtitan's models/*/infra/parallelize.py is the model: one readable function.

    1. tensor parallelism   the block's linears, the vocabulary-parallel embedding and head (shard_for_tp)
    2. expert parallelism   each MoE layer keeps its ep rank's experts and exchanges tokens (shard_for_ep)
    3. context parallelism  attention and positions learn where this rank's tokens sit (shard_for_cp)
    4. recomputation        built into the slice (GPT(recompute=...): selective's checkpoint is inside attention)
    5. compilation          the finished module on its device and in its dtype (compile_stage)
    6. data parallelism     not here: its buffers span every stage of the rank and follow the plan, so the
                            gradient syncs build them from layout.reductions (pipegpt.train.grad_sync)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipegpt.context_parallel.layers import shard_for_cp
from pipegpt.engine.compiling import compile_stage
from pipegpt.expert_parallel.dispatch import ExpertGroup
from pipegpt.expert_parallel.layers import shard_for_ep
from pipegpt.model.gpt import GPT
from pipegpt.parallelisms import StageParallelism
from pipegpt.tensor_parallel.layers import shard_for_tp


@dataclass(eq=False)
class Parallelized:
    """One stage after parallelize: its module, the layout it got and this rank's tp place."""

    module: GPT
    layout: StageParallelism
    tp_rank: int = 0

    def partial_params(self) -> list[torch.Tensor]:
        """The parameters whose gradients tp ranks sum (sequence parallelism's replicated ones)."""
        return [p for name, p in self.module.named_parameters() if self.layout.partial(name)]

    def shared_kv_params(self) -> list[torch.Tensor]:
        """The kv heads' parameters shared by several tp ranks (their gradients summed over them)."""
        return [p for name, p in self.module.named_parameters() if self.layout.shared_kv(name)]


def parallelize(module: GPT, layout: StageParallelism, mesh, *, device: torch.device, dtype: torch.dtype,
                rank: int = 0, timeout_s: float | None = None) -> Parallelized:
    """Apply `layout` to `module` (a whole slice, built from its per-name seeds) as this rank of `mesh` holds it
    (mesh: pipegpt.comm.mesh.Mesh, or any object with its tp_index, cp_index, ep_index and group(name));
    timeout_s: how long context-parallel attention and the experts' all-to-all wait for a peer. In place where it can be; returns the record."""
    if module.recompute != layout.recompute:
        raise ValueError(f"the slice was built with recompute={module.recompute!r}, the layout has "
                         f"{layout.recompute!r}")
    tp_rank = mesh.tp_index if layout.tp > 1 else 0
    if layout.tp > 1:
        shard_for_tp(module, tp_rank, layout.tp, mesh.group("tp"), layout.sequence_parallel)
    if layout.ep > 1:
        shard_for_ep(module, ExpertGroup(mesh.group("ep"), layout.ep, mesh.ep_index,
                                         60.0 if timeout_s is None else timeout_s))
    shard_for_cp(module, mesh.cp_index, layout.cp, mesh.group("cp"), layout.cp_comm, timeout_s)
    module = module.to(device, dtype)  # fp32 master weights under bf16 autocast too
    if layout.compile:  # in place, each stage on its own (dynamo's limit counts per stage)
        compile_stage(module, rank)
    return Parallelized(module, layout, tp_rank)
