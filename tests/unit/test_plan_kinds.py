"""The planner and the calibration on a model whose layers differ (tests/unit/test_layer_kinds.py's toy: GPT-2,
C = 128, T = 64, V = 256, whose second half of layers has twice the MLP width): its memory and its step time count
each layer as its kind, the balance gives the wide stage fewer layers, and plan --calibrate scales each stage's
layers at their kinds. Expected values are worked out by hand
from the shapes and FLOPs there (fp32, 1e12 FLOP/s at efficiency 1, no host floor)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pipegpt.config import MODEL_PRESETS
from pipegpt.costs.calibrated_costs import RunShape, fit_calibrated_costs
from pipegpt.planner.candidates import Layout, LayoutChoice, Request
from pipegpt.planner.command import PlanOptions, plan_command
from pipegpt.planner.search import Search, evaluate_layout, search
from pipegpt.dims import Sharding
from pipegpt.schedule.simulate import Costs
from test_layer_kinds import C, DENSE_BLOCK, EMBED, HEAD, V, WIDE_BLOCK, _costs, mixed  # noqa: F401 (a fixture)

DENSE_F, WIDE_F = 27_262_976, 44_040_192  # one block's forward FLOPs per sequence (test_layer_kinds)
PASSES = 3  # forward, and the backward's input and weight gradients: 3 x a block's forward FLOPs


def _request(model, batch: int, **kw) -> Request:
    cs = _costs()
    return Request(model, batch, cs.cluster, cs.cost, **kw)


def test_memory_counts_each_layer_as_its_kind(mixed):
    """1F1B over two ranks, layers 3 + 1: rank 0 holds the embedding, two dense layers and a wide one, rank 1 a wide
    layer, ln_f and its own lm_head; weights, gradients and AdamW's two moments in fp32."""
    r = evaluate_layout(_request(mixed, 4), Layout(1, 2, 1, "1f1b", 1, 4, 1, layers_per_stage=(3, 1)))
    params = [EMBED + 2 * DENSE_BLOCK + WIDE_BLOCK, WIDE_BLOCK + HEAD + V * C]
    assert params == [767_360, 362_880]
    assert [(x["weights"], x["gradients"], x["optimizer"]) for x in r.memory] == [(4 * n, 4 * n, 8 * n) for n in params]


def test_the_search_plans_a_mixed_model(mixed):
    """The whole search runs on it; its best plan on two GPUs (two replicas, ZeRO-1) holds every layer's weights."""
    best = search(_request(mixed, 8, top=3)).best
    assert len(best) == 3
    top = best[0]
    assert (top.layout.dp, top.layout.pp, top.layout.zero) == (2, 1, 1)
    assert top.memory[0]["weights"] == 4 * (EMBED + 2 * DENSE_BLOCK + 2 * WIDE_BLOCK + HEAD) == 4 * 1_097_472


def test_step_time_counts_each_layer_as_its_kind(mixed):
    """One rank, four microbatches: the busy rank's compute is the dense model's plus, per microbatch, two layers'
    extra MLP FLOPs (wide - dense) over their three passes; tensor- and context-parallel time do not depend on the
    MLP's width, so they are the dense model's."""
    dense = dataclasses.replace(mixed, arch="gpt2")
    one = Layout(1, 1, 1, "1f1b", 1, 4, 1)
    ask = lambda model, layout: evaluate_layout(_request(model, 4), layout).breakdown  # noqa: E731
    extra = 4 * 2 * PASSES * (WIDE_F - DENSE_F) / 1e12
    assert extra == pytest.approx(402.653184e-6, rel=1e-12)
    assert ask(mixed, one)["compute"] - ask(dense, one)["compute"] == pytest.approx(extra, rel=1e-9)
    cp_tp = dataclasses.replace(one, cp=2, tp=2, microbatches=2, microbatch_size=2)
    for part in ("tp_comm", "cp_comm"):
        assert ask(mixed, cp_tp)[part] > 0
        assert ask(mixed, cp_tp)[part] == pytest.approx(ask(dense, cp_tp)[part], rel=1e-12)


def test_the_layout_bound_counts_each_layer_as_its_kind(mixed):
    """A layout's bound (a replica's least work over its ranks) is the dense model's plus the wide layers' extra."""
    def bound(model):
        return Search(_request(model, 8)).layout_bound(LayoutChoice(Sharding(pp=2), model, False))

    extra = 8 * 2 * PASSES * (WIDE_F - DENSE_F) / 1e12 / 2  # 8 sequences, 2 wide layers, over 2 ranks
    assert bound(mixed) - bound(dataclasses.replace(mixed, arch="gpt2")) == pytest.approx(extra, rel=1e-9)


def test_the_balance_gives_the_wide_stage_fewer_layers(mixed):
    """Six layers (three dense, three wide) over two pipeline ranks: the search's plan splits them 4 + 2."""
    six = dataclasses.replace(mixed, n_layer=6)
    best = search(_request(six, 8, top=1, schedules=("1f1b",), only={"dp": 1, "pp": 2, "cp": 1, "tp": 1})).best[0]
    assert (best.layout.layers_per_stage, best.layout.balanced) == ((4, 2), True)
    assert [x["weights"] for x in best.memory] == [4 * (EMBED + 3 * DENSE_BLOCK + WIDE_BLOCK),
                                                   4 * (2 * WIDE_BLOCK + HEAD + V * C)]


def test_calibration_predicts_each_stage_from_its_layers_kinds(mixed):
    """plan --calibrate scales the FLOP model to a run's measured F, B and W: here a run of two stages (2 dense
    layers and the embedding; 2 wide layers and the head) measured at twice, three times and once the analytical
    times at peak. The prediction at 1e12 FLOP/s, in picoseconds: F = the blocks' forwards + the embedding's three
    passes over T x C fp32 (98,304) | + the head's 2 T C V (4,194,304) and three passes over the logits (196,608);
    B = twice the blocks' + the embedding's gradient, T C + 2 V C fp32 values (294,912) | + the head's 8,519,680;
    W = the blocks' forwards + the embedding's 294,912 | + the head's matmul 4,194,304."""
    ps = 1e-12
    F = (98_304 + 2 * DENSE_F, 2 * WIDE_F + 4_390_912)
    B = (294_912 + 4 * DENSE_F, 4 * WIDE_F + 8_519_680)
    W = (294_912 + 2 * DENSE_F, 2 * WIDE_F + 4_194_304)
    measured = Costs(tuple(2 * x * ps for x in F), tuple(3 * x * ps for x in B), tuple(x * ps for x in W), 1e-5)
    run = RunShape(mixed, Sharding(), "none", 1, (2, 2), (0, 1), None)
    fit = fit_calibrated_costs(_costs().cluster, run, measured, 1.0, [1, 1], "run")
    assert (fit.scale_f, fit.scale_b, fit.scale_w) == (pytest.approx(2, rel=1e-12), pytest.approx(3, rel=1e-12),
                                                       pytest.approx(1, rel=1e-12))


def test_pipegpt_plan_prints_a_mixed_models_plans(mixed, monkeypatch):
    """`pipegpt plan`'s work end to end (plan_command, --explain, text and JSON): the model line counts its kinds,
    the first plan's memory is the whole model's weights on each of two replicas, its command names the preset."""
    monkeypatch.setitem(MODEL_PRESETS, "toymix", mixed)  # what `pipegpt run --model` would build it from
    opts = PlanOptions(gpus=2, batch_size=8, gpu_memory="8GiB", gpu_tflops=1, intra_node_gbps="800",
                       precision="fp32", efficiency=1.0, layer_overhead_us=0, explain=True)
    text = plan_command(mixed, opts)
    assert text.startswith("model: toymix, 1.1M parameters: 4 layers (2 dense, 2 wide MLP), width 128")
    assert "#1 dp2 pp1 tp1 1f1b m4x1 rc=none zero1" in text
    assert "weights 4.2 MiB" in text  # 4 x 1,097,472 bytes
    first = json.loads(plan_command(mixed, dataclasses.replace(opts, as_json=True)))["plans"][0]
    assert first["memory_per_rank"][0]["weights"] == 4 * 1_097_472
    assert first["command"].startswith("pipegpt run --model toymix --stages 1 --dp 2 --tp 1 --schedule 1f1b")
