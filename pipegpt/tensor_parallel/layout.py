"""How each parameter is split over tensor-parallel ranks, by its one-process name.

    tp_shard_spec(name)          REPLICATED, DIM0, DIM1, QKV_DIM0 or KV_DIM0
    shard_tensor / gather_full   one tensor: full -> rank r's shard, shards -> full
    shard_state_dict / gather_state_dicts   the same for whole state dicts
    kv_replicas(kv_heads, tp)    how many tp ranks share each key/value head (1 unless tp > kv_heads)
    qk_norm_param(name)          a q/k norm's gain (replicated, its gradient partial over tp)

Knows names and shapes, not the layers, the model or any communication: a checkpoint can
reshard by name with it. It does not import torch at import time (torch is imported inside
the two functions that build tensors), so torch-free code can ask for the specs. Whether a
model can be split at all is a config check: pipegpt.config.validate_tp.

GPT-2: attn.qkv (q, k, v stacked) QKV_DIM0; mlp.fc DIM0; attn.proj, mlp.proj DIM1; their biases follow
(row-parallel biases replicated); wte, lm_head DIM0 (vocabulary); wpe and LayerNorms replicated.
Llama: attn.q, mlp.gate, mlp.up DIM0; attn.k, attn.v KV_DIM0 (and their biases); attn.proj, mlp.proj
DIM1; RMSNorms replicated; wte, lm_head DIM0.

Key/value heads (KV_DIM0, grouped-query attention): rank r holds the q heads [r*n_head/tp, (r+1)*n_head/tp)
and the kv heads they attend with. When tp divides kv_heads that is a plain DIM0 chunk (kv_heads/tp heads);
when tp is a multiple of kv_heads each kv head is REPLICATED over tp/kv_heads consecutive ranks (rank r holds
kv head r // (tp/kv_heads)), whose gradients are partial (each rank's q heads only) and must be summed over the
ranks sharing it. Both cases need the kv head count, so shard_tensor and gather_full take `kv_heads` for k/v
(a ValueError without it when tp > 1: the row count alone cannot tell a head from half of one).
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
KV_DIM0 = "kv-dim0"        # rows of kv_heads heads: rank r holds its q heads' kv heads (DIM0, or one replicated)

_SPECS = (  # (name suffix, spec), first match wins; names are one-process names
    ("attn.qkv.weight", QKV_DIM0), ("attn.qkv.bias", QKV_DIM0),
    ("mlp.fc.weight", DIM0), ("mlp.fc.bias", DIM0),
    ("attn.q.weight", DIM0), ("attn.q.bias", DIM0),
    ("attn.k.weight", KV_DIM0), ("attn.k.bias", KV_DIM0), ("attn.v.weight", KV_DIM0), ("attn.v.bias", KV_DIM0),
    ("mlp.gate.weight", DIM0), ("mlp.gate.bias", DIM0), ("mlp.up.weight", DIM0), ("mlp.up.bias", DIM0),
    ("attn.proj.weight", DIM1), ("mlp.proj.weight", DIM1),
    ("attn.proj.bias", REPLICATED), ("mlp.proj.bias", REPLICATED),
    ("wte.weight", DIM0), ("lm_head.weight", DIM0), ("wpe.weight", REPLICATED),
    # MoE (pipegpt.model.moe): not tensor-parallel (Megatron's ETP 1), whole on every rank (with ep over tp under
    # sequence parallelism, the experts are each tp rank's own ep slice: pipegpt.parallelisms)
    ("mlp.experts_gate", REPLICATED), ("mlp.experts_up", REPLICATED), ("mlp.experts_proj", REPLICATED),
    ("mlp.experts_fc", REPLICATED), ("mlp.shared.fc.weight", REPLICATED),  # GPT-2's GELU experts
    ("mlp.router.weight", REPLICATED), ("mlp.expert_bias", REPLICATED), ("mlp.shared.gate.weight", REPLICATED),
    ("mlp.shared.up.weight", REPLICATED), ("mlp.shared.proj.weight", REPLICATED),
    # q/k RMSNorm (qk_norm): head's one [head_dim] gain for every head; projection's [n_head x head_dim] one whole
    # too (the size of one RMSNorm's), each rank applying its heads' columns
    ("attn.q_norm.weight", REPLICATED), ("attn.k_norm.weight", REPLICATED),
)
QK_NORM_GAINS = ("attn.q_norm.weight", "attn.k_norm.weight")  # each tp rank applies them to its heads


def qk_norm_param(name: str) -> bool:
    """The parameter (by one-process name) is a q/k norm's gain: whole on every tp rank and applied to that rank's
    heads only, so its gradient there is partial whatever the sequence split."""
    return any(name == suffix or name.endswith("." + suffix) for suffix in QK_NORM_GAINS)


def tp_shard_spec(name: str) -> str:
    """How the parameter called `name` (its one-process name) is split: REPLICATED, DIM0, DIM1,
    QKV_DIM0 or KV_DIM0."""
    for suffix, spec in _SPECS:
        if name == suffix or name.endswith("." + suffix):
            return spec
    if name.startswith("ln_f.") or ".ln1." in name or ".ln2." in name:
        return REPLICATED
    raise KeyError(f"no tensor-parallel layout known for parameter {name!r}")


def kv_replicas(kv_heads: int, tp_size: int) -> int:
    """How many consecutive tp ranks hold the same key/value head: tp/kv_heads when tp > kv_heads, else 1."""
    return tp_size // kv_heads if tp_size > kv_heads else 1


def _kv_heads_for(name: str, kv_heads: int | None, tp_size: int) -> int:
    if kv_heads is None:
        raise ValueError(f"{name}: key/value rows split by kv head: pass kv_heads (the model's n_kv_head) "
                         f"to shard or gather it over tp={tp_size}")
    if not (kv_heads % tp_size == 0 or tp_size % kv_heads == 0):
        raise ValueError(f"{name}: {kv_heads} kv heads cannot be split over tp={tp_size} "
                         f"(tp must divide n_kv_head or be a multiple of it)")
    return kv_heads


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp_size: int,
                 kv_heads: int | None = None) -> torch.Tensor:
    """Rank tp_rank's shard of the one-process tensor `full` called `name` (a view where possible).
    kv_heads: the model's key/value head count (ModelConfig.kv_heads), needed for Llama's attn.k/attn.v."""
    import torch

    spec = tp_shard_spec(name)
    if spec == REPLICATED or tp_size == 1:
        return full
    if spec == KV_DIM0:
        kv = _kv_heads_for(name, kv_heads, tp_size)
        if full.size(0) % kv:
            raise ValueError(f"{name}: {full.size(0)} rows are not {kv} kv heads of equal size")
        replicas = kv_replicas(kv, tp_size)
        return full.chunk(tp_size // replicas, 0)[tp_rank // replicas]
    dim = 1 if spec == DIM1 else 0
    parts = 3 * tp_size if spec == QKV_DIM0 else tp_size
    if full.size(dim) % parts:
        raise ValueError(f"{name}: size {full.size(dim)} of dim {dim} is not divisible into {parts} parts")
    if spec == QKV_DIM0:
        return torch.cat([t.chunk(tp_size, 0)[tp_rank] for t in full.chunk(3, 0)])
    return full.chunk(tp_size, dim)[tp_rank]


def gather_full(name: str, shards: list[torch.Tensor], kv_heads: int | None = None) -> torch.Tensor:
    """The one-process tensor called `name` from its shards in tp rank order (the inverse of
    shard_tensor). A replicated tensor is the first rank's; a replicated kv head the first copy's."""
    import torch

    spec = tp_shard_spec(name)
    if spec == REPLICATED or len(shards) == 1:
        return shards[0]
    if spec == KV_DIM0:
        replicas = kv_replicas(_kv_heads_for(name, kv_heads, len(shards)), len(shards))
        return torch.cat(shards[::replicas])
    if spec == QKV_DIM0:
        q, k, v = zip(*(s.chunk(3, 0) for s in shards))
        return torch.cat([*q, *k, *v])
    return torch.cat(shards, 1 if spec == DIM1 else 0)


def shard_state_dict(full_state_dict: dict, tp_rank: int, tp_size: int, kv_heads: int | None = None) -> dict:
    """{name: shard} of a slice's one-process state dict (e.g. slice_state_dict's)."""
    return {k: shard_tensor(k, v, tp_rank, tp_size, kv_heads) for k, v in full_state_dict.items()}


def gather_state_dicts(shard_state_dicts: list[dict], kv_heads: int | None = None) -> dict:
    """One one-process state dict from the tp ranks' sharded ones, in tp rank order."""
    return {k: gather_full(k, [sd[k] for sd in shard_state_dicts], kv_heads) for k in shard_state_dicts[0]}
