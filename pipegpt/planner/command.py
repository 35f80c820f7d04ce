"""`pipegpt plan`'s work: the global batch, the cluster and the costs from the command's options, the
search, and its answer as text or JSON (or, with --try, the top plans run and measured)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from pipegpt.config import CP_COMM, ConfigError, ModelConfig, nearest_multiples, validate_cp
from pipegpt.dims import AXES
from pipegpt.schedule.registry import schedule_names

from .candidates import Request
from pipegpt.costs.calibrated import calibrate_costs
from pipegpt.costs.cost import DEFAULT_EFFICIENCY, DEFAULT_LAYER_OVERHEAD_S, AnalyticalCosts
from pipegpt.costs.devices import make_cluster
from pipegpt.costs.experts import DEFAULT_MOE_IMBALANCE, check_ep
from .report import as_json, format_text, no_fit_message, rank_ties
from .search import search
from .trial import trials_dir, trials_text, try_plans


@dataclass(frozen=True)
class PlanOptions:
    """`pipegpt plan`'s options besides the model's shape, named as the command names them (None: not given)."""

    gpus: int
    batch_size: int | None = None
    batch_tokens: int | None = None
    gpus_per_node: int | None = None
    device: str | None = None
    gpu_memory: str | None = None
    reserve: str | None = None
    gpu_tflops: float | None = None
    intra_node_gbps: str | None = None
    inter_node_gbps: str | None = None
    precision: str = "bf16"
    efficiency: float | None = None
    layer_overhead_us: float | None = None
    calibrate_dir: str | None = None
    schedules: str = "all"
    all_gpus: bool = False
    only_dp: int | None = None  # only_<axis> (pipegpt.dims.AXES): only layouts of that size along it
    only_pp: int | None = None
    only_tp: int | None = None
    only_cp: int | None = None
    cp_comm: str | None = None  # None: the planner's (the ring)
    only_ep: int | None = None  # expert parallelism (carved out of dp x cp x tp, not one of AXES)
    moe_imbalance: float | None = None  # None: pipegpt.costs.experts.DEFAULT_MOE_IMBALANCE
    moe_dispatcher: str | None = None  # None: alltoall, what pipegpt run dispatches with (deepep: a what-if)
    only_zero: int | None = None
    top: int = 5
    explain: bool = False
    try_top: int | None = None
    try_steps: int = 5
    try_device: str = "auto"
    try_dir: str | None = None
    as_json: bool = False


def plan_command(model: ModelConfig, opts: PlanOptions) -> str:
    """The best plans for this model on the cluster the options describe, as the command prints them."""
    batch_size = global_batch(model, opts.batch_size, opts.batch_tokens)
    cluster = make_cluster(opts.gpus, opts.gpus_per_node, opts.device, opts.gpu_memory, opts.gpu_tflops,
                           opts.intra_node_gbps, opts.inter_node_gbps, opts.precision, reserve=opts.reserve)
    if opts.calibrate_dir is not None:
        if opts.efficiency is not None or opts.layer_overhead_us is not None:
            raise ConfigError("--calibrate takes the compute from the run: leave out --efficiency and "
                              "--layer-overhead-us")
        costs = calibrate_costs(opts.calibrate_dir, cluster)
        if opts.moe_imbalance is not None:
            costs.moe_imbalance = AnalyticalCosts(cluster, moe_imbalance=opts.moe_imbalance).moe_imbalance
    else:
        costs = AnalyticalCosts(cluster, DEFAULT_EFFICIENCY if opts.efficiency is None else opts.efficiency,
                                DEFAULT_LAYER_OVERHEAD_S if opts.layer_overhead_us is None
                                else opts.layer_overhead_us * 1e-6,
                                DEFAULT_MOE_IMBALANCE if opts.moe_imbalance is None else opts.moe_imbalance)
    if opts.moe_dispatcher is not None:
        if not model.n_experts:
            raise ConfigError(f"--moe-dispatcher {opts.moe_dispatcher} on a model without experts (n_experts=0): "
                              f"leave it out")
        costs.moe_dispatcher = AnalyticalCosts(cluster, moe_dispatcher=opts.moe_dispatcher).moe_dispatcher
    if opts.moe_imbalance is not None and not model.n_experts:
        raise ConfigError(f"--moe-imbalance {opts.moe_imbalance:g} on a model without experts (n_experts=0): "
                          f"leave it out")
    if opts.only_ep is not None:
        check_ep(model, opts.only_ep, opts.only_dp, opts.only_cp or 1, opts.only_tp)
    if opts.only_cp is not None:
        validate_cp(model, opts.only_cp)
        if opts.only_cp > opts.gpus:
            raise ConfigError(f"--cp {opts.only_cp} is more context-parallel ranks than the {opts.gpus} GPUs: "
                              f"use at most {opts.gpus}")
    if opts.cp_comm is not None and opts.cp_comm not in CP_COMM:
        raise ConfigError(f"--cp-comm {opts.cp_comm!r} is not valid: use {' or '.join(CP_COMM)}")
    request = Request(model, batch_size, cluster, costs, top=opts.top, explain=opts.explain,
                      schedules=tuple(schedule_names(opts.schedules, synthesized=False)), exact_gpus=opts.all_gpus,
                      only={axis: getattr(opts, f"only_{axis}") for axis in AXES + ("ep",)
                            if getattr(opts, f"only_{axis}") is not None}, cp_comm=opts.cp_comm,
                      zero=opts.only_zero)
    result = search(request)
    result = replace(result, best=rank_ties(result.best))  # ties within 1% go to the simplest plan
    if not result.best:
        raise ConfigError(no_fit_message(result))
    if not opts.try_top:
        return json.dumps(as_json(result)) if opts.as_json else format_text(result)
    best = result.best[:opts.try_top]
    tried = try_plans(best, opts.precision, opts.try_steps, opts.try_device, trials_dir(opts.try_dir))
    if opts.as_json:
        return json.dumps({**as_json(result), "tried": tried})
    return format_text(result) + "\n\n" + trials_text(best, tried, opts.try_steps)


def global_batch(model: ModelConfig, batch_size: int | None, batch_tokens: int | None) -> int:
    """Sequences per step from --batch-size or --batch-tokens (exactly one of them)."""
    if (batch_size is None) == (batch_tokens is None):
        raise ConfigError("give the global batch as --batch-size SEQUENCES or --batch-tokens TOKENS (one of them)")
    if batch_tokens is not None:
        if batch_tokens < 1 or batch_tokens % model.seq_len:
            raise ConfigError(f"--batch-tokens {batch_tokens} is not a whole number of sequences of seq_len="
                              f"{model.seq_len}: use {nearest_multiples(batch_tokens, model.seq_len)}")
        batch_size = batch_tokens // model.seq_len
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1 sequence")
    return batch_size
