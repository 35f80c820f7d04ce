"""PIPEGPT_FAULT is checked before any worker starts: a malformed or out-of-range fault is one line naming the
entry and what is valid (it used to fail inside a worker, or never fire and exit 0)."""
from __future__ import annotations

import pytest

from pipegpt.config import ConfigError, TrainConfig
from pipegpt.resilience.faults import FAULT_ENV, check_faults


@pytest.mark.parametrize("value, message", [
    ("raise", "'raise' is not KIND:RANK:STEP"),
    ("raise:1", "'raise:1' is not KIND:RANK:STEP"),
    ("raise:a:3", "'raise:a:3' is not KIND:RANK:STEP"),
    ("explode:1:3", "kind 'explode' is not one of raise, exit"),
    ("raise:2:3", "rank 2 is not one of this job's ranks 0..1"),
    ("raise:-1:3", "rank -1 is not one of this job's ranks 0..1"),
    ("raise:1:9", "step 9 is not one this run takes (1..8)"),
    ("raise:1:0", "step 0 is not one this run takes (1..8)"),
    ("raise:1:3,exit:0:12", "step 12 is not one this run takes (1..8)"),
])
def test_a_bad_fault_is_one_line(value, message):
    with pytest.raises(ValueError) as e:
        check_faults(2, 8, {FAULT_ENV: value})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_good_faults_pass():
    for value in ("", "raise:1:3", "lose:0:1,stuck:1:8", "kill-in-save:1:8"):
        check_faults(2, 8, {FAULT_ENV: value})


def test_the_driver_refuses_it_before_any_worker_starts(monkeypatch):
    from pipegpt.train.driver import check

    monkeypatch.setenv(FAULT_ENV, "raise:5:3")
    cfg = TrainConfig().replace(stages=2, steps=8)
    with pytest.raises(ConfigError, match="rank 5 is not one of this job's ranks 0..1"):
        check(cfg)


def test_the_training_docs_give_the_fault_syntax_and_every_kind():
    """PIPEGPT_FAULT's syntax was only in docs/architecture.md (then in the README, now in docs/training.md)."""
    from helpers import ROOT
    from pipegpt.resilience.faults import KINDS

    readme = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert "`PIPEGPT_FAULT=KIND:RANK:STEP`" in readme
    assert [kind for kind in KINDS if f"`{kind}`" not in readme] == []
