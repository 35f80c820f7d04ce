"""Text from a checkpoint, in one process (`pipegpt sample`): nanoGPT's generation loop.

The checkpoint may come from any layout (or from `pipegpt convert --from-hf`): its parameters are read
by one-process name (checkpoint.read_weights) into the whole GPT, which runs in eval mode. Each new token
is drawn from the last position's logits over a context cropped to the model's seq_len (keys and values of
the positions seen are kept in a KVCache, so each new token costs one position's forward, until the context
is full; from then on the cropped window is computed whole, as nanoGPT does): divided by the
temperature, cut to the top k, softmax, one draw from a generator seeded with `seed` (temperature 0:
the argmax). Tokens the tokenizer cannot decode (rows beyond its vocabulary) are never drawn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipegpt.state import checkpoint
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.model.gpt import GPT, KVCache, load_whole_model


class SampleError(ConfigError):
    """A sampling setting or a prompt is unusable (one line; the CLI prints it, exit status 2)."""


@dataclass
class Sample:
    text: str                  # the prompt and the generated text, decoded together
    prompt_tokens: list[int]
    new_tokens: list[int]
    checkpoint: Path
    tokenizer: str


def check_settings(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise SampleError(f"max-new-tokens={max_new_tokens!r} must be an integer >= 0")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise SampleError(f"temperature={temperature!r} must be a number >= 0 (0: always the most likely token)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise SampleError(f"top-k={top_k!r} must be an integer >= 1 (1: always the most likely token)")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SampleError("device=cuda but no CUDA GPU is visible: use --device cpu")
    if device not in ("cpu", "cuda"):
        raise SampleError(f"device={device!r} is not one of auto, cpu, cuda")
    return torch.device(device)


def load_model(path, device="cpu") -> tuple[GPT, dict, Path]:
    """The whole model of a checkpoint (or of a run directory's latest) in eval mode, its manifest, its path."""
    found = checkpoint.resolve(path)
    manifest = checkpoint.read_manifest(found)
    try:
        config = ModelConfig(**manifest["model"]).validate()
    except (KeyError, TypeError, ConfigError) as e:
        raise checkpoint.CheckpointError(f"{found / checkpoint.MANIFEST}: no usable model settings ({e})") from None
    state = checkpoint.read_weights(found)
    try:
        model = load_whole_model(config, state, device)
    except (KeyError, RuntimeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise checkpoint.CheckpointError(f"{found}: its parameters do not fit its model settings ({first})") from None
    return model, manifest, found


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, vocab_limit: int | None = None,
             use_cache: bool = True) -> list[int]:
    """The max_new_tokens tokens that follow `prompt` (nanoGPT's loop; temperature 0: greedy)."""
    check_settings(max_new_tokens, temperature, top_k)
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    T = model.config.seq_len
    cache, fed = (KVCache(), 0) if use_cache else (None, 0)
    for _ in range(max_new_tokens):
        if cache is not None and idx.size(1) <= T:
            logits = model(idx[:, fed:], cache=cache)[:, -1, :].float()  # only the positions not yet cached
            fed = idx.size(1)
        else:  # the context no longer fits: positions shift, so the window is computed whole
            logits = model(idx[:, -T:])[:, -1, :].float()
        if vocab_limit is not None and vocab_limit < logits.size(-1):
            logits[:, vocab_limit:] = -math.inf
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k).values[:, [-1]]
                logits[logits < kth] = -math.inf
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, nxt), dim=1)
    return idx[0, len(prompt):].tolist()


def sample(path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int,
           tokenizer: str | None = None, device: str = "cpu") -> Sample:
    """Generate from a checkpoint: its tokenizer (or `tokenizer`), the prompt, then max_new_tokens more."""
    from pipegpt.data.tokenizers import get_tokenizer

    check_settings(max_new_tokens, temperature, top_k)
    dev = pick_device(device)
    model, manifest, found = load_model(path, dev)
    name = tokenizer or manifest.get("tokenizer") or "bytes"
    tok = get_tokenizer(name)
    ids = tok.encode(prompt)
    if not ids:
        if tok.eot_token is None:
            raise SampleError("the prompt encodes to no tokens: give a non-empty --prompt")
        ids = [tok.eot_token]  # GPT-2's documents start after an end-of-text token
    vocab = model.config.vocab_size
    if max(ids) >= vocab:
        raise SampleError(f"the prompt holds token id {max(ids)} (tokenizer {name}), not below the model's "
                          f"vocabulary size {vocab}: use the tokenizer the model was trained with (--tokenizer)")
    generator = torch.Generator(device=dev).manual_seed(seed)
    new = generate(model, ids, max_new_tokens, temperature, top_k, generator, vocab_limit=tok.vocab_size)
    text = tok.decode(ids + new) if prompt else tok.decode(new)  # not the end-of-text token put in its place
    return Sample(text, ids, new, found, name)
