"""Megatron-style tensor parallelism as module replacement on a plain GPT slice.

`shard_for_tp(slice, tp_rank, tp_size, group)` swaps, in place, the slice's layers for
tensor-parallel ones holding this rank's shard, under the same one-process parameter names:

    attn.qkv   column-parallel: rows of this rank's n_head/tp heads from each of q, k and v
    attn.proj  row-parallel (input columns of those heads), bias added once after the reduce
    mlp.fc     column-parallel;  mlp.proj row-parallel
    Llama:     attn.q, mlp.gate, mlp.up column-parallel; attn.k, attn.v column-parallel by kv head: the
               kv heads of this rank's q heads, n_kv_head/tp of them, or, when tp is a multiple of
               n_kv_head, the one head (r // (tp/n_kv_head)) shared with the other ranks of its group,
               whose gradients replicated_kv_params / sum_replicated_kv_grads sum over the group;
               q/k/v biases follow their weights; attn.proj, mlp.proj row-parallel; no wpe (rotary
               positions: with sequence parallelism attention sees the gathered sequence, so positions
               are 0..T-1 as in one process)
    wte        vocabulary-parallel: a contiguous range of the (padded) vocabulary per rank;
               tokens outside it embed to 0, then the ranks' embeddings are summed
    lm_head    column-parallel over the vocabulary (tied to the local wte shard when the slice
               holds both); the loss is vocab_parallel_cross_entropy, logits are never gathered
    LayerNorms (RMSNorms), wpe, row-parallel biases: replicated (identical on every tp rank)
    attn.q_norm, attn.k_norm whole on every rank, their gradients partial whatever the sequence split
               (partial_grad_params): qk_norm head (Qwen3): one [head_dim] gain for every head, this rank's
               heads' part; qk_norm projection (OLMoE): over the whole q (k) projection, its mean square
               summed over tp, and this rank's columns of the gain (ProjectionSliceRMSNorm)
    MoE layers (pipegpt.model.moe): attention as above; the feed-forward (router, shared and routed experts)
               whole on every rank (experts not tensor-parallel, Megatron's ETP 1): without sequence parallelism
               each rank computes it on the same tokens, with it on its own chunk (the aux loss's sums then
               reduce_from_tp over the group: MoE.token_sums)

Shapes (B microbatch, T sequence, C n_embd, tp ranks; rank r's sequence chunk is positions
[r*T/tp, (r+1)*T/tp)):

                             sequence_parallel=False     sequence_parallel=True
    first stage input        tokens [B, T]               tokens [B, T] (the same on every tp rank)
    hidden states between    [B, T, C], the same on      [B, T/tp, C], rank r's sequence chunk
    stages (and their grads) every tp rank
    last stage targets       [B, T]                      [B, T]
    loss                     scalar, the same on every tp rank
    logits (no targets)      [B, T, real columns of this rank's vocabulary range]

Under autocast a column-parallel layer casts its input to the autocast dtype before communicating (the
matmul would cast it anyway): the collectives at its entry and their backward move bf16, as Megatron's do.
The embedding's reduction stays in the residual stream's dtype.

With sequence parallelism the LayerNorm/dropout/residual regions hold a sequence chunk: a
column-parallel layer all-gathers its input along the sequence (instead of copy_to_tp) and a
row-parallel one reduce-scatters its output (instead of all-reduce); the embedding
reduce-scatters and adds the position embeddings of its chunk. Every replicated parameter then
gets a PARTIAL gradient (from its chunk only): `partial_grad_params(slice)` lists them (and the
per-head q/k norms' gains), for the caller to all-reduce (sum) over the tp group after backward.

Dropout: tp ranks seed torch identically, so dropout in replicated regions draws one mask on all of
them. In sharded regions (the attention probabilities of a rank's heads; under sequence parallelism
every dropout, over a sequence chunk) each rank draws masks of its own (pipegpt.tensor_parallel.rng),
restored with the shared stream by recomputation: the one-process model given the ranks' masks
(joined over heads or chunks) computes the same loss and gradients.

Sharded linears stay pipegpt.model.split_backward.SplitLinear, so defer_weight_grads() defers their
weight grads (and the row-parallel biases', added after the reduce with add_bias); W closures
never communicate.

Which parameter is split how (by one-process name) is in pipegpt.tensor_parallel.layout; the
collectives the layers call are in pipegpt.tensor_parallel.collectives.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipegpt.arch import MOE, ROW, block_linears, kv_local_heads, layer_kinds
from pipegpt.config import ConfigError
from pipegpt.model.gpt import GPT
from pipegpt.model.split_backward import SplitLinear, add_bias, split_linear
from pipegpt.tensor_parallel.collectives import (copy_to_tp, gather_from_sequence, group_size, reduce_from_tp,
                                                 reduce_scatter_to_sequence, sum_used_by_all,
                                                 vocab_parallel_cross_entropy, vocab_parallel_token_losses)
from pipegpt.config import validate_tp
from pipegpt.tensor_parallel.layout import (KV_DIM0, REPLICATED, qk_norm_param, kv_replicas, shard_tensor,
                                            tp_shard_spec)
from pipegpt.tensor_parallel.rng import ShardedDropout, sharded_region


# ---------------------------------------------------------------------------
# Tensor-parallel layers
# ---------------------------------------------------------------------------
class ColumnParallelLinear(SplitLinear):
    """Output features split over tp ranks; the input is replicated (copy_to_tp) or, with
    sequence parallelism, gathered along the sequence. The output stays split."""

    def __init__(self, in_features, out_features_local, bias, group, sequence_parallel, device=None,
                 dtype=None):
        super().__init__(in_features, out_features_local, bias=bias, device=device, dtype=dtype)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        x = _to_autocast_dtype(x)
        x = gather_from_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
        return super().forward(x)


def _to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype, if autocast is on: the matmul would cast it anyway (the forward's values do not
    change), so the all-gather and, in backward, the reduce-scatter or all-reduce of its gradient move half the
    bytes, as Megatron's do. LayerNorm's fp32 output is what arrives here under autocast. The cast's backward
    hands fp32 back to the LayerNorm, so gradients keep their parameters' dtype."""
    if not x.is_floating_point() or not torch.is_autocast_enabled(x.device.type):
        return x
    dtype = torch.get_autocast_dtype(x.device.type)
    return x if x.dtype == dtype else x.to(dtype)


class RowParallelLinear(SplitLinear):
    """Input features split over tp ranks; the partial outputs are summed (all-reduce) or, with
    sequence parallelism, reduce-scattered along the sequence; then the bias, once."""

    def __init__(self, in_features_local, out_features, bias, group, sequence_parallel, device=None,
                 dtype=None):
        super().__init__(in_features_local, out_features, bias=bias, device=device, dtype=dtype)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        y = split_linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else add_bias(y, self.bias)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the (padded) vocabulary; tokens outside
    embed to 0, then the ranks' embeddings are summed (or reduce-scattered along the sequence)."""

    def __init__(self, weight: torch.Tensor, vocab_start, group, sequence_parallel):
        super().__init__(*weight.shape, _weight=weight)  # _weight: no init drawn
        self.vocab_start, self.group, self.sequence_parallel = vocab_start, group, sequence_parallel

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_tp(out, self.group)


class SequenceChunkEmbedding(nn.Embedding):
    """A replicated position embedding that, given all T positions, embeds this rank's chunk."""

    def __init__(self, weight: torch.Tensor, tp_rank, tp_size):
        super().__init__(*weight.shape, _weight=weight)  # _weight: no init drawn
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def forward(self, pos):
        """pos [T], or [B, T] (positions per sequence: restarting at each document)."""
        if pos.size(-1) % self.tp_size:
            raise ValueError(f"sequence parallelism: sequence length {pos.size(-1)} is not divisible "
                             f"by tp={self.tp_size}")
        return super().forward(pos.chunk(self.tp_size, -1)[self.tp_rank])


def _vocab_parallel_head_output(logits, targets, vocab_start: int, vocab_size: int, group, reduction: str = "mean"):
    """GPT.head_output for a vocabulary shard: the loss (reduction "none": each target's), or the logits of this
    rank's real columns."""
    if targets is None:
        return logits[..., :max(0, min(logits.size(-1), vocab_size - vocab_start))]
    if reduction == "none":
        return vocab_parallel_token_losses(logits, targets, vocab_start, group, vocab_size=vocab_size)
    return vocab_parallel_cross_entropy(logits, targets, vocab_start, group, vocab_size=vocab_size)


class ProjectionSliceRMSNorm(nn.Module):
    """qk_norm projection (OLMoE's) on one tp rank: an RMSNorm over the whole q (or k) projection of which this
    rank holds columns [start, start + width). The mean square is every rank's sum of squares, summed over tp
    (sum_used_by_all: each rank's outputs depend on it, so its backward sums their gradients too); a kv head held
    by `replicas` ranks is in that sum as many times, hence the division. The gain stays whole on every rank
    (replicated, the size of one RMSNorm's) and this rank applies its columns: its gradient is zero elsewhere, so
    the sum over tp of the ranks' gradients is the one-process gradient (pipegpt.parallelisms' partial sum)."""

    def __init__(self, weight: torch.Tensor, eps: float | None, start: int, width: int, replicas: int, group):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.eps = torch.finfo(torch.float32).eps if eps is None else eps
        self.start, self.width, self.replicas, self.group = start, width, replicas, group

    def forward(self, x):
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # at least fp32 (float64 stays)
        squares = wide.pow(2).sum(-1, keepdim=True)
        mean_square = sum_used_by_all(squares, self.group) / (self.replicas * self.weight.numel())
        gain = self.weight[self.start:self.start + self.width]
        return (wide * torch.rsqrt(mean_square + self.eps)).type_as(x) * gain


@dataclass(frozen=True)
class TPLayout:
    """Set as `slice.tensor_parallel` by shard_for_tp."""

    tp_rank: int
    tp_size: int
    sequence_parallel: bool


# ---------------------------------------------------------------------------
# Module replacement
# ---------------------------------------------------------------------------
def shard_for_tp(module: GPT, tp_rank: int, tp_size: int, group, sequence_parallel: bool = False) -> GPT:
    """Replace `module`'s layers, in place, by tensor-parallel ones holding rank tp_rank's shard
    of their current values (build the slice unsharded, e.g. from its init_seed, then shard).
    `group`: the tp process group (None only when tp_size == 1). Returns `module`.

    Don't call init_weights or load_from_full on the result: load shards with
    load_state_dict(shard_state_dict(full_sd, tp_rank, tp_size, config.kv_heads)).
    """
    validate_tp(module.config, tp_size, sequence_parallel)
    if not (isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise ConfigError(f"tp_rank={tp_rank!r} must be an integer in [0, {tp_size})")
    if getattr(module, "tensor_parallel", None) is not None:
        raise ValueError("this model slice is already sharded for tensor parallelism")
    if tp_size > 1 and (group is None or group_size(group) != tp_size):
        got = "None" if group is None else f"a group of {group_size(group)} ranks"
        raise ValueError(f"tp_size={tp_size} needs a tp process group of {tp_size} ranks, got {got}")
    sp = sequence_parallel and tp_size > 1
    module.tensor_parallel = TPLayout(tp_rank, tp_size, sp)
    if tp_size == 1:
        return module

    config = module.config
    kv = config.kv_heads

    def take(name: str, old: nn.Parameter) -> nn.Parameter:
        shard = shard_tensor(name, old.detach(), tp_rank, tp_size, kv)
        return nn.Parameter(shard.clone(memory_format=torch.contiguous_format), requires_grad=old.requires_grad)

    def meta(*shape) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    def swap(new: nn.Module, old: nn.Module, prefix: str) -> nn.Module:
        # new was built on the meta device (no init, no RNG drawn): give it the old one's shards
        for pname, p in old.named_parameters(recurse=False):
            setattr(new, pname, take(f"{prefix}.{pname}", p))
        new.train(old.training)
        return new

    def column(old: SplitLinear, prefix: str, out_local: int | None = None) -> ColumnParallelLinear:
        out_local = old.out_features // tp_size if out_local is None else out_local
        new = ColumnParallelLinear(old.in_features, out_local, old.bias is not None, group, sp, device="meta")
        return swap(new, old, prefix)

    def row(old: SplitLinear, prefix: str) -> RowParallelLinear:
        new = RowParallelLinear(old.in_features // tp_size, old.out_features, old.bias is not None,
                                group, sp, device="meta")
        return swap(new, old, prefix)

    def own_masks(old: nn.Dropout) -> ShardedDropout:
        return swap(ShardedDropout(old.p, tp_rank), old, "")

    kv_local = kv_local_heads(config, tp_size)  # kv heads of this rank: kv/tp, or one shared (tp a multiple of kv)
    replicas = kv_replicas(kv, tp_size)

    def projection_norm(old: nn.RMSNorm, prefix: str, heads: int, first: int, replicas: int) -> nn.Module:
        hd = config.head_dim
        new = ProjectionSliceRMSNorm(meta(*old.weight.shape), old.eps, first * hd, heads * hd, replicas, group)
        return swap(new, old, prefix)

    kinds = layer_kinds(config)
    for i, block in module.blocks.items():
        for lin in block_linears(config, tp_size, kinds[int(i)]):  # each one's split and its shape on this rank
            if kinds[int(i)] is MOE and not lin.name.startswith("attn."):
                continue  # the MoE feed-forward stays whole on every tp rank (experts not tensor-parallel)
            owner, _, leaf = lin.name.rpartition(".")
            parent, name = block.get_submodule(owner), f"blocks.{i}.{lin.name}"
            old = getattr(parent, leaf)
            setattr(parent, leaf, row(old, name) if lin.split == ROW else column(old, name, lin.rows))
        block.attn.n_head //= tp_size
        block.attn.n_kv_head = kv_local
        if config.qk_norm == "projection":  # this rank's q heads and kv heads of the whole projections
            q_heads, attn = block.attn.n_head, block.attn
            attn.q_norm = projection_norm(attn.q_norm, f"blocks.{i}.attn.q_norm", q_heads, tp_rank * q_heads, 1)
            attn.k_norm = projection_norm(attn.k_norm, f"blocks.{i}.attn.k_norm", kv_local,
                                          tp_rank // replicas * kv_local, replicas)
        block.attn.core_rng = functools.partial(sharded_region, tp_rank)  # this rank's heads: its own masks
        if sp:  # the residual branches' dropout sees this rank's sequence chunk
            block.attn.resid_drop, block.mlp.drop = own_masks(block.attn.resid_drop), own_masks(block.mlp.drop)
        if sp and kinds[int(i)] is MOE:  # each rank routes its own sequence chunk: the aux loss sums over tp
            block.mlp.token_sums.append(functools.partial(reduce_from_tp, group=group))

    V_local = config.padded_vocab_size // tp_size
    vocab_start = tp_rank * V_local
    if module.embed:
        old = module.wte
        module.wte = swap(VocabParallelEmbedding(meta(V_local, old.embedding_dim), vocab_start, group, sp),
                          old, "wte")
        if sp and hasattr(module, "wpe"):  # GPT-2's learned positions (Llama's rotary ones have no parameters)
            old = module.wpe
            module.wpe = swap(SequenceChunkEmbedding(meta(*old.weight.shape), tp_rank, tp_size), old, "wpe")
        if sp:  # the embedding's dropout sees this rank's sequence chunk
            module.drop = own_masks(module.drop)
    if module.head:
        module.lm_head = column(module.lm_head, "lm_head")
        if module.embed and module.config.tie_embeddings:
            module.lm_head.weight = module.wte.weight  # the local vocabulary shard, shared
        module.head_output = functools.partial(_vocab_parallel_head_output, vocab_start=vocab_start,
                                               vocab_size=module.config.vocab_size, group=group)
    return module


def partial_grad_params(module: GPT) -> list[torch.Tensor]:
    """The parameters whose gradients are partial on each tp rank: under sequence parallelism every
    replicated one (LayerNorms, row-parallel biases, wpe), and with tp > 1 the per-head q/k norms'
    gains (each rank's heads only): all-reduce (sum) their .grad over the tp group after the step's
    backward (all B, or all I and W), before clipping and the optimizer. Empty otherwise (replicated
    gradients are then already whole)."""
    layout = getattr(module, "tensor_parallel", None)
    if layout is None or layout.tp_size == 1:
        return []
    return [p for name, p in module.named_parameters() if tp_shard_spec(name) == REPLICATED
            and (layout.sequence_parallel or qk_norm_param(name))]


def replicated_kv_params(module: GPT) -> list[torch.Tensor]:
    """Llama's attn.k and attn.v parameters when tp > n_kv_head (tp a multiple of it): each kv
    head is then held by tp/n_kv_head ranks, each of which computes its gradient from its own q heads only.
    sum_replicated_kv_grads sums them over the ranks sharing the head. Empty otherwise."""
    layout = getattr(module, "tensor_parallel", None)
    if layout is None or kv_replicas(module.config.kv_heads, layout.tp_size) == 1:
        return []
    return [p for name, p in module.named_parameters() if tp_shard_spec(name) == KV_DIM0]


def sum_replicated_kv_grads(params: list[torch.Tensor], group, kv_heads: int, tp_rank: int, tp_size: int) -> None:
    """Sum, in place, the gradients of replicated kv heads (replicated_kv_params) over the tp ranks sharing
    each head, with one all-reduce over the whole tp group and no other process group: every rank writes its
    gradients into the row of its kv head of a [kv_heads, n] zero buffer (n: its gradients' total size), the
    all-reduce sums each row over the ranks of that head, and each rank takes its row back. kv_heads < tp, so
    the buffer is smaller than tp copies of the gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    buffer = flat.new_zeros(kv_heads, flat.numel())
    head = tp_rank // kv_replicas(kv_heads, tp_size)
    buffer[head] = flat
    torch.distributed.all_reduce(buffer, group=group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(buffer[head], grads)):
        grad.copy_(summed)
