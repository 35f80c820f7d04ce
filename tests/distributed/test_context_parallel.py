"""Context parallelism against the one-process model: each cp rank holds two chunks of every sequence, attention
sees the others' keys and values (ring or all-gather), and the loss and every named gradient equal the whole model's
on the whole sequences (tests/distributed/test_pipeline_oracle.py's comparison and workers, reused).

Default: cp 2 with GPT-2 (ring) and a GQA Llama across two stages (all-gather, zbv); the rest of the grid is slow.
"""
from __future__ import annotations

import dataclasses

import pytest

from pipegpt.config import ModelConfig
from pipegpt.train.driver import check

from test_llama_oracle import MODELS, assert_llama_matches as assert_matches_reordered
from test_pipeline_oracle import MODEL, base_config, workers  # noqa: F401 (fixture)

# cp sums attention's blocks and averages gradients over cp ranks in another order than one process: step 0's loss
# and gradients are compared in fp32, the parameters after 3 AdamW steps in float64 (Adam amplifies fp32 rounding
# past fp32 tolerance: 1.5e-5 relative measured, as for tensor parallelism), where a real error cannot hide.


def cp_config(p: int, cp: int, model: ModelConfig = MODEL, **changes):
    return base_config(p, cp=cp, model=model, **changes)


@pytest.mark.parametrize("comm", ["ring", pytest.param("allgather", marks=pytest.mark.slow)])
def test_gpt2_cp2_matches_one_process(workers, comm):
    cfg = cp_config(1, 2, cp_comm=comm, microbatches=2)
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))


@pytest.mark.parametrize("schedule,comm,model", [("zbv", "allgather", "gqa"),
                                                 pytest.param("1f1b", "ring", "mqa", marks=pytest.mark.slow),
                                                 pytest.param("auto", "ring", "gqa", marks=pytest.mark.slow),
                                                 pytest.param("zb-h1", "ring", "qkv-bias-tied", marks=pytest.mark.slow)])
def test_llama_cp2_pp2_matches_one_process(workers, schedule, comm, model):
    cfg = cp_config(2, 2, MODELS[model], schedule=schedule, cp_comm=comm, microbatches=4)
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))


# The rest of the grid: cp 4, with dp and ZeRO-1, with tp and sequence parallelism, recomputation, bf16.
GRID = [(4, 1, 1, 1, "ring", {}), (4, 1, 1, 1, "allgather", {}),
        (2, 2, 1, 1, "ring", {"zero": 1}), (2, 1, 2, 1, "ring", {"sequence_parallel": True}),
        (2, 1, 2, 1, "allgather", {}), (2, 2, 1, 1, "allgather", {"recompute": "selective"}),
        (2, 1, 1, 2, "ring", {"recompute": "full", "schedule": "zb-h1"})]


@pytest.mark.slow
@pytest.mark.parametrize("cp,dp,tp,p,comm,extra", GRID, ids=[
    f"cp{c}-dp{d}-tp{t}-pp{p}-{comm}-{'-'.join(f'{k}={v}' for k, v in e.items())}" for c, d, t, p, comm, e in GRID])
@pytest.mark.parametrize("model", ["gpt2", "gqa"])
def test_cp_grid_matches_one_process(workers, cp, dp, tp, p, comm, extra, model):
    m = MODEL if model == "gpt2" else MODELS[model]
    if cp * dp * tp * p > 4:
        pytest.skip("more than 4 ranks")
    cfg = cp_config(p, cp, m, dp=dp, tp=tp, cp_comm=comm, microbatches=2 * p, **extra)
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))
