"""Run one drawn case against the oracle: the same model in one process (tests/distributed/test_pipeline_oracle's
reference, float64), then, where the case says so, a checkpoint taken halfway resumed into another layout.

Workers are kept per grid (dp, pp, cp, tp) between cases, as the oracle tests keep them: `Hosts` holds at most one
grid's workers at a time.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS, TESTS / "distributed"):  # helpers, cluster_host, the oracle's comparison
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from layouts import Case, config  # noqa: E402

STEPS = 3


class Hosts:
    """Workers for one grid at a time, started on demand."""

    def __init__(self):
        self.key, self.host = None, None

    def get(self, cfg):
        from cluster_host import ClusterHost

        par = cfg.parallel
        key = (par.dp, par.stages, par.cp, par.tp)
        if key != self.key:
            self.close()
            self.host, self.key = ClusterHost(cfg), key
        return self.host

    def close(self) -> None:
        if self.host is not None:
            try:
                self.host.close()
            finally:
                self.host, self.key = None, None


def run_case(case: Case, hosts: Hosts, work: Path | None = None) -> None:
    """Raises AssertionError (or the run's error) where the case differs from one process."""
    import pytest
    import torch

    from pipegpt.state import checkpoint
    from test_pipeline_oracle import assert_matches

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(work or scratch)
        schedule_file = None
        if case.schedule_text is not None:
            schedule_file = work / f"schedule-{case.seed}.txt"
            schedule_file.write_text(case.schedule_text)
        cfg = config(case.settings, case.model, schedule_file and str(schedule_file))
        assert_matches(cfg, hosts.get(cfg), steps=STEPS)
        if case.resume_settings is None:
            return
        path, next_loss = hosts.get(cfg).save(cfg, work / f"ckpt-{case.seed}", case.resume_after)
        other = config(case.resume_settings, case.model)
        params, moments, loss = hosts.get(other).resume(other, path)
        reader = checkpoint.CheckpointReader(path)
        for key, value in {**params, **moments}.items():
            assert torch.equal(value, reader.full(key, key.split("/", 1)[1])), f"resumed {key} differs from the saved"
        assert loss == pytest.approx(next_loss, rel=1e-9), "the step after the resume differs"
