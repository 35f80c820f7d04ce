"""What a context-parallel rank's blocks keep for their backward, measured, against the planner's
pipegpt.costs.activations.activation_bytes for the same blocks, to the byte.

One spawn of 4 gloo processes (a module fixture): cp 4 over all of them, cp 2 on ranks 0-1 and 2-3. Each case builds
a middle stage (blocks only; one case the first stage, tokens in) of a small model sharded for cp, runs one forward
and backward first (the rotary table and the rank's positions are cached once per rank, not per microbatch), then
counts the storages alive after a forward (plan_memory_harness.StorageTracker), less the parameters and the stage's
output (released once sent).

The cases pin what cp's attention keeps beside what one process's SDPA keeps: its autograd Function saves k and v
as the kv heads give them (SDPA keeps them repeated to the query heads: at one kv head of four, 1.5 hidden states
more per layer), its log-sum-exp even under selective recomputation (which never checkpoints cp's attention), and
rotary's cos and sin are indexed at the rank's positions per call, in fp32 too (one process's fp32 tables are
views of the cached one). At cp 2 the peer's K/V block stays as well.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from pipegpt.config import MODEL_PRESETS, ModelConfig
from pipegpt.costs.activations import activation_bytes, memory_precision
from pipegpt.dims import Sharding
from plan_memory_harness import StorageTracker, storages_of
from test_cp_attention import WORLD, spawn

LLAMA = replace(MODEL_PRESETS["tiny-llama"], seq_len=256, n_layer=2)  # width 128, 4 heads of 32 (2 kv), MLP 352
MQA = replace(LLAMA, n_kv_head=1)  # one kv head
GPT2 = replace(MODEL_PRESETS["tiny"], seq_len=256, n_layer=2, dropout=0.0)


def case(name, model: ModelConfig, cp, comm="ring", recompute="none", precision="fp32", dtype="float32",
         embed=False):
    return dict(name=name, model=model, cp=cp, comm=comm, recompute=recompute, precision=precision, dtype=dtype,
                embed=embed)


CASES = [
    case("mqa-cp4-ring", MQA, 4),  # the kv heads unrepeated and the per-call rotary tables
    case("mqa-cp2-ring-selective", MQA, 2, recompute="selective"),  # and the log-sum-exp
    case("gqa-cp4-allgather-selective", LLAMA, 4, "allgather", recompute="selective"),
    case("gqa-cp2-allgather-bf16", LLAMA, 2, "allgather", precision="bf16"),
    case("mqa-cp2-ring-float64", MQA, 2, dtype="float64"),
    case("mqa-cp2-ring-full", MQA, 2, recompute="full"),
    case("gpt2-cp2-ring-selective", GPT2, 2, recompute="selective"),  # fused qkv: q, k, v views of one output
    case("gpt2-cp2-ring-embed", GPT2, 2, embed=True),  # the first stage: its tokens; wpe's positions are cached
]


def predicted(c) -> int:
    return activation_bytes(c["model"], c["model"].n_layer, microbatch_size=2, sharding=Sharding(cp=c["cp"]),
                            recompute=c["recompute"], precision=memory_precision(c["precision"], c["dtype"]),
                            embed=c["embed"], device="cpu")


def held_after_forward(c, group, cp_rank: int) -> int:
    from pipegpt.context_parallel.layers import shard_for_cp
    from pipegpt.model.gpt import GPT

    cfg, dtype = c["model"], getattr(torch, c["dtype"])
    layers = range(cfg.n_layer)
    module = GPT(cfg, layers, embed=c["embed"], head=False, recompute=c["recompute"], init_seed=1).to(dtype)
    model = shard_for_cp(module, cp_rank, c["cp"], group, c["comm"])
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=c["precision"] == "bf16")
    shape = (2, cfg.seq_len // c["cp"], cfg.n_embd)

    def forward():
        if c["embed"]:  # the tokens, which the stage keeps (Stage.inputs)
            x = torch.randint(0, cfg.vocab_size, shape[:2])
        else:  # the stage input: the first block's, counted there
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
        with autocast:
            return model(x)

    forward().sum().backward()  # caches made once per rank
    model.zero_grad(set_to_none=True)
    params = storages_of(model.parameters())
    with StorageTracker() as tracker:
        out = forward()
    ignored = params | storages_of([out])
    held, deadline = tracker.held(ignored), time.monotonic() + 2.0
    while time.monotonic() < deadline:  # gloo's worker thread drops its last Work's tensors a moment late
        time.sleep(0.02)
        again = tracker.held(ignored)
        if again == held:
            break
        held = again
    out.sum().backward()
    return held


def worker(rank, port, cases, out_path):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    groups = {4: dist.new_group(list(range(4))), 2: [dist.new_group([0, 1]), dist.new_group([2, 3])]}
    results = {}
    for c in cases:
        group = groups[4] if c["cp"] == 4 else groups[2][rank // 2]
        results[c["name"]] = held_after_forward(c, group, rank % c["cp"])
    torch.save(results, f"{out_path}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return spawn(CASES, str(tmp_path_factory.mktemp("cp-memory") / "held"), timeout_s=180, target=worker)


@pytest.mark.parametrize("c", CASES, ids=lambda c: c["name"])
def test_a_cp_ranks_blocks_keep_what_the_planner_counts(measured, c):
    want = predicted(c)
    assert [measured[r][c["name"]] for r in range(WORLD)] == [want] * WORLD
