"""`pipegpt hellaswag`: acc and acc_norm equal a hand-written scoring of the same examples with the same model
(each candidate run alone, unpadded, its ending tokens' losses picked by position); candidates longer than
seq_len keep their last seq_len tokens; bad inputs are one `Error:` line with exit status 2."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, invoke, run_pipegpt
from pipegpt.state import checkpoint
from pipegpt.config import ModelConfig
from pipegpt.data.tokenizers import ByteTokenizer
from pipegpt.data.hellaswag import Example, ending_losses, render
from pipegpt.tools.hellaswag import evaluate
from pipegpt.model.gpt import GPT

MODEL = ModelConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=32)
EXAMPLES = [  # bytes tokenizer: one token per character; seq_len 32
    ("The cat sat on the", ["mat.", "quantum chromodynamics lecture", "x", "roof of the old red barn"]),
    ("She opened the door and", ["walked in.", "ate it", "the door opened her", "zzzz"]),
    ("A man is standing on a ladder and he is painting the wall of the house while",  # ctx cut at seq_len
     ["singing.", "his dog barks at the mailman", "it rains", "the paint dries"]),
    ("def f(x):", ["return x", "print(x) and then some more text that runs past the window", "pass", ""]),
    ("1, 2, 3,", ["4, 5", "banana", "3, 2, 1", "four"]),
    ("Hello", ["world", "there, how are you doing today my friend", "!", "Hello"]),
]


def make_checkpoint(path, model: ModelConfig = MODEL, seed: int = 3) -> GPT:
    gpt = GPT(model, init_seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # far from the initial values (near-uniform logits), so that endings score differently
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    state = {name: p.detach() for name, p in gpt.named_parameters()}
    checkpoint.write_weights(path, state, {"model": dataclasses.asdict(model), "tokenizer": "bytes"})
    return gpt


def write_jsonl(path, labels, examples=EXAMPLES):
    path.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": lab}) + "\n"
                            for (c, e), lab in zip(examples, labels)))
    return path


@torch.no_grad()
def oracle(model: GPT, ctx: str, ending: str) -> tuple[float, float]:
    """Sum and mean of the ending tokens' losses: the candidate alone, the last seq_len tokens kept."""
    ctx_ids, end_ids = list(ctx.encode()), list((" " + ending).encode())
    row = (ctx_ids + end_ids)[-model.config.seq_len:]
    first = max(len(row) - len(end_ids), 1)  # the first ending token in the window with a token before it
    logp = F.log_softmax(model(torch.tensor([row]))[0].double(), dim=-1)
    losses = [-float(logp[j - 1, row[j]]) for j in range(first, len(row))]
    return sum(losses), sum(losses) / len(losses)


def predictions(model: GPT, examples=EXAMPLES) -> tuple[list[int], list[int]]:
    """Per example: the argmin of the summed loss (acc) and of the mean loss (acc_norm)."""
    by_sum, by_mean = [], []
    for ctx, endings in examples:
        scores = [oracle(model, ctx, e) for e in endings]
        by_sum.append(min(range(4), key=lambda i: scores[i][0]))
        by_mean.append(min(range(4), key=lambda i: scores[i][1]))
    return by_sum, by_mean


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hellaswag") / "run" / "checkpoints" / "step-00000000"
    gpt = make_checkpoint(path)
    return path, gpt, predictions(gpt)


def cli(*args) -> "click.testing.Result":  # noqa: F821
    return invoke("hellaswag", *args)


def test_the_examples_exercise_cropping_and_the_two_scores(ckpt):
    path, gpt, (by_sum, by_mean) = ckpt
    seq_len = gpt.config.seq_len
    assert len(EXAMPLES[2][0]) > seq_len and len(" " + EXAMPLES[3][1][1]) > seq_len
    assert by_sum != by_mean  # acc and acc_norm pick differently somewhere: a swap would be seen
    assert len(set(by_mean)) > 1


def test_each_candidates_losses_equal_the_oracle(ckpt):
    """The batched, padded, masked losses equal each candidate's own, by position (not only their argmin)."""
    path, gpt, _ = ckpt
    for ctx, endings in EXAMPLES:
        rows, masks = render(Example(ctx, endings, 0, 1), ByteTokenizer(), gpt.config.seq_len)
        total, mean = ending_losses(gpt, rows, masks)
        expected = torch.tensor([oracle(gpt, ctx, e) for e in endings], dtype=torch.float64)
        torch.testing.assert_close(total.double(), expected[:, 0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(mean.double(), expected[:, 1], rtol=1e-5, atol=1e-5)


def test_acc_and_acc_norm_equal_the_oracle(ckpt, tmp_path):
    path, gpt, (by_sum, by_mean) = ckpt
    labels = [0, 1, 2, 3, 0, 1]
    data = write_jsonl(tmp_path / "val.jsonl", labels)
    correct = sum(p == lab for p, lab in zip(by_sum, labels))
    correct_norm = sum(p == lab for p, lab in zip(by_mean, labels))
    result = cli(path, "--file", data, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"hellaswag: 6 examples, acc {correct / 6:.4f}, acc_norm {correct_norm / 6:.4f}\n"
    got = json.loads(cli(path.parent.parent, "--file", data, "--device", "cpu", "--json").stdout)  # a run dir
    assert (got["examples"], got["correct"], got["correct_norm"]) == (6, correct, correct_norm)
    assert got["acc"] == correct / 6 and got["acc_norm"] == correct_norm / 6
    assert got["checkpoint"] == str(path) and got["tokenizer"] == "bytes"


def test_labels_the_model_prefers_score_one(ckpt, tmp_path):
    path, gpt, (by_sum, by_mean) = ckpt
    norm = evaluate(path, write_jsonl(tmp_path / "norm.jsonl", by_mean))
    assert (norm.acc_norm, norm.correct) == (1.0, sum(a == b for a, b in zip(by_sum, by_mean)))
    summed = evaluate(path, write_jsonl(tmp_path / "sum.jsonl", by_sum))
    assert summed.acc == 1.0 and summed.acc_norm < 1.0
    wrong = evaluate(path, write_jsonl(tmp_path / "wrong.jsonl", [(p + 1) % 4 for p in by_mean]))
    assert wrong.acc_norm == 0.0
    first = evaluate(path, write_jsonl(tmp_path / "limit.jsonl", by_mean[:2] + [(p + 1) % 4 for p in by_mean[2:]]),
                     limit=2)
    assert (first.examples, first.acc_norm) == (2, 1.0)


def test_bad_inputs_are_one_line_errors(ckpt, tmp_path):
    path, _, _ = ckpt
    good = json.dumps({"ctx": "a b", "endings": ["c", "d", "e", "f"], "label": 1})

    def bad(name: str, *lines: str):
        (tmp_path / name).write_text("".join(line + "\n" for line in lines))
        return tmp_path / name

    assert_one_line_error(cli(path, "--file", tmp_path / "nowhere.jsonl"), "nowhere.jsonl", "no such file")
    assert_one_line_error(cli(path, "--file", bad("blank.jsonl", "", "  ")), "holds no examples")
    assert_one_line_error(cli(path, "--file", bad("json.jsonl", good, "{not json")), "json.jsonl:2", "not valid JSON")
    assert_one_line_error(cli(path, "--file", bad("list.jsonl", "[1, 2]")), "list.jsonl:1", "expected an object")
    assert_one_line_error(cli(path, "--file", bad("fields.jsonl", '{"ctx": "a"}')), "fields.jsonl:1",
                          "'endings', 'label'")
    three = json.dumps({"ctx": "a", "endings": ["b", "c", "d"], "label": 0})
    assert_one_line_error(cli(path, "--file", bad("three.jsonl", good, three)), "three.jsonl:2", "list of 4 strings")
    for label in (4, -1, True, "x", 1.0):
        line = json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": label})
        assert_one_line_error(cli(path, "--file", bad("label.jsonl", line)), "label.jsonl:1", "label", "0..3")
    empty = json.dumps({"ctx": "", "endings": ["b", "c", "d", "e"], "label": 0})
    assert_one_line_error(cli(path, "--file", bad("ctx.jsonl", empty)), "ctx.jsonl:1", "non-empty string")
    (tmp_path / "empty").mkdir()
    data = bad("good.jsonl", good)
    assert_one_line_error(cli(tmp_path / "empty", "--file", data), "not a checkpoint")
    assert_one_line_error(cli(tmp_path / "gone", "--file", data), "no such file or directory")
    assert_one_line_error(cli(path, "--file", data, "--limit", 0), "--limit")
    narrow = tmp_path / "narrow"
    make_checkpoint(narrow, dataclasses.replace(MODEL, vocab_size=100))
    tilde = json.dumps({"ctx": "a~", "endings": ["b", "c", "d", "e"], "label": 0})
    assert_one_line_error(cli(narrow, "--file", bad("tilde.jsonl", tilde), "--device", "cpu"), "tilde.jsonl:1",
                   "token id 126", "vocabulary size 100")
    if not torch.cuda.is_available():
        assert_one_line_error(cli(path, "--file", data, "--device", "cuda"), "no CUDA GPU")


@pytest.mark.slow  # 11 s; scoring a checkpoint stays in the default set
def test_during_a_pipelined_run_it_scores_the_model_the_checkpoint_holds(tmp_path):
    """`pipegpt run --hellaswag` scores the 2-stage x tp-2 model on its workers at an evaluation step; its
    accuracies equal the oracle's on the checkpoint saved at that step."""
    from pipegpt.tools.sample import load_model

    labels = [0, 1, 2, 3, 0, 1]
    data = write_jsonl(tmp_path / "hs.jsonl", labels)
    run = tmp_path / "run"
    proc = run_pipegpt("run", "--stages", "2", "--tp", "2", "--microbatches", "2", "--steps", "2", "--n-layer", "2",
                       "--n-embd", "32", "--seq-len", "32", "--eval-every", "2", "--save-every", "2",
                       "--hellaswag", data, "--run-dir", run, timeout=240)
    assert proc.returncode == 0, proc.stderr
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    model, _, _ = load_model(run, "cpu")
    by_sum, by_mean = predictions(model.eval())
    assert last["hellaswag_acc"] == sum(p == lab for p, lab in zip(by_sum, labels)) / len(labels)
    assert last["hellaswag_acc_norm"] == sum(p == lab for p, lab in zip(by_mean, labels)) / len(labels)


def test_a_bad_file_is_refused_before_any_worker_starts(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 7}\n')
    result = invoke("run", "--eval-every", "1", "--hellaswag", bad, "--run-dir", tmp_path / "run")
    assert result.exit_code == 2 and "label" in result.output and not (tmp_path / "run").exists()


def test_a_layout_the_model_cannot_take_is_refused_before_any_worker_starts(ckpt, tmp_path, no_workers):
    path, _, _ = ckpt
    data = write_jsonl(tmp_path / "hs.jsonl", [0])
    assert_one_line_error(cli(path, "--file", data, "--stages", 3), "--stages 3", "2 layers", "at most 2")
    assert_one_line_error(cli(path, "--file", data, "--stages", 2, "--tp", 3), "tp")
    assert not no_workers


@pytest.mark.slow  # two jobs of workers
def test_on_workers_it_gives_the_one_process_accuracies(ckpt, tmp_path):
    path, _, (by_sum, by_mean) = ckpt
    labels = [0, 1, 2, 3, 0, 1]
    data = write_jsonl(tmp_path / "val.jsonl", labels)
    one = json.loads(cli(path, "--file", data, "--device", "cpu", "--json").stdout)
    assert (one["correct"], one["correct_norm"]) == (sum(p == lab for p, lab in zip(by_sum, labels)),
                                                     sum(p == lab for p, lab in zip(by_mean, labels)))
    for layout in (["--stages", "2", "--tp", "2"], ["--stages", "2", "--dp", "2"]):
        proc = run_pipegpt("hellaswag", path, "--file", data, "--device", "cpu", "--json", *layout, timeout=240)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == one
