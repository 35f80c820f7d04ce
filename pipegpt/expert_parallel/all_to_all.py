"""The all-to-all that moves tokens to their experts' ranks and back, as an autograd Function with variable split
sizes, which a caller may start now and wait for later.

    counts = exchange_counts(send_counts, group, timeout_s)       # [ranks, n] each way: who sends whom how many
    pending = start_all_to_all(x, send_splits, recv_splits, group, timeout_s, "dispatch")
    ...                                                           # compute while the tokens travel
    received = pending.wait()                                     # bounded by timeout_s

x's rows go to the group's ranks in order, send_splits[r] of them to rank r (in the group's order); the result
holds recv_splits[r] rows from each rank r, in rank order. The backward is the reverse all-to-all (the splits
swapped), run when autograd reaches it and waited for at once. `all_to_all` is start and wait together.

Every wait is bounded by timeout_s where the backend's Work takes a timeout (gloo; on CUDA a wait only orders
streams and NCCL's own group timeout bounds it), and a failure raises ExpertParallelError naming this rank and
its peers in the group (global ranks): a collective's Work does not say which peer failed it. group None is a
group of one rank (no communication), as pipegpt.comm.mesh leaves a group of one. bytes_sent() counts what this
process sent other ranks through these functions (rows to itself stay local).
"""
from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist


_sent = [0]  # bytes this process sent other ranks through this module


class ExpertParallelError(RuntimeError):
    pass


def bytes_sent() -> int:
    return _sent[0]


def reset_bytes_sent() -> None:
    _sent[0] = 0


# While a traced step runs, pipegpt.observe.exchanges' recorder: each exchange's span, from its post to the end of
# its wait, goes into the step's trace (its mark() is the runtime clock's); None: not recording.
recorder = None


def group_ranks(group) -> list[int]:
    """The group's global ranks in its order ([this rank] for a group of one)."""
    if group is None:
        return [dist.get_rank() if dist.is_initialized() else 0]
    return dist.get_process_group_ranks(group)


def _wait(work, device: torch.device, group, timeout_s: float, what: str) -> None:
    try:
        if device.type == "cuda":
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout_s))
    except Exception as e:  # gloo raises on a timeout or a dead peer
        me = dist.get_rank()
        peers = [r for r in group_ranks(group) if r != me]
        raise ExpertParallelError(f"rank {me}: expert-parallel {what} with peer rank{'s' * (len(peers) > 1)} "
                                  f"{', '.join(map(str, peers))} failed after at most {timeout_s:g}s: {e}") from None


class Pending:
    """A posted all-to-all: wait() gives the received tensor (once it has arrived; bounded by the timeout)."""

    def __init__(self, out: torch.Tensor, work, group, timeout_s: float, what: str):
        self.out, self.work, self.group, self.timeout_s, self.what = out, work, group, timeout_s, what
        self.posted = None if recorder is None or work is None else recorder.mark()

    @property
    def done(self) -> bool:
        return self.work is None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            work, self.work = self.work, None
            _wait(work, self.out.device, self.group, self.timeout_s, self.what)
            if self.posted is not None and recorder is not None:
                recorder.add(self.what, self.posted, self.out.size(0))
        return self.out


def _post(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, timeout_s: float,
          what: str) -> Pending:
    """Post the exchange of x's rows (no autograd): a Pending for the received rows."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    if group is None:
        return Pending(out.copy_(x), None, group, timeout_s, what)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    _sent[0] += (sum(send_splits) - send_splits[dist.get_rank(group)]) * row_bytes
    work = dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits), input_split_sizes=list(send_splits),
                                  group=group, async_op=True)
    return Pending(out, work, group, timeout_s, what)


class _AllToAll(torch.autograd.Function):
    """Forward: post the exchange, hand the Pending out through `box` (its output's values arrive by wait()).
    Backward: the reverse exchange, waited for."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, timeout_s, what, box):
        ctx.splits, ctx.group, ctx.timeout_s, ctx.what = (send_splits, recv_splits), group, timeout_s, what
        pending = _post(x, send_splits, recv_splits, group, timeout_s, what)
        box.append(pending)
        return pending.out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        back = _post(grad, recv_splits, send_splits, ctx.group, ctx.timeout_s, f"{ctx.what} (backward)")
        return back.wait(), None, None, None, None, None, None


def start_all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, timeout_s: float,
                     what: str = "all-to-all") -> Pending:
    """Start sending send_splits[r] of x's rows to the group's rank r and receiving recv_splits[r] from it; the
    Pending's wait() gives the received rows, part of x's autograd graph (the backward runs the reverse)."""
    if len(send_splits) != len(recv_splits) or sum(send_splits) != x.size(0):
        raise ValueError(f"{what}: splits {list(send_splits)} (send) and {list(recv_splits)} (receive) for "
                         f"{x.size(0)} rows: one of each per rank of the group, the sends summing to the rows")
    box: list[Pending] = []
    out = _AllToAll.apply(x, list(send_splits), list(recv_splits), group, timeout_s, what, box)
    pending = box[0]
    pending.out = out  # the autograd output (the same storage the exchange writes)
    return pending


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, timeout_s: float,
               what: str = "all-to-all") -> torch.Tensor:
    return start_all_to_all(x, send_splits, recv_splits, group, timeout_s, what).wait()


def exchange_counts(send_counts: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
    """send_counts [ranks, n] (integers: row r what this rank sends group rank r, per its n kinds) -> [ranks, n]:
    row r what rank r sends this one. Waited for: the counts size the exchange that follows."""
    return post_counts(send_counts, group, timeout_s).wait()


def post_counts(send_counts: torch.Tensor, group, timeout_s: float) -> Pending:
    """exchange_counts posted: its Pending's wait() gives what it returns."""
    ranks = send_counts.size(0)
    return _post(send_counts, [1] * ranks, [1] * ranks, group, timeout_s, "exchange of token counts")


class CarriedExchange:
    """An exchange posted outside autograd that splits a piece's graph in two (stages.overlap's Cut, by its
    duck type: sent, wait(), transpose(grad)), with tensors carried past it unchanged.

    Each side of the cut must reach the other only through it (the Stage runs each side's backward apart), so what
    the compute after the cut needs from before it (a residual stream, routing weights) travels in `sent` beside
    the rows: sent is one flat tensor, the carried tensors then the rows, in a dtype that holds them all exactly.
    Only the rows travel, in their own dtype (bf16 rows under autocast: 2 bytes an element, though the carried
    residual stream makes the flat tensor fp32); the carried part stays on this rank.
    wait() gives the same layout with the rows received; transpose(grad) posts the rows' gradient back (the splits
    swapped) and hands the carried part's gradient straight through. `unpack(received)` splits a received flat
    tensor (or its leaf) back into the carried tensors and the received rows."""

    __slots__ = ("sent", "_shapes", "_dtypes", "_splits", "_width", "_group", "_timeout_s", "_what", "_pending")

    def __init__(self, carried: list[torch.Tensor], rows: torch.Tensor, send_splits: list[int],
                 recv_splits: list[int], group, timeout_s: float, what: str):
        parts = [*carried, rows]
        dtype = parts[0].dtype
        for t in parts[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        self._shapes, self._dtypes = [t.shape for t in carried], [t.dtype for t in parts]
        self._splits, self._width = (list(send_splits), list(recv_splits)), rows.shape[1:]
        self._group, self._timeout_s, self._what = group, timeout_s, what
        self.sent = torch.cat([t.reshape(-1).to(dtype) for t in parts])
        self._pending = self._start(self.sent.detach(), *self._splits, what)

    @property
    def _carried_size(self) -> int:
        return sum(math.prod(s) for s in self._shapes)

    def _start(self, flat: torch.Tensor, send_splits, recv_splits, what) -> "_Joined":
        kept = self._carried_size
        # exact both ways: the rows' values (and their gradient, unpack's cast's) are the rows' dtype's
        rows = flat[kept:].view(-1, *self._width).to(self._dtypes[-1])
        return _Joined(flat[:kept], _post(rows, send_splits, recv_splits, self._group, self._timeout_s, what))

    def wait(self) -> torch.Tensor:
        received, self._pending = self._pending.wait(), None
        # sent's values are read by nothing now (its backward, a cat's, does not read them; the Stage keeps it as
        # the root of the part before the cut): free them, as Stage.release_output frees a stage's output
        self.sent.data = self.sent.new_empty(0)
        return received

    def transpose(self, grad: torch.Tensor) -> "_Joined":
        send_splits, recv_splits = self._splits
        return self._start(grad, recv_splits, send_splits, f"{self._what} (backward)")

    def unpack(self, received: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """received (wait()'s layout) -> the carried tensors (their shapes and dtypes) and the received rows.
        Where the rows' dtype is narrower than the flat tensor's (bf16 rows beside the fp32 residual stream), the
        carried tensors are copied out and received's storage is freed: autograd keeps received (the Stage's leaf)
        for its gradient alone, which it does not read, and the rows are kept once, in their own dtype."""
        out, at = [], 0
        narrower = self._dtypes[-1] != received.dtype
        for shape, dtype in zip(self._shapes, self._dtypes):
            n = math.prod(shape)
            part = received[at:at + n].view(shape)
            out.append(part.clone() if narrower and dtype == received.dtype else part.to(dtype))
            at += n
        rows = received[at:].view(-1, *self._width).to(self._dtypes[-1])
        if narrower:
            received.data = received.new_empty(0)
        return out, rows


class _Joined:
    """A posted exchange's rows behind a part handed straight through: wait() gives both as one flat tensor."""

    __slots__ = ("kept", "pending")

    def __init__(self, kept: torch.Tensor, pending: Pending):
        self.kept, self.pending = kept, pending

    def wait(self) -> torch.Tensor:
        return torch.cat((self.kept, self.pending.wait().reshape(-1).to(self.kept.dtype)))
