"""How many bytes one rank of a layout needs: weights, gradients, optimizer state, activations,
communication buffers. Pure arithmetic on shapes (no torch), exact where it can be, and checked
against pipegpt's real modules and a measured replay (tests/unit/test_plan_memory.py).

    parameter_count(model, layers, embed, head, tp)     parameters of one stage's slice, per tp rank
    state_bytes(model, stages, sharding, precision)     weights, gradients, AdamW state of one rank
    activation_bytes(model, layers, microbatch_size=.., sharding=.., ...)
                                                        what one stage keeps per microbatch in flight
    deferred_bytes(...)                                 what it keeps between an I and its W
    workspace_bytes(...)                                its actions' transients (an estimate)
    stage_activation_bytes(model, layers_per_stage, ...) the three for every stage
    activation_peaks(plan, saved, deferred, workspace)  each rank's (held, working) peak, walking its
    peak_activation_bytes(plan, saved, deferred)        actions / the held one alone
    plan_memory(model, plan, layers_per_stage, ...)     MemoryBreakdown of every rank / of one
    rank_memory(model, plan, layers_per_stage, rank, ...)

Context parallelism: a cp rank holds its stage's whole weights and L = seq_len/cp tokens of every sequence
(pipegpt.costs.activations); gradients are averaged, and ZeRO-1 shards the optimizer state, over the dp x cp
ranks of a stage (gradient_group, read from pipegpt.parallelisms), so the data-parallel gradient copy exists
whenever dp x cp > 1.

Layer kinds: every per-block term (parameters, activations, deferred bytes; a workspace's largest block) is each
layer's at its kind's block shape (pipegpt.arch.layer_kinds), summed over the slice's layers: a slice is then a
range of layers (plan_memory makes ranges of a split's counts); a count stands for one only where every layer is
alike.

A planner calls plan_memory (or rank_memory) per candidate layout: everything that depends only on
shapes is cached, and the peaks walk each rank's actions once (well under a millisecond per call for
GPT-2 sizes); the message count lowers each plan once (cached per plan). A layout's tp, sequence
parallelism, dp and ZeRO come as one pipegpt.dims.Sharding.

Precision ("precision" below): "fp32" (dtype float32), "bf16" (autocast; float32 master weights,
gradients and AdamW moments) or "fp64" (dtype float64: everything 8 bytes). memory_precision()
maps a run's (precision, dtype) to it.

Parameters (exact)
------------------
One stage's slice holds, per tp rank t of tp (shapes as pipegpt.tensor_parallel shards them): the
embedding wte [Vp/tp, h] (Vp: the padded vocabulary) and wpe [seq_len, h] (replicated); per block
ln1, ln2 (weight, bias: replicated), attn.qkv [3h/tp, h] + bias [3h/tp], attn.proj [h, h/tp] + bias
[h] (replicated: added once after the reduce), mlp.fc [4h/tp, h] + bias [4h/tp], mlp.proj
[h, 4h/tp] + bias [h]; the head ln_f and lm_head [Vp/tp, h] (no bias). With tied embeddings a slice
holding both ends shares one tensor, and so does a rank holding both ends of a V-shape
(pipegpt.train.worker makes them one tensor); a head stage on another rank than the embedding keeps its own
copy of wte.

State (exact)
-------------
weights and gradients: 4 bytes per parameter (8 with fp64; bf16 autocast keeps fp32 master weights
and fp32 .grad; a mixture of experts' weights add, at the step's peak, the bf16 cast of the rank's routed
experts that every microbatch shares, 2 bytes per parameter, except under full recomputation). AdamW: exp_avg
and exp_avg_sq, 2 x the parameter bytes (the per-tensor `step` is a
4-byte host scalar, left out). ZeRO (pipegpt.data_parallel) cuts each bucket of a stage's flat buffer
into dp equal chunks, whatever the tensors' boundaries: each dp rank's shard is S = ceil(P/dp) of the rank's P
parameters (a bucket's padding, under dp elements, left out). At the step's peak (between steps in brackets):

    zero 0   weights P         gradients P             moments 2P
    zero 1   weights P         gradients P             moments 2S   (reduced in place: the shard is the rank's chunks)
    zero 2   weights P         gradients P + S  (S)    moments 2S   (the full buffer lives through the backward)
    zero 3   weights S + P (S) gradients P + S  (S)    moments 2S   (--unshard step: the rank's stages gathered)

With --unshard microbatch (zero 3) a stage is gathered around each run of its compute actions and the next run's
gather is posted one run ahead, so at most two of the rank's stages are whole at once: weights S + the two
largest stages. At zero >= 2 a stage's full gradient buffer is freed once its reduce-scatter (after the stage's
last backward of the step) completes: with one microbatch per step at most two stages' full gradients coexist
(S + the two largest), with several an interleaved order runs every stage's first backward before any stage's
last, so all of them live through the step (P + S). A rank of one or two stages holds P either way. The tied
embedding whose two ends are stages of one rank (FSDP per block, a V) is a unit of its own at zero >= 2
(stage_units): whole whenever either end's stage is, its full gradients from the head's backward to the
embedding's, so the bounds add it to the two largest stages' own parameters. Those are bounds over the policy;
on the run's plan, which carries its REDUCE_GRAD, UNSHARD and RESHARD, plan_memory walks the rank's actions as
the runtime runs them instead (walked_zero_state: each kind's peak, to the byte).

Activations, deferred bytes, workspace and the peaks: pipegpt.costs.activations (re-exported here).

Rank totals
-----------
weights + gradients + optimizer + p2p buffers + activations + workspace (dp_buffers, once the gradient copies
the data-parallel reductions made, is 0: they reduce the flat gradient buffer in place). p2p buffers: the most
messages the runtime holds at once (pipegpt.schedule.messages.message_peaks of the lowered plan, b*S*h*c
each, in the compute precision as --p2p-dtype's default; S = s/tp with sequence parallelism, else s): a tensor to send from its compute until the schedule
shows its receiver has it (a later message the receiver posted after receiving it), a received gradient
until its backward. That follows the schedule: under 1F1B a number bounded by the stage count, whatever
the microbatch count; under GPipe every forward output until the first backward acknowledges one.

Not modelled: the CUDA context and the caching allocator's rounding and fragmentation, the optimizer
step's temporaries (foreach AdamW's intermediates over a parameter group), torch.compile's buffers, the
batch of token ids the loader holds for the step (a few KB).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from pipegpt.arch import kv_local_heads, stage_ranges, stage_shapes, uniform  # noqa: F401 (kv_local_heads: callers')
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.dims import Sharding
from pipegpt.parallelisms import stage_parallelism
from pipegpt.schedule.actions import Kind, Plan
from pipegpt.schedule.lowering import lower
from pipegpt.schedule.messages import message_peaks
from pipegpt.schedule.simulate import assumed_latency, lowered

from .experts import EXPERT_PREFIX, expert_ranks, expert_replicas
from .activations import (BOOL, INT64, MEMORY_PRECISIONS, Workspace, _check, _check_positive, _check_tp,  # noqa: F401
                          _count, _mix, _widths, activation_bytes, activation_peaks, check_tp_shapes, deferred_bytes,
                          memory_precision, peak_activation_bytes, stage_activation_bytes, workspace_bytes)


# ---------------------------------------------------------------------------
# Parameters and their state
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def stage_parameter_shapes(model: ModelConfig, layers: int, embed: bool, head: bool,
                           tp: int = 1) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter one tp rank of the slice holds, in GPT.named_parameters order
    (block names without their index). A tied lm_head in a slice that holds the embedding is wte."""
    _check_tp(model, tp)
    return stage_shapes(model, layers, embed, head, tp)


def _layers_key(model: ModelConfig, layers):
    """A slice's layers as the caches above key them: a count where every layer is alike (a range and its
    length are one slice), else the range (a count there raises: it does not say which layers)."""
    _mix(model, layers)
    return _count(layers) if uniform(model) else layers


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def parameter_count(model: ModelConfig, layers, embed: bool, head: bool, tp: int = 1) -> int:
    """Parameters one tp rank of the slice (layers: a count or a range, a range where the model's layers differ)
    holds; see the module docstring."""
    return sum(_numel(shape) for _, shape in stage_parameter_shapes(model, _layers_key(model, layers), embed, head,
                                                                    tp))


def expert_parameter_count(model: ModelConfig, layers) -> int:
    """The routed experts' parameters in a slice, all of them (as one process holds them: whole over tp)."""
    return sum(_numel(shape) for name, shape in stage_parameter_shapes(model, _layers_key(model, layers), False, False)
               if name.startswith(EXPERT_PREFIX))


@dataclass(frozen=True)
class StateBytes:
    parameters: int  # on this rank (a V-shape's tied embedding once)
    weights: int
    gradients: int
    optimizer: int  # AdamW moments; with ZeRO-1 the largest dp rank's share

    def as_dict(self) -> dict:
        return asdict(self)


def gradient_group(sharding: Sharding) -> int:
    """Ranks of a stage that average its gradients, and over which ZeRO shards its state: dp x cp
    (a context-parallel rank holds the same weights and its own tokens, like a replica), as the stage's
    parallelisms say (pipegpt.parallelisms: what the engine and the gradient syncs apply)."""
    return stage_parallelism(sharding).gradient_ranks


@functools.lru_cache(maxsize=4096)
def stage_units(model: ModelConfig, stages: tuple, tp: int = 1) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(each stage's own parameters, its routed experts' among them, the shared tensor's) in elements, for one
    rank holding `stages` ((layers, embed, head), layers as _layers_key gives them). Shared: the tied embedding
    when both ends are stages of the rank (the worker makes them one tensor), a unit of ZeRO's of its own
    (pipegpt.data_parallel.replicas) and in neither stage's count; 0 otherwise."""
    ends = {(embed, head) for _, embed, head in stages}
    share_tied = model.tie_embeddings and any(e for e, _ in ends) and any(h for _, h in ends) \
        and not any(e and h for e, h in ends)
    own, experts, shared = [], [], 0
    for layers, embed, head in stages:
        shapes = stage_parameter_shapes(model, layers, embed, head, tp)
        tied = [_numel(shape) for name, shape in shapes if share_tied and name in ("wte.weight", "lm_head.weight")]
        shared = max([shared, *tied])
        own.append(sum(_numel(shape) for _, shape in shapes) - sum(tied))
        experts.append(sum(_numel(shape) for name, shape in shapes if name.startswith(EXPERT_PREFIX)))
    return tuple(own), tuple(experts), shared


@functools.lru_cache(maxsize=4096)
def _state_bytes(model, stages, sharding: Sharding, precision, between_steps: bool = False, unshard: str = "step",
                 microbatches: int = 2, full_recompute: bool = False) -> StateBytes:
    r, _ = _widths(precision)
    tp, dp, zero = sharding.tp, gradient_group(sharding), sharding.zero
    per_stage, experts, shared = stage_units(model, stages, tp)
    edp, ep = expert_replicas(sharding), expert_ranks(sharding)
    mine = [-(-e // ep) for e in experts]
    # under bf16 the step's one cast of the rank's routed experts, which every microbatch's call shares
    # (pipegpt.model.moe.MoE.expert_weights), from the first forward to the step's end; none kept under full
    # recomputation (a cast per call, which its checkpoint does not keep)
    casts = 2 * sum(mine) if precision == "bf16" and not between_steps and not full_recompute else 0
    if not any(experts) or (edp == dp and ep == 1):  # every parameter alike
        params = sum(per_stage)
        weights, gradients, optimizer = zero_state(per_stage, dp, zero, unshard, microbatches, between_steps, shared)
        return StateBytes(params + shared, weights * r + casts, gradients * r, optimizer * r)
    # experts: 1/ep of them here, their state sharded over edp; the rest over dp x cp
    dense = zero_state([p - e for p, e in zip(per_stage, experts)], dp, zero, unshard, microbatches, between_steps,
                       shared)
    routed = zero_state(mine, edp, zero, unshard, microbatches, between_steps)
    params = shared + sum(p - e + m for p, e, m in zip(per_stage, experts, mine))
    weights, gradients, optimizer = (r * (a + b) for a, b in zip(dense, routed))
    return StateBytes(params, weights + casts, gradients, optimizer)


def zero_state(stage_params: Sequence[int], dp: int, zero: int, unshard: str = "step", microbatches: int = 2,
               between_steps: bool = False, shared: int = 0) -> tuple[int, int, int]:
    """(weights, gradients, AdamW moments) in elements of a rank whose stages hold stage_params, under ZeRO level
    `zero` over dp ranks (see the module docstring's table); shared: a tensor two of the stages compute with, in
    none of stage_params (the tied embedding when both ends are stages of the rank)."""
    params = sum(stage_params) + shared
    if not zero or dp == 1:
        return params, params, 2 * params
    shard = -(-params // dp)
    # the two largest stages: what the microbatch policy keeps whole; and the shared tensor, a unit of its own
    # whole whenever one of its stages is (zero >= 2: gathered with either, its full gradients from the first
    # of their backwards until the last)
    two = sum(sorted(stage_params)[-2:]) + shared
    if zero >= 3:
        weights = shard + (0 if between_steps else two if unshard == "microbatch" else params)
    else:
        weights = params
    if zero >= 2:
        gradients = shard + (0 if between_steps else two if microbatches == 1 else params)
    else:
        gradients = params  # zero 1 reduce-scatters in place: its shard is its chunks of the full buffer
    return weights, gradients, 2 * shard


def walked_zero_state(model: ModelConfig, plan: Plan, rank: int, stages: tuple, sharding: Sharding,
                      precision: str = "fp32") -> tuple[int, int] | None:
    """(weights, gradients) bytes of a ZeRO-2/3 pipeline rank at their peaks over its actions, walked as
    pipegpt.data_parallel runs them, for a plan that carries its collectives (the run's plan: REDUCE_GRAD, and at
    zero 3 UNSHARD/RESHARD; pipegpt.planner.run_plan.make_plan): a unit (a stage's own parameters, the shared
    tensor: stage_units) is whole while a stage that reads it holds an UNSHARD, its full gradients from the first
    backward of a stage that reads it until the rank's next REDUCE_GRAD after its own has settled it. None
    elsewhere (zero_state's bound applies): below zero 2, one replica, experts, a plan without them.
    stages: the rank's (layers, embed, head) as stage_units takes them."""
    walk = _zero_walk(model, plan, rank, stages, sharding)
    if walk is None:
        return None
    r = _widths(precision)[0]
    weights, gradients = zip(*walk)
    return r * max(weights), r * max(gradients)


def _zero_walk(model: ModelConfig, plan: Plan, rank: int, stages: tuple, sharding: Sharding) -> list | None:
    """walked_zero_state's walk: (weights, gradients) elements after each of the rank's actions (flattened), or
    None where it does not apply."""
    dp, zero = gradient_group(sharding), sharding.zero
    actions = plan.flattened().ranks[rank]
    reduce_at = {a.stage: i for i, a in enumerate(actions) if a.kind is Kind.REDUCE_GRAD}
    mine = plan.stages_of(rank)
    if zero < 2 or dp == 1 or set(reduce_at) != set(mine) or (
            zero >= 3 and not any(a.kind is Kind.UNSHARD for a in actions)):
        return None
    own, experts, shared = stage_units(model, stages, sharding.tp)
    if any(experts):
        return None
    size = dict(zip(mine, own))
    reads = {s: [s] for s in mine}
    reduced_with = {s: [s] for s in mine}
    if shared:  # read by both ends; reduced with the one whose gradients complete last (Engine.params_by_stage)
        ends = [s for s in mine if s in (0, plan.num_stages - 1)]
        size["shared"] = shared
        for s in ends:
            reads[s].append("shared")
        reduced_with[max(ends, key=reduce_at.__getitem__)].append("shared")
    params = sum(size.values())
    shard = -(-params // dp)
    holders = {u: set() for u in size}
    full, reducing, backed, out = set(), [], set(), []
    for a in actions:
        kind, s = a.kind, a.stage
        if kind is Kind.UNSHARD:
            for u in reads[s]:
                holders[u].add(s)
        elif kind is Kind.RESHARD:
            for u in reads[s]:
                holders[u].discard(s)
        elif kind is Kind.REDUCE_GRAD:  # the reduce-scatters in flight settle, this stage's start
            full -= set(reducing)
            reducing = reduced_with[s]
        elif kind.is_compute and kind is not Kind.F and s not in backed:
            backed.add(s)
            full.update(reads[s])
        gathered = sum(size[u] for u, h in holders.items() if h)
        out.append((shard + gathered if zero >= 3 else params, shard + sum(size[u] for u in full)))
    return out


def held_levels(plan: Plan, rank: int, saved: Sequence[int], deferred: Sequence[int]) -> list[int]:
    """The activations the rank holds after each of its actions (flattened), as activation_peaks' held walks
    them: an F adds its stage's saved bytes, a B frees them, an I keeps the deferred bytes, a W frees those."""
    change = {Kind.F: lambda s: saved[s], Kind.B: lambda s: -saved[s], Kind.I: lambda s: deferred[s] - saved[s],
              Kind.W: lambda s: -deferred[s]}
    return list(itertools.accumulate(change[a.kind](a.stage) if a.kind in change else 0
                                     for a in plan.flattened().ranks[rank]))


def state_bytes(model: ModelConfig, stages: Sequence[tuple], *, sharding: Sharding = Sharding(),
                precision: str = "fp32", between_steps: bool = False, unshard: str = "step",
                microbatches: int = 2, recompute: str = "none") -> StateBytes:
    """Weights, gradients and AdamW state of one rank holding `stages`, each (layers, embed, head)
    (layers: a count or a range, a range where the model's layers differ), cut over sharding.tp, and over
    dp x cp by ZeRO (sharding.zero): at the step's peak, or what stays between steps. unshard: ZeRO-3's gather
    policy (step or microbatch); microbatches: per step (one lets ZeRO-2/3 free each stage's full gradients early);
    recompute: the layout's (all but full keep the experts' bf16 cast for the step). See the module docstring."""
    _check_positive("dp", sharding.dp)
    key = tuple((_layers_key(model, layers), bool(embed), bool(head)) for layers, embed, head in stages)
    return _state_bytes(model, key, sharding, precision, between_steps, unshard, min(microbatches, 2),
                        recompute == "full")


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank needs at its peak (see the module docstring for what each holds)."""

    rank: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int  # peak of held activations over the step
    workspace: int  # the most one action's transients add on top of the held level (an estimate)
    p2p_buffers: int
    dp_buffers: int  # gradient copies while the dp reductions run: none (they reduce the flat buffer in place)
    overlap_dp: bool = False  # dp_buffers coexist with activations (several stages on the rank)

    @property
    def total(self) -> int:
        pipeline = self.activations + self.workspace
        busy = pipeline + self.dp_buffers if self.overlap_dp else max(pipeline, self.dp_buffers)
        return self.weights + self.gradients + self.optimizer + self.p2p_buffers + busy

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _layer_counts(model: ModelConfig, plan: Plan, layers_per_stage) -> list[int]:
    counts = [_count(x) for x in layers_per_stage]
    if len(counts) != plan.num_stages:
        raise ConfigError(f"layers_per_stage has {len(counts)} entries but the plan has {plan.num_stages} stages")
    if sum(counts) != model.n_layer:
        raise ConfigError(f"layers_per_stage sums to {sum(counts)} but the model has n_layer={model.n_layer}")
    return counts


@functools.lru_cache(maxsize=1024)
def held_messages(plan: Plan, device: str = "cuda") -> tuple[int, ...]:
    """Per rank, the most message buffers the runtime holds at once (sends are posted eagerly off CUDA), the plan
    lowered as a run lowers it: on CUDA (NCCL matches by order) for an assumed latency (planner.run_plan)."""
    if not plan.is_lowered:
        plan = lowered(plan, assumed_latency(plan.stage_to_rank)) if device == "cuda" else lower(plan)
    return tuple(message_peaks(plan, eager_sends=device != "cuda"))


def plan_memory(model: ModelConfig, plan: Plan, layers_per_stage: Sequence, *, microbatch_size: int,
                sharding: Sharding = Sharding(), recompute: str = "none", precision: str = "fp32",
                device: str = "cuda", activations: Sequence[int] | None = None,
                cp_comm: str = "ring", unshard: str = "step") -> list[MemoryBreakdown]:
    """The MemoryBreakdown of every pipeline rank of `plan` (every dp and tp replica of a pipeline
    rank needs the same; with ZeRO-1 the optimizer is the largest dp rank's share). sharding: tp (and
    sequence parallelism), dp and ZeRO; the pipeline is the plan's.

    layers_per_stage: a count or range per stage (pipegpt.stages.partition_layers gives pipegpt's
    default split; not imported here, the stages package loads torch). activations: each
    rank's peak activation bytes if the caller has them (e.g. from a Timeline built with
    Costs(activation_bytes=saved); with I/W that misses what deferred_bytes adds); by default
    activation_peaks' held. workspace: activation_peaks' working less held (cp_comm: how K/V travel with
    sharding.cp > 1, ring or allgather). unshard: ZeRO-3's gather policy (state_bytes).
    """
    _layer_counts(model, plan, layers_per_stage)
    counts = stage_ranges(layers_per_stage)  # which layers each stage holds: their kinds count
    kw = dict(microbatch_size=microbatch_size, sharding=sharding, precision=precision)
    saved, deferred, workspace = stage_activation_bytes(model, counts, recompute=recompute, device=device,
                                                        cp_comm=cp_comm, **kw)
    walked = activation_peaks(plan, saved, deferred, workspace)
    peaks = [held for held, _ in walked] if activations is None else list(activations)
    _, c = _widths(precision)  # messages travel in the compute precision (--p2p-dtype's default)
    message = sharding.tokens_per_rank(model.seq_len, microbatch_size) * model.n_embd * c
    last = plan.num_stages - 1
    messages = held_messages(plan, device)
    out = []
    for rank in range(plan.num_ranks):
        mine = plan.stages_of(rank)
        held = [(counts[s], s == 0, s == last) for s in mine]
        state = state_bytes(model, held, sharding=sharding, precision=precision, unshard=unshard,
                            microbatches=plan.num_microbatches, recompute=recompute)
        zero_walk = walked_zero_state(model, plan, rank, tuple((_layers_key(model, n), e, h) for n, e, h in held),
                                      sharding, precision)
        if zero_walk is not None:  # the run's plan: what its gathers and reductions hold, not the policy's bound
            state = replace(state, weights=zero_walk[0], gradients=zero_walk[1])
        out.append(MemoryBreakdown(
            rank=rank, parameters=state.parameters, weights=state.weights, gradients=state.gradients,
            optimizer=state.optimizer, activations=int(peaks[rank]), workspace=walked[rank][1] - walked[rank][0],
            p2p_buffers=message * messages[rank],
            dp_buffers=0, overlap_dp=len(mine) > 1))
    return out


def held_peak(model: ModelConfig, plan: Plan, layers_per_stage: Sequence, rank: int, **kwargs) -> int:
    """The most bytes the rank holds at one point between its actions (what a count after each action sees:
    pipegpt.observe.tensor_bytes, no action's workspace): its weights and gradients (walked over the run's plan
    where walked_zero_state applies, else their peaks) and the activations it holds after the same action
    (held_levels), with its optimizer state and its messages' peak. plan_memory's total adds each kind's own peak
    and the workspace: a bound above this. kwargs: plan_memory's."""
    x = plan_memory(model, plan, layers_per_stage, **kwargs)[rank]
    counts = stage_ranges(layers_per_stage)
    kw = {k: kwargs[k] for k in ("microbatch_size", "sharding", "precision", "recompute", "device", "cp_comm")
          if k in kwargs}
    saved, deferred, _ = stage_activation_bytes(model, counts, **kw)
    last = plan.num_stages - 1
    stages = tuple((_layers_key(model, counts[s]), s == 0, s == last) for s in plan.stages_of(rank))
    walk = _zero_walk(model, plan, rank, stages, kwargs.get("sharding", Sharding()))
    levels = held_levels(plan, rank, saved, deferred)
    r = _widths(kwargs.get("precision", "fp32"))[0]
    state = [r * (w + g) for w, g in walk] if walk else [x.weights + x.gradients] * len(levels)
    return x.optimizer + x.p2p_buffers + max(a + b for a, b in zip(state, levels))


def rank_memory(model: ModelConfig, plan: Plan, layers_per_stage: Sequence, rank: int, *,
                activations: int | None = None, **kwargs) -> MemoryBreakdown:
    """The MemoryBreakdown of one pipeline rank (kwargs: those of plan_memory); `activations`: its peak
    activation bytes if the caller has them."""
    if activations is not None:
        peaks = [0] * plan.num_ranks
        peaks[rank] = activations
        kwargs["activations"] = peaks
    return plan_memory(model, plan, layers_per_stage, **kwargs)[rank]
