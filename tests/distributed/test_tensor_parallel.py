"""Tensor parallelism against the one-process model: loss (or output hidden states), input
gradient and every named parameter's gradient, gathered to full shape, for whole models and
slices, tied and untied, with vocabulary padding, with and without sequence parallelism and the
I/W split. One pair of gloo processes (tp=2) runs every case; the parent compares.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.testing import assert_close

from pipegpt.config import ConfigError, ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.model.split_backward import SplitLinear, defer_weight_grads
from pipegpt.config import validate_tp
from pipegpt.tensor_parallel import (DIM0, DIM1, KV_DIM0, QKV_DIM0, REPLICATED, gather_full, gather_state_dicts,
                                     kv_replicas, shard_state_dict, shard_tensor, tp_shard_spec)
from pipegpt.tensor_parallel.collectives import scatter_to_sequence, vocab_parallel_cross_entropy
from pipegpt.tensor_parallel.layers import (replicated_kv_params, partial_grad_params, shard_for_tp,
                                            sum_replicated_kv_grads)

TP = 2
SEED = 4321
RTOL, ATOL = 1e-5, 1e-7
B = 2
CONFIGS = {
    "tied": ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_embd=32),
    # 61 -> 64: rank 1 holds 29 real columns and 3 padding ones
    "untied-pad": ModelConfig(vocab_size=61, seq_len=8, n_layer=2, n_head=4, n_embd=32,
                              tie_embeddings=False, pad_vocab_to=8),
    # 30 -> 64: rank 1's vocabulary shard is all padding
    "tied-pad-shard": ModelConfig(vocab_size=30, seq_len=8, n_layer=2, n_head=4, n_embd=32, pad_vocab_to=64),
    "no-bias": ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_embd=32, bias=False),
    # Llama: grouped-query attention (2 kv heads: one per tp rank), q/k/v biases, untied
    "llama-gqa": ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48,
                             arch="llama", bias=False, qkv_bias=True, tie_embeddings=False),
    # multi-query (1 kv head: replicated on both tp ranks, its gradient summed over them), tied
    "llama-mqa": ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_kv_head=1, n_embd=32, ffn_hidden=48,
                             arch="llama", bias=False),
}
SLICES = {  # (layers, embed, head)
    "full": (range(0, 2), True, True),
    "first": (range(0, 1), True, False),
    "middle": (range(1, 2), False, False),
    "head": (range(1, 2), False, True),
    "bare-head": (range(2, 2), False, True),
}
# name: (config, slice, sequence_parallel, I/W split, recompute)
CASES = {
    "full-tied": ("tied", "full", False, False, "none"),
    "full-tied-sp": ("tied", "full", True, False, "none"),
    "full-tied-split": ("tied", "full", False, True, "none"),
    "full-tied-sp-split": ("tied", "full", True, True, "none"),
    "full-untied-pad": ("untied-pad", "full", False, False, "none"),
    "full-untied-pad-sp": ("untied-pad", "full", True, True, "none"),
    "full-pad-shard": ("tied-pad-shard", "full", False, False, "none"),
    "full-pad-shard-sp": ("tied-pad-shard", "full", True, False, "none"),
    "full-no-bias-sp-split": ("no-bias", "full", True, True, "none"),
    "first-sp": ("tied", "first", True, False, "none"),
    "middle": ("tied", "middle", False, False, "none"),
    "middle-sp": ("tied", "middle", True, False, "none"),
    "middle-sp-split-recompute": ("tied", "middle", True, True, "full"),
    "middle-split-selective": ("tied", "middle", False, True, "selective"),
    "head-tied": ("tied", "head", False, False, "none"),
    "head-tied-sp-split": ("tied", "head", True, True, "none"),
    "head-untied-pad-sp": ("untied-pad", "head", True, False, "none"),
    "bare-head-pad-shard": ("tied-pad-shard", "bare-head", False, False, "none"),
    "llama-full-sp-split": ("llama-gqa", "full", True, True, "none"),
    "llama-mqa-full": ("llama-mqa", "full", False, False, "none"),
    "llama-mqa-full-sp-split": ("llama-mqa", "full", True, True, "none"),
    "llama-mqa-middle-sp-split-selective": ("llama-mqa", "middle", True, True, "selective"),
    "llama-head-sp": ("llama-gqa", "head", True, False, "none"),
}
# Under bf16 autocast: the same cases, against the one-process model under autocast too.
BF16_CASES = ("full-tied", "full-tied-sp-split", "middle-sp", "llama-full-sp-split")
_F32 = torch.float32
BF16_FP32_COLLECTIVES = {
    "full-tied": [("all_reduce", _F32)] * 4,  # embedding x 2, cross-entropy x 2
    "full-tied-sp-split": [("reduce_scatter", _F32)] * 2 + [("all_gather", _F32), ("all_reduce", _F32),
                                                             ("all_reduce", _F32)],  # + the embedding's backward
    "middle-sp": [],
    "llama-full-sp-split": [("reduce_scatter", _F32)] * 2 + [("all_gather", _F32), ("all_reduce", _F32),
                                                              ("all_reduce", _F32)],  # as GPT-2's: no wpe to add
}
# Measured: at most 6.8e-3 (normwise, over every parameter's gradient of these cases), bf16's 2^-8 rounding
# of partial sums; a gradient that lost or doubled a rank's part is off by ~0.5 or more.
BF16_GRAD_RTOL = 2e-2
# name: (rows shape, padded vocab, real vocab_size)
CE_CASES = {"plain": ((24,), 64, None), "pad": ((24,), 64, 60), "pad-whole-shard": ((4, 6), 64, 30)}


pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(cfg: ModelConfig):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    y[0, :3] = -1  # ignored targets
    h = torch.randn(B, cfg.seq_len, cfg.n_embd, generator=g)
    grad = torch.randn(B, cfg.seq_len, cfg.n_embd, generator=g)
    return x, y, h, grad


def run_case(name: str, tp_rank: int = 0, tp_size: int = 1, group=None, bf16: bool = False) -> dict:
    """One case on one rank; tp_size=1 is the one-process reference. bf16: forward under bf16 autocast."""
    cfg_name, slice_name, sp, split, recompute = CASES[name]
    cfg = CONFIGS[cfg_name]
    layers, embed, head = SLICES[slice_name]
    torch.manual_seed(0)
    model = GPT(cfg, layers=layers, embed=embed, head=head, recompute=recompute, init_seed=SEED)
    sp = sp and tp_size > 1
    if tp_size > 1:
        shard_for_tp(model, tp_rank, tp_size, group, sequence_parallel=sp)
    x, y, h, grad = inputs(cfg)
    if sp:  # hidden states between stages are sequence chunks
        h, grad = h.chunk(tp_size, 1)[tp_rank], grad.chunk(tp_size, 1)[tp_rank]
    inp = x if embed else h.clone().requires_grad_()
    result = {}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    if head:  # without targets: the logits of this rank's real vocabulary columns
        with torch.no_grad(), autocast:
            result["logits"] = model(inp)
    with autocast:
        out = model(inp, y if head else None)
    result["out"] = out.detach().clone()
    if split:
        with defer_weight_grads() as pending:
            out.backward(None if head else grad)
        embedding = model.wte.weight if embed else None  # its (tied) grad is not a linear's: not deferred
        linears = [m for m in model.modules() if isinstance(m, SplitLinear)]
        result["deferred"] = bool(pending) and all(
            p.grad is None for m in linears for p in m.parameters() if p is not embedding)
        for w in pending:
            w()
    else:
        out.backward(None if head else grad)
    if tp_size > 1:
        for p in partial_grad_params(model):
            dist.all_reduce(p.grad, group=group)
        sum_replicated_kv_grads(replicated_kv_params(model), group, cfg.kv_heads, tp_rank, tp_size)
    result["in_grad"] = None if embed else inp.grad.clone()
    result["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    result["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    result["all_split_linear"] = all(isinstance(m, SplitLinear) for m in model.modules() if isinstance(m, torch.nn.Linear))
    result["tied_local"] = embed and head and model.lm_head.weight is model.wte.weight
    result["sp_params"] = sorted(n for n, p in model.named_parameters()
                                 if any(p is q for q in partial_grad_params(model)))
    return result


def ce_inputs(name: str):
    rows, V, vocab_size = CE_CASES[name]
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(*rows, V, generator=g) * 3
    targets = torch.randint(0, vocab_size or V, rows, generator=g)
    targets.view(-1)[::5] = -1
    return logits, targets, vocab_size


def run_ce(name: str, tp_rank: int, tp_size: int, group) -> dict:
    logits, targets, vocab_size = ce_inputs(name)
    shard = logits.chunk(tp_size, -1)[tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, targets, tp_rank * shard.size(-1), group, vocab_size=vocab_size)
    (loss * 0.7).backward()
    return {"loss": loss.detach(), "grad": shard.grad}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(TP)))
    results = {"cases": {name: run_case(name, rank, TP, group) for name in CASES},
               "ce": {name: run_ce(name, rank, TP, group) for name in CE_CASES},
               "bf16": {name: _recording_collectives(run_case, name, rank, TP, group, bf16=True) for name in BF16_CASES}}
    x = torch.arange(24.0).view(2, 4, 3).requires_grad_()
    y = scatter_to_sequence(x, group, dim=1)
    (y * (rank + 1)).sum().backward()
    results["scatter"] = {"y": y.detach(), "x_grad": x.grad}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier(group)
    dist.destroy_process_group()


def _recording_collectives(run, *args, **kwargs) -> dict:
    """run(*args, **kwargs)'s result, with the (collective, dtype) of every tensor-parallel collective it ran."""
    from pipegpt.tensor_parallel import collectives

    log, names = [], {"_all_reduce": "all_reduce", "_all_gather_single": "all_gather",
                      "_reduce_scatter_single": "reduce_scatter"}
    real = {attr: getattr(collectives, attr) for attr in names}

    def recorder(attr):
        def call(first, *a, **kw):  # the tensor communicated (or written) comes first in each
            log.append((names[attr], first.dtype))
            return real[attr](first, *a, **kw)
        return call

    for attr in names:
        setattr(collectives, attr, recorder(attr))
    try:
        result = run(*args, **kwargs)
    finally:
        for attr, fn in real.items():
            setattr(collectives, attr, fn)
    result["collectives"] = log
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=TP, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(TP)]


def _merge(tensors, sp: bool):
    """The one-process tensor from the ranks' copies: sequence chunks concatenate, replicas agree."""
    if sp:
        return torch.cat(tensors, 1)
    for t in tensors[1:]:
        assert torch.equal(t, tensors[0])
    return tensors[0]


@pytest.mark.parametrize("name", CASES)
def test_matches_one_process(tp_results, name):
    ref = run_case(name)
    ranks = [r["cases"][name] for r in tp_results]
    sp, split, head = CASES[name][2], CASES[name][3], SLICES[CASES[name][1]][2]
    assert_close(_merge([r["out"] for r in ranks], sp and not head), ref["out"], rtol=RTOL, atol=ATOL)
    if head:
        assert_close(torch.cat([r["logits"] for r in ranks], -1), ref["logits"], rtol=RTOL, atol=ATOL)
    if ref["in_grad"] is not None:
        assert_close(_merge([r["in_grad"] for r in ranks], sp), ref["in_grad"], rtol=RTOL, atol=ATOL)
    assert all(list(r["grads"]) == list(ref["grads"]) for r in ranks), "parameter names differ"
    kv = CONFIGS[CASES[name][0]].kv_heads
    for n, full in ref["grads"].items():
        shards = [r["grads"][n] for r in ranks]
        shared_kv = tp_shard_spec(n) == KV_DIM0 and kv_replicas(kv, TP) > 1  # one kv head on both ranks
        if tp_shard_spec(n) == REPLICATED or shared_kv:
            assert torch.equal(shards[0], shards[1]), f"{n}: replicated gradient differs across tp ranks"
        else:
            assert shards[0].numel() * TP == full.numel(), n
        assert_close(gather_full(n, shards, kv), full, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")
    assert all(r["all_split_linear"] for r in ranks)
    if split:
        assert all(r["deferred"] for r in ranks), "weight grads were not deferred"
    cfg_name, slice_name = CASES[name][:2]
    if slice_name == "full" and CONFIGS[cfg_name].tie_embeddings:
        assert all(r["tied_local"] for r in ranks)
    expected_sp = sorted(n for n in ref["grads"] if tp_shard_spec(n) == REPLICATED) if sp else []
    assert all(r["sp_params"] == expected_sp for r in ranks)


@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_collectives(tp_results, name):
    """Under bf16 autocast a column-parallel layer's collectives (its input's all-gather, or copy_to_tp's backward
    all-reduce, and the reduce-scatter of its input gradient) move bf16, as Megatron's: fp32 only where the
    residual stream or the loss is (the embedding's reduction, run by the logits pass and the loss pass, and
    the cross-entropy's two all-reduces). Gradients stay fp32 and track the one-process model under autocast
    (their outputs too) within BF16_GRAD_RTOL (normwise): bf16 sums over tp ranks round differently from one process's."""
    ref = run_case(name, bf16=True)
    ranks = [r["bf16"][name] for r in tp_results]
    fp32 = [(kind, dtype) for kind, dtype in ranks[0]["collectives"] if dtype != torch.bfloat16]
    assert sorted(fp32) == sorted(BF16_FP32_COLLECTIVES[name]), ranks[0]["collectives"]
    assert len(fp32) < len(ranks[0]["collectives"])
    sp, head = CASES[name][2], SLICES[CASES[name][1]][2]
    relative = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
    assert relative(_merge([r["out"] for r in ranks], sp and not head), ref["out"]) < BF16_GRAD_RTOL
    for n, full in ref["grads"].items():
        shards = [r["grads"][n] for r in ranks]
        assert {g.dtype for g in shards} == {torch.float32}, n
        error = relative(gather_full(n, shards, CONFIGS[CASES[name][0]].kv_heads), full)
        assert error < BF16_GRAD_RTOL, f"{n}: relative difference {error:.2e}"


@pytest.mark.parametrize("name", CE_CASES)
def test_vocab_parallel_cross_entropy(tp_results, name):
    logits, targets, vocab_size = ce_inputs(name)
    V = vocab_size or logits.size(-1)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full[..., :V].reshape(-1, V), targets.reshape(-1), ignore_index=-1)
    (ref * 0.7).backward()
    ranks = [r["ce"][name] for r in tp_results]
    for r in ranks:
        assert_close(r["loss"], ref.detach(), rtol=RTOL, atol=ATOL)
    assert_close(torch.cat([r["grad"] for r in ranks], -1), full.grad, rtol=RTOL, atol=ATOL)
    assert (full.grad[..., V:] == 0).all()


def test_scatter_to_sequence(tp_results):
    x = torch.arange(24.0).view(2, 4, 3)
    for rank, r in enumerate(tp_results):
        assert torch.equal(r["scatter"]["y"], x[:, 2 * rank:2 * rank + 2])
        # backward all-gathers: each chunk's gradient is its owner's scale
        assert torch.equal(r["scatter"]["x_grad"], torch.tensor([1.0, 1, 2, 2]).view(1, 4, 1).expand(2, 4, 3))


# ---------------------------------------------------------------------------
# No processes: layouts and checks
# ---------------------------------------------------------------------------
def test_shard_specs_round_trip():
    model = GPT(CONFIGS["untied-pad"], init_seed=SEED)
    sd = model.state_dict()
    specs = {n: tp_shard_spec(n) for n in sd}
    assert specs["blocks.0.attn.qkv.weight"] == specs["blocks.0.attn.qkv.bias"] == QKV_DIM0
    assert specs["blocks.1.mlp.fc.weight"] == specs["wte.weight"] == specs["lm_head.weight"] == DIM0
    assert specs["blocks.1.attn.proj.weight"] == specs["blocks.1.mlp.proj.weight"] == DIM1
    assert specs["blocks.1.attn.proj.bias"] == specs["ln_f.weight"] == specs["wpe.weight"] == REPLICATED
    for tp in (2, 4):
        shards = [shard_state_dict(sd, r, tp) for r in range(tp)]
        back = gather_state_dicts(shards)
        assert all(torch.equal(back[n], sd[n]) for n in sd)
    # rank r's qkv rows are its heads' rows of q, k and v
    C = 32
    w = sd["blocks.0.attn.qkv.weight"]
    assert torch.equal(shard_tensor("blocks.0.attn.qkv.weight", w, 1, 2),
                       torch.cat([w[16:32], w[C + 16:C + 32], w[2 * C + 16:2 * C + 32]]))
    with pytest.raises(KeyError, match="no tensor-parallel layout"):
        tp_shard_spec("blocks.0.attn.rotary.freqs")


@pytest.mark.parametrize("cfg, tp, sp, message", [
    (ModelConfig(n_head=6, n_embd=48), 4, False,
     "n_head=6 is not divisible by tp=4 (each tp rank holds n_head/tp heads): use tp=3 or tp=6, "
     "or n_head=4 or 8 (with n_embd=48)"),
    (ModelConfig(n_head=25, n_embd=100), 2, False,
     "n_head=25 is not divisible by tp=2 (each tp rank holds n_head/tp heads): use tp=1 or tp=5, "
     "or n_head=20 or 50 (with n_embd=100)"),
    (ModelConfig(vocab_size=1001), 2, False,
     "padded vocab_size=1001 (vocab_size=1001, pad_vocab_to=1) is not divisible by tp=2: "
     "pass --pad-vocab (pad_vocab_to=64, padded vocab 1024)"),
    (ModelConfig(vocab_size=100, n_head=6, n_embd=48, pad_vocab_to=64), 3, False,
     "padded vocab_size=128 (vocab_size=100, pad_vocab_to=64) is not divisible by tp=3: "
     "use pad_vocab_to=192 (padded vocab 192)"),
    (ModelConfig(seq_len=15), 2, True,
     "sequence parallelism needs seq_len divisible by tp: seq_len=15, tp=2; use seq_len=14 or 16"),
    (ModelConfig(seq_len=3), 4, True,
     "sequence parallelism needs seq_len divisible by tp: seq_len=3, tp=4; use seq_len=4"),
])
def test_config_errors(cfg, tp, sp, message):
    with pytest.raises(ConfigError) as e:
        validate_tp(cfg, tp, sp)
    assert str(e.value) == message
    with pytest.raises(ConfigError) as e:  # shard_for_tp checks before touching the group
        shard_for_tp(GPT(cfg, layers=range(1), init_seed=0), 0, tp, None, sequence_parallel=sp)
    assert str(e.value) == message


def test_valid_layouts_pass():
    validate_tp(ModelConfig(), 4, True)
    validate_tp(ModelConfig(seq_len=15), 2, False)  # seq_len only matters with sequence parallelism
    validate_tp(ModelConfig(vocab_size=50257, n_head=12, n_embd=768, pad_vocab_to=64), 4, True)
    with pytest.raises(ConfigError, match="tp=0 must be an integer >= 1"):
        validate_tp(ModelConfig(), 0)
    with pytest.raises(ValueError, match="needs a tp process group of 2 ranks, got None"):
        shard_for_tp(GPT(ModelConfig(), layers=range(1), init_seed=0), 0, 2, None)
