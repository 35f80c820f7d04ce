"""The driver: checks a job, builds its plan once, owns the workers' lives and runs the training loop.

    job = Job(cfg)            # refuses a bad config or schedule before any process starts
    with job:                 # start (or join, under torchrun) the workers; kill them all on any error
        job.start()
        results = job.step(0)

`train()` is the loop: one control message per step; checkpoints, evaluation and profiling hook in
between steps, where the loop says so.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from pipegpt.comm.rpc import LocalCluster, TorchrunCluster, free_port, port_is_free
from pipegpt.config import ConfigError, TrainConfig
from pipegpt.devices import local_world_size, resolve_device, under_torchrun
from pipegpt.metrics import RunLog, StepMetrics, step_metrics
from pipegpt.schedule import Plan, ScheduleError, build_plan, lower, validate
from pipegpt.schedule.schedule_file import load_schedule_file
from pipegpt.stages import partition_layers
from pipegpt.worker import Worker


def make_plan(cfg: TrainConfig) -> Plan:
    """The lowered, validated plan every worker executes: from the schedule registry or a schedule file."""
    p = cfg.parallel
    try:
        if p.schedule_file is not None:
            plan = load_schedule_file(p.schedule_file)
            for flag, given, actual in (("--stages", p.stages, plan.num_ranks),
                                        ("--microbatches", p.microbatches, plan.num_microbatches)):
                if given != actual:
                    raise ConfigError(f"{p.schedule_file} has {actual} {flag[2:]} but {flag} is {given}: "
                                      f"leave {flag} out (the file fixes it) or give {actual}")
            return plan if plan.is_lowered else validate(lower(plan))
        return validate(lower(build_plan(p.schedule, p.stages, p.microbatches, p.virtual_stages)))
    except ScheduleError as e:
        raise ConfigError(str(e)) from None


def check(cfg: TrainConfig) -> Plan:
    """Everything that can be refused before a worker starts; returns the plan."""
    import torch

    cfg.validate(os.environ)
    plan = make_plan(cfg)
    partition_layers(cfg.model.n_layer, plan.num_stages, cfg.parallel.layers_per_stage)
    if resolve_device(cfg.runtime.device, cfg.world_size) == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local = local_world_size(cfg.world_size)
        if have < local:
            raise ConfigError(f"device=cuda needs one GPU per rank on this machine ({local}), "
                              f"but {have} are visible: use --device cpu or fewer ranks")
    return plan


class Job:
    """A job's workers, from start to close: one actor per rank, steered over RPC."""

    def __init__(self, cfg: TrainConfig, port: int | None = None, threads_per_worker: int | None = None):
        self.cfg, self.plan = cfg, check(cfg)
        if port is not None and not under_torchrun() and not port_is_free(port):
            raise ConfigError(f"port {port} is in use: choose a free port or leave --port out")
        self.port = port
        self.threads = threads_per_worker or cfg.runtime.threads_per_worker \
            or max(1, (os.cpu_count() or 1) // cfg.world_size)
        self.cluster = None

    def start(self) -> bool:
        """Start the workers and build them for the plan. Under torchrun every process calls this; the
        ones other than the driver serve until the driver shuts the job down, then return False."""
        cfg = self.cfg
        if under_torchrun():
            self.cluster, init_method = TorchrunCluster(cfg.runtime.timeout_s), "env://"
            if not self.cluster.is_driver:
                self.cluster.close()  # serve the driver's requests until it shuts everyone down
                return False
        else:
            init_method = f"tcp://127.0.0.1:{self.port or free_port()}"
            self.cluster = LocalCluster(cfg.world_size, cfg.runtime.timeout_s, self.threads)
        self.cluster.spawn(Worker, lambda r: (r, cfg, init_method))
        self.cluster.call("start", self.plan)  # every worker built before step 0 starts its clock
        return True

    def step(self, step: int) -> list[dict]:
        return self.cluster.call("step", step)

    def build(self, cfg: TrainConfig) -> list[dict]:
        """Rebuild every worker for another config on the same grid (dp x pp x tp)."""
        grid = lambda c: (c.parallel.dp, c.parallel.stages, c.parallel.tp)  # noqa: E731
        if grid(cfg) != grid(self.cfg):
            raise ConfigError(f"a running job keeps its grid dp x pp x tp = {grid(self.cfg)}, not {grid(cfg)}")
        self.cfg, self.plan = cfg, check(cfg)
        return self.cluster.call("build", cfg, self.plan)

    def call(self, method: str, *args) -> list:
        return self.cluster.call(method, *args)

    def close(self) -> None:
        self.cluster.call("shutdown")
        self.cluster.close()

    def kill(self) -> None:
        if self.cluster is not None:
            self.cluster.kill()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is not None:
            self.kill()


def train(job: Job, log: RunLog, on_step: Callable[[StepMetrics, list[dict]], None] = lambda m, r: None
          ) -> list[StepMetrics]:
    """The training loop on a started job: a step, its metrics, and (later) checkpoint/eval/profile hooks."""
    cfg, history = job.cfg, []
    for step in range(cfg.runtime.steps):
        t0 = time.perf_counter()
        results = job.step(step)
        metrics = step_metrics(step, results, cfg, time.perf_counter() - t0)
        log.step(metrics)
        history.append(metrics)
        on_step(metrics, results)
    return history


def run_job(job: Job, run_dir: Path, on_step: Callable[[StepMetrics], None] = lambda m: None
            ) -> list[StepMetrics] | None:
    """Start (or join, under torchrun) the job's workers, train, and write metrics and the last step's trace.

    Returns the step metrics on the driver, None on the other torchrun ranks.
    """
    last: list[dict] = []

    def record(metrics: StepMetrics, results: list[dict]) -> None:
        last[:] = results
        on_step(metrics)

    with job:
        if not job.start():
            return None
        log = RunLog(run_dir, job.cfg)
        try:
            history = train(job, log, record)
            if last:
                log.trace(last, job.plan)
        finally:
            log.close()
        job.close()
    return history
