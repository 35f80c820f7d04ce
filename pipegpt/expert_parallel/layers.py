"""Expert parallelism applied to a model slice: each MoE layer keeps its ep rank's experts and exchanges tokens
with the group (shard_for_ep, beside tp's shard_for_tp and cp's shard_for_cp)."""
from __future__ import annotations

import functools

import torch.nn as nn

from pipegpt.expert_parallel.dispatch import ExpertGroup
from pipegpt.model.moe import MoE, block_steps, moe_layers


def shard_for_ep(module: nn.Module, ep: ExpertGroup) -> None:
    """In place: every MoE layer of module holds experts ep.local_experts(E) of its E (built whole from the
    one-process seeds, then cut, so the values are one process's) and dispatches through `ep`. Each block of
    module.blocks whose MLP is one of them gets forward_steps (model.moe.block_steps): run in pieces (a pair's
    half) it posts its all-to-alls for the other half to hide."""
    if ep.size == 1:
        return
    for layer in moe_layers(module):
        if layer.n_experts % ep.size:
            raise ValueError(f"{layer.n_experts} experts do not divide over ep = {ep.size}")
        mine = ep.local_experts(layer.n_experts)
        for name in layer.expert_names:
            full = getattr(layer, name)
            setattr(layer, name, nn.Parameter(full.data[mine].clone(), requires_grad=full.requires_grad))
        layer.expert_parallel = ep
    for block in (module.blocks.values() if hasattr(module, "blocks") else ()):
        if isinstance(getattr(block, "mlp", None), MoE):
            block.forward_steps = functools.partial(_block_steps, block, module)


def _block_steps(block, module, x, documents):
    return block_steps(block, x, documents, getattr(module, "recompute", "none") == "full")
