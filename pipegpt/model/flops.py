"""Training FLOPs per token of a model shape (torch-free: the planner and the run's MFU both count them)."""
from __future__ import annotations

from pipegpt.config import ModelConfig


def matmul_parameters(model: ModelConfig) -> int:
    """N of nanoGPT's FLOPs estimate: every parameter but the position embedding, the LM head (the padded
    vocabulary's rows) counted once, tied or not (an untied token embedding is a lookup, not a matmul)."""
    C, L, V = model.n_embd, model.n_layer, model.padded_vocab_size
    norm = 2 * C if model.bias else C  # a LayerNorm's gain (and bias)
    biases = 3 * C + C + 4 * C + C if model.bias else 0  # qkv, attention proj, fc, mlp proj
    block = 2 * norm + 12 * C * C + biases
    return L * block + norm + V * C


def flops_per_token(model: ModelConfig) -> int:
    """Training FLOPs per token as nanoGPT (PaLM appendix B) counts them: 6N for the forward and backward
    matmuls of N parameters, plus 12*L*H*Q*T for attention's scores and weighted sum over T positions
    (H heads of dimension Q). Recomputation is not counted: MFU counts the model's FLOPs, not the hardware's."""
    return 6 * matmul_parameters(model) + 12 * model.n_layer * model.n_head * model.head_dim * model.seq_len
