"""What a worker answers the driver for a training step: one typed record per rank, pickled across RPC
(torch-free, so the driver side reads it without the worker's imports)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerStep:
    """One rank's answer to Worker.step."""

    rank: int
    losses: list[float]  # one per microbatch on ranks holding the last stage; empty on the others
    grad_norm: float  # the global norm before clipping: the same on every rank
    lr: float  # the learning rate this step's optimizer update used
    peak_memory: int  # bytes: CUDA's max allocated on a GPU, the process's max RSS on the CPU
    device_name: str  # the GPU's name as torch reports it, or "cpu"
    # (action, start_s, end_s) per action on steps whose timeline is recorded (--trace-steps and the last);
    # empty on the others
    events: list[tuple[str, float, float]] = field(default_factory=list)
    compute_s: float | None = None  # wall seconds inside step(); None: not timed (an answer built by hand)
    cpu_s: float | None = None  # the worker process's CPU seconds during step(); None: not timed
    # False when the optimizer update was dropped: the gradient norm or some rank's loss was not finite
    # (every rank decides alike, from the values the norm's all-reduce gave them all)
    applied: bool = True
    # on such a step, this rank's stages whose gradients (its share of the norm) were not finite
    nonfinite_stages: list[int] = field(default_factory=list)
    # this rank's MoE layers' figures of the step (pipegpt.model.moe.end_step); empty without experts
    moe: dict = field(default_factory=dict)
    # with --ep, on recorded steps: (what, start_s, end_s, rows received) per expert all-to-all
    # (pipegpt.observe.exchanges), on the events' time line
    exchanges: list[tuple[str, float, float, int]] = field(default_factory=list)
    # on recorded steps: this rank's peak of tensor bytes, {"total", "by_kind", "predicted": the planner's
    # {"total", "by_kind"} or None} (pipegpt.observe.tensor_bytes); None on the others
    tensor_bytes: dict | None = None
    # on recorded steps: (part, start_s, end_s) of the step's parts on the host, in order, from step()'s start to
    # its end: before the actions, the actions, the gradient sync, the clip, the optimizer, the end of the step
    # (pipegpt.observe.step_time)
    phases: list[tuple[str, float, float]] = field(default_factory=list)


@dataclass
class SavedFile:
    """One rank's answer to Worker.save: the file it wrote and its SHA-256 (for the manifest), or, when some
    parameter or Adam moment it holds is not finite, nothing written and which one ((stage, "exp_avg/<name>"))."""

    rank: int
    name: str | None = None
    sha256: str | None = None
    nonfinite: tuple[int, str] | None = None
