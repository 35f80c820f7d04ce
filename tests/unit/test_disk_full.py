"""A full disk under the files the driver writes (pipegpt.run_files names them): each failure is a RunFileError
whose text is one line naming the file and the cause, and leaves no empty or half-written file, no temporary
file and no checkpoint directory holding space. ENOSPC is simulated by a write that puts half its bytes down
and then fails, as a filling disk does (the CLI's one line: tests/distributed/test_failures.py)."""
from __future__ import annotations

import builtins
import errno
import io
import json
import os

import pytest

from pipegpt import run_files

pytestmark = pytest.mark.usefixtures("one_thread")


class _FillingFile:
    """A file whose writes put half their bytes down, then fail with ENOSPC."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        self._f.write(data[:len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.fixture
def full_disk(monkeypatch):
    """full_disk(pred): from then on, a file opened for writing whose path satisfies pred fills the disk."""
    real = io.open

    def install(pred=lambda path: True):
        def fake(file, mode="r", *args, **kwargs):
            f = real(file, mode, *args, **kwargs)
            return _FillingFile(f) if any(c in mode for c in "wax") and pred(os.fspath(file)) else f

        monkeypatch.setattr(builtins, "open", fake)
        monkeypatch.setattr(io, "open", fake)  # pathlib's write_text

    return install


def _log(run_dir, first_step=0, resume=None):
    from pipegpt.config import TrainConfig
    from pipegpt.observe.metrics import RunLog
    from pipegpt.schedule import build_plan, lower

    cfg = TrainConfig.build(stages=2, microbatches=2, resume=resume)
    return RunLog(run_dir, cfg, lower(build_plan("1f1b", 2, 2)), first_step)


def _row(step):
    from pipegpt.observe.metrics import StepMetrics

    return StepMetrics(step, 4.0, 1.0, 100.0, 1.0, [0, 0])


def _files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_the_attempts_config_is_whole_or_absent(tmp_path, full_disk):
    full_disk()
    with pytest.raises(run_files.RunFileError) as e:
        _log(tmp_path)
    assert str(e.value) == f"disk full writing {tmp_path / 'configs' / 'attempt-1.json'}: No space left on device"
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert _files(tmp_path) == ["configs"]  # no 0-byte attempt-1.json, no .tmp


def test_plan_txt_too(tmp_path, full_disk):
    full_disk(lambda path: path.endswith("plan.txt.tmp"))
    with pytest.raises(run_files.RunFileError, match=r"^disk full writing .*/plan\.txt: No space left on device$"):
        _log(tmp_path)
    assert _files(tmp_path) == ["config.json", "configs", "configs/attempt-1.json"]


def test_a_failed_metrics_row_names_the_file_and_the_next_attempt_cuts_it(tmp_path, full_disk, monkeypatch):
    log = _log(tmp_path)
    log.step(_row(1))
    log.close(plot=False)
    full_disk(lambda path: path.endswith("metrics.jsonl"))
    log = _log(tmp_path, resume="run", first_step=1)
    with pytest.raises(run_files.RunFileError) as e:
        log.step(_row(2))
    assert str(e.value) == f"disk full writing {tmp_path / 'metrics.jsonl'}: No space left on device"
    log.close(plot=False)  # nothing pending: closing does not fail a second time
    assert not (tmp_path / "metrics.jsonl").read_text().endswith("\n")  # half of row 2 went down
    monkeypatch.undo()  # the disk has room again
    _log(tmp_path, resume="run", first_step=1).close(plot=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


def test_restart_json(tmp_path, full_disk):
    from pipegpt.train.restart import restart_state, write_restart_state

    write_restart_state(tmp_path, 1, 5.0, 2)
    full_disk()
    with pytest.raises(run_files.RunFileError, match=r"^disk full writing .*/restart\.json: "):
        write_restart_state(tmp_path, 2, 6.0, 3)
    assert restart_state(tmp_path) == (1, 5.0, 2)  # the earlier one, whole
    assert _files(tmp_path) == ["restart.json"]


def test_a_checkpoint_whose_manifest_cannot_be_written_leaves_nothing(tmp_path, full_disk):
    import torch

    from pipegpt.state import checkpoint

    root = tmp_path / "checkpoints"
    tmp = checkpoint.begin(root, 4)
    checkpoint.write_rank_file(tmp, 0, {"param/w": torch.ones(2)}, {"param/w": [0, 1]})
    full_disk()
    with pytest.raises(run_files.RunFileError, match=r"^disk full writing .*/\.tmp-step-00000004/manifest\.json: "):
        checkpoint.commit(tmp, {"step": 4}, keep=0)
    assert _files(root) == []  # the rank files' space is given back at once


def test_snapshots_json_leaves_no_unrecorded_root(tmp_path, full_disk, monkeypatch):
    from pipegpt.state import snapshot

    monkeypatch.setattr(snapshot, "_base", lambda: tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    (tmp_path / "run").mkdir()
    full_disk(lambda path: path.endswith("snapshots.json.tmp"))
    with pytest.raises(run_files.RunFileError, match=r"^disk full writing .*/run/snapshots\.json: "):
        snapshot.claim_root(tmp_path / "run")
    assert _files(tmp_path) == ["run", "shm"]


def test_a_trace_is_whole_or_absent(tmp_path, full_disk):
    from pipegpt.engine.results import WorkerStep
    from pipegpt.schedule import build_plan, lower

    log = _log(tmp_path)
    full_disk(lambda path: "trace" in path)
    results = [WorkerStep(r, [], 1.0, 1e-3, 0, "cpu", events=[(f"{r}F0", 0.0, 1.0)]) for r in range(2)]
    with pytest.raises(run_files.RunFileError, match=r"^disk full writing .*/trace\.json: "):
        log.trace(results, lower(build_plan("1f1b", 2, 2)))
    log.close(plot=False)
    assert not any("trace" in name for name in _files(tmp_path))


def test_any_other_oserror_is_one_line_too():
    assert run_files.failure_line(OSError(errno.ENOSPC, "No space left on device", "runs/a/x")) == \
        "disk full writing runs/a/x: No space left on device"
    assert run_files.failure_line(OSError(errno.EACCES, "Permission denied", "runs/a/x")) == \
        "Permission denied: runs/a/x"
    assert run_files.failure_line(OSError(errno.EIO, "Input/output error")) == "[Errno 5] Input/output error"
