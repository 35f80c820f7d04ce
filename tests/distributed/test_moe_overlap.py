"""A MoE block's all-to-alls posted as cuts (model.moe.block_steps), hidden in a pair under the other half's compute.

In one process (an ep "group" of one: the exchange is a copy) a pair of pieces equals the plain stage per named
gradient, with recomputation and split backward; over processes, paired schedules with ep 2 equal one process.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.testing import assert_close

from pipegpt.expert_parallel.dispatch import ExpertGroup
from pipegpt.expert_parallel.layers import _block_steps
from pipegpt.model.gpt import GPT
from pipegpt.model.moe import MoE
from pipegpt.stages import Stage
from pipegpt.stages.stage import interleave

from pipegpt.train.driver import check

from test_moe_oracle import MOE, assert_bf16_matches, assert_moe_matches, moe_config
from test_pipeline_oracle import workers  # noqa: F401 (a fixture)


def _stage(model, recompute, posted):
    stage = Stage(0, 1, GPT(model, layers=range(model.n_layer), embed=True, head=True, recompute=recompute,
                            init_seed=7), 2)
    stage.module.train()
    calls = []
    if posted:  # what shard_for_ep does with ep > 1; a group of one exchanges by copying
        for block in stage.module.blocks.values():
            if isinstance(block.mlp, MoE):
                block.mlp.expert_parallel = ExpertGroup(None, 1, 0)
                steps = functools.partial(_block_steps, block, stage.module)
                block.forward_steps = lambda x, documents, steps=steps: calls.append(1) or steps(x, documents)
    return stage, calls


# The default suite: split backward with each recomputation (the distributed case below runs B without one)
@pytest.mark.parametrize("recompute, split", [pytest.param("none", False, marks=pytest.mark.slow),
                                              pytest.param("full", False, marks=pytest.mark.slow),
                                              ("selective", True), ("full", True)])
def test_a_moe_block_posting_its_all_to_alls_trains_as_the_plain_block(recompute, split):
    model = dataclasses.replace(MOE, n_layer=3)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)) for _ in "012"]
    results = []
    for posted in (False, True):
        stage, calls = _stage(model, recompute, posted)
        for layer in stage.module.blocks.values():
            if isinstance(layer.mlp, MoE):
                layer.mlp.aux_loss_scale = 0.5
        stage.forward_pieces(0, *data[0]).finish()
        loss1, _ = interleave(stage.forward_pieces(1, *data[1]), stage.backward_pieces(0, None, split=split))
        loss2, _ = interleave(stage.forward_pieces(2, *data[2]), stage.backward_pieces(1, None, split=split))
        stage.backward(2, None, split=split)
        if split:
            for mb in range(3):
                stage.backward_weight(mb)
        results.append(((loss1, loss2), {n: p.grad.clone() for n, p in stage.module.named_parameters()},
                        [float(m.aux_sum) for m in stage.module.modules() if isinstance(m, MoE)]))
        assert len(calls) == (6 if posted else 0)  # two MoE blocks, three forwards
    (plain_losses, plain, plain_aux), (losses, grads, aux) = results
    assert_close(losses, plain_losses, rtol=0, atol=0)
    assert aux == pytest.approx(plain_aux, rel=1e-6) and all(plain_aux)
    assert any("router" in n for n in plain)
    for name in plain:
        assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")


# Over processes: dp 2 x ep 2 x pp 2, schedules with pairs, the tiny MoE with its aux loss and bias updates. The
# default suite runs dualpipev (its pairs: one stage's forward with the other's backward on a rank) under tag
# matching; recomputation, order matching, 1f1b-overlap and --overlap off are slow.
PAIRED = [pytest.param("dualpipev", "none", "tag", "on", id="dualpipev"),
          pytest.param("dualpipev", "full", "order", "on", id="dualpipev-full-order", marks=pytest.mark.slow),
          pytest.param("dualpipev", "selective", "tag", "off", id="dualpipev-selective-off", marks=pytest.mark.slow),
          pytest.param("1f1b-overlap", "none", "order", "on", id="1f1b-overlap-order", marks=pytest.mark.slow),
          pytest.param("1f1b-overlap", "full", "tag", "on", id="1f1b-overlap-full", marks=pytest.mark.slow),
          pytest.param("1f1b-overlap", "selective", "tag", "off", id="1f1b-overlap-off", marks=pytest.mark.slow)]


@pytest.mark.parametrize("schedule, recompute, p2p, overlap", PAIRED)
def test_paired_schedules_with_experts_over_ep_match_one_process(workers, schedule, recompute, p2p,  # noqa: F811
                                                                 overlap, request):
    cfg = moe_config(2, dp=2, ep=2, schedule=schedule, recompute=recompute, p2p_matching=p2p, overlap=overlap)
    check(cfg)
    host = workers(cfg)
    assert_moe_matches(cfg, host, steps=1)
    if "slow" in request.keywords:  # parameters after 3 AdamW steps and the biases after their updates, in float64
        assert_moe_matches(cfg.replace(dtype="float64"), host, steps=3)


# bf16 (the oracle module's assert_bf16_matches): the halves of a pair under autocast, the all-to-alls sending bf16
# rows; under full recomputation each part of block_steps runs under checkpoint and casts the experts per call.
# dualpipev's four stages hold a block each (rank 0: stages 0 and 3, rank 1: 1 and 2), so the messages that travel
# in bf16 leave blocks 0 and 2; stage 1's output is handed over on rank 1 as it is (the reference rounding after
# none of the blocks, after 1 or after 0, 1 and 2 instead: 4.2e-2 to 5.0e-2 measured).
@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_dualpipev_in_bf16_with_experts_over_ep_matches_one_process_under_autocast(workers, recompute):  # noqa: F811
    cfg = moe_config(2, dp=2, ep=2, schedule="dualpipev", overlap="on", precision="bf16", recompute=recompute,
                     layers_per_stage=(1, 1, 1, 1))
    check(cfg)
    assert_bf16_matches(cfg, workers(cfg), (0, 2))


def test_calibration_measures_the_overlap_a_paired_run_achieved():
    """simulate --trace of a paired run: the trace's pair (one event) against the simulator's (its halves drawn)
    and against its halves apart at the calibrated costs."""
    from pipegpt.schedule.actions import B, Composite, F
    from pipegpt.schedule.calibrate import pair_times
    from pipegpt.schedule.simulate import Event, Timeline
    from pipegpt.schedule.timing_rule import Costs

    pair = Composite.of(F(0, 1), B(0, 0))
    measured = Timeline([Event(0, F(0, 0), 0, 1), Event(0, pair, 1, 3.5), Event(0, B(0, 1), 3.5, 5.5)], 1,
                        time_unit="s")
    predicted = Timeline([Event(0, F(0, 0), 0, 1), Event(0, F(0, 1), 1, 2, pair=pair),
                          Event(0, B(0, 0), 2, 4.25, pair=pair), Event(0, B(0, 1), 4.25, 6.25)], 1)
    assert pair_times(measured, predicted, Costs.uniform(1, F=1, B=2)) == \
        {"count": 1, "measured": 2.5, "predicted": 3.25, "apart": 3.0}
    assert pair_times(Timeline([Event(0, F(0, 0), 0, 1)], 1), predicted, Costs.uniform(1)) is None
