"""The device check before a restart (pipegpt.resilience.health): which GPUs a restart may use. Its control logic runs
here with a stand-in check; the probe itself runs on the CPU (gloo in place of NCCL)."""
import subprocess

from pipegpt.resilience import health
from pipegpt.resilience.health import probe, restart_devices, visible_gpus


def test_cpu_restarts_keep_every_rank_but_a_lost_one():
    assert restart_devices("cpu", 4, None) == (4, {}, "")
    assert restart_devices("cpu", 4, lost_rank=2) == (3, {}, "")


def test_a_gpu_that_fails_the_check_is_left_out_of_the_restart():
    ranks, env, said = restart_devices("cuda", 4, None, check=lambda gpu: gpu != "2", env={}, count=8)
    assert (ranks, env) == (3, {"CUDA_VISIBLE_DEVICES": "0,1,3"})  # the job's 4 GPUs probed, not all 8
    assert said.startswith("GPUs 0, 1, 3 passed the device check (") and said.endswith("; 2 did not")


def test_a_rehearsed_lost_rank_takes_its_gpu_by_the_visible_ids():
    probed = []
    check = lambda gpu: probed.append(gpu) or True  # noqa: E731
    ranks, env, _ = restart_devices("cuda", 4, lost_rank=1, check=check, env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert (ranks, env) == (3, {"CUDA_VISIBLE_DEVICES": "4,6,7"}) and sorted(probed) == ["4", "6", "7"]
    assert visible_gpus({}, count=2) == ["0", "1"]


def test_the_probe_passes_a_working_device_and_fails_one_that_does_not_answer_in_time():
    assert probe(None) is True  # allocate, compute, a one-rank group's all-reduce: here on the CPU with gloo
    assert probe(None, timeout_s=0.05) is False  # still importing torch: killed, counted as failed


class Unkillable:
    """A probe process stuck in the driver: it never exits, SIGKILL included."""

    killed = 0

    def __init__(self, *args, **kwargs):
        pass

    def wait(self, timeout=None):
        assert timeout is not None, "waited for a process with no timeout: the restart would hang with it"
        raise subprocess.TimeoutExpired("probe", timeout)

    def kill(self):
        Unkillable.killed += 1


def test_a_probe_that_outlives_its_kill_fails_its_gpu_without_hanging_the_restart(monkeypatch):
    monkeypatch.setattr(health.subprocess, "Popen", Unkillable)
    monkeypatch.setattr(health, "KILL_WAIT_S", 0.01, raising=False)
    assert probe("0", timeout_s=0.01) is False and Unkillable.killed == 1


class OldWorker:
    """A killed worker's process: it exits when joined, unless it is stuck (then join only waits its timeout)."""

    def __init__(self, stuck: bool):
        self.stuck, self.alive, self.waited = stuck, True, []

    def join(self, timeout=None):
        assert timeout is not None
        self.waited.append(timeout)
        self.alive = self.stuck

    def is_alive(self):
        return self.alive


def test_gpus_are_probed_once_the_old_workers_have_exited_and_a_survivors_gpu_fails_unprobed():
    workers = [OldWorker(stuck=r == 1) for r in range(3)]
    probed = []

    def check(gpu):
        assert not any(w.alive and not w.stuck for w in workers), "probed while an old worker may hold a GPU"
        probed.append(gpu)
        return True

    ranks, env, said = restart_devices("cuda", 3, None, check=check, env={"CUDA_VISIBLE_DEVICES": "4,5,6"},
                                       workers=workers, exit_wait_s=0.5)
    assert (ranks, env) == (2, {"CUDA_VISIBLE_DEVICES": "4,6"}) and sorted(probed) == ["4", "6"]
    assert said.endswith("; 5 did not (5: the old worker had not exited after 0 s)"), said
    assert all(w.waited and max(w.waited) <= 0.5 for w in workers)  # one deadline for them all
