"""Tokens for training: a built-in offline corpus, tokenizers, token files, batches.

The built-in corpus is the text of Python's own help topics
(`pydoc_data.topics.topics`), so a run needs no download. Token files are
nanoGPT's format: a flat array of uint16 token ids (`train.bin`).

BatchSampler draws random windows deterministically from (seed, step), so
every process computes the same batch for a step without communicating.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

TOKENIZERS = ("bytes", "gpt2")


class DataError(RuntimeError):
    """Data or a tokenizer cannot be loaded (one-line, user-facing message)."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no download, no unknown tokens."""

    name = "bytes"
    vocab_size = 256
    eot_token = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """GPT-2 BPE via tiktoken (vocabulary 50257; end of text is token 50256)."""

    def __init__(self, name: str = "gpt2"):
        try:
            import tiktoken

            self._enc = tiktoken.get_encoding(name)
        except Exception as e:  # tiktoken downloads its BPE file on first use
            first = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise DataError(
                f"cannot load the tiktoken {name!r} tokenizer (it needs the network once to fetch its "
                f"BPE file, or a filled TIKTOKEN_CACHE_DIR): {type(e).__name__}: {first}; "
                f"use the 'bytes' tokenizer offline"
            ) from None
        self.name = name
        self.vocab_size = self._enc.n_vocab
        self.eot_token = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def get_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenTokenizer("gpt2")
    raise DataError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)}")


@functools.lru_cache(maxsize=1)
def builtin_text() -> str:
    """Python's help topics, values joined in sorted key order (about 465k characters)."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics))


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size < 2**16 else np.uint32


def builtin_tokens(tokenizer) -> np.ndarray:
    """The built-in corpus as a flat token array (uint16 when the vocabulary allows)."""
    text = builtin_text()
    dtype = token_dtype(tokenizer.vocab_size)
    if isinstance(tokenizer, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
    return np.asarray(tokenizer.encode(text), dtype=dtype)


def write_token_file(path, tokens) -> None:
    """Write tokens as a flat uint16 file (the format load_token_file reads)."""
    arr = np.asarray(tokens)
    if arr.size and int(arr.max()) >= 2**16:
        raise DataError(f"token id {int(arr.max())} does not fit a uint16 token file")
    arr.astype(np.uint16).tofile(os.fspath(path))


def load_token_file(path) -> np.ndarray:
    """A flat uint16 token file (nanoGPT's train.bin format), memory-mapped read-only."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"token file {path!r} not found: expected a flat uint16 .bin file (nanoGPT format)")
    size = os.path.getsize(path)
    if size == 0 or size % 2:
        raise DataError(f"token file {path!r} has {size} bytes: expected a non-empty flat uint16 array")
    return np.memmap(path, dtype=np.uint16, mode="r")


class BatchSampler:
    """Random (x, y) windows of `tokens`, y = x shifted by one, deterministic from (seed, step)."""

    def __init__(self, tokens, batch_size: int, seq_len: int, seed: int = 0):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size={batch_size} and seq_len={seq_len} must both be >= 1")
        if len(tokens) < seq_len + 1:
            raise DataError(f"{len(tokens)} tokens are too few for seq_len={seq_len}: need at least {seq_len + 1}")
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.step = 0

    def starts(self, step: int) -> np.ndarray:
        """Where each of the step's batch_size windows starts."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(self.tokens, self.starts(step), self.seq_len)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    __next__ = next

    def __iter__(self):
        return self


def windows(tokens, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of the windows at `starts`: y is x shifted by one token."""
    idx = starts[:, None] + np.arange(seq_len + 1)
    buf = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


class RankLoader:
    """What one rank needs of each step: its data-parallel replica's slice of the global batch, as
    microbatches, and only the part its stages use (inputs on the first stage, targets on the last).

    It draws the same global batch as BatchSampler, which the one-process reference uses, so every
    layout trains on the same data. Its position is a small state (state_dict) that a checkpoint keeps.
    """

    def __init__(self, tokens, seq_len: int, microbatches: int, microbatch_size: int, dp: int, dp_index: int,
                 seed: int, inputs: bool, targets: bool):
        per_replica = microbatches * microbatch_size
        self.sampler = BatchSampler(tokens, dp * per_replica, seq_len, seed)
        self.rows = slice(dp_index * per_replica, (dp_index + 1) * per_replica)
        self.microbatch_size, self.inputs, self.targets = microbatch_size, inputs, targets
        self.step = 0

    def batch(self, step: int) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """(input microbatches or None, target microbatches or None) of a step."""
        x, y = windows(self.sampler.tokens, self.sampler.starts(step)[self.rows], self.sampler.seq_len)
        return (list(x.split(self.microbatch_size)) if self.inputs else None,
                list(y.split(self.microbatch_size)) if self.targets else None)

    def next(self):
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
