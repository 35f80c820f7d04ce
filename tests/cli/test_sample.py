"""`pipegpt sample`: generation from a checkpoint equals hand-written loops over the same model; seeded draws
repeat; the context is cropped to seq_len; bad inputs are one `Error:` line with exit status 2."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, invoke, run_pipegpt
from pipegpt.state import checkpoint
from pipegpt.config import ModelConfig
from pipegpt.data.tokenizers import ByteTokenizer
from pipegpt.model.gpt import GPT
from pipegpt.infer.job import InferenceJob, Layout
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


PROMPTS = ["def f(x):", "a", "hello!"]


def test_several_prompts_in_one_process_each_equal_a_loop_of_their_own(ckpt, tmp_path):
    """Prompt i draws from seed + i: in one batch, in batches of 2 and from a file, the tokens of the loop alone."""
    path, gpt = ckpt
    expected = [generate(gpt, list(p.encode()), 6, 0.9, 20, torch.Generator().manual_seed(4 + i), 256)
                for i, p in enumerate(PROMPTS)]
    args = ["--max-new-tokens", 6, "--temperature", 0.9, "--top-k", 20, "--seed", 4, "--device", "cpu", "--json"]
    prompts = [x for p in PROMPTS for x in ("--prompt", p)]
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    for extra in (prompts, [*prompts, "--batch", 2], ["--prompts-file", tmp_path / "prompts.txt"]):
        result = cli(path, *args, *extra)
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in result.stdout.splitlines()]
        assert [r["new_tokens"] for r in rows] == expected and [r["prompt"] for r in rows] == PROMPTS
        assert "tokens/s (one process)" in result.stderr
    text = cli(path, *args[:-1], *prompts)
    assert text.stdout == "\n---------------\n".join(ByteTokenizer().decode(list(p.encode()) + t)
                                                   for p, t in zip(PROMPTS, expected)) + "\n"


def test_a_layout_or_prompts_that_cannot_run_are_refused_before_any_worker_starts(ckpt, tmp_path, no_workers):
    path, _ = ckpt
    assert_one_line_error(cli(path, "--stages", 3), "--stages 3", "2 layers", "at most 2")
    # 9 + 8 tokens: the 8th new one is never fed back, so 16 positions hold them (refused one token early before)
    assert_one_line_error(cli(path, "--stages", 2, "--prompt", PROMPT, "--max-new-tokens", 9),
                          "--max-new-tokens 9 is past the context", "9 tokens", "seq_len=16", "--max-new-tokens 8")
    assert_one_line_error(cli(path, "--tp", 2, "--prompt", "x" * 17, "--max-new-tokens", 1),
                          "prompt 1 has 17 tokens", "a prompt of at most seq_len=16 tokens")
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert_one_line_error(cli(path, "--prompts-file", tmp_path / "empty.txt"), "empty.txt", "holds no prompts")
    assert_one_line_error(cli(path, "--prompts-file", tmp_path / "nowhere.txt"), "nowhere.txt", "no such file")
    assert_one_line_error(cli(path, "--prompts-file", tmp_path), "a directory")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    assert_one_line_error(cli(path, "--prompts-file", tmp_path / "latin1.txt"), "latin1.txt", "not UTF-8")
    (tmp_path / "p.txt").write_text("a\n")
    assert_one_line_error(cli(path, "--prompt", "a", "--prompts-file", tmp_path / "p.txt"), "not both")
    assert_one_line_error(cli(path, "--stages", 0), "--stages")
    assert not no_workers


def test_more_ranks_than_cores_is_a_warning(ckpt):
    path, _ = ckpt
    cores = len(os.sched_getaffinity(0))
    said = []
    job = InferenceJob(path, Layout(stages=2, tp=2, dp=cores), device="cpu", warn=said.append)
    assert job.cluster is None and len(said) == 1
    assert f"{4 * cores} worker processes on {cores} CPU cores" in said[0]
    said.clear()
    InferenceJob(path, Layout(stages=1), device="cpu", warn=said.append)
    assert not said


def test_on_workers_a_full_context_samples_what_one_process_does(ckpt):
    """9 prompt tokens and 8 new ones fill seq_len=16 (the last one is never fed back): workers give them all."""
    path, _ = ckpt
    args = ["sample", path, "--prompt", PROMPT, "--max-new-tokens", 8, "--temperature", 0, "--device", "cpu", "--json"]
    one = cli(*args[1:])
    assert one.exit_code == 0, one.output
    proc = run_pipegpt(*args, "--stages", 2, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == one.stdout and len(json.loads(proc.stdout)["new_tokens"]) == 8


@pytest.mark.slow  # three jobs of workers
def test_on_workers_it_prints_what_one_process_prints(ckpt, tmp_path):
    """`--stages 2 --tp 2` and `--dp 2` print what `--stages 1` prints, and `--stages 1` what one process does."""
    path, _ = ckpt
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    args = ["sample", path, "--prompts-file", tmp_path / "prompts.txt", "--max-new-tokens", 7, "--temperature", 0.8,
            "--device", "cpu", "--json"]
    one = cli(*args[1:])
    assert one.exit_code == 0, one.output
    for layout in (["--stages", 1], ["--stages", 2, "--tp", 2], ["--dp", 2, "--batch", 2]):
        proc = run_pipegpt(*args, *layout, timeout=240)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == one.stdout, layout
