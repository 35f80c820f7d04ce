"""`pipegpt run --init-from CKPT` with no model flags trains the checkpoint's model (a Llama here, not the
default `tiny`); a model flag that disagrees with the checkpoint is one line, exit 2, before any worker starts."""
from __future__ import annotations

import pytest

from helpers import assert_one_line_error, run_pipegpt

ARGS = ["--stages", "2", "--microbatches", "2", "--microbatch-size", "2", "--steps", "2", "--threads-per-worker", "1"]


# 8 s, two runs: slow. The default suite starts from a checkpoint's weights in tests/distributed/test_checkpoint.py
# (test_init_from_starts_at_step_0_from_the_weights) and resumes a Llama checkpoint in test_llama_oracle.py.
@pytest.mark.slow
def test_init_from_a_llama_takes_its_shape(tmp_path):
    first = run_pipegpt("run", "--model", "tiny-llama", "--n-layer", "2", *ARGS, "--save-every", "2",
                        "--run-dir", tmp_path / "a", timeout=240)
    assert first.returncode == 0, first.stderr
    again = run_pipegpt("run", "--init-from", tmp_path / "a", *ARGS, "--run-dir", tmp_path / "b", timeout=240)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert again.stdout.startswith("pipegpt: 2-layer Llama (from checkpoint)"), again.stdout
    refused = run_pipegpt("run", "--init-from", tmp_path / "a", "--n-kv-head", "4", *ARGS, "--run-dir", tmp_path / "c")
    assert_one_line_error(refused, "--n-kv-head 4", "n_kv_head 2")
    assert not (tmp_path / "c").exists()
