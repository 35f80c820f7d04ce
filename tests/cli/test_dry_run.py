"""`pipegpt run ... --dry-run [DEVICE]`: the job checked and predicted with the planner's own model, in this
process, with no worker started (the rpc clusters and launch() patched to fail the test); refusals are one line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from helpers import ROOT, assert_one_line_error, clean_env, invoke
from pipegpt.config import MODEL_PRESETS
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import format_bytes, make_cluster
from pipegpt.planner.candidates import Request
from pipegpt.planner.report import format_seconds
from pipegpt.planner.search import search


@pytest.fixture
def nothing_starts(monkeypatch, no_workers):
    """Starting the job in any way fails the test: launch() itself, and the rpc clusters (no_workers)."""
    import pipegpt.train.launch as launch_module

    def refuse(*args, **kwargs):
        raise AssertionError("--dry-run launched the job")

    monkeypatch.setattr(launch_module, "launch", refuse)
    return no_workers


def _children() -> list[str]:
    """This process's child processes (Linux: /proc/<pid>/task/*/children)."""
    pid, found = os.getpid(), []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += f.read().split()
    return found


@pytest.mark.parametrize("preset, batch", [("gpt2", 512), ("llama3-8b", 16)])
def test_a_planned_layout_dry_runs_to_the_planners_own_numbers(nothing_starts, preset, batch):
    """Each of the planner's top plans on 8 H100s (GPT-2: ZeRO-3 per block, 1F1B; Llama 3 8B: cp, tp, sequence
    parallelism), run with its own command and --dry-run h100, predicts the step time, bubble, makespan and
    every pipeline rank's memory the planner printed."""
    cluster = make_cluster(8, device="h100", precision="bf16")
    result = search(Request(MODEL_PRESETS[preset], batch, cluster, AnalyticalCosts(cluster)))
    assert len(result.best) >= 3
    for r in result.best[:3]:
        out = invoke("run", *r.layout.run_args(r.model, "bf16"), "--dry-run", "h100")
        assert out.exit_code == 0, out.output
        text = out.stdout
        assert f"predicted step: {format_seconds(r.step_time)} " in text, (r.layout.short(), text)
        assert f"makespan {format_seconds(r.makespan)}, bubble {100 * r.bubble:.1f}%" in text
        assert f"layout: {r.layout.mesh_name}, 8 ranks; " in text
        rows = [line.split() for line in text.splitlines() if re.match(r"^\s+\d+\s+\d", line)]
        assert len(rows) == r.layout.pp
        for rank, parts in enumerate(r.memory):
            total = format_bytes(parts["total"]).split()
            assert rows[rank][0] == str(rank) and rows[rank][-3:-1] == total, (rank, rows[rank], parts)
        assert f"holds {format_bytes(r.peak_bytes)} of 78.0 GiB" in text
    assert nothing_starts == []


def test_a_32_gpu_gpt2_job_is_answered_here_in_seconds(nothing_starts):
    """4 nodes x 8 H100s (the sbatch example's shape): the whole answer on this CPU machine, no child process."""
    before = set(_children())
    t0 = time.monotonic()
    out = invoke("run", "--model", "gpt2", "--stages", 4, "--dp", 8, "--microbatches", 8, "--batch-size", 256,
                 "--precision", "bf16", "--dry-run", "h100")
    took = time.monotonic() - t0
    assert out.exit_code == 0, out.output
    assert took < 20, took
    text = out.stdout
    assert "dry run, nothing started: gpt2, 124M parameters" in text
    assert "32 x h100 (4 nodes x 8)" in text
    assert "layout: dp8 pp4 tp1, 32 ranks; 1f1b, 8 microbatches x 4 sequences x 1024 tokens" in text
    assert "plan: 1f1b, 4 pipeline ranks x 1 stage" in text
    assert re.search(r"predicted step: \d", text) and "MFU" in text
    for part in ("weights", "gradients", "optimizer", "activations"):
        assert part in text
    assert "torchrun --nnodes 4 --nproc-per-node 8" in text
    assert set(_children()) <= before
    assert nothing_starts == []


@pytest.mark.parametrize("args, fragments", [
    (["--model", "llama3-8b", "--stages", 2, "--dp", 4, "--microbatches", 8, "--batch-size", 32, "--precision",
      "bf16", "--dry-run", "h100"],
     ["does not fit in the device's memory", "pipeline rank 0 needs", "> 78.0 GiB usable on h100", "activations"]),
    (["--model", "gpt2", "--stages", 4, "--dry-run", "b200"], ["--dry-run b200", "h100, h100-pcie"]),
    (["--model", "gpt2", "--stages", 24, "--dry-run", "h100"], ["n_layer=12", "24"]),
    (["--model", "gpt2", "--stages", 2, "--dp", 4, "--batch-size", 10, "--dry-run", "h100"], ["batch-size=10", "4 x 8"]),
    (["--model", "gpt2", "--tp", 5, "--dry-run", "h100"], ["tp"]),
    (["--model", "gpt2", "--layout", "auto", "--dry-run", "h100"], ["--dry-run checks the layout given", "pipegpt plan"]),
])
def test_what_would_fail_at_start_up_is_refused_in_one_line(nothing_starts, args, fragments):
    assert_one_line_error(invoke("run", *args), *fragments)
    assert nothing_starts == []


def test_the_dry_run_of_a_run_that_fits_on_cpu_ranks_says_so(nothing_starts):
    """--dry-run alone: this machine's devices (here, nominal CPU ranks)."""
    out = invoke("run", "--stages", 2, "--device", "cpu", "--dry-run")
    assert out.exit_code == 0, out.output
    assert "2 x CPU rank (nominal)" in out.stdout and "run it with the same command without --dry-run" in out.stdout


def test_a_plan_the_planner_does_not_build_is_checked_and_its_memory_shown_untimed(nothing_starts):
    """auto writes its own order: the plan is validated and its memory counted, its time left to simulate."""
    out = invoke("run", "--model", "gpt2", "--stages", 4, "--schedule", "auto", "--dry-run", "h100")
    assert out.exit_code == 0, out.output
    assert "plan: auto, 4 pipeline ranks x 1 stage" in out.stdout and "predicted step: not timed" in out.stdout
    assert "layout: dp1 pp4 tp1, 4 ranks; auto, 8 microbatches" in out.stdout
    assert len([line for line in out.stdout.splitlines() if re.match(r"^\s+\d+\s+\d", line)]) == 4


def test_a_dry_run_loads_no_torch():
    """Nothing that could start a worker or a process group is even imported: torch stays out of the process."""
    code = ("import sys\nfrom pipegpt.cli import main\n"
            "try:\n    main(['run', '--model', 'gpt2', '--stages', '4', '--dp', '8', '--dry-run', 'h100'])\n"
            "except SystemExit as e:\n    print('exit', e.code)\nprint('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.splitlines()[-2:] == ["exit 0", "False"], proc.stdout + proc.stderr
