"""`pipegpt simulate --trace RUN_DIR`: costs calibrated from a measured trace, measured beside predicted.

Synthetic runs are simulated timelines written as a run directory would be (plan.txt, trace.json): the
calibration must give back the costs they were simulated with, and a fidelity of exactly 1.
"""
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers import ROOT, assert_one_line_error, clean_env, invoke, run_pipegpt
from pipegpt.schedule import ScheduleError, build_plan, lower
from pipegpt.schedule.calibrate import calibrate, compare, comm_samples, load_run, read_trace
from pipegpt.schedule.render import ascii_gantt, to_chrome_trace
from pipegpt.schedule.schedule_file import dump_schedule_text
from pipegpt.schedule.simulate import Costs, simulate


def write_run(path: Path, plan, trace: dict, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "plan.txt").write_text(dump_schedule_text(plan))
    (path / "trace.json").write_text(json.dumps(trace))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def synthetic_run(path: Path, name: str, p: int, m: int, costs: Costs):
    """A run directory whose trace is the simulation of the lowered plan with `costs`."""
    plan = lower(build_plan(name, p, m))
    return write_run(path, plan, to_chrome_trace(simulate(plan, costs))), plan


def simulate_cli(*args):
    return invoke("simulate", *args)


# Dyadic numbers, so microseconds and back are exact in floating point.
CASES = {
    "1f1b": (2, 4, Costs((1, 1.5), (2, 3), (1, 1.5))),
    "1f1b-4x8": (4, 8, Costs((1, 1.25, 1, 2), (2, 2.5, 2, 3), (1, 1, 1, 1))),
    "zb-h1": (3, 6, Costs((1, 1.5, 1), (2, 3, 2.5), (0.75, 1.25, 1))),
    "interleaved-1f1b": (2, 4, Costs((0.5, 0.75, 0.5, 1), (1, 1.5, 1, 2), (0.5, 0.75, 0.5, 1))),
}


@pytest.mark.parametrize("comm", [0, 0.25])
@pytest.mark.parametrize("case", list(CASES))
def test_synthetic_trace_gives_back_its_costs_and_fidelity_one(tmp_path, case, comm):
    p, m, costs = CASES[case]
    costs = Costs(costs.forward, costs.backward, costs.weight, comm)
    run_dir, plan = synthetic_run(tmp_path / "run", case.split("-4x")[0], p, m, costs)
    c = compare(run_dir)
    got = c.calibration.costs
    assert got.forward == costs.forward and got.backward == costs.backward and got.comm == comm
    if case == "zb-h1":
        assert got.weight == costs.weight and all(c.calibration.samples["I"])
    assert c.calibration.samples["comm"] > 0
    assert c.fidelity == 1.0
    assert [e.start for e in c.predicted.events] == [e.start for e in simulate(plan, costs).events]
    s = c.summary()
    assert s["measured"]["step_span"] == s["predicted"]["makespan"]
    assert s["measured"]["idle_per_rank"] == s["predicted"]["idle_per_rank"]
    assert s["measured"]["comm_overhead_per_rank"] is None  # a simulated trace has no comm events


def test_interleaved_has_several_stages_per_rank(tmp_path):
    p, m, costs = CASES["interleaved-1f1b"]
    run_dir, plan = synthetic_run(tmp_path / "run", "interleaved-1f1b", p, m, costs)
    plan_read, measured = load_run(run_dir)
    assert plan_read.stage_to_rank == (0, 1, 0, 1) and measured.time_unit == "unit"
    assert calibrate(plan_read, measured).samples["F"] == [m] * 4


def test_a_wait_inside_the_compute_that_reads_the_message_is_not_compute():
    """The runtime waits for a received input inside the compute that reads it: each such compute starts when
    its rank is free. Hand-worked on 1F1B, 2 x 4, F 1, B 2, every message 0.5 late (simulated, then each
    compute moved to start at its rank's previous end, as the runtime records it). Counted from its start,
    rank 0's B0 would read 5; from its producer 1B0's end (4.5) it reads 2.5, the compute and the message's
    last leg. Stage 0's B: 0B0 7 - 4.5, 0B1 10 - 8 (started after 1B1's 7.5), 0B2 14 - 11.5, 0B3 17 - 14.5:
    mean 2.375. Stage 1's F: 1, 1, 9.5 - 8 (1F2 waited inside for 0F2), 1: mean 1.125. The waited-for messages,
    each from its consumer's end less that mean to its producer's end: 1F2's 9.5 - 1.125 - 8 = 0.375; 0B0's
    7 - 2.375 - 4.5, 0B2's 14 - 2.375 - 11.5 and 0B3's 17 - 2.375 - 14.5, 0.125 each. comm = their mean,
    0.75 / 4."""
    import dataclasses

    plan = lower(build_plan("1f1b", 2, 4))
    simulated = simulate(plan, Costs.uniform(2, 1, 2, comm=0.5))
    free, moved = {}, []
    for e in sorted(simulated.events, key=lambda e: (e.rank, e.start)):
        if e.action.kind.is_compute:
            moved.append(dataclasses.replace(e, start=free.get(e.rank, e.start)))
            free[e.rank] = e.end
        else:
            moved.append(e)
    calibration = calibrate(plan, dataclasses.replace(simulated, events=moved, meta={"recorded": True}))
    got = calibration.costs
    assert got.forward == (1, 1.125) and got.backward == (2.375, 2) and got.comm == 0.1875
    assert calibration.host == 0 and calibration.compute == got  # each compute began as its rank came free
    assert calibrate(plan, simulated).costs.backward == (2, 2)  # waits outside the computes: as before


def test_the_hosts_time_between_computes_is_the_ranks():
    """In a trace the runtime recorded, the time between two computes (its message batches, the dispatch)
    holds the rank, and the simulator has no place for it but the computes. Hand-worked on one rank, 1F1B
    x 2 (F0 B0 F1 B1), F 1, B 2, 0.25 between computes: F0 from the step's start 1, F1 1.25 (mean 1.125), B 2.25
    each; simulated, 2 x 1.125 + 2 x 2.25 = 6.75, the measured span. Read as a simulation's trace, the gaps are
    waits on nothing the plan has: F 1, B 2, predicted 6. Apart, for the planner: the computes alone F 1, B 2,
    and the host's (0 + 0.25 x 3) / 4 = 0.1875 per compute."""
    import dataclasses

    plan = build_plan("1f1b", 1, 2)
    simulated = simulate(plan, Costs.uniform(1, 1, 2))
    shift, gapped = 0.0, []
    for i, e in enumerate(sorted(simulated.events, key=lambda e: e.start)):
        shift = 0.25 * i
        gapped.append(dataclasses.replace(e, start=e.start + shift, end=e.end + shift))
    recorded = dataclasses.replace(simulated, events=gapped, meta={"recorded": True})
    assert [str(e.action) for e in gapped] == ["0F0", "0B0", "0F1", "0B1"] and recorded.makespan == 6.75
    calibration = calibrate(plan, recorded)
    got = calibration.costs
    assert got.forward == (1.125,) and got.backward == (2.25,)
    assert simulate(plan, got).makespan == 6.75
    assert calibration.compute.forward == (1,) and calibration.compute.backward == (2,)
    assert calibration.host == 0.1875
    as_simulated = calibrate(plan, dataclasses.replace(recorded, meta={}))
    assert as_simulated.costs.forward == (1,) and as_simulated.costs.backward == (2,)
    assert as_simulated.host == 0 and as_simulated.compute == as_simulated.costs


def test_a_runs_trace_says_it_was_recorded(tmp_path):
    """A run's trace.json says so (otherData.recorded), and reading it back keeps it: calibration reads the
    gaps between its computes as the host's."""
    plan = lower(build_plan("1f1b", 2, 4))
    timeline = simulate(plan, Costs.uniform(2, 1, 2))
    assert "recorded" not in to_chrome_trace(timeline)["otherData"]
    timeline.meta["recorded"] = True
    run_dir = write_run(tmp_path / "run", plan, to_chrome_trace(timeline))
    assert load_run(run_dir)[1].meta["recorded"] is True


def test_comm_samples_are_the_waits():
    plan = lower(build_plan("1f1b", 2, 4))
    timeline = simulate(plan, Costs.uniform(2, 1, 2, comm=0.5))
    assert set(comm_samples(plan, timeline)) == {0.5}
    one_rank = build_plan("1f1b", 1, 4)
    assert comm_samples(one_rank, simulate(one_rank, Costs.uniform(1))) == []


def test_dp_and_tp_read_the_first_replica(tmp_path):
    # pp=2, dp=2, tp=2: pipeline rank r of replica (dp 0, tp 0) is global rank r * tp; the others are noise.
    p, m, costs = CASES["1f1b"]
    plan = lower(build_plan("1f1b", p, m))
    trace = to_chrome_trace(simulate(plan, costs))
    noisy = json.loads(json.dumps(trace))
    events = []
    for e in noisy["traceEvents"]:
        for dp in range(2):
            for tp in range(2):
                copy = dict(e, pid=(dp * p + e["pid"]) * 2 + tp)
                if (dp, tp) != (0, 0) and copy["ph"] == "X":
                    copy["dur"] = e["dur"] * 3  # would spoil the costs if read
                events.append(copy)
    noisy["traceEvents"] = events
    run_dir = write_run(tmp_path / "run", plan, noisy, {"parallel": {"stages": 2, "dp": 2, "tp": 2}})
    c = compare(run_dir)
    assert c.global_ranks == (0, 2)
    assert c.calibration.costs.forward == costs.forward and c.fidelity == 1.0
    result = simulate_cli("--trace", str(run_dir), "--no-chart")
    assert result.exit_code == 0, result.output
    assert "global ranks [0, 2]" in result.stdout


def test_cli_text_json_and_pictures(tmp_path):
    p, m, costs = CASES["zb-h1"]
    run_dir, _ = synthetic_run(tmp_path / "run", "zb-h1", p, m, Costs(costs.forward, costs.backward,
                                                                          costs.weight, 0.25))
    result = simulate_cli("--trace", str(run_dir), "--width", "100")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("measured:") and "predicted (calibrated costs):" in out
    assert out.count("r0 |") == 2 and "fidelity 1.000" in out and "comm 0.25 per message" in out

    result = simulate_cli("--trace", str(run_dir), "--json", "--out", str(tmp_path / "cmp.html"))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {"run_dir", "schedule", "ranks", "stages", "microbatches", "stage_to_rank", "global_ranks", "time_unit",
            "costs", "samples", "measured", "predicted", "fidelity", "notes"} <= set(data)
    assert {"step_span", "bubble_fraction", "bubble_fraction_per_rank", "busy_per_rank", "idle_per_rank",
            "comm_overhead_per_rank"} <= set(data["measured"])
    assert {"makespan", "bubble_fraction", "idle_per_rank"} <= set(data["predicted"])
    assert data["costs"] == {"F": [1.0, 1.5, 1.0], "B": [2.0, 3.0, 2.5], "W": [0.75, 1.25, 1.0], "comm": 0.25}
    assert data["fidelity"] == 1.0 and data["schedule"] == "zb-h1" and data["time_unit"] == "unit"
    html = (tmp_path / "cmp.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 2 and "fidelity" in html

    result = simulate_cli("--trace", str(run_dir), "--no-chart", "--out", str(tmp_path / "cmp.svg"))
    assert result.exit_code == 0, result.output
    for name in ("measured", "predicted"):
        ET.fromstring((tmp_path / f"cmp.{name}.svg").read_text())


def test_one_scale_for_two_charts():
    plan = build_plan("1f1b", 2, 2)
    t = simulate(plan, Costs.uniform(2, 1, 2))
    assert ascii_gantt(t, width=60, span=t.makespan) == ascii_gantt(t, width=60)
    rows = [line for line in ascii_gantt(t, width=60, span=2 * t.makespan).splitlines() if line.startswith("r0 |")]
    bar = rows[0][4:-1]
    assert bar.endswith(" " * (len(bar) // 2 - 1)) and "makespan 9," in ascii_gantt(t, width=60, span=18)


# ---------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def test_bad_run_dirs(tmp_path):
    assert_one_line_error(simulate_cli("--trace", str(tmp_path / "nope")), "no such run directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(simulate_cli("--trace", str(tmp_path / "empty")), "no plan.txt")
    run_dir, plan = synthetic_run(tmp_path / "run", "1f1b", *CASES["1f1b"])
    (run_dir / "trace.json").unlink()
    assert_one_line_error(simulate_cli("--trace", str(run_dir)), "no trace.json")
    (run_dir / "trace.json").write_text("{not json")
    assert_one_line_error(simulate_cli("--trace", str(run_dir)), "is not valid JSON")


def test_trace_of_another_plan(tmp_path):
    _, _, costs = CASES["1f1b"]
    run_dir, _ = synthetic_run(tmp_path / "run", "1f1b", 2, 4, costs)
    other = to_chrome_trace(simulate(lower(build_plan("zb-h1", 2, 4)), costs))
    (run_dir / "trace.json").write_text(json.dumps(other))
    assert_one_line_error(simulate_cli("--trace", str(run_dir)), "is not a trace of this plan (1f1b, 2 ranks")
    more = to_chrome_trace(simulate(lower(build_plan("1f1b", 2, 6)), costs))
    (run_dir / "trace.json").write_text(json.dumps(more))
    assert_one_line_error(simulate_cli("--trace", str(run_dir)), "which the plan does not have there")
    (run_dir / "config.json").write_text(json.dumps({"parallel": {"stages": 2, "dp": 1, "tp": 2}}))
    assert_one_line_error(simulate_cli("--trace", str(run_dir)), "has no events for rank 1 (global rank 2)")
    (run_dir / "config.json").write_text(json.dumps({"parallel": {"stages": 4, "dp": 1, "tp": 1}}))
    with pytest.raises(ScheduleError, match="stages=4 but plan.txt has 2 ranks"):
        load_run(run_dir)


def test_trace_missing_an_action(tmp_path):
    plan = lower(build_plan("1f1b", 2, 4))
    trace = to_chrome_trace(simulate(plan, CASES["1f1b"][2]))
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("args", {}).get("action") != "1B3"]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    with pytest.raises(ScheduleError, match="on rank 1 the plan's 1B3 is not in it"):
        read_trace(path, plan)


@pytest.mark.parametrize("extra", [["--schedule", "1f1b"], ["--schedule-file", "x.txt"], ["--costs", "F=1"]])
def test_trace_refuses_other_sources(tmp_path, extra):
    run_dir, _ = synthetic_run(tmp_path / "run", "1f1b", *CASES["1f1b"])
    assert_one_line_error(simulate_cli("--trace", str(run_dir), *extra), f"leave out {extra[0]}")


def test_trace_refuses_other_sizes(tmp_path):
    run_dir, _ = synthetic_run(tmp_path / "run", "1f1b", *CASES["1f1b"])
    assert_one_line_error(simulate_cli("--trace", str(run_dir), "--stages", "3"), "--stages 3 does not match")
    assert simulate_cli("--trace", str(run_dir), "--stages", "2", "-m", "4", "--no-chart").exit_code == 0


# ---------------------------------------------------------------------------------------------------------
# a real run


def test_real_run_calibrates(tmp_path):
    run_dir = tmp_path / "run"
    done = run_pipegpt("run", "--stages", "2", "--microbatches", "4", "--steps", "3", "--run-dir", run_dir,
                       env=clean_env(PYTHONPATH=str(ROOT)), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    result = simulate_cli("--trace", str(run_dir), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    print(f"\nfidelity of 1f1b 2x4 on this machine: {data['fidelity']:.3f} (measured step span "
          f"{data['measured']['step_span'] * 1e3:.1f} ms, predicted {data['predicted']['makespan'] * 1e3:.1f} ms, "
          f"comm {data['costs']['comm'] * 1e3:.3f} ms)")
    assert math.isfinite(data["fidelity"]) and 0.5 <= data["fidelity"] <= 2
    assert data["time_unit"] == "s" and data["samples"]["F"] == [4, 4] and data["samples"]["comm"] > 0
    assert len(data["measured"]["comm_overhead_per_rank"]) == 2
    assert json.loads((run_dir / "trace.json").read_text())["otherData"]["recorded"] is True
    text = simulate_cli("--trace", str(run_dir), "--width", "100")
    assert text.exit_code == 0 and "fidelity" in text.stdout and " ms" in text.stdout
