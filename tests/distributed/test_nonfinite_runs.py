"""The non-finite guard in real runs: a diverging run stops before the update with one line naming the step, the
rank and the stage, and leaves its finite checkpoints alone; --on-nonfinite skip drops the update on every rank
alike and counts it; metrics.jsonl stays strict JSON. Values are poisoned on purpose with PIPEGPT_FAULT
(nan-loss, nan-grad: pipegpt.resilience.faults)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.state import checkpoint

from cluster_host import ClusterHost
from helpers import clean_env, run_pipegpt

FAST = ["--threads-per-worker", "1"]


def pipegpt_run(run_dir: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = clean_env(PIPEGPT_FAULT=fault) if fault else clean_env()
    return run_pipegpt("run", *FAST, "--run-dir", run_dir, *args, env=env, timeout=240)


def report(proc) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def stopped_line(proc) -> str:
    """The run's last word: exit 1, its last stderr line an `Error:` of at most ~200 characters, no traceback."""
    assert proc.returncode == 1, report(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, report(proc)
    line = proc.stderr.splitlines()[-1]
    assert line.startswith("Error: step ") and len(line.split(", last checkpoint: ")[0]) < 200, line
    return line


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl read as strict JSON (a bare NaN or Infinity raises)."""
    def refuse(text):
        raise ValueError(f"not strict JSON: {text}")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_a_diverging_run_stops_before_the_update_and_keeps_its_finite_checkpoints(tmp_path):
    """The issue's case: lr 1e4 turns the gradients non-finite after a step or two."""
    run = tmp_path / "run"
    proc = pipegpt_run(run, "--stages", "2", "--microbatches", "4", "--steps", "8", "--lr", "1e4", "--save-every", "1")
    line = stopped_line(proc)
    match = re.fullmatch(r"Error: step (\d+): the (loss|gradient norm) is (nan|inf)( \(first on rank \d, stage \d\))?"
                         r"|Error: step (\d+): the loss is (nan|inf) on rank 1 \(stage 1\)", line.split(";")[0])
    assert match, line
    bad = int(match.group(1) or match.group(5))
    saved = checkpoint.complete_checkpoints(run / "checkpoints")
    assert line.endswith(f"; no update applied, last checkpoint: {saved[-1]}"), line
    # every step before the bad one saved, the newest 3 (--keep) kept; nothing from the bad state, nothing left over
    assert [p.name for p in saved] == [f"step-{s:08d}" for s in range(max(1, bad - 3), bad)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [p.name for p in saved]
    for ckpt in saved:
        checkpoint.read_manifest(ckpt)  # checksums hold
        for f in ckpt.glob("rank-*.safetensors"):
            assert all(bool(torch.isfinite(t).all()) for t in load_file(str(f)).values()), f
    metrics = rows(run)
    assert [r["step"] for r in metrics] == list(range(1, bad + 1))
    assert metrics[-1]["nonfinite"] and "done:" not in proc.stdout
    assert all(r["nonfinite"] is None for r in metrics[:-1])


def test_a_nan_loss_is_named_with_its_rank_and_stage(tmp_path):
    run = tmp_path / "run"
    proc = pipegpt_run(run, "--stages", "2", "--microbatches", "2", "--steps", "4", "--save-every", "1",
                       fault="nan-loss:1:2")
    assert stopped_line(proc) == (f"Error: step 2: the loss is nan on rank 1 (stage 1); no update applied, "
                                  f"last checkpoint: {run / 'checkpoints' / 'step-00000001'}")
    assert [p.name for p in checkpoint.complete_checkpoints(run / "checkpoints")] == ["step-00000001"]
    assert rows(run)[-1]["loss"] is None


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_non_finite_gradients_are_named_where_they_appeared(tmp_path):
    proc = pipegpt_run(tmp_path / "run", "--stages", "2", "--microbatches", "2", "--steps", "3",
                       fault="nan-grad:0:2")
    assert stopped_line(proc) == ("Error: step 2: the gradient norm is nan (first on rank 0, stage 0); "
                                  "no update applied, last checkpoint: none")


def test_skip_drops_the_update_counts_it_and_goes_on(tmp_path):
    run = tmp_path / "run"
    proc = pipegpt_run(run, "--stages", "2", "--microbatches", "2", "--steps", "3", "--on-nonfinite", "skip",
                       fault="nan-loss:1:2")
    assert proc.returncode == 0, report(proc)
    assert "pipegpt: step 2: the loss is nan on rank 1 (stage 1); update skipped (--on-nonfinite skip)" in \
        proc.stderr.splitlines(), report(proc)
    metrics = rows(run)
    assert [r["skipped_steps"] for r in metrics] == [0, 1, 1]
    assert [r["nonfinite"] for r in metrics] == [None, "the loss is nan on rank 1 (stage 1)", None]


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_every_rank_skips_the_same_update(monkeypatch):
    """Replica 1 alone sees a nan loss (its gradients are finite): replica 0 must drop the update too, or the
    replicas part ways. ClusterHost checks that every replica holds the same parameters after the steps."""
    monkeypatch.setenv("PIPEGPT_FAULT", "nan-loss:1:2")  # dp 2 x 1 stage: rank 1 is replica 1
    cfg = TrainConfig.build(ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, n_embd=32), dp=2, stages=1,
                            microbatches=2, microbatch_size=2, device="cpu", timeout_s=60)
    host = ClusterHost(cfg)
    try:
        host.run(cfg, 3)  # raises if the replicas' parameters differ
    finally:
        host.close()


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_skip_never_applies_an_update_whose_squares_overflow_the_moments(tmp_path):
    """--lr 1e4 without clipping: step 2's gradients are finite but their norm (~1e24) squares past float32, so
    applying it would leave Adam's second moment infinite (a checkpoint then refused it: the run stopped though
    --on-nonfinite skip was given). Such an update is skipped like a non-finite one; the moments stay finite."""
    run_dir = tmp_path / "run"
    proc = pipegpt_run(run_dir, "--stages", "2", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len",
                       "32", "--vocab-size", "256", "--lr", "1e4", "--grad-clip", "0", "--on-nonfinite", "skip",
                       "--steps", "4", "--save-every", "1", "--keep", "0")
    assert proc.returncode == 0, report(proc)
    assert "too large for the optimizer's squared-gradient moment; update skipped" in proc.stderr, report(proc)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["skipped_steps"] >= 1
    # a skipped step's weights are an earlier step's: it writes no checkpoint, an applied one does
    saved_steps = [int(p.name.split("-")[1]) for p in checkpoint.complete_checkpoints(run_dir / "checkpoints")]
    assert saved_steps == [r["step"] for r in rows if r["nonfinite"] is None], report(proc)
    saved = checkpoint.resolve(run_dir)
    for path in sorted(saved.glob("rank-*.safetensors")):
        for key, value in load_file(path).items():
            assert torch.isfinite(value).all(), key


def test_skipping_every_step_stops_after_max_skipped_steps(tmp_path):
    """--lr 1e30 without clipping: every step from 2 on is skipped. It used to end with exit 0 ("loss 5.5 -> nan")
    and a checkpoint of useless weights; now the run stops after --max-skipped-steps in a row, exit 1, naming the
    last checkpoint, and writes none of a skipped step."""
    run_dir = tmp_path / "run"
    proc = pipegpt_run(run_dir, "--stages", "1", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len",
                       "32", "--vocab-size", "256", "--lr", "1e30", "--grad-clip", "0", "--on-nonfinite", "skip",
                       "--max-skipped-steps", "2", "--steps", "8", "--save-every", "1", "--keep", "0",
                       "--microbatches", "2")
    assert proc.returncode == 1, report(proc)
    last = stopped_line(proc)
    assert "steps in a row skipped (--max-skipped-steps 2); stopping, last checkpoint: " in last, report(proc)
    assert last.endswith("step-00000001"), report(proc)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite"] is None for r in rows] == [True, False, False], report(proc)
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir / "checkpoints")] == ["step-00000001"]
