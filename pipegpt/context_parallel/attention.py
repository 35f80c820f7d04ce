"""Causal attention over a sequence cut across a context-parallel group (chunks.py's load-balanced order).

    context_parallel_attention(q, k, v, group, cp_rank, cp_size, comm="ring", documents=None)

q [B, Hq, L, hd], k and v [B, Hkv, L, hd]: this rank's L = T / cp tokens (chunk r, then chunk 2cp-1-r), positions
already applied. A query attends to the keys at global positions <= its own (and, given documents [B, L], of its own
document). Two autograd Functions; each saves local tensors (q, k, v, out, the log-sum-exp, documents) and, at
cp 2 (KEEP_PEER_CP), the peer's K/V block (and document ids) it received, so that the backward sends dK/dV only:
one K/V block more per layer kept, one exchange of three per layer saved. Under torch's checkpoint (full
recomputation) the first forward keeps nothing and the recomputed one passes K/V again and keeps the block.

ring (default): K/V (with GQA only the kv heads) travel to the next cp rank in batched point-to-point, each block's
  attention computed while the next is in flight, partial outputs merged by their log-sum-exp in fp32. At step s
  rank r holds the block of rank (r - s) mod cp; with the load-balanced chunks it computes: its own block causally
  (local order is global order), an earlier rank's block only against that rank's first chunk (its second is later
  than all of r's queries), a later rank's block only for r's second chunk (r's first is earlier than all its keys).
  Every step after the first is L x L/2 pairs on every rank. The backward is a ring too: a block's dK/dV (fp32)
  begin at the first rank after its owner and travel with the block, each rank adding its share; the last hop
  brings them to the owner, which adds its own (cp - 1 hops of dK/dV: none for the owner's share). At cp 2 the
  backward's K/V is the forward's kept block: only the dK/dV hop travels.
allgather (Llama 3's): K, V and documents gathered once; the local queries attend to the ring's blocks, the
  earlier ranks' key chunks joined into one block and the later ranks' into another (at most three kernels, no
  pair the causal mask drops); the backward re-gathers K/V (at cp 2: the kept peer's block, copied out of the
  gathered buffer in the forward) and reduce-scatters dK/dV.

Every wait is bounded by TIMEOUT_S (set_timeout) where the backend's Work takes a timeout (gloo; on CUDA NCCL's
own group timeout bounds the stream wait) and a failure raises ContextParallelError naming the peer. bytes_sent()
counts what this process sent through these functions (a collective counted as a ring algorithm sends it).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from pipegpt.context_parallel.chunks import local_positions
from pipegpt.context_parallel.kernels import block_backward, block_forward, merge_into
from pipegpt.tensor_parallel.collectives import _all_gather_single, _reduce_scatter_single  # torch's names by version

COMMS = ("ring", "allgather")
TIMEOUT_S = 60.0  # any one wait; pipegpt's --timeout through set_timeout
KEEP_PEER_CP = 2  # at this cp the forward keeps the peer's K/V block for the backward (one block per layer)
_sent = [0]  # bytes this process sent through this module


class ContextParallelError(RuntimeError):
    pass


def set_timeout(seconds: float) -> None:
    global TIMEOUT_S
    TIMEOUT_S = float(seconds)


def bytes_sent() -> int:
    return _sent[0]


def reset_bytes_sent() -> None:
    _sent[0] = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def attention_pairs(seq_len: int, cp_rank: int, cp_size: int, documents: torch.Tensor | None = None) -> int:
    """The (query, key) pairs rank cp_rank's queries attend to (causal, and within their document when documents,
    ids [seq_len] or [B, seq_len] of the whole sequence, nondecreasing, are given); summed over B."""
    positions = local_positions(seq_len, cp_rank, cp_size)
    if documents is None:
        return int((positions + 1).sum())
    docs = documents.reshape(-1, seq_len)
    idx = torch.arange(seq_len).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = torch.where(starts, idx, 0).cummax(dim=1).values  # where each token's document begins
    return int((idx - first + 1)[:, positions].sum())


def _same_document(docs_q: torch.Tensor | None, docs_k: torch.Tensor | None) -> torch.Tensor | None:
    return None if docs_q is None else docs_q[:, :, None] == docs_k[:, None, :]


class _Peers:
    """Batched point-to-point with the next and previous cp ranks, each wait bounded."""

    def __init__(self, group, cp_rank: int, cp_size: int, device: torch.device):
        self.group, self.cp_rank = group, cp_rank
        self.next, self.prev = (cp_rank + 1) % cp_size, (cp_rank - 1) % cp_size
        self.host_waits = device.type != "cuda"  # NCCL: the stream waits, the group's timeout bounds it

    def peer(self, cp_rank: int) -> str:
        return f"cp rank {cp_rank} (global rank {dist.get_global_rank(self.group, cp_rank)})"

    def shift(self, tensors: list[torch.Tensor], tag: int, what: str):
        """Post: each tensor to the next rank, a buffer like it from the previous. wait() gives the buffers."""
        recvs = [torch.empty_like(t) for t in tensors]
        next_rank, prev_rank = (dist.get_global_rank(self.group, r) for r in (self.next, self.prev))
        ops = [dist.P2POp(dist.isend, t, next_rank, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, prev_rank, self.group, tag) for t in recvs]
        works = dist.batch_isend_irecv(ops)
        _sent[0] += sum(_nbytes(t) for t in tensors)
        if len(works) == len(ops):  # gloo: one Work per operation, so a failure names its peer
            labelled = [(w, f"{what} to {self.peer(self.next)}") for w in works[:len(tensors)]]
            labelled += [(w, f"{what} from {self.peer(self.prev)}") for w in works[len(tensors):]]
        else:  # one Work for the batch (NCCL)
            labelled = [(w, f"{what} to {self.peer(self.next)} and from {self.peer(self.prev)}") for w in works]
        return recvs, labelled

    def wait(self, posted) -> list[torch.Tensor]:
        recvs, labelled = posted
        for work, what in labelled:
            _wait([work], self.host_waits, what, self.cp_rank)
        return recvs


def _wait(works, host_waits: bool, what: str, cp_rank: int) -> None:
    try:
        for work in works:
            work.wait(timedelta(seconds=TIMEOUT_S)) if host_waits else work.wait()
    except Exception as e:  # gloo raises on a timeout or a dead peer
        raise ContextParallelError(f"cp rank {cp_rank}: context-parallel attention: {what} failed after at most "
                                   f"{TIMEOUT_S:g}s: {e}") from None


def _ring_block(r: int, source: int, half: int):
    """(query slice, key slice, causal) rank r computes against the block of rank `source`."""
    if source == r:
        return slice(None), slice(None), True
    if source < r:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _ring_blocks(peers: _Peers, k, v, documents, r: int, n: int, kept=None, keep: list | None = None):
    """Each step's (query slice, key slice, causal, k, v, same-document mask) on rank r; the next block travels
    while the caller computes on this one. kept: at cp 2, the peer's (K/V, document ids) the forward received,
    so nothing travels; keep: a list the peer's block received last is appended to (the forward's, at cp 2)."""
    half = k.size(2) // 2
    kv = torch.stack((k, v)) if n > 1 and kept is None else None  # one contiguous message
    docs = documents
    for step in range(n):
        posted = None
        if step < n - 1 and kept is None:
            posted = peers.shift([kv] if docs is None else [kv, docs], 0, "passing K/V")
        qs, ks, causal = _ring_block(r, (r - step) % n, half)
        allowed = None if docs is None else _same_document(documents[:, qs], docs[:, ks])
        # the own block from k and v themselves: the kernel's dK/dV then come in their layout, which the
        # model's view of them back to [B, L, C] takes without a copy
        yield (qs, ks, causal, k, v, allowed) if step == 0 else (qs, ks, causal, kv[0][:, :, ks], kv[1][:, :, ks],
                                                                 allowed)
        if posted is not None:
            kv, docs = (peers.wait(posted) + [None])[:2]
        elif kept is not None:
            kv, docs = kept
    if keep is not None and n > 1:
        keep.append((kv, docs))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, group, cp_rank, cp_size):
        peers = _Peers(group, cp_rank, cp_size, q.device)
        out = lse = None
        keep = [] if cp_size == KEEP_PEER_CP else None
        for qs, ks, causal, k_block, v_block, allowed in _ring_blocks(peers, k, v, documents, cp_rank, cp_size,
                                                                      keep=keep):
            block_out, block_lse = block_forward(q[:, :, qs], k_block, v_block, causal, allowed)
            if out is None:  # the diagonal block: every query sees itself, so lse starts finite
                out, lse = block_out.to(block_lse.dtype), block_lse
            else:
                merge_into(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
        out = out.to(q.dtype)
        peer_kv, peer_docs = keep[0] if keep else (None, None)  # at cp 2: the peer's block, for the backward
        ctx.save_for_backward(q, k, v, out, lse, documents, peer_kv, peer_docs)
        ctx.group, ctx.cp_rank, ctx.cp_size = group, cp_rank, cp_size
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, documents, peer_kv, peer_docs = ctx.saved_tensors
        peers = _Peers(ctx.group, ctx.cp_rank, ctx.cp_size, q.device)
        dq = posted = None
        kept = None if peer_kv is None else (peer_kv, peer_docs)
        blocks = _ring_blocks(peers, k, v, documents, ctx.cp_rank, ctx.cp_size, kept)
        for step, (qs, ks, causal, k_block, v_block, allowed) in enumerate(blocks):
            dq_b, dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], k_block, v_block, out[:, :, qs],
                                              lse[:, :, qs], causal, allowed)
            if step == 0:  # this rank's own block: its share stays here until the others' come home
                dq, dk, dv = dq_b, dk_b, dv_b
                continue
            dq[:, :, qs] += dq_b
            # the block's dK/dV so far: begun by the first rank after its owner, then from the rank before
            dkv = _begin_dkv(dk_b, dv_b, ks, k.size(2)) if step == 1 else peers.wait(posted)[0]
            if step > 1:
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            posted = peers.shift([dkv], 1, "passing dK/dV")  # after the last step, to the block's owner
        dkv = peers.wait(posted)[0]
        return dq.to(q.dtype), dk.add_(dkv[0]).to(k.dtype), dv.add_(dkv[1]).to(v.dtype), None, None, None, None


def _begin_dkv(dk_b: torch.Tensor, dv_b: torch.Tensor, ks: slice, length: int) -> torch.Tensor:
    """[2, B, Hkv, length, hd]: a block's first dK/dV share (keys `ks` of `length`), zero for the other keys."""
    if ks == slice(None):
        return torch.stack((dk_b, dv_b))
    dkv = dk_b.new_zeros((2, *dk_b.shape[:2], length, dk_b.size(3)))
    dkv[0][:, :, ks] = dk_b
    dkv[1][:, :, ks] = dv_b
    return dkv


def _all_gather(x: torch.Tensor, what: str, group, cp_rank: int, cp_size: int, host_waits: bool) -> torch.Tensor:
    """[cp, *x.shape]: every rank's x, in cp rank order."""
    x = x.contiguous()
    out = x.new_empty((cp_size * x.size(0), *x.shape[1:]))  # the collective concatenates along dim 0
    work = _all_gather_single(out, x, group=group, async_op=True)
    _sent[0] += (cp_size - 1) * _nbytes(x)
    _wait([work], host_waits, f"all-gathering {what} over cp ranks 0..{cp_size - 1} "
                              f"(global ranks {dist.get_process_group_ranks(group)})", cp_rank)
    return out.view(cp_size, *x.shape)


def _reduce_scatter(x: torch.Tensor, group, cp_rank: int, cp_size: int, host_waits: bool) -> torch.Tensor:
    """x [cp, ...] summed over the group, rank r keeping x[r]."""
    x = x.contiguous()
    _sent[0] += (cp_size - 1) * _nbytes(x[0])
    what = (f"reduce-scattering dK/dV over cp ranks 0..{cp_size - 1} "
            f"(global ranks {dist.get_process_group_ranks(group)})")
    if host_waits:  # gloo reduce-scatters by all-reducing the whole of x: each share goes to its rank instead
        others = [s for s in range(cp_size) if s != cp_rank]
        shares = [torch.empty_like(x[cp_rank]) for _ in others]
        ranks = [dist.get_global_rank(group, s) for s in others]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x[s], g, group, 2) for s, g in zip(others, ranks)]
                                       + [dist.P2POp(dist.irecv, t, g, group, 2) for t, g in zip(shares, ranks)])
        _wait(works, host_waits, what, cp_rank)
        return torch.stack(shares).sum(0).add_(x[cp_rank]) if len(shares) > 1 else shares[0].add_(x[cp_rank])
    out = x.new_empty(x.shape[1:])
    work = _reduce_scatter_single(out, x.view(-1, *x.shape[2:]), group=group, async_op=True)  # splits dim 0
    _wait([work], host_waits, what, cp_rank)
    return out


def _gathered_blocks(r: int, n: int, half: int) -> list[tuple[slice, list[tuple[int, slice]], bool]]:
    """The blocks rank r computes from every rank's K/V: (query slice, [(source rank, key slice)], causal). The
    ring's blocks (_ring_block), with the earlier ranks' key chunks joined into one block and the later ranks'
    into another (softmax does not care in what order keys come): at most three kernels whatever cp, and none
    computes a pair the causal mask would drop."""
    blocks = [(slice(None), [(r, slice(None))], True)]
    if r > 0:
        blocks.append((slice(None), [(s, slice(0, half)) for s in range(r)], False))
    if r < n - 1:
        blocks.append((slice(half, None), [(s, slice(None)) for s in range(r + 1, n)], False))
    return blocks


def _keys(gathered: torch.Tensor, parts, dim: int) -> torch.Tensor:
    """gathered [cp, ...]'s key slices `parts` along `dim` (of one rank's tensor), joined along it."""
    pieces = [gathered[s][(slice(None),) * dim + (ks,)] for s, ks in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _allgather_blocks(k, v, documents, group, r: int, n: int, kept=None, keep: list | None = None):
    """K/V (and document ids) gathered from every cp rank, then per block of _gathered_blocks: (query slice, its
    key parts, causal, the block's K/V [2, B, Hkv, keys, hd], its same-document mask or None). kept: at cp 2, the
    peer's (K/V, document ids) from the forward: nothing is gathered; keep: a list the peer's are appended to,
    copied out of the gathered buffer (whose other half is this rank's own K/V, kept already)."""
    host_waits = k.device.type != "cuda"
    if kept is None:
        kv = _all_gather(torch.stack((k, v)), "K/V", group, r, n, host_waits)  # [cp, 2, B, Hkv, L, hd]
        docs = None if documents is None else _all_gather(documents, "document ids", group, r, n, host_waits)
        if keep is not None:
            keep.append((kv[1 - r].clone(), None if docs is None else docs[1 - r].clone()))
    else:  # cp 2: this rank's and the peer's, in cp rank order
        (peer_kv, peer_docs), own = kept, torch.stack((k, v))
        kv = (own, peer_kv) if r == 0 else (peer_kv, own)
        docs = None if documents is None else ((documents, peer_docs) if r == 0 else (peer_docs, documents))
    for qs, parts, causal in _gathered_blocks(r, n, k.size(2) // 2):
        allowed = None if docs is None else _same_document(documents[:, qs], _keys(docs, parts, 1))
        yield qs, parts, causal, _keys(kv, parts, 3), allowed


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, group, cp_rank, cp_size):
        out = lse = None
        keep = [] if cp_size == KEEP_PEER_CP else None
        for qs, _, causal, kv_block, allowed in _allgather_blocks(k, v, documents, group, cp_rank, cp_size,
                                                                  keep=keep):
            block_out, block_lse = block_forward(q[:, :, qs], kv_block[0], kv_block[1], causal, allowed)
            if out is None:  # the diagonal block first: its lse is finite
                out, lse = block_out.to(block_lse.dtype), block_lse
            else:
                merge_into(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
        out = out.to(q.dtype)
        # local only, but at cp 2 the peer's K/V (one block); at cp > 2 K/V are gathered again in backward
        peer_kv, peer_docs = keep[0] if keep else (None, None)
        ctx.save_for_backward(q, k, v, out, lse, documents, peer_kv, peer_docs)
        ctx.group, ctx.cp_rank, ctx.cp_size = group, cp_rank, cp_size
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, documents, peer_kv, peer_docs = ctx.saved_tensors
        r, n, host_waits = ctx.cp_rank, ctx.cp_size, q.device.type != "cuda"
        dq = dkv = None
        kept = None if peer_kv is None else (peer_kv, peer_docs)
        for qs, parts, causal, kv_block, allowed in _allgather_blocks(k, v, documents, ctx.group, r, n, kept):
            dq_b, dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], kv_block[0], kv_block[1], out[:, :, qs],
                                              lse[:, :, qs], causal, allowed)
            if dq is None:  # the diagonal block, all of this rank's keys: its rows start as this block's
                dq, dkv = dq_b, torch.empty((n, 2, *k.shape), dtype=dk_b.dtype, device=k.device)
                dkv[r][0], dkv[r][1] = dk_b, dv_b
                for s in range(n):
                    if s != r:
                        dkv[s].zero_()
                continue
            dq[:, :, qs] += dq_b
            start = 0
            for s, ks in parts:  # each source's keys back to its own rows
                rows = dkv[s][:, :, :, ks]
                rows[0] += dk_b[:, :, start:start + rows.size(3)]
                rows[1] += dv_b[:, :, start:start + rows.size(3)]
                start += rows.size(3)
        dkv = _reduce_scatter(dkv, ctx.group, r, n, host_waits)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _check(q, k, v, group, cp_rank, cp_size, comm, documents) -> None:
    if comm not in COMMS:
        raise ValueError(f"cp comm {comm!r} is not one of {', '.join(COMMS)}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside cp = {cp_size}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or (q.size(0), q.size(2), q.size(3)) != (
            k.size(0), k.size(2), k.size(3)) or q.size(1) % k.size(1):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q [B, Hq, L, hd] "
                         "and k, v [B, Hkv, L, hd] with Hkv dividing Hq")
    if cp_size > 1 and q.size(2) % 2:
        raise ValueError(f"a local sequence of {q.size(2)} does not hold two equal chunks")
    if documents is not None and tuple(documents.shape) != (q.size(0), q.size(2)):
        raise ValueError(f"documents {tuple(documents.shape)}: expected [B, L] = {(q.size(0), q.size(2))}")
    if cp_size > 1 and dist.get_rank(group) != cp_rank:
        raise ValueError(f"cp_rank {cp_rank} is not this process's rank {dist.get_rank(group)} in the cp group")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp_rank: int, cp_size: int,
                               comm: str = "ring", documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (and, given documents, same-document) attention of this rank's queries over the whole sequence's
    keys, [B, Hq, L, hd] in q's dtype; scale 1/sqrt(hd). cp_size 1: plain attention, no communication (group
    unused, may be None)."""
    _check(q, k, v, group, cp_rank, cp_size, comm, documents)
    k, v = k.to(q.dtype), v.to(q.dtype)
    if cp_size == 1:
        return _local_attention(q, k, v, documents)
    function = _RingAttention if comm == "ring" else _AllGatherAttention
    return function.apply(q, k, v, documents, group, cp_rank, cp_size)


def _local_attention(q, k, v, documents):
    if k.size(1) != q.size(1):
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    if documents is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    L = q.size(2)
    mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril() & (documents[:, :, None] == documents[:, None])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
