"""A rank's peak of tensor bytes by kind over a step: what a run fails on, on a GPU as on a CPU.

Kinds (each storage counted once, under the first kind that holds it):

    parameters   the rank's own parameters: the flat buffers (zero <= 2), the shard (zero 3)
    gathered     ZeRO-3's full parameter buffers, from a gather (UNSHARD) to a free (RESHARD)
    gradients    the flat gradient buffers and ZeRO's reduced shards (or each parameter's .grad without dp)
    optimizer    AdamW's moments
    messages     the runtime's point-to-point buffers: received, to send, in flight
    activations  what autograd saved for the backward (torch.autograd.graph.saved_tensors_hooks) and the
                 stages' seams (the inputs and outputs each stage keeps per microbatch), less the above

The counts are sampled where the peak can occur: after each action of the step (the runtime's after_action
hook), after the gradients' reduction and after the optimizer update. The peak is the sample with the most
bytes, kept with its breakdown. On CUDA the allocator's max_memory_allocated is the total (the run's so far:
it sees the transients between samples, an action's workspace, the optimizer's temporaries) and the sampled
breakdown says what was held at the largest sample; on CPU the total is the largest sample's sum.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Callable, Iterable

import torch

KINDS = ("parameters", "gathered", "gradients", "optimizer", "messages", "activations")


def _tensors(items) -> Iterable[torch.Tensor]:
    """The tensors in the runtime's inbox, outbox and in-flight maps (a value is a tensor or a Message)."""
    for item in items:
        t = item if isinstance(item, torch.Tensor) else getattr(item, "tensor", None)
        if t is not None:
            yield t


def by_kind(held: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """{kind: bytes of the distinct storages its tensors use}, a storage shared by two kinds counted under
    the first of KINDS (a parameter autograd saved for a matmul is a parameter, not an activation)."""
    seen: set[int] = set()
    out = {}
    for kind in KINDS:
        total = 0
        for t in held.get(kind, ()):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or not storage.nbytes():
                continue
            seen.add(ptr)
            total += storage.nbytes()
        out[kind] = total
    return out


class PeakTensorBytes:
    """Samples one rank's tensors over a step (measure()), keeping the peak and its breakdown.

    held: () -> {kind: tensors} for the kinds the rank's state holds (parameters, gathered, gradients,
    optimizer); stages: the rank's pipeline stages (their seams are activations)."""

    def __init__(self, held: Callable[[], dict[str, Iterable[torch.Tensor]]], stages: dict, device: torch.device,
                 hook_saved: bool = True):
        self.held, self.stages, self.device, self.hook_saved = held, stages, device, hook_saved
        self.saved: list[weakref.ref] = []  # what autograd saved this step, alive until its graph is freed
        self.peak: dict[str, int] = {}
        self.peak_total = 0
        self.kind_peaks: dict[str, int] = {}  # each kind's own largest sample (the planner's kinds are these)
        self.sampling_s = 0.0  # what the samples cost the step (the accounting's own price)
        self.samples = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.append(weakref.ref(t))
        return t

    def _activations(self) -> list[torch.Tensor]:
        live = [t for t in (ref() for ref in self.saved) if t is not None]
        if len(live) < len(self.saved) // 2:  # drop the dead references now and then, not at every sample
            self.saved = [weakref.ref(t) for t in live]
        for stage in self.stages.values():
            for seams in getattr(stage, "seams", {}).values():
                live += [t for pair in seams for t in pair if isinstance(t, torch.Tensor)]
        return live

    def sample(self, *message_maps) -> None:
        """Count now; message_maps: the runtime's dicts of messages (their values)."""
        t0 = time.perf_counter()
        held = dict(self.held())
        held["messages"] = [t for m in message_maps for t in _tensors(m.values())]
        held["activations"] = self._activations()
        counts = by_kind(held)
        total = sum(counts.values())
        if total >= self.peak_total or not self.peak:
            self.peak, self.peak_total = counts, total
        self.kind_peaks = {k: max(n, self.kind_peaks.get(k, 0)) for k, n in counts.items()}
        self.sampling_s += time.perf_counter() - t0
        self.samples += 1

    @contextlib.contextmanager
    def measure(self, runtime):
        """Sample through a step: after each of the runtime's actions, and where the caller calls sample()."""
        self.saved, self.peak, self.peak_total, self.sampling_s, self.samples = [], {}, 0, 0.0, 0
        self.kind_peaks = {}
        runtime.after_action = self.sample
        try:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t) if self.hook_saved \
                else contextlib.nullcontext()
            with hooks:
                self.sample()
                yield self
        finally:
            runtime.after_action = None
            self.saved = []

    def result(self) -> dict:
        """{"total": the peak's bytes, "by_kind": what was held at the largest sample, "kind_peaks": each kind's
        own peak over the samples (kinds peak at different actions: gathered parameters at a stage's run with its
        prefetch, full gradients in the backward), "samples" and "sampling_s": how many samples the step took
        and what they cost it}."""
        total = self.peak_total
        if self.device.type == "cuda":  # the allocator saw every transient between the samples
            total = max(total, torch.cuda.max_memory_allocated(self.device))
        return {"total": int(total), "by_kind": dict(self.peak), "kind_peaks": dict(self.kind_peaks),
                "samples": self.samples,
                "sampling_s": self.sampling_s}


def predicted_peak(cfg, plan, pipeline_rank: int, device: str) -> dict:
    """The planner's peak for one pipeline rank (pipegpt.costs.memory.plan_memory) in the kinds above:
    {"total": bytes, "by_kind": {...}, "held": bytes}; weights split into the rank's own (what stays between steps)
    and ZeRO-3's gathered rest; activations with their workspace. by_kind is each kind's own peak, the total their
    sum (a bound: the kinds peak at different actions); held: the most the rank holds at one point between its
    actions, what the samples here can see (pipegpt.costs.memory.held_peak)."""
    from pipegpt.costs.activations import memory_precision
    from pipegpt.costs.memory import held_peak, plan_memory, state_bytes
    from pipegpt.model.partition import partition_layers

    p, m = cfg.parallel, cfg.model
    layers = partition_layers(m.n_layer, plan.num_stages, p.layers_per_stage)
    precision = memory_precision(cfg.runtime.precision, cfg.runtime.dtype)
    unshard = p.unshard or "step"
    kw = dict(microbatch_size=p.microbatch_size, sharding=p.sharding, recompute=p.recompute, precision=precision,
              device=device, cp_comm=p.cp_comm, unshard=unshard)
    rank = plan_memory(m, plan, layers, **kw)[pipeline_rank]
    last = plan.num_stages - 1
    mine = [(layers[s], s == 0, s == last) for s in plan.stages_of(pipeline_rank)]
    own = state_bytes(m, mine, sharding=p.sharding, precision=precision, between_steps=True,
                      unshard=unshard).weights if p.zero >= 3 else rank.weights
    kinds = {"parameters": own, "gathered": rank.weights - own, "gradients": rank.gradients,
             "optimizer": rank.optimizer, "messages": rank.p2p_buffers,
             "activations": rank.activations + rank.workspace}
    return {"total": int(rank.total), "by_kind": {k: int(v) for k, v in kinds.items()},
            "held": int(held_peak(m, plan, layers, pipeline_rank, **kw))}
