"""Text from a checkpoint (`pipegpt sample`): nanoGPT's generation loop, in one process or on workers in a layout.

The checkpoint may come from any layout (or from `pipegpt convert --from-hf`): its parameters are read
by one-process name (checkpoint.read_weights) into the whole GPT, which runs in eval mode. Each new token
is drawn from the last position's logits over a context cropped to the model's seq_len (keys and values of
the positions seen are kept in a KVCache, so each new token costs one position's forward, until the context
is full; from then on the cropped window is computed whole, as nanoGPT does): divided by the
temperature, cut to the top k, softmax, one draw from a generator seeded with `seed` (temperature 0:
the argmax). Tokens the tokenizer cannot decode (rows beyond its vocabulary) are never drawn.

Several prompts (repeated --prompt, or --prompts-file) generate together, `batch` at a time: in one process as one
left-padded batch (pipegpt.infer.generation), or with --stages/--tp/--dp on workers holding a slice each, the prompt
groups in flight through the stages (pipegpt.infer.job). Prompt i draws from a generator seeded with seed + i, so
every prompt's tokens are the same alone, in any batch and in any layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pipegpt.state import checkpoint
from pipegpt.config import ConfigError
from pipegpt.infer.sampling import next_token
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
    config = checkpoint.model_config(found, manifest)
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
        idx = torch.cat((idx, next_token(logits, temperature, top_k, generator, vocab_limit)), dim=1)
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
    ids = encode_prompt(tok, name, prompt, model.config.vocab_size)
    generator = torch.Generator(device=dev).manual_seed(seed)
    new = generate(model, ids, max_new_tokens, temperature, top_k, generator, vocab_limit=tok.vocab_size)
    return Sample(_text(tok, prompt, ids, new), ids, new, found, name)


def encode_prompt(tok, name: str, prompt: str, vocab: int, which: str = "the prompt") -> list[int]:
    """A prompt's tokens (an empty one: the end-of-text token, where GPT-2's documents start)."""
    ids = tok.encode(prompt)
    if not ids:
        if tok.eot_token is None:
            raise SampleError(f"{which} encodes to no tokens: give a non-empty --prompt")
        ids = [tok.eot_token]
    if max(ids) >= vocab:
        raise SampleError(f"{which} holds token id {max(ids)} (tokenizer {name}), not below the model's "
                          f"vocabulary size {vocab}: use the tokenizer the model was trained with (--tokenizer)")
    return ids


def _text(tok, prompt: str, ids: list[int], new: list[int]) -> str:
    return tok.decode(ids + new) if prompt else tok.decode(new)  # not the end-of-text token put in its place


def read_prompts(file) -> list[str]:
    """The prompts of a file, one per line (blank lines skipped)."""
    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SampleError(f"{path}: no such file (expected prompts, one per line)") from None
    except IsADirectoryError:
        raise SampleError(f"{path}: a directory (expected a file of prompts, one per line)") from None
    except UnicodeDecodeError as e:
        raise SampleError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise SampleError(f"{path}: unreadable ({e.strerror})") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SampleError(f"{path}: holds no prompts (one per line)")
    return prompts


@dataclass
class Generation:
    samples: list[Sample]
    seconds: float             # generating (the workers' calls, or the one-process loop), not loading
    where: str                 # "one process", or the layout

    @property
    def tokens_per_s(self) -> float:
        return sum(len(s.new_tokens) for s in self.samples) / self.seconds if self.seconds else 0.0


def check_room(prompts: list[list[int]], max_new_tokens: int, seq_len: int) -> None:
    """On workers the KV caches hold seq_len positions: a prompt and its new tokens but the last (chosen, never fed
    back) must fit in them."""
    i, longest = max(enumerate(prompts), key=lambda p: len(p[1]))
    if max_new_tokens and len(longest) + max_new_tokens - 1 > seq_len:
        room = seq_len - len(longest) + 1
        use = f"--max-new-tokens {room} or less" if room > 0 else f"a prompt of at most seq_len={seq_len} tokens"
        raise SampleError(f"--max-new-tokens {max_new_tokens} is past the context: prompt {i + 1} has "
                          f"{len(longest)} tokens, and the KV caches hold seq_len={seq_len} positions: use {use} "
                          f"(one process, without --stages, --tp or --dp, crops the context instead)")


def sample_many(path, prompts: list[str], settings, tokenizer: str | None = None, device: str = "cpu",
                batch: int | None = None, layout=None, timeout_s: float = 60.0) -> Generation:
    """Every prompt's continuation (settings: pipegpt.infer.sampling.SamplingSettings; its vocab_limit is set
    from the tokenizer): in one process (layout None), or on workers in `layout` (pipegpt.infer.job.Layout)."""
    import dataclasses
    import time

    from pipegpt.data.tokenizers import get_tokenizer
    from pipegpt.infer.generation import generate_in_process
    from pipegpt.infer.job import InferenceJob

    check_settings(settings.max_new_tokens, settings.temperature, settings.top_k)
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise SampleError(f"batch={batch!r} must be an integer >= 1")
    if layout is None:
        dev = pick_device(device)
        model, manifest, found = load_model(path, dev)
        config = model.config
    else:
        job = InferenceJob(path, layout, device, timeout_s)  # refuses a bad layout before any worker starts
        manifest, found, config = job.manifest, job.found, job.model
    name = tokenizer or manifest.get("tokenizer") or "bytes"
    tok = get_tokenizer(name)
    ids = [encode_prompt(tok, name, p, config.vocab_size, f"prompt {i + 1}" if len(prompts) > 1 else "the prompt")
           for i, p in enumerate(prompts)]
    settings = dataclasses.replace(settings, vocab_limit=tok.vocab_size)
    if layout is not None:
        check_room(ids, settings.max_new_tokens, config.seq_len)
        with job:
            job.start()
            new, seconds = job.generate(ids, settings, batch)
        where = layout.describe()
    else:
        t0, new, step = time.perf_counter(), [], batch or len(ids)
        for start in range(0, len(ids), step):
            part = ids[start:start + step]
            if max(map(len, part)) + settings.max_new_tokens <= config.seq_len:
                new += generate_in_process(model, part, settings, first=start)
            else:  # the context overflows: each prompt alone, its window cropped
                new += [generate(model, p, settings.max_new_tokens, settings.temperature, settings.top_k,
                                 torch.Generator(device=dev).manual_seed(settings.seed + start + k), tok.vocab_size)
                        for k, p in enumerate(part)]
        seconds, where = time.perf_counter() - t0, "one process"
    samples = [Sample(_text(tok, p, i, n), i, n, found, name) for p, i, n in zip(prompts, ids, new)]
    return Generation(samples, seconds, where)
