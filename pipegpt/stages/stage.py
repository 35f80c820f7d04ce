"""A Stage runs forward and backward of one microbatch on one slice of the model, whole or piece by piece.

It keeps, per microbatch in flight, only what backward needs: per piece its input (a leaf that collects the
input gradient; the stage's first input on the first stage is the tokens) and its output's autograd graph.

Pieces: the whole-stage actions run the slice as one piece, the module's own call (compiled under --compile).
forward_pieces and backward_pieces run it one named piece at a time (the embedding, each block, the head with
the loss), with a detached-with-grad input at each seam as between two stages, so something else can run
between two pieces: a composite action runs two microbatches' pieces in turns (interleave). Both go through
the same walk (_forward_walk, _backward_walk): a whole-stage action is that walk over one piece, and a backward
walks whichever pieces its forward ran. No context (autocast, deferred weight gradients) stays open between
two pieces, so interleaved walks do not see each other's. A piece may post communication and yield its handle
(stages.overlap): run alone it is waited for at once; in a pair (interleave), just before the piece goes on,
after the other half's next piece has computed.

Mixed precision: with autocast_dtype (torch.bfloat16), the forward runs under torch.autocast (a
recomputation under checkpoint inherits it) while parameters stay in their own dtype (fp32 master
weights). The residual stream stays fp32 (embeddings are fp32, and each block adds its bf16 branch
to the fp32 stream), so outputs and input gradients keep the parameters' dtype; the runtime casts them to
the message dtype (--p2p-dtype) when sending and back when receiving.
Backward runs outside autocast, as torch recommends.
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Callable, Generator

import torch
from torch.autograd import Variable

from pipegpt.model.gpt import GPT, Documents
from pipegpt.model.moe import set_aux_loss_scale
from pipegpt.model.split_backward import defer_weight_grads

WHOLE = "stage"  # the one piece of a whole-stage action: the module's own call

# piece(x, targets, documents, reduction) -> its output; targets and reduction matter to the head only
Piece = Callable[[torch.Tensor, "torch.Tensor | None", "Documents | None", str], torch.Tensor]


class PieceRun:
    """One action's work on one microbatch, a piece per step(): step() runs the next piece (or the part of one
    up to the communication it posts) and says whether one is left; `pending` is the handle it yielded, to
    wait for before the next step; once none is left, `result` holds what the whole action returns."""

    __slots__ = ("_walk", "result", "done", "pending")

    def __init__(self, walk: Generator):
        self._walk, self.result, self.done, self.pending = walk, None, False, None

    def step(self) -> bool:
        """Wait for the communication the last step posted (its consumer is this step), then run this step."""
        handle, self.pending = self.pending, None
        try:
            self.pending = self._walk.send(None if handle is None else handle.wait())
            return True
        except StopIteration as end:
            self.result, self.done = end.value, True
            return False

    def finish(self):
        """Run the pieces left; the action's result."""
        while not self.done:
            self.step()
        return self.result


def _finish(walk: Generator):
    """Run a walk to its end, each handle it yields waited for at once; what it returns (a whole-stage action:
    its one piece, no PieceRun around it)."""
    try:
        handle = next(walk)
        while True:
            handle = walk.send(None if handle is None else handle.wait())
    except StopIteration as end:
        return end.value


def interleave(*runs: PieceRun, done: Callable[[int, object], None] | None = None) -> list:
    """Run the runs' pieces in turns until every one is done: two microbatches' actions as one composite action.
    A run keeps the turn while its steps post nothing (its next piece hides nobody's communication by waiting)
    and gives it to the next run once a step has posted communication (its `pending` handle), which is waited for
    at its next step, after the other runs' steps have computed. The turns depend on what the steps post, not on
    when anything arrives, so every rank of a collective posts in the same order. done(i, result), where given,
    is told as soon as run i ends (the runtime posts its output's send then, while the other still computes).
    Returns their results, in the order given."""
    live, turn = list(enumerate(runs)), 0
    while live:
        i, run = live[turn]
        if not run.step():
            del live[turn]
            if done is not None:
                done(i, run.result)
        elif run.pending is not None:
            turn += 1
        turn = turn % len(live) if live else 0
    return [run.result for run in runs]


def _steps(piece: Piece, x, targets, documents, reduction, context, seams: list, cuts: dict) -> Generator:
    """A piece's call under `context` (autocast, or none); a piece that returns a generator of handles is driven
    a step at a time, each step under the context and none open across a yield (the other half of a pair runs
    there). A Cut (a handle with `sent` and transpose(), stages.overlap) ends a seam at what it sent and starts
    the next at what it received (a leaf that collects the gradient to send back): backward runs the piece's
    compute on each side of it apart, the gradient's communication between. Returns (the last seam's input, the
    piece's output)."""
    with context():
        out = piece(x, targets, documents, reduction)
    if not isinstance(out, types.GeneratorType):
        return x, out
    steps, received = out, None
    while True:
        with context():
            try:
                handle = steps.send(received)
            except StopIteration as end:
                return x, end.value
        received = yield handle
        if getattr(handle, "transpose", None) is not None:
            seams.append((x, handle.sent))
            x = received = received.detach().requires_grad_()
            cuts[len(seams)] = handle


class Stage:
    def __init__(self, index: int, num_stages: int, module: GPT, num_microbatches: int,
                 autocast_dtype: torch.dtype | None = None):
        self.index, self.num_stages, self.module = index, num_stages, module
        self.autocast_dtype = autocast_dtype
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.num_microbatches = num_microbatches
        set_aux_loss_scale(module, 1 / num_microbatches)  # the MoE aux losses' gradient: as the loss's (below)
        # Per microbatch in flight, per piece in forward order: (its input, its output with the graph behind it).
        self.seams: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pending_weight_grads: dict[int, list[list]] = {}  # per microbatch, per piece run: its W closures
        # Per microbatch in flight, seam index -> the Cut (stages.overlap) whose received tensor is that seam's
        # input: its backward posts the gradient's communication back.
        self.cuts: dict[int, dict[int, object]] = {}
        self.losses: list[torch.Tensor] = []
        self._empty: torch.Tensor | None = None  # what a released output holds (release_output)
        self._ones: torch.Tensor | None = None  # the loss's gradient (_ones_like)
        self._whole: tuple[tuple[str, Piece], ...] = ((WHOLE, self._call_module),)
        self._layers: tuple[tuple[str, Piece], ...] | None = None  # made at first use: after tp/cp/compile
        # Scoring (HellaSwag): the last stage reports per sequence the sum of its targets' losses and their count
        # [rows, 2], not the microbatch's mean loss.
        self.per_row = False

    @property
    def inputs(self) -> dict[int, torch.Tensor]:
        """The stage's input per microbatch in flight."""
        return {mb: seams[0][0] for mb, seams in self.seams.items() if seams}

    def piece_names(self) -> tuple[str, ...]:
        """The slice's pieces in forward order: "embedding", "block.<layer>" for each block, "head"."""
        return tuple(name for name, _ in self.layer_pieces())

    def layer_pieces(self) -> tuple[tuple[str, Piece], ...]:
        """(name, piece) in forward order. Pieces call the model's own parts (GPT.embedding, block_forward,
        head_forward), uncompiled: --compile compiles the module's whole call, the whole-stage piece."""
        if self._layers is None:
            m, pieces = self.module, []
            if m.embed:
                pieces.append(("embedding", lambda x, targets, documents, reduction: m.embedding(x, None, documents)))
            for layer, block in m.blocks.items():
                steps = getattr(block, "forward_steps", None)  # a block that posts communication (stages.overlap)
                pieces.append((f"block.{layer}", functools.partial(_block_steps, steps) if steps is not None
                               else functools.partial(_block_piece, m.block_forward, block)))
            if m.head:
                pieces.append(("head", lambda x, targets, documents, reduction: m.head_forward(x, targets, reduction)))
            self._layers = tuple(pieces)
        return self._layers

    def _call_module(self, x, targets, documents, reduction):
        return self.module(x, targets, documents=documents, reduction=reduction)

    def forward(self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """Returns the output to pass on (detached), or on the last stage the microbatch loss.
        documents: the microbatch's document boundaries (--document-mask), on every stage."""
        return _finish(self._forward_walk(mb, x, targets, documents, self._whole))

    def forward_pieces(self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None,
                       documents: Documents | None = None) -> PieceRun:
        """forward() one piece (piece_names) per step of the run returned; its result is forward()'s."""
        return PieceRun(self._forward_walk(mb, x, targets, documents, self.layer_pieces()))

    def _forward_walk(self, mb, x, targets, documents, pieces) -> Generator[None, None, torch.Tensor]:
        if not self.is_first:
            x = x.detach().requires_grad_()
        seams = self.seams[mb] = []
        cuts = self.cuts[mb] = {}
        reduction = "none" if self.is_last and self.per_row else "mean"
        last = len(pieces) - 1
        context = contextlib.nullcontext if self.autocast_dtype is None else \
            functools.partial(torch.autocast, x.device.type, dtype=self.autocast_dtype)
        for i, (_, piece) in enumerate(pieces):
            if i:
                yield
                x = out.detach().requires_grad_()
            x, out = yield from _steps(piece, x, targets if i == last else None, documents, reduction, context, seams,
                                       cuts)
            seams.append((x, out))
        return self._finish_forward(seams, out, targets)

    def _finish_forward(self, seams: list, out: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        if self.is_last and self.per_row:
            losses = out.float()
            rows = torch.stack((losses.sum(dim=-1), (targets != -1).sum(dim=-1).to(losses.dtype)), dim=-1)
            self.losses.append(rows)
            return rows
        if self.is_last:
            detached = out.detach()
            self.losses.append(detached)
            # Microbatches are equal-sized, so the mean of their mean losses is the batch's mean loss.
            seams[-1] = (seams[-1][0], out / self.num_microbatches)
            return detached
        return out.detach()

    def release_output(self, mb: int) -> None:
        """Drop the stage's hold on the output's storage once a send has it: backward needs only its graph,
        and the send's message keeps the storage until the runtime releases the send.

        Safe because every stage ends in a residual add, whose backward does not read its output.
        """
        seams = self.seams.get(mb)
        if seams:
            out = seams[-1][1]
            empty = self._empty
            if empty is None or empty.dtype != out.dtype or empty.device != out.device:
                empty = self._empty = torch.empty(0, dtype=out.dtype, device=out.device)
            out.data = empty  # one shared empty tensor, not one per microbatch: nothing writes to no elements

    def backward(self, mb: int, grad_output: torch.Tensor | None, split: bool = False) -> torch.Tensor | None:
        """Full backward (B), or with split=True only the input gradient (I), keeping W for later."""
        return _finish(self._backward_walk(mb, grad_output, split))

    def backward_pieces(self, mb: int, grad_output: torch.Tensor | None, split: bool = False) -> PieceRun:
        """backward() one piece per step of the run returned, last piece first; its result is backward()'s."""
        return PieceRun(self._backward_walk(mb, grad_output, split))

    def _backward_walk(self, mb, grad, split) -> Generator[None, None, torch.Tensor | None]:
        seams, cuts = self.seams.pop(mb), self.cuts.pop(mb, {})
        pending = self.pending_weight_grads.setdefault(mb, []) if split else None
        for i in range(len(seams) - 1, -1, -1):
            x, out = seams[i]
            grads = (self._ones_like(out),) if self.is_last and i == len(seams) - 1 else (grad,)
            if split:
                with defer_weight_grads() as deferred:
                    _run_backward(out, grads)
                pending.append(deferred)
            else:
                _run_backward(out, grads)
            if i:
                grad = x.grad
                cut = cuts.get(i)
                if cut is None:
                    yield
                else:  # x came through communication: its gradient goes back the same way, waited for next step
                    grad = yield cut.transpose(grad)
        return None if self.is_first else x.grad

    def _ones_like(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss's gradient, made once: autograd reads it, never writes to it (a leaf's .grad would be a copy:
        this reference keeps autograd from taking it over)."""
        ones = self._ones
        if ones is None or ones.shape != loss.shape or ones.dtype != loss.dtype or ones.device != loss.device:
            ones = self._ones = torch.ones_like(loss)
        return ones

    def backward_weight(self, mb: int) -> None:
        _finish(self._weight_walk(mb))

    def weight_pieces(self, mb: int) -> PieceRun:
        """backward_weight() one piece per step, in the order of the I pieces that deferred them."""
        return PieceRun(self._weight_walk(mb))

    def _weight_walk(self, mb) -> Generator[None, None, None]:
        for i, deferred in enumerate(self.pending_weight_grads.pop(mb)):
            if i:
                yield
            for accumulate in deferred:
                accumulate()

    def discard(self) -> None:
        """Forget every microbatch in flight (after an evaluation pass: forwards with no backward)."""
        self.seams.clear()
        self.cuts.clear()

    def pop_losses(self) -> list[torch.Tensor]:
        losses, self.losses = self.losses, []
        return losses


def _block_piece(block_forward, block, x, targets, documents, reduction):
    return block_forward(block, x, None, documents)


def _block_steps(forward_steps, x, targets, documents, reduction):
    return forward_steps(x, documents)


def _run_backward(out: torch.Tensor, grads) -> None:
    # The engine call (as Megatron does) skips backward()'s shape check, which a
    # released output (empty storage, intact graph) would fail.
    Variable._execution_engine.run_backward(
        (out,), grads, keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)
