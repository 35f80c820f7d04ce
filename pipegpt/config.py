"""Configuration as frozen dataclasses, checked before any process starts.

Every check raises ConfigError with a one-line message that names the bad
value and says what would be valid, so the driver can print it as it is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value is not valid (one-line, user-facing message)."""


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    if value < 1:
        raise ConfigError(f"{name}={value} must be a positive integer (>= 1)")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT-2 style model. Defaults are the byte-level `tiny` preset."""

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True
    pad_vocab_to: int = 1  # round the embedding/head rows up to a multiple of this (e.g. 64)
    bias: bool = True

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to
        return -(-self.vocab_size // m) * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "pad_vocab_to"):
            _check_positive_int(name, getattr(self, name))
        if self.n_embd % self.n_head:
            lo = self.n_embd // self.n_head * self.n_head
            hi = lo + self.n_head
            such_as = f"{lo} or {hi}" if lo > 0 else f"{hi}"
            raise ConfigError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"use a multiple of {self.n_head} such as {such_as}"
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout!r} must be a number in [0, 1), e.g. 0.0 or 0.1")
        for name in ("tie_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        return self


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_embd=128),
    "gpt2": ModelConfig(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": ModelConfig(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": ModelConfig(vocab_size=50257, seq_len=1024, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": ModelConfig(vocab_size=50257, seq_len=1024, n_layer=48, n_head=25, n_embd=1600),
}


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


DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    """One training job: model, layout (dp x pp x tp), schedule, optimisation, data."""

    model: ModelConfig = ModelConfig()
    stages: int = 4  # pipeline ranks (pp)
    dp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 8
    microbatch_size: int = 4
    virtual_stages: int | None = None
    layers_per_stage: tuple[int, ...] | None = None  # per model stage (rank x virtual stage)
    recompute: str = "none"
    steps: int = 50
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # 0 turns clipping off
    seed: int = 1337
    device: str = "auto"
    tokenizer: str = "bytes"
    data: str | None = None  # a flat uint16 token file; None means the built-in corpus
    timeout_s: float = 60.0
    threads_per_worker: int | None = None
    zero: int = 0  # 1: shard the optimizer state across data-parallel replicas (ZeRO stage 1)
    sequence_parallel: bool = False  # with tp > 1: shard LayerNorm/dropout regions along the sequence
    dtype: str = "float32"  # of parameters and activations; float64 makes runs comparable bit for bit-ish

    @property
    def world_size(self) -> int:
        return self.dp * self.stages * self.tp

    @property
    def batch_size(self) -> int:
        """Sequences per step across all data-parallel replicas."""
        return self.dp * self.microbatches * self.microbatch_size

    def validate(self) -> "TrainConfig":
        self.model.validate()
        for name in ("stages", "dp", "tp", "microbatches", "microbatch_size", "steps"):
            _check_positive_int(name, getattr(self, name))
        if self.recompute not in ("none", "full", "selective"):
            raise ConfigError(f"recompute={self.recompute!r} is not one of none, full, selective")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not one of {', '.join(DEVICES)}")
        for name in ("lr", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"dtype={self.dtype!r} is not one of float32, float64")
        if self.zero not in (0, 1):
            raise ConfigError(f"zero={self.zero} is not supported: use 0 (off) or 1 (shard optimizer state)")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("grad_clip and weight_decay must be >= 0")
        return self
