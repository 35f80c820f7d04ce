"""Evaluation: the forward-only plan, run by the same runtime, gives the one-process model's validation loss, and
--hellaswag's scores on the workers the one-process acc and acc_norm, with nothing of the model on the driver.
(The plan itself, for every schedule, is tests/unit/test_evaluation_plan.py.)"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from helpers import clean_env, one_thread
from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.data.hellaswag import read_examples, score
from pipegpt.model.gpt import GPT
from pipegpt.state import checkpoint
from pipegpt.data.loader import BatchSampler
from pipegpt.data.tokenizers import get_tokenizer
from pipegpt.data.tokens import builtin_tokens
from pipegpt.model.gpt import build_reference_model

from cluster_host import ClusterHost

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, n_embd=32)
BATCHES = 2


def reference_val_loss(cfg: TrainConfig) -> float:
    """The mean microbatch loss over the eval batches, in one process: windows of the built-in corpus drawn
    with seed + 1 (it has no held-out split), the same global batches for every layout."""
    model = build_reference_model(cfg.model, cfg.runtime.seed).to(getattr(torch, cfg.runtime.dtype)).eval()
    sampler = BatchSampler(builtin_tokens(get_tokenizer("bytes")), cfg.batch_size, cfg.model.seq_len,
                           cfg.runtime.seed + 1)
    losses = []
    with torch.no_grad():
        for k in range(BATCHES):
            x, y = sampler.batch(k)
            mbs = cfg.parallel.microbatch_size
            losses += [float(model(xm, ym)) for xm, ym in zip(x.split(mbs), y.split(mbs))]
    return sum(losses) / len(losses)


GRIDS = {"p2": {"stages": 2}, "p2-dp2": {"stages": 2, "dp": 2}, "p2-tp2": {"stages": 2, "tp": 2}}
SCHEDULE_CASES = [("1f1b", "p2"), ("zbv", "p2"), ("interleaved-1f1b", "p2"), ("zb-h1", "p2-dp2"), ("1f1b", "p2-tp2")]


@pytest.fixture(scope="module")
def hosts():
    made = {}
    yield lambda grid, cfg: made.setdefault(grid, ClusterHost(cfg))
    for host in made.values():
        host.close()


# p2-tp2 is slow: its own worker grid; tensor-parallel forwards are checked against one process by the oracle.
# zbv and interleaved-1f1b too (the default suite's time): 1f1b and zb-h1 x dp2 stand for the schedules.
@pytest.mark.parametrize("schedule,grid", [pytest.param(s, g, marks=pytest.mark.slow)
                                           if g == "p2-tp2" or s in ("zbv", "interleaved-1f1b") else (s, g)
                                           for s, g in SCHEDULE_CASES], ids=[f"{s}-{g}" for s, g in SCHEDULE_CASES])
def test_validation_loss_equals_one_process(hosts, schedule, grid):
    cfg = TrainConfig.build(MODEL, schedule=schedule, microbatches=4, microbatch_size=2, device="cpu", seed=3,
                            timeout_s=60, eval_batches=BATCHES, **GRIDS[grid])
    loss = hosts(grid, cfg).evaluate(cfg)
    assert loss == pytest.approx(reference_val_loss(cfg), rel=1e-5)


HELLASWAG = [  # bytes: a token per character, most contexts cropped to seq_len 16
    ("The cat sat on the", ["mat.", "quantum chromodynamics lecture", "x", "roof of the old red barn"]),
    ("She opened the door and", ["walked in.", "ate it", "the door opened her", "zzzz"]),
    ("def f(x):", ["return x", "print(x)", "pass", ""]),
    ("1, 2, 3,", ["4, 5", "banana", "3, 2, 1", "four"]),
    ("Hello", ["world", "there, how are you", "!", "Hello"]),
]


def hellaswag_case(tmp_path):
    """A jsonl of HELLASWAG, and a weights-only checkpoint of MODEL far from its initial values (and that model)."""
    file = tmp_path / "hellaswag.jsonl"
    file.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": k % 4}) + "\n"
                            for k, (c, e) in enumerate(HELLASWAG)))
    gpt = GPT(MODEL, init_seed=5).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    path = tmp_path / "weights"
    checkpoint.write_weights(path, {n: p.detach() for n, p in gpt.named_parameters()},
                             {"model": dataclasses.asdict(MODEL), "tokenizer": "bytes"})
    return file, path, gpt


HELLASWAG_GRIDS = {"p2": {"stages": 2}, "p2-tp2": {"stages": 2, "tp": 2}, "p2-cp2": {"stages": 2, "cp": 2}}


@pytest.mark.parametrize("grid", [g if g == "p2" else pytest.param(g, marks=pytest.mark.slow)
                                  for g in HELLASWAG_GRIDS])
def test_hellaswag_during_training_is_scored_on_the_workers(hosts, grid, tmp_path):
    """--hellaswag's acc and acc_norm, scored by the training workers in their layout, equal the one-process
    scoring of the same weights (pipegpt.data.hellaswag.score)."""
    file, path, gpt = hellaswag_case(tmp_path)
    cfg = TrainConfig.build(MODEL, schedule="1f1b", microbatches=4, microbatch_size=2, device="cpu", seed=3,
                            timeout_s=60, eval_every=1, hellaswag=str(file), **HELLASWAG_GRIDS[grid])
    examples = read_examples(file)
    with one_thread():
        correct, correct_norm = score(gpt, examples, "bytes", file)
    assert 0 < correct_norm < len(examples)  # the labels are neither all the model's choices nor none of them
    acc, acc_norm = hosts(grid, cfg).hellaswag(cfg, path)
    assert (acc, acc_norm) == (correct / len(examples), correct_norm / len(examples))


PEAK = "import resource, sys\nfrom pipegpt.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n" \
       "    print('driver peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr)\n"


@pytest.mark.slow
def test_hellaswag_during_training_builds_no_model_on_the_driver(tmp_path):
    """A run with --hellaswag (2 stages of 14M parameters each) peaks on the driver within one stage's parameters of
    the same run without it: gathering the model there (what the driver did before) takes the whole model twice,
    as it arrives and as a GPT."""
    file, _, _ = hellaswag_case(tmp_path)
    model = ["--n-layer", "4", "--n-embd", "768", "--n-head", "4", "--seq-len", "16", "--vocab-size", "256"]
    stage_bytes = 2 * 12 * 768 * 768 * 4  # two blocks' matrices in fp32
    peaks = {}
    for name, extra in (("without", []), ("with", ["--hellaswag", str(file)])):
        run = subprocess.run([sys.executable, "-c", PEAK, "run", *model, "--stages", "2", "--steps", "1",
                              "--microbatches", "2", "--microbatch-size", "1", "--eval-every", "1", "--eval-batches",
                              "1", "--device", "cpu", "--run-dir", str(tmp_path / name), *extra],
                             env=clean_env(), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        peaks[name] = int(run.stderr.rsplit("driver peak ", 1)[1].split()[0])
        assert name == "without" or "hellaswag_acc" in (tmp_path / name / "metrics.jsonl").read_text()
    assert peaks["with"] - peaks["without"] < stage_bytes, (peaks, stage_bytes)
