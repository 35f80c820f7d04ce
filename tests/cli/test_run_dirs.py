"""`pipegpt run`'s run directory and the errors around it, in one line before any worker starts: one run per
directory (a fresh run into a used one is refused; --overwrite moves the old content aside), one live run per
directory (its driver's lock: a second run, a resume or an --overwrite is refused naming its pid), a directory
that exists as a file or cannot be written, ports out of range, --log-every 0; and a warning when more
worker processes than cores start on CPU.

In-process (click's CliRunner) where starting a cluster fails the test (the no_workers fixture), or with the
training itself replaced (the no_training fixture) where what comes before it is under test.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import NoWorkers, assert_one_line_error, invoke, lock_held_elsewhere, read_only

ARGS = ["--stages", "2", "--microbatches", "2", "--steps", "2"]


@pytest.fixture
def no_training(monkeypatch, clean_environ):
    """`pipegpt run` in-process up to its workers: run_job is replaced and records the run directory it got."""
    import pipegpt.train.driver as driver

    calls = []
    monkeypatch.setattr(driver, "run_job", lambda job, run_dir, on_step=None: calls.append(run_dir))
    return calls


def _used(run_dir):
    """A directory holding a run: a metrics row and a checkpoint directory (its manifest a stand-in)."""
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000002" / "manifest.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n')
    return run_dir


# --------------------------------------------------------------------------------------------------------------
# one run per directory

def test_a_fresh_run_into_a_used_directory_is_refused(no_workers, tmp_path):
    run = _used(tmp_path / "run")
    before = sorted(p.name for p in run.rglob("*"))
    line = assert_one_line_error(invoke("run", *ARGS, "--run-dir", run), f"--run-dir {run}", f"--resume {run}",
                                 "new --run-dir", "--overwrite")
    assert len(line) < 200 + len(str(run)) * 2, line
    assert not NoWorkers.started
    assert sorted(p.name for p in run.rglob("*")) == before


def test_overwrite_moves_the_old_run_aside(no_training, tmp_path):
    run = _used(tmp_path / "run")
    result = invoke("run", *ARGS, "--run-dir", run, "--overwrite")
    assert result.exit_code == 0, result.output
    assert no_training == [run]
    moved = [p for p in run.iterdir() if p.name.startswith("previous-")]
    assert len(moved) == 1 and sorted(p.name for p in moved[0].iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert sorted(p.name for p in run.iterdir()) == [moved[0].name]
    assert f"moved the earlier run in {run} to {moved[0]}" in result.stdout


def test_an_empty_directory_takes_a_fresh_run(no_training, tmp_path):
    result = invoke("run", *ARGS, "--run-dir", tmp_path)
    assert result.exit_code == 0, result.output
    assert no_training == [tmp_path]


def test_a_resume_into_another_runs_directory_is_refused(no_workers, tmp_path):
    from pipegpt.config import ConfigError, TrainConfig
    from pipegpt.train.run_dir import check_run_dir

    run, other = _used(tmp_path / "run"), _used(tmp_path / "other")
    cfg = TrainConfig.build(resume=str(run / "checkpoints" / "step-00000002"))
    with pytest.raises(ConfigError, match="holds another run than the checkpoint's"):
        check_run_dir(other, cfg, overwrite=False)
    check_run_dir(run, cfg, overwrite=False)  # its own run: attempt after attempt
    with pytest.raises(ConfigError, match="--overwrite starts a fresh run and --resume continues one"):
        check_run_dir(tmp_path / "new", cfg, overwrite=True)


# --------------------------------------------------------------------------------------------------------------
# one live run per directory

@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "overwrite"])
def test_a_directory_a_live_run_holds_is_refused_naming_its_pid(no_workers, tmp_path, overwrite):
    run = _used(tmp_path / "run") if overwrite else tmp_path / "run"
    run.mkdir(exist_ok=True)
    before = sorted(p.name for p in run.rglob("*"))
    with lock_held_elsewhere(run) as pid:
        result = invoke("run", *ARGS, "--run-dir", run, *(["--overwrite"] if overwrite else []))
        assert_one_line_error(result, f"{run} is in use by another pipegpt run (pid {pid})", "another --run-dir")
    assert not NoWorkers.started
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing moved aside, nothing written


def test_the_lock_goes_with_its_holder_and_a_finished_run_gives_it_back(no_training, tmp_path):
    from pipegpt.state.owner import lock_holder

    run = tmp_path / "run"
    run.mkdir()
    with lock_held_elsewhere(run):
        assert invoke("run", *ARGS, "--run-dir", run).exit_code == 2
    assert no_training == []
    result = invoke("run", *ARGS, "--run-dir", run)  # the holder was killed: the kernel freed the lock
    assert result.exit_code == 0, result.output
    assert no_training == [run] and lock_holder(run) is None  # this process holds it no longer


RESTARTED = """
import fcntl, os, sys
from pipegpt.state import owner
run_dir = sys.argv[1]
if len(sys.argv) == 2:  # the driver: owns the directory, then replaces itself as a restart does
    assert owner.lock_run_dir(run_dir) is None
    env = dict(os.environ)
    owner.keep_across_exec(env)
    os.execve(sys.executable, [sys.executable, __file__, run_dir, "again"], env)
probe = os.open(run_dir, os.O_RDONLY)
try:  # before the new image takes anything: is the directory still locked?
    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("held")
os.close(probe)
print(owner.lock_run_dir(run_dir), owner.lock_holder(run_dir) == os.getpid(), owner.LOCK_FD_ENV in os.environ)
"""


def test_a_restart_keeps_the_run_directory_through_its_exec(tmp_path):
    """The driver replaces itself (os.execve, same pid) on a restart: the directory is never free in between,
    and the new image takes over the lock it inherited (a second flock of its own would be refused)."""
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEGPT_")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["held", "None True False"], proc.stdout


def test_a_start_removes_what_interrupted_saves_left(no_training, tmp_path):
    """A save cut short leaves checkpoints/.tmp-step-*: removed as the next attempt starts (on a full disk, its
    space is what the run lacks), not only at its first save."""
    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step-00000004").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step-00000004" / "rank-00000.safetensors").write_bytes(b"\0" * 1024)
    (run / "metrics.jsonl").write_text('{"step": 1, "attempt": 1, "loss": 5.0}\n')
    result = invoke("run", *ARGS, "--run-dir", run, "--resume", "auto")  # no checkpoint: the run starts again
    assert result.exit_code == 0, result.output
    assert no_training == [run] and os.listdir(run / "checkpoints") == []


def test_under_torchrun_only_rank_0_writes(no_training, tmp_path, monkeypatch):
    """The other ranks neither create nor lock a run directory (here: no runs/<time> of their own)."""
    monkeypatch.chdir(tmp_path)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    result = invoke("run", *ARGS)
    assert result.exit_code == 0, result.output
    assert no_training == [None] and os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------------------------
# one line for every error, before any work

@pytest.mark.parametrize("args, fragments", [
    pytest.param(["--port", "70000"], ["--port", "70000", "1<=x<=65535"], id="port-too-large"),
    pytest.param(["--port", "-1"], ["--port", "-1", "1<=x<=65535"], id="port-negative"),
    pytest.param(["--log-every", "0"], ["--log-every", "0", "x>=1"], id="log-every-0"),
    pytest.param(["--stages", "4", "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--microbatches", "4"],
                 ["n_layer=4", "8 model stages", "4 ranks x 2", "--stages 2", "--virtual-stages 1", "8 layers"],
                 id="virtual-stages"),
])
def test_bad_values_are_one_line(no_workers, tmp_path, args, fragments):
    run = tmp_path / "run"
    assert_one_line_error(invoke("run", *ARGS, *args, "--run-dir", run), *fragments)
    assert not NoWorkers.started and not run.exists()


def test_a_run_dir_that_is_a_file_is_refused(no_workers, tmp_path):
    path = tmp_path / "file"
    path.write_text("mine")
    assert_one_line_error(invoke("run", *ARGS, "--run-dir", path), f"--run-dir {path} is a file")
    assert_one_line_error(invoke("run", *ARGS, "--run-dir", path / "sub"), f"{path} is a file")
    assert path.read_text() == "mine" and not NoWorkers.started


def test_an_unwritable_run_dir_is_refused_before_work(no_workers, tmp_path):
    (tmp_path / "ro").mkdir()
    with read_only(tmp_path / "ro") as ro:
        assert_one_line_error(invoke("run", *ARGS, "--run-dir", ro), f"--run-dir {ro} is not writable")
        assert_one_line_error(invoke("run", *ARGS, "--run-dir", ro / "new"), f"--run-dir {ro / 'new'}",
                              "is not writable", f"({ro}, where it would be created)")
    assert not NoWorkers.started


def test_an_unwritable_checkpoint_dir_is_refused_before_work(no_workers, tmp_path):
    """A resume into its own run, whose checkpoints/ cannot take the checkpoints --save-every asks for."""
    from pipegpt.config import ConfigError, TrainConfig
    from pipegpt.train.run_dir import check_run_dir

    run = _used(tmp_path / "run")
    cfg = TrainConfig.build(resume=str(run / "checkpoints" / "step-00000002"), save_every=1)
    with read_only(run / "checkpoints") as checkpoints:
        with pytest.raises(ConfigError, match=f"{checkpoints} .*is not writable.*--save-every 0"):
            check_run_dir(run, cfg, overwrite=False)
        check_run_dir(run, cfg.replace(save_every=0, save_final=False), overwrite=False)  # nothing will be saved there


def test_more_workers_than_cores_on_cpu_is_said(no_training, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    result = invoke("run", *ARGS, "--device", "cpu", "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "pipegpt: warning: 2 worker processes on 1 CPU cores: they take turns, so each step is slower than on "
        "2 cores (dp x pp x cp x tp = 2)"], result.stderr
    fits = invoke("run", "--stages", "1", "--microbatches", "2", "--steps", "2", "--device", "cpu",
                  "--run-dir", tmp_path / "one")
    assert fits.exit_code == 0 and fits.stderr == "", fits.output


def test_a_tokenizer_with_fewer_ids_than_the_vocabulary_is_said(no_training, tmp_path):
    """`--model gpt2 --tokenizer bytes` trains 50,257 embeddings on 256 ids: one line says so; a fit says nothing."""
    result = invoke("run", "--model", "gpt2", "--tokenizer", "bytes", *ARGS, "--device", "cpu",
                    "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if "vocabulary" in line] == [
        "pipegpt: warning: tokenizer bytes gives 256 token ids but the model's vocabulary is 50,257: 50,001 "
        "embedding rows are never trained (give --vocab-size 256, or the tokenizer the model was made for)"]
    fits = invoke("run", "--tokenizer", "bytes", "--vocab-size", "256", *ARGS, "--device", "cpu",
                  "--run-dir", tmp_path / "fits")
    assert fits.exit_code == 0 and "vocabulary" not in fits.stderr, fits.output


def test_one_rank_is_one_worker(no_training, tmp_path):
    """The banner said '1 workers'."""
    result = invoke("run", "--stages", "1", "--microbatches", "2", "--steps", "2", "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert ", 1 worker on " in result.stdout.splitlines()[0], result.stdout
