"""Tensor-parallel collectives as paired autograd functions (Megatron/picotron style).

Each function's backward is its forward's conjugate:

    copy_to_tp                  fwd identity                  bwd all-reduce (sum)
    reduce_from_tp              fwd all-reduce (sum)          bwd identity
    sum_used_by_all             fwd all-reduce (sum)          bwd all-reduce (sum)
    scatter_to_sequence         fwd keep my sequence chunk    bwd all-gather along the sequence
    gather_from_sequence        fwd all-gather along seq      bwd reduce-scatter along the sequence
    reduce_scatter_to_sequence  fwd reduce-scatter along seq  bwd all-gather along the sequence

plus `vocab_parallel_cross_entropy`, the mean cross-entropy of logits split over the vocabulary
without ever gathering them.

Knows torch.distributed, not the model. Device-neutral (gloo on CPU, NCCL on CUDA).
`group=None` means a group of one rank (no communication), as pipegpt.comm.mesh leaves a
size-1 family's group: it never means the world group. Sequence chunks are contiguous and in
rank order: rank r holds positions [r*T/tp, (r+1)*T/tp) of the `dim` axis.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.11 names the single-tensor collectives *_single; older ones *_tensor (same signature)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NO_REDUCE_SCATTER: set[str] = set()  # "gloo" once found to lack reduce-scatter (older torch)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or `op`) of x over the group, in a new contiguous tensor (x is not modified)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if group is not None:
        dist.all_reduce(out, op=op, group=group)
    return out


def _check_divisible(x: torch.Tensor, dim: int, n: int, what: str) -> None:
    if x.size(dim) % n:
        raise ValueError(f"{what}: size {x.size(dim)} of dim {dim} (shape {tuple(x.shape)}) "
                         f"is not divisible by the tensor-parallel size {n}")


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    xt = x.movedim(dim, 0).contiguous()  # the collective concatenates along dim 0
    out = xt.new_empty((n * xt.size(0), *xt.shape[1:]))
    _all_gather_single(out, xt, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group, keeping my chunk along dim. Gloo builds without reduce-scatter fall
    back to all-reduce + take my chunk (same result, tp times the traffic; remembered). Any
    other backend's failure is real (an NCCL error): it propagates, since carrying on would
    leave the ranks issuing mismatched collectives."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "reduce-scatter along the sequence")
    xt = x.movedim(dim, 0).contiguous()
    backend = str(dist.get_backend(group))
    if backend not in _NO_REDUCE_SCATTER:
        out = xt.new_empty((xt.size(0) // n, *xt.shape[1:]))
        try:
            _reduce_scatter_single(out, xt, group=group)
            return out.movedim(0, dim).contiguous()
        except (RuntimeError, NotImplementedError):
            if backend != "gloo":
                raise
            _NO_REDUCE_SCATTER.add(backend)
    xt = xt.clone()  # movedim + contiguous can be x itself, which the caller may still hold
    dist.all_reduce(xt, group=group)
    return xt.chunk(n, 0)[dist.get_rank(group)].movedim(0, dim).contiguous()


def _my_chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "split along the sequence")
    return x.chunk(n, dim)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumUsedByAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _my_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: forward identity, backward
    all-reduce (each rank's shard contributed a partial input gradient)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tensor-parallel region holding partial sums: forward all-reduce, backward identity."""
    return _ReduceFromTP.apply(x, group)


def sum_used_by_all(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group of x, which every rank then uses and backpropagates as its own objective's:
    forward all-reduce, backward all-reduce (x's gradient is the sum of every rank's gradient of the sum)."""
    return _SumUsedByAll.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """A replicated tensor -> my chunk of it along `dim`; backward all-gathers the gradient."""
    return _ScatterToSequence.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """My chunk along `dim` -> the whole tensor (all-gather), to enter a tensor-parallel region;
    backward reduce-scatters the gradient (each rank's shard contributed a partial one)."""
    return _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Partial sums -> my chunk along `dim` of their sum (reduce-scatter), to leave a
    tensor-parallel region; backward all-gathers the gradient."""
    return _ReduceScatterToSequence.apply(x, group, dim)


# ---------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy
# ---------------------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, targets, vocab_start, vocab_size, group):
        exp, index, mine, valid, sum_exp, target_logit = _shifted_parts(logits_shard, targets, vocab_start,
                                                                        vocab_size, group)
        count = valid.sum()
        loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp)).sum() / count
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(1)), index, mine, valid, count)
        ctx.shape, ctx.dtype = logits_shard.shape, logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, valid, count = ctx.saved_tensors
        scale = valid.to(softmax.dtype) * (grad.to(softmax.dtype) / count)  # per row; 0 if ignored
        g = softmax * scale.unsqueeze(1)  # out of place: a retained graph can run backward again
        g.scatter_add_(1, index, -(mine.to(g.dtype) * scale).unsqueeze(1))
        return g.view(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group, vocab_size: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits split over the vocabulary, never gathering them.

    logits_shard: [..., V_local], this rank's columns [vocab_start, vocab_start + V_local) of the
    (padded) vocabulary; targets: [...] global token ids, -1 ignored. vocab_size: the real
    vocabulary; columns >= vocab_size are padding, masked to -inf (never predicted); targets must
    be < vocab_size (not checked: that would cost a device sync). Every rank
    returns the same loss; backward gives each rank (softmax - onehot) on its own columns,
    times grad / (number of targets != -1). Two collectives: all-reduce max of the row maxima,
    then one all-reduce sum of the stacked (target logit, sum of exp) per row.
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, vocab_start, vocab_size, group)


@torch.no_grad()
def vocab_parallel_token_losses(logits_shard: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                group, vocab_size: int | None = None) -> torch.Tensor:
    """Each target's cross-entropy (0 where targets == -1), in targets' shape, from logits split over the
    vocabulary as vocab_parallel_cross_entropy takes them; for scoring, without gradients."""
    _, _, _, valid, sum_exp, target_logit = _shifted_parts(logits_shard, targets, vocab_start, vocab_size, group)
    return torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp)).view(targets.shape)


def _shifted_parts(logits_shard, targets, vocab_start, vocab_size, group):
    """The softmax's pieces every rank agrees on, without gathering the logits: (exp of the shifted local logits,
    the target's local column, whether this rank owns the target, whether the target counts, the global sum of
    exp, the target's shifted logit) per row. Two collectives: all-reduce max of the row maxima, then one
    all-reduce sum of the stacked (target logit, sum of exp)."""
    V_local = logits_shard.size(-1)
    # at least fp32, as F.cross_entropy under autocast (and the loss comes back in it)
    logits = logits_shard.reshape(-1, V_local).to(torch.promote_types(logits_shard.dtype, torch.float32))
    targets = targets.reshape(-1)
    if logits.size(0) != targets.numel():
        raise ValueError(f"vocab_parallel_cross_entropy: {logits.size(0)} rows of logits "
                         f"but {targets.numel()} targets")
    n_real = V_local if vocab_size is None else max(0, min(V_local, vocab_size - vocab_start))
    if n_real < V_local:  # padded vocabulary columns are never predicted
        logits = logits.clone()
        logits[:, n_real:] = float("-inf")
    # 1. the global max per row (a shard of pure padding contributes -inf)
    row_max = _all_reduce(logits.max(dim=1).values, group, op=dist.ReduceOp.MAX)
    shifted = logits - row_max.unsqueeze(1)
    # 2. the target's shifted logit (from the one shard that owns it) and sum of exp, in one sum
    valid = targets != -1
    local_t = targets - vocab_start
    mine = valid & (local_t >= 0) & (local_t < n_real)
    index = torch.where(mine, local_t, torch.zeros_like(local_t)).unsqueeze(1)
    target_logit = torch.where(mine, shifted.gather(1, index).squeeze(1), torch.zeros_like(row_max))
    exp = shifted.exp()
    sums = _all_reduce(torch.stack([target_logit, exp.sum(dim=1)]), group)
    return exp, index, mine, valid, sums[1], sums[0]
