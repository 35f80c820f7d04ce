"""Context-parallel attention (pipegpt.context_parallel.attention) against one-process attention.

One spawn of 4 gloo processes (a module fixture) runs every case: cp 4 over all of them, cp 2 twice (ranks 0-1 and
2-3, so cp ranks differ from global ranks), ring and all-gather, GPT-2-like heads, GQA and MQA, with and without
documents, fp64 / fp32 / bf16, the fused CPU kernel and the math path. The shards, joined, must equal
F.scaled_dot_product_attention on the whole sequence (output and the gradients of q, k and v); bytes sent and
the saved activations match their counts. In one process: the kernels agree, the CUDA choices and calls (on
CPU stand-ins), the load balance, cp 1, bad input.
"""
from __future__ import annotations

import math
import os
import re
import time
import types
import zlib
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipegpt.context_parallel import attention, kernels
from pipegpt.context_parallel.attention import attention_pairs, context_parallel_attention
from pipegpt.context_parallel.chunks import join_sequence, local_positions, shard_sequence
from pipegpt.context_parallel.kernels import block_backward, block_forward, choose_kernel
from plan_memory_harness import StorageTracker, storages_of

pytestmark = pytest.mark.usefixtures("one_thread")
WORLD = 4
DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}


def case(cp, comm, hq, hkv, docs, dtype="f64", kernel=None, batch=2, seq=24, hd=8, recompute=False):
    name = (f"cp{cp}-{comm}-h{hq}kv{hkv}{'-docs' if docs else ''}-{dtype}{'-' + kernel if kernel else ''}-T{seq}"
            f"{'-recompute' if recompute else ''}")
    return dict(name=name, cp=cp, comm=comm, hq=hq, hkv=hkv, docs=docs, dtype=dtype, kernel=kernel, batch=batch,
                seq=seq, hd=hd, recompute=recompute)


HEADS = [(2, 2), (4, 2), (4, 1)]  # GPT-2-like, GQA, MQA
CASES = ([case(cp, comm, hq, hkv, docs) for cp in (2, 4) for comm in ("ring", "allgather") for hq, hkv in HEADS
          for docs in (False, True)]
         + [case(cp, comm, 4, 2, True, kernel="math") for cp in (2, 4) for comm in ("ring", "allgather")]
         + [case(cp, comm, 4, 2, True, "bf16") for cp in (2, 4) for comm in ("ring", "allgather")]
         + [case(4, comm, 4, 1, True, "f32") for comm in ("ring", "allgather")]
         # under torch's checkpoint (full recomputation): the first forward keeps nothing, the recomputed one
         # keeps the peer's K/V at cp 2 and the backward uses it
         + [case(cp, comm, 4, 2, True, recompute=True) for cp in (2, 4) for comm in ("ring", "allgather")])
SLOW_CASES = [case(cp, comm, hq, hkv, docs, dtype, kernel, batch=3, seq=96, hd=16)
              for cp in (2, 4) for comm in ("ring", "allgather") for hq, hkv in HEADS + [(8, 2)] for docs in (False, True)
              for dtype, kernel in (("f64", None), ("f32", None), ("f64", "math"), ("bf16", None))]


def full_inputs(c):
    """q, k, v, dout over the whole sequence (fp64) and document ids [B, T] (nondecreasing, short documents)."""
    g = torch.Generator().manual_seed(zlib.crc32(c["name"].encode()))
    B, T, hd = c["batch"], c["seq"], c["hd"]
    q, dout = (torch.randn(B, c["hq"], T, hd, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, c["hkv"], T, hd, generator=g, dtype=torch.float64) for _ in range(2))
    docs = (torch.rand(B, T, generator=g) < 0.25).long().cumsum(1) if c["docs"] else None
    return q, k, v, dout, docs


def reference(c, dtype=torch.float64):
    """One process: out and the gradients of q, k, v under a causal (& same-document) mask."""
    q, k, v, dout, docs = full_inputs(c)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    g = c["hq"] // c["hkv"]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if docs is None:
        out = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    else:
        T = c["seq"]
        mask = torch.ones(T, T, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
        out = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask[:, None])
    out.backward(dout.to(dtype))
    return out.detach(), q.grad, k.grad, v.grad


def run_case(c, group, cp_rank):
    q, k, v, dout, docs = full_inputs(c)
    dtype = DTYPES[c["dtype"]]
    # [B, L, H, hd] seen as [B, H, L, hd], as the model's heads are (strided views)
    local = [shard_sequence(t, cp_rank, c["cp"], dim=2).to(dtype).transpose(1, 2).contiguous() for t in (q, k, v, dout)]
    leaves = [t.requires_grad_() for t in local[:3]]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    docs = None if docs is None else shard_sequence(docs, cp_rank, c["cp"], dim=1)
    kernels.FORCE_KERNEL = c["kernel"]
    attention.reset_bytes_sent()
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    args = (q, k, v, group, cp_rank, c["cp"], c["comm"], docs)
    if c["recompute"]:  # what the forward leaves alive beside its output: nothing but its inputs
        with StorageTracker() as tracker:
            out = checkpoint(context_parallel_attention, *args, use_reentrant=False)
        inputs = storages_of([out, *leaves, docs])  # aliases of the inputs are seen
        held, deadline = tracker.held(inputs), time.monotonic() + 2.0
        while held and time.monotonic() < deadline:  # gloo's worker thread drops its last Work's tensors a moment
            time.sleep(0.01)                          # after the wait returned: a leak stays, that does not
            held = tracker.held(inputs)
    else:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = context_parallel_attention(*args)
        held = None
    forward_bytes = attention.bytes_sent()
    out.backward(local[3].transpose(1, 2))
    kernels.FORCE_KERNEL = None
    dq, dk, dv = (t.grad.transpose(1, 2) for t in leaves)
    return dict(out=out.detach(), dq=dq, dk=dk, dv=dv, forward_bytes=forward_bytes,
                backward_bytes=attention.bytes_sent() - forward_bytes, saved=sum(saved), held=held)


def worker(rank, port, cases, out_path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    groups = {4: dist.new_group(list(range(4))), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
    broken = dist.new_group([0, 1])
    attention.set_timeout(30)
    results = {}
    for c in cases:
        group = groups[4] if c["cp"] == 4 else groups[2][rank // 2]
        results[c["name"]] = run_case(c, group, rank % c["cp"])
    if rank == 0:  # cp rank 1 never joins: the ring's wait ends, naming it
        attention.set_timeout(0.25)
        x = torch.randn(1, 1, 4, 8)
        start = time.monotonic()
        try:
            context_parallel_attention(x, x, x, broken, 0, 2)
            results["failure"] = ("no error", 0.0)
        except attention.ContextParallelError as e:
            results["failure"] = (str(e), time.monotonic() - start)
    torch.save(results, f"{out_path}.{rank}")
    dist.barrier()
    os._exit(0)  # the broken group's receive is still posted: skip the teardown that would wait for it


def spawn(cases, out_path, timeout_s, target=worker):
    """target(rank, port, cases, out_path) in WORLD processes; what each saved to out_path.<rank>, in rank order."""
    from pipegpt.comm.rpc import free_port

    context = mp.start_processes(target, args=(free_port(), cases, out_path), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cp workers ({target.__name__}) took over {timeout_s}s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [torch.load(f"{out_path}.{r}") for r in range(WORLD)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(CASES, str(tmp_path_factory.mktemp("cp-attention") / "results"), timeout_s=240)


def joined(results, c, key):
    """The whole sequence of `key` from the cp group holding global rank 0."""
    return join_sequence([results[r][c["name"]][key] for r in range(c["cp"])], dim=2)


def check_case(results, c):
    dtype = DTYPES[c["dtype"]]
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 5e-2}[dtype]
    expected = reference(c, ref_dtype)
    for key, want in zip(("out", "dq", "dk", "dv"), expected):
        got = joined(results, c, key)
        assert got.dtype == dtype and got.shape == want.shape, (key, got.dtype, got.shape)
        torch.testing.assert_close(got.to(ref_dtype), want, atol=tol, rtol=tol, msg=lambda m: f"{key}: {m}")
    if c["cp"] == 2:  # the second cp 2 group (global ranks 2 and 3) computed the same
        for key in ("out", "dq", "dk", "dv"):
            assert torch.equal(join_sequence([results[r][c["name"]][key] for r in (2, 3)], dim=2), joined(results, c, key))


@pytest.mark.parametrize("c", CASES, ids=lambda c: c["name"])
def test_matches_one_process_attention(results, c):
    check_case(results, c)


@pytest.mark.slow
def test_matches_one_process_attention_longer_sequences(tmp_path):
    results = spawn(SLOW_CASES, str(tmp_path / "results"), timeout_s=600)
    for c in SLOW_CASES:
        check_case(results, c)


def expected_bytes(c):
    """What one rank sends: forward, backward. Ring: (cp-1) K/V (+ documents) hops each way, cp-1 hops of dK/dV
    (accumulated in fp32, fp64 for fp64; the owner's share never travels); all-gather: K/V (+ documents) to cp-1
    ranks each way, dK/dV's share: the same bytes. At cp 2 the backward sends no K/V (the forward kept the peer's)
    but under recomputation, whose forward passes them again."""
    n, L = c["cp"], c["seq"] // c["cp"]
    size = DTYPES[c["dtype"]].itemsize
    kv = 2 * c["batch"] * c["hkv"] * L * c["hd"]
    docs = c["batch"] * L * 8 if c["docs"] else 0
    grads = kv * (8 if c["dtype"] == "f64" else 4)
    passes = (n > 2) + c["recompute"]  # K/V again in the backward: at cp > 2, and in the recomputed forward
    return (n - 1) * (kv * size + docs), (n - 1) * (passes * (kv * size + docs) + grads)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c["name"])
def test_bytes_sent_and_saved_activations_are_local(results, c):
    """Bytes match the count; what autograd keeps is q, k, v, out, lse and documents of this rank only, and at
    cp 2 the peer's K/V (and documents): one block. Under checkpoint the forward leaves nothing alive but its
    output (and its inputs, not counted)."""
    L = c["seq"] // c["cp"]
    size = DTYPES[c["dtype"]].itemsize
    lse_size = 8 if c["dtype"] == "f64" else 4
    docs = 8 if c["docs"] else 0
    local = c["batch"] * L * ((2 * c["hq"] + 2 * c["hkv"]) * c["hd"] * size + c["hq"] * lse_size + docs)
    peer = c["batch"] * L * (2 * c["hkv"] * c["hd"] * size + docs) if c["cp"] == 2 else 0
    for r in range(c["cp"]):
        row = results[r][c["name"]]
        assert (row["forward_bytes"], row["backward_bytes"]) == expected_bytes(c)
        if c["recompute"]:
            assert (row["saved"], row["held"]) == (0, 0)
        else:
            assert row["saved"] == local + peer


def test_a_silent_peer_ends_the_wait_naming_it(results):
    message, waited = results[0]["failure"]
    assert re.match(r"cp rank 0: context-parallel attention: passing K/V (to|from) cp rank 1 \(global rank 1\) "
                    r"failed after at most 0.25s: ", message), message
    assert waited < 20


# one process


def test_the_fused_cpu_kernel_and_the_math_path_agree():
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        q = torch.randn(2, 4, 6, 8, generator=g).to(dtype)
        k, v = (torch.randn(2, 2, 10, 8, generator=g).to(dtype) for _ in range(2))
        allowed = torch.rand(2, 6, 10, generator=g) < 0.5
        allowed[0, 2] = False  # a row that sees nothing
        for causal, mask in ((False, None), (False, allowed), (True, None), (True, allowed[:, :, :6])):
            kv = (k[:, :, :6], v[:, :, :6]) if causal else (k, v)  # a causal block is square
            (out_m, lse_m), (out_f, lse_f) = (block_forward(q, *kv, causal, mask, kernel=n) for n in ("math", "cpu_flash"))
            torch.testing.assert_close(out_f.to(out_m.dtype), out_m, atol=tol, rtol=tol)
            assert torch.equal(lse_f.isinf(), lse_m.isinf()) and not out_f.isnan().any()
            torch.testing.assert_close(lse_f, lse_m.to(lse_f.dtype), atol=tol, rtol=tol)
            lse = torch.where(lse_m.isinf(), 0.0, lse_m)  # a merged lse is finite
            dout = torch.randn(q.shape, generator=g).to(dtype)
            for a, b in zip(*(block_backward(dout, q, *kv, out_m.to(dtype), lse, causal, mask, kernel=n)
                              for n in ("math", "cpu_flash"))):
                torch.testing.assert_close(b, a, atol=tol * 4, rtol=tol * 4)


def test_the_kernel_choice_by_device():
    assert choose_kernel("cpu", torch.float32, 64, masked=True) == "cpu_flash"
    assert choose_kernel("cpu", torch.bfloat16, 64, masked=False) == "cpu_flash"
    assert choose_kernel("cuda", torch.bfloat16, 128, masked=False) == "cuda_flash"
    assert choose_kernel("cuda", torch.bfloat16, 128, masked=True) == "cuda_efficient"  # flash takes no mask
    assert choose_kernel("cuda", torch.float32, 64, masked=False) == "cuda_efficient"  # flash is fp16/bf16 only
    assert choose_kernel("cuda", torch.float64, 64, masked=False) == "math"
    assert choose_kernel("cuda", torch.bfloat16, 60, masked=False) == "math"  # unaligned head
    assert choose_kernel("mps", torch.float32, 64, masked=False) == "math"


def _standin_aten():
    """CPU stand-ins for the CUDA kernels with their calling conventions (checked): flash takes no mask and
    returns 9 values; efficient takes a bias of q's dtype with 16-aligned rows and pads its lse to 32 rows."""
    def math_forward(q, k, v, causal, bias):
        allowed = None if bias is None else (bias[:, 0] == 0)
        return block_forward(q, k, v, causal, allowed, kernel="math")

    def flash(q, k, v, dropout, causal, debug, *, scale):
        assert dropout == 0 and not debug and scale == 1 / math.sqrt(q.size(-1))
        out, lse = math_forward(q, k, v, causal, None)
        return out.to(q.dtype), lse, None, None, q.size(2), k.size(2), None, None, None

    def flash_backward(dout, q, k, v, out, lse, cq, ck, max_q, max_k, dropout, causal, seed, offset, *, scale):
        assert cq is None and ck is None and (max_q, max_k) == (q.size(2), k.size(2)) and lse.shape == q.shape[:3]
        return block_backward(dout, q, k, v, out, lse, causal, None, kernel="math")

    def efficient(q, k, v, bias, with_lse, dropout, causal, *, scale):
        assert with_lse and (bias is None or (bias.dtype == q.dtype and bias.stride(2) % 16 == 0))
        assert bias is None or not causal
        out, lse = math_forward(q, k, v, causal, bias)
        rows = -(-q.size(2) // 32) * 32
        padded = torch.cat((lse, lse.new_full((*lse.shape[:2], rows - q.size(2)), float("nan"))), -1)
        return out.to(q.dtype), padded, torch.zeros(()), torch.zeros(())

    def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout, grad_mask, causal, *, scale):
        assert lse.size(-1) % 32 == 0 and list(grad_mask) == [True, True, True, False]
        allowed = None if bias is None else (bias[:, 0] == 0)
        return (*block_backward(dout, q, k, v, out, lse[..., :q.size(2)], causal, allowed, kernel="math"), None)

    return types.SimpleNamespace(_scaled_dot_product_flash_attention=flash,
                                 _scaled_dot_product_flash_attention_backward=flash_backward,
                                 _scaled_dot_product_efficient_attention=efficient,
                                 _scaled_dot_product_efficient_attention_backward=efficient_backward)


@pytest.mark.parametrize("kernel", ["cuda_flash", "cuda_efficient"])
def test_the_cuda_kernels_are_called_by_their_conventions(monkeypatch, kernel):
    monkeypatch.setattr(kernels, "_aten", _standin_aten())
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 40, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(2))
    masks = [None] if kernel == "cuda_flash" else [None, torch.rand(2, 40, 40, generator=g) < 0.5]
    for causal in (False, True):
        for mask in masks:
            out, lse = block_forward(q, k, v, causal, mask, kernel="math")
            got_out, got_lse = block_forward(q, k, v, causal, mask, kernel=kernel)
            torch.testing.assert_close(got_out, out)
            torch.testing.assert_close(got_lse, lse)
            lse = torch.where(lse.isinf(), 0.0, lse)
            dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
            for a, b in zip(block_backward(dout, q, k, v, out, lse, causal, mask, kernel="math"),
                            block_backward(dout, q, k, v, out, lse, causal, mask, kernel=kernel)):
                torch.testing.assert_close(b, a)


def mask_count(seq_len, cp_rank, cp_size, docs=None):
    """The True entries of the one-process mask in rank cp_rank's query rows."""
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    return int(mask[:, local_positions(seq_len, cp_rank, cp_size)].sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_every_cp_rank_attends_to_as_many_pairs(cp):
    seq_len, chunk = 64, 64 // (2 * cp)
    pairs = [attention_pairs(seq_len, r, cp) for r in range(cp)]
    assert pairs == [mask_count(seq_len, r, cp) for r in range(cp)]
    assert max(pairs) - min(pairs) <= chunk * (chunk + 1) // 2  # within one chunk's diagonal (here equal)
    assert sum(pairs) == seq_len * (seq_len + 1) // 2
    docs = (torch.rand(3, seq_len, generator=torch.Generator().manual_seed(cp)) < 0.1).long().cumsum(1)
    assert [attention_pairs(seq_len, r, cp, docs) for r in range(cp)] == [mask_count(seq_len, r, cp, docs)
                                                                         for r in range(cp)]


@pytest.mark.parametrize("docs", [False, True])
def test_cp_1_is_plain_causal_attention(docs):
    c = case(1, "ring", 4, 2, docs)
    out, dq, dk, dv = reference(c)
    q, k, v, dout, documents = full_inputs(c)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attention.reset_bytes_sent()
    got = context_parallel_attention(q, k, v, None, 0, 1, documents=documents)
    got.backward(dout)
    assert attention.bytes_sent() == 0
    for a, b in ((got, out), (q.grad, dq), (k.grad, dk), (v.grad, dv)):
        torch.testing.assert_close(a.detach(), b)


def test_bad_input_is_refused():
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 3, 6, 8)
    with pytest.raises(ValueError, match="Hkv dividing Hq"):
        context_parallel_attention(q, k, k, None, 0, 2)
    with pytest.raises(ValueError, match="cp comm 'ulysses' is not one of ring, allgather"):
        context_parallel_attention(q, q, q, None, 0, 2, comm="ulysses")
    with pytest.raises(ValueError, match="cp_rank 2 is outside cp = 2"):
        context_parallel_attention(q, q, q, None, 2, 2)
    with pytest.raises(ValueError, match=r"documents \(1, 5\): expected \[B, L\] = \(1, 6\)"):
        context_parallel_attention(q, q, q, None, 0, 2, documents=torch.zeros(1, 5, dtype=torch.long))
    odd = torch.zeros(1, 4, 5, 8)
    with pytest.raises(ValueError, match="local sequence of 5 does not hold two equal chunks"):
        context_parallel_attention(odd, odd, odd, None, 0, 2)


def test_the_planner_keeps_the_peers_block_where_attention_does():
    from pipegpt.costs import activations

    assert attention.KEEP_PEER_CP == activations.KEEP_PEER_CP == 2
