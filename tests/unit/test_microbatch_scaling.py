"""A calibrated CPU run's compute at other microbatch sizes (pipegpt.costs.calibrated.MicrobatchScaling): the scale
from a block's measured seconds per sequence at the layout's threads, what is measured when, and the planner's
step scaled by it with the thread term. Hand-worked numbers; the block's seconds are given, not timed."""
from __future__ import annotations

import pytest

from pipegpt.config import ModelConfig
from pipegpt.costs.calibrated import MicrobatchScaling, ThreadScaling, at_size
from pipegpt.costs.calibrated_costs import RunShape, fit_calibrated_costs
from pipegpt.costs.devices import make_cluster
from pipegpt.dims import Sharding
from pipegpt.planner.candidates import Layout, Request
from pipegpt.planner.search import evaluate_layout
from pipegpt.schedule.simulate import Costs


def timer(seconds: dict):
    """A settings timer that answers from `seconds` ({(threads, size): s}) and records each call's settings."""
    calls = []

    def measure(settings):
        calls.append(tuple(settings))
        return {x: seconds[x] for x in settings}

    return measure, calls


def scalings(seconds: dict, calibrated_size: int):
    """Calibrated on 2 cores from 2 ranks (1 thread each) at `calibrated_size` sequences per microbatch."""
    measure, calls = timer(seconds)
    threads = ThreadScaling(calibrated=1, explicit=False, cores=2, measure=at_size(measure, calibrated_size))
    return threads, MicrobatchScaling(threads, calibrated_size, measure), calls


def test_the_term_is_one_at_the_runs_own_size_and_measures_nothing():
    threads, microbatch, calls = scalings({}, 2)
    assert microbatch.scale(2, 2) == 1.0 and microbatch.scale(1, 2) == 1.0 and microbatch.scale(4, 2) == 1.0
    assert calls == [] and "other sizes measured when a layout needs them" in microbatch.describe()


def test_a_size_scales_by_the_blocks_seconds_per_sequence_at_the_layouts_threads():
    """The run's size 2 at 1 thread: 18 ms a block, 9 ms a sequence. Size 4 there takes 32 ms, 8 a sequence: x8/9;
    size 1 10 ms: x10/9. The first need measures the run's size, the layout's and the powers of two below (1, 2, 4)
    in one call; size 8 later adds only itself (60 ms: 7.5 / 9). One rank gets both cores: its sizes are measured
    at 2 threads, against the run's size at 2 threads (10 ms, 5 a sequence; 4: 18 ms, 4.5: x0.9), in a call of
    its own."""
    threads, microbatch, calls = scalings({(1, 1): 0.010, (1, 2): 0.018, (1, 4): 0.032, (1, 8): 0.060,
                                           (2, 1): 0.006, (2, 2): 0.010, (2, 4): 0.018}, 2)
    assert microbatch.scale(2, 4) == pytest.approx(8 / 9)
    assert calls == [((1, 1), (1, 2), (1, 4))]
    assert microbatch.scale(2, 1) == pytest.approx(10 / 9) and len(calls) == 1  # measured with the first
    assert microbatch.scale(2, 8) == pytest.approx(7.5 / 9)
    assert calls[1:] == [((1, 8),)]
    assert microbatch.scale(1, 4) == pytest.approx(0.9)
    assert calls[2:] == [((2, 1), (2, 2), (2, 4))]
    assert "at 1 thread: 1: x1.111, 4: x0.889, 8: x0.833" in microbatch.describe()


def test_the_planners_compute_scales_by_threads_and_microbatch_size_together():
    """Calibrated from 2 ranks on 2 cores (1 thread each) at 2 sequences per microbatch: a block takes 20 ms. pp 1
    gets both cores: at size 2 a block takes 12 ms (x0.6, the thread term), at size 4 21 ms, 5.25 a sequence
    against 6 at size 2 (x0.875, the microbatch term), so pp 1 at m 2 x 4 computes at x0.525 of the calibrated
    model's time without the terms: (21 / 4 x 2) / 20, the block at its threads and size over the run's. With one stage and no messages its
    makespan is all compute. pp 2 at m 4 x 2 runs as calibrated: unchanged, and nothing measured for it."""
    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    run = RunShape(model, Sharding(), "none", 2, (1, 1), (0, 1), 2.0)
    cluster = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
    measured = Costs((1e-3, 1e-3), (2e-3, 2e-3), (1e-3, 1e-3), 1e-4)

    def predict(scaled, pp, m):
        fit = fit_calibrated_costs(cluster, run, measured, 1.0, [1000, 1500], "run")
        if scaled is not None:
            fit.threads, fit.microbatch = scaled
        return evaluate_layout(Request(model, 8, cluster, fit), Layout(1, pp, 1, "1f1b", 1, m, 8 // m))

    threads, microbatch, calls = scalings({(1, 2): 0.020, (2, 1): 0.007, (2, 2): 0.012, (2, 4): 0.021}, 2)
    assert predict((threads, microbatch), 1, 2).makespan == pytest.approx(0.525 * predict(None, 1, 2).makespan)
    assert predict((threads, microbatch), 1, 4).makespan == pytest.approx(0.6 * predict(None, 1, 4).makespan)
    before = len(calls)
    assert predict((threads, microbatch), 2, 4).makespan == pytest.approx(predict(None, 2, 4).makespan)
    assert len(calls) == before
