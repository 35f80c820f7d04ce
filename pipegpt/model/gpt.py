"""A nanoGPT-style GPT whose blocks can be sliced into pipeline stages: GPT-2 or Llama.

The module knows nothing of processes. `GPT(config)` is the whole model;
`GPT(config, layers=range(2, 4), embed=False, head=True)` is one stage of it.
Every parameter keeps its one-process name whichever slice holds it
(`wte.weight`, `blocks.3.attn.qkv.weight`, `ln_f.weight`, `lm_head.weight`).

One block structure whose parts follow the architecture's description (pipegpt.arch: its norm, positions,
MLP, fused or separate q/k/v):
    gpt2   wte + wpe; LayerNorm ln1/ln2/ln_f; attn.qkv (q, k, v stacked) and attn.proj; mlp.fc, GELU, mlp.proj
    llama  wte only (rotary positions, Hugging Face's rotate-half form, so its weights load unchanged);
           RMSNorm ln1/ln2/ln_f; attn.q, attn.k, attn.v (k and v with n_kv_head heads: grouped-query
           attention), attn.proj; optional attn.q_norm and attn.k_norm (qk_norm: RMSNorm of each head or of
           the whole projection, before rotary); SwiGLU mlp.proj(silu(mlp.gate(x)) * mlp.up(x)); no biases
           but optional q/k/v ones (qkv_bias)

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

import contextlib
import functools
import math
import zlib
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipegpt.arch import MOE, layer_kinds
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.model.moe import MoE
from pipegpt.model.split_backward import SplitLinear

RECOMPUTE_MODES = ("none", "full", "selective")
TIED_NAME = "wte.weight"  # the one-process name of the tied embedding/head weight

# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------
def _causal_sdpa(q, k, v, dropout_p: float, offset: int = 0, documents: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None):
    """Causal attention of q's positions offset.. over k's 0..: offset > 0 when earlier keys are cached.
    documents [B, T]: each token's document (where it starts); a token then attends within its own only.
    mask [B, 1, T, S]: which keys each query sees, given whole (a KVCache of left-padded prompts)."""
    if k.size(1) != q.size(1):  # grouped-query attention: each kv head serves n_head/n_kv_head q heads
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if documents is not None:
        T = q.size(2)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal & (documents[:, :, None] == documents[:, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout_p)
    if offset == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    T, S = q.size(2), k.size(2)
    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class Documents(NamedTuple):
    """Where packed documents lie in a microbatch's sequences: `starts` [B, T] holds, per token, the position
    where its document starts (so two tokens share a document when their starts are equal, and a token's place in
    its document is its position less its start); `reset_positions`: positions restart at each document."""

    starts: torch.Tensor
    reset_positions: bool = False


@functools.lru_cache(maxsize=16)
def _rope_table(head_dim: int, length: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] of the rotary angles, fp32, as Hugging Face's Llama computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(length, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, theta: float, offset: int = 0, positions: torch.Tensor | None = None,
               table_length: int | None = None) -> torch.Tensor:
    """x [B, heads, T, head_dim] rotated by positions offset..offset+T (the rotate-half form), or by `positions`
    ([T] or [B, T]: context parallelism's chunks, positions restarting at each document) below table_length."""
    T, hd = x.size(2), x.size(3)
    if positions is None:
        cos, sin = (t[offset:offset + T].to(x.dtype) for t in _rope_table(hd, offset + T, float(theta), x.device))
    else:
        cos, sin = (t[positions].to(x.dtype) for t in _rope_table(hd, table_length, float(theta), x.device))
        if positions.dim() == 2:  # per sequence: [B, 1, T, hd] over the heads
            cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def token_positions(length: int, context_parallel, documents: Documents | None, device) -> torch.Tensor | None:
    """The positions of a slice's `length` tokens when they are not 0..length-1: a context-parallel rank's chunks
    (context_parallel.positions), less each document's start where positions restart; None otherwise."""
    positions = None if context_parallel is None else context_parallel.positions(length, device)
    if documents is not None and documents.reset_positions:
        base = torch.arange(length, device=device) if positions is None else positions
        positions = base - documents.starts
    return positions


class KVCache:
    """Keys and values of the positions seen so far, per block, for sampling one token at a time.

    pads: for a batch of prompts of different lengths, left-padded to the longest, each row's padding. A row's
    positions then start after its padding and its queries never see a padding key, so every row computes what
    it would alone; all rows stay at one cache index, so a decoding step appends one column for all of them."""

    def __init__(self, pads: list[int] | None = None):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0  # cache index of the next token (its position without padding); GPT.forward advances it
        self.pads = pads if pads and any(pads) else None
        self.least_pad = min(pads) if self.pads else 0
        self._pads: torch.Tensor | None = None
        self._mask: tuple | None = None  # (length, T, mask) of the forward in progress: its blocks share it

    def _pad_tensor(self, device) -> torch.Tensor:
        if self._pads is None:
            self._pads = torch.tensor(self.pads, device=device)
        return self._pads

    def positions(self, T: int, device) -> torch.Tensor | None:
        """Each row's positions of the next T tokens [B, T] (padding at 0); None without padding (every row's
        are length..length+T-1)."""
        if self.pads is None:
            return None
        at = self.length + torch.arange(T, device=device)
        return (at[None, :] - self._pad_tensor(device)[:, None]).clamp_min(0)

    def mask(self, T: int, device) -> torch.Tensor | None:
        """Which keys (cached and new) each of the next T queries sees [B, 1, T, length + T]: the causal ones that
        are not padding, and a padding query its own key (so none is left with nothing); None without padding."""
        if self.pads is None:
            return None
        if self._mask is not None and self._mask[:2] == (self.length, T):
            return self._mask[2]
        keys, queries = torch.arange(self.length + T, device=device), self.length + torch.arange(T, device=device)
        causal, own = keys[None, :] <= queries[:, None], keys[None, :] == queries[:, None]
        real = keys[None, :] >= self._pad_tensor(device)[:, None]
        mask = ((causal[None] & real[:, None, :]) | own[None])[:, None]
        self._mask = (self.length, T, mask)
        return mask

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k, v = torch.cat((self.keys[layer], k), dim=2), torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, selective: bool, layer: int = 0):
        super().__init__()
        # n_head and n_kv_head are per instance: a tensor-parallel shard holds n_head/tp of them.
        self.n_head, self.n_kv_head, self.layer = config.n_head, config.kv_heads, layer
        self.dropout, self.selective = config.dropout, selective
        self.max_positions = config.seq_len
        # Set by pipegpt.context_parallel.shard_for_cp: this rank's place in the sequence and attention over the
        # cp group (positions(length, device), attend(q, k, v, document starts)).
        self.context_parallel = None
        arch = config.architecture
        self.rope_theta = config.rope_theta if arch.rotary else None
        self.fused_qkv = arch.fused_qkv
        C, hd = config.n_embd, config.head_dim
        qkv_bias = config.qkv_bias if arch.own_qkv_bias else config.bias
        if arch.fused_qkv:
            self.qkv = SplitLinear(C, 3 * C, bias=qkv_bias)
        else:
            self.q = SplitLinear(C, self.n_head * hd, bias=qkv_bias)
            self.k = SplitLinear(C, self.n_kv_head * hd, bias=qkv_bias)
            self.v = SplitLinear(C, self.n_kv_head * hd, bias=qkv_bias)
        self.proj = SplitLinear(self.n_head * hd, C, bias=config.bias)
        # q/k RMSNorm before rotary: over each head (Qwen3) or the whole projection (OLMoE)
        self.qk_norm = config.qk_norm
        if self.qk_norm != "none":
            widths = (hd, hd) if self.qk_norm == "head" else (self.n_head * hd, self.n_kv_head * hd)
            self.q_norm, self.k_norm = (nn.RMSNorm(w, eps=config.norm_eps) for w in widths)
        self.resid_drop = nn.Dropout(config.dropout)
        # tensor parallelism: a context for this rank's own dropout masks over its heads (tensor_parallel.rng)
        self.core_rng = None

    def _heads(self, x):
        """q [B, n_head, T, hd], k and v [B, n_kv_head, T, hd]. Widths come from the projections' outputs,
        not x: a tensor-parallel shard may see a longer (sequence-gathered) input."""
        if self.fused_qkv:
            q, k, v = self.qkv(x).chunk(3, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        B, T, W = q.shape
        hd = W // self.n_head
        q, k, v = q.view(B, T, self.n_head, hd), k.view(B, T, self.n_kv_head, hd), v.view(B, T, self.n_kv_head, hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, cache: KVCache | None = None, documents: Documents | None = None):
        q, k, v = self._heads(x)
        offset = cache.length if cache is not None else 0
        cp = self.context_parallel
        if self.rope_theta is not None:
            positions = token_positions(q.size(2), cp, documents, q.device)
            if positions is None and cache is not None:
                positions = cache.positions(q.size(2), q.device)
            q, k = (apply_rope(t, self.rope_theta, offset, positions, self.max_positions) for t in (q, k))
        mask = None
        if cache is not None:
            mask = cache.mask(q.size(2), q.device)
            k, v = cache.extend(self.layer, k, v)
        p = self.dropout if self.training else 0.0
        starts = None if documents is None else documents.starts
        if cp is not None:  # its Function keeps only q, k, v, the output and their log-sum-exp: nothing to recompute
            y = cp.attend(q, k, v, starts)
        else:
            with self.core_rng(q.device) if p and self.core_rng else contextlib.nullcontext():
                if self.selective and torch.is_grad_enabled():
                    y = checkpoint(_causal_sdpa, q, k, v, p, offset, starts, use_reentrant=False)
                else:
                    y = _causal_sdpa(q, k, v, p, offset, starts, mask)
        B, H, T, hd = y.shape
        return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, H * hd)))


class MLP(nn.Module):
    """GPT-2's fc, GELU, proj; or Llama's SwiGLU: proj(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        C, hidden = config.n_embd, config.ffn_width
        self.swiglu = config.architecture.gated_mlp
        if self.swiglu:
            self.gate = SplitLinear(C, hidden, bias=config.bias)
            self.up = SplitLinear(C, hidden, bias=config.bias)
        else:
            self.fc = SplitLinear(C, hidden, bias=config.bias)
        self.proj = SplitLinear(hidden, C, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x):
        hidden = F.silu(self.gate(x)) * self.up(x) if self.swiglu else F.gelu(self.fc(x), approximate="tanh")
        return self.drop(self.proj(hidden))


def make_norm(config: ModelConfig) -> nn.Module:
    if config.architecture.norm == "rms":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, selective: bool = False, layer: int = 0, experts: bool = False):
        super().__init__()
        self.ln1 = make_norm(config)
        self.attn = CausalSelfAttention(config, selective, layer)
        self.ln2 = make_norm(config)
        self.mlp = MoE(config) if experts else MLP(config)

    def forward(self, x, cache: KVCache | None = None, documents: Documents | None = None):
        x = x + self.attn(self.ln1(x), cache, documents)
        return x + self.mlp(self.ln2(x))


def head_output(logits: torch.Tensor, targets: torch.Tensor | None, vocab_size: int,
                reduction: str = "mean") -> torch.Tensor:
    """What the head returns from its logits: without targets the logits of the real vocabulary
    (padded columns dropped, they are never predicted), with targets the mean cross-entropy
    ignoring targets == -1 (reduction "none": each target's, 0 where ignored, in targets' shape).
    GPT.head_output is this, per instance, so tensor parallelism can put a vocabulary-parallel
    version in its place."""
    if logits.size(-1) != vocab_size:
        logits = logits[..., :vocab_size]
    if targets is None:
        return logits
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), ignore_index=-1, reduction=reduction)
    return loss if reduction == "mean" else loss.view(targets.shape)


def slice_state_dict(full_state_dict: dict, layers: range, embed: bool, head: bool, tie: bool) -> dict:
    """The entries of a full model's state dict that the slice (layers, embed, head) holds,
    under their one-process names. With tying, `lm_head.weight` comes from `wte.weight`."""
    prefixes = tuple(f"blocks.{i}." for i in layers)
    out = {k: v for k, v in full_state_dict.items() if k.startswith(prefixes)}
    if embed:
        out.update({k: full_state_dict[k] for k in ("wte.weight", "wpe.weight") if k in full_state_dict})
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
        self.rotary = config.architecture.rotary
        self.context_parallel = None  # pipegpt.context_parallel.shard_for_cp's: where this rank's tokens sit
        if embed:
            self.wte = nn.Embedding(V, C)
            if not self.rotary:  # rotary positions have no parameters
                self.wpe = nn.Embedding(config.seq_len, C)
            self.drop = nn.Dropout(config.dropout)
        kinds = layer_kinds(config)  # each block at its kind's shape (pipegpt.arch)
        self.blocks = nn.ModuleDict({str(i): Block(kinds[i].block_model(config), recompute == "selective", i,
                                                   kinds[i] is MOE)
                                     for i in layers})
        for block in self.blocks.values():  # full recomputation keeps no cast of the experts (model.moe)
            if isinstance(block.mlp, MoE):
                block.mlp.cast_once = recompute != "full"
        if head:
            self.ln_f = make_norm(config)
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
            if ".ln" in "." + name or name.endswith("_norm.weight"):  # ln1, ln2, ln_f; attn.q_norm, attn.k_norm
                p.fill_(1.0 if name.endswith("weight") else 0.0)
                continue
            if name.endswith("bias"):
                p.zero_()
                continue
            std = resid_std if name.endswith(("attn.proj.weight", "mlp.proj.weight", "mlp.experts_proj",
                                              "mlp.shared.proj.weight")) else 0.02
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(tied.get(name, name).encode())) % 2**63)
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))

    def load_from_full(self, full_state_dict: dict, strict: bool = True):
        """Load this slice's entries of a full model's state dict (see slice_state_dict)."""
        sd = slice_state_dict(full_state_dict, self.layers, self.embed, self.head, self.config.tie_embeddings)
        return self.load_state_dict(sd, strict=strict)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None, documents: Documents | None = None,
                reduction: str = "mean") -> torch.Tensor:
        """Tokens (or the previous stage's activations) -> activations, logits, or the mean loss with targets
        (reduction "none": each target's loss). With a KVCache (sampling, no grad), x holds the positions
        after those cached. documents: packed documents' boundaries (attention stays within each; positions
        may restart)."""
        x = self.hidden(x, cache, documents)
        if not self.head:
            return x
        return self.head_forward(x, targets, reduction)

    def hidden(self, x: torch.Tensor, cache: KVCache | None = None,
               documents: Documents | None = None) -> torch.Tensor:
        """forward() up to the head: the embedding (if held) and the blocks; a cache advances past x."""
        T = x.size(1)
        if self.embed:
            x = self.embedding(x, cache, documents)
        for block in self.blocks.values():
            x = self.block_forward(block, x, cache, documents)
        if cache is not None:
            cache.length += T
        return x

    # forward() in its pieces (pipegpt.stages.stage runs a stage one piece at a time with them).
    def embedding(self, x: torch.Tensor, cache: KVCache | None = None,
                  documents: Documents | None = None) -> torch.Tensor:
        """Tokens -> the residual stream: token (and learned position) embeddings, then dropout."""
        T = x.size(1)
        start = cache.length if cache is not None else 0
        if start + T - (cache.least_pad if cache is not None else 0) > self.config.seq_len:
            raise ValueError(f"sequence length {start + T} exceeds seq_len={self.config.seq_len}")
        x = self.wte(x)
        if not self.rotary:
            positions = token_positions(T, self.context_parallel, documents, x.device)
            if positions is None and cache is not None:
                positions = cache.positions(T, x.device)
            x = x + self.wpe(torch.arange(start, start + T, device=x.device) if positions is None else positions)
        return self.drop(x)

    def block_forward(self, block: Block, x: torch.Tensor, cache: KVCache | None = None,
                      documents: Documents | None = None) -> torch.Tensor:
        """One of the slice's blocks; under --recompute full its activations are recomputed in backward."""
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(block, x, None, documents, use_reentrant=False)
        return block(x, cache, documents)

    def head_forward(self, x: torch.Tensor, targets: torch.Tensor | None = None,
                     reduction: str = "mean") -> torch.Tensor:
        """The residual stream -> logits, or the loss with targets (see head_output)."""
        return self.head_output(self.lm_head(self.ln_f(x)), targets, reduction=reduction)


def build_reference_model(config: ModelConfig, seed: int, recompute: str = "none") -> GPT:
    """The whole model in one process: the correctness oracle. Seeds torch (dropout) too;
    GPT(config, layers=..., init_seed=seed) slices get exactly the same initial values."""
    torch.manual_seed(seed)
    return GPT(config, recompute=recompute, init_seed=seed)


def load_whole_model(config: ModelConfig, full_state_dict: dict, device="cpu") -> GPT:
    """The whole model in one process holding a full state dict (one-process names), in eval mode: built on
    the meta device (no initial values drawn), then loaded (strict; a misfit raises KeyError or RuntimeError)."""
    with torch.device("meta"):
        model = GPT(config, init_seed=0)
    model.to_empty(device=device)
    if config.tie_embeddings:
        model.lm_head.weight = model.wte.weight  # to_empty gives each module its own tensor
    model.load_from_full(full_state_dict)
    return model.eval()
