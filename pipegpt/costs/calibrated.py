"""`pipegpt plan --calibrate RUN_DIR`: CalibratedCosts from a `pipegpt run` directory. pipegpt.run_files reads its
plan.txt, trace.json, config.json and metrics.jsonl; pipegpt.schedule.calibrate turns the trace of the plan into
per-stage costs and its step's parts outside the actions (the optimizer, the sync's tail, the rest: step_times);
pipegpt.costs.cost scales the FLOP model to them (fit_calibrated_costs).
"""
from __future__ import annotations

import errno
import os

from pipegpt.arch import stage_ranges
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.dims import Sharding
from pipegpt.run_files import CONFIG, RunReadError, read_measured_run, read_metrics
from pipegpt.schedule import ScheduleError
from pipegpt.schedule.calibrate import OPTIMIZER, SYNC, StepBreakdown, breakdown, calibrate_run
from pipegpt.schedule.schedule_file import load_schedule_file

from .balance import even_layers
from .cost import CalibratedCosts, RunShape, StepTimes, fit_calibrated_costs
from .devices import Cluster
from .memory import parameter_count


def calibrate_costs(run_dir: str, cluster: Cluster) -> CalibratedCosts:
    """CalibratedCosts from a `pipegpt run` directory (its plan.txt, trace.json, config.json, metrics.jsonl)."""
    try:
        files = read_measured_run(run_dir)
        plan = load_schedule_file(files.plan_path)
        measured, calibration = calibrate_run(plan, files)
    except (RunReadError, ScheduleError) as e:
        raise ConfigError(f"--calibrate: {e}") from None
    shape = run_shape(run_dir, files.config, plan)
    S = plan.num_stages
    params = [0] * plan.num_ranks
    for s, layers in enumerate(stage_ranges(shape.layers)):  # which layers: their kinds count
        params[plan.stage_to_rank[s]] += parameter_count(shape.model, layers, s == 0, s == S - 1, shape.sharding.tp)
    par = (files.config or {}).get("parallel", {})
    replicas = int(par.get("dp", 1)) * int(par.get("cp", 1))
    return fit_calibrated_costs(cluster, shape, calibration.costs, measured.makespan, params, os.fspath(run_dir),
                                step_times(breakdown(files.trace)), replicas, int(par.get("zero", 0)))


def step_times(parts: StepBreakdown | None) -> StepTimes | None:
    """The cost model's terms outside the actions, from a traced step's breakdown (None: a trace without parts)."""
    if parts is None:
        return None
    return StepTimes(optimizer=parts.part(OPTIMIZER), sync=parts.part(SYNC), rest=parts.rest)


def run_shape(run_dir: str, config: dict | None, plan) -> RunShape:
    """The run's model and layout from its config.json's contents, its last step's time from metrics.jsonl."""
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
    step_time = float(rows[-1]["step_time_s"]) if rows else None  # trace.json is the last step's
    sharding = Sharding(tp=int(par.get("tp", 1)), sequence_parallel=bool(par.get("sequence_parallel", False)))
    return RunShape(model, sharding, str(par.get("recompute", "none")), int(par.get("microbatch_size", 1)),
                    tuple(layers), tuple(plan.stage_to_rank), step_time,
                    {"precision": config.get("runtime", {}).get("precision")})
