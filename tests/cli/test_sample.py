"""`pipegpt sample`: generation from a checkpoint equals hand-written loops over the same model; seeded draws
repeat; the context is cropped to seq_len; bad inputs are one `Error:` line with exit status 2."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, invoke
from pipegpt.state import checkpoint
from pipegpt.config import ModelConfig
from pipegpt.data.tokenizers import ByteTokenizer
from pipegpt.model.gpt import GPT
from pipegpt.tools.sample import generate, load_model, sample

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, n_embd=32)
PROMPT = "def f(x):"  # 9 tokens: with 24 new ones the context outgrows seq_len=16 and is cropped


def make_checkpoint(path, model: ModelConfig = MODEL, seed: int = 3):
    gpt = GPT(model, init_seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # far from the initial values (near-uniform logits), so that draws depend on them
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    state = {name: p.detach() for name, p in gpt.named_parameters()}
    checkpoint.write_weights(path, state, {"model": dataclasses.asdict(model), "tokenizer": "bytes"})
    return gpt


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("sample") / "run" / "checkpoints" / "step-00000000"
    return path, make_checkpoint(path)


def cli(*args) -> "click.testing.Result":  # noqa: F821
    return invoke("sample", *args)


@torch.no_grad()
def argmax_loop(model: GPT, ids: list[int], n: int) -> list[int]:
    for _ in range(n):
        ids = ids + [int(model(torch.tensor([ids[-model.config.seq_len:]]))[0, -1].argmax())]
    return ids


def test_greedy_equals_an_argmax_loop_over_the_same_model(ckpt):
    path, gpt = ckpt
    expected = argmax_loop(gpt, list(PROMPT.encode()), 24)
    result = cli(path, "--prompt", PROMPT, "--max-new-tokens", 24, "--temperature", 0, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout == ByteTokenizer().decode(expected) + "\n"
    run_dir = path.parent.parent  # a run directory's latest checkpoint
    got = sample(run_dir, PROMPT, 24, temperature=0, top_k=None, seed=0, device="cpu")
    assert got.prompt_tokens + got.new_tokens == expected and got.checkpoint == path
    assert len(set(got.new_tokens)) > 1  # not a degenerate model
    top1 = sample(path, PROMPT, 24, temperature=0.8, top_k=1, seed=5, device="cpu")
    assert top1.new_tokens == got.new_tokens


def test_seeded_sampling_repeats_and_equals_a_hand_written_loop(ckpt):
    path, gpt = ckpt
    args = [path, "--prompt", PROMPT, "--max-new-tokens", 30, "--temperature", 0.9, "--top-k", 20,
            "--device", "cpu"]
    first, again, other = cli(*args, "--seed", 1), cli(*args, "--seed", 1), cli(*args, "--seed", 2)
    assert first.exit_code == again.exit_code == other.exit_code == 0, first.output
    assert first.stdout == again.stdout != other.stdout
    ids, g = list(PROMPT.encode()), torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(30):
            logits = gpt(torch.tensor([ids[-16:]]))[0, -1] / 0.9
            logits[logits < torch.topk(logits, 20).values[-1]] = -float("inf")
            ids.append(int(torch.multinomial(F.softmax(logits, -1), 1, generator=g)))
    assert first.stdout == ByteTokenizer().decode(ids) + "\n"


def test_tokens_the_tokenizer_cannot_decode_are_never_drawn(tmp_path):
    """A 300-token model under the 256-token byte tokenizer: rows 256..299 exist but are never drawn."""
    path = tmp_path / "wide"
    gpt = make_checkpoint(path, dataclasses.replace(MODEL, vocab_size=300))
    model, _, _ = load_model(path)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([[1, 2, 3]])), gpt(torch.tensor([[1, 2, 3]])))
    got = generate(model, [1, 2, 3], 200, temperature=2.0, generator=torch.Generator().manual_seed(0),
                   vocab_limit=256)
    assert max(got) < 256 and len(set(got)) > 20
    result = cli(path, "--prompt", "x", "--max-new-tokens", 50, "--temperature", 2, "--device", "cpu")
    assert result.exit_code == 0, result.output


def test_bad_inputs_are_one_line_errors(ckpt, tmp_path):
    path, _ = ckpt
    (tmp_path / "empty").mkdir()
    assert_one_line_error(cli(tmp_path / "empty", "--prompt", "a"), "not a checkpoint")
    assert_one_line_error(cli(tmp_path / "nowhere", "--prompt", "a"), "no such file or directory")
    assert_one_line_error(cli(path, "--temperature", -0.5), "temperature=-0.5", ">= 0")
    assert_one_line_error(cli(path, "--top-k", 0), "top-k=0", ">= 1")
    assert_one_line_error(cli(path, "--max-new-tokens", -1), "max-new-tokens=-1")
    assert_one_line_error(cli(path, "--prompt", "", "--device", "cpu"), "no tokens")
    narrow = tmp_path / "narrow"
    make_checkpoint(narrow, dataclasses.replace(MODEL, vocab_size=100))
    assert_one_line_error(cli(narrow, "--prompt", "abc~", "--device", "cpu"), "token id 126", "vocabulary size 100")
    if not torch.cuda.is_available():
        assert_one_line_error(cli(path, "--device", "cuda"), "no CUDA GPU")
