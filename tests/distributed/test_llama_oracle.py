"""The oracle for Llama: a pipelined, tensor-parallel, data-parallel run of a tiny Llama equals the same model in
one process: the loss and every named parameter's gradient after one step, and every parameter after AdamW steps
(tests/distributed/test_pipeline_oracle.py's comparison and workers, reused).

The models: grouped-query attention (n_head 4, n_kv_head 2: tp 2 splits the kv heads), multi-query (n_kv_head 1:
tp 2 replicates the one kv head, whose gradient the two ranks sum), q/k/v biases (tied, so the V-shape's rank 0
holds both ends); SwiGLU's three linears and q/k/v under the zero-bubble I/W split. The default run keeps a few
representative cases; `pytest -m slow` runs every schedule at pp 2 and 4 (V-shapes, interleaved), each
recomputation, tied and untied, the dp x pp x tp grid with sequence parallelism and ZeRO-1, and a checkpoint saved
under pp 2 x tp 2 resumed in one process.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.schedule import SCHEDULES
from pipegpt.state import checkpoint
from pipegpt.train.driver import check

from test_pipeline_oracle import assert_matches, base_config, valid_microbatches, workers  # noqa: F401 (fixture)

GQA = ModelConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                  arch="llama", bias=False, tie_embeddings=False)
MQA = dataclasses.replace(GQA, n_kv_head=1)  # tp 2: the one kv head replicated on both ranks
BIASED_TIED = dataclasses.replace(GQA, qkv_bias=True, tie_embeddings=True)  # Qwen2's q/k/v biases; SmolLM's tying
MODELS = {"gqa": GQA, "mqa": MQA, "qkv-bias-tied": BIASED_TIED}


def llama_config(p: int, model: str, **changes) -> TrainConfig:
    return base_config(p, model=MODELS[model], **changes)


def assert_llama_matches(cfg: TrainConfig, host) -> None:
    """Step 0's loss and gradients in fp32; the parameters after 3 AdamW steps in float64. In fp32 the 3 steps
    differ by rounding only, but Adam amplifies it past fp32 tolerance for the elements with small gradients that
    rotary positions give Llama's k bias (GPT-2's is exactly 0 and left out of the comparison), whenever the
    run sums in another order than one process (tensor parallelism's split products, a tied embedding's two
    copies); in float64 the comparison is exact to 1e-9."""
    assert_matches(cfg, host, steps=1)
    assert_matches(cfg.replace(dtype="float64"), host, steps=3)


# Default: pp 2 with a whole backward, a split one (I/W) under selective recomputation, and a V whose rank 0 holds
# both ends of the tied embedding.
@pytest.mark.parametrize("schedule,m,model,recompute", [("1f1b", 3, "gqa", "none"),
                                                        ("zb-h1", 3, "mqa", "selective"),
                                                        ("zbv", 4, "qkv-bias-tied", "full")])
def test_llama_pipeline_matches_one_process(workers, schedule, m, model, recompute):
    cfg = llama_config(2, model, schedule=schedule, microbatches=m, recompute=recompute)
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))


# The dp x pp x tp grid (as test_pipeline_oracle.test_grid_matches).
# Default: one pp x tp case (13 s for the 1f1b-mqa one, so it is slow; MQA runs in the default pipeline cases).
GRIDS = [pytest.param(1, 2, 2, "1f1b", False, "mqa", 0, marks=pytest.mark.slow), (1, 2, 2, "zb-h1", True, "qkv-bias-tied", 0),
         pytest.param(1, 2, 2, "zbv", True, "gqa", 0, marks=pytest.mark.slow),
         pytest.param(1, 2, 2, "interleaved-1f1b", False, "mqa", 0, marks=pytest.mark.slow),
         pytest.param(2, 2, 1, "1f1b", False, "gqa", 1, marks=pytest.mark.slow),
         pytest.param(2, 2, 1, "zbv", False, "qkv-bias-tied", 0, marks=pytest.mark.slow),
         pytest.param(2, 2, 1, "dualpipev", False, "mqa", 1, marks=pytest.mark.slow),
         pytest.param(1, 1, 2, "1f1b", True, "gqa", 0, marks=pytest.mark.slow),
         pytest.param(1, 1, 2, "1f1b", True, "mqa", 0, marks=pytest.mark.slow),
         pytest.param(1, 1, 4, "1f1b", True, "gqa", 0, marks=pytest.mark.slow)]  # tp 4 > 2 kv heads: replicated


@pytest.mark.parametrize("dp,p,tp,schedule,sp,model,zero", GRIDS, ids=[
    f"{d}x{p}x{t}-{s}{'-sp' if sp else ''}-{mo}{'-zero1' if z else ''}"
    for d, p, t, s, sp, mo, z in (g.values if hasattr(g, "values") else g for g in GRIDS)])
def test_llama_grid_matches_one_process(workers, dp, p, tp, schedule, sp, model, zero):
    m = 4 if schedule == "interleaved-1f1b" else 2 * p
    cfg = llama_config(p, model, dp=dp, tp=tp, schedule=schedule, microbatches=m, sequence_parallel=sp, zero=zero,
                       **({"virtual_stages": 2} if schedule == "interleaved-1f1b" else {}))
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))


def test_a_llama_checkpoint_of_pp2_tp2_resumes_in_one_process(workers, tmp_path):
    """Saved by 2 stages x tp 2 with the one kv head replicated on both tp ranks, loaded by one process: every
    parameter and Adam moment as saved (one copy of the shared head), and the next step's loss the run had.
    (After the grid tests: the 2 x 2 workers are still up.)"""
    saved = llama_config(2, "mqa", tp=2, microbatches=4, dtype="float64")
    path, next_loss = workers(saved).save(saved, tmp_path, 2)
    one = llama_config(1, "mqa", microbatches=4, dtype="float64")
    params, moments, loss = workers(one).resume(one, path)
    reader = checkpoint.CheckpointReader(path)
    assert {k.split("/", 1)[1] for k in params} == {k[6:] for k in reader.where if k.startswith("param/")}
    assert {k for k in moments} == {k for k in reader.where if k.split("/")[0] in ("exp_avg", "exp_avg_sq")}
    for key, value in {**params, **moments}.items():
        assert torch.equal(value, reader.full(key, key.split("/", 1)[1])), key
    # the two tp ranks' copies of a shared kv head were saved alike (their gradients were summed)
    k = "param/blocks.0.attn.k.weight"
    copies = [reader._files[reader.where[k][r][0]].get_tensor(k) for r in range(2)]
    assert torch.equal(copies[0], copies[1])
    assert loss == pytest.approx(next_loss, rel=1e-9)


# The full matrix: every schedule at pp 2, and at pp 4 those that place stages differently there (V-shapes,
# interleaved), each recomputation, tied and untied.
FULL = [(s, p, m, rc, model) for p, names in ((2, list(SCHEDULES)),
                                              (4, ["interleaved-1f1b", "zbv", "dualpipev", "auto-v"]))
        for s in names for m in valid_microbatches(s, p)[-1:]
        for rc, model in (("none", "gqa"), ("full", "mqa"), ("selective", "qkv-bias-tied"))]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,m,recompute,model", FULL,
                         ids=[f"{s}-p{p}-m{m}-{rc}-{mo}" for s, p, m, rc, mo in FULL])
def test_llama_full_matrix(workers, schedule, p, m, recompute, model):
    cfg = llama_config(p, model, schedule=schedule, microbatches=m, recompute=recompute)
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_llama_tensor_parallel_recompute(workers, recompute):
    cfg = llama_config(2, "mqa", tp=2, schedule="zb-h1", microbatches=3, recompute=recompute, sequence_parallel=True)
    check(cfg)
    assert_matches(cfg, workers(cfg), steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,groups", [("1f1b", "auto"), ("zbv", "auto"), ("zbv", "pairs")])
def test_llama_order_matching(workers, schedule, groups):
    """The CUDA control path (messages matched by order) on CPU; on its pair groups too."""
    cfg = llama_config(2, "gqa", schedule=schedule, microbatches=4, p2p_matching="order", p2p_groups=groups)
    assert_llama_matches(cfg, workers(cfg))


