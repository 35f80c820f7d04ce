"""The memory oracle's measuring side: replay one rank's compute actions with real pipegpt Stages
and measure the activation bytes it really holds.

What is measured. A TorchDispatchMode sees every tensor every aten op returns (forward, backward,
recomputation under checkpoint, the W closures, tensor-parallel collectives) and keeps a C++ weak
reference to its storage (StorageWeakRef), keyed by the storage's address: a view shares its base's
storage, so each storage counts once, with its real size, for as long as anything at all keeps it
alive - the autograd graph's saved tensors, a checkpoint frame's inputs, Stage.inputs, a pending W
closure, the graph nodes such a closure's tensors still reference. After each compute action the
rank "holds" the bytes of the live storages, less the parameters, their .grad and the tensors
waiting in the replay's inbox (a V-shape's hand-over between two stages of one rank: a
communication buffer, which the memory model counts apart). The peak over the replay is the
measurement ("peak"); with transient=True the same count after every op gives the peak inside the
actions too ("transient": a backward's gradients, a recomputation, the logits).

Why not saved_tensors_hooks alone: a non-reentrant checkpoint keeps its block's inputs through
its frame, not as saved tensors, and after an I action the W closures keep tensors (and the stage
input, through the graph nodes those tensors reference) that no pack hook is ever asked about.
Storage liveness sees all of it; `saved_tensor_bytes` (the hooks' count) is kept as a cross-check
of the simple case.

The replay: the rank's compute actions in plan order with that rank's stage modules, random
inputs and output gradients of the right shapes (no pipeline communication: what a receive would
deliver is made where it is consumed; what a send would take is dropped at once, and a forward
output is released as the runtime releases it once sent). tp > 1 runs one process per tp rank
(gloo), so the tensor-parallel collectives are real; gloo's worker thread drops its reference to a
collective's tensors a moment after the call returns, so there each count waits until it is stable.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.schedule import Kind, Plan
from pipegpt.stages import Stage, partition_layers


class StorageTracker(TorchDispatchMode):
    """Every storage an op returns while the mode is on, until nothing keeps it alive."""

    def __init__(self, exclude=None):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.exclude, self.transient = exclude, 0  # exclude: () -> storages not counted, for the transient peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.track(t)
        if self.exclude is not None:  # after every op: the peak inside actions too
            self.transient = max(self.transient, self.held(self.exclude()))
        return out

    def track(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key == 0:  # empty
            return
        known = self.live.get(key)
        if known is None or known[0].expired() or known[1] != s.nbytes():
            self.live[key] = (StorageWeakRef(s), s.nbytes())

    def held(self, exclude: set[int]) -> int:
        total = 0
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
            elif key not in exclude:
                total += nbytes
        return total


def storages_of(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


@dataclass(frozen=True)
class Layout:
    """One measured case: a model, a schedule and how the stages are built."""

    name: str
    model: ModelConfig
    schedule: str
    ranks: int
    microbatches: int
    microbatch_size: int = 2
    recompute: str = "none"
    tp: int = 1
    sequence_parallel: bool = False
    precision: str = "fp32"  # fp32 | bf16 (autocast)
    dtype: str = "float32"
    layers_per_stage: tuple[int, ...] | None = None

    def plan(self) -> Plan:
        from pipegpt.schedule import build_plan

        return build_plan(self.schedule, self.ranks, self.microbatches)


def build_stages(layout: Layout, plan: Plan, rank: int, tp_rank: int = 0, group=None) -> dict[int, Stage]:
    """The Stages of pipeline rank `rank`, as pipegpt.train.worker builds them."""
    from pipegpt.tensor_parallel.layers import shard_for_tp

    cfg = layout.model
    ranges = partition_layers(cfg.n_layer, plan.num_stages, layout.layers_per_stage)
    last = plan.num_stages - 1
    dtype = getattr(torch, layout.dtype)
    stages = {}
    for s in plan.stages_of(rank):
        module = GPT(cfg, layers=ranges[s], embed=s == 0, head=s == last, recompute=layout.recompute, init_seed=7)
        if layout.tp > 1:
            shard_for_tp(module, tp_rank, layout.tp, group, layout.sequence_parallel)
        module = module.to(dtype=dtype)
        stages[s] = Stage(s, plan.num_stages, module, plan.num_microbatches,
                          torch.bfloat16 if layout.precision == "bf16" else None)
    if stages.keys() >= {0, last} and last != 0 and cfg.tie_embeddings:
        stages[last].module.lm_head.weight = stages[0].module.wte.weight  # one tensor, as the worker does
    return stages


def replay_rank(layout: Layout, plan: Plan, rank: int, tp_rank: int = 0, group=None, seed: int = 0,
                transient: bool = False) -> dict:
    """Replay pipeline rank `rank`'s compute actions; the activation bytes it holds after each action.

    Returns {"peak": bytes, "after": [(action, bytes), ...]} and with transient=True also
    "transient": the peak over every op inside the actions (a backward's gradients, a recomputation,
    the logits), counted the same way, and "during": that peak per action.
    """
    cfg = layout.model
    torch.manual_seed(seed)  # the same on every tp rank: identical inputs
    stages = build_stages(layout, plan, rank, tp_rank, group)
    params = [p for st in stages.values() for p in st.module.parameters()]
    dtype = getattr(torch, layout.dtype)
    b, T, C = layout.microbatch_size, cfg.seq_len, cfg.n_embd
    S = T // layout.tp if layout.sequence_parallel and layout.tp > 1 else T
    owner = plan.stage_to_rank
    inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # a V-shape's hand-over on this rank
    after, peak = [], 0

    def not_counted() -> set[int]:
        return storages_of(params) | storages_of(p.grad for p in params) | storages_of(inbox.values())

    tracker = StorageTracker(not_counted if transient else None)
    during, top = [], 0  # per action: the most held inside it (transient=True)
    with tracker:
        for action in plan.compute_only().ranks[rank]:
            tracker.transient = 0
            s, mb, stage = action.stage, action.microbatch, stages[action.stage]
            if action.kind is Kind.F:
                if stage.is_first:
                    x = torch.randint(0, cfg.vocab_size, (b, T))
                else:
                    x = inbox.pop(("F", s, mb), None)
                    x = torch.randn(b, S, C, dtype=dtype) if x is None else x
                y = torch.randint(0, cfg.vocab_size, (b, T)) if stage.is_last else None
                out = stage.forward(mb, x, y)
                if not stage.is_last:
                    if owner[s + 1] == rank:
                        inbox[("F", s + 1, mb)] = out
                    else:
                        stage.release_output(mb)  # sent
                del x, y, out
            elif action.kind in (Kind.B, Kind.I):
                g = None
                if not stage.is_last:
                    g = inbox.pop(("B", s, mb), None)
                    g = torch.randn(b, S, C, dtype=dtype) if g is None else g
                grad_input = stage.backward(mb, g, split=action.kind is Kind.I)
                if not stage.is_first and owner[s - 1] == rank:
                    inbox[("B", s - 1, mb)] = grad_input
                del g, grad_input
            else:
                stage.backward_weight(mb)
            exclude = not_counted()
            held = tracker.held(exclude)
            if group is not None:  # gloo's worker thread lets go of a collective's tensors a moment later
                for _ in range(50):
                    time.sleep(0.002)
                    again = tracker.held(exclude)
                    if again == held:
                        break
                    held = again
            after.append((str(action), held))
            during.append(max(tracker.transient, held))
            peak, top = max(peak, held), max(top, tracker.transient)
    return {"peak": peak, "after": after, "during": during, "transient": max(top, peak)}


def saved_tensor_bytes(layout: Layout, stage_index: int, num_stages: int) -> int:
    """Cross-check with saved_tensors_hooks: the bytes the autograd graph of one forward saves
    (each storage once, parameters excluded) plus the stage's input, for a stage without
    recomputation (a checkpoint keeps its inputs outside saved tensors: use replay_rank there)."""
    cfg = layout.model
    ranges = partition_layers(cfg.n_layer, num_stages, layout.layers_per_stage)
    last = num_stages - 1
    module = GPT(cfg, layers=ranges[stage_index], embed=stage_index == 0, head=stage_index == last,
                 init_seed=7).to(dtype=getattr(torch, layout.dtype))
    stage = Stage(stage_index, num_stages, module, 1, torch.bfloat16 if layout.precision == "bf16" else None)
    params = storages_of(module.parameters())
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != 0:
            seen[s.data_ptr()] = s.nbytes()
        return t

    b, T, C = layout.microbatch_size, cfg.seq_len, cfg.n_embd
    x = torch.randint(0, cfg.vocab_size, (b, T)) if stage.is_first else \
        torch.randn(b, T, C, dtype=getattr(torch, layout.dtype))
    y = torch.randint(0, cfg.vocab_size, (b, T)) if stage.is_last else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage.forward(0, x, y)
    seen.setdefault(x.untyped_storage().data_ptr(), x.untyped_storage().nbytes())
    return sum(seen.values())


# ---------------------------------------------------------------------------
# tp > 1: one process per tp rank
# ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_modules(model: ModelConfig, stages: list[tuple[range, bool, bool]], dtype=torch.float32) -> list[GPT]:
    """One rank's slices as pipegpt.train.worker builds them (both ends of a V-shape share the tied tensor)."""
    modules = [GPT(model, layers=layers, embed=embed, head=head, init_seed=3).to(dtype=dtype)
               for layers, embed, head in stages]
    ends = [m for m in modules if m.embed], [m for m in modules if m.head]
    if model.tie_embeddings and ends[0] and ends[1] and ends[0][0] is not ends[1][0]:
        ends[1][0].lm_head.weight = ends[0][0].wte.weight
    return modules


def optimizer_state_bytes(modules: list[GPT], zero_group=None) -> dict:
    """Step pipegpt's optimizer (AdamW, or over this rank's ZeRO-1 shard of zero_group) once and count its real
    state."""
    from pipegpt.config import OptimizerConfig
    from pipegpt.data_parallel import DataParallel
    from pipegpt.train.optim import decays, make_optimizer

    seen, named = set(), []
    for m in modules:
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    stepped, decaying = named, None
    if zero_group is not None:  # one stage's flat buffers over the group, as the training role builds them
        params = [p for _, p in named]
        dp = DataParallel({0: params}, {0: params}, zero_group, torch.distributed.get_rank(zero_group), zero=1,
                          rank=torch.distributed.get_rank(), timeout_s=60)
        stepped = [(str(i), h.value) for i, h in enumerate(dp.pieces())]
        decaying = {id(h.value) for h in dp.pieces() if decays(h)}
    for _, p in stepped:
        p.grad = torch.ones_like(p)
    optimizer = make_optimizer(stepped, OptimizerConfig(), decaying)
    optimizer.step()
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values()
                  for k, t in state.items() if k in ("exp_avg", "exp_avg_sq"))
    steps = sum(1 for state in optimizer.state.values() if "step" in state)
    return {"parameters": sum(p.numel() for _, p in named),
            "weights": sum(p.numel() * p.element_size() for _, p in named),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for _, p in named if p.grad is not None),
            "optimizer": moments, "step_tensors": steps, "tensors": len(stepped)}


def tp_worker(tp_rank: int, tp: int, port: int, layouts: list[Layout], zero_cases: list, out_path: str) -> None:
    """Replay every pipeline rank of every layout on tensor-parallel rank tp_rank (spawned); the same
    processes then serve as a dp group for ZeRO-1's real optimizer state (zero_cases: (model, stages))."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=tp_rank, world_size=tp,
                            timeout=timedelta(seconds=120))
    try:
        group = dist.new_group(list(range(tp)))
        results = {}
        for layout in layouts:
            plan = layout.plan()
            replays = [replay_rank(layout, plan, r, tp_rank, group, transient=True) for r in range(plan.num_ranks)]
            results[layout.name] = [{"peak": x["peak"], "transient": x["transient"]} for x in replays]
        results["zero"] = [optimizer_state_bytes(rank_modules(model, stages), group)["optimizer"]
                           for model, stages in zero_cases]
        torch.save(results, f"{out_path}.{tp_rank}")
        dist.barrier(group)
    finally:
        dist.destroy_process_group()
