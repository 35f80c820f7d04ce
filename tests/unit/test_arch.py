"""pipegpt.arch is the one description of each architecture: the model builds exactly the parameters it
lists, at every tp degree as the tensor-parallel layout shards them, and the FLOPs count, the planner's memory
and the converters' names read their numbers from it. A third architecture is one more entry."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from pipegpt import arch
from pipegpt.arch import ARCHITECTURES, GPT2, LLAMA, hf_names, named_shapes, stage_shapes
from pipegpt.config import ConfigError, ModelConfig, validate_tp
from pipegpt.model import flops
from pipegpt.model.gpt import GPT
from pipegpt.costs import memory
from pipegpt.tensor_parallel.layout import shard_tensor

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {  # several shapes of each architecture: kv heads split and replicated, biases, tying, MLP widths
    "gpt2": ModelConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, n_embd=32),
    "gpt2-untied-nobias": ModelConfig(vocab_size=60, seq_len=8, n_layer=2, n_head=8, n_embd=64, bias=False,
                                      tie_embeddings=False, pad_vocab_to=8, ffn_hidden=96),
    "llama": ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=3, n_head=4, n_kv_head=2, n_embd=32,
                         ffn_hidden=48, bias=False, tie_embeddings=False),
    "llama-qkv-bias-tied": ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=8, n_kv_head=1,
                                       n_embd=64, qkv_bias=True, bias=False, tie_embeddings=True),
    "llama-all-bias": ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32,
                                  ffn_hidden=64, qkv_bias=True, bias=True),
    "llama-wide-heads": ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=3, n_head=4, n_kv_head=2,
                                    n_embd=32, head_size=16, bias=False, tie_embeddings=False),  # Qwen3's 2x
    "llama-qk-norm": ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=3, n_head=4, n_kv_head=2,
                                 n_embd=32, head_size=16, qk_norm="head", bias=False),  # gains whole on each tp rank
}
SLICES = [(range(0, 3), True, True), (range(0, 1), True, False), (range(1, 2), False, False),
          (range(1, 3), False, True), (range(0, 0), False, True)]


def _numel(shapes) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


@pytest.mark.parametrize("name", SHAPES)
def test_the_whole_model_holds_the_described_parameters(name):
    """Names, order and shapes of GPT.named_parameters; the parameter count; flops' per-block counts."""
    model = SHAPES[name].validate()
    gpt = GPT(model, init_seed=0)
    assert list(named_shapes(model).items()) == [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]
    assert _numel(named_shapes(model).items()) == gpt.num_parameters()
    block = gpt.blocks["0"]
    assert flops.block_parameters(model) == sum(p.numel() for p in block.parameters())
    assert flops.block_matmul_weights(model) == sum(m.weight.numel() for m in block.modules()
                                                    if isinstance(m, torch.nn.Linear))
    wpe = gpt.wpe.weight.numel() if hasattr(gpt, "wpe") else 0
    untied_wte = 0 if model.tie_embeddings else gpt.wte.weight.numel()
    assert flops.matmul_parameters(model) == gpt.num_parameters() - wpe - untied_wte  # the head counted once


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_slice_at_every_tp_degree_is_described(name, tp):
    """Each tp rank's shard shapes (the layout's split of the real slice) are the description's, and so is the
    planner's parameter count; a degree the shapes cannot take is refused by the planner, not guessed."""
    model = SHAPES[name].validate()
    try:
        memory.check_tp_shapes(model, tp)
        validate_tp(model, tp, False)
    except ConfigError:
        assert tp > 1
        with pytest.raises(ConfigError):
            memory.stage_parameter_shapes(model, 1, True, True, tp)
        return
    checked = 0
    for layers, embed, head in SLICES:
        layers = range(min(layers.start, model.n_layer), min(layers.stop, model.n_layer))
        gpt = GPT(model, layers=layers, embed=embed, head=head, init_seed=0)
        for rank in range(tp):
            real = [(n.split(".", 2)[2] if n.startswith("blocks.") else n,
                     tuple(shard_tensor(n, p, rank, tp, model.kv_heads).shape)) for n, p in gpt.named_parameters()]
            assert list(stage_shapes(model, len(layers), embed, head, tp)) == real, (layers, embed, head, rank)
        assert memory.parameter_count(model, layers, embed, head, tp) == _numel(real)
        checked += 1
    assert checked == len(SLICES)


def test_both_architectures_differ_where_the_description_says():
    assert (GPT2.norm, GPT2.rotary, GPT2.gated_mlp, GPT2.fused_qkv, GPT2.grouped_kv) == \
        ("layer", False, False, True, False)
    assert (LLAMA.norm, LLAMA.rotary, LLAMA.gated_mlp, LLAMA.fused_qkv, LLAMA.grouped_kv) == \
        ("rms", True, True, False, True)
    assert [lin.name for lin in arch.block_linears(SHAPES["gpt2"])] == ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]
    assert [(lin.name, lin.split) for lin in arch.block_linears(SHAPES["llama"], 4)] == [
        ("attn.q", "column"), ("attn.k", "kv"), ("attn.v", "kv"), ("attn.proj", "row"), ("mlp.gate", "column"),
        ("mlp.up", "column"), ("mlp.proj", "row")]
    assert arch.block_linears(SHAPES["llama"], 4)[1].rows == 8  # one of 2 kv heads replicated per rank: 8 wide
    assert ModelConfig(arch="llama", n_embd=4096).ffn_width == 11008 and ModelConfig(n_embd=768).ffn_width == 3072


def test_hugging_face_names_cover_every_parameter_once():
    for model in SHAPES.values():
        names = hf_names(model)
        assert sorted(ours for _, ours, _ in names) == sorted(named_shapes(model))
        assert len({hf for hf, _, _ in names}) == len(names)
    gpt2 = {ours: (hf, t) for hf, ours, t in hf_names(SHAPES["gpt2"])}
    assert gpt2["blocks.1.attn.qkv.weight"] == ("h.1.attn.c_attn.weight", True)  # Conv1D: [in, out]
    assert gpt2["blocks.1.attn.qkv.bias"] == ("h.1.attn.c_attn.bias", False)
    llama = {ours: hf for hf, ours, _ in hf_names(SHAPES["llama-all-bias"])}
    assert llama["blocks.0.mlp.proj.bias"] == "model.layers.0.mlp.down_proj.bias"
    assert llama["ln_f.weight"] == "model.norm.weight" and "ln_f.bias" not in llama


NEOX = dataclasses.replace(GPT2, name="neox", title="NeoX", family="NeoX", positions="rotary",
                           default_preset="tiny", hf_block_prefix="gpt_neox.layers.{i}.")


def test_a_third_architecture_is_one_entry(monkeypatch):
    """GPT-2's block with rotary positions instead of wpe: one description entry, and the model, the FLOPs,
    the planner's memory and the tensor-parallel shapes follow it with no other change."""
    monkeypatch.setitem(ARCHITECTURES, "neox", NEOX)
    model = ModelConfig(arch="neox", vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32).validate()
    gpt = GPT(model, init_seed=0)
    assert not hasattr(gpt, "wpe") and gpt.blocks["0"].attn.rope_theta == model.rope_theta
    assert list(named_shapes(model).items()) == [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]
    gpt2 = dataclasses.replace(model, arch="gpt2")
    assert gpt.num_parameters() == GPT(gpt2, init_seed=0).num_parameters() - model.seq_len * model.n_embd
    assert flops.flops_per_token(model) == flops.flops_per_token(gpt2)  # wpe is a lookup either way
    loss = gpt(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    assert torch.isfinite(loss)
    for tp in (1, 2, 4):
        assert memory.parameter_count(model, 2, True, True, tp) == memory.parameter_count(gpt2, 2, True, True, tp) \
            - model.seq_len * model.n_embd
    kw = dict(microbatch_size=2, precision="bf16")  # rotary's bf16 cos/sin tables: GPT-2's bytes plus those
    gpt2_bytes = memory.activation_bytes(gpt2, 2, embed=True, **kw) - model.seq_len * 8  # less wpe's positions
    tables = 2 * 4 * model.seq_len * model.head_dim * 2  # per block: cos and sin, for q and k, in bf16
    assert memory.activation_bytes(model, 2, embed=True, **kw) == gpt2_bytes + tables
    with pytest.raises(ConfigError, match="arch='gptx' is not valid: use one of gpt2, llama, neox"):
        ModelConfig(arch="gptx").validate()


@pytest.mark.parametrize("name, tp", list(itertools.product(["gpt2", "llama"], [1, 2])))
def test_the_planners_tensor_counts_are_the_descriptions(name, tp):
    """The optimizer's per-tensor work counts the description's tensors (the head's lm_head always)."""
    from pipegpt.costs.stage_costs import StageCosts

    model = SHAPES[name]
    per_block = len(dict(arch.block_shapes(model)))
    assert StageCosts.stage_tensors(model, [2, 1]) == [
        2 * per_block + len(arch.embedding_shapes(model)), per_block + len(arch.head_shapes(model))]
    gpt = GPT(model, layers=range(0, 0), embed=False, head=True, init_seed=0)
    assert len(arch.head_shapes(model)) == len(list(gpt.parameters()))
