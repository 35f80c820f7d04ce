"""The calibrated model (CalibratedCosts, `pipegpt plan --calibrate RUN_DIR`): pipegpt.costs.cost's shapes, with each
block's F, B and W scaled by measured / analytical (each stage's layers at their kinds' blocks: the middle stages'
where there are any, else the lower of the two ends' ratios) over the stages of a run's trace
(pipegpt.costs.calibrated reads the run, pipegpt.schedule.calibrate calibrates it), what the first and the last
stage measure beyond that as the embedding's and the head's extra time per token, the message latency the run
measured, no host floor per layer but the host's time between a rank's computes, measured apart, once per forward
and backward of a stage (host_s). Outside the actions, from the traced step's parts (pipegpt.observe.step_time): the
optimizer per byte of the busiest rank's fp32 parameters, and the rest (the driver's round trip, the batch, the
clip; the sync's tail on one replica) as a time per step (per_step_time); a trace without parts gives what the run
spent after its last action (step time - trace span) per parameter of the busiest rank. Collectives stay analytical
(a trace shows no separate collective times).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipegpt.arch import layer_kinds, layer_mix, stage_ranges
from pipegpt.config import ModelConfig
from pipegpt.dims import Sharding

from .cost import FP32, AnalyticalCosts, Piece, Shape
from .devices import Cluster


class CalibratedCosts(AnalyticalCosts):
    """AnalyticalCosts whose compute is scaled per kind to a measured run (see the module docstring)."""

    kind = "calibrated"

    def __init__(self, cluster: Cluster, scale_f: float, scale_b: float, scale_w: float, message_s: float,
                 after_per_param_s: float, source: str = "", notes: tuple = (),
                 optimizer_s_per_byte: float | None = None, per_step_s: float = 0.0, host_s: float = 0.0):
        super().__init__(cluster, efficiency=1.0, layer_overhead_s=0.0)
        self.scale_f, self.scale_b, self.scale_w = scale_f, scale_b, scale_w
        self.message_s, self.after_per_param_s, self.source, self.notes = message_s, after_per_param_s, source, notes
        # from the trace's step parts (StepTimes); without them (an older trace) all that follows the last
        # action is after_per_param_s per parameter of the busiest rank
        self.optimizer_s_per_byte, self.per_step_s = optimizer_s_per_byte, per_step_s
        # the host's time between two computes (message batches, the dispatch), per forward and backward: a
        # microbatch twice the size or a stage with twice the layers spends it once
        self.host_s = host_s
        # seconds per token of the first and the last stage's measured F, B, W beyond what the scaled FLOP model
        # gives them (the embedding's and the head's, the loss's): set by fit_calibrated_costs
        self.embed_extra, self.head_extra = (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)
        # a CPU run's compute at other threads per rank, other microbatch sizes than its own: set by
        # pipegpt.costs.calibrated
        self.threads = self.microbatch = None

    def describe(self) -> str:
        text = (f"calibrated from {self.source}: compute x{self.scale_f:.3g} (F), x{self.scale_b:.3g} (B), "
                f"x{self.scale_w:.3g} (W) of the FLOP model at peak; {self.message_s * 1e3:.3g} ms per message")
        if any(self.embed_extra + self.head_extra):
            text += (f"; first / last stage +{self.embed_extra[0] * 1e6:.3g} / +{self.head_extra[0] * 1e6:.3g} (F), "
                     f"+{self.embed_extra[1] * 1e6:.3g} / +{self.head_extra[1] * 1e6:.3g} (B) ms per 1k tokens")
        if self.optimizer_s_per_byte is not None:
            text += (f"; optimizer {self.optimizer_s_per_byte * 1e9:.3g} ms per MB of fp32 parameters; "
                     f"{self.per_step_s * 1e3:.3g} ms a step besides (round trip, batch, clip)")
        if self.host_s:
            text += f"; {self.host_s * 1e3:.3g} ms of the host's before each F and B"
        for scaling in (self.threads, self.microbatch):
            if scaling is not None:
                text += f"; {scaling.describe()}"
        return text

    def compute(self, model: ModelConfig, shape: Shape) -> tuple[Piece, Piece, Piece]:
        out = []
        tokens = shape.sharding.tokens_per_rank(model.seq_len, shape.mbs)
        for p, extra in zip(super().compute(model, shape), ((0.0, 0.0, 0.0), self.embed_extra, self.head_extra)):
            f, b, w = (max(0.0, x * scale + e * tokens) for x, scale, e in
                       zip((p.f, p.b, p.w), (self.scale_f, self.scale_b, self.scale_w), extra))
            out.append(Piece(f, b, min(w, b)))
        return tuple(out)

    def message_time(self, nbytes: float, same_node: bool) -> float:
        return self.message_s

    def attention_time(self, flops: float) -> float:
        return super().attention_time(flops) * self.scale_f  # the forward's measured speed

    def expert_weight_bytes(self, block: ModelConfig, ep: int) -> tuple[float, float, float]:
        return 0.0, 0.0, 0.0  # the measured compute holds the run's own memory traffic

    def optimizer_time(self, params: float, tensors: int) -> float:
        if self.optimizer_s_per_byte is not None:
            return params * FP32 * self.optimizer_s_per_byte
        return params * self.after_per_param_s

    def per_step_time(self) -> float:
        return self.per_step_s

    def host_per_action(self) -> float:
        return self.host_s

    def compute_scale(self, sharding, mbs: int) -> float:
        ranks = min(sharding.world_size, self.cluster.gpus_per_node)  # the ranks of one machine
        k = 1.0 if self.threads is None else self.threads.scale(ranks)
        return k if self.microbatch is None else k * self.microbatch.scale(ranks, mbs)

    def optimizer_scale(self, sharding) -> float:
        if self.threads is None or self.optimizer_s_per_byte is None:
            return 1.0
        return self.threads.optimizer_scale(min(sharding.world_size, self.cluster.gpus_per_node))



@dataclass
class RunShape:
    """What a run directory says about the run: its model and layout."""

    model: ModelConfig
    sharding: Sharding  # tp and sequence parallelism
    recompute: str
    mbs: int
    layers: tuple
    stage_to_rank: tuple
    step_time_s: float | None
    extra: dict = field(default_factory=dict)


def _block_scale(measured: list, predicted: list) -> float:
    """Measured over the FLOP model's time of a block: over the middle stages (blocks only) where there are any;
    else the lower of the two stages' ratios, so that neither the embedding's nor the head's extra is negative
    (one stage: its ratio)."""
    ratio = [m / p if p > 0 else 1.0 for m, p in zip(measured, predicted)]
    if len(ratio) > 2:
        middle = sum(predicted[1:-1])
        return sum(measured[1:-1]) / middle if middle > 0 else 1.0
    return min(ratio)


@dataclass
class StepTimes:
    """A traced step's time outside its actions, in seconds (pipegpt.schedule.calibrate's breakdown): the
    optimizer's part on the busiest rank, the gradient sync's tail, and all the rest (the driver's round trip,
    the batch, the clip, the end of the step)."""

    optimizer: float
    sync: float
    rest: float


def fit_calibrated_costs(cluster: Cluster, run: RunShape, measured, makespan: float, params_per_rank: list,
                         source: str, parts: StepTimes | None = None, replicas: int = 1,
                         zero: int = 0, host: float = 0.0) -> CalibratedCosts:
    """CalibratedCosts for a run of this shape whose trace calibrated to `measured` (a schedule.simulate.Costs:
    per-stage F, B, W and the message latency) over a step span of `makespan`: each block's F, B and W scaled by
    _block_scale, the first and the last stage's measured rest as the embedding's and the head's extra time per
    token, and what the step spent after its last action per parameter of the busiest rank.

    With the traced step's `parts` besides, the optimizer is a time per byte of the busiest rank's fp32 parameters
    (with ZeRO, 1/replicas of them: its shard) and the rest a time per step;
    the sync's tail counts there too on one replica (no data-parallel reduction for the model to charge it to).
    `host`: the host's time per compute, which `measured` does not hold (Calibration.compute, Calibration.host):
    charged once per forward and backward, not per token."""
    unit = AnalyticalCosts(cluster, efficiency=1.0, layer_overhead_s=0.0)
    shape = Shape(run.sharding, run.recompute, run.mbs)
    _, embed, head = unit.compute(run.model, shape)
    blocks = {kind: unit.compute(kind.block_model(run.model), shape)[0]
              for kind in dict.fromkeys(layer_kinds(run.model))}
    S = len(run.layers)
    predicted = {"f": [], "b": [], "w": []}
    for s, layers in enumerate(stage_ranges(run.layers)):  # each layer at its kind's block
        for part in predicted:
            x = sum(n * getattr(blocks[kind], part) for kind, n in layer_mix(run.model, layers))
            x += getattr(embed, part) if s == 0 else 0.0
            x += getattr(head, part) if s == S - 1 else 0.0
            predicted[part].append(x)
    measured_of = {"f": measured.forward, "b": measured.backward, "w": measured.weight}
    scale = {k: _block_scale(measured_of[k], predicted[k]) for k in predicted}
    # What the first and the last stage measure beyond the blocks' scale is the embedding's and the head's (per
    # token): the FLOP model sees little of the loss, the logits' traffic, the embedding's scatter.
    tokens = run.sharding.tokens_per_rank(run.model.seq_len, run.mbs)
    extra = {end: tuple((measured_of[k][s] - scale[k] * predicted[k][s]) / tokens if S > 1 else 0.0
                        for k in ("f", "b", "w")) for end, s in (("embed", 0), ("head", S - 1))}
    notes = []
    after = 0.0
    if run.step_time_s is not None:
        after = max(0.0, run.step_time_s - float(makespan))
    else:
        notes.append("no metrics.jsonl: nothing after the last action is counted")
    per_param = after / max(params_per_rank) if max(params_per_rank) else 0.0
    per_byte, per_step = None, 0.0
    if parts is not None and max(params_per_rank):
        per_byte = parts.optimizer / (max(params_per_rank) / (replicas if zero else 1) * FP32)
        per_step = parts.rest + (parts.sync if replicas == 1 else 0.0)
    fit = CalibratedCosts(cluster, scale["f"], scale["b"], scale["w"], float(measured.comm), per_param,
                          source=source, notes=tuple(notes), optimizer_s_per_byte=per_byte, per_step_s=per_step,
                          host_s=host)
    fit.embed_extra, fit.head_extra = extra["embed"], extra["head"]
    return fit
