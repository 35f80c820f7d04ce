"""The plan a run executes, from its config: the schedule registry's, a schedule file's, or the synthesizer's
(auto, auto-v) for the stages' costs, measured or estimated from the model's shape; and its forward-only
evaluation plan. Torch-free: the driver builds it once, and a restart's elastic layout asks it which layouts
build and how fast they are predicted to run.
"""
from __future__ import annotations

from dataclasses import replace

from pipegpt.config import ConfigError, TrainConfig
from pipegpt.model.partition import partition_layers
from pipegpt.costs.balance import stage_costs
from pipegpt.costs.devices import LATENCY_INTRA_S
from pipegpt.parallelisms import stage_parallelism
from pipegpt.schedule import (SCHEDULES, Kind, Plan, ScheduleError, add_reduce_grad, add_unshard_reshard, lower,
                              schedule_spec, validate, without_reduce_grad, without_unshard_reshard)
from pipegpt.schedule.schedule_file import check_against_file, load_schedule_file
from pipegpt.schedule.simulate import ASSUMED_LATENCY_FORWARDS, Costs, assumed_latency, lowered


def make_plan(cfg: TrainConfig) -> Plan:
    """The lowered, validated plan every worker executes: from the schedule registry or a schedule file; with
    data or context parallelism each stage's REDUCE_GRAD in it (where a schedule file has none: after the stage's
    last B or W), with one replica and one cp rank none; with --zero 3 each stage's UNSHARD/RESHARD by the
    --unshard policy (where a schedule file has none), below it none."""
    plan = _pipeline_plan(cfg)
    try:
        averaged = stage_parallelism(cfg.parallel.sharding).gradient_ranks > 1  # averaged over dp x cp
        plan = validate(add_reduce_grad(plan)) if averaged else without_reduce_grad(plan)
        if cfg.parallel.zero >= 3:
            return validate(add_unshard_reshard(plan, cfg.parallel.unshard or "step"))
        _refuse_file_gathers(plan, cfg)
        return without_unshard_reshard(plan)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None


def _refuse_file_gathers(plan: Plan, cfg: TrainConfig) -> None:
    """A schedule file's UNSHARD/RESHARD below --zero 3 would be dropped unseen: the user wrote them for a reason."""
    if cfg.parallel.schedule_file is None:
        return
    gathers = [str(a) for acts in plan.ranks for a in acts if a.kind in (Kind.UNSHARD, Kind.RESHARD)]
    if gathers:
        raise ConfigError(f"schedule file {cfg.parallel.schedule_file} gathers parameters ({gathers[0]}), and --zero "
                          f"is {cfg.parallel.zero}: UNSHARD and RESHARD are ZeRO-3's; give --zero 3, or remove them "
                          f"from the file")


def _pipeline_plan(cfg: TrainConfig) -> Plan:
    p = cfg.parallel
    apart = p.overlap == "off"  # each pair's halves one after the other, lowered as such
    try:
        if p.schedule_file is not None:
            plan = load_schedule_file(p.schedule_file)
            check_against_file(plan, p.schedule_file, p.stages, p.microbatches)
            plan = plan.flattened() if apart else plan
            return plan if plan.is_lowered else validate(lowered(plan, lowering_costs(cfg, plan.stage_to_rank)))
        spec = schedule_spec(p.schedule)
        if not spec.synthesized:
            if p.max_live is not None:
                raise ConfigError(f"--max-live is the memory limit auto and auto-v schedule to; {p.schedule} is a "
                                  f"fixed schedule: use --schedule auto or auto-v, or leave --max-live out")
            plan = spec.build(p.stages, p.microbatches, p.virtual_stages)
        else:
            plan = synthesized_plan(cfg, spec)
        plan = plan.flattened() if apart else plan
        return validate(lowered(plan, lowering_costs(cfg, plan.stage_to_rank)))
    except ScheduleError as e:
        raise ConfigError(str(e)) from None


def synthesized_plan(cfg: TrainConfig, spec) -> Plan:
    """auto / auto-v: the order written for the stages' costs (measured on the workers once they start; until
    then estimated from the model's shape), their split and --max-live. The plan's meta holds the prediction."""
    p, m = cfg.parallel, cfg.model
    placement = spec.stage_to_rank(p.stages, p.virtual_stages)
    layers = [len(r) for r in partition_layers(m.n_layer, len(placement), p.layers_per_stage)]
    costs = stage_costs_for(layers, p.schedule_costs or estimated_layer_costs(m))
    matching = "order" if order_matched(cfg) else "tag"  # written for NCCL's order where the run is known to use it
    synthesis = spec.synthesize(p.stages, p.microbatches, p.virtual_stages, costs, p.max_live, matching=matching)
    meta = {**synthesis.plan.meta, "predicted_s": float(synthesis.makespan),
            "lower_bound_s": float(synthesis.lower_bound), "best_fixed": synthesis.best_fixed,
            "best_fixed_s": None if synthesis.best_fixed_makespan is None else float(synthesis.best_fixed_makespan),
            "measured": p.schedule_costs is not None}
    return replace(synthesis.plan, meta=meta)


def order_matched(cfg: TrainConfig) -> bool:
    """Whether the run's messages are known to match by order (NCCL, or --p2p-matching order), not by tag."""
    r = cfg.runtime
    return r.p2p_matching == "order" or (r.p2p_matching == "auto" and r.device == "cuda")


def lowering_costs(cfg: TrainConfig, stage_to_rank) -> Costs | None:
    """The per-stage costs the plan's messages are placed for (schedule.lowering): what the run measured
    (auto's order, --balance cost's split), auto's estimate until then; None (unit costs) otherwise.

    Where messages match by order (NCCL, or --p2p-matching order), the costs carry a latency, with which the
    lowering places each message on the timeline of messages matched by tag, where order matching costs what tag
    matching does (schedule.lowering). Measured costs on a GPU are seconds: the intra-node latency of
    pipegpt.costs.devices (NCCL's typical, every preset's). Elsewhere (unit or estimated costs, which have no
    unit, or gloo, whose latency is not known before a run's trace measures it) ASSUMED_LATENCY_FORWARDS of a
    rank's forward, over unit costs where there are none. Tag-matched runs lower as for none."""
    p = cfg.parallel
    pieces = p.schedule_costs
    if pieces is None and p.balanced_costs is not None:  # forward + backward of each piece: B = 2F, W = F
        pieces = tuple(x for total in p.balanced_costs for x in (total / 3, 2 * total / 3, total / 3))
    measured = pieces is not None
    if pieces is None and p.schedule_file is None and schedule_spec(p.schedule).synthesized:
        pieces = estimated_layer_costs(cfg.model)
    if not order_matched(cfg):
        return None if pieces is None else _stage_costs(cfg, stage_to_rank, pieces)
    if measured and cfg.runtime.device == "cuda":
        return replace(_stage_costs(cfg, stage_to_rank, pieces), comm=LATENCY_INTRA_S)
    if pieces is None:
        return assumed_latency(stage_to_rank)
    costs = _stage_costs(cfg, stage_to_rank, pieces)
    return replace(costs, comm=ASSUMED_LATENCY_FORWARDS * sum(costs.forward) / (max(stage_to_rank) + 1))


def _stage_costs(cfg: TrainConfig, stage_to_rank, pieces: tuple[float, ...]) -> Costs:
    layers = [len(r) for r in partition_layers(cfg.model.n_layer, len(stage_to_rank), cfg.parallel.layers_per_stage)]
    return stage_costs_for(layers, pieces)


def stage_costs_for(layers: list[int], layer_costs: tuple[float, ...], tp: int = 1) -> Costs:
    """Per-stage F, B and W for a split of the layers, from the pieces' (embedding, block, head) forward,
    backward and weight-gradient costs (schedule_costs' nine numbers)."""
    n = sum(layers)
    per = [stage_costs(layers, [layer_costs[3 + k]] * n, layer_costs[k], layer_costs[6 + k]) for k in range(3)]
    return Costs(*(tuple(x / tp for x in column) for column in per))


def estimated_layer_costs(m) -> tuple[float, ...]:
    """Relative forward, backward and weight-gradient costs before anything is measured: a block's matmuls
    (12 d^2 per token, plus attention's 2 d x seq), the head's d x vocab, the embedding a lookup (nearly
    free); B = 2F, W = F."""
    block, head = 12 * m.n_embd ** 2 + 2 * m.n_embd * m.seq_len, m.n_embd * m.vocab_size
    return 0.01 * block, 0.02 * block, 0.01 * block, block, 2 * block, block, head, 2 * head, head


def synthesis_line(plan: Plan) -> str:
    """What the driver says about a synthesized plan: predicted step beside the best fixed schedule's."""
    meta = plan.meta
    fixed = (f"best fixed schedule {meta['best_fixed']} {meta['best_fixed_s'] * 1e3:.1f} ms"
             if meta.get("best_fixed") else "no fixed schedule of this placement fits")
    chosen = meta.get("from")
    # No synthesized order beat a fixed schedule: say which one runs, so a user need not wonder what auto did.
    order = f" = {chosen}'s order" if chosen and chosen != "synthesized" else ""
    return (f"pipegpt: schedule {plan.name}{order} (max live {meta['max_live']}): predicted compute "
            f"{meta['predicted_s'] * 1e3:.1f} ms "
            f"per step, {fixed}; lower bound {meta['lower_bound_s'] * 1e3:.1f} ms "
            f"(gap {100 * (meta['predicted_s'] / meta['lower_bound_s'] - 1):.1f}%)")


def evaluation_plan(plan: Plan) -> Plan:
    """The training plan's forwards alone, lowered: validation runs through the same runtime (gathering each
    stage's parameters once where the training plan gathers them: ZeRO-3)."""
    forward = lower(plan.compute_only().forward_only())
    sharded = any(a.kind is Kind.UNSHARD for acts in plan.ranks for a in acts)
    return validate(add_unshard_reshard(forward) if sharded else forward)


def check_layers_fill(cfg: TrainConfig, plan: Plan) -> None:
    """With several model stages per rank (interleaved, V shapes), too few layers is said in the terms given:
    stages x stages per rank, and the settings that would fit."""
    n, stages, ranks = cfg.model.n_layer, plan.num_stages, plan.num_ranks
    if stages <= ranks or n >= stages or cfg.parallel.layers_per_stage is not None:
        return
    per_rank = stages // ranks
    spec = SCHEDULES.get(cfg.parallel.schedule) if cfg.parallel.schedule_file is None else None
    fits = [f"--stages {n // per_rank}"] if n // per_rank >= 1 else []
    if spec is not None and spec.takes_virtual_stages and n // ranks >= 1:
        fits.append(f"--virtual-stages {n // ranks}")
    fits.append(f"at least {stages} layers")
    raise ConfigError(f"n_layer={n} is fewer than the {stages} model stages to fill ({ranks} ranks x {per_rank} "
                      f"stages each, {plan.name}): use {', '.join(fits[:-1] + [''])}or {fits[-1]}"
                      .replace(": use or ", ": use "))
