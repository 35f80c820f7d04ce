"""A model's shape (ModelConfig, the presets) and whether it fits a layout (validate_tp, validate_cp).

Below pipegpt.config, which re-exports these names: the planner, the tensor- and context-parallel layers and the
config's own checks ask the same questions here. Nothing here imports torch; every check raises ConfigError with
a one-line message that names the bad value and says what would be valid.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipegpt.arch import ARCHITECTURES, PRESET_SHAPES, Architecture


class ConfigError(ValueError):
    """A configuration value is not valid (one-line, user-facing message)."""


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    if value < 1:
        raise ConfigError(f"{name}={value} must be a positive integer (>= 1)")


ARCHS = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT: GPT-2 (learned positions, LayerNorm, GELU MLP, biases) or Llama (rotary positions,
    RMSNorm, SwiGLU MLP, grouped-query attention, no biases). Defaults are the byte-level `tiny` preset.

    arch-dependent fields: n_kv_head None means n_head (no grouping); ffn_hidden None means 4 x n_embd for
    GPT-2 and Llama's rule (two thirds of 4 x n_embd, rounded up to a multiple of 256) for Llama. rope_theta,
    norm_eps and qkv_bias (Qwen2's) matter to Llama only; GPT-2's LayerNorm eps is norm_eps too (1e-5).
    head_size (heads wider than n_embd / n_head, as Qwen3's) and qk_norm are Llama's only too.
    """

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True
    pad_vocab_to: int = 1  # round the embedding/head rows up to a multiple of this (e.g. 64)
    bias: bool = True
    arch: str = "gpt2"
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    head_size: int | None = None  # each attention head's width (Hugging Face's head_dim); None: n_embd / n_head
    qk_norm: str = "none"  # RMSNorm of q and k before rotary: "head" (each head's, Qwen3) or "projection" (OLMoE)
    # Mixture of experts (pipegpt.model.moe; Hugging Face's names where they have one). n_experts 0: dense.
    n_experts: int = 0
    n_experts_per_token: int | None = None  # top-k; None: 2
    n_shared_experts: int = 0
    expert_hidden: int | None = None  # each expert's width; None: ffn_width
    moe_every: int = 1  # every k-th layer (counted from first_dense_layers) is MoE
    first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace
    router_score: str = "softmax"
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    router_bias_update_rate: float = 0.0
    moe_capacity_factor: float = 0.0  # 0: dropless

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to
        return -(-self.vocab_size // m) * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head if self.head_size is None else self.head_size

    @property
    def attention_width(self) -> int:
        """The width of q and of attention's output (the proj input): n_head x head_dim, n_embd unless
        head_size says otherwise (Qwen3's 32 heads of 128 over n_embd 2048)."""
        return self.n_head * self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is not set."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width (ffn_hidden, or the architecture's rule)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return self.architecture.ffn_rule(self.n_embd)

    @property
    def experts_per_token(self) -> int:
        return 2 if self.n_experts_per_token is None else self.n_experts_per_token

    @property
    def expert_width(self) -> int:
        return self.ffn_width if self.expert_hidden is None else self.expert_hidden

    @property
    def architecture(self) -> Architecture:
        """The description of arch (pipegpt.arch)."""
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"arch={self.arch!r} is not valid: use one of {', '.join(ARCHITECTURES)}")
        return ARCHITECTURES[self.arch]

    def settings(self) -> dict:
        """The fields a checkpoint's manifest records: every one, but a dense model's expert settings (a dense
        checkpoint reads as it did before experts existed, and one written before them resumes)."""
        out = dataclasses.asdict(self)
        for name, default in (("head_size", None), ("qk_norm", "none")):  # as the expert settings, when unused
            if out[name] == default:
                out.pop(name)
        if not self.n_experts:
            for name in ("n_experts", *_MOE_FIELDS):
                out.pop(name)
        return out

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "pad_vocab_to"):
            check_positive_int(name, getattr(self, name))
        arch = self.architecture
        self._validate_heads()
        if self.head_size is None and self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"use a multiple of {self.n_head} such as {nearest_multiples(self.n_embd, self.n_head)}"
            )
        for name in ("n_kv_head", "ffn_hidden"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        if self.n_head % self.kv_heads:
            divisors = [d for d in range(1, self.n_head + 1) if self.n_head % d == 0]
            raise ConfigError(f"n_kv_head={self.kv_heads} does not divide n_head={self.n_head}: "
                              f"use one of {', '.join(map(str, divisors))}")
        if self.kv_heads != self.n_head and not arch.grouped_kv:
            grouped = ", ".join(a.name for a in ARCHITECTURES.values() if a.grouped_kv)
            raise ConfigError(f"n_kv_head={self.kv_heads} (grouped-query attention) needs arch {grouped}, "
                              f"not {self.arch}; {arch.title} has n_kv_head = n_head = {self.n_head}")
        if arch.rotary and self.head_dim % 2:
            size = "n_embd/n_head" if self.head_size is None else "head_size"
            raise ConfigError(f"head size {size} = {self.head_dim} is odd: rotary embeddings need an even head size")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout!r} must be a number in [0, 1), e.g. 0.0 or 0.1")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{name}={value!r} must be a positive finite number, e.g. "
                                  f"{'500000' if name == 'rope_theta' else '1e-5'}")
        for name in ("tie_embeddings", "bias", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        self._validate_experts()
        return self

    def _validate_heads(self) -> None:
        """head_size and qk_norm: Llama-style attention's (GPT-2's fused q, k, v are n_embd wide, its norm a
        LayerNorm)."""
        if self.head_size is not None:
            check_positive_int("head_size", self.head_size)
            if self.architecture.fused_qkv:
                raise ConfigError(f"head_size={self.head_size} needs separate q, k, v projections (arch llama), "
                                  f"not {self.arch}: leave it out (n_embd / n_head = {self.n_embd / self.n_head:g})")
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"qk_norm={self.qk_norm!r} is not valid: use one of {', '.join(QK_NORMS)}")
        if self.qk_norm != "none" and self.architecture.norm != "rms":
            raise ConfigError(f"qk_norm={self.qk_norm} is an RMSNorm: it needs arch llama, not {self.arch}")

    def _validate_experts(self) -> None:
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ConfigError(f"n_experts={self.n_experts!r} must be an integer >= 0 (0: a dense model)")
        if not self.n_experts:
            router = [f.name for f in dataclasses.fields(self) if f.name in _MOE_FIELDS
                      and getattr(self, f.name) != f.default]
            if router:
                raise ConfigError(f"{', '.join(router)} set on a model without experts: give n_experts too")
            return
        for name in ("n_experts_per_token", "expert_hidden", "moe_every"):
            if getattr(self, name) is not None:
                check_positive_int(name, getattr(self, name))
        for name in ("n_shared_experts", "first_dense_layers"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) \
                    or getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be an integer >= 0")
        if self.experts_per_token > self.n_experts:
            raise ConfigError(f"n_experts_per_token={self.experts_per_token} is above n_experts={self.n_experts}: "
                              f"use at most {self.n_experts}")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ConfigError(f"router_score={self.router_score!r} is not valid: use softmax or sigmoid")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate", "moe_capacity_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(f"{name}={value!r} must be a finite number >= 0"
                                  + (" (0: dropless)" if name == "moe_capacity_factor" else ""))
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"norm_topk_prob={self.norm_topk_prob!r} must be True or False")


# qk_norm's values: none; each head's head_dim values (Qwen3); the whole q and k projections (OLMoE, OLMo 2)
QK_NORMS = ("none", "head", "projection")
# The mixture-of-experts fields a `pipegpt run` flag sets (--n-experts: n_experts); norm_topk_prob is a preset's
MOE_FLAG_FIELDS = ("n_experts", "n_experts_per_token", "n_shared_experts", "expert_hidden", "moe_every",
                   "first_dense_layers", "router_score", "router_aux_loss_coef", "router_z_loss_coef",
                   "router_bias_update_rate", "moe_capacity_factor")
_MOE_FIELDS = ("n_experts_per_token", "n_shared_experts", "expert_hidden", "moe_every", "first_dense_layers",
               "router_score", "norm_topk_prob", "router_aux_loss_coef", "router_z_loss_coef",
               "router_bias_update_rate", "moe_capacity_factor")

MODEL_PRESETS: dict[str, ModelConfig] = {name: ModelConfig(**shape) for name, shape in PRESET_SHAPES.items()}


def model_config(preset: str, **overrides) -> ModelConfig:
    """The preset named `preset` with `overrides` applied (None values are ignored), validated."""
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}: known presets are {', '.join(MODEL_PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    changes = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ConfigError(
            f"unknown model setting {', '.join(unknown)}: valid settings are {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(MODEL_PRESETS[preset], **changes).validate()



def nearest_multiples(n: int, k: int) -> str:
    """The multiples of k either side of n, for a "use ..." suggestion: '24 or 32' (k alone when no positive
    multiple lies below n)."""
    lo = n // k * k
    return f"{lo} or {lo + k}" if lo > 0 else f"{k}"


def _near_divisors(n: int, k: int) -> str:
    """The divisors of n nearest to k, below and above: 'tp=2 or tp=4'."""
    below = max(d for d in range(1, k) if n % d == 0)
    above = next((d for d in range(k + 1, n + 1) if n % d == 0), None)
    return f"tp={below}" + (f" or tp={above}" if above else "")


def validate_cp(config: ModelConfig, cp: int) -> None:
    """`config` can run over `cp` context-parallel ranks: every sequence cuts into 2 x cp equal chunks (rank r
    holds chunks r and 2cp-1-r), and attention has no dropout there (the ring computes it blockwise)."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"cp={cp!r} must be an integer >= 1")
    if cp == 1:
        return
    if config.seq_len % (2 * cp):
        raise ConfigError(f"context parallelism cuts each sequence into 2 x cp = {2 * cp} chunks: seq_len="
                          f"{config.seq_len} is not divisible by {2 * cp}; use seq_len="
                          f"{nearest_multiples(config.seq_len, 2 * cp)}")
    if config.dropout:
        raise ConfigError(f"context parallelism computes attention blockwise, without dropout: dropout="
                          f"{config.dropout} needs cp=1 (or use dropout=0)")


def validate_tp(config: ModelConfig, tp: int, sequence_parallel: bool = False, cp: int = 1) -> None:
    """Raise ConfigError (one line, naming the values and the nearest valid ones) unless
    `config` can be split over `tp` tensor-parallel ranks: whole heads per rank, and key/value heads either
    n_kv_head/tp per rank or, with tp a multiple of n_kv_head, one replicated over tp/n_kv_head ranks
    (pipegpt.tensor_parallel.layout); the MLP width and the padded vocabulary divisible by tp."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r} must be an integer >= 1")
    if tp == 1:
        return
    C = config.n_embd
    if config.n_head % tp:
        heads = [h for h in range(tp, C + 1, tp) if C % h == 0]  # multiples of tp dividing n_embd
        lo = [h for h in heads if h < config.n_head]
        hi = [h for h in heads if h > config.n_head]
        alt = " or ".join(str(h) for h in (lo[-1:] + hi[:1]))
        raise ConfigError(f"n_head={config.n_head} is not divisible by tp={tp} (each tp rank holds "
                          f"n_head/tp heads): use {_near_divisors(config.n_head, tp)}"
                          + (f", or n_head={alt} (with n_embd={C})" if alt else ""))
    kv, width = config.kv_heads, config.ffn_width
    valid = lambda: ", ".join(str(t) for t in range(1, config.n_head + 1)  # noqa: E731
                              if config.n_head % t == 0 and (kv % t == 0 or t % kv == 0) and width % t == 0)
    if kv % tp and tp % kv:
        raise ConfigError(f"n_kv_head={kv} does not split over tp={tp}: each tp rank holds n_kv_head/tp key/value "
                          f"heads, or one shared by tp/n_kv_head ranks (tp a multiple of n_kv_head); "
                          f"use tp={valid()}")
    if width % tp:  # GPT-2's 4*n_embd: implied by the n_head check; a Llama ffn_hidden may not divide
        what = f"ffn_hidden={width}" if config.ffn_hidden is not None else f"the MLP width {width}"
        raise ConfigError(f"{what} is not divisible by tp={tp} (each tp rank holds ffn_hidden/tp of the MLP's "
                          f"columns): use tp={valid()}")
    V, pad = config.padded_vocab_size, config.pad_vocab_to
    if V % tp:
        if 64 % tp == 0 and pad != 64:
            fix = f"pass --pad-vocab (pad_vocab_to=64, padded vocab {-(-config.vocab_size // 64) * 64})"
        else:
            m = math.lcm(pad, tp)
            fix = f"use pad_vocab_to={m} (padded vocab {-(-config.vocab_size // m) * m})"
        raise ConfigError(f"padded vocab_size={V} (vocab_size={config.vocab_size}, pad_vocab_to={pad}) "
                          f"is not divisible by tp={tp}: {fix}")
    T = config.seq_len
    if sequence_parallel and T % (tp * cp):
        if cp > 1:
            raise ConfigError(f"sequence parallelism cuts each context-parallel rank's seq_len/cp tokens over tp: "
                              f"seq_len={T} is not divisible by cp x tp = {cp * tp}; use seq_len="
                              f"{nearest_multiples(T, math.lcm(tp * cp, 2 * cp))}")
        raise ConfigError(f"sequence parallelism needs seq_len divisible by tp: seq_len={T}, tp={tp}; "
                          f"use seq_len={nearest_multiples(T, tp)}")
