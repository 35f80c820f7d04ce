"""metrics.jsonl across attempts: every row names its attempt, and readers take the rows of the attempt that
went on (each step's last; an interrupted attempt's steps past the checkpoint a resume went on from are
dropped): pipegpt.run_files.read_metrics, which `plan --calibrate` (pipegpt.costs.calibrated) reads."""
from __future__ import annotations

import json

from pipegpt.run_files import read_metrics


def _write(run_dir, rows, tail: str = ""):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_a_resumed_runs_rows_are_its_lineage(tmp_path):
    # attempt 1 ran steps 0..5 and saved after step 3; attempt 2 resumed there and was stopped after step 4;
    # attempt 3 resumed from the same checkpoint and finished.
    rows = [{"step": s, "attempt": 1, "step_time_s": 1.0} for s in range(6)]
    rows += [{"step": s, "attempt": 2, "step_time_s": 2.0} for s in (3, 4)]
    rows += [{"step": s, "attempt": 3, "step_time_s": 3.0} for s in (3,)]
    _write(tmp_path, rows, tail='{"step": 4, "att')  # a line cut short by a crash
    got = [(r["step"], r["attempt"]) for r in read_metrics(tmp_path)]
    assert got == [(0, 1), (1, 1), (2, 1), (3, 3)]


def test_rows_without_attempts_take_each_steps_last(tmp_path):
    _write(tmp_path, [{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 1, "loss": 3.0}])
    assert [r["loss"] for r in read_metrics(tmp_path)] == [5.0, 3.0]
    assert read_metrics(tmp_path / "none") == []


def test_calibration_reads_the_last_step_of_the_lineage(tmp_path, monkeypatch):
    """plan --calibrate takes the step time of trace.json's step: the last row of the attempt that went on,
    not the last line of the file."""
    from pipegpt.costs import calibrated
    from pipegpt.schedule import build_plan, lower

    plan = lower(build_plan("1f1b", 2, 2))
    config = {"model": {}, "parallel": {"tp": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _write(tmp_path, [{"step": 0, "attempt": 1, "step_time_s": 1.0}, {"step": 1, "attempt": 1, "step_time_s": 9.0},
                      {"step": 1, "attempt": 2, "step_time_s": 2.0}, {"step": 0, "attempt": 3, "step_time_s": 7.0}])
    assert calibrated.run_shape(str(tmp_path), config, plan).step_time_s == 7.0


# --------------------------------------------------------------------------------------------------------------
# the run's log as an attempt opens it: one line of history, a torn row cut, whole files or none

def _log(run_dir, first_step=None, resume=None):
    """The log of an attempt that goes on after first_step (None: a fresh start, RunLog's default)."""
    from pipegpt.config import TrainConfig
    from pipegpt.observe.metrics import RunLog
    from pipegpt.schedule import build_plan, lower

    cfg = TrainConfig.build(stages=2, microbatches=2, resume=resume)
    where = {} if first_step is None else {"first_step": first_step}
    return RunLog(run_dir, cfg, lower(build_plan("1f1b", 2, 2)), **where)


def _step(log, step):
    from pipegpt.observe.metrics import StepMetrics

    log.step(StepMetrics(step, 4.0, 1.0, 100.0, 1.0, [0, 0]))


def _raw(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_torn_last_row_is_cut_as_the_next_attempt_opens(tmp_path):
    """A writer killed mid-line: the next row would be glued to it, and readers would drop both."""
    _write(tmp_path, [{"step": s, "attempt": 1, "loss": 5.0} for s in (1, 2)], tail='{"step": 3, "attempt": 1, "lo')
    log = _log(tmp_path, first_step=2, resume="run")
    _step(log, 3)
    log.close()
    assert [(r["step"], r["attempt"]) for r in _raw(tmp_path)] == [(1, 1), (2, 1), (3, 2)]  # every line a row
    assert [(r["step"], r["attempt"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 1), (3, 2)]


def test_starting_over_where_rows_exist_is_a_new_attempt_and_the_old_rows_are_abandoned(tmp_path):
    """--resume auto (or a restart) without a checkpoint: the run starts again at step 1 in its directory, as
    attempt 2, never as attempt 1 again beside the first attempt's steps."""
    _write(tmp_path, [{"step": s, "attempt": 1, "loss": 5.0} for s in (1, 2, 3, 4)])
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "attempt-1.json").write_text("{}")
    log = _log(tmp_path)
    _step(log, 1)
    log.close()
    assert log.attempt == 2 and (tmp_path / "configs" / "attempt-2.json").is_file()
    assert [(r["step"], r["attempt"], r.get("abandoned")) for r in _raw(tmp_path)] == \
        [(1, 1, True), (2, 1, True), (3, 1, True), (4, 1, True), (1, 2, None)]
    assert [(r["step"], r["attempt"]) for r in read_metrics(tmp_path)] == [(1, 2)]


def test_the_rows_of_an_abandoned_branch_are_marked_and_skipped(tmp_path):
    """A resume of the step-2 checkpoint after a run went to step 6: steps 3-6 were another history. Readers skip
    them even where a later attempt ends before them (no stale row after the line's last step)."""
    _write(tmp_path, [{"step": s, "attempt": 1, "loss": 5.0} for s in range(1, 7)])
    log = _log(tmp_path, first_step=2, resume="run")
    _step(log, 3)
    log.close()
    assert [r["step"] for r in _raw(tmp_path) if r.get("abandoned")] == [3, 4, 5, 6]
    assert [(r["step"], r["attempt"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 1), (3, 2)]
    _log(tmp_path, first_step=1, resume="run").close()  # marked once: a row already abandoned stays as it was
    assert [(r["step"], r["attempt"]) for r in _raw(tmp_path) if not r.get("abandoned")] == [(1, 1)]


def test_a_full_disk_leaves_no_empty_config(tmp_path):
    """configs/attempt-N.json, config.json and plan.txt are whole or absent: never 0 bytes, nor a temporary file."""
    import resource
    import signal

    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # as a full disk: a write past 16 bytes fails
    try:
        with pytest.raises(OSError):
            _log(tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["configs"]
