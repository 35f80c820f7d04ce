"""metrics.jsonl across attempts: every row names its attempt, and readers take the rows of the attempt that
went on (each step's last; an interrupted attempt's steps past the checkpoint a resume went on from are
dropped): pipegpt.schedule.calibrate.read_metrics, which `plan --calibrate` (pipegpt.plan.cost) reads."""
from __future__ import annotations

import json

from pipegpt.schedule.calibrate import read_metrics


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
    from pipegpt.plan import cost
    from pipegpt.schedule import build_plan, lower

    plan = lower(build_plan("1f1b", 2, 2))
    (tmp_path / "config.json").write_text(json.dumps({"model": {}, "parallel": {"tp": 1}}))
    _write(tmp_path, [{"step": 0, "attempt": 1, "step_time_s": 1.0}, {"step": 1, "attempt": 1, "step_time_s": 9.0},
                      {"step": 1, "attempt": 2, "step_time_s": 2.0}, {"step": 0, "attempt": 3, "step_time_s": 7.0}])
    assert cost._run_shape(str(tmp_path), plan).step_time_s == 7.0
