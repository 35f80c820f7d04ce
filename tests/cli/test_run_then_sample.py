"""A newcomer's path: `pipegpt run` then `pipegpt sample` of the same run directory works with default flags (a
run saves its last step unless --no-save-final), and a run directory without a checkpoint says how to get one."""
from __future__ import annotations

import json

from helpers import assert_one_line_error, invoke, run_pipegpt

TINY = ["--stages", "2", "--microbatches", "2", "--steps", "2", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
        "--seq-len", "16", "--threads-per-worker", "1"]


def test_run_then_sample_of_its_directory_works_with_default_flags(tmp_path):
    run = tmp_path / "run"
    proc = run_pipegpt("run", *TINY, "--run-dir", run, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]  # the last step's
    sampled = run_pipegpt("sample", run, "--prompt", "def ", "--max-new-tokens", "4", "--seed", "1", timeout=300)
    assert sampled.returncode == 0, sampled.stdout + sampled.stderr
    assert sampled.stdout.startswith("def ") and len(sampled.stdout) > len("def \n")

    bare = tmp_path / "bare"
    proc = run_pipegpt("run", *TINY, "--run-dir", bare, "--no-save-final", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (bare / "checkpoints").exists() or not list((bare / "checkpoints").iterdir())
    assert json.loads((bare / "config.json").read_text())["checkpoint"]["save_final"] is False
    assert_one_line_error(run_pipegpt("sample", bare, "--prompt", "a"), f"{bare}: a run directory that holds no "
                          "complete checkpoint", "--no-save-final", "--save-every N")


def test_sample_and_hellaswag_of_a_run_without_a_checkpoint_say_how_to_get_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "attempt": 1, "loss": 5.0}\n')
    how = ("a run directory that holds no complete checkpoint", "unless --no-save-final", "pipegpt run --run-dir")
    assert_one_line_error(invoke("sample", run, "--prompt", "a"), *how)
    data = tmp_path / "h.jsonl"
    data.write_text(json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 0}) + "\n")
    assert_one_line_error(invoke("hellaswag", run, "--file", data), *how)
    assert_one_line_error(invoke("sample", tmp_path / "empty-dir-that-is-not-there", "--prompt", "a"),
                          "no such file or directory")
