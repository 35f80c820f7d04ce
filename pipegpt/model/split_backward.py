"""Split backward (zero-bubble I and W): input gradients now, weight gradients later.

Inside `with defer_weight_grads() as pending:` a backward through the operations below computes
input gradients only and appends to `pending` one closure per operation that later computes and
accumulates its weight/bias gradients into `.grad` (a W action). Outside the context they are
ordinary autograd operations.

The public interface is what the model and the tensor-parallel layers need, nothing more:

    defer_weight_grads()         the context manager (the stage's I action opens it)
    SplitLinear                  nn.Linear whose weight/bias gradients defer (the model's linears)
    split_linear(x, w, b=None)   the same operation as a function, for layers that own their
                                 parameters differently (a row-parallel linear applies its weight
                                 before the all-reduce and its bias after it)
    add_bias(y, bias)            y + bias whose bias gradient defers like SplitLinear's

Knows torch only: not the model, the stages, the schedule or any communication. W closures
never communicate (they read only the saved activations and output gradient).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SplitLinear", "add_bias", "defer_weight_grads", "split_linear"]

# A module-level stack, deliberately NOT thread-local: the autograd engine runs
# CUDA (and other accelerator) backward functions on its own per-device worker
# threads, which would not see a thread-local set by the caller. The list is
# also not captured on ctx at forward time: whether to defer is decided by the
# backward call (an I action), and with recomputation the forward runs again
# later anyway. One process drives one backward at a time, so a global is safe.
_DEFER_STACK: list[list] = []


@contextlib.contextmanager
def defer_weight_grads():
    """Backward passes inside this context compute input grads only; yields the
    list of closures that compute and accumulate the weight/bias grads (W)."""
    pending: list = []
    _DEFER_STACK.append(pending)
    try:
        yield pending
    finally:
        # by identity: list.remove compares by ==, and two empty lists are equal
        del _DEFER_STACK[next(i for i, p in enumerate(_DEFER_STACK) if p is pending)]


def _weight_grads(grad_out, x, need_w: bool, need_b: bool):
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    gw = g2.t().matmul(x.reshape(-1, x.shape[-1])) if need_w else None
    gb = g2.sum(0) if need_b else None
    return gw, gb


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


@torch.no_grad()
def _deferred_w(grad_out, x, weight, bias) -> None:
    gw, gb = _weight_grads(grad_out, x, weight is not None, bias is not None)
    if weight is not None:
        _accumulate(weight, gw)
    if bias is not None:
        _accumulate(bias, gb)


def _autocast_dtype(x: torch.Tensor):
    try:
        if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
    except (TypeError, AttributeError):  # torch < 2.4: no per-device autocast query
        pass
    return None


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = _autocast_dtype(x)
        xc, wc, bc = x, weight, bias
        if dtype is not None:  # do autocast's cast ourselves so backward sees matching dtypes
            xc, wc = x.to(dtype), weight.to(dtype)
            bc = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(xc, wc)
        ctx.params = (weight, bias)  # the leaf Parameters themselves, for deferred accumulation
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors  # unpack once: checkpoint allows a single unpack
        weight, bias = ctx.params
        grad_x = grad_out.matmul(w) if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if (need_w or need_b) and _DEFER_STACK:
            _DEFER_STACK[-1].append(functools.partial(
                _deferred_w, grad_out, x, weight if need_w else None, bias if need_b else None))
            return grad_x, None, None
        gw, gb = _weight_grads(grad_out, x, need_w, need_b)
        return grad_x, gw, gb


class _BiasAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias):
        ctx.bias = bias
        return y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[1]:
            return grad, None
        if _DEFER_STACK:
            _DEFER_STACK[-1].append(functools.partial(_deferred_w, grad, None, None, ctx.bias))
            return grad, None
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias.dtype)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) whose weight/bias gradients defer (see defer_weight_grads).
    Under autocast it casts x, weight and bias to the autocast dtype itself."""
    return _SplitLinearFn.apply(x, weight, bias)


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias (cast to y's dtype) whose bias gradient defers like SplitLinear's."""
    return _BiasAdd.apply(y, bias)


class SplitLinear(nn.Linear):
    """nn.Linear whose weight gradient can be deferred (see defer_weight_grads)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_linear(x, self.weight, self.bias)
