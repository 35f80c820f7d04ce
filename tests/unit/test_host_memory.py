"""A CPU job larger than the machine is refused before any worker starts, from the planner's memory estimate
(it ran until the kernel's OOM killer took a worker, then said 'no answer to start() within 60s')."""
from __future__ import annotations

import dataclasses

import pytest

from pipegpt.config import MODEL_PRESETS, ConfigError, TrainConfig
from pipegpt.planner.run_plan import make_plan
from pipegpt.train.preflight import PROCESS_BYTES, check_host_memory


def meminfo(tmp_path, available_bytes: int):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_bytes // 1024} kB\n")
    return str(path)


def test_a_job_larger_than_the_machine_is_one_line(tmp_path):
    cfg = dataclasses.replace(TrainConfig().replace(stages=2), model=MODEL_PRESETS["llama3-405b"])
    with pytest.raises(ConfigError, match=r"needs about \d+\.\d GiB of host memory on this machine \(2 ranks: "
                                          r".*and 22\.0 GiB is available"):
        check_host_memory(cfg, make_plan(cfg), meminfo(tmp_path, 22 * 2**30))


def test_the_tiny_default_fits_and_the_estimate_counts_each_rank(tmp_path):
    cfg = TrainConfig().replace(stages=2)
    check_host_memory(cfg, make_plan(cfg), meminfo(tmp_path, 4 * 2**30))
    with pytest.raises(ConfigError, match="2 ranks"):  # the processes alone, with no room for the model
        check_host_memory(cfg, make_plan(cfg), meminfo(tmp_path, 2 * PROCESS_BYTES))
