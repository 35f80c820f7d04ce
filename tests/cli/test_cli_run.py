"""`pipegpt run`: a short real run (output, metrics.jsonl, trace.json), bad input refused before any
worker starts (one `Error:` line, exit status 2, no traceback), and --help."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from collections import defaultdict

import pytest

from helpers import NoWorkers, assert_one_line_error, invoke, run_pipegpt
from pipegpt.schedule import SCHEDULES, build_plan, lower
from pipegpt.schedule.actions import Action

REFUSE_WITHIN_S = 10.0


# --------------------------------------------------------------------------------------------------------------
# (a) a short real run

STAGES, MICROBATCHES, STEPS = 2, 4, 6


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cli_run") / "run"
    t0 = time.monotonic()
    proc = run_pipegpt("run", "--stages", STAGES, "--microbatches", MICROBATCHES, "--steps", STEPS,
                       "--run-dir", run_dir, "--no-save-final", timeout=300)  # its output without a save's line
    print(f"\npipegpt run --stages {STAGES} --microbatches {MICROBATCHES} --steps {STEPS}: "
          f"{time.monotonic() - t0:.1f}s")
    return proc, run_dir


def test_run_exits_0_and_prints_steps_and_summary(real_run):
    proc, run_dir = real_run
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("pipegpt: 4-layer GPT (tiny), 2 workers on cpu, schedule 1f1b, 4 microbatches"), lines
    assert str(run_dir) in lines[0]
    steps = [ln for ln in lines if ln.startswith("step ")]
    # Default --log-every 10: the first step and the last one.
    assert [ln.split()[1] for ln in steps] == ["1/6", "6/6"], proc.stdout
    pattern = re.compile(r"^step +\d+/6 \[[#.]{20}\] loss (\d+\.\d{4}) +[\d.]+ ms +[\d,]+ tok/s  elapsed \d+s"
                         r"(  eta (\?|\d+s))?$")
    assert all(pattern.match(ln) for ln in steps), steps
    assert "eta" in steps[0] and "eta" not in steps[-1], steps  # nothing left after the last step
    summary = next((ln for ln in lines if ln.startswith("done: ")), None)
    assert summary is not None, proc.stdout
    assert re.match(r"^done: loss \d+\.\d{4} -> \d+\.\d{4} in 6 steps; median step [\d.]+ ms, [\d,]+ tok/s; "
                    r"peak memory per rank \d+ MiB, \d+ MiB$", summary), summary
    assert any(ln.startswith("metrics: ") and str(run_dir / "metrics.jsonl") in ln
               and str(run_dir / "trace.json") in ln for ln in lines), proc.stdout
    # The printed losses are the logged ones.
    metrics = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    printed = [float(pattern.match(ln).group(1)) for ln in steps]
    assert printed == pytest.approx([metrics[0]["loss"], metrics[-1]["loss"]], abs=1e-4)


def test_run_writes_metrics_jsonl(real_run):
    proc, run_dir = real_run
    assert proc.returncode == 0, proc.stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == STEPS
    records = [json.loads(ln) for ln in lines]
    for i, r in enumerate(records):
        assert {"step", "loss", "step_time_s", "tokens_per_s"} <= r.keys(), r
        assert r["step"] == i + 1  # counted from 1, as the console counts
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        # where the step's time went: the control plane's share, each process's CPU (1.0 = a core busy all step)
        assert 0 <= r["control_s"] < r["step_time_s"]
        assert len(r["cpu_per_rank"]) == STAGES and all(0 < c < os.cpu_count() + 1 for c in r["cpu_per_rank"]), r
        assert 0 <= r["driver_cpu"] < 1, r
    assert records[-1]["loss"] < records[0]["loss"], [r["loss"] for r in records]
    assert json.loads((run_dir / "config.json").read_text())["parallel"]["stages"] == STAGES


def test_run_writes_a_trace_covering_the_plan(real_run):
    proc, run_dir = real_run
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((run_dir / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert events
    per_rank = defaultdict(list)
    for e in events:
        assert e["dur"] >= 0 and e["ts"] >= 0, e
        per_rank[e["pid"]].append(e)
    plan = build_plan("1f1b", STAGES, MICROBATCHES)
    expected = plan.compute_only().as_strings()
    lowered = lower(plan).as_strings()
    assert sorted(per_rank) == list(range(STAGES))
    for rank in range(STAGES):
        ordered = sorted(per_rank[rank], key=lambda e: e["ts"])
        names = [e["args"]["action"] for e in ordered]
        assert set(names) <= set(lowered[rank]), (rank, names)  # nothing the plan does not hold
        compute = [n for n in names if Action.parse(n).kind.is_compute]
        assert compute == expected[rank], (rank, compute, expected[rank])  # every compute action, in plan order
        compute_events = [e for e in ordered if Action.parse(e["args"]["action"]).kind.is_compute]
        for a, b in zip(compute_events, compute_events[1:]):  # one rank computes one thing at a time
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (a, b)  # 1 us slack for rounding


def test_run_writes_the_plan_it_ran(real_run):
    from pipegpt.schedule.schedule_file import load_schedule_file

    proc, run_dir = real_run
    assert proc.returncode == 0, proc.stderr
    ran = load_schedule_file(run_dir / "plan.txt")
    assert ran.ranks == lower(build_plan("1f1b", STAGES, MICROBATCHES)).ranks


# --------------------------------------------------------------------------------------------------------------
# (b) bad input: refused before any worker starts

@pytest.fixture
def cli(no_workers, tmp_path):
    """`pipegpt run ARGS` in-process, where starting a cluster fails the test (the no_workers fixture)."""

    def run(*args):
        run_dir = tmp_path / "run"
        t0 = time.monotonic()
        result = invoke("run", *args, "--steps", "2", "--run-dir", run_dir)
        return result, time.monotonic() - t0, run_dir

    return run


def _port_in_use():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s



def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


BAD = [
    pytest.param(["--stages", "8"], ["n_layer=4", "8 pipeline stages", "at most 4 stages"], id="stages>layers"),
    pytest.param(["--n-embd", "130"], ["n_embd=130", "n_head=4", "128 or 132"], id="heads-dont-divide-width"),
    pytest.param(["--batch-size", "10", "--microbatches", "4"], ["batch-size=10", "multiple of 4", "8 or 12"],
                 id="batch-size"),
    pytest.param(["--schedule", "nope"], ["'nope'", *SCHEDULES], id="unknown-schedule"),
    pytest.param(["--schedule", "interleaved-1f1b", "--stages", "2", "--microbatches", "5"],
                 ["interleaved-1f1b", "microbatches=5", "2 equal rounds", "4 or 6"], id="interleaved-microbatches"),
    pytest.param(["--device", "cuda"], ["device=cuda", "GPU", "--device cpu"], id="cuda-on-cpu"),
    pytest.param(["--stages", "2", "--schedule", "auto-v", "--max-live", "1"], ["max-live=1", "least that works is 2"],
                 id="max-live-below-least"),
    pytest.param(["--stages", "2", "--schedule", "zb-h1", "--max-live", "3"], ["--max-live", "zb-h1 is a fixed",
                                                                              "auto or auto-v"], id="max-live-fixed"),
    pytest.param(["--stages", "2", "--layers-per-stage", "1,1"], ["layers-per-stage 1,1", "sums to 2", "n_layer=4"],
                 id="layers-per-stage"),
    pytest.param(["--data", "/nonexistent.bin"], ["/nonexistent.bin", "no such file"], id="missing-data"),
    pytest.param(["--recompute", "bogus"], ["'bogus'", "'none'", "'full'", "'selective'"], id="recompute"),
    pytest.param(["--stages", "2", "--layers-per-stage", "2,x"], ["'2,x'", "comma-separated list of integers"],
                 id="layers-per-stage-not-ints"),
]


def _check_refusal(result, seconds, must_name):
    assert_one_line_error(result, *must_name)
    assert seconds < REFUSE_WITHIN_S, f"refused after {seconds:.1f}s"


@pytest.mark.parametrize("args, must_name", BAD)
def test_bad_input_is_refused_before_any_worker_starts(cli, args, must_name):
    if "cuda" in args and _cuda_available():
        pytest.skip("a GPU is visible: --device cuda is valid here")
    result, seconds, run_dir = cli(*args)
    assert not NoWorkers.started
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    _check_refusal(result, seconds, must_name)
    assert not run_dir.exists(), "a refused run created its run directory"


def test_port_in_use_is_refused_before_any_worker_starts(cli):
    with _port_in_use() as s:
        port = s.getsockname()[1]
        result, seconds, _ = cli("--stages", "2", "--port", str(port))
    assert not NoWorkers.started
    _check_refusal(result, seconds, [f"port {port}", "in use", "leave --port out"])
    # Not checked: the run directory. The port is only checked in run_job, after `run` has printed
    # its banner and created the directory (an empty runs/<time>/ is left behind by default).


@pytest.mark.parametrize("args, must_name", [
    pytest.param(["--stages", "8"], ["n_layer=4", "at most 4 stages"], id="stages>layers"),
    pytest.param(["--stages", "2", "--port", "PORT"], ["in use", "leave --port out"], id="port-in-use"),
])
def test_refusal_as_a_user_sees_it(args, must_name, tmp_path):
    """The console script in a fresh process: the same one line, status 2, torch import included."""
    with _port_in_use() as s:
        args = [str(s.getsockname()[1]) if a == "PORT" else a for a in args]
        t0 = time.monotonic()
        proc = run_pipegpt("run", *args, "--steps", "2", "--run-dir", tmp_path / "run", timeout=60)
        seconds = time.monotonic() - t0
    print(f"\nrefused {' '.join(args)} in {seconds:.2f}s")
    _check_refusal(proc, seconds, must_name)


# --------------------------------------------------------------------------------------------------------------
# (c) --help

def test_run_help_lists_the_options():
    result = invoke("run", "--help")
    assert result.exit_code == 0, result.output
    for option in ("--steps", "--microbatch-size", "--seed", "--schedule", "--no-tie-embeddings", "--run-dir",
                   "--recompute", "--layers-per-stage"):
        assert re.search(rf"(^|[\s,]){re.escape(option)}([\s,=]|$)", result.stdout, re.M), option
