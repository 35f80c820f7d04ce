"""Checkpoints: resume bit for bit, resume under another layout, survive a SIGKILL mid-save, refuse bad ones.

Runs are `pipegpt run` subprocesses, as a user runs them; layout changes are checked inside workers
(tests/distributed/cluster_host.py), where every parameter and Adam moment can be gathered by one-process name.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from pipegpt.state import checkpoint
from pipegpt.config import ModelConfig, TrainConfig

from cluster_host import ClusterHost
from helpers import assert_one_line_error, clean_env, run_pipegpt

MODEL_ARGS = ["--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--seq-len", "16"]
MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, n_embd=32)


def pipegpt_run(run_dir: Path, *args: str, fault: str | None = None, expect: int = 0) -> subprocess.CompletedProcess:
    env = clean_env(PIPEGPT_FAULT=fault) if fault else clean_env()
    proc = run_pipegpt("run", *MODEL_ARGS, "--microbatch-size", "2", "--threads-per-worker", "1", "--run-dir", run_dir,
                       *args, env=env, timeout=240)
    assert proc.returncode == expect, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


LAYOUTS = {"1f1b": ["--stages", "2", "--microbatches", "2"],
           "zb-h1": ["--stages", "2", "--microbatches", "3", "--schedule", "zb-h1"],
           "1f1b-dp2": ["--stages", "2", "--microbatches", "2", "--dp", "2"],
           "zb-h1-dp2-zero1": ["--stages", "2", "--microbatches", "2", "--dp", "2", "--zero", "1", "--schedule", "zb-h1"],
           "1f1b-cp2": ["--stages", "2", "--microbatches", "2", "--cp", "2"],
           "zbv-dp2-zero3": ["--stages", "2", "--microbatches", "4", "--dp", "2", "--zero", "3", "--schedule", "zbv",
                             "--unshard", "microbatch"]}


# All slow: the dropout test resumes 1f1b-dp2 bit for bit in the default run, and a ZeRO-1 resume under another
# layout (dp2-zero1) restores the sharded optimizer state.
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS])
def test_resume_with_the_same_layout_is_bit_for_bit(tmp_path, layout):
    pipegpt_run(tmp_path / "full", *LAYOUTS[layout], "--steps", "4", "--save-every", "2")
    pipegpt_run(tmp_path / "resumed", *LAYOUTS[layout], "--steps", "4",
                "--resume", str(tmp_path / "full" / "checkpoints" / "step-00000002"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "full")[2:]


@pytest.mark.slow  # 27 s; per-rank dropout streams are checked fast in tests/unit (train/rng)
def test_resume_with_dropout_continues_every_ranks_stream_bit_for_bit(tmp_path):
    # Two replicas x two stages: four streams (pipegpt.state.rng), each restored from the checkpoint.
    layout = [*LAYOUTS["1f1b-dp2"], "--dropout", "0.1"]
    pipegpt_run(tmp_path / "full", *layout, "--steps", "4", "--save-every", "2")
    pipegpt_run(tmp_path / "resumed", *layout, "--steps", "4",
                "--resume", str(tmp_path / "full" / "checkpoints" / "step-00000002"))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "full")[2:]
    pipegpt_run(tmp_path / "plain", *LAYOUTS["1f1b-dp2"], "--steps", "2")
    assert losses(tmp_path / "plain") != losses(tmp_path / "full")[:2]  # dropout was on
    full, resumed = (checkpoint.CheckpointReader(tmp_path / run / "checkpoints" / "step-00000004")
                     for run in ("full", "resumed"))
    for key in sorted(k for k in full.where if k.startswith("param/")):
        assert torch.equal(full.full(key, key[6:]), resumed.full(key, key[6:])), key


def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    args = LAYOUTS["1f1b"]
    pipegpt_run(tmp_path / "whole", *args, "--steps", "5")
    run = tmp_path / "killed"
    proc = pipegpt_run(run, *args, "--steps", "5", "--save-every", "2", fault="kill-in-save:1:4", expect=1)
    assert "rank 1 failed: killed by signal SIGKILL" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert (run / "checkpoints" / ".tmp-step-00000004").is_dir(), "the save was under way"
    assert not (run / "checkpoints" / ".tmp-step-00000004" / checkpoint.MANIFEST).exists()
    assert checkpoint.resolve(run).name == "step-00000002"
    out = pipegpt_run(tmp_path / "unused", *args, "--steps", "5", "--resume", str(run), "--run-dir", str(run))
    assert "loss" in out.stdout
    # the resumed steps 2..4 follow the killed run's steps 0..3 in its metrics.jsonl
    assert losses(run)[-3:] == losses(tmp_path / "whole")[2:]


@pytest.fixture(scope="module")
def four_stage_checkpoint(tmp_path_factory):
    """A 4-stage 1f1b run saved after 2 steps, and the loss of its third step."""
    run = tmp_path_factory.mktemp("ckpt4") / "run"
    pipegpt_run(run, "--stages", "4", "--microbatches", "4", "--steps", "3", "--save-every", "2", "--keep", "0",
                "--dtype", "float64")
    return run / "checkpoints" / "step-00000002", losses(run)[2]


def _config(**layout) -> TrainConfig:
    return TrainConfig.build(MODEL, microbatch_size=2, device="cpu", timeout_s=60, dtype="float64",
                             **{"microbatches": 4, **layout})


@pytest.mark.parametrize("layout", [{"stages": 2, "tp": 2}, {"stages": 1}, {"stages": 2, "dp": 2, "zero": 1,
                                                                              "microbatches": 2},
                                    {"stages": 2, "cp": 2},
                                    pytest.param({"stages": 1, "cp": 4}, marks=pytest.mark.slow),
                                    pytest.param({"stages": 1, "cp": 2, "dp": 2, "zero": 1, "microbatches": 2},
                                                 marks=pytest.mark.slow)],
                         ids=["2-stages-tp2", "one-process", "dp2-zero1", "2-stages-cp2", "cp4", "cp2-dp2-zero1"])
def test_resume_under_another_layout_restores_everything(four_stage_checkpoint, layout):
    path, next_loss = four_stage_checkpoint
    reader = checkpoint.CheckpointReader(path)
    cfg = _config(**layout)
    host = ClusterHost(cfg)
    try:
        params, moments, loss = host.resume(cfg, path)
    finally:
        host.close()
    names = {key.split("/", 1)[1] for key in reader.where if key.startswith("param/")}
    assert {k.split("/", 1)[1] for k in params} == names
    for key, value in {**params, **moments}.items():
        name = key.split("/", 1)[1]
        assert torch.equal(value, reader.full(key, name)), key
    assert {k for k in moments} == {k for k in reader.where if k.split("/")[0] in ("exp_avg", "exp_avg_sq")}
    assert loss == pytest.approx(next_loss, rel=1e-5)


def assert_resumes_exactly(run: Path, cfg: TrainConfig) -> None:
    """The run's step-2 checkpoint loaded into cfg's layout: every parameter and moment as saved, and step 3's
    loss as the run had it."""
    path = run / "checkpoints" / "step-00000002"
    host = ClusterHost(cfg)
    try:
        params, moments, loss = host.resume(cfg, path)
    finally:
        host.close()
    reader = checkpoint.CheckpointReader(path)
    for key, value in {**params, **moments}.items():
        assert torch.equal(value, reader.full(key, key.split("/", 1)[1])), key
    assert loss == pytest.approx(losses(run)[2], rel=1e-5)


@pytest.mark.slow  # resharding ZeRO-1 state stays in the default run: the dp2-zero1 layout above
def test_dp2_zero1_resumes_in_dp1(tmp_path):
    run = tmp_path / "dp2"
    pipegpt_run(run, *LAYOUTS["1f1b-dp2"], "--zero", "1", "--steps", "3", "--save-every", "2", "--dtype", "float64")
    # The same global batch in one replica: twice the microbatches.
    assert_resumes_exactly(run, _config(stages=2, microbatches=4))


@pytest.mark.slow  # 11 s; tp -> one process is in the default set as test_resume_under_another_layout_restores_everything[2-stages-tp2]
def test_a_tensor_parallel_checkpoint_resumes_in_one_process(tmp_path):
    run = tmp_path / "tp2"
    pipegpt_run(run, "--stages", "1", "--tp", "2", "--microbatches", "4", "--steps", "3", "--save-every", "2",
                "--dtype", "float64")
    assert_resumes_exactly(run, _config(stages=1))


def test_keep_prunes_old_checkpoints(tmp_path):
    pipegpt_run(tmp_path, *LAYOUTS["1f1b"], "--steps", "4", "--save-every", "1", "--keep", "2")
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path / "checkpoints")] == \
        ["step-00000003", "step-00000004"]


def test_init_from_starts_at_step_0_from_the_weights(tmp_path):
    pipegpt_run(tmp_path / "a", *LAYOUTS["1f1b"], "--steps", "4", "--save-every", "4")
    pipegpt_run(tmp_path / "b", *LAYOUTS["1f1b"], "--steps", "2", "--init-from", str(tmp_path / "a"))
    fresh = losses(tmp_path / "a")
    assert len(losses(tmp_path / "b")) == 2 and losses(tmp_path / "b")[0] < fresh[0] - 0.1


# --------------------------------------------------------------------------------------------------------------
# Bad checkpoints: one line, exit 2, before any worker starts, nothing overwritten

def _refused(tmp_path, *args) -> str:
    line = assert_one_line_error(pipegpt_run(tmp_path / "new", *LAYOUTS["1f1b"], "--steps", "3", *args, expect=2))
    assert not (tmp_path / "new").exists()
    return line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run = tmp_path_factory.mktemp("saved") / "run"
    pipegpt_run(run, *LAYOUTS["1f1b"], "--steps", "2", "--save-every", "2")
    return run


def test_a_path_that_is_not_a_checkpoint_is_refused(tmp_path):
    assert "not a checkpoint" in _refused(tmp_path, "--resume", str(tmp_path))


def test_a_checkpoint_of_another_model_is_refused(tmp_path, saved):
    line = _refused(tmp_path, "--resume", str(saved), "--n-layer", "2")
    assert "checkpoint of another model: n_layer=4 (this run: 2)" in line


def test_a_truncated_tensor_file_is_refused(tmp_path, saved):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(saved / "checkpoints" / "step-00000002", copy)
    victim = copy / "rank-00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    assert f"{victim}: truncated tensor file" in _refused(tmp_path, "--resume", str(copy))
    assert (saved / "checkpoints" / "step-00000002" / "rank-00001.safetensors").stat().st_size > victim.stat().st_size


def test_resume_and_init_from_exclude_each_other(tmp_path, saved):
    assert "not both" in _refused(tmp_path, "--resume", str(saved), "--init-from", str(saved))


# --------------------------------------------------------------------------------------------------------------
# Verified checkpoints: a SHA-256 per file, checked by every command that loads one

def _flip_a_moment_byte(path: Path) -> str:
    """Flip one byte in the middle of the first Adam moment's data; the size stays what the header says."""
    import struct

    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = next(k for k in sorted(header) if k.startswith("exp_avg/"))
    start, end = header[key]["data_offsets"]
    raw[8 + n + (start + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return key


def test_a_flipped_byte_is_refused_by_resume_init_from_sample_convert_and_hellaswag(tmp_path, saved):
    import shutil

    from helpers import invoke

    copy = tmp_path / "copy"
    shutil.copytree(saved / "checkpoints" / "step-00000002", copy)
    victim = copy / "rank-00001.safetensors"
    _flip_a_moment_byte(victim)
    corrupt = victim.read_bytes()
    expected = f"Error: {victim}: corrupt: its SHA-256 is "
    for option in ("--resume", "--init-from"):
        assert _refused(tmp_path, option, str(copy)).startswith(expected)
    examples = tmp_path / "hellaswag.jsonl"
    examples.write_text(json.dumps({"ctx": "The cat sat on the", "endings": ["mat.", "x", "roof", "sky"], "label": 0}))
    for args in (["sample", copy, "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"],
                 ["convert", "--to-hf", tmp_path / "hf", "--checkpoint", copy],
                 ["hellaswag", copy, "--file", examples, "--device", "cpu"]):
        assert assert_one_line_error(invoke(*args)).startswith(expected), args
    assert not (tmp_path / "hf").exists()
    assert victim.read_bytes() == corrupt  # nothing overwritten
    assert sorted(p.name for p in copy.iterdir()) == ["manifest.json", "rank-00000.safetensors",
                                                       "rank-00001.safetensors"]


def test_a_runs_checkpoint_files_follow_the_umask(saved):
    import os

    umask = os.umask(0)
    os.umask(umask)  # this process's, which the run inherited
    ckpt = saved / "checkpoints" / "step-00000002"
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in ckpt.iterdir()}
    assert modes == {name: oct(0o666 & ~umask) for name in modes} and len(modes) == 3


@pytest.mark.slow
def test_a_context_parallel_checkpoint_resumes_in_one_process(tmp_path):
    """cp 2 -> cp 1: a checkpoint is layout-free (cp ranks hold the same weights; replica 0 stores them)."""
    pipegpt_run(tmp_path / "run", *LAYOUTS["1f1b-cp2"], "--steps", "3", "--save-every", "2", "--dtype", "float64")
    assert_resumes_exactly(tmp_path / "run", _config(stages=1, microbatches=2))
