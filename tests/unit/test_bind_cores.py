"""--bind-cores: each worker pinned to cores of its own, or one line saying how many cores it would need; and
without --threads-per-worker, each worker's share of the cores this process may use."""
from __future__ import annotations

import os
import re

import pytest

from helpers import assert_one_line_error, invoke, run_pipegpt
from pipegpt.config import ConfigError, ModelConfig, TrainConfig, usable_cores
from pipegpt.engine.placement import default_threads, torchrun_cores, worker_cores

AVAILABLE = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(AVAILABLE) < 2, reason="needs two cores this process may use")


def test_each_rank_gets_the_next_threads_cores_of_those_allowed():
    allowed = [2, 3, 5, 7, 8, 9]  # a process restricted by taskset or a cgroup: not 0..n-1
    assert [worker_cores(r, 3, 2, allowed) for r in range(3)] == [(2, 3), (5, 7), (8, 9)]
    assert [worker_cores(r, 2, 1, allowed) for r in range(2)] == [(2,), (3,)]


def test_too_few_cores_names_what_would_fit():
    with pytest.raises(ConfigError, match=r"needs 2 ranks x 4 threads = 8 cores .* may use 6: lower "
                                          r"--threads-per-worker to 3, or leave --bind-cores out"):
        worker_cores(0, 2, 4, list(range(6)))
    with pytest.raises(ConfigError, match=r"needs 8 ranks x 1 thread = 8 cores .* may use 6: run at most 6 "
                                          r"ranks here"):
        worker_cores(0, 8, 1, list(range(6)))


@needs_two_cores
def test_under_torchrun_the_local_rank_picks_the_cores():
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert torchrun_cores(1, env) == (AVAILABLE[1],)
    assert torchrun_cores(None, env) == tuple(AVAILABLE[len(AVAILABLE) // 2:2 * (len(AVAILABLE) // 2)])


@needs_two_cores
def test_run_refuses_more_threads_than_cores_in_one_line():
    result = invoke("run", "--stages", "2", "--bind-cores", "--threads-per-worker", str(len(AVAILABLE)),
                    "--steps", "1")
    assert_one_line_error(result, f"2 ranks x {len(AVAILABLE)} threads", f"may use {len(AVAILABLE)}",
                          f"lower --threads-per-worker to {len(AVAILABLE) // 2}")


@needs_two_cores
def test_each_worker_runs_on_its_own_core(tmp_path):
    result = run_pipegpt("run", "--stages", "2", "--microbatches", "2", "--steps", "1", "--bind-cores",
                         "--threads-per-worker", "1", "--run-dir", tmp_path / "run", timeout=120)
    assert result.returncode == 0, result.stderr
    # the cores each worker's own process reports (os.sched_getaffinity inside it)
    line = next(ln for ln in result.stdout.splitlines() if "cores per rank" in ln)
    assert re.findall(r"(\d+): ([\d,]+)", line) == [("0", str(AVAILABLE[0])), ("1", str(AVAILABLE[1]))]


@pytest.fixture
def pinned_to_two_of_sixteen(monkeypatch):
    """A process a cpuset (taskset, a container, a batch scheduler) allows cores 4 and 5 of a 16-core machine."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)


def test_default_threads_divide_the_cores_this_process_may_use(pinned_to_two_of_sixteen):
    assert usable_cores() == 2  # not the machine's 16: 2 workers would share 8 threads each over 2 cores
    assert [default_threads(ranks, env={}) for ranks in (1, 2, 4)] == [2, 1, 1]
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1"}  # 1 of 8 ranks on this machine
    assert default_threads(8, env=torchrun) == 2


def test_a_run_gives_each_worker_its_share_of_the_allowed_cores(pinned_to_two_of_sixteen):
    from pipegpt.train.driver import Job

    cfg = TrainConfig.build(ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16), stages=2, microbatches=2,
                            device="cpu")
    assert Job(cfg).threads == 1
    assert Job(cfg, threads_per_worker=3).threads == 3  # given, it is kept
