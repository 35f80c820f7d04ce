"""The optimizer side of a step: parameter groups, AdamW (over a ZeRO shard's pieces too), the learning-rate
schedule, global-norm clipping."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pipegpt.config import OptimizerConfig


def decays(p) -> bool:
    """Matrices decay; biases and LayerNorm gains do not (as GPT-2 and nanoGPT). p: a tensor, or anything with
    its shape (a ZeRO piece: pipegpt.data_parallel.HeldPiece, whose parameter may be resharded)."""
    return len(p.shape) >= 2


def adamw_kernel(params) -> dict[str, bool]:
    """How AdamW updates: fused (one kernel over all tensors, as nanoGPT on CUDA) where every parameter is a
    floating-point CUDA tensor; else foreach (on CPU the same per-tensor arithmetic as foreach=False, bit for
    bit, which the one-process oracle compares against, so a ZeRO piece of a tensor steps as the tensor would)."""
    params = list(params)
    on_cuda = bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)
    return {"fused": True} if on_cuda else {"foreach": True}


def step_tensor(step: int, p: torch.Tensor, group: dict) -> torch.Tensor:
    """A parameter's Adam `step` as torch keeps it (a resume sets it): on the parameter's device, float32, for
    the fused and capturable kernels; a CPU scalar otherwise."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=p.device)
    return torch.tensor(float(step))


def make_optimizer(named_params: list[tuple[str, torch.Tensor]], optim: OptimizerConfig,
                   decaying: set[int] | None = None):
    """AdamW over two groups (decay, no decay), fused on CUDA (adamw_kernel). decaying: the ids of the tensors
    that decay, where they are not the parameters themselves (ZeRO's 1-D pieces of a shard:
    pipegpt.data_parallel); else by decays()."""
    decay = (lambda p: id(p) in decaying) if decaying is not None else decays  # noqa: E731
    groups = [
        {"params": [p for _, p in named_params if decay(p)], "weight_decay": optim.weight_decay},
        {"params": [p for _, p in named_params if not decay(p)], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, **adamw_kernel(p for _, p in named_params))


def lr_at(step: int, optim: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of step `step` (0-based) of a run of `total_steps` steps: nanoGPT's get_lr.

    warmup (step < w):   lr * (step + 1) / (w + 1), linear, never 0 at the first step
    cosine (after):      min_lr + (lr - min_lr) * (1 + cos(pi * (step - w) / (total_steps - w))) / 2,
                         lr at step w, down to min_lr (default lr/10) at step total_steps, min_lr after
    constant (after):    lr
    """
    lr, w = optim.lr, optim.warmup_steps
    if step < w:
        return lr * (step + 1) / (w + 1)
    if optim.lr_schedule == "constant":
        return lr
    min_lr = optim.final_lr
    if step >= total_steps:
        return min_lr
    ratio = (step - w) / (total_steps - w)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(counted: list[torch.Tensor], params: list[torch.Tensor], max_norm: float, group=None,
                    device=None) -> float:
    """The global gradient norm, then every grad of `params` scaled so that it is at most max_norm (0: off).

    counted: the parameters whose gradients make up this rank's share of the norm, each value once
    across `group` (the ranks of one model replica), whose squares are summed in float64.
    """
    norm = global_grad_norm(counted, group, device)[0]
    clip_grads_(params, norm, max_norm)
    return norm


def global_grad_norm(counted: list[torch.Tensor], group=None, device=None, flagged: bool = False
                     ) -> tuple[float, bool, bool]:
    """(the global gradient norm, whether any rank of `group` was flagged, whether this rank's share was finite).

    One all-reduce carries both the squares (see clip_grad_norm_) and the flags (a rank's non-finite loss),
    so every rank of the group learns both at the cost the norm alone had."""
    grads = [p.grad for p in counted if p.grad is not None]
    # One foreach call accumulating in float64 (no float64 copy of any gradient); nothing reaches the host
    # before the all-reduce's one read below.
    local = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)).pow(2).sum() if grads else \
        torch.zeros((), dtype=torch.float64, device=device)
    both = torch.stack([local, local.new_full((), float(flagged))])  # a new tensor: `local` stays this rank's
    if group is not None:
        dist.all_reduce(both, group=group)
    total, flags = both.tolist()
    # This rank's share is looked at only when the total is not finite (rarely): no second copy to the host.
    return math.sqrt(total), flags > 0, math.isfinite(total) or math.isfinite(float(local))


def moments_overflow_at(dtype: torch.dtype) -> float:
    """The gradient norm from which some gradient's square may overflow `dtype`: Adam's second moment would then be
    infinite after the update, though every gradient was finite (max |g| <= the norm, so below it none can)."""
    return math.sqrt(torch.finfo(dtype).max)


def clip_grads_(params: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale every grad of params so that the global norm `norm` becomes at most max_norm (0: off)."""
    if max_norm > 0 and norm > max_norm:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
