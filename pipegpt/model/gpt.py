"""A nanoGPT-style GPT-2 whose blocks can be sliced into pipeline stages.

The module knows nothing of processes. `GPT(config)` is the whole model;
`GPT(config, layers=range(2, 4), embed=False, head=True)` is one stage of it.
Every parameter keeps its one-process name whichever slice holds it
(`wte.weight`, `blocks.3.attn.qkv.weight`, `ln_f.weight`, `lm_head.weight`).

Initial values: each parameter is drawn from its own generator seeded by
(init_seed, its one-process name), so a slice built with the same init_seed
(or right after the same torch.manual_seed) holds exactly the values of the
full model's corresponding parameters, without building the full model.
To load existing weights into a slice use `GPT.load_from_full(full_sd)` (or
`load_state_dict(slice_state_dict(full_sd, ...))`).

Tied embeddings: in a slice holding both the embedding and the head,
`lm_head.weight` IS `wte.weight`. A slice holding the head but not the
embedding owns its own `lm_head.weight`, a copy of `wte.weight`;
`tied_parameter_names()` tells the runtime which local parameter belongs to
the tied group so it can sum the group's gradients across stages.

Split backward (zero-bubble I and W): every Linear in the blocks and the head
is a SplitLinear, so a backward inside `defer_weight_grads()` leaves their
weight/bias gradients for later. That machinery lives in pipegpt.model.split_backward;
this module holds the model only.
"""
from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipegpt.config import ConfigError, ModelConfig
from pipegpt.model.split_backward import SplitLinear

RECOMPUTE_MODES = ("none", "full", "selective")
TIED_NAME = "wte.weight"  # the one-process name of the tied embedding/head weight

# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------
def _causal_sdpa(q, k, v, dropout_p: float):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, selective: bool):
        super().__init__()
        self.n_head, self.dropout, self.selective = config.n_head, config.dropout, selective
        self.qkv = SplitLinear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = SplitLinear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x):
        # Widths come from qkv's output, not x: a tensor-parallel shard holds n_head/tp heads
        # (self.n_head is per instance) and may see a longer (sequence-gathered) input.
        qkv = self.qkv(x)
        B, T, W = qkv.shape
        q, k, v = (t.view(B, T, self.n_head, W // (3 * self.n_head)).transpose(1, 2)
                   for t in qkv.split(W // 3, dim=2))
        p = self.dropout if self.training else 0.0
        if self.selective and torch.is_grad_enabled():
            y = checkpoint(_causal_sdpa, q, k, v, p, use_reentrant=False)
        else:
            y = _causal_sdpa(q, k, v, p)
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, W // 3)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = SplitLinear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = SplitLinear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, selective: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, selective)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def head_output(logits: torch.Tensor, targets: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """What the head returns from its logits: without targets the logits of the real vocabulary
    (padded columns dropped, they are never predicted), with targets the mean cross-entropy
    ignoring targets == -1. GPT.head_output is this, per instance, so tensor parallelism can put
    a vocabulary-parallel version in its place."""
    if logits.size(-1) != vocab_size:
        logits = logits[..., :vocab_size]
    if targets is None:
        return logits
    return F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=-1)


def slice_state_dict(full_state_dict: dict, layers: range, embed: bool, head: bool, tie: bool) -> dict:
    """The entries of a full model's state dict that the slice (layers, embed, head) holds,
    under their one-process names. With tying, `lm_head.weight` comes from `wte.weight`."""
    prefixes = tuple(f"blocks.{i}." for i in layers)
    out = {k: v for k, v in full_state_dict.items() if k.startswith(prefixes)}
    if embed:
        out.update({k: full_state_dict[k] for k in ("wte.weight", "wpe.weight")})
    if head:
        out.update({k: v for k, v in full_state_dict.items() if k.startswith("ln_f.")})
        out["lm_head.weight"] = full_state_dict[TIED_NAME if tie else "lm_head.weight"]
    return out


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, layers: range | None = None, embed: bool = True,
                 head: bool = True, recompute: str = "none", init_seed: int | None = None):
        super().__init__()
        if init_seed is None:  # drawn first: deterministic given torch.manual_seed, same for every slice
            init_seed = int(torch.randint(0, 2**62, (1,)).item())
        config.validate()
        layers = range(config.n_layer) if layers is None else layers
        if not (isinstance(layers, range) and layers.step == 1 and 0 <= layers.start <= layers.stop <= config.n_layer):
            raise ConfigError(f"layers={layers!r} must be a range(start, stop) with "
                              f"0 <= start <= stop <= n_layer={config.n_layer}")
        if not (len(layers) or embed or head):
            raise ConfigError("a model slice must hold at least one block, the embedding or the head")
        if recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute={recompute!r} is not valid: use one of {', '.join(RECOMPUTE_MODES)}")
        self.config, self.layers, self.embed, self.head, self.recompute = config, layers, embed, head, recompute
        V, C = config.padded_vocab_size, config.n_embd
        if embed:
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(config.seq_len, C)
            self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(config, recompute == "selective") for i in layers})
        if head:
            self.ln_f = nn.LayerNorm(C, bias=config.bias)
            self.lm_head = SplitLinear(C, V, bias=False)
            if embed and config.tie_embeddings:
                self.lm_head.weight = self.wte.weight
            self.head_output = functools.partial(head_output, vocab_size=config.vocab_size)
        self.init_weights(init_seed)

    def tied_parameter_names(self) -> dict[str, str]:
        """{local name: one-process name} of this slice's parameters in the tied group whose
        copies live on other slices (their grads must be summed across those slices before the
        optimizer step). Empty when untied or when this slice holds both embedding and head."""
        if not self.config.tie_embeddings or self.embed == self.head:
            return {}
        return {"wte.weight": TIED_NAME} if self.embed else {"lm_head.weight": TIED_NAME}

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init; each parameter from a generator seeded by (seed, one-process name)."""
        tied = self.tied_parameter_names()
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if ".ln" in "." + name:  # LayerNorm: ln1, ln2, ln_f
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            if name.endswith("bias"):
                p.zero_()
                continue
            std = resid_std if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else 0.02
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(tied.get(name, name).encode())) % 2**63)
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))

    def load_from_full(self, full_state_dict: dict, strict: bool = True):
        """Load this slice's entries of a full model's state dict (see slice_state_dict)."""
        sd = slice_state_dict(full_state_dict, self.layers, self.embed, self.head, self.config.tie_embeddings)
        return self.load_state_dict(sd, strict=strict)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed:
            T = x.size(1)
            if T > self.config.seq_len:
                raise ValueError(f"sequence length {T} exceeds seq_len={self.config.seq_len}")
            pos = torch.arange(T, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            if self.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if not self.head:
            return x
        return self.head_output(self.lm_head(self.ln_f(x)), targets)


def build_reference_model(config: ModelConfig, seed: int, recompute: str = "none") -> GPT:
    """The whole model in one process: the correctness oracle. Seeds torch (dropout) too;
    GPT(config, layers=..., init_seed=seed) slices get exactly the same initial values."""
    torch.manual_seed(seed)
    return GPT(config, recompute=recompute, init_seed=seed)
