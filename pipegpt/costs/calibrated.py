"""`pipegpt plan --calibrate RUN_DIR`: CalibratedCosts from a `pipegpt run` directory. pipegpt.run_files reads its
plan.txt, trace.json, config.json and metrics.jsonl; pipegpt.schedule.calibrate turns the trace of the plan into
per-stage costs and its step's parts outside the actions (the optimizer, the sync's tail, the rest: step_times);
pipegpt.costs.calibrated_costs scales the FLOP model to them (fit_calibrated_costs).

A CPU run's compute is what it measured at its own intra-op threads per rank: --threads-per-worker, else the
machine's cores over its ranks (pipegpt.train.driver's default). A layout whose ranks get another number (the
default for fewer or more ranks; every layout runs at an explicit --threads-per-worker) has its F, B and W scaled by
the block's measured time at that number over its time at the calibration run's (ThreadScaling), not by an assumed
linear speedup. Its compute is also what the run measured at its own microbatch size, and the FLOP model is linear
in tokens, where a larger microbatch's larger matmuls run at a higher rate: a layout of another size has its
compute scaled by the block's measured time per sequence at that size over at the run's (MicrobatchScaling). And
ranks computing at once on one machine slow each other down: a layout with another number of them than the run
had is scaled by the block timed in that many processes at once over alone, against the run's (ThreadScaling's
sharing_scale). Each times one block of the run's model in a child process on this machine
(pipegpt.stages.block_timing) the first time a layout needs it. Calibrate on the machine the run ran on, and a
quiet one: a second thread on a busy core runs slower than one. On a GPU none applies (the block would have to be
timed on the run's GPU): the run's rate is every size's. The analytical model's per-block floor is its own
microbatch-size term; calibrated costs have none, so nothing counts twice.
"""
from __future__ import annotations

import errno
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

from pipegpt.arch import stage_ranges
from pipegpt.config import ConfigError, ModelConfig, usable_cores
from pipegpt.dims import Sharding
from pipegpt.run_files import CONFIG, RunReadError, read_measured_steps, read_metrics
from pipegpt.schedule import ScheduleError
from pipegpt.schedule.calibrate import OPTIMIZER, SYNC, StepBreakdown, breakdown, calibrate_run, median_calibration
from pipegpt.schedule.schedule_file import load_schedule_file

from .balance import even_layers
from .calibrated_costs import CalibratedCosts, RunShape, StepTimes, fit_calibrated_costs
from .devices import Cluster
from .memory import parameter_count


Settings = tuple[tuple[int, int], ...]  # (intra-op threads, sequences per microbatch) for each timing of a block
OPTIMIZER_STEP = 0  # a setting's size 0: the optimizer's step over the model's parameters (stages.block_timing)
Timer = Callable[[Settings], dict[tuple[int, int], float]]  # {(threads, size): seconds of one block}
SharedTimer = Callable[[int, int, int], tuple[float, float]]  # (threads, size, k) -> the block alone, k at once


def calibrate_costs(run_dir: str, cluster: Cluster, measure: Timer | None = None,
                    shared: SharedTimer | None = None, host_per_action: bool = True) -> CalibratedCosts:
    """CalibratedCosts from a `pipegpt run` directory (its plan.txt, trace.json, config.json, metrics.jsonl).
    measure: one block's seconds under each setting asked (default: block_timer's child process); shared: the
    block alone and in processes at once (default, where measure is too: shared_block_timer's; else none).
    host_per_action False: the host's time between computes stays in F and B, scaled with them (as before it was
    a term of its own; bench_plan_order compares the two)."""
    try:
        steps = read_measured_steps(run_dir)
        plan = load_schedule_file(steps[0].plan_path)
        calibrated = [calibrate_run(plan, step) for step in steps]
    except (RunReadError, ScheduleError) as e:
        raise ConfigError(f"--calibrate: {e}") from None
    files = steps[-1]
    calibration = median_calibration([c for _, c in calibrated])
    makespan = statistics.median(float(measured.makespan) for measured, _ in calibrated)
    shape = run_shape(run_dir, files.config, plan, [s.step for s in steps])
    S = plan.num_stages
    params = [0] * plan.num_ranks
    for s, layers in enumerate(stage_ranges(shape.layers)):  # which layers: their kinds count
        params[plan.stage_to_rank[s]] += parameter_count(shape.model, layers, s == 0, s == S - 1, shape.sharding.tp)
    par = (files.config or {}).get("parallel", {})
    replicas = int(par.get("dp", 1)) * int(par.get("cp", 1))
    apart = host_per_action and calibration.compute is not None
    fit = fit_calibrated_costs(cluster, shape, calibration.compute if apart else calibration.costs, makespan, params,
                               os.fspath(run_dir), median_step_times([step_times(breakdown(s.trace)) for s in steps]),
                               replicas, int(par.get("zero", 0)), calibration.host if apart else 0.0)
    timer = measure or block_timer(files.config)
    shared = shared or (shared_block_timer(files.config) if measure is None else None)
    fit.threads = thread_scaling(files.config, read_metrics(run_dir), plan.num_ranks * replicas * shape.sharding.tp,
                                 at_size(timer, shape.mbs))
    if fit.threads is not None:
        fit.threads.measure_optimizer = at_size(timer, OPTIMIZER_STEP)
        if shared is not None:
            fit.threads.measure_shared = lambda threads, k: shared(threads, shape.mbs, k)
        fit.microbatch = MicrobatchScaling(fit.threads, shape.mbs, timer)
    return fit


def step_times(parts: StepBreakdown | None) -> StepTimes | None:
    """The cost model's terms outside the actions, from a traced step's breakdown (None: a trace without parts)."""
    if parts is None:
        return None
    return StepTimes(optimizer=parts.part(OPTIMIZER), sync=parts.part(SYNC), rest=parts.rest)


def median_step_times(steps: list[StepTimes | None]) -> StepTimes | None:
    """Each term outside the actions, the median over the traced steps that have their parts."""
    known = [s for s in steps if s is not None]
    if not known:
        return None
    return StepTimes(*(statistics.median(getattr(s, k) for s in known) for k in ("optimizer", "sync", "rest")))


def run_shape(run_dir: str, config: dict | None, plan, steps: list[int | None] | None = None) -> RunShape:
    """The run's model and layout from its config.json's contents; from metrics.jsonl, the median time of the
    traced `steps` (None: trace.json's, the last step of the attempt that went on)."""
    if config is None:
        missing = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.path.join(run_dir, CONFIG))
        raise ConfigError(f"--calibrate {run_dir}: cannot read its config.json ({missing})")
    fields = {f for f in ModelConfig.__dataclass_fields__}
    model = ModelConfig(**{k: v for k, v in config.get("model", {}).items() if k in fields})
    par = config.get("parallel", {})
    layers = par.get("layers_per_stage")
    if layers is None:
        layers = even_layers(model.n_layer, plan.num_stages)
    rows = read_metrics(run_dir)  # each step's row from the attempt that went on (a resumed run has several)
    times = [float(r["step_time_s"]) for r in rows if steps and int(r["step"]) in steps and r.get("step_time_s")]
    step_time = statistics.median(times) if times else float(rows[-1]["step_time_s"]) if rows else None
    sharding = Sharding(tp=int(par.get("tp", 1)), sequence_parallel=bool(par.get("sequence_parallel", False)))
    return RunShape(model, sharding, str(par.get("recompute", "none")), int(par.get("microbatch_size", 1)),
                    tuple(layers), tuple(plan.stage_to_rank), step_time,
                    {"precision": config.get("runtime", {}).get("precision")})


@dataclass
class ThreadScaling:
    """A CPU run's compute at other intra-op threads per rank than its own: each layout's threads (the calibration
    run's explicit --threads-per-worker, else cores // the ranks on the machine, as the driver gives them) and the
    block's measured seconds at them. scale(ranks) = seconds at the layout's threads / seconds at the calibration
    run's; measured once, at every count a layout on this machine can get, when the first layout needs another."""

    calibrated: int  # the calibration run's threads per rank
    explicit: bool  # --threads-per-worker was given: every layout runs at it
    cores: int  # this process's (config.usable_cores: the driver's default divides them)
    measure: Callable[[tuple[int, ...]], dict[int, float]]
    seconds: dict = field(default_factory=dict)  # threads -> one block's forward + backward, as measured
    # {threads: seconds} of one optimizer step over the model's parameters (None: the optimizer is not scaled)
    measure_optimizer: Callable[[tuple[int, ...]], dict[int, float]] | None = None
    optimizer_seconds: dict = field(default_factory=dict)
    ranks: int = 1  # the calibration run's ranks on the machine
    # (threads, k) -> (the block's seconds alone, in k processes at once) (None: ranks at once are not scaled)
    measure_shared: Callable[[int, int], tuple[float, float]] | None = None
    shared: dict = field(default_factory=dict)  # (threads, k) -> the block in k processes at once over alone

    def threads(self, ranks: int) -> int:
        """The intra-op threads of each of `ranks` workers on one machine."""
        return self.calibrated if self.explicit else max(1, self.cores // max(1, ranks))

    def scale(self, ranks: int) -> float:
        return self._ratio(ranks, self.measure, self.seconds) * self.sharing_scale(ranks)

    def at_once(self, ranks: int) -> int:
        """How many of `ranks` workers compute at once on the machine: as many as its cores hold at their threads."""
        return max(1, min(ranks, self.cores // self.threads(ranks)))

    def sharing_scale(self, ranks: int) -> float:
        """Ranks at once on one machine slow each other down (memory bandwidth, caches): a layout with fewer of
        them than the calibration run had computes faster by what its ranks lost, a layout with more slower. The
        block in as many processes at once as each has, over alone; the layout's over the run's."""
        mine, run = (self.threads(ranks), self.at_once(ranks)), (self.calibrated, self.at_once(self.ranks))
        if self.measure_shared is None or mine == run:
            return 1.0
        return self._shared(*mine) / self._shared(*run)

    def _shared(self, threads: int, at_once: int) -> float:
        if at_once == 1:
            return 1.0
        if (threads, at_once) not in self.shared:
            alone, shared = self.measure_shared(threads, at_once)
            self.shared[threads, at_once] = shared / alone
        return self.shared[threads, at_once]

    def optimizer_scale(self, ranks: int) -> float:
        """The optimizer step's seconds at the layout's threads over at the run's: an elementwise pass over the
        parameters, bound by memory, which more threads speed up less than a block's matmuls."""
        if self.measure_optimizer is None:
            return 1.0
        return self._ratio(ranks, self.measure_optimizer, self.optimizer_seconds)

    def _ratio(self, ranks: int, measure, seconds: dict) -> float:
        n = self.threads(ranks)
        if n == self.calibrated:
            return 1.0
        if n not in seconds:
            counts = sorted({self.calibrated, n, *(max(1, self.cores // r) for r in range(1, self.cores + 1))})
            seconds.update(measure(tuple(t for t in counts if t not in seconds)))
        return seconds[n] / seconds[self.calibrated]

    def describe(self) -> str:
        said = f"{self.calibrated} thread{'s' * (self.calibrated > 1)} per rank"
        if self.explicit:
            return f"{said} (--threads-per-worker: every layout's)"
        if len(self.seconds) < 2:
            return f"{said} (cores / ranks: other counts measured when a layout needs them)"
        base = self.seconds[self.calibrated]
        text = (f"{said} (cores / ranks); a block at "
                + ", ".join(f"{t}: x{base / s:.2f}" for t, s in sorted(self.seconds.items()) if t != self.calibrated)
                + " its speed")
        if len(self.optimizer_seconds) > 1:
            base = self.optimizer_seconds[self.calibrated]
            text += ("; the optimizer at " + ", ".join(f"{t}: x{base / s:.2f}" for t, s in
                                                       sorted(self.optimizer_seconds.items()) if t != self.calibrated))
        if self.shared:
            text += "; a block in ranks at once, over alone: " + ", ".join(
                f"{k} at {t} thread{'s' * (t > 1)} x{x:.3f}" for (t, k), x in sorted(self.shared.items()))
        return text


def thread_scaling(config: dict | None, rows: list, ranks: int, measure, cores: int | None = None
                   ) -> ThreadScaling | None:
    """The calibration run's ThreadScaling (None for a run on a GPU: threads drive no kernels there). Its device:
    config.json's, and under "auto" a CPU where its metrics have no MFU (known for every GPU of the table)."""
    runtime = (config or {}).get("runtime", {})
    device = runtime.get("device", "auto")
    on_gpu = device == "cuda" or (device == "auto" and any(r.get("mfu") is not None for r in rows))
    if on_gpu or device not in ("cpu", "auto", "cuda"):
        return None
    cores = cores or usable_cores()
    given = runtime.get("threads_per_worker")
    return ThreadScaling(int(given) if given else max(1, cores // max(1, ranks)), bool(given), cores, measure,
                         ranks=ranks)


def at_size(timer: Timer, size: int) -> Callable[[tuple[int, ...]], dict[int, float]]:
    """ThreadScaling's measure from a Timer: {threads: seconds} of the block at each count, at `size`."""
    return lambda threads: {t: s for (t, _), s in timer(tuple((t, size) for t in threads)).items()}


@dataclass
class MicrobatchScaling:
    """A CPU run's compute at other microbatch sizes than its own: a larger microbatch's larger matmuls run more
    tokens a second, which a compute model linear in tokens does not see. scale(ranks, size) = one block's seconds
    per sequence at `size` over at the calibration run's size, both at the layout's threads (`threads`), so that
    with ThreadScaling's factor (the run's size at the layout's threads over at the run's) the product is the block
    at the layout's threads and size over at the run's. The first layout at a thread count that needs another size
    measures, in one child process, the run's size, the layout's and every power of two below the larger."""

    threads: ThreadScaling  # each layout's threads per rank
    calibrated: int  # the calibration run's sequences per microbatch
    measure: Timer
    seconds: dict = field(default_factory=dict)  # (threads, size) -> one block's forward + backward, as measured

    def scale(self, ranks: int, size: int) -> float:
        if size == self.calibrated:
            return 1.0
        n = self.threads.threads(ranks)
        if (n, size) not in self.seconds:
            top = max(size, self.calibrated)
            sizes = sorted({self.calibrated, size, *(1 << k for k in range(top.bit_length()))})
            self.seconds.update(self.measure(tuple((n, s) for s in sizes if (n, s) not in self.seconds)))
        return self.seconds[n, size] / size / (self.seconds[n, self.calibrated] / self.calibrated)

    def describe(self) -> str:
        said = f"microbatches of {self.calibrated} sequence{'s' * (self.calibrated > 1)}"
        counts = sorted({n for n, _ in self.seconds})
        if not counts:
            return f"{said} (other sizes measured when a layout needs them)"
        per = {key: s / key[1] for key, s in self.seconds.items()}
        return (f"{said}; a block's time per sequence against the run's size "
                + "; ".join(f"at {n} thread{'s' * (n > 1)}: "
                            + ", ".join(f"{size}: x{per[n, size] / per[n, self.calibrated]:.3f}"
                                        for m, size in sorted(self.seconds) if m == n and size != self.calibrated)
                            for n in counts))


def _block_request(config: dict | None) -> dict:
    runtime = (config or {}).get("runtime", {})
    return {"model": (config or {}).get("model", {}),
            "recompute": (config or {}).get("parallel", {}).get("recompute", "none"),
            "dtype": runtime.get("dtype", "float32"), "bf16": runtime.get("precision") == "bf16"}


def _timing_child(request: dict, said: str) -> list:
    """pipegpt.stages.block_timing's answer to `request`, in a child process; ConfigError naming what it timed."""
    args = [sys.executable, "-m", "pipegpt.stages.block_timing", json.dumps(request)]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        raise ConfigError(f"--calibrate: timing a block ({said}) failed: "
                          f"{detail.strip().splitlines()[-1] if detail.strip() else e}") from None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _said(threads: int, size: int) -> str:
    return f"{threads} thread{'s' * (threads > 1)}, {size} sequence{'s' * (size > 1)}"


def block_timer(config: dict | None) -> Timer:
    """measure for ThreadScaling and MicrobatchScaling: one block of the run's model timed under each setting in a
    child process (pipegpt.stages.block_timing; the planner imports no torch)."""
    request = _block_request(config)

    def measure(settings: Settings) -> dict[tuple[int, int], float]:
        answer = _timing_child({**request, "settings": [list(x) for x in settings]},
                               "; ".join(_said(t, n) for t, n in settings))
        return {(int(t), int(size)): float(s) for t, size, s in answer}

    return measure


def shared_block_timer(config: dict | None) -> SharedTimer:
    """ThreadScaling's measure_shared: one block of the run's model timed alone and in k processes at once,
    alternated (pipegpt.stages.block_timing with at_once), in a child process."""
    request = _block_request(config)

    def measure(threads: int, size: int, at_once: int) -> tuple[float, float]:
        (_, _, alone, shared), = _timing_child({**request, "settings": [[threads, size]], "at_once": at_once},
                                               f"{_said(threads, size)}, {at_once} processes at once")
        return float(alone), float(shared)

    return measure
