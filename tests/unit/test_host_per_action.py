"""The host's time between two computes (message batches, the dispatch) in the calibrated planner: charged once per
forward and backward of a stage, not scaled with its tokens or its layers
(pipegpt.costs.calibrated_costs.CalibratedCosts.host_s, from pipegpt.schedule.calibrate's Calibration.host).
Hand-worked: the computes are given, nothing is timed."""
from __future__ import annotations

import pytest

from pipegpt.config import ModelConfig
from pipegpt.costs.calibrated_costs import RunShape, fit_calibrated_costs
from pipegpt.costs.devices import make_cluster
from pipegpt.costs.stage_costs import StageCosts
from pipegpt.dims import Sharding
from pipegpt.planner.candidates import Layout, Request
from pipegpt.planner.search import evaluate_layout
from pipegpt.schedule.simulate import Costs

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)
CLUSTER = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
HOST = 0.5e-3


def fitted(host: float):
    """Calibrated from pp 2 (a layer a stage) at 2 sequences per microbatch: F 1 ms, B 2 ms each, without the host's."""
    run = RunShape(MODEL, Sharding(), "none", 2, (1, 1), (0, 1), 2.0)
    return fit_calibrated_costs(CLUSTER, run, Costs((1e-3, 1e-3), (2e-3, 2e-3), (1e-3, 1e-3), 1e-4), 1.0,
                                [1000, 1500], "run", host=host)


@pytest.mark.parametrize("layers, mbs", [((1, 1), 2), ((1, 1), 4), ((2,), 2), ((2,), 8)])
def test_each_stages_forward_and_backward_spend_it_once(layers, mbs):
    """Whatever a stage's layers and its microbatch's size: F and B each + 0.5 ms, W none (I holds it)."""
    def vectors(host):
        return StageCosts(CLUSTER, fitted(host)).vectors(MODEL, Sharding(), "none", mbs, layers)[:3]

    (F, B, W), (F0, B0, W0) = vectors(HOST), vectors(0.0)
    assert F == pytest.approx([f + HOST for f in F0]) and B == pytest.approx([b + HOST for b in B0])
    assert W == pytest.approx(W0)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_one_stage_spends_it_per_action_not_per_token(m):
    """pp 1, a batch of 8 in m microbatches (one stage, no messages: the makespan is its computes): the host's
    time adds 2 x 0.5 ms per microbatch, m F and m B, whatever their size."""
    def makespan(host, m):
        layout = Layout(1, 1, 1, "1f1b", 1, m, 8 // m)
        return evaluate_layout(Request(MODEL, 8, CLUSTER, fitted(host)), layout).makespan

    assert makespan(HOST, m) - makespan(0.0, m) == pytest.approx(2 * HOST * m)


def test_the_costs_say_it():
    assert "0.5 ms of the host's before each F and B" in fitted(HOST).describe()
    assert "host's" not in fitted(0.0).describe()
