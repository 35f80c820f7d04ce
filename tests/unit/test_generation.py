"""Generation's pieces in one process: a KVCache of left-padded prompts gives each prompt the logits it has alone
(GPT-2's learned positions and a grouped-query Llama's rotary ones, prefill and decode steps); the batched sampler
(the decode loop with one stage) equals nanoGPT's loop per prompt, greedy and seeded; the per-sequence loss sums
that HellaSwag's workers report equal the model's own cross-entropy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipegpt.config import ModelConfig
from pipegpt.infer.generation import generate_in_process, make_groups
from pipegpt.infer.sampling import SamplingSettings
from pipegpt.model.gpt import GPT, KVCache
from pipegpt.stages import Stage
from pipegpt.tools.sample import generate

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "gpt2": ModelConfig(vocab_size=256, seq_len=40, n_layer=2, n_head=4, n_embd=32),
    "llama": ModelConfig(arch="llama", vocab_size=256, seq_len=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=32),
}
PROMPTS = [list(b"def f(x): return"), list(b"a"), list(b"hello"), list(b"xyz!")]


def trained_like(model: ModelConfig) -> GPT:
    gpt = GPT(model, init_seed=2).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return gpt


@pytest.mark.parametrize("arch", MODELS)
@torch.no_grad()
def test_left_padded_prompts_each_see_what_they_see_alone(arch):
    gpt = trained_like(MODELS[arch])
    (group,) = make_groups(list(enumerate(PROMPTS)), 1)
    assert group.indices == [1, 3, 2, 0]  # shortest first
    assert group.pads == [len(PROMPTS[0]) - len(PROMPTS[i]) for i in group.indices]
    cache = KVCache(group.pads)
    logits = gpt(group.tokens, cache=cache)[:, -1]
    if arch == "llama":  # grouped-query attention caches the kv heads only
        assert cache.keys[0].shape == (len(PROMPTS), 2, group.tokens.size(1), 8)
    texts = [list(PROMPTS[i]) for i in group.indices]
    for _ in range(3):
        alone = torch.stack([gpt(torch.tensor([t]))[0, -1] for t in texts])
        torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
        chosen = logits.argmax(-1, keepdim=True)
        texts = [t + [int(c)] for t, c in zip(texts, chosen)]
        logits = gpt(chosen, cache=cache)[:, -1]


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("temperature,top_k", [(0, None), (0.9, 20)])
def test_the_batched_sampler_equals_nanogpts_loop_per_prompt(arch, temperature, top_k):
    gpt = trained_like(MODELS[arch])
    settings = SamplingSettings(20, temperature, top_k, seed=11, vocab_limit=256)
    expected = [generate(gpt, p, 20, temperature, top_k, torch.Generator().manual_seed(11 + i), 256)
                for i, p in enumerate(PROMPTS)]
    assert generate_in_process(gpt, PROMPTS, settings) == expected
    assert len({tuple(t) for t in expected}) == len(PROMPTS)  # a swap of two prompts' tokens would be seen
    # a later batch: its prompts keep their own generators (seed + their index)
    assert generate_in_process(gpt, PROMPTS[2:], settings, first=2) == expected[2:]


def test_groups_keep_similar_lengths_together_and_split_evenly():
    prompts = [(i, [1] * n) for i, n in enumerate([5, 1, 9, 2, 3])]
    groups = make_groups(prompts, 2)
    assert [g.indices for g in groups] == [[1, 3, 4], [0, 2]]
    assert [g.pads for g in groups] == [[2, 1, 0], [4, 0]]
    assert [tuple(g.tokens.shape) for g in groups] == [(3, 3), (2, 9)]


@torch.no_grad()
def test_the_last_stage_reports_each_sequences_loss_sum_and_count():
    gpt = trained_like(MODELS["llama"])
    x = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    y[0, :5] = -1
    y[2, :] = -1
    stage = Stage(0, 1, gpt, 1)
    stage.per_row = True
    rows = stage.forward(0, x, y)
    losses = F.cross_entropy(gpt(x).reshape(-1, 256), y.reshape(-1), ignore_index=-1, reduction="none").view(3, 12)
    torch.testing.assert_close(rows[:, 0], losses.sum(1))
    assert rows[:, 1].tolist() == [7, 12, 0]
    torch.testing.assert_close(rows[1, 0] / 12, gpt(x[1:2], y[1:2]))
