"""TEMPORARY stand-in (not committed): all-gather attention."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipegpt.context_parallel.chunks import join_sequence, local_positions, shard_sequence


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return join_sequence(parts, 2)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return shard_sequence(g, ctx.rank, ctx.size, 2), None, None, None


def context_parallel_attention(q, k, v, group, cp_rank, cp_size, comm="ring", documents=None):
    L = q.size(2)
    K, V = _Gather.apply(k, group, cp_rank, cp_size), _Gather.apply(v, group, cp_rank, cp_size)
    if K.size(1) != q.size(1):
        K, V = (t.repeat_interleave(q.size(1) // K.size(1), dim=1) for t in (K, V))
    qpos = local_positions(L * cp_size, cp_rank, cp_size, q.device)
    kpos = torch.arange(L * cp_size, device=q.device)
    mask = kpos[None, :] <= qpos[:, None]
    if documents is not None:
        parts = [torch.empty_like(documents) for _ in range(cp_size)]
        dist.all_gather(parts, documents.contiguous(), group=group)
        docs = join_sequence(parts, 1)
        mask = (mask & (documents[:, :, None] == docs[:, None, :]))[:, None]
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
