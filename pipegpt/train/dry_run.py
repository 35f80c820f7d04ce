"""`pipegpt run ... --dry-run [DEVICE]`: will this job start, fit and how fast, answered here without a worker.

The settings are checked as a start would check them (pipegpt.train.preflight, leaving out this machine's
devices: the job is meant for others), the plan built and validated, and the planner's cost and memory model
(pipegpt.planner.search.evaluate_layout: the simulator fed with pipegpt.costs) predicts the step and each
pipeline rank's memory on the devices named. Nothing starts: no process, no process group. A job that would not
start, or would not fit in the device's memory, is refused in one line (ConfigError).
"""
from __future__ import annotations

import re
from typing import Callable

from pipegpt.config import ConfigError, TrainConfig
from pipegpt.costs.activations import memory_precision
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import DEVICES, Cluster, format_bytes, make_cluster
from pipegpt.costs.memory import plan_memory
from pipegpt.model.partition import partition_layers
from pipegpt.planner.auto import CPU_RANK, GPU_PRESETS
from pipegpt.planner.candidates import Layout, Request, Result, memory_parts, mesh_name
from pipegpt.planner.report import busiest_line, describe_model, format_count, format_seconds, memory_line
from pipegpt.planner.search import evaluate_layout
from pipegpt.schedule import SCHEDULES, Plan
from pipegpt.schedule.render import text_table

HERE = "here"  # --dry-run without a device: the devices this machine has (a core per rank without a GPU)
PARTS = ("weights", "gradients", "optimizer", "activations", "workspace", "communication")


def dry_run(cfg: TrainConfig, device: str, preset: str, echo: Callable[[str], None],
            gpus_per_node: int | None = None) -> None:
    """Check the job, predict it on `device` (a planner preset: h100, a100-80gb, ...; or HERE) and print the
    answer; ConfigError for a job that would be refused at start-up or does not fit."""
    from pipegpt.train.preflight import check

    plan = check(cfg, devices=False)
    cluster = job_cluster(cfg, device, gpus_per_node)
    timed = predict(cfg, cluster, plan)
    memory = timed.memory if timed is not None else plan_memory_parts(cfg, plan, cluster)
    refuse_overflow(memory, cluster)
    for line in report_lines(cfg, preset, plan, cluster, timed, memory):
        echo(line)


def job_cluster(cfg: TrainConfig, device: str, gpus_per_node: int | None = None) -> Cluster:
    """The machines the job would run on: cfg.world_size devices of the planner's preset `device`, or (HERE)
    this machine's GPU model, or nominal CPU ranks."""
    precision = "bf16" if cfg.runtime.precision == "bf16" else "fp32"
    gpus = cfg.world_size
    if device != HERE and device.lower() not in DEVICES:
        raise ConfigError(f"--dry-run {device}: not a device the planner knows: name one of {', '.join(DEVICES)}, "
                          f"or give --dry-run alone for this machine's")
    if device != HERE:
        return make_cluster(gpus, gpus_per_node, device=device, precision=precision)
    import torch

    if cfg.runtime.device == "cpu" or not torch.cuda.is_available():
        return make_cluster(gpus, gpus_per_node or gpus, precision=precision, reserve=0, name="CPU rank (nominal)",
                            **CPU_RANK)
    name = torch.cuda.get_device_name(0)
    preset = next((p for pattern, p in GPU_PRESETS if re.search(pattern, name.upper())), None)
    if preset is None:
        raise ConfigError(f"--dry-run does not know this machine's GPU {name!r}: name a device, e.g. --dry-run h100")
    return make_cluster(gpus, gpus_per_node, device=preset, precision=precision,
                        gpu_memory=torch.cuda.get_device_properties(0).total_memory)


def predict(cfg: TrainConfig, cluster: Cluster, plan: Plan) -> Result | None:
    """The planner's prediction (time and memory: pipegpt.planner.search.evaluate_layout) for this run's layout,
    its split of the layers and its schedule; None for a plan the planner does not build (auto, a file's)."""
    p, m = cfg.parallel, cfg.model
    name = plan.name if p.schedule_file is not None else p.schedule
    if name not in SCHEDULES or SCHEDULES[name].synthesized:
        return None
    layers = tuple(len(r) for r in partition_layers(m.n_layer, plan.num_stages, p.layers_per_stage))
    layout = Layout(p.dp, p.stages, p.tp, name, plan.num_stages // plan.num_ranks, p.microbatches,
                    p.microbatch_size, p.recompute, p.zero, p.sequence_parallel, layers,
                    p.layers_per_stage is not None, False, p.cp, p.cp_comm,
                    "microbatch" if p.zero >= 3 and p.unshard == "microbatch" else None)
    batch = p.dp * p.microbatches * p.microbatch_size
    return evaluate_layout(Request(m, batch, cluster, AnalyticalCosts(cluster)), layout)


def plan_memory_parts(cfg: TrainConfig, plan: Plan, cluster: Cluster) -> list[dict]:
    """Each pipeline rank's memory by part for a plan the planner does not time (the memory model on the plan)."""
    p, m = cfg.parallel, cfg.model
    ranks = plan_memory(m, plan, partition_layers(m.n_layer, plan.num_stages, p.layers_per_stage),
                        microbatch_size=p.microbatch_size, sharding=p.sharding, recompute=p.recompute,
                        precision=memory_precision(cluster.precision, cfg.runtime.dtype), cp_comm=p.cp_comm,
                        unshard=p.unshard or "step")
    return [memory_parts(x) for x in ranks]


def report_lines(cfg: TrainConfig, preset: str, plan: Plan, cluster: Cluster, r: Result | None,
                 memory: list[dict]) -> list[str]:
    """What a dry run prints: the job, its layout, the plan's summary, the predicted step (r: None, untimed)
    and each pipeline rank's memory."""
    p = cfg.parallel
    batch = p.dp * p.microbatches * p.microbatch_size
    per_rank = plan.num_stages // plan.num_ranks
    layers = [len(x) for x in partition_layers(cfg.model.n_layer, plan.num_stages, p.layers_per_stage)]
    zero = f"{p.zero} ({p.unshard or 'step'})" if p.zero >= 3 else str(p.zero)
    spec = SCHEDULES.get(p.schedule)
    v = f" v{per_rank}" if spec and spec.takes_virtual_stages and (per_rank > 1 or not spec.synthesized) else ""
    lines = [f"pipegpt: dry run, nothing started: {preset}, {describe_model(cfg.model)}",
             f"devices: {cluster.describe()}",
             f"layout: {mesh_name(p.sharding, {'cp': p.cp_comm})}{' sp' * p.sequence_parallel}, {cfg.world_size} "
             f"ranks; {p.schedule}{v}, {p.microbatches} microbatches x {p.microbatch_size} "
             f"sequence{'s' * (p.microbatch_size > 1)} x {cfg.model.seq_len} tokens (global batch {batch:,} "
             f"sequences); recompute {p.recompute}; ZeRO {zero}; "
             f"layers per stage {','.join(map(str, layers))}",
             f"plan: {plan.name}, {plan.num_ranks} pipeline ranks x {per_rank} stage{'s' * (per_rank > 1)}, "
             f"{sum(len(acts) for acts in plan.ranks):,} actions: valid"]
    if r is None:
        lines.append(f"predicted step: not timed (the planner times the fixed schedules, not {plan.name}'s order): "
                     f"`pipegpt simulate --schedule-file` with the run's plan.txt")
    else:
        lines += [f"chart: makespan {format_seconds(r.makespan)}, bubble {100 * r.bubble:.1f}% (the planner's "
                  f"costs; `pipegpt simulate` draws it)",
                  f"predicted step: {format_seconds(r.step_time)} ({format_seconds(r.after)} after the last action), "
                  f"{format_count(r.tokens_per_s)} tokens/s" + ("" if r.mfu is None else f", MFU {100 * r.mfu:.1f}%"),
                  f"  {busiest_line(r)}"]
    lines.append(f"memory per {cluster.unit} on each pipeline rank (its dp x cp x tp {cluster.unit}s alike), against "
                 f"{format_bytes(cluster.usable_bytes)} usable:")
    rows = [["rank", *PARTS, "total", "of usable"]]
    for rank, parts in enumerate(memory):
        rows.append([rank, *(format_bytes(parts.get(k, 0)) for k in PARTS), format_bytes(parts["total"]),
                     f"{100 * parts['total'] / cluster.usable_bytes:.0f}%"])
    lines += ["  " + row for row in text_table(rows, right=set(range(len(rows[0]))), rule=True).splitlines()]
    fullest = max(range(len(memory)), key=lambda k: memory[k]["total"])
    nodes = -(-cfg.world_size // cluster.gpus_per_node)
    where = (f"torchrun --nnodes {nodes} --nproc-per-node {cluster.gpus_per_node} ... -m pipegpt run ..."
             if nodes > 1 else "the same command without --dry-run")
    lines.append(f"fits: the fullest (pipeline rank {fullest}) holds {format_bytes(memory[fullest]['total'])} of "
                 f"{format_bytes(cluster.usable_bytes)}; run it with {where}")
    return lines


def refuse_overflow(memory: list[dict], cluster: Cluster) -> None:
    """A job whose fullest rank needs more than the device's usable memory: one line, its parts named."""
    fullest = max(range(len(memory)), key=lambda k: memory[k]["total"])
    if memory[fullest]["total"] <= cluster.usable_bytes:
        return
    raise ConfigError(f"does not fit in the device's memory: pipeline rank {fullest} needs "
                      f"{format_bytes(memory[fullest]['total'])} > {format_bytes(cluster.usable_bytes)} usable on "
                      f"{cluster.name} ({memory_line(memory[fullest])}): use more pipeline stages, --zero, "
                      f"--recompute, a smaller --microbatch-size, or ask `pipegpt plan`")
