"""Training FLOPs per token of a model shape (torch-free: the planner and the run's MFU both count them).

The parameters counted are pipegpt.arch's description of each architecture; for the two there are,
C = n_embd, F = ffn_width, Q = head_dim, A = n_head x Q (C unless head_size is set), K = kv_heads x Q:

    gpt2   block: ln1, ln2 (LayerNorm gain and bias: 2C each, C without bias), attn.qkv 3C x C, attn.proj C x C,
           mlp.fc F x C, mlp.proj C x F (+ biases 3C, C, F, C); embedding wte + wpe (lookups); ln_f, lm_head
    llama  block: ln1, ln2 (RMSNorm gain: C each), attn.q A x C, attn.k and attn.v K x C each (grouped-query
           attention: K < C when n_kv_head < n_head), attn.proj C x A, the q/k norms' gains (qk_norm), SwiGLU's
           mlp.gate and mlp.up F x C and mlp.proj C x F (+ q/k/v biases A + 2K with qkv_bias, the other biases
           with bias); embedding wte only
           (rotary positions have no parameters); ln_f (RMSNorm), lm_head
"""
from __future__ import annotations

import math

from pipegpt.arch import DENSE, MOE, LayerKind, block_linears, block_shapes, head_shapes, layer_kinds
from pipegpt.config import ModelConfig


def block_matmul_weights(model: ModelConfig, kind: LayerKind = DENSE) -> int:
    """Elements of one block's weight matrices (the FLOPs of its matmuls are 2 x this per token forward)."""
    return sum(lin.rows * lin.cols for lin in block_linears(model, 1, kind))


def block_parameters(model: ModelConfig, kind: LayerKind = DENSE) -> int:
    """Parameters of one block: its weight matrices, norms and biases."""
    return sum(math.prod(shape) for _, shape in block_shapes(model, 1, kind))


def matmul_parameters(model: ModelConfig) -> int:
    """N of nanoGPT's FLOPs estimate: every parameter but the position embedding, the LM head (the padded
    vocabulary's rows) counted once, tied or not (an untied token embedding is a lookup, not a matmul)."""
    C, V = model.n_embd, model.padded_vocab_size
    norm = sum(math.prod(shape) for _, shape in head_shapes(model, lm_head=False))  # ln_f
    kinds = layer_kinds(model)
    return sum(kinds.count(kind) * active_block_parameters(model, kind) for kind in dict.fromkeys(kinds)) + norm + V * C


def active_block_parameters(model: ModelConfig, kind: LayerKind = DENSE) -> int:
    """The parameters a token meets in one block: all of them, but of an MoE block's experts only its top-k
    and the shared ones (a dense block as wide as those, and the router)."""
    if kind is not MOE:
        return block_parameters(model, kind)
    dense = kind.block_model(model)
    # experts have no biases (pipegpt.model.moe): the dense MLP's, with bias (GPT-2's), are not met
    biases = sum(lin.rows for lin in block_linears(dense) if lin.bias and lin.name.startswith("mlp."))
    return block_parameters(dense) + model.n_experts * model.n_embd - biases


def flops_per_token(model: ModelConfig) -> int:
    """Training FLOPs per token as nanoGPT (PaLM appendix B) counts them: 6N for the forward and backward
    matmuls of N parameters, plus 12*L*H*Q*T for attention's scores and weighted sum over T positions
    (H heads of dimension Q: every query head, grouped-query attention or not). Recomputation is not
    counted: MFU counts the model's FLOPs, not the hardware's. Llama's smaller K/V projections, its three
    SwiGLU matrices and its missing position embedding enter through N; norms, rotary and SiLU are
    elementwise (their parameters are in N, as nanoGPT counts LayerNorm's)."""
    kinds = layer_kinds(model)
    heads = sum(kinds.count(kind) * kind.block_model(model).attention_width for kind in dict.fromkeys(kinds))
    return 6 * matmul_parameters(model) + 12 * heads * model.seq_len
