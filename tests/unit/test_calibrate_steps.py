"""`plan --calibrate` over every traced step of a run (pipegpt.run_files.read_measured_steps,
pipegpt.schedule.calibrate.median_calibration): which steps are read, and each figure the median over them, so
that one slow step does not move the calibration. Hand-made run directories and numbers."""
from __future__ import annotations

import json

from pipegpt.costs.calibrated import median_step_times, run_shape
from pipegpt.costs.calibrated_costs import StepTimes
from pipegpt.run_files import read_measured_steps
from pipegpt.schedule import build_plan, lower
from pipegpt.schedule.calibrate import Calibration, median_calibration
from pipegpt.schedule.simulate import Costs


def _run_dir(tmp_path, traced: list[int], steps: int):
    """plan.txt, trace.json (the last step's), traces/step-N.json and metrics.jsonl: each trace names its step
    in otherData, and step k took k seconds."""
    (tmp_path / "plan.txt").write_text("")
    (tmp_path / "traces").mkdir()
    trace = lambda step: json.dumps({"traceEvents": [], "otherData": {"step": step}})  # noqa: E731
    for n in traced:
        (tmp_path / "traces" / f"step-{n}.json").write_text(trace(n))
    (tmp_path / "trace.json").write_text(trace(steps))
    rows = [{"step": k, "step_time_s": float(k)} for k in range(1, steps + 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_every_traced_step_once_the_first_left_out(tmp_path):
    runs = read_measured_steps(_run_dir(tmp_path, [1, 3, 5], steps=5))
    assert [r.step for r in runs] == [3, 5]  # step 1 warms up; step 5 is trace.json, read once
    assert [r.trace["otherData"]["step"] for r in runs] == [3, 5]
    assert runs[-1].trace_path.endswith("trace.json")


def test_a_run_with_only_its_last_step_traced(tmp_path):
    assert [r.step for r in read_measured_steps(_run_dir(tmp_path, [], steps=4))] == [4]


def test_step_one_alone_is_kept(tmp_path):
    assert [r.step for r in read_measured_steps(_run_dir(tmp_path, [], steps=1))] == [1]


def test_the_step_time_is_the_traced_steps_median(tmp_path):
    run = _run_dir(tmp_path, [2, 3], steps=9)
    config = {"model": {}, "parallel": {"tp": 1}}
    plan = lower(build_plan("1f1b", 2, 2))
    assert run_shape(str(run), config, plan, [2, 3, 9]).step_time_s == 3.0
    assert run_shape(str(run), config, plan).step_time_s == 9.0  # no steps named: the last, as trace.json


def test_each_figure_is_the_median_over_the_steps():
    def calibration(f0, b1, comm, waits):
        return Calibration(Costs((f0, 2.0), (4.0, b1), (2.0, 3.0), comm),
                           {"F": [4, 4], "B": [4, 4], "I": [0, 0], "W": [0, 0], "comm": waits})

    slow = calibration(10.0, 60.0, 0.9, 1)  # a step that ran slow: its F on stage 0 and B on stage 1
    merged = median_calibration([calibration(1.0, 6.0, 0.1, 3), slow, calibration(1.2, 6.2, 0.2, 2)])
    assert merged.costs.forward == (1.2, 2.0) and merged.costs.backward == (4.0, 6.2)
    assert merged.costs.weight == (2.0, 3.0) and merged.costs.comm == 0.2
    assert merged.samples == {"F": [12, 12], "B": [12, 12], "I": [0, 0], "W": [0, 0], "comm": 6}
    assert median_calibration([slow]) is slow


def test_the_terms_outside_the_actions_are_medians_too():
    steps = [StepTimes(0.010, 0.0, 0.005), None, StepTimes(0.030, 0.002, 0.004), StepTimes(0.011, 0.001, 0.020)]
    assert median_step_times(steps) == StepTimes(0.011, 0.001, 0.005)
    assert median_step_times([None]) is None
    assert median_step_times([]) is None


def test_the_median_of_two_is_their_mean():
    one = Calibration(Costs((1.0,), (2.0,), (1.0,), 0.0), {"F": [1], "B": [1], "I": [0], "W": [0], "comm": 0})
    two = Calibration(Costs((3.0,), (4.0,), (1.0,), 0.0), {"F": [1], "B": [1], "I": [0], "W": [0], "comm": 0})
    assert median_calibration([one, two]).costs.forward == (2.0,)
