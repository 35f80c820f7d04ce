"""Inference on workers equals one process. Generation, token for token, against tools.sample.generate (nanoGPT's
loop, one prompt at a time, prompt i's generator seeded with seed + i): GPT-2 and a grouped-query Llama, greedy
and seeded, prompts of different lengths in one batch, in groups through the stages. HellaSwag: the one-process
acc and acc_norm exactly, and every candidate's ending loss sum. The workers stay up across the cases of a layout
(tests/distributed/inference_host.py); pp 2 is the default set, pp 2 x tp 2, pp 4, --stages 1 and dp 2 are slow."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import one_thread
from inference_host import InferenceHost
from pipegpt.config import ModelConfig
from pipegpt.data.hellaswag import ending_losses, read_examples, render, render_all, score
from pipegpt.data.tokenizers import ByteTokenizer
from pipegpt.infer.job import Layout
from pipegpt.infer.sampling import SamplingSettings
from pipegpt.model.gpt import GPT
from pipegpt.state import checkpoint
from pipegpt.tools.sample import generate

MODELS = {
    "gpt2": ModelConfig(vocab_size=256, seq_len=48, n_layer=4, n_head=4, n_embd=32),
    "llama": ModelConfig(arch="llama", vocab_size=256, seq_len=48, n_layer=4, n_head=4, n_kv_head=2, n_embd=32),
}
PROMPTS = ["def f(x):", "a", "the pipeline sends activations", "xy", "Hello there"]  # 5 lengths: 2 groups at pp 2
SETTINGS = {"greedy": SamplingSettings(16, 0, None, 7, vocab_limit=256),
            "seeded": SamplingSettings(16, 0.9, 20, 7, vocab_limit=256)}
HELLASWAG = [  # bytes: a token per character; the third context is longer than seq_len (cropped)
    ("The cat sat on the", ["mat.", "quantum chromodynamics lecture", "x", "roof of the old red barn"]),
    ("She opened the door and", ["walked in.", "ate it", "the door opened her", "zzzz"]),
    ("A man is standing on a ladder and he is painting the wall of the house while",
     ["singing.", "his dog barks at the mailman", "it rains", "the paint dries"]),
    ("def f(x):", ["return x", "print(x) and then some more text that runs past the window", "pass", ""]),
    ("1, 2, 3,", ["4, 5", "banana", "3, 2, 1", "four"]),
]

FAST = [Layout(2)]
SLOW = [Layout(2, tp=2), Layout(4), Layout(1), Layout(1, dp=2)]
SCORES = [Layout(2), Layout(2, tp=2), Layout(4)]  # HellaSwag: a pipeline, with and without tp
# Grouped by layout, so that one job of workers is up at a time; each layout: both models' generation, then HellaSwag.
CASES = [pytest.param(layout, case, id=f"{layout.describe().replace(' ', '')}-{case}",
                      marks=[pytest.mark.slow] if layout in SLOW else [])
         for layout in FAST + SLOW for case in [*MODELS, "hellaswag"][:3 if layout in SCORES else 2]]


def make_checkpoint(path, model: ModelConfig, seed: int = 3) -> GPT:
    """Weights far from the initial values (near-uniform logits), so that draws and scores depend on them."""
    gpt = GPT(model, init_seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    checkpoint.write_weights(path, {n: p.detach() for n, p in gpt.named_parameters()},
                             {"model": dataclasses.asdict(model), "tokenizer": "bytes"})
    return gpt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference")
    return {name: (root / name, make_checkpoint(root / name, model)) for name, model in MODELS.items()}


@pytest.fixture(scope="module")
def hosts(models):
    """The InferenceHost of a layout, started on first use; the previous layout's job is closed then."""
    made = {}

    def host(layout):
        if layout not in made:
            for other in made.values():
                other.close()
            made.clear()
            made[layout] = InferenceHost(models["gpt2"][0], layout)
        return made[layout]

    yield host
    for host in made.values():
        host.close()


def one_process(gpt: GPT, prompts: list[list[int]], settings: SamplingSettings) -> list[list[int]]:
    with one_thread():
        return [generate(gpt, ids, settings.max_new_tokens, settings.temperature, settings.top_k,
                         torch.Generator().manual_seed(settings.seed + i), settings.vocab_limit)
                for i, ids in enumerate(prompts)]


@pytest.mark.parametrize("layout,case", CASES)
def test_on_workers_equals_one_process(hosts, models, layout, case, tmp_path):
    if case == "hellaswag":
        check_hellaswag(hosts(layout), models, tmp_path)
    else:
        check_generation(hosts(layout), models, case)


@pytest.mark.slow
def test_generation_under_order_matching_on_pair_groups_equals_one_process(models):
    """The CUDA path's messages on CPU: matched by order, each direction of each pair of neighbours on its own
    group; 4 stages, so the tokens go from the last rank back to the first on the wrap-around pair's."""
    host = InferenceHost(models["gpt2"][0], Layout(4), runtime={"p2p_matching": "order", "p2p_groups": "pairs"})
    try:
        check_generation(host, models, "gpt2")
    finally:
        host.close()


def check_generation(host, models, model):
    """Greedy and seeded, the prompts in one batch and in batches of 2, token for token."""
    path, gpt = models[model]
    prompts = [list(p.encode()) for p in PROMPTS]
    for name, settings in SETTINGS.items():
        expected = one_process(gpt, prompts, settings)
        assert len({tuple(t) for t in expected}) > 1 and any(len(set(t)) > 1 for t in expected)  # not degenerate
        assert host.generate(path, prompts, settings) == expected, (model, name)
    # batches one after another: each prompt keeps its own generator
    assert host.generate(path, prompts, SETTINGS["seeded"], batch=2) == expected


def check_hellaswag(host, models, tmp_path):
    """acc and acc_norm exactly, and each candidate's summed and mean ending loss."""
    path, gpt = models["llama"]
    file = tmp_path / "hellaswag.jsonl"
    file.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": k % 4}) + "\n"
                            for k, (c, e) in enumerate(HELLASWAG)))
    examples = read_examples(file)
    with one_thread():
        expected = score(gpt, examples, "bytes", file)
        losses = [ending_losses(gpt, *render(ex, ByteTokenizer(), gpt.config.seq_len)) for ex in examples]
    assert 0 < expected[1] < len(examples)
    rendered = render_all(examples, "bytes", gpt.config.seq_len, gpt.config.vocab_size, file)
    (correct, correct_norm), scores = host.hellaswag(path, examples, rendered)
    assert (correct, correct_norm) == expected
    for i, (total, mean) in enumerate(losses):
        got = torch.tensor(scores[i], dtype=torch.float64)
        torch.testing.assert_close(got[:, 0], total.double(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got[:, 0] / got[:, 1], mean.double(), rtol=1e-5, atol=1e-5)
