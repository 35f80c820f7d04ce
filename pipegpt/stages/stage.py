"""A Stage runs forward and backward of one microbatch on one slice of the model.

It keeps, per microbatch in flight, only what backward needs: the input
(a leaf that collects the input gradient) and the output's autograd graph.

Mixed precision: with autocast_dtype (torch.bfloat16), the forward runs under torch.autocast (a
recomputation under checkpoint inherits it) while parameters stay in their own dtype (fp32 master
weights). The residual stream stays fp32 (embeddings are fp32, and each block adds its bf16 branch
to the fp32 stream), so outputs and input gradients keep the parameters' dtype; the runtime casts them to
the message dtype (--p2p-dtype) when sending and back when receiving.
Backward runs outside autocast, as torch recommends.
"""
from __future__ import annotations

import torch
from torch.autograd import Variable

from pipegpt.model.gpt import GPT, Documents
from pipegpt.model.moe import set_aux_loss_scale
from pipegpt.model.split_backward import defer_weight_grads


class Stage:
    def __init__(self, index: int, num_stages: int, module: GPT, num_microbatches: int,
                 autocast_dtype: torch.dtype | None = None):
        self.index, self.num_stages, self.module = index, num_stages, module
        self.autocast_dtype = autocast_dtype
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.num_microbatches = num_microbatches
        set_aux_loss_scale(module, 1 / num_microbatches)  # the MoE aux losses' gradient: as the loss's (below)
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pending_weight_grads: dict[int, list] = {}
        self.losses: list[torch.Tensor] = []
        self._empty: torch.Tensor | None = None  # what a released output holds (release_output)
        self._ones: torch.Tensor | None = None  # the loss's gradient (_ones_like)
        # Scoring (HellaSwag): the last stage reports per sequence the sum of its targets' losses and their count
        # [rows, 2], not the microbatch's mean loss.
        self.per_row = False

    def forward(self, mb: int, x: torch.Tensor, targets: torch.Tensor | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """Returns the output to pass on (detached), or on the last stage the microbatch loss.
        documents: the microbatch's document boundaries (--document-mask), on every stage."""
        if not self.is_first:
            x = x.detach().requires_grad_()
        self.inputs[mb] = x
        if self.autocast_dtype is None:
            return self._forward(mb, x, targets, documents)
        with torch.autocast(x.device.type, dtype=self.autocast_dtype):
            return self._forward(mb, x, targets, documents)

    def _forward(self, mb: int, x: torch.Tensor, targets: torch.Tensor | None,
                 documents: Documents | None) -> torch.Tensor:
        if self.is_last and self.per_row:
            losses = self.module(x, targets, documents=documents, reduction="none").float()
            rows = torch.stack((losses.sum(dim=-1), (targets != -1).sum(dim=-1).to(losses.dtype)), dim=-1)
            self.losses.append(rows)
            return rows
        if self.is_last:
            loss = self.module(x, targets, documents=documents)
            detached = loss.detach()
            self.losses.append(detached)
            # Microbatches are equal-sized, so the mean of their mean losses is the batch's mean loss.
            self.outputs[mb] = loss / self.num_microbatches
            return detached
        out = self.module(x, documents=documents)
        self.outputs[mb] = out
        return out.detach()

    def release_output(self, mb: int) -> None:
        """Drop the stage's hold on the output's storage once a send has it: backward needs only its graph,
        and the send's message keeps the storage until the runtime releases the send.

        Safe because every stage ends in a residual add, whose backward does not read its output.
        """
        out = self.outputs.get(mb)
        if out is not None:
            empty = self._empty
            if empty is None or empty.dtype != out.dtype or empty.device != out.device:
                empty = self._empty = torch.empty(0, dtype=out.dtype, device=out.device)
            out.data = empty  # one shared empty tensor, not one per microbatch: nothing writes to no elements

    def backward(self, mb: int, grad_output: torch.Tensor | None, split: bool = False) -> torch.Tensor | None:
        """Full backward (B), or with split=True only the input gradient (I), keeping W for later."""
        out, x = self.outputs.pop(mb), self.inputs.pop(mb)
        grads = (self._ones_like(out),) if self.is_last else (grad_output,)
        if split:
            with defer_weight_grads() as pending:
                _run_backward(out, grads)
            self.pending_weight_grads[mb] = pending
        else:
            _run_backward(out, grads)
        return None if self.is_first else x.grad

    def _ones_like(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss's gradient, made once: autograd reads it, never writes to it (a leaf's .grad would be a copy:
        this reference keeps autograd from taking it over)."""
        ones = self._ones
        if ones is None or ones.shape != loss.shape or ones.dtype != loss.dtype or ones.device != loss.device:
            ones = self._ones = torch.ones_like(loss)
        return ones

    def backward_weight(self, mb: int) -> None:
        for accumulate in self.pending_weight_grads.pop(mb):
            accumulate()

    def discard(self) -> None:
        """Forget every microbatch in flight (after an evaluation pass: forwards with no backward)."""
        self.inputs.clear()
        self.outputs.clear()

    def pop_losses(self) -> list[torch.Tensor]:
        losses, self.losses = self.losses, []
        return losses


def _run_backward(out: torch.Tensor, grads) -> None:
    # The engine call (as Megatron does) skips backward()'s shape check, which a
    # released output (empty storage, intact graph) would fail.
    Variable._execution_engine.run_backward(
        (out,), grads, keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)
