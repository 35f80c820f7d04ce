"""Going on with fewer ranks: the layout a restart takes when a rank's device is gone (--min-ranks).

The global batch stays: tensor parallelism is kept (its groups live inside a node), data-parallel replicas
are kept while a pipeline of at least one stage fits, else halved with twice the microbatches each, and the
pipeline takes the ranks left. Among the layouts that build, the one the simulator predicts fastest wins,
with per-stage costs from the run's measured layer costs (--balance cost, --schedule auto) or, without
them, estimated from the model's shape; the prediction is given relative to the old layout's.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from pipegpt.config import ConfigError, TrainConfig, option_flags


@dataclass(frozen=True)
class Shrunk:
    cfg: TrainConfig
    flags: dict  # the run options that change, as the command line gives them
    ratio: float  # predicted step time over the old layout's


def layout_text(cfg: TrainConfig) -> str:
    p = cfg.parallel
    return f"{p.dims.label(spaced=True)}, {p.schedule}, {p.microbatches} microbatches"


def shrunk_layout(cfg: TrainConfig, ranks: int) -> Shrunk | None:
    """The fastest layout of the same model and global batch on `ranks` ranks (None: none builds). ZeRO 1-3
    shard over the replicas: where none of the layouts that keep them builds, one replica with ZeRO lowered to 0
    does (a checkpoint loads at any ZeRO level); its flags then say --zero 0."""
    p = cfg.parallel
    if p.schedule_file is not None:
        return None  # a schedule file fixes the stages
    return _fastest(cfg, ranks, lower_zero=False) or (_fastest(cfg, ranks, lower_zero=True) if p.zero else None)


def _fastest(cfg: TrainConfig, ranks: int, lower_zero: bool) -> Shrunk | None:
    p = cfg.parallel
    old = _predicted(cfg)
    best = None
    for dp in sorted((d for d in range(1, p.dp + 1) if p.dp % d == 0), reverse=True):
        stage = p.dims._replace(dp=dp, pp=1)  # the ranks of one pipeline position, over every replica
        stages = min(ranks // stage.world_size, cfg.model.n_layer)
        unsharded = p.zero >= 1 and stage.replicas == 1  # ZeRO needs replicas to shard over
        if stages < 1 or (unsharded and not lower_zero):
            continue
        zero = 0 if unsharded else p.zero
        microbatches = p.microbatches * p.dp // dp
        ep = math.gcd(p.ep, dp * p.cp)  # experts spread over what is left of the ranks ep is carved from
        for schedule in dict.fromkeys((p.schedule, "1f1b")):
            changes = dict(stages=stages, dp=dp, microbatches=microbatches, schedule=schedule,
                           virtual_stages=p.virtual_stages if schedule == p.schedule else None,
                           layers_per_stage=None, balanced_costs=None, schedule_costs=p.schedule_costs,
                           balance=p.balance if stages == p.stages else "even", max_live=None,
                           zero=zero, unshard=p.unshard if zero == p.zero else None, ep=ep)
            try:
                candidate = cfg.replace(**changes)
                time = _predicted(candidate)
            except ConfigError:
                continue
            if best is None or time < best[0]:
                given = {name: changes[name] for name in ("stages", "dp", "microbatches", "schedule", "virtual_stages")
                         if changes[name] is not None}  # the restart's command line: flag -> value
                if zero != p.zero:  # None: the flag goes (--unshard is ZeRO-3's)
                    given.update(zero=zero, unshard=None)
                if ep > 1:  # a layout flag: the restart's command line gives it anew
                    given.update(ep=ep)
                best = (time, candidate, {option_flags(name)[0]: value for name, value in given.items()})
            break
    if best is None:
        return None
    return Shrunk(best[1], best[2], best[0] / old)


def _predicted(cfg: TrainConfig) -> float:
    """One replica's simulated step at the run's measured (or estimated) per-layer costs: a relative time."""
    from pipegpt.schedule.simulate import simulate
    from pipegpt.model.partition import partition_layers
    from pipegpt.planner.run_plan import estimated_layer_costs, make_plan, stage_costs_for

    plan = make_plan(cfg)
    m = cfg.model
    layers = [len(r) for r in partition_layers(m.n_layer, plan.num_stages, cfg.parallel.layers_per_stage)]
    costs = stage_costs_for(layers, cfg.parallel.schedule_costs or estimated_layer_costs(m), cfg.parallel.tp)
    return float(simulate(plan.compute_only(), costs).makespan)
