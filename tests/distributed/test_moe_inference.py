"""A mixture of experts on inference workers with its experts over ep (--dp 2 --ep 2) equals one process: greedy
and seeded tokens, prompts split unevenly over the replicas (a replica of fewer prompts runs stand-ins, as its
MoE layers exchange tokens with the other's at every forward), HellaSwag's acc, acc_norm and every candidate's
loss sum; the router biases (which choose the experts) are loaded. Also HellaSwag during a `pipegpt run --dp 2
--ep 2` against the checkpoint of that step (slow), and the layouts refused in one line."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import assert_one_line_error, invoke, run_pipegpt
from inference_host import InferenceHost
from test_inference import HELLASWAG, PROMPTS, SETTINGS, check_hellaswag, one_process
from pipegpt.config import ModelConfig
from pipegpt.infer.job import Layout
from pipegpt.model.gpt import GPT
from pipegpt.state import checkpoint

MODEL = ModelConfig(arch="llama", vocab_size=256, seq_len=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, bias=False,
                    n_experts=4, n_experts_per_token=2, n_shared_experts=1, expert_hidden=24)


def make_moe_checkpoint(path, seed: int = 3) -> GPT:
    """Weights far from the initial values, and router biases large enough to change which experts are chosen."""
    gpt = GPT(MODEL, init_seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        biases = {n: b for n, b in gpt.named_buffers() if n.endswith("expert_bias")}
        for b in biases.values():
            b.copy_(0.2 * torch.randn(b.shape, generator=g))
    state = {n: p.detach() for n, p in gpt.named_parameters()} | biases
    checkpoint.write_weights(path, state, {"model": dataclasses.asdict(MODEL), "tokenizer": "bytes"})
    return gpt


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "ckpt"
    return path, make_moe_checkpoint(path)


@pytest.mark.parametrize("layout", [Layout(1, dp=2, ep=2),
                                    pytest.param(Layout(2, dp=2, ep=2), marks=pytest.mark.slow)],
                         ids=lambda layout: layout.describe().replace(" ", ""))
def test_experts_over_ep_on_workers_equal_one_process(moe, layout, tmp_path):
    path, gpt = moe
    prompts = [list(p.encode()) for p in PROMPTS]  # 5 prompts over 2 replicas: 3 and 2
    host = InferenceHost(path, layout)
    try:
        for name, settings in SETTINGS.items():
            expected = one_process(gpt, prompts, settings)
            assert len({tuple(t) for t in expected}) > 1, name  # not degenerate
            assert host.generate(path, prompts, settings) == expected, name
        # one prompt: the other replica runs a stand-in only
        assert host.generate(path, prompts[:1], SETTINGS["greedy"]) == one_process(gpt, prompts[:1],
                                                                                     SETTINGS["greedy"])
        check_hellaswag(host, {"llama": (path, gpt)}, tmp_path)  # 5 examples over 2 replicas: 3 and 2
    finally:
        host.close()


def test_the_router_biases_matter_here(moe):
    """Without its biases the model chooses other tokens: the equality above checks that they are loaded."""
    _, gpt = moe
    prompts = [list(p.encode()) for p in PROMPTS]
    unbiased = GPT(MODEL, init_seed=0).eval()
    state = {n: t for n, t in gpt.state_dict().items() if not n.endswith("expert_bias")}
    unbiased.load_state_dict(state, strict=False)
    assert one_process(unbiased, prompts, SETTINGS["greedy"]) != one_process(gpt, prompts, SETTINGS["greedy"])


def test_layouts_that_do_not_fit_are_refused_in_one_line(moe, tmp_path, no_workers):
    path, _ = moe
    assert_one_line_error(invoke("sample", path, "--prompt", "a", "--dp", 2, "--ep", 4), "--ep 4")
    assert_one_line_error(invoke("sample", path, "--prompt", "a", "--dp", 3, "--ep", 3), "--ep 3")
    dense = tmp_path / "dense"
    dense_model = dataclasses.replace(MODEL, n_experts=0, n_experts_per_token=None, n_shared_experts=0,
                                      expert_hidden=None)
    checkpoint.write_weights(dense, {n: p.detach() for n, p in GPT(dense_model, init_seed=0).named_parameters()},
                             {"model": dataclasses.asdict(dense_model), "tokenizer": "bytes"})
    assert_one_line_error(invoke("sample", dense, "--prompt", "a", "--dp", 2, "--ep", 2), "--ep 2")
    assert not no_workers


@pytest.mark.slow  # a training run of 4 workers, then HellaSwag in one process
def test_hellaswag_during_a_run_with_ep_scores_the_checkpoint_it_saves(tmp_path):
    from pipegpt.data.hellaswag import read_examples, score
    from pipegpt.tools.sample import load_model

    data = tmp_path / "hs.jsonl"
    data.write_text("".join(json.dumps({"ctx": c, "endings": e, "label": k % 4}) + "\n"
                            for k, (c, e) in enumerate(HELLASWAG)))
    run = tmp_path / "run"
    proc = run_pipegpt("run", "--model", "tiny-moe", "--stages", 1, "--dp", 2, "--ep", 2, "--microbatches", 2,
                       "--batch-size", 8, "--steps", 2, "--tokenizer", "bytes", "--vocab-size", 256,
                       "--router-bias-update-rate", 0.01, "--eval-every", 2, "--save-every", 2, "--hellaswag", data,
                       "--device", "cpu", "--run-dir", run, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    model, _, _ = load_model(run, "cpu")
    examples = read_examples(data)
    correct, correct_norm = score(model.eval(), examples, "bytes", data)
    assert (last["hellaswag_acc"], last["hellaswag_acc_norm"]) == (correct / len(examples),
                                                                    correct_norm / len(examples))
