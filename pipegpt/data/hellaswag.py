"""HellaSwag accuracy of a checkpoint, in one process (`pipegpt hellaswag`): nanoGPT's scoring.

The file is the jsonl that nanoGPT's hellaswag.py reads (hellaswag_val.jsonl): one JSON object per line
with "ctx" (a non-empty string), "endings" (4 strings) and "label" (the right ending, 0..3; an integer,
or a string of one digit as in Hugging Face exports). Blank lines are skipped; `limit` keeps the first
examples only (lines after them are not read).

Each of the 4 candidates is the tokens of ctx followed by the tokens of " " + ending. The model reads the
4 rows (right-padded) in one batch; each ending token's cross-entropy comes from the logits at the
position before it (ctx tokens are not scored). Two predictions, each the argmin over the 4 endings:

    acc       the SUM of the ending tokens' losses (the ending's total log-likelihood)
    acc_norm  the MEAN loss per ending token (length-normalized; what nanoGPT reports)

A candidate longer than the model's seq_len keeps its last seq_len tokens (the ending included, the
start of ctx cut): its ending tokens that remain are scored, except a first token left without a
predecessor (an ending longer than seq_len). Losses are over the model's vocabulary (padded columns
excluded, as in training), in float32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pipegpt.config import ConfigError
from pipegpt.data.tokenizers import DataError, get_tokenizer

if TYPE_CHECKING:
    from pipegpt.model.gpt import GPT

ENDINGS = 4


@dataclass
class Example:
    ctx: str
    endings: list[str]
    label: int
    line: int              # 1-based line number in the file


def _label(value, where: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ENDINGS:
        raise DataError(f"{where}: \"label\" is {value!r}: expected an integer 0..{ENDINGS - 1} (the right ending)")
    return value


def parse_example(text: str, where: str, line: int) -> Example:
    """One jsonl line as an Example; a DataError naming `where` (file:line) when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, expected an object with ctx, endings, label")
    missing = [k for k in ("ctx", "endings", "label") if k not in obj]
    if missing:
        raise DataError(f"{where}: no {', '.join(repr(k) for k in missing)} (each line needs ctx, endings, label)")
    ctx, endings = obj["ctx"], obj["endings"]
    if not isinstance(ctx, str) or not ctx:
        raise DataError(f"{where}: \"ctx\" is {ctx!r}: expected a non-empty string")
    if not (isinstance(endings, list) and len(endings) == ENDINGS and all(isinstance(e, str) for e in endings)):
        raise DataError(f"{where}: \"endings\" must be a list of {ENDINGS} strings")
    return Example(ctx, list(endings), _label(obj["label"], where), line)


def read_examples(path, limit: int | None = None) -> list[Example]:
    """The examples of a HellaSwag jsonl file (the first `limit` of them when given)."""
    path = Path(path)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"limit={limit!r} must be an integer >= 1")
    if not path.exists():
        raise DataError(f"{path}: no such file (expected a HellaSwag jsonl file such as hellaswag_val.jsonl)")
    if path.is_dir():
        raise DataError(f"{path}: a directory (expected a HellaSwag jsonl file such as hellaswag_val.jsonl)")
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, text in enumerate(f, start=1):
                if limit is not None and len(examples) >= limit:
                    break
                if text.strip():
                    examples.append(parse_example(text, f"{path}:{n}", n))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    if not examples:
        raise DataError(f"{path}: holds no examples (one JSON object per line with ctx, endings, label)")
    return examples


def render(example: Example, tok, seq_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """The 4 candidates' tokens (ctx + " " + ending, the last seq_len kept) and masks (1: an ending token)."""
    ctx = tok.encode(example.ctx)
    rows, masks = [], []
    for ending in example.endings:
        end = tok.encode(" " + ending)
        rows.append((ctx + end)[-seq_len:])
        masks.append(([0] * len(ctx) + [1] * len(end))[-seq_len:])
    return rows, masks


@torch.no_grad()
def ending_losses(model: GPT, rows: list[list[int]], masks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per candidate: the sum and the mean of its ending tokens' cross-entropy (float32, on the CPU)."""
    device = next(model.parameters()).device
    T = max(len(r) for r in rows)
    tokens = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, (row, m) in enumerate(zip(rows, masks)):
        tokens[i, :len(row)] = torch.tensor(row)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    tokens, mask = tokens.to(device), mask.to(device)
    logits = model(tokens).float()
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1),
                             reduction="none").view(len(rows), T - 1)
    scored = mask[:, 1:]  # the first token has no position before it
    total = (losses * scored).sum(dim=1)
    return total.cpu(), (total / scored.sum(dim=1)).cpu()


def score(model: GPT, examples: list[Example], tokenizer: str, file) -> tuple[int, int]:
    """(correct by summed ending loss, correct by mean ending loss) of a model on the examples."""
    tok = get_tokenizer(tokenizer)
    seq_len, vocab = model.config.seq_len, model.config.vocab_size
    correct = correct_norm = 0
    for ex in examples:
        rows, masks = render(ex, tok, seq_len)
        top = max(max(r) for r in rows)
        if top >= vocab:
            raise DataError(f"{Path(file)}:{ex.line}: token id {top} (tokenizer {tokenizer}) is not below the "
                            f"model's vocabulary size {vocab}: use the tokenizer the model was trained with "
                            f"(--tokenizer)")
        total, mean = ending_losses(model, rows, masks)
        correct += int(int(total.argmin()) == ex.label)
        correct_norm += int(int(mean.argmin()) == ex.label)
    return correct, correct_norm
