"""Batches from token arrays: BatchSampler draws random windows deterministically from (seed, step),
so every process computes the same batch for a step without communicating; RankLoader takes one rank's
part of it. torch is imported only where tensors are made.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pipegpt.data.tokenizers import DataError

if TYPE_CHECKING:
    import torch


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


def document_starts(x: torch.Tensor, end_of_text: int) -> torch.Tensor:
    """[N, T]: for each token of x [N, T], the position where its document starts: 0, or the last end-of-text token
    at or before it. pipegpt prepare (as llm.c's shards) puts that token before every document, so it opens its
    document, and its target, the document's first token, is predicted from it alone (as after a BOS)."""
    import torch

    T = x.size(1)
    new = x == end_of_text
    new[:, 0] = True
    return (torch.arange(T) * new).cummax(dim=1).values


def windows(tokens, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of the windows at `starts`: y is x shifted by one token."""
    import torch

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
                 seed: int, inputs: bool, targets: bool, vocab_size: int | None = None, cp: int = 1,
                 cp_index: int = 0, end_of_text: int | None = None):
        per_replica = microbatches * microbatch_size
        self.vocab_size = vocab_size  # ids at or past it are refused here, not met as an IndexError in a layer
        self.sampler = BatchSampler(tokens, dp * per_replica, seq_len, seed)
        self.rows = slice(dp_index * per_replica, (dp_index + 1) * per_replica)
        self.microbatch_size, self.inputs, self.targets = microbatch_size, inputs, targets
        # context parallelism: this rank's chunks of every sequence; with end_of_text, where documents start
        self.cp, self.cp_index, self.end_of_text = cp, cp_index, end_of_text
        self.step = 0

    def batch(self, step: int) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """(input microbatches or None, target microbatches or None) of a step."""
        inputs, targets, _ = self.parts(step)
        return inputs, targets

    def parts(self, step: int) -> tuple[list | None, list | None, list | None]:
        """(inputs, targets, document starts), each a list of microbatches or None: document starts
        (pipegpt.data.loader.document_starts) when an end-of-text token was given, for every stage."""
        from pipegpt.context_parallel.chunks import shard_sequence

        x, y = windows(self.sampler.tokens, self.sampler.starts(step)[self.rows], self.sampler.seq_len)
        self._check_vocabulary(step, x, y)
        starts = None if self.end_of_text is None else document_starts(x, self.end_of_text)
        x, y, starts = (None if t is None else shard_sequence(t, self.cp_index, self.cp) for t in (x, y, starts))
        split = lambda t, wanted: list(t.split(self.microbatch_size)) if wanted and t is not None else None  # noqa
        return split(x, self.inputs), split(y, self.targets), split(starts, True)

    def _check_vocabulary(self, step: int, x, y) -> None:
        if self.vocab_size is not None and max(int(x.max()), int(y.max())) >= self.vocab_size:
            from pipegpt.data.tokenizers import DataError

            raise DataError(f"step {step + 1}'s batch holds token id {max(int(x.max()), int(y.max()))}, not below "
                            f"the model's vocabulary size {self.vocab_size}: the check before the run did not see "
                            f"it (a meta.json whose max token id is wrong, or data changed since)")

    def next(self):
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
