"""What one stage keeps per microbatch in flight, between an I and its W, and its actions' transients;
each rank's peaks over a plan. Pure arithmetic on shapes (no torch), checked against the saved-tensor hooks
and a measured replay (tests/unit/test_plan_memory.py, test_plan_llama.py). pipegpt.costs.memory adds the
rest of a rank (weights, gradients, optimizer state, message buffers) and re-exports these.

Activations (per microbatch in flight; checked against the measured replay)
------------------------------------------------------------------------------
Korthikanti et al. 2022 (Table 2) count, per layer and in 16-bit, s*b*h*(34 + 5*a*s/h) bytes:
    LayerNorm inputs 4sbh | QKV input 2sbh | Q, K 4sbh | V 2sbh | softmax output 2as^2b |
    softmax dropout mask as^2b | dropout output 2as^2b | proj input 2sbh | attn dropout mask sbh |
    fc input 2sbh | GeLU input 8sbh | proj input (GeLU output) 8sbh | MLP dropout mask sbh
i.e. 16 stored sbh-elements of 2 bytes, 2sbh bytes of masks and 5as^2b. What pipegpt stores instead
(N = b*s*h; Ns = b*s*h/tp with sequence parallelism, else N; t = tp; sizes in bytes, r = residual
and LayerNorm dtype: 4, or 8 with fp64; c = compute dtype: 2 under bf16, else r):

    term                           pipegpt                              paper (16-bit, t-way tp)
    LayerNorm inputs (ln1, ln2)    2*Ns*r                               4sbh (SP: 4sbh/t)
    LayerNorm mean, rstd           4*(b*s or b*s/t)*r                   (not counted)
    QKV and fc inputs              2*N*c: full even with SP: the        4sbh (SP: 4sbh/t: Megatron
      (LayerNorm outputs)          column-parallel layer saves the      re-gathers it in backward)
                                   all-gathered input; under bf16 it
                                   is the bf16 cast (the fp32 LN output
                                   is not kept)
    Q, K, V                        3*N/t*c (the qkv output SDPA keeps)  6sbh/t
    attention core                 SDPA flash/efficient: its output     5as^2b/t (softmax, mask,
                                   N/t*c (also the proj input: the      dropout output) + proj
                                   transpose(1,2).contiguous() is a     input 2sbh/t
                                   no-op on its layout) and logsumexp
                                   b*a/t*s*r. No s^2 term. (CPU with
                                   dropout > 0: the math path, with
                                   softmax output, dropout mask and
                                   output, 3*b*a/t*s^2*c, instead of
                                   the logsumexp.)
    fc output (GeLU input)         4*N/t*c                              8sbh/t
    GeLU output (proj input)       4*N/t*c                              8sbh/t
    dropout masks                  none with dropout = 0; else 1 byte   2sbh (+ as^2b)
                                   per element (CUDA; CPU: a mask of
                                   the tensor's dtype), see device=
    bf16 weight casts              12*h*h/t*2 per layer: SplitLinear    (not counted)
                                   casts each weight to bf16 per call
                                   and saves the cast, so each
                                   microbatch in flight keeps its own

(Check, tp=1 fp32 per layer: 2+2+3+1+4+4 = 16 elements of 4 bytes = 64*b*s*h bytes plus the small
stats and logsumexp; the paper's 34 less the 2 of masks is 32 bytes = the same 16 elements of 2.)

Recomputation: "full" keeps each block's input (Ns*r per layer, checkpoint's frame) and nothing else
of the block; "selective" (pipegpt checkpoints the attention core only) drops what the core saves
beyond its inputs and output: with SDPA's flash/efficient kernels that is only the logsumexp, so
unlike the paper's selective recomputation (which drops the 5as^2b) it saves almost nothing. Only
on SDPA's math path (CPU with dropout > 0) is there an s^2 term to drop.

Stage extras: the first stage keeps its tokens (Stage.inputs, b*s int64) and wpe's positions (s
int64); tp > 1 adds the vocabulary-parallel embedding's local ids (b*s int64) and outside-mask (b*s
bool). The embedding output is the first block's input (counted there). The last stage keeps ln_f's
input (Ns*r) and stats, lm_head's input (N*c, gathered/full), under bf16 the bf16 cast of lm_head's
weight (Vp/t*h*2), and the loss's: tp = 1 the log-softmax of the real vocabulary (b*s*V*r: fp32 even
under autocast) and the targets (b*s int64); tp > 1 the vocabulary-parallel softmax (b*s*Vp/t*r),
the target index (b*s int64), two b*s bool masks; and a few loss scalars. A stage's output is
released once sent (its graph stays); a non-first stage's input is its first block's (or ln_f's)
input, counted there.

Measured on CPU, where SDPA (dropout = 0) runs its flash kernel. On CUDA the flash (bf16) and
memory-efficient (fp32) kernels keep the same q, k, v, output and logsumexp (the efficient kernel
pads the logsumexp's sequence to a multiple of 32) and dropout keeps 1-byte masks; that side is
not measured here.

Between an I and its W (zb-h1, zbv, ...) a stage keeps what the deferred weight gradients read:
each linear's input and output gradient, per layer (4*N + 12*N/t)*c (+ 2*Ns*c: the row-parallel
biases' own gradients under sequence parallelism), for the head ln_f's output (N*c) and the logits'
gradient (b*s*Vp/t*c), and on a non-first stage its input and the input's gradient (2*Ns*r: the W
closures' tensors reference graph nodes that reach the input's AccumulateGrad). This does not
depend on recomputation: the I pass recomputes, and W keeps what it recomputed. With full
recomputation this is far more than the forward keeps.

Llama (arch llama)
------------------
Parameters: wte [Vp/tp, h] (no wpe: rotary positions have no parameters); per block ln1, ln2 (RMSNorm:
a gain [h], replicated), attn.q [n_head*hd/tp, h], attn.k and attn.v [kv*hd, h] where kv, the key/value
heads a tp rank holds, is kv_heads/tp, or 1 when tp > kv_heads (each head replicated on tp/kv_heads
ranks; tp must divide kv_heads or be a multiple of it: check_tp_shapes), with [rows] biases under
qkv_bias; attn.proj [h, n_head*hd/tp]; mlp.gate and mlp.up [F/tp, h], mlp.proj [h, F/tp] (F: ffn_width;
biases as GPT-2's when bias); ln_f [h] and lm_head [Vp/tp, h] (its own unless tie_embeddings).

Activations per layer, what pipegpt's Llama block stores (F/t: the rank's SwiGLU width; checked against the
saved-tensor hooks and the replay at tp 1 and 2, tests/unit/test_plan_llama.py):

    term                              bytes
    RMSNorm inputs (ln1, ln2)         2*Ns*r
    RMSNorm statistics                rstd 2*(b*s or b*s/t)*r on CUDA (its fused kernel); the CPU's
                                      composite one also keeps x * rstd, 2*Ns*r
    q/k/v and gate/up inputs          2*N*c: the two RMSNorm outputs, shared by the linears that read them;
                                      5*N*c when each linear makes its own (the bf16 cast under autocast,
                                      the all-gather with sequence parallelism)
    q (rotated), k (rotated), v       3*N/t*c: grouped-query attention repeats k and v to the rank's query
                                      heads before SDPA, which keeps the repeated ones, so GQA saves no
                                      activation memory here; with selective recomputation the checkpoint
                                      (with cp, the attention Function) keeps its inputs instead: q N/t*c and
                                      k, v 2*b*s*kv*hd*c (kv wide)
    attention output, logsumexp       N/t*c, b*a/t*s*r (as GPT-2's; selective drops the logsumexp, but with cp)
    SwiGLU                            4*b*s*F/t*c: gate output (SiLU's input), up output, SiLU output,
                                      their product (mlp.proj's input)
    rotary tables                     4*s*hd*c when the compute dtype is not fp32, or with cp (cos and sin for q
                                      and for k); in fp32 the cached tables are shared, a per-rank constant
                                      of 2*s*hd*4 bytes not counted
    bf16 weight casts                 the rank's seven block matrices x 2 bytes (bf16 only)

The first stage keeps its tokens only (no positions); the last stage's ln_f keeps its input and rstd (and
the CPU's x * rstd). Between I and W: the linears' inputs (2*N, or 5*N as above, + N/t + b*s*F/t) and
output gradients (q N/t, k and v 2*b*s*kv*hd, attn.proj N, gate and up 2*b*s*F/t, mlp.proj N), times c.
Workspace: as GPT-2's with the MLP's intermediates 4*b*s*F/t*c under full recomputation, a backward's
3*b*s*F*r and the widest weight F*h/t.

Context parallelism (sharding.cp > 1)
-------------------------------------
A rank holds L = s/cp tokens of every sequence (two chunks), and its blocks keep what they keep for s tokens
with s = L (the ring's autograd Function saves its local q, k, v, output and logsumexp: O(L)); so does
the head, and the embedding's tokens. Every per-token term above divides by cp; weights do not.
Four terms differ from one process's (measured to the byte, tests/unit/test_cp_memory.py):
- the Function keeps k and v as the kv heads give them, 2*b*L*kv*hd*c, where SDPA keeps them repeated to
  the query heads (Llama with 1 kv head of 4 at cp 4, b 2, L 64, h 128, fp32: 96 KiB less per layer);
- it keeps its logsumexp (fp32; fp64 in fp64) under selective recomputation too, which never checkpoints
  cp's attention: selective keeps what none keeps;
- rotary's cos and sin for q and for k are indexed at the rank's positions per call, 4*L*hd*c in fp32 too
  (one process's fp32 tables are views of the cached one). The cached table itself, 2*seq_len*hd*4 bytes
  with cp, is a per-rank constant and not counted;
- wpe's positions (GPT-2) are the rank's, cached (pipegpt.context_parallel.layers): not per microbatch.
At cp 2 (KEEP_PEER_CP) each block also keeps the peer's K/V, b*L*2*kv*hd*c bytes (kv: the rank's kv heads),
for its backward (none under full recomputation, whose checkpoint keeps the block's input only).
In flight while a block's attention runs (workspace, not held): blocks of K and V of b*L*2*kv*hd*c bytes
(only kv heads travel): the ring two in the forward (the one computed on, the one arriving; at cp 2 the
arriving one stays, held) and four in the backward (K/V and dK/dV; at cp 2 dK/dV's two); the all-gather the
whole gathered K/V (cp blocks) forward and K/V with dK/dV (2*cp blocks) backward (at cp 2 the own K/V stacked
beside the kept peer's and dK/dV: 3).

Workspace (an estimate)
-----------------------
What an action allocates and frees again, on top of what the rank holds: a block's temporaries in a
forward (2*N*r; with full recomputation nothing is kept, so 8*N/t*c + 2*N*r), about one block's
gradients in a backward (8*N*r; with full recomputation also that block's recomputed activations),
the logits next to the saved softmax in the head's forward (b*s*Vp/t*c, plus their fp32 copy under
bf16), the logits' gradient and its padded or bf16 copy in the head's backward (2 or 2.5 x
b*s*Vp/t*r: on GPT-2's last stage the largest transient by far), the embedding's dense gradient at
the end of the first stage's backward (Vp/t*h*r), a weight's gradient before it accumulates
(W). activation_peaks adds each action's to the level it runs at; the replay's per-op peak is met
within a few percent, overshot by up to ~25% with full recomputation.

"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from pipegpt.arch import MOE, ROW, block_linears, kv_local_heads, layer_mix, stage_ranges
from pipegpt.config import ConfigError, ModelConfig, validate_tp
from pipegpt.dims import Sharding
from pipegpt.schedule.actions import Kind, Plan

from .experts import tp_model

KEEP_PEER_CP = 2  # cp at which a block keeps the peer's K/V (pipegpt.context_parallel.attention's)


MEMORY_PRECISIONS = ("fp32", "bf16", "fp64")
INT64, BOOL = 8, 1
FP32_BYTES = 4  # the router's scores: fp32 whatever the precision


def memory_precision(precision: str = "fp32", dtype: str = "float32") -> str:
    """A run's (runtime.precision, runtime.dtype) as this module's precision."""
    if dtype == "float64":
        return "fp64"
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"precision={precision!r} is not valid: use fp32 or bf16")
    return precision


def _widths(precision: str) -> tuple[int, int]:
    """(r, c): bytes of a residual/LayerNorm/parameter element and of a compute element."""
    if precision == "fp32":
        return 4, 4
    if precision == "bf16":
        return 4, 2
    if precision == "fp64":
        return 8, 8
    raise ConfigError(f"precision={precision!r} is not valid: use one of {', '.join(MEMORY_PRECISIONS)}")


def _count(layers) -> int:
    return layers if isinstance(layers, int) else len(layers)


def _mix(model: ModelConfig, layers) -> tuple:
    """A slice's (layer kind, count) pairs (pipegpt.arch.layer_mix), as a ConfigError where a count is ambiguous."""
    try:
        return layer_mix(model, layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_tp(model: ModelConfig, tp: int, sequence_parallel: bool = False, cp: int = 1) -> None:
    """ConfigError unless the model splits over tp: pipegpt.config.validate_tp (of a model with experts, its
    attention and dense layers: experts stay whole per tp rank), and the shapes below (check_tp_shapes)."""
    validate_tp(tp_model(model, tp), tp, sequence_parallel, cp)
    check_tp_shapes(model, tp)


def check_tp_shapes(model: ModelConfig, tp: int) -> None:
    """What the shapes below assume of tp beyond whole heads and a divisible vocabulary: the MLP width
    divisible by tp and the key/value heads split (tp divides kv_heads) or replicated (tp a multiple of
    kv_heads). validate_tp says the same; this guard keeps the planner from listing shapes no rank holds."""
    kv, width = model.kv_heads, model.ffn_width
    if kv % tp and tp % kv:
        raise ConfigError(f"n_kv_head={kv} does not split over tp={tp}: tp must divide n_kv_head or be a "
                          f"multiple of it")
    if width % tp:
        raise ConfigError(f"the MLP width {width} is not divisible by tp={tp}")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")




# ---------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------
def _check(model, sharding: Sharding, recompute, device, microbatch_size=1):
    _check_tp(model, sharding.tp, sharding.sequence_parallel)
    _check_positive("microbatch_size", microbatch_size)
    if recompute not in ("none", "selective", "full", "norm-act"):
        raise ConfigError(f"recompute={recompute!r} is not valid: use none, selective or full (or norm-act, "
                          f"Megatron-Core's, for the planner)")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"device={device!r} is not valid: use cuda or cpu")


def _locals(model, b, sharding: Sharding, precision, device):
    """What the terms below share: widths, token counts and the norms' statistics of one microbatch of b."""
    r, c = _widths(precision)
    s = model.seq_len // sharding.cp  # the tokens a rank holds of each sequence
    S = sharding.tokens_per_rank(model.seq_len)  # the sequence a tp rank holds in the replicated regions
    N, Ns, bs, bS = b * s * model.n_embd, b * S * model.n_embd, b * s, b * S
    # a norm's statistics: LayerNorm's mean and rstd; RMSNorm's rstd (and on CPU, composite, x * rstd)
    norm_stats = (bS * r + (Ns * r if device == "cpu" else 0)) if model.architecture.norm == "rms" else 2 * bS * r
    return r, c, s, N, Ns, bs, norm_stats


@functools.lru_cache(maxsize=8192)
def _layer_bytes(model, b, sharding: Sharding, recompute, precision, device, moe: bool = False) -> int:
    """What one block (at its kind's block model; moe: an MoE block's) keeps per microbatch in flight."""
    r, c, s, N, Ns, bs, norm_stats = _locals(model, b, sharding, precision, device)
    a, tp, sp = model.n_head, sharding.tp, sharding.splits_sequence
    drop = model.dropout > 0
    # Where dropout > 0 puts its masks: 1 byte (CUDA's native_dropout) or the tensor's dtype (CPU).
    mask_c = 1 if device == "cuda" else c
    math_attention = drop and device == "cpu"  # CPU SDPA has no dropout in its flash kernel
    arch, F = model.architecture, model.ffn_width
    if recompute == "full":
        return Ns * r + (_moe_checkpointed(model, b, sharding, precision) if moe else 0)  # the block's input
    # SDPA keeps q, k and v (GPT-2's: views of the qkv output; grouped-query attention repeats k and v to
    # the q heads before the kernel); selective recomputation's checkpoint keeps its inputs, k and v as
    # the kv heads give them, and so does cp's attention Function (it repeats them per block, transiently)
    cp = sharding.cp > 1
    kv = kv_local_heads(model, tp) * model.head_dim
    Q = N // model.n_embd * model.attention_width  # q and the attention output: n_embd wide unless head_size is set
    attention_inputs = Q // tp + (2 * b * s * kv if recompute == "selective" or cp else 2 * Q // tp)
    # Megatron-Core's `--recompute-modules layernorm moe_act` (norm-act): the norms' outputs (the column-parallel
    # linears' inputs) and the MLP's SiLU output and product are recomputed in the backward, not kept
    norm_act = recompute == "norm-act"
    layer = (2 * Ns * r  # ln1, ln2 inputs
             + 2 * norm_stats  # their statistics
             + (0 if norm_act else _linear_inputs(model, precision, sp) * N * c)  # the column-parallel linears' inputs
             + attention_inputs * c  # q and k (after rotation), v
             + Q // tp * c  # the attention output = the proj input
             + (arch.mlp_saved - (2 if norm_act else 0)) * b * s * (F // tp) * c  # the MLP's intermediates
             + (_moe_dispatched(model, b, sharding, precision) if moe else 0))  # its rows, experts' outputs
    if sharding.cp == KEEP_PEER_CP:
        layer += 2 * b * s * kv * c  # the peer's K/V block, for the backward
    if arch.rotary and (c != 4 or cp):  # cp: cos and sin indexed at the rank's positions, per call, any dtype
        layer += 4 * s * model.head_dim * c  # rotary cos and sin cast to q's and k's dtype, per call
    if precision == "bf16":
        layer += _block_weights(model, tp) * 2  # each microbatch's bf16 casts of the block's weights
        layer += _moe_weight_casts(model, sharding) * 2 if moe else 0
    if math_attention:
        if recompute != "selective":  # softmax output, its dropout mask, the dropout output
            layer += 3 * b * (a // tp) * s * s * c
    elif recompute != "selective" or cp:  # selective never checkpoints cp's attention, which keeps it
        layer += b * (a // tp) * s * r  # SDPA's (or cp's attention Function's, fp32 or fp64) logsumexp
    if drop:
        layer += 2 * Ns * mask_c  # the attention and MLP residual dropouts' masks
    return layer


@functools.lru_cache(maxsize=8192)
def _activation_bytes(model, mix, b, sharding: Sharding, recompute, precision, embed, head, device) -> int:
    _check(model, sharding, recompute, device, b)
    r, c, s, N, Ns, bs, norm_stats = _locals(model, b, sharding, precision, device)
    h, V, Vp, tp = model.n_embd, model.vocab_size, model.padded_vocab_size, sharding.tp
    drop, arch = model.dropout > 0, model.architecture
    mask_r = 1 if device == "cuda" else r
    total = 0
    for kind, n in mix:  # each kind's blocks at its block model
        total += n * _layer_bytes(kind.block_model(model), b, sharding, recompute, precision, device, kind is MOE)
    if embed:
        # tokens (Stage.inputs), wpe's positions (made per call; with cp a rank's are cached, a per-rank constant)
        total += bs * INT64 + (0 if arch.rotary or sharding.cp > 1 else s * INT64)
        if tp > 1:
            total += bs * INT64 + bs * BOOL  # the vocabulary shard's local ids and outside-mask
        if drop:
            total += Ns * mask_r  # the embedding dropout's mask
    if head:
        total += Ns * r + norm_stats  # ln_f input, its statistics
        total += N * c  # lm_head input (ln_f output; gathered with SP; the bf16 cast)
        if precision == "bf16":
            total += Vp // tp * h * 2  # the bf16 cast of lm_head's weight
        if tp == 1:
            total += bs * V * r + bs * INT64 + 3 * r  # log-softmax, targets, total_weight and the losses
        else:
            total += bs * (Vp // tp) * r + bs * INT64 + 2 * bs * BOOL + INT64 + 2 * r
    return total


def _routed(model: ModelConfig, b: int, sharding: Sharding) -> int:
    """Assignments an MoE block of b sequences computes on a rank, the load balanced: the tokens it routes (its
    sequence-parallel share: pipegpt.model.moe routes each tp rank's) times top-k (0 for a dense block)."""
    return sharding.tokens_per_rank(model.seq_len, b) * model.experts_per_token if model.n_experts else 0


def _moe_dispatched(model: ModelConfig, b: int, sharding: Sharding, precision: str) -> int:
    """What an MoE block keeps beyond its dense-equivalent block (a SwiGLU as wide as a token's active experts,
    pipegpt.arch), as pipegpt.model.moe saves it: three n_embd-wide rows per assignment in the compute dtype (the
    dispatched rows its grouped matmuls read, cast once; the experts' outputs, which the weighting reads; the
    weighted outputs, which index_add_ keeps for its backward), and the routing in fp32: the scores (E per token),
    the chosen experts and their sort (int64), the weights, their sum and the keep mask (33 bytes per assignment
    and 4 per token). On CPU in fp32 this is what the saved-tensor hooks see (tests/unit/test_plan_moe_terms.py);
    the loop over experts that stands in for the grouped matmul elsewhere casts a row once per linear."""
    _, c = _widths(precision)
    m, n = _routed(model, b, sharding), sharding.tokens_per_rank(model.seq_len, b)
    return 3 * m * model.n_embd * c + n * (model.n_experts * FP32_BYTES + 4) + 33 * m


def _moe_checkpointed(model: ModelConfig, b: int, sharding: Sharding, precision: str) -> int:
    """What full recomputation keeps of an MoE block beyond its input where ep > 1: pipegpt.model.moe.block_steps
    checkpoints the parts between the all-to-alls apart (the all-to-alls are not repeated), so the received rows
    and the experts' combined outputs (both in the compute dtype, as the all-to-alls send them), their weights and
    the residual stream past the attention stay too."""
    if not model.n_experts or "ep" not in sharding.axis_names or sharding.size("ep") == 1:
        return 0
    r, c = _widths(precision)
    m = _routed(model, b, sharding)
    return m * model.n_embd * 2 * c + m * r + sharding.tokens_per_rank(model.seq_len, b) * model.n_embd * r


def _moe_weight_casts(model: ModelConfig, sharding: Sharding) -> int:
    """Elements of an MoE block's bf16 weight casts per call beyond its dense-equivalent's MLP: each call casts the
    router and the shared experts and saves the casts for its backward, where the dense-equivalent counts an MLP as
    wide as a token's active experts cut over tp (negative where that is the larger). The rank's E/ep routed
    experts are cast once per step and shared by every call: pipegpt.costs.memory counts that copy once."""
    if not model.n_experts:
        return 0
    C, H = model.n_embd, model.expert_width
    active = 3 * (model.ffn_width // sharding.tp) * C  # what _block_weights counted for the MLP
    shared = 3 * model.n_shared_experts * H * C
    return model.n_experts * C + shared - active


def _linear_inputs(model: ModelConfig, precision: str, sp: bool) -> int:
    """The inputs the block's column-parallel linears (attention's on ln1's output, the MLP's on ln2's) keep:
    the two norm outputs, shared; or, where each linear makes its own (autocast's bf16 cast, sequence
    parallelism's all-gather), one each (GPT-2's qkv and fc: two; Llama's q, k, v, gate, up: five)."""
    return sum(lin.split != ROW for lin in block_linears(model)) if precision == "bf16" or sp else 2


def _block_weights(model: ModelConfig, tp: int) -> int:
    """Elements of one block's weight matrices on one tp rank (Llama: k and v per local kv head)."""
    return sum(lin.rows * lin.cols for lin in block_linears(model, tp))


def activation_bytes(model: ModelConfig, layers, *, microbatch_size: int, sharding: Sharding = Sharding(),
                     recompute: str = "none", precision: str = "fp32", embed: bool = False, head: bool = False,
                     device: str = "cuda") -> int:
    """Bytes one stage (layers: a count or a range, a range where the model's layers differ; embed: it is the
    first, head: the last) keeps per
    microbatch in flight, from the end of its forward to its backward (B or I). `device` matters only
    with dropout > 0 (see the module docstring for every term)."""
    return _activation_bytes(model, _mix(model, layers), microbatch_size, sharding, recompute, precision,
                             bool(embed), bool(head), device)


def _deferred_layer(model, b, sharding: Sharding, precision) -> int:
    """What one block (at its kind's block model) keeps between its I and its W."""
    _, c = _widths(precision)
    s, h = model.seq_len // sharding.cp, model.n_embd
    tp, sp = sharding.tp, sharding.splits_sequence
    N, Ns = b * s * h, sharding.tokens_per_rank(model.seq_len, b) * h
    # each linear's input and output gradient: the column-parallel ones' inputs (the norms' outputs, shared or
    # each its own) and outputs (kv heads wide for k and v), the row-parallel ones' (rank-wide) inputs and outputs
    widths = sum(lin.cols + lin.rows if lin.split == ROW else lin.rows for lin in block_linears(model, tp))
    layer = (_linear_inputs(model, precision, sp) * N + b * s * widths) * c
    if sp and model.bias:
        layer += 2 * Ns * c  # the row-parallel biases' gradients (after the reduce-scatter)
    return layer


@functools.lru_cache(maxsize=8192)
def _deferred_bytes(model, mix, b, sharding: Sharding, precision, embed, head) -> int:
    r, c = _widths(precision)
    s, h, Vp, tp = model.seq_len // sharding.cp, model.n_embd, model.padded_vocab_size, sharding.tp
    N, Ns = b * s * h, sharding.tokens_per_rank(model.seq_len, b) * h
    total = sum(n * _deferred_layer(kind.block_model(model), b, sharding, precision) for kind, n in mix)
    if head:
        total += N * c + b * s * (Vp // tp) * c  # lm_head's input and the logits' gradient
    if not embed:
        total += 2 * Ns * r  # the stage input and its gradient, reachable from the W closures
    return total


def deferred_bytes(model: ModelConfig, layers, *, microbatch_size: int, sharding: Sharding = Sharding(),
                   precision: str = "fp32", embed: bool = False, head: bool = False) -> int:
    """Bytes a stage keeps per microbatch between its I (input-gradient half of the backward) and its
    W (the deferred weight gradients), whatever the recomputation (see the module docstring)."""
    _check_tp(model, sharding.tp, sharding.sequence_parallel)
    return _deferred_bytes(model, _mix(model, layers), microbatch_size, sharding, precision, bool(embed), bool(head))


def stage_activation_bytes(model: ModelConfig, layers_per_stage: Sequence, **kwargs) -> tuple[tuple, tuple, tuple]:
    """(saved, deferred, workspace): activation_bytes, deferred_bytes and workspace_bytes of every
    stage of a split (counts or ranges; stage 0 holds the embedding, the last the head), for
    Costs(activation_bytes=saved) and activation_peaks. kwargs: those of activation_bytes, without
    layers, embed and head; and workspace_bytes' cp_comm."""
    last = len(layers_per_stage) - 1
    layers_per_stage = stage_ranges(layers_per_stage)  # which layers: their kinds count
    cp_comm = kwargs.pop("cp_comm", "ring")
    deferred_kwargs = {k: v for k, v in kwargs.items() if k not in ("recompute", "device")}
    saved = tuple(activation_bytes(model, n, embed=s == 0, head=s == last, **kwargs)
                  for s, n in enumerate(layers_per_stage))
    deferred = tuple(deferred_bytes(model, n, embed=s == 0, head=s == last, **deferred_kwargs)
                     for s, n in enumerate(layers_per_stage))
    workspace = tuple(workspace_bytes(model, n, embed=s == 0, head=s == last, cp_comm=cp_comm, **kwargs)
                      for s, n in enumerate(layers_per_stage))
    return saved, deferred, workspace


@dataclass(frozen=True)
class Workspace:
    """Transient bytes of one stage's actions beyond what they leave held (see activation_peaks)."""

    forward: int  # on top of the level after the F
    backward: int  # B or I: on top of the level before it (an I: the larger of before and after)
    tail: int  # the end of a B or I: on top of the level after it (the embedding's dense gradient)
    weight: int  # a W, or the weight gradients of a B: on top of the level before it


def _block_workspace(model, b, sharding: Sharding, recompute, precision, device, cp_comm,
                     moe: bool = False) -> tuple[int, int, int]:
    """One block's (at its kind's block model) forward, backward and weight transients."""
    r, c = _widths(precision)
    tp, cp = sharding.tp, sharding.cp
    s, h, a = model.seq_len // cp, model.n_embd, model.n_head
    N = b * s * h  # a hidden state (gathered)
    # forward: the block's temporaries; under full recomputation nothing is kept, so fc and GeLU
    # outputs are transient too. backward: the gradients of about one block; under full
    # recomputation that block's recomputed activations as well.
    F = model.ffn_width
    mlp = model.architecture.mlp_saved * b * s * (F // tp) * c  # the MLP's intermediates
    forward = mlp + 2 * N * r if recompute == "full" else 2 * N * r
    backward = model.architecture.mlp_matrices * b * s * F * r
    if recompute == "full":
        backward += _layer_bytes(model, b, sharding, "none", precision, device, moe)
    elif recompute == "norm-act":  # the recomputed norm outputs and SiLU output and product
        backward += _layer_bytes(model, b, sharding, "none", precision, device, moe) - _layer_bytes(
            model, b, sharding, recompute, precision, device, moe)
    if model.dropout > 0 and device == "cpu":  # SDPA's math path: the s^2 gradients
        backward += 2 * b * (a // tp) * s * s * r
        if recompute == "selective":  # and the recomputed softmax, mask and dropout output
            backward += 3 * b * (a // tp) * s * s * c
    if cp > 1:  # K/V blocks in flight (see the module docstring)
        kv_block = b * s * 2 * kv_local_heads(model, tp) * model.head_dim * c
        kept = cp == KEEP_PEER_CP  # the peer's block stays after the forward (held) and never travels back
        forward += kv_block * (cp if cp_comm == "allgather" else 1 if kept else 2)
        backward += kv_block * ((2 * cp - 1 if kept else 2 * cp) if cp_comm == "allgather" else 2 if kept else 4)
    widest = F * h // tp
    return forward, backward, widest * (r + (2 if precision == "bf16" else 0))  # the largest weight's gradient


@functools.lru_cache(maxsize=8192)
def _workspace(model, mix, b, sharding: Sharding, recompute, precision, embed, head, device,
               cp_comm="ring") -> Workspace:
    r, c = _widths(precision)
    tp, cp = sharding.tp, sharding.cp
    s, h, Vp = model.seq_len // cp, model.n_embd, model.padded_vocab_size
    L = b * s * (Vp // tp) * r  # the logits in the loss's dtype
    forward = backward = weight = 0
    for kind, _ in mix:  # the largest block of the slice's kinds
        f, bw, w = _block_workspace(kind.block_model(model), b, sharding, recompute, precision, device, cp_comm,
                                    kind is MOE)
        forward, backward, weight = max(forward, f), max(backward, bw), max(weight, w)
    if head:
        # forward: the logits (and their fp32 copy under bf16) next to the saved softmax; backward:
        # the logits' gradient and its padded (tp=1) or bf16 (tp>1) copy; the head weight's gradient
        forward = max(forward, L // r * c + (L if precision == "bf16" else 0))
        head_weight = Vp // tp * h * (r + (2 if precision == "bf16" else 0))
        copies = 2.5 if precision == "bf16" and tp > 1 else 2
        backward = max(backward, int(copies * L), L + head_weight)
        weight = max(weight, head_weight)
    tail = Vp // tp * h * r if embed else 0  # the embedding's dense weight gradient
    return Workspace(forward, backward, tail, weight)


def workspace_bytes(model: ModelConfig, layers, *, microbatch_size: int, sharding: Sharding = Sharding(),
                    recompute: str = "none", precision: str = "fp32", embed: bool = False, head: bool = False,
                    device: str = "cuda", cp_comm: str = "ring") -> Workspace:
    """An estimate of the transient memory of one stage's actions (arguments as activation_bytes):
    the blocks' temporaries and gradients, a full recomputation's block, the logits and their
    gradient, the weight gradients before they accumulate, context parallelism's K/V blocks in flight
    (cp_comm: ring or allgather). Checked as a bound of the replay's per-op peak, not exact."""
    _check(model, sharding, recompute, device, microbatch_size)
    return _workspace(model, _mix(model, layers), microbatch_size, sharding, recompute, precision, bool(embed),
                      bool(head), device, cp_comm)


def activation_peaks(plan: Plan, saved: Sequence[int], deferred: Sequence[int] | None = None,
                     workspace: Sequence[Workspace] | None = None) -> list[tuple[int, int]]:
    """(held, working) peak bytes of each rank over the plan's step.

    held: a stage-microbatch holds saved[stage] from its F to the end of its backward (B), or to the
    end of its I and then deferred[stage] until the end of its W. A rank's level changes only at its
    own actions, so its peak depends on its action order alone, not on timing: without I/W it equals
    simulate(plan, Costs(..., activation_bytes=saved)).peak_activation_bytes_per_rank.
    working: the same walk plus each action's transient (workspace[stage], see Workspace); equal to
    held when no workspace is given.
    """
    deferred = saved if deferred is None else deferred
    peaks = []
    for actions in plan.flattened().ranks:  # a pair's halves in order: its F counts before its B frees
        level = held = working = 0
        for a in actions:
            kind, s = a.kind, a.stage
            before = level
            if kind is Kind.F:
                level += saved[s]
            elif kind is Kind.B:
                level -= saved[s]
            elif kind is Kind.I:
                level += deferred[s] - saved[s]
            elif kind is Kind.W:
                level -= deferred[s]
            else:
                continue
            held = max(held, level)
            if workspace is None:
                continue
            ws = workspace[s]
            if kind is Kind.F:
                top = level + ws.forward
            elif kind is Kind.W:
                top = before + ws.weight
            else:
                top = max(max(before, level) + ws.backward, level + ws.tail)
                if kind is Kind.B:
                    top = max(top, before + ws.weight)
            working = max(working, top)
        peaks.append((held, max(held, working)))
    return peaks


def peak_activation_bytes(plan: Plan, saved: Sequence[int], deferred: Sequence[int] | None = None) -> list[int]:
    """Each rank's peak of held activation bytes (activation_peaks' held)."""
    return [held for held, _ in activation_peaks(plan, saved, deferred)]
