"""A step's whole time: its parts outside the plan's actions in the trace (pipegpt.observe.step_time), the breakdown
read back (pipegpt.schedule.calibrate.breakdown), and the cost model's terms calibrated from it (the optimizer
per parameter byte, a time per step): hand-worked numbers, no timing."""
from __future__ import annotations

import json

import pytest

from helpers import invoke
from pipegpt.config import ModelConfig
from pipegpt.costs.calibrated import step_times
from pipegpt.costs.calibrated_costs import RunShape, StepTimes, fit_calibrated_costs
from pipegpt.costs.devices import make_cluster
from pipegpt.costs.memory import parameter_count
from pipegpt.dims import Sharding
from pipegpt.observe.step_time import StepPhases, breakdown_text, trace_events
from pipegpt.planner.candidates import Layout, Request
from pipegpt.planner.search import evaluate_layout
from pipegpt.schedule import build_plan, lower
from pipegpt.schedule.calibrate import breakdown
from pipegpt.schedule.schedule_file import dump_schedule_text
from pipegpt.schedule.simulate import Costs

T0 = 10.0  # the step's first action, on the driver's clock (seconds)
# 1F1B on 2 ranks, 1 microbatch: rank 0's actions end last, at T0 + 100 ms
ACTIONS = {0: [("0F0", 0.000, 0.030), ("0SEND_F0", 0.030, 0.031), ("0B0", 0.082, 0.100)],
           1: [("1F0", 0.035, 0.050), ("1B0", 0.050, 0.080)]}
# each rank's step(): before the actions, the actions, the sync, the clip, the optimizer, the end of the step
MARKS = {0: [-0.005, -0.001, 0.101, 0.102, 0.104, 0.110, 0.111],
         1: [-0.004, -0.0005, 0.081, 0.090, 0.104, 0.108, 0.109]}
PARTS = ["before the actions", "actions", "gradient sync", "clip", "optimizer", "end of the step"]
SEND, RECEIPT = -0.010, 0.115  # the driver's call


def synthetic_trace(driver: bool = True) -> dict:
    """A trace.json as a run writes it: the actions ("X", microseconds from T0) and the step parts."""
    events = [{"name": a, "ph": "X", "pid": rank, "tid": 0, "ts": s * 1e6, "dur": (e - s) * 1e6,
               "args": {"action": a}} for rank, actions in ACTIONS.items() for a, s, e in actions]
    phases = [(rank, [(part, T0 + a, T0 + b) for part, a, b in zip(PARTS, marks, marks[1:])])
              for rank, marks in MARKS.items()]
    events += trace_events(phases, T0, (T0 + SEND, T0 + RECEIPT, 1) if driver else None)
    return {"traceEvents": events, "otherData": {"time_unit": "s"}}


def test_the_parts_of_a_synthetic_trace_sum_to_the_step():
    """The chain of instants: the send (-10 ms), the first rank's start (-5), the first action (0), the last
    action's end (100), the last sync (102), clip (104), optimizer (110) and end (111), the receipt (115)."""
    b = breakdown(synthetic_trace())
    got = {name: round(x * 1e3, 9) for name, x in b.parts}
    assert got == {"driver -> workers": 5, "before the actions": 5, "actions": 100, "gradient sync": 2, "clip": 2,
                   "optimizer": 6, "end of the step": 1, "workers -> driver": 4}
    assert b.total == pytest.approx(RECEIPT - SEND) and b.driver
    assert b.round_trip == pytest.approx(0.009) and b.rest == pytest.approx(0.017)  # 125 - 100 - 2 - 6
    # rank 0 computes 48 ms of the 100 ms span and spends 1 ms in a message batch; rank 1 computes 45
    assert b.per_rank[0]["compute"] == pytest.approx(0.048) and b.per_rank[0]["messages"] == pytest.approx(0.001)
    assert b.per_rank[0]["idle"] == pytest.approx(0.051) and b.per_rank[1]["idle"] == pytest.approx(0.055)
    assert b.per_rank[1]["gradient sync"] == pytest.approx(0.009)  # rank 1 waits in its sync for rank 0
    assert b.per_rank[0]["optimizer"] == pytest.approx(0.006)
    text = breakdown_text(b)
    assert "workers -> driver" in text and "125.000 ms" in text


def test_without_the_drivers_call_the_parts_span_the_workers_steps():
    b = breakdown(synthetic_trace(driver=False))
    assert [name for name, _ in b.parts][0] == "before the actions" and not b.driver
    assert b.total == pytest.approx(0.111 + 0.005)  # the first rank's start to the last rank's end
    assert breakdown({"traceEvents": synthetic_trace()["traceEvents"][:5]}) is None  # actions only: no parts


def test_step_phases_cut_a_step_at_its_marks():
    phases = StepPhases(1.0)
    phases.mark("a")
    phases.mark("b")
    (a, start, mid), (b, mid2, end) = phases.spans
    assert (a, b, start) == ("a", "b", 1.0) and mid == mid2 and start <= mid <= end


def test_the_optimizer_is_bytes_times_the_calibrated_rate():
    """6 ms of optimizer on the busiest rank's 1,500 parameters (6,000 fp32 bytes): 1 us a byte, so 2,000
    parameters take 8 ms; the 17 ms of the rest and the 2 ms sync tail (one replica: no reduction to charge it to)
    are 19 ms a step. With ZeRO over 2 replicas the busiest rank updates 750 of them: 2 us a byte."""
    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    run = RunShape(model, Sharding(), "none", 1, (1, 1), (0, 1), None)
    cluster = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
    measured = Costs((1e-3, 1e-3), (2e-3, 2e-3), (1e-3, 1e-3), 1e-4)
    parts = StepTimes(optimizer=0.006, sync=0.002, rest=0.017)
    fit = fit_calibrated_costs(cluster, run, measured, 1.0, [1000, 1500], "run", parts)
    assert fit.optimizer_s_per_byte == pytest.approx(1e-6) and fit.per_step_time() == pytest.approx(0.019)
    assert fit.optimizer_time(2000, 7) == pytest.approx(0.008)
    zero = fit_calibrated_costs(cluster, run, measured, 1.0, [1000, 1500], "run", parts, replicas=2, zero=1)
    assert zero.optimizer_s_per_byte == pytest.approx(2e-6) and zero.per_step_time() == pytest.approx(0.017)
    old = fit_calibrated_costs(cluster, run, measured, 1.0, [1000, 1500], "run")  # no parts: as before
    assert old.optimizer_s_per_byte is None and old.per_step_time() == 0.0 and old.optimizer_time(1500, 7) == 0.0

    # the planner's step: makespan + the busiest rank's optimizer + the time per step (one stage: no tied sum)
    result = evaluate_layout(Request(model, 4, cluster, fit), Layout(1, 1, 1, "1f1b", 1, 4, 1))
    params = parameter_count(model, range(2), True, True, 1)
    assert result.step_time - result.makespan == pytest.approx(params * 4 * 1e-6 + 0.019)
    assert step_times(breakdown(synthetic_trace())) == StepTimes(pytest.approx(0.006), pytest.approx(0.002),
                                                                 pytest.approx(0.017))


def test_simulate_breakdown_predicts_the_whole_step(tmp_path):
    """--breakdown: the predicted step is the simulated makespan plus the 25 ms outside the actions."""
    plan = lower(build_plan("1f1b", 2, 1))
    (tmp_path / "plan.txt").write_text(dump_schedule_text(plan))
    (tmp_path / "trace.json").write_text(json.dumps(synthetic_trace()))
    result = invoke("simulate", "--trace", str(tmp_path), "--breakdown", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    step = data["step"]
    assert step["total"] == pytest.approx(0.125) and step["parts"]["optimizer"] == pytest.approx(0.006)
    assert step["predicted"] == pytest.approx(data["predicted"]["makespan"] + 0.025)
    text = invoke("simulate", "--trace", str(tmp_path), "--breakdown", "--no-chart")
    assert text.exit_code == 0 and "whole step measured / predicted" in text.stdout
    assert invoke("simulate", "--breakdown").exit_code != 0  # only with --trace


def test_a_real_runs_trace_has_its_steps_parts(tmp_path):
    """A run's trace.json holds each rank's parts and the driver's call: the parts sum to the driver's call, which
    encloses the step's time in metrics.jsonl (the driver's own measure of the same call)."""
    from helpers import ROOT, clean_env, run_pipegpt

    run_dir = tmp_path / "run"
    done = run_pipegpt("run", "--stages", "2", "--microbatches", "2", "--steps", "2", "--run-dir", run_dir,
                       env=clean_env(PYTHONPATH=str(ROOT)), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    b = breakdown(json.loads((run_dir / "trace.json").read_text()))
    assert b.driver and [name for name, _ in b.parts] == ["driver -> workers", *PARTS, "workers -> driver"]
    assert sorted(b.per_rank) == [0, 1] and all(x >= 0 for name, x in b.parts[:-1])
    step_time = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step_time_s"]
    assert b.total >= step_time > b.part("actions")


def test_the_last_stage_keeps_what_it_measures_beyond_the_blocks():
    """Two stages of one block each, measured at twice the FLOP model at peak, the last stage's forward 4 ms more
    (the loss, the logits' traffic): the blocks are scaled by 2 (the lower ratio), the head gets 4 ms per
    microbatch of 2 x 16 tokens (125 us a token: 8 ms at 4 sequences); one stage of both blocks measures the sum."""
    from pipegpt.costs.cost import AnalyticalCosts, Shape

    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    cluster = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
    unit = AnalyticalCosts(cluster, efficiency=1.0, layer_overhead_s=0.0)
    block, embed, head = unit.compute(model, Shape(Sharding(), "none", 2))
    first, last = [block.f + embed.f, block.b + embed.b, block.w + embed.w], [block.f + head.f, block.b + head.b,
                                                                             block.w + head.w]
    measured = Costs((2 * first[0], 2 * last[0] + 0.004), (2 * first[1], 2 * last[1]), (2 * first[2], 2 * last[2]), 0)
    fit = fit_calibrated_costs(cluster, RunShape(model, Sharding(), "none", 2, (1, 1), (0, 1), None), measured, 1.0,
                               [1, 1], "run")
    assert (fit.scale_f, fit.scale_b) == (pytest.approx(2), pytest.approx(2))
    assert fit.head_extra == (pytest.approx(0.004 / 32), pytest.approx(0), pytest.approx(0))
    assert fit.embed_extra == (pytest.approx(0), pytest.approx(0), pytest.approx(0))
    b2, e2, h2 = fit.compute(model, Shape(Sharding(), "none", 2))
    assert (b2.f + e2.f, b2.f + h2.f) == (pytest.approx(measured.forward[0]), pytest.approx(measured.forward[1]))
    h4 = fit.compute(model, Shape(Sharding(), "none", 4))[2]
    assert h4.f == pytest.approx(2 * unit.compute(model, Shape(Sharding(), "none", 4))[2].f + 0.008)
