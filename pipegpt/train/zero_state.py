"""The training role's state under ZeRO (pipegpt.data_parallel): the optimizer steps pieces of this rank's
shard, so its moments (and with ZeRO-3 its parameters) are pieces too. Checkpoints stay layout-free: each
piece is written under its parameter's one-process name with where it starts in the (tp shard of the)
tensor, and a loader of any layout joins the pieces by name (pipegpt.state.checkpoint) and takes its own.
"""
from __future__ import annotations

import torch

from pipegpt.state import rng
from pipegpt.train.optim import step_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")


def checkpoint_tensors(worker) -> tuple[dict, dict]:
    """What this rank owns of a checkpoint: RNG streams; the parameters (replica 0, whole; with ZeRO-3 every
    rank its pieces); its pieces of the Adam moments. Returns (tensors, each key's shard metadata)."""
    mesh, elsewhere, layout = worker.engine.mesh, worker.elsewhere, worker.engine.parallelism
    ep_index = getattr(mesh, "ep_index", 0)
    shard = lambda name: layout.checkpoint_shard(name, mesh.tp_index, ep_index)  # noqa: E731
    tensors = rng.rng_state(worker.rank, worker.device)
    shards = {key: [0, 1] for key in tensors}
    replica = 0 if mesh.dp_index == 0 and mesh.cp_index == 0 else 1
    if worker.dp.zero < 3 and (replica == 0 or layout.ep > 1):  # with ep: edp index 0 stores the experts
        for _, p in worker.named_params:
            name = worker.full_names[id(p)]
            if id(p) not in elsewhere and layout.stored_by(name, replica, getattr(mesh, "edp_index", 0)):
                tensors[f"param/{name}"], shards[f"param/{name}"] = p, shard(name)
    state = worker.optimizer.state
    for h in worker.pieces:
        if id(h.param) in elsewhere:
            continue
        name = worker.full_names[id(h.param)]
        kinds = [(k, state[h.value][k]) for k in MOMENTS if k in state.get(h.value, {})]
        if worker.dp.zero >= 3:
            kinds.append(("param", h.value))
        for kind, t in kinds:
            key = f"{kind}/{name}"
            tensors[key], shards[key] = t, [*shard(name), h.start, list(h.shape)]
    return tensors, shards


def load(worker, mine, step: int, weights_only: bool) -> None:
    """Take this rank's pieces of a checkpoint's tensors; mine(key, param) is the param's (tp shard of the)
    full tensor under key."""
    def piece(key: str, h) -> torch.Tensor:
        return mine(key, h.param).reshape(-1)[h.start:h.stop].clone()

    with torch.no_grad():
        if worker.dp.zero >= 3:
            for h in worker.pieces:
                h.value.copy_(piece("param", h))
        else:
            for _, p in worker.named_params:
                p.copy_(mine("param", p))
    if weights_only:
        return
    group = worker.optimizer.param_groups[0]  # fused or not: the same for every group (optim.adamw_kernel)
    for h in worker.pieces:
        worker.optimizer.state[h.value] = {"step": step_tensor(step, h.value, group),
                                           **{k: piece(k, h) for k in MOMENTS}}


def first_nonfinite(worker) -> tuple[int, str] | None:
    """(stage, "param/<name>" or "exp_avg/<name>", ...) of the first piece of a parameter or moment this rank
    holds whose value is not finite, or None."""
    stage_of = {id(p): s for s in sorted(worker.stages, reverse=True) for p in worker.stages[s].module.parameters()}
    state, found = worker.optimizer.state, []
    for h in sorted(worker.pieces, key=lambda h: stage_of[id(h.param)]):
        s, name = stage_of[id(h.param)], worker.full_names[id(h.param)]
        found += [(s, f"param/{name}", h.value)] + [(s, f"{k}/{name}", state[h.value][k])
                                                      for k in MOMENTS if k in state.get(h.value, {})]
    return first_bad(found)


def first_bad(found: list) -> tuple[int, str] | None:
    """The first (stage, key) of [(stage, key, tensor)] whose tensor is not finite (one read back for all)."""
    if not found:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, _, t in found]).tolist()
    return next(((s, key) for (s, key, _), ok in zip(found, finite) if not ok), None)


def gathered_moments(worker) -> dict[str, torch.Tensor]:
    """{"exp_avg/<name>": the whole moment (this rank's tp shard), ...} gathered from every rank's pieces (a
    collective over the data-parallel group; moments not yet made read as zeros)."""
    state, out = worker.optimizer.state, {}
    for k in MOMENTS:
        values = {id(h.value): state[h.value][k] if k in state.get(h.value, {}) else torch.zeros_like(h.value)
                  for h in worker.pieces}
        whole = worker.dp.gather_pieces(values)
        out.update({f"{k}/{worker.full_names[id(p)]}": whole[id(p)].cpu().clone() for _, p in worker.named_params})
    return out
