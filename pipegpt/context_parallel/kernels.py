"""Attention of one block of queries over one block of keys on one device, with its log-sum-exp.

Context-parallel attention (attention.py) computes a query block against several key blocks and merges the partial
outputs by their log-sum-exp; the backward of each block takes the merged output and log-sum-exp (then a block's
gradients are exactly its share of the whole). So every block needs a kernel that returns the log-sum-exp and a
backward that accepts one:

    cpu_flash       torch's CPU flash kernel (an additive float mask of q's dtype)
    cuda_flash      CUDA flash (fp16/bf16, no mask: causal or unmasked blocks only)
    cuda_efficient  CUDA memory-efficient (fp32 too, an additive bias; log-sum-exp padded to 32 rows)
    math            plain torch, softmax in fp32 (fp64 for fp64 inputs): any device, the reference

choose_kernel is the one device-dependent choice. A block's mask is `causal` (the square diagonal block, local
order = global order) and/or `allowed` (bool [B or 1, Lq, Lk], e.g. same document). A row with no allowed key gets
output 0 and log-sum-exp -inf whatever the kernel returns (CPU flash returns lse 0 there), so merging never makes
NaN. Grouped-query attention: k and v hold Hkv heads; q head h uses kv head h // (Hq / Hkv) (repeat_interleave, as
the model); dk and dv come back with Hkv heads. Gradients are returned in fp32.
"""
from __future__ import annotations

import math

import torch

KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "math")
FORCE_KERNEL: str | None = None  # tests and benchmarks: one kernel for every block ("math" to compare)

_aten = torch.ops.aten


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """The kernel for blocks on `device_type` in `dtype`; `masked`: the block needs a mask beyond causal."""
    if FORCE_KERNEL is not None:
        return FORCE_KERNEL
    if device_type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "cpu_flash"
    if device_type == "cuda" and head_dim % 8 == 0:
        if not masked and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
            return "cuda_flash"
        if dtype in (torch.float16, torch.bfloat16, torch.float32) and head_dim <= 128:
            return "cuda_efficient"
    return "math"


def _expand_heads(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.size(1) == heads else k.repeat_interleave(heads // k.size(1), dim=1)


def _fold_heads(dk: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, L, hd] gradients of expanded kv heads summed back to [B, kv_heads, L, hd]."""
    B, H, L, hd = dk.shape
    return dk if H == kv_heads else dk.view(B, kv_heads, H // kv_heads, L, hd).sum(2)


def _full_mask(causal: bool, allowed: torch.Tensor | None, lq: int, lk: int, device) -> torch.Tensor | None:
    """bool [B or 1, Lq, Lk] of what a query may see, or None when everything is allowed."""
    if not causal:
        return allowed
    tril = torch.ones(lq, lk, dtype=torch.bool, device=device).tril()[None]
    return tril if allowed is None else allowed & tril


def _additive(mask: torch.Tensor, dtype: torch.dtype, lk_align: int = 1) -> torch.Tensor:
    """[B, 1, Lq, Lk] 0 where allowed, -inf elsewhere; its rows' storage padded to lk_align elements."""
    b, lq, lk = mask.shape
    padded = -(-lk // lk_align) * lk_align
    bias = torch.zeros(b, 1, lq, padded, dtype=dtype, device=mask.device)[..., :lk]
    return bias.masked_fill_(~mask[:, None], float("-inf"))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _math_scores(q, k, mask, scale):
    s = torch.matmul(q.to(_compute_dtype(q.dtype)), k.to(_compute_dtype(q.dtype)).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask[:, None], float("-inf"))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  allowed: torch.Tensor | None = None, kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, Hq, Lq, hd] (q's dtype, fp32/fp64 from math) and lse [B, Hq, Lq] fp32 (fp64 for fp64)."""
    Lq, Lk, hd = q.size(2), k.size(2), q.size(3)
    scale = 1.0 / math.sqrt(hd)
    kernel = kernel or choose_kernel(q.device.type, q.dtype, hd, allowed is not None)
    k, v = _expand_heads(k, q.size(1)), _expand_heads(v, q.size(1))
    # a causal block alone needs no mask but in plain torch: the fused kernels take the flag, and a square
    # causal block leaves no row empty
    mask = _full_mask(causal, allowed, Lq, Lk, q.device) if allowed is not None or kernel == "math" else None
    with torch.autocast(q.device.type, enabled=False):
        if kernel == "math":
            s = _math_scores(q, k, mask, scale)
            lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # an empty row: p = 0
            return torch.matmul(p, v.to(s.dtype)), lse
        if kernel == "cpu_flash":
            bias = None if allowed is None else _additive(mask, q.dtype)
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal and bias is None, attn_mask=bias, scale=scale)
        elif kernel == "cuda_flash":
            out, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        elif kernel == "cuda_efficient":
            bias = None if allowed is None else _additive(mask, q.dtype, 16).expand(-1, q.size(1), -1, -1)
            out, lse = _aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, causal and bias is None, scale=scale)[:2]
            lse = lse[..., :Lq]  # padded to a multiple of 32 rows
        else:
            raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    lse = lse.to(_compute_dtype(q.dtype)).contiguous()
    if mask is not None:  # a row with no allowed key: output 0, lse -inf, whatever the kernel made of it
        empty = ~mask.any(-1)[:, None]
        if empty.any():
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, allowed: torch.Tensor | None = None,
                   kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [B, Hq, Lq, hd], dk and dv [B, Hkv, Lk, hd] (fp32; fp64 for fp64) of this block's share, given the
    merged out (q's dtype) and lse (finite: every query sees at least itself somewhere)."""
    Hq, Hkv, Lq, Lk, hd = q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)
    scale = 1.0 / math.sqrt(hd)
    kernel = kernel or choose_kernel(q.device.type, q.dtype, hd, allowed is not None)
    ke, ve = _expand_heads(k, Hq), _expand_heads(v, Hq)
    mask = _full_mask(causal, allowed, Lq, Lk, q.device) if allowed is not None or kernel == "math" else None
    lse = lse.contiguous()
    with torch.autocast(q.device.type, enabled=False):
        if kernel == "math":
            ct = _compute_dtype(q.dtype)
            p = torch.exp(_math_scores(q, ke, mask, scale) - lse.to(ct)[..., None])
            do, vc = dout.to(ct), ve.to(ct)
            dv = torch.matmul(p.transpose(-1, -2), do)
            delta = (do * out.to(ct)).sum(-1, keepdim=True)
            ds = p * (torch.matmul(do, vc.transpose(-1, -2)) - delta) * scale
            dq, dk = torch.matmul(ds, ke.to(ct)), torch.matmul(ds.transpose(-1, -2), q.to(ct))
        elif kernel == "cpu_flash":
            bias = None if allowed is None else _additive(mask, q.dtype)
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, ke, ve, out, lse, 0.0, causal and bias is None, attn_mask=bias, scale=scale)
        elif kernel == "cuda_flash":
            # Not varlen (no cumulative lengths); dropout 0, so the RNG state is never read.
            seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
            offset = torch.zeros((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse, None, None, Lq, Lk, 0.0, causal, seed, offset, scale=scale)
        elif kernel == "cuda_efficient":
            bias = None if allowed is None else _additive(mask, q.dtype, 16).expand(-1, Hq, -1, -1)
            padded = torch.nn.functional.pad(lse, (0, -(-Lq // 32) * 32 - Lq))  # the kernel reads 32-row tiles
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
                dout, q, ke, ve, bias, out, padded, seed, seed, 0.0, [True, True, True, False],
                causal and bias is None, scale=scale)
        else:
            raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    acc = _compute_dtype(q.dtype)
    return dq.to(acc), _fold_heads(dk.to(acc), Hkv), _fold_heads(dv.to(acc), Hkv)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge a block's partial attention into the running (out, lse), in place (fp32). lse must be finite
    (the diagonal block comes first); a block row with lse -inf and output 0 changes nothing."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new)[..., None]).add_(block_out.to(out.dtype) * torch.exp(block_lse - new)[..., None])
    lse.copy_(new)
