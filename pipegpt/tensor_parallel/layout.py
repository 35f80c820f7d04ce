"""How each parameter is split over tensor-parallel ranks, by its one-process name.

    tp_shard_spec(name)          REPLICATED, DIM0, DIM1 or QKV_DIM0
    shard_tensor / gather_full   one tensor: full -> rank r's shard, shards -> full
    shard_state_dict / gather_state_dicts   the same for whole state dicts

Knows names and shapes, not the layers, the model or any communication: a checkpoint can
reshard by name with it. It does not import torch at import time (torch is imported inside
the two functions that build tensors), so torch-free code can ask for the specs. Whether a
model can be split at all is a config check: pipegpt.config.validate_tp.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# How a parameter is split over tp ranks (tp_shard_spec); shards are contiguous and in rank order.
REPLICATED = "replicated"  # every rank holds the whole tensor
DIM0 = "dim0"              # rank r holds rows [r*n/tp, (r+1)*n/tp)
DIM1 = "dim1"              # rank r holds columns [r*n/tp, (r+1)*n/tp)
QKV_DIM0 = "qkv-dim0"      # rows stacked [q; k; v]: rank r holds its DIM0 chunk of each, stacked

_SPECS = (  # (name suffix, spec), first match wins; names are one-process names
    ("attn.qkv.weight", QKV_DIM0), ("attn.qkv.bias", QKV_DIM0),
    ("mlp.fc.weight", DIM0), ("mlp.fc.bias", DIM0),
    ("attn.proj.weight", DIM1), ("mlp.proj.weight", DIM1),
    ("attn.proj.bias", REPLICATED), ("mlp.proj.bias", REPLICATED),
    ("wte.weight", DIM0), ("lm_head.weight", DIM0), ("wpe.weight", REPLICATED),
)


def tp_shard_spec(name: str) -> str:
    """How the parameter called `name` (its one-process name) is split: REPLICATED, DIM0, DIM1
    or QKV_DIM0."""
    for suffix, spec in _SPECS:
        if name == suffix or name.endswith("." + suffix):
            return spec
    if name.startswith("ln_f.") or ".ln1." in name or ".ln2." in name:
        return REPLICATED
    raise KeyError(f"no tensor-parallel layout known for parameter {name!r}")


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank tp_rank's shard of the one-process tensor `full` called `name` (a view where possible)."""
    import torch

    spec = tp_shard_spec(name)
    if spec == REPLICATED:
        return full
    dim = 1 if spec == DIM1 else 0
    parts = 3 * tp_size if spec == QKV_DIM0 else tp_size
    if full.size(dim) % parts:
        raise ValueError(f"{name}: size {full.size(dim)} of dim {dim} is not divisible into {parts} parts")
    if spec == QKV_DIM0:
        return torch.cat([t.chunk(tp_size, 0)[tp_rank] for t in full.chunk(3, 0)])
    return full.chunk(tp_size, dim)[tp_rank]


def gather_full(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The one-process tensor called `name` from its shards in tp rank order (the inverse of
    shard_tensor). A replicated tensor is the first rank's."""
    import torch

    spec = tp_shard_spec(name)
    if spec == REPLICATED:
        return shards[0]
    if spec == QKV_DIM0:
        q, k, v = zip(*(s.chunk(3, 0) for s in shards))
        return torch.cat([*q, *k, *v])
    return torch.cat(shards, 1 if spec == DIM1 else 0)


def shard_state_dict(full_state_dict: dict, tp_rank: int, tp_size: int) -> dict:
    """{name: shard} of a slice's one-process state dict (e.g. slice_state_dict's)."""
    return {k: shard_tensor(k, v, tp_rank, tp_size) for k, v in full_state_dict.items()}


def gather_state_dicts(shard_state_dicts: list[dict]) -> dict:
    """One one-process state dict from the tp ranks' sharded ones, in tp rank order."""
    return {k: gather_full(k, [sd[k] for sd in shard_state_dicts]) for k in shard_state_dicts[0]}
