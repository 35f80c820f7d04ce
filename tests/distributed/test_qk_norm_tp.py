"""q/k norms under tensor parallelism equal one process: the loss and every named gradient after one step in fp32,
every parameter after 3 AdamW steps in float64 (test_llama_oracle's comparison and workers, reused), and a
checkpoint written by tp 2 read by one process bitwise.

qk_norm head (Qwen3): each tp rank holds n_head/tp heads and applies the one [head_dim] gain of q_norm (and k_norm)
to them: its gradient there is that rank's heads' part, summed over tp with and without sequence parallelism
(pipegpt.parallelisms). With n_kv_head < tp a kv head is shared by tp/n_kv_head ranks, each of which gives k_norm's
gain its own q heads' part of that head's gradient, so the same sum over tp counts each part once.
qk_norm projection (OLMoE): the mean square over the whole q (k) projection is summed over tp (a shared kv head
counted once), and each rank applies its columns of the whole gain, whose gradient the same tp sum completes.
One case of each in the default suite, the rest slow.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.state import checkpoint
from pipegpt.train.driver import check

from test_llama_oracle import assert_llama_matches
from test_moe_oracle import MOE, assert_moe_matches, moe_config
from test_pipeline_oracle import base_config, workers  # noqa: F401 (a fixture)

# Qwen3's shape in small: heads wider than n_embd / n_head (4 x 16 = 64 > 32), grouped-query attention
QWEN3 = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, head_size=16,
                    ffn_hidden=64, arch="llama", bias=False, tie_embeddings=False, qk_norm="head")
SHARED_KV = dataclasses.replace(QWEN3, n_kv_head=1)  # tp 2: the one kv head on both ranks
OLMOE = dataclasses.replace(QWEN3, head_size=None, qk_norm="projection")  # OLMoE's heads are n_embd / n_head wide
OLMOE_SHARED_KV = dataclasses.replace(OLMOE, n_kv_head=1)

slow = pytest.mark.slow
# (model, stages, layout)
CASES = [pytest.param(QWEN3, 1, dict(tp=2), id="tp2"),
         pytest.param(QWEN3, 1, dict(tp=2, sequence_parallel=True), id="tp2-sp", marks=slow),
         pytest.param(SHARED_KV, 1, dict(tp=2), id="tp2-shared-kv", marks=slow),
         pytest.param(SHARED_KV, 1, dict(tp=2, sequence_parallel=True), id="tp2-sp-shared-kv", marks=slow),
         pytest.param(QWEN3, 1, dict(tp=4, sequence_parallel=True), id="tp4-sp-shared-kv", marks=slow),
         pytest.param(QWEN3, 2, dict(tp=2, schedule="zb-h1", recompute="selective"), id="pp2-tp2-zb-h1-selective",
                      marks=slow),
         pytest.param(QWEN3, 1, dict(dp=2, tp=2, sequence_parallel=True, zero=1), id="dp2-tp2-sp-zero1",
                      marks=slow),
         pytest.param(OLMOE, 1, dict(tp=2), id="projection-tp2"),
         pytest.param(OLMOE, 1, dict(tp=2, sequence_parallel=True), id="projection-tp2-sp", marks=slow),
         pytest.param(OLMOE_SHARED_KV, 1, dict(tp=2), id="projection-tp2-shared-kv", marks=slow),
         pytest.param(OLMOE, 1, dict(tp=4, sequence_parallel=True), id="projection-tp4-sp-shared-kv", marks=slow),
         pytest.param(OLMOE, 2, dict(tp=2, schedule="zb-h1", recompute="full"), id="projection-pp2-tp2-zb-h1-full",
                      marks=slow),
         pytest.param(OLMOE_SHARED_KV, 1, dict(dp=2, tp=2, zero=3), id="projection-dp2-tp2-shared-kv-zero3",
                      marks=slow)]


def layout_config(model: ModelConfig, p: int, **changes) -> TrainConfig:
    return base_config(p, model=model, microbatches=2 * p, **changes)


@pytest.mark.parametrize("model, p, layout", CASES)
def test_qk_norms_under_tp_match_one_process(workers, model, p, layout):  # noqa: F811
    cfg = layout_config(model, p, **layout)
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))


@slow
@pytest.mark.parametrize("qk_norm, layout", [("head", dict(tp=2)), ("head", dict(tp=2, sequence_parallel=True, ep=2)),
                                             ("projection", dict(tp=2, sequence_parallel=True))],
                         ids=["qwen3-tp2", "qwen3-tp2-sp-ep2", "olmoe-tp2-sp"])
def test_a_moe_with_qk_norms_under_tp_matches_one_process(workers, qk_norm, layout):  # noqa: F811
    """Qwen3-MoE's and OLMoE's attention with the tiny MoE of test_moe_oracle, experts whole on each tp rank or
    each tp rank's own ep slice."""
    cfg = moe_config(1, dataclasses.replace(MOE, qk_norm=qk_norm), **layout)
    check(cfg)
    host = workers(cfg)
    assert_moe_matches(cfg, host, steps=1)
    assert_moe_matches(cfg.replace(dtype="float64"), host, steps=3)


@slow
@pytest.mark.parametrize("model, width", [(SHARED_KV, 16), (OLMOE_SHARED_KV, 32)], ids=["head", "projection"])
def test_a_tp2_checkpoint_with_qk_norms_resumes_in_one_process(workers, tmp_path, model, width):  # noqa: F811
    """Saved by tp 2 with the one kv head shared, loaded by one process: every parameter and Adam moment as saved,
    the norms' gains stored once and moved from their ones by the summed gradients, the next step's loss the run's."""
    saved = layout_config(model, 1, tp=2, sequence_parallel=True, dtype="float64")
    path, next_loss = workers(saved).save(saved, tmp_path, 2)
    one = layout_config(model, 1, dtype="float64")
    params, moments, loss = workers(one).resume(one, path)
    reader = checkpoint.CheckpointReader(path)
    assert {k.split("/", 1)[1] for k in params} == {k[6:] for k in reader.where if k.startswith("param/")}
    for key, value in {**params, **moments}.items():
        assert torch.equal(value, reader.full(key, key.split("/", 1)[1])), key
    for name, size in (("q_norm", width), ("k_norm", width // 4)):  # projection's: 4 q heads, 1 kv head of 8
        gain = params[f"param/blocks.1.attn.{name}.weight"]
        assert gain.shape == (16 if width == 16 else size,) and not torch.equal(gain, torch.ones_like(gain))
    assert loss == pytest.approx(next_loss, rel=1e-9)

