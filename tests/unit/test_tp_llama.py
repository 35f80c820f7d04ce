"""Llama's tensor-parallel layout without processes: which one-process name is split how, shard -> gather
round trips of a whole tiny Llama (grouped-query attention: kv heads split over tp, or replicated when tp
exceeds them), which rows a rank's k/v shard holds, and the one-line refusals of layouts that cannot work."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.config import MODEL_PRESETS, ConfigError, ModelConfig, TrainConfig, validate_tp
from pipegpt.model.gpt import GPT
from pipegpt.tensor_parallel import (DIM0, DIM1, KV_DIM0, REPLICATED, gather_full, gather_state_dicts, kv_replicas,
                                     shard_state_dict, shard_tensor, tp_shard_spec)
from pipegpt.tensor_parallel.layers import shard_for_tp

# head_dim 8: n_head 4, n_kv_head 2, q/k/v biases on (they follow their weights)
LLAMA = ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=48,
                    arch="llama", bias=False, tie_embeddings=False, qkv_bias=True)


def test_llama_names_have_megatron_specs():
    sd = GPT(LLAMA, init_seed=0).state_dict()
    specs = {n: tp_shard_spec(n) for n in sd}
    assert "wpe.weight" not in specs
    for n in ("blocks.0.attn.q.weight", "blocks.0.attn.q.bias", "blocks.1.mlp.gate.weight", "blocks.1.mlp.up.weight",
              "wte.weight", "lm_head.weight"):
        assert specs[n] == DIM0, n
    for n in ("blocks.0.attn.k.weight", "blocks.0.attn.k.bias", "blocks.0.attn.v.weight", "blocks.0.attn.v.bias"):
        assert specs[n] == KV_DIM0, n
    assert specs["blocks.0.attn.proj.weight"] == specs["blocks.1.mlp.proj.weight"] == DIM1
    assert specs["blocks.0.ln1.weight"] == specs["blocks.1.ln2.weight"] == specs["ln_f.weight"] == REPLICATED
    assert set(specs.values()) == {DIM0, DIM1, KV_DIM0, REPLICATED}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_gather_round_trip(tp):
    sd = GPT(LLAMA, init_seed=0).state_dict()
    shards = [shard_state_dict(sd, r, tp, LLAMA.kv_heads) for r in range(tp)]
    hd, kv = LLAMA.head_dim, LLAMA.kv_heads
    for r, shard in enumerate(shards):  # every rank: n_head/tp q heads, its kv heads (one when replicated)
        assert shard["blocks.0.attn.q.weight"].shape == (LLAMA.n_head // tp * hd, 32)
        assert shard["blocks.0.attn.k.weight"].shape == (max(1, kv // tp) * hd, 32)
        assert shard["blocks.0.attn.v.bias"].shape == (max(1, kv // tp) * hd,)
        assert shard["blocks.1.mlp.up.weight"].shape == (48 // tp, 32)
        assert shard["blocks.1.mlp.proj.weight"].shape == (32, 48 // tp)
        assert shard["wte.weight"].shape == (64 // tp, 32)
        assert torch.equal(shard["ln_f.weight"], sd["ln_f.weight"])
    back = gather_state_dicts(shards, kv)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[n], sd[n]) for n in sd)


def test_replicated_kv_heads_follow_their_q_heads():
    """tp 4 > n_kv_head 2: rank r holds kv head r // 2, the group of its one q head (q head r)."""
    w = GPT(LLAMA, init_seed=0).state_dict()["blocks.0.attn.k.weight"]
    hd, group = LLAMA.head_dim, LLAMA.n_head // LLAMA.kv_heads  # q heads per kv head
    assert kv_replicas(2, 4) == 2 and kv_replicas(2, 2) == kv_replicas(2, 1) == 1 and kv_replicas(1, 8) == 8
    for r in range(4):
        q_head = r  # n_head/tp = 1 q head per rank
        assert torch.equal(shard_tensor("blocks.0.attn.k.weight", w, r, 4, 2), w[q_head // group * hd:][:hd])
    # the gather takes one copy per head: a diverged second copy is not read
    shards = [shard_tensor("blocks.0.attn.k.weight", w, r, 4, 2).clone() for r in range(4)]
    shards[1].fill_(7.0)
    assert torch.equal(gather_full("blocks.0.attn.k.weight", shards, 2), w)
    # n_kv_head 1 (multi-query): every rank holds the one head
    one = dataclasses.replace(LLAMA, n_kv_head=1)
    wk = GPT(one, init_seed=0).state_dict()["blocks.1.attn.v.weight"]
    assert all(torch.equal(shard_tensor("blocks.1.attn.v.weight", wk, r, 2, 1), wk) for r in range(2))


def test_kv_shards_need_the_kv_head_count():
    w = torch.zeros(16, 32)
    with pytest.raises(ValueError, match="pass kv_heads"):
        shard_tensor("blocks.0.attn.k.weight", w, 0, 2)
    with pytest.raises(ValueError, match="pass kv_heads"):
        gather_full("blocks.0.attn.v.bias", [torch.zeros(8)] * 2)
    with pytest.raises(ValueError, match="cannot be split over tp=3"):
        shard_tensor("blocks.0.attn.k.weight", torch.zeros(16, 32), 0, 3, 2)
    assert shard_tensor("blocks.0.attn.k.weight", w, 0, 1) is w  # tp 1: nothing to split


@pytest.mark.parametrize("cfg, tp, message", [
    (ModelConfig(arch="llama", bias=False, n_head=12, n_kv_head=4, n_embd=96, ffn_hidden=240), 6,
     "n_kv_head=4 does not split over tp=6: each tp rank holds n_kv_head/tp key/value heads, or one shared by "
     "tp/n_kv_head ranks (tp a multiple of n_kv_head); use tp=1, 2, 4, 12"),
    (ModelConfig(arch="llama", bias=False, n_head=12, n_kv_head=6, n_embd=96, ffn_hidden=240), 4,
     "n_kv_head=6 does not split over tp=4: each tp rank holds n_kv_head/tp key/value heads, or one shared by "
     "tp/n_kv_head ranks (tp a multiple of n_kv_head); use tp=1, 2, 3, 6, 12"),
    (dataclasses.replace(LLAMA, ffn_hidden=90), 4,
     "ffn_hidden=90 is not divisible by tp=4 (each tp rank holds ffn_hidden/tp of the MLP's columns): use tp=1, 2"),
    (LLAMA, 3, "n_head=4 is not divisible by tp=3 (each tp rank holds n_head/tp heads): use tp=2 or tp=4"),
])
def test_layouts_that_cannot_work_are_refused_in_one_line(cfg, tp, message):
    with pytest.raises(ConfigError) as e:
        validate_tp(cfg, tp)
    assert str(e.value) == message
    with pytest.raises(ConfigError) as e:  # the run's config check says the same, before any process
        TrainConfig.build(cfg, stages=1, tp=tp, device="cpu").validate()
    assert str(e.value) == message
    with pytest.raises(ConfigError) as e:  # and shard_for_tp, before touching a group
        shard_for_tp(GPT(cfg, layers=range(1), init_seed=0), 0, tp, None)
    assert str(e.value) == message


def test_valid_llama_layouts_pass():
    tiny = MODEL_PRESETS["tiny-llama"]  # n_head 4, n_kv_head 2
    for tp in (1, 2, 4):
        validate_tp(tiny, tp, sequence_parallel=True)
    validate_tp(dataclasses.replace(tiny, n_kv_head=1), 4)
    validate_tp(MODEL_PRESETS["llama3-8b"], 8, True)
    validate_tp(MODEL_PRESETS["smollm-135m"], 3)  # 9 heads, 3 kv heads, ffn 1536
