"""The next token from logits, as every sampler of pipegpt draws it (one process, or the last stage of a pipeline):
tokens the tokenizer cannot decode never drawn, then temperature 0 the argmax, else the logits divided by the
temperature, cut to the top k, softmax, one draw from the prompt's own generator."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int  # prompt i draws from a generator seeded with seed + i
    vocab_limit: int | None = None  # the tokenizer's vocabulary: ids from here on are never drawn


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None,
               vocab_limit: int | None = None) -> torch.Tensor:
    """The next token [B, 1] from the last position's float logits [B, V] (changed in place)."""
    if vocab_limit is not None and vocab_limit < logits.size(-1):
        logits[:, vocab_limit:] = -math.inf
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[:, [-1]]
        logits[logits < kth] = -math.inf
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


def prompt_generators(indices: list[int], settings: SamplingSettings, device) -> list[torch.Generator | None]:
    """Each prompt's generator (seed + its index), so a prompt draws the same tokens in any batch or layout."""
    if settings.temperature == 0:
        return [None] * len(indices)
    return [torch.Generator(device=device).manual_seed(settings.seed + i) for i in indices]


def next_tokens(logits: torch.Tensor, settings: SamplingSettings, generators: list) -> list[int]:
    """Per row of logits [B, V], its prompt's next token, each row drawn alone as one prompt would be."""
    if settings.temperature == 0:
        return next_token(logits, 0, None, None, settings.vocab_limit)[:, 0].tolist()
    return [int(next_token(logits[i:i + 1], settings.temperature, settings.top_k, g, settings.vocab_limit))
            for i, g in enumerate(generators)]
