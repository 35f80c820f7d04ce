"""The device check before a restart (pipegpt.resilience.health): which GPUs a restart may use. Its control logic runs
here with a stand-in check; the probe itself runs on the CPU (gloo in place of NCCL)."""
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
