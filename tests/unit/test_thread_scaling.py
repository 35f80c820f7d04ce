"""A calibrated CPU run's compute at other threads per rank (pipegpt.costs.calibrated.ThreadScaling): each layout's
threads as the driver gives them, the scale from a block's measured seconds, and the planner's step scaled by it.
Hand-worked numbers; the block's seconds are given, not timed."""
from __future__ import annotations

import json

import pytest

from pipegpt.config import ModelConfig
from pipegpt.costs.calibrated import ThreadScaling, thread_scaling
from pipegpt.costs.calibrated_costs import RunShape, fit_calibrated_costs
from pipegpt.costs.devices import make_cluster
from pipegpt.dims import Sharding
from pipegpt.planner.candidates import Layout, Request
from pipegpt.planner.search import evaluate_layout
from pipegpt.schedule.simulate import Costs


def timer(seconds: dict):
    """A measure that answers from `seconds` and records each call's thread counts."""
    calls = []

    def measure(threads):
        calls.append(tuple(threads))
        return {t: seconds[t] for t in threads}

    return measure, calls


def test_a_layout_runs_at_the_cores_over_its_ranks_scaled_by_the_blocks_measured_time():
    """8 cores, the calibration run on 4 ranks: 2 threads each. One rank gets 8 threads, a block there takes
    25 of the 50 ms it took at 2: x0.5; eight ranks get 1 thread: 80 / 50 = x1.6. The first layout that needs
    another count measures every count a layout can get here at once (8 // r for r = 1..8, and the run's own)."""
    measure, calls = timer({1: 0.080, 2: 0.050, 4: 0.030, 8: 0.025})
    scaling = ThreadScaling(calibrated=2, explicit=False, cores=8, measure=measure)
    assert [scaling.threads(r) for r in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]
    assert scaling.scale(4) == 1.0 and scaling.scale(3) == 1.0 and calls == []  # the run's own threads
    assert scaling.scale(1) == pytest.approx(0.5)
    assert calls == [(1, 2, 4, 8)]
    assert scaling.scale(8) == pytest.approx(1.6) and scaling.scale(2) == pytest.approx(0.6)
    assert calls == [(1, 2, 4, 8)]  # measured once
    assert "8: x2.00" in scaling.describe() and "1: x0.62" in scaling.describe()


def test_an_explicit_thread_count_is_every_layouts():
    measure, calls = timer({})
    scaling = ThreadScaling(calibrated=1, explicit=True, cores=2, measure=measure)
    assert scaling.threads(1) == 1 and scaling.scale(1) == 1.0 and calls == []
    assert "--threads-per-worker" in scaling.describe()


def test_the_calibration_runs_threads_from_its_config_and_none_on_a_gpu():
    cpu = {"runtime": {"device": "auto", "threads_per_worker": None}}
    got = thread_scaling(cpu, [{"mfu": None}], ranks=2, measure=None, cores=2)
    assert (got.calibrated, got.explicit, got.cores) == (1, False, 2)
    got = thread_scaling(cpu, [{"mfu": None}], ranks=3, measure=None, cores=16)
    assert (got.calibrated, got.explicit) == (5, False)  # the driver's cpu_count // world_size
    given = {"runtime": {"device": "cpu", "threads_per_worker": 3}}
    assert (thread_scaling(given, [], 2, None, cores=16).calibrated, thread_scaling(given, [], 2, None, 16).explicit) \
        == (3, True)
    assert thread_scaling({"runtime": {"device": "cuda"}}, [], 2, None, 2) is None
    assert thread_scaling({"runtime": {"device": "auto"}}, [{"mfu": 0.3}], 2, None, 2) is None  # a GPU's MFU


def test_the_planners_compute_scales_by_the_layouts_threads():
    """Calibrated from 2 ranks on 2 cores (1 thread each). pp 1 runs its one rank on both cores: a block takes
    6 of the 10 ms it took on one, so its compute is x0.6, and with one stage and no messages its makespan is
    all compute: x0.6 exactly. pp 2 runs as calibrated: unchanged. What follows the last action is not compute."""
    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    run = RunShape(model, Sharding(), "none", 1, (1, 1), (0, 1), 2.0)
    cluster = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
    measured = Costs((1e-3, 1e-3), (2e-3, 2e-3), (1e-3, 1e-3), 1e-4)

    def predict(threads, pp):
        fit = fit_calibrated_costs(cluster, run, measured, 1.0, [1000, 1500], "run")
        fit.threads = threads
        return evaluate_layout(Request(model, 4, cluster, fit), Layout(1, pp, 1, "1f1b", 1, 4, 1))

    measure, calls = timer({1: 0.010, 2: 0.006})
    scaled = ThreadScaling(calibrated=1, explicit=False, cores=2, measure=measure)
    alone, two = predict(scaled, 1), predict(scaled, 2)
    assert alone.makespan == pytest.approx(0.6 * predict(None, 1).makespan)
    assert alone.after == pytest.approx(predict(None, 1).after)
    assert two.makespan == pytest.approx(predict(None, 2).makespan) and calls == [(1, 2)]
    explicit = ThreadScaling(calibrated=1, explicit=True, cores=2, measure=measure)
    assert predict(explicit, 1).makespan == pytest.approx(predict(None, 1).makespan)


def test_the_child_process_answers_seconds_per_setting(capsys):
    """The measurement the planner runs as a child process: one block under each [threads, microbatch size] asked,
    in JSON, in the order asked."""
    from pipegpt.stages.block_timing import main

    model = {"vocab_size": 64, "seq_len": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
    assert main([json.dumps({"model": model, "settings": [[1, 1], [1, 2]]})]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert [(t, size) for t, size, _ in answer] == [(1, 1), (1, 2)] and all(s > 0 for _, _, s in answer)


def test_the_optimizer_scales_by_its_own_measured_step_not_the_blocks():
    """Calibrated from 2 ranks on 2 cores (1 thread each), its optimizer at 0.5 ms per MB of fp32 parameters and
    4 ms a step besides. pp 1's one rank updates every parameter on both cores, where the optimizer's step took 8 of
    the 10 ms it took on one (the block: 6 of 10): its after-term's optimizer part is x0.8, the 4 ms unchanged. pp 2
    runs as calibrated: nothing scaled, nothing measured for it."""
    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    run = RunShape(model, Sharding(), "none", 1, (1, 1), (0, 1), 2.0)
    cluster = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
    measured = Costs((1e-3, 1e-3), (2e-3, 2e-3), (1e-3, 1e-3), 1e-4)
    block, _ = timer({1: 0.010, 2: 0.006})
    step, step_calls = timer({1: 0.010, 2: 0.008})

    def predict(threads, pp):
        fit = fit_calibrated_costs(cluster, run, measured, 1.0, [1000, 1500], "run")
        fit.optimizer_s_per_byte, fit.per_step_s, fit.threads = 0.5e-9, 0.004, threads
        return evaluate_layout(Request(model, 4, cluster, fit), Layout(1, pp, 1, "1f1b", 1, 4, 1))

    scaled = ThreadScaling(calibrated=1, explicit=False, cores=2, measure=block, measure_optimizer=step)
    plain = predict(None, 1).after
    assert plain > 0.004
    assert predict(scaled, 1).after == pytest.approx(0.8 * (plain - 0.004) + 0.004)
    assert step_calls == [(1, 2)] and "the optimizer at 2: x1.25" in scaled.describe()
    assert predict(scaled, 2).after == pytest.approx(predict(None, 2).after) and step_calls == [(1, 2)]
    assert ThreadScaling(calibrated=1, explicit=False, cores=2, measure=block).optimizer_scale(1) == 1.0


def test_the_child_process_times_the_optimizer_at_size_zero(capsys):
    """Size 0 asks for one AdamW step over the model's parameters, not the block."""
    from pipegpt.stages.block_timing import main

    model = {"vocab_size": 64, "seq_len": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
    assert main([json.dumps({"model": model, "settings": [[1, 0], [2, 0]]})]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert [(t, size) for t, size, _ in answer] == [(1, 0), (2, 0)] and all(s > 0 for _, _, s in answer)


def test_a_layout_with_fewer_ranks_at_once_than_the_run_computes_faster_by_what_they_lost_to_each_other():
    """Calibrated from 2 ranks on 2 cores at 1 thread: the block took 10.4 ms in two processes at once against 10 ms
    alone. pp 1's one rank has the machine to itself: x0.6 for its 2 threads and x1/1.04 for no neighbour. pp 2 runs
    as the run did: unchanged, nothing measured. At an explicit 1 thread, pp 1 still computes alone (a core idle)."""
    measure, _ = timer({1: 0.010, 2: 0.006})
    asked = []

    def shared(threads, at_once):
        asked.append((threads, at_once))
        return 0.010, 0.0104

    scaling = ThreadScaling(calibrated=1, explicit=False, cores=2, measure=measure, ranks=2, measure_shared=shared)
    assert scaling.scale(2) == 1.0 and asked == []
    assert [scaling.at_once(r) for r in (1, 2, 4)] == [1, 2, 2]
    assert scaling.scale(1) == pytest.approx(0.6 / 1.04) and asked == [(1, 2)]
    assert scaling.scale(4) == 1.0  # four ranks on two cores: two compute at once, as in the run
    assert "2 at 1 thread x1.040" in scaling.describe()
    explicit = ThreadScaling(calibrated=1, explicit=True, cores=2, measure=measure, ranks=2, measure_shared=shared)
    assert explicit.scale(1) == pytest.approx(1 / 1.04) and explicit.scale(2) == 1.0


def test_the_child_process_times_the_block_alone_and_in_processes_at_once(capsys):
    """at_once: the one setting asked, timed alone and in two processes at once, rounds alternating."""
    from pipegpt.stages.block_timing import main

    model = {"vocab_size": 64, "seq_len": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
    assert main([json.dumps({"model": model, "settings": [[1, 1]], "at_once": 2})]) == 0
    (threads, size, alone, shared), = json.loads(capsys.readouterr().out)
    assert (threads, size) == (1, 1) and alone > 0 and shared > 0
