"""The stall watchdog on the CUDA control path (p2p_matching "order"), run on CPU.

On CUDA a host runs ahead of its GPU: waits only order streams, so a slow kernel leaves every host in the step's
settle(), and the hosts alone look like a deadlock cycle. `PIPEGPT_FAULT=gpu-stuck:1:4` rehearses that on CPU:
rank 1's host runs step 4 to its end and then never returns from settle(), while its device marks (CUDA events on a GPU,
pipegpt.stages.timing.device_marker) say its "GPU" never finished its first compute action. The watchdog must name
rank 1 and say its GPU is busy in 1F0.
"""
from __future__ import annotations

import pytest

from pipegpt.comm.rpc import WorkerStalled
from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.train.driver import Job

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=3, n_head=2, n_embd=16)
STUCK_STEP = 3


@pytest.mark.slow  # 14 s; the watchdog's naming of a stuck rank stays in the default set (test_watchdog_stall)
def test_a_gpu_stuck_in_compute_is_named_not_a_cycle_of_hosts(monkeypatch):
    monkeypatch.setenv("PIPEGPT_FAULT", f"gpu-stuck:1:{STUCK_STEP + 1}")  # the workers inherit it; counted from 1
    cfg = TrainConfig.build(MODEL, stages=3, microbatches=3, microbatch_size=2, device="cpu", steps=8,
                            timeout_s=60, threads_per_worker=1, p2p_matching="order")
    job = Job(cfg)
    try:
        job.start()
        for step in range(STUCK_STEP):
            job.step(step)
        with pytest.raises(WorkerStalled) as stalled:
            job.step(STUCK_STEP)
    finally:
        job.kill()
    error = stalled.value
    assert error.rank == 1, error.report
    # its host sits in its last wait of the step (a send on this CPU stand-in; settle() on a GPU)
    assert str(error).startswith("rank 1 stalled: GPU busy in 1F0 (its host is at "), error.report
    assert "waiting for no other rank; ranks 0, 2 wait for it" in str(error), error.report
    rows = {int(line.split()[0]): line for line in error.report.splitlines()[2:]}
    assert rows[1].split()[2] == "GPU" and rows[1].split()[4] == "1F0", error.report
