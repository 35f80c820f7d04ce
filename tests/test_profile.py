"""`pipegpt run --trace-steps` (timelines of chosen steps, `simulate --trace-step N`) and `--profile` (py-spy
flame graphs per rank, and a run that goes on without them when py-spy is missing)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PIPEGPT = str(BIN / "pipegpt")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_USE_AGENT_STORE")


def _env(path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and k != "PIPEGPT_FAULT"}
    if path is not None:
        env["PATH"] = path
    return env


def pipegpt(*args: str, path: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PIPEGPT, *args], cwd=ROOT, env=_env(path), capture_output=True, text=True,
                          timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr


# --------------------------------------------------------------------------------------------------------------
# --trace-steps


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("traced") / "run"
    proc = pipegpt("run", "--stages", "2", "--microbatches", "2", "--steps", "4", "--trace-steps", "1,3",
                   "--run-dir", str(run_dir))
    return proc, run_dir


def test_trace_steps_writes_each_chosen_step_and_trace_json(traced_run):
    proc, run_dir = traced_run
    _ok(proc)
    assert sorted(p.name for p in (run_dir / "traces").iterdir()) == ["step-1.json", "step-3.json"]
    traces = {n: json.loads((run_dir / "traces" / f"step-{n}.json").read_text()) for n in (1, 3)}
    assert json.loads((run_dir / "trace.json").read_text()) == traces[3]  # the last step is trace.json too
    for trace in traces.values():  # the format trace.json has: every rank's actions
        assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    assert traces[1] != traces[3]


def test_simulate_reads_a_traced_step(traced_run):
    proc, run_dir = traced_run
    _ok(proc)
    sim = pipegpt("simulate", "--trace", str(run_dir), "--trace-step", "1", "--json")
    assert sim.returncode == 0, sim.stderr
    summary = json.loads(sim.stdout)
    assert summary["ranks"] == 2 and summary["fidelity"] > 0
    last = json.loads(pipegpt("simulate", "--trace", str(run_dir), "--json").stdout)
    assert summary["measured"]["step_span"] != last["measured"]["step_span"]  # step 1's trace, not trace.json


def test_simulate_refuses_a_step_that_was_not_traced(traced_run):
    proc, run_dir = traced_run
    _ok(proc)
    sim = pipegpt("simulate", "--trace", str(run_dir), "--trace-step", "2")
    assert sim.returncode == 2 and sim.stdout == ""
    assert sim.stderr.splitlines() == [f"Error: {run_dir} has no trace of step 2; traced steps: 1, 3"]


@pytest.mark.parametrize("value, message", [
    ("1,x", "trace_steps='1,x' must be last, all, or comma-separated step numbers"),
    ("4", "trace_steps='4': step 4 is not in this run, whose steps are 0 to 3"),
])
def test_a_bad_trace_steps_value_is_refused_in_one_line(tmp_path, value, message):
    proc = pipegpt("run", "--steps", "4", "--stages", "2", "--trace-steps", value, "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: " + message), lines
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


def test_profile_without_py_spy_says_so_in_one_line_and_runs_on(tmp_path):
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and shutil.which("py-spy", path=d) is None)
    run_dir = tmp_path / "run"
    proc = pipegpt("run", "--profile", "--steps", "2", "--stages", "2", "--microbatches", "2",
                   "--run-dir", str(run_dir), path=path)
    _ok(proc)
    said = [ln for ln in proc.stderr.splitlines() if "--profile" in ln]
    assert said == ["pipegpt: --profile: py-spy is not on PATH (pip install py-spy, or activate the virtualenv "
                    "that has it); the run goes on without profiles (every rank)"], proc.stderr
    assert not any((run_dir / "profiles").glob("rank-*"))
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2 and (run_dir / "trace.json").is_file()
