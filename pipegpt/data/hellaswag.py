"""HellaSwag accuracy of a checkpoint, nanoGPT's scoring: in one process (score), or on the workers of a run or an
inference job in their layout (score_on_engine; the driver's render_all, combine_scores and count_correct).

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
from pipegpt.context_parallel.chunks import shard_sequence
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


def _check_vocabulary(rows: list[list[int]], example: Example, tokenizer: str, vocab: int, file) -> None:
    top = max(max(r) for r in rows)
    if top >= vocab:
        raise DataError(f"{Path(file)}:{example.line}: token id {top} (tokenizer {tokenizer}) is not below the "
                        f"model's vocabulary size {vocab}: use the tokenizer the model was trained with "
                        f"(--tokenizer)")


def score(model: GPT, examples: list[Example], tokenizer: str, file) -> tuple[int, int]:
    """(correct by summed ending loss, correct by mean ending loss) of a model on the examples."""
    tok = get_tokenizer(tokenizer)
    seq_len, vocab = model.config.seq_len, model.config.vocab_size
    correct = correct_norm = 0
    for ex in examples:
        rows, masks = render(ex, tok, seq_len)
        _check_vocabulary(rows, ex, tokenizer, vocab, file)
        total, mean = ending_losses(model, rows, masks)
        correct += int(int(total.argmin()) == ex.label)
        correct_norm += int(int(mean.argmin()) == ex.label)
    return correct, correct_norm


# Scoring on the workers, in the run's layout, with the evaluation plan: the driver renders every example once
# (render_all). Each data-parallel replica takes every dp-th example; a step of the forward-only plan carries one
# example per microbatch (its 4 candidates are the microbatch's sequences, right-padded to the longest of the
# step), and the last stage's ranks report per candidate the sum of its ending tokens' losses and how many there
# were (pipegpt.stages.Stage.per_row). Under context parallelism each cp rank holds its chunks of the sequences and
# reports its part of the sums. The driver adds the parts (combine_scores) and picks the answers (count_correct):
# numbers travel, never weights.

Rendered = list[tuple[list[int], int]]  # per candidate: its tokens and where its scored ending starts in them


def render_all(examples: list[Example], tokenizer: str, seq_len: int, vocab: int, file) -> list[Rendered]:
    """Every example's 4 candidates as render() makes them, each (tokens, index of its first ending token);
    a token id the model cannot take is a DataError naming the line."""
    tok = get_tokenizer(tokenizer)
    out = []
    for ex in examples:
        rows, masks = render(ex, tok, seq_len)
        _check_vocabulary(rows, ex, tokenizer, vocab, file)
        out.append([(row, mask.index(1) if 1 in mask else len(mask)) for row, mask in zip(rows, masks)])
    return out


def count_correct(examples: list[Example], scores: dict[int, list[list[float]]]) -> tuple[int, int]:
    """(correct by summed ending loss, correct by mean ending loss) from each example's per-candidate
    [sum of losses, tokens scored], as score() picks: the first candidate with the least."""
    correct = correct_norm = 0
    for i, ex in enumerate(examples):
        sums = [total for total, _ in scores[i]]
        means = [total / count for total, count in scores[i]]
        correct += int(min(range(ENDINGS), key=sums.__getitem__) == ex.label)
        correct_norm += int(min(range(ENDINGS), key=means.__getitem__) == ex.label)
    return correct, correct_norm


Scores = list[tuple[int, list[list[float]]]]  # (example index, per candidate [sum of losses, tokens scored])


def score_on_engine(engine, rendered: list[Rendered]) -> Scores | None:
    """This rank's part of scoring the examples: what the last stage's ranks of tp index 0 report (one per cp
    rank), None on every other rank."""
    mesh, sharding = engine.mesh, engine.sharding
    plan = engine.eval_runtime.plan
    m = plan.num_microbatches
    # a sequence cuts into 2 x cp chunks, and again over tp under sequence parallelism
    multiple = (2 * sharding.cp if sharding.cp > 1 else 1) * (sharding.tp if sharding.splits_sequence else 1)
    mine = list(range(mesh.dp_index, len(rendered), sharding.dp))
    reports = mesh.tp_index == 0 and plan.num_stages - 1 in engine.stages
    # with experts over ep, the replicas' MoE layers exchange tokens at every forward: all run as many steps
    steps = -(-len(rendered) // sharding.dp) if engine.parallelism.ep > 1 else len(mine)
    scores: Scores = []
    for start in range(0, steps, m):
        examples = mine[start:start + m]
        length = max((len(tokens) for i in examples for tokens, _ in rendered[i]), default=1)
        length = -(-length // multiple) * multiple
        inputs, targets = [], []
        for k in range(m):  # a step short of examples fills its microbatches with candidates scoring nothing
            x, y = _candidates(rendered[examples[k]] if k < len(examples) else [], length)
            inputs.append(engine.to_device(shard_sequence(x, mesh.cp_index, sharding.cp)))
            targets.append(engine.to_device(shard_sequence(y, mesh.cp_index, sharding.cp)))
        shape = (ENDINGS, sharding.tokens_per_rank(length), engine.width)
        rows = engine.score_rows(inputs, targets, shape)
        if reports:
            scores += [(i, rows[k]) for k, i in enumerate(examples)]
    return scores if reports else None


def _candidates(example: Rendered, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [4, length] (0 after each candidate's end) and targets (the next token where it is an ending token,
    else -1: the context and the padding are not scored, nor a first token without one before it)."""
    x = torch.zeros((ENDINGS, length), dtype=torch.long)
    y = torch.full((ENDINGS, length), -1, dtype=torch.long)
    for j, (tokens, ending) in enumerate(example):
        x[j, :len(tokens)] = torch.tensor(tokens)
        first = max(ending, 1)
        y[j, first - 1:len(tokens) - 1] = torch.tensor(tokens[first:], dtype=torch.long)
    return x, y


def combine_scores(answers: list[Scores | None]) -> dict[int, list[list[float]]]:
    """Every example's per-candidate [sum, count] from the ranks' reports: cp ranks' parts added."""
    combined: dict[int, list[list[float]]] = {}
    for scores in answers:
        for i, rows in scores or ():
            if i in combined:
                combined[i] = [[a + c, b + d] for (a, b), (c, d) in zip(combined[i], rows)]
            else:
                combined[i] = [list(row) for row in rows]
    return combined
