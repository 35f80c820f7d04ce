"""The mixture-of-experts oracle under tensor (with and without sequence parallelism) and context parallelism, and
with ep carved out of tp under sequence parallelism: the tiny MoE of test_moe_oracle (aux loss, bias update) equals
one process. Loss and every named gradient (router included) after one step in fp32; parameters after 3 AdamW
steps and the router biases after their updates (exactly) in float64.

Experts are not tensor-parallel: every tp rank holds the whole MoE feed-forward. Under sequence parallelism (and
cp) each rank routes its own tokens of the call, so the aux loss's counts and mean scores are summed over those
ranks; without it every tp rank routes the same tokens. One case in the default suite, the others slow.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.model.moe import counted_once, merge_stats
from pipegpt.train.driver import check

from test_moe_oracle import GPT2_MOE, MOE, _restored, _saved, assert_moe_matches, moe_config
from test_pipeline_oracle import workers  # noqa: F401 (a fixture)

Z_LOSS = dataclasses.replace(MOE, router_aux_loss_coef=0.0, router_z_loss_coef=1e-3)

SP = dict(tp=2, sequence_parallel=True)
slow = pytest.mark.slow
# (pipeline stages, layout, model, also the fp32 step): the default suite's case checks float64 alone (its loss and
# gradients too), for time; its slow twin adds the fp32 step
CASES = [pytest.param(1, SP, MOE, False, id="tp2-sp"),
         pytest.param(1, SP, MOE, True, id="tp2-sp-fp32", marks=slow),
         pytest.param(1, SP, GPT2_MOE, True, id="gpt2-tp2-sp", marks=slow),  # fused q/k/v, GELU experts
         pytest.param(1, dict(tp=2), MOE, True, id="tp2", marks=slow),
         pytest.param(1, dict(cp=2), MOE, True, id="cp2", marks=slow),
         pytest.param(1, dict(cp=2, **SP), Z_LOSS, True, id="cp2-tp2-sp-z-loss", marks=slow),
         pytest.param(2, SP, MOE, True, id="tp2-sp-pp2", marks=slow),
         pytest.param(2, dict(schedule="zb-h1", recompute="full", **SP), MOE, True, id="tp2-sp-pp2-zb-h1-recompute",
                      marks=slow),
         pytest.param(1, dict(dp=2, zero=3, **SP), MOE, True, id="dp2-tp2-sp-zero3", marks=slow),
         pytest.param(1, dict(dp=2, cp=2, zero=1), MOE, True, id="dp2-cp2-zero1", marks=slow),
         # ep carved out of tp (sequence parallelism): each tp rank holds 2 of the 4 experts, whole
         pytest.param(1, dict(ep=2, **SP), MOE, True, id="tp2-sp-ep2", marks=slow),
         pytest.param(1, dict(ep=2, **SP), GPT2_MOE, True, id="gpt2-tp2-sp-ep2", marks=slow),
         pytest.param(1, dict(dp=2, ep=2, **SP), MOE, True, id="dp2-tp2-sp-ep2", marks=slow),
         pytest.param(1, dict(cp=2, ep=2), MOE, True, id="cp2-ep2", marks=slow),
         # without sequence parallelism ep is carved out of dp: each tp rank exchanges the same tokens
         pytest.param(1, dict(dp=2, tp=2, ep=2), MOE, True, id="dp2-tp2-ep2", marks=slow)]


@pytest.mark.parametrize("p, layout, model, fp32", CASES)
def test_moe_under_tp_and_cp_matches_one_process(workers, p, layout, model, fp32):  # noqa: F811
    cfg = moe_config(p, model, **layout)
    check(cfg)
    host = workers(cfg)
    if fp32:
        assert_moe_matches(cfg, host, steps=1)
    assert_moe_matches(cfg.replace(dtype="float64"), host, steps=3)


def test_moe_with_tp_and_cp_and_qk_norms_is_accepted():
    for changes in (dict(tp=2), dict(tp=2, sequence_parallel=True, ep=2), dict(cp=2, ep=2)):
        moe_config(2, **changes).validate({})
    for qk_norm in ("head", "projection"):  # Qwen3's, OLMoE's
        moe_config(2, dataclasses.replace(MOE, qk_norm=qk_norm), tp=2).validate({})


@pytest.mark.parametrize("sequence_parallel, dropped", [(False, 2.0), (True, 5.0)])
def test_tp_ranks_count_their_shared_aux_loss_once(sequence_parallel, dropped):
    """Two tp ranks report one aux loss (0.3, every rank's after the reduction); their dropped assignments are the
    same ones without sequence parallelism (rank 0's count), their own chunks' with it (summed)."""
    ranks = [{"aux_loss": 0.3, "moe_imbalance": 1.5, "moe_dropped": 2.0},
             {"aux_loss": 0.3, "moe_imbalance": 2.0, "moe_dropped": 3.0 if sequence_parallel else 2.0}]
    merged = merge_stats([counted_once(s, tp == 0, tp == 0 or sequence_parallel) for tp, s in enumerate(ranks)])
    assert merged == {"aux_loss": pytest.approx(0.3), "moe_imbalance": 2.0, "moe_dropped": dropped}


@pytest.mark.slow
@pytest.mark.parametrize("saved, restored", [(dict(ep=2, **SP), {}), ({}, dict(cp=2, ep=2)),
                                             (dict(tp=2), dict(ep=2, **SP))],
                         ids=["tp2-sp-ep2-to-one", "one-to-cp2-ep2", "tp2-to-tp2-sp-ep2"])
def test_moe_checkpoints_reshard_across_tp_and_ep(workers, tmp_path, saved, restored):  # noqa: F811
    """Written with experts over tp (and ep) and read in another layout: every tensor bitwise the one-process
    tensor, the next step's loss within 1e-5 of the writer's, the router biases after it exactly (float64)."""
    saved_cfg = moe_config(1, dtype="float64", steps=3, **saved)
    path, loss, biases = _saved(workers, saved_cfg, tmp_path)
    restored_loss, restored_biases = _restored(workers, saved_cfg, path,
                                               moe_config(1, dtype="float64", steps=3, **restored))
    assert restored_loss == pytest.approx(loss, rel=1e-5)
    assert set(biases) == set(restored_biases) and all(torch.equal(biases[n], restored_biases[n]) for n in biases)
    assert any(b.abs().sum() > 0 for b in biases.values())
