"""`pipegpt run --trace-steps` (timelines of chosen steps, `simulate --trace-step N`) and `--profile` (py-spy
flame graphs per rank, and a run that goes on without them when py-spy is missing)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from helpers import assert_one_line_error, clean_env, run_pipegpt

BIN = Path(sys.executable).parent  # where the console scripts (and py-spy, if installed) are


def pipegpt(*args: str, path: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`pipegpt ARGS` in a clean environment, with PATH set to `path` if given."""
    return run_pipegpt(*args, env=clean_env() if path is None else clean_env(PATH=path), timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr


# --------------------------------------------------------------------------------------------------------------
# --trace-steps


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("traced") / "run"
    proc = pipegpt("run", "--stages", "2", "--microbatches", "2", "--steps", "4", "--trace-steps", "2,4",
                   "--run-dir", str(run_dir))
    return proc, run_dir


def test_trace_steps_writes_each_chosen_step_and_trace_json(traced_run):
    proc, run_dir = traced_run
    _ok(proc)
    assert sorted(p.name for p in (run_dir / "traces").iterdir()) == ["step-2.json", "step-4.json"]
    traces = {n: json.loads((run_dir / "traces" / f"step-{n}.json").read_text()) for n in (2, 4)}
    assert json.loads((run_dir / "trace.json").read_text()) == traces[4]  # the last step is trace.json too
    for trace in traces.values():  # the format trace.json has: every rank's actions
        assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    assert traces[2] != traces[4]


def test_simulate_reads_a_traced_step(traced_run):
    proc, run_dir = traced_run
    _ok(proc)
    sim = pipegpt("simulate", "--trace", str(run_dir), "--trace-step", "2", "--json")
    assert sim.returncode == 0, sim.stderr
    summary = json.loads(sim.stdout)
    assert summary["ranks"] == 2 and summary["fidelity"] > 0
    last = json.loads(pipegpt("simulate", "--trace", str(run_dir), "--json").stdout)
    assert summary["measured"]["step_span"] != last["measured"]["step_span"]  # step 2's trace, not trace.json


def test_plan_calibrates_from_every_traced_step(traced_run, monkeypatch):
    """plan --calibrate reads steps 2 and 4 (trace.json, the last, once): each measured figure and the step span
    the medians over them, the step time their metrics rows' median. The computes are fitted without the host's
    time before each, which is charged per action: the run's trace says it was recorded, and it had some."""
    import statistics

    from pipegpt.costs import calibrated
    from pipegpt.costs.devices import make_cluster
    from pipegpt.run_files import read_measured_run
    from pipegpt.schedule.calibrate import calibrate_run
    from pipegpt.schedule.schedule_file import load_schedule_file

    proc, run_dir = traced_run
    _ok(proc)
    seen = {}
    plan = load_schedule_file(str(run_dir / "plan.txt"))
    per_step = [calibrate_run(plan, read_measured_run(run_dir, n)) for n in (2, 4)]
    real_fit = calibrated.fit_calibrated_costs

    def capture(cluster, shape, measured, makespan, *rest):
        seen.update(shape=shape, measured=measured, makespan=makespan, host=rest[-1])
        return real_fit(cluster, shape, measured, makespan, *rest)

    monkeypatch.setattr(calibrated, "fit_calibrated_costs", capture)
    cluster = make_cluster(2, 2, gpu_memory="64GiB", gpu_tflops=1.0, intra_node="80", precision="fp32")
    calibrated.calibrate_costs(str(run_dir), cluster, measure=lambda settings: {x: 1.0 for x in settings})
    assert seen["measured"].forward == tuple(statistics.median(c.compute.forward[s] for _, c in per_step)
                                             for s in range(2))
    assert seen["measured"].backward == tuple(statistics.median(c.compute.backward[s] for _, c in per_step)
                                              for s in range(2))
    assert seen["host"] == statistics.median(c.host for _, c in per_step) > 0
    assert seen["makespan"] == statistics.median(float(m.makespan) for m, _ in per_step)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert seen["shape"].step_time_s == statistics.median(r["step_time_s"] for r in rows if r["step"] in (2, 4))


def test_simulate_refuses_a_step_that_was_not_traced(traced_run):
    proc, run_dir = traced_run
    _ok(proc)
    sim = pipegpt("simulate", "--trace", str(run_dir), "--trace-step", "3")
    assert sim.returncode == 2 and sim.stdout == ""
    assert sim.stderr.splitlines() == [f"Error: {run_dir} has no trace of step 3; traced steps: 2, 4"]


@pytest.mark.parametrize("value, message", [
    ("1,x", "trace_steps='1,x' must be last, all, or comma-separated step numbers"),
    ("5", "trace_steps='5': step 5 is not in this run, whose steps are 1 to 4"),
])
def test_a_bad_trace_steps_value_is_refused_in_one_line(tmp_path, value, message):
    proc = pipegpt("run", "--steps", "4", "--stages", "2", "--trace-steps", value, "--run-dir", str(tmp_path / "r"))
    assert assert_one_line_error(proc).startswith("Error: " + message), proc.stderr
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------------------------------------------
# --profile


def test_profile_leaves_a_flame_graph_per_rank(tmp_path):
    if shutil.which("py-spy", path=str(BIN)) is None and shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed")
    run_dir = tmp_path / "run"
    proc = pipegpt("run", "--profile", "--steps", "3", "--stages", "2", "--run-dir", str(run_dir),
                   path=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    said = [ln for ln in proc.stderr.splitlines() if "--profile" in ln]
    if said and "cannot profile" in said[0]:
        pytest.skip(f"py-spy cannot attach here: {said[0]}")
    _ok(proc)
    assert not said, said
    for rank in (0, 1):
        svg = (run_dir / "profiles" / f"rank-{rank}.svg").read_text()
        assert svg.lstrip().startswith(("<?xml", "<svg")), svg[:100]
        assert ET.fromstring(svg).tag.endswith("svg")
        speedscope = json.loads((run_dir / "profiles" / f"rank-{rank}.speedscope.json").read_text())
        assert speedscope["profiles"] and any(p["samples"] for p in speedscope["profiles"])
    assert "profiles (py-spy): " in proc.stdout


def _path_without_py_spy() -> str:
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and shutil.which("py-spy", path=d) is None)


def _twin_environment(tmp_path: Path) -> Path:
    """This virtual environment under another bin directory, which holds python alone: its interpreter has no
    py-spy beside it. Returns the twin's python."""
    twin = tmp_path / "twin"
    (twin / "bin").mkdir(parents=True)
    (twin / "bin" / "python").symlink_to(sys.executable)
    (twin / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
    for lib in ("lib", "lib64"):
        if (Path(sys.prefix) / lib).is_dir():
            (twin / lib).symlink_to(Path(sys.prefix) / lib)
    return twin / "bin" / "python"


def test_profile_without_py_spy_says_so_in_one_line_and_runs_on(tmp_path):
    if not (Path(sys.prefix) / "pyvenv.cfg").is_file():
        pytest.skip("not in a virtual environment: no twin to make")
    python = _twin_environment(tmp_path)
    run_dir = tmp_path / "run"
    proc = subprocess.run([str(python), "-m", "pipegpt", "run", "--profile", "--steps", "2", "--stages", "2",
                           "--microbatches", "2", "--run-dir", str(run_dir)],
                          env=clean_env(PATH=_path_without_py_spy()), capture_output=True, text=True, timeout=120)
    _ok(proc)
    said = [ln for ln in proc.stderr.splitlines() if "--profile" in ln]
    assert said == [f"pipegpt: --profile: py-spy is neither beside {python} nor on PATH (pip install py-spy into "
                    f"this environment); the run goes on without profiles (every rank)"], proc.stderr
    assert not any((run_dir / "profiles").glob("rank-*"))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2 and (run_dir / "trace.json").is_file()


@pytest.mark.slow  # the lookup's order is test_py_spy_beside_the_interpreter_comes_before_path, in the default run
def test_profile_finds_py_spy_beside_the_interpreter_when_path_lacks_it(tmp_path):
    """As the README runs it: .venv/bin/pipegpt, the virtualenv not activated."""
    if shutil.which("py-spy", path=str(BIN)) is None:
        pytest.skip("py-spy is not installed in this environment")
    run_dir = tmp_path / "run"
    proc = pipegpt("run", "--profile", "--steps", "2", "--stages", "2", "--microbatches", "2",
                   "--run-dir", str(run_dir), path=_path_without_py_spy())
    _ok(proc)
    said = [ln for ln in proc.stderr.splitlines() if "--profile" in ln]
    assert not any("nor on PATH" in ln or "not on PATH" in ln for ln in said), said
    if said:  # found, but not allowed to attach here (ptrace), or no sample in two tiny steps
        assert all("cannot profile" in ln or "took no sample" in ln for ln in said), said
    else:
        assert sorted(p.name for p in (run_dir / "profiles").glob("rank-*.svg")) == ["rank-0.svg", "rank-1.svg"]


def _fake_py_spy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "py-spy"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    return exe


def test_py_spy_beside_the_interpreter_comes_before_path(tmp_path, monkeypatch):
    from pipegpt.observe.profile import find_py_spy

    beside, on_path = _fake_py_spy(tmp_path / "env" / "bin"), _fake_py_spy(tmp_path / "elsewhere")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "env" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    assert find_py_spy() == str(beside)
    beside.unlink()
    assert find_py_spy() == str(on_path)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert find_py_spy() is None


def test_a_profile_window_without_a_sample_says_how_to_get_one(tmp_path, monkeypatch):
    """py-spy leaves out waiting threads: two tiny steps on a rank that mostly waits can give it no sample, and
    it then exits 1 ("No stack counts found"). The line says so, not that py-spy failed."""
    from pipegpt.observe import profile

    exe = tmp_path / "py-spy"
    exe.write_text("#!/bin/sh\n"
                   "trap 'echo \"Error: Failed to write flamegraph: No stack counts found\"; exit 1' INT\n"
                   "echo 'py-spy> Sampling process at 100 Hz. Press Control-C to exit.'\n"
                   "while true; do sleep 0.05; done\n")
    exe.chmod(0o755)
    monkeypatch.setattr(profile, "find_py_spy", lambda: str(exe))
    # A shell cannot trap a signal ignored when it started, and pytest run in the background (`... &`) ignores
    # SIGINT: with a handler here the stand-in starts with SIGINT's default. (py-spy itself installs its own.)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        profiler = profile.Profiler(tmp_path / "profiles", rank=1)
        assert profiler.start(timeout_s=10) is None
        written, problem = profiler.stop(timeout_s=10)
    finally:
        signal.signal(signal.SIGINT, before)
    assert written == []
    assert problem == ("py-spy took no sample of a running thread in the profiled steps (one every 10 ms): "
                       "profile more or longer steps (--trace-steps)")
