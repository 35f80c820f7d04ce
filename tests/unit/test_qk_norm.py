"""Qwen3's and OLMoE's attention (issue 45): heads of an explicit width (head_size, Hugging Face's head_dim) and
q/k RMSNorm (qk_norm "head": each head's; "projection": the whole q and k projections), their presets, flags,
counts and refusals. A dense model without them keeps every number it had."""
import dataclasses
import math

import pytest
import torch

from pipegpt import arch, command_options
from pipegpt.config import MODEL_PRESETS, ConfigError, ModelConfig, model_config, validate_tp
from pipegpt.model import flops
from pipegpt.model.gpt import GPT
from test_model_flags import _model, _refusal

pytestmark = pytest.mark.usefixtures("one_thread")

WIDE = ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                   head_size=16, ffn_hidden=48, bias=False, tie_embeddings=False)


def _billions(model) -> float:
    return sum(math.prod(s) for s in arch.named_shapes(model).values()) / 1e9


def test_qwen3_presets_carry_the_published_sizes():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Qwen3-235B-A22B: 235B, 22B (the model cards' figures,
    rounded down; the embedding, a lookup in the FLOPs, counted in the active one)."""
    for name, total, active in (("qwen3-30b-a3b", 30.5, 3.35), ("qwen3-235b-a22b", 235.1, 22.19)):
        m = model_config(name)
        assert (m.head_dim, m.attention_width, m.qk_norm) == (128, m.n_head * 128, "head")
        assert m.attention_width == 2 * m.n_embd  # the heads are twice n_embd / n_head wide
        assert round(_billions(m), 1) == total
        assert round((flops.matmul_parameters(m) + m.vocab_size * m.n_embd) / 1e9, 2) == active
    assert model_config("olmoe-1b-7b").qk_norm == "projection"


@pytest.mark.parametrize("qk_norm", ["none", "head", "projection"])
def test_the_model_holds_the_described_parameters(qk_norm):
    model = dataclasses.replace(WIDE, qk_norm=qk_norm).validate()
    gpt = GPT(model, init_seed=0)
    assert list(arch.named_shapes(model).items()) == [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]
    assert tuple(gpt.blocks["0"].attn.q.weight.shape) == (64, 32) and tuple(gpt.blocks["0"].attn.proj.weight.shape) \
        == (32, 64)
    norms = {n: tuple(p.shape) for n, p in gpt.named_parameters() if "_norm" in n and n.startswith("blocks.0.")}
    assert norms == {"none": {}, "head": {"blocks.0.attn.q_norm.weight": (16,), "blocks.0.attn.k_norm.weight": (16,)},
                     "projection": {"blocks.0.attn.q_norm.weight": (64,),
                                    "blocks.0.attn.k_norm.weight": (32,)}}[qk_norm]
    assert all(bool((p == 1).all()) for n, p in gpt.named_parameters() if "_norm" in n)  # gains start at one
    hf = {ours: theirs for theirs, ours, _ in arch.hf_names(model)}
    if qk_norm != "none":
        assert hf["blocks.1.attn.k_norm.weight"] == "model.layers.1.self_attn.k_norm.weight"


def _attention_after_scaling_one_heads_q(model, scale: float) -> torch.Tensor:
    torch.manual_seed(0)
    attn = GPT(model, init_seed=1).blocks["0"].attn
    with torch.no_grad():
        attn.q.weight[:model.head_dim] *= scale  # head 0's q rows only
    return attn(torch.randn(2, 8, model.n_embd))


@pytest.mark.parametrize("qk_norm, invariant", [("none", False), ("head", True), ("projection", False)])
def test_where_the_norm_applies(qk_norm, invariant):
    """A per-head RMSNorm makes attention blind to one head's q scale; no norm, or one over the whole
    projection (the other heads' share of the mean square moves), is not."""
    model = dataclasses.replace(WIDE, qk_norm=qk_norm)
    same = torch.allclose(_attention_after_scaling_one_heads_q(model, 1.0),
                          _attention_after_scaling_one_heads_q(model, 5.0), atol=1e-5)
    assert same is invariant


def test_the_projection_norm_is_one_rmsnorm_over_every_head():
    model = dataclasses.replace(WIDE, qk_norm="projection")
    attn = GPT(model, init_seed=1).blocks["0"].attn
    x = torch.randn(2, 8, model.n_embd)
    q, k, _ = attn._heads(x)
    by_hand = torch.nn.functional.rms_norm(attn.q(x), (64,), eps=model.norm_eps).view(2, 8, 4, 16).transpose(1, 2)
    assert torch.allclose(q, by_hand, atol=1e-6)
    assert k.shape == (2, 2, 8, 16)


def test_flops_count_the_heads_width():
    """Attention's T x T products run over n_head x head_dim, not n_embd; the projections are as wide."""
    narrow = dataclasses.replace(WIDE, head_size=None)  # 4 heads of 8
    matmuls = flops.matmul_parameters(WIDE) - flops.matmul_parameters(narrow)
    assert matmuls == 2 * (2 * 32 * 32 + 2 * 32 * 16)  # per layer: q and proj 32 wider, k and v 16 wider
    attention = flops.flops_per_token(WIDE) - flops.flops_per_token(narrow) - 6 * matmuls
    assert attention == 12 * 2 * (64 - 32) * 16


def test_a_dense_model_without_them_is_unchanged():
    for name in ("tiny", "tiny-llama", "llama3-8b", "mixtral-8x7b"):
        m = MODEL_PRESETS[name]
        assert (m.head_size, m.qk_norm, m.attention_width) == (None, "none", m.n_embd)
        assert "head_size" not in m.settings() and "qk_norm" not in m.settings()  # manifests read as before
    assert model_config("qwen3-30b-a3b").settings()["head_size"] == 128


def test_flags_build_them_and_model_flags_writes_them_back():
    m = _model("--arch", "llama", "--head-dim", "64", "--qk-norm", "head")
    assert m == dataclasses.replace(MODEL_PRESETS["tiny-llama"], head_size=64, qk_norm="head")
    assert _model(*command_options.model_flags(m, "bytes").split()[:-2]) == m
    qwen = _model("--model", "qwen3-30b-a3b", "--n-layer", "2")
    assert (qwen.head_dim, qwen.qk_norm) == (128, "head")
    assert _model(*command_options.model_flags(qwen, "bytes").split()[:-2]) == qwen


def test_the_planners_run_command_builds_the_same_model():
    from pipegpt.planner.candidates import model_args

    qwen = dataclasses.replace(MODEL_PRESETS["qwen3-30b-a3b"], seq_len=4096, n_layer=2)
    assert model_args(qwen) == ["--model", "qwen3-30b-a3b", "--n-layer", "2", "--seq-len", "4096"]  # its preset
    for model in (qwen, dataclasses.replace(MODEL_PRESETS["tiny-llama"], head_size=16, qk_norm="projection")):
        args = model_args(model)
        assert (model is qwen or "--head-dim" in args) and _model(*args) == model, args


@pytest.mark.parametrize("args, fragment", [
    (["--head-dim", "64"], "head_size=64 needs separate q, k, v projections (arch llama)"),
    (["--qk-norm", "head"], "qk_norm=head is an RMSNorm: it needs arch llama"),
    (["--arch", "llama", "--head-dim", "7"], "head size head_size = 7 is odd"),
    (["--arch", "llama", "--head-dim", "0"], "head_size=0 must be a positive integer"),
])
def test_bad_values_are_refused_in_one_line(args, fragment):
    line = _refusal(*args)
    assert fragment in line and "\n" not in line, line


def test_qk_norms_split_over_tp_as_their_heads_do():
    for qk_norm in ("head", "projection"):  # whole heads per tp rank; the gains whole on each
        validate_tp(dataclasses.replace(WIDE, qk_norm=qk_norm), 2)
    with pytest.raises(ConfigError, match="n_head=4 is not divisible by tp=3"):
        validate_tp(dataclasses.replace(WIDE, qk_norm="projection"), 3)
    validate_tp(WIDE, 2)  # an explicit head width alone splits by whole heads
    with pytest.raises(ConfigError, match="qk_norm='rms' is not valid"):
        dataclasses.replace(WIDE, qk_norm="rms").validate()


def test_a_checkpoint_of_other_heads_is_refused_naming_the_flag(tmp_path):
    from helpers import assert_one_line_error, invoke
    from pipegpt.state import checkpoint

    model = dataclasses.replace(MODEL_PRESETS["tiny-llama"], head_size=64, qk_norm="head")
    checkpoint.write_weights(tmp_path / "ckpt", GPT(model, init_seed=0).state_dict(),
                             {"model": model.settings(), "tokenizer": "bytes"})
    assert_one_line_error(invoke("run", "--init-from", tmp_path / "ckpt", "--head-dim", "32"),
                          "--head-dim 32 disagrees with its head_size 64")
    assert_one_line_error(invoke("run", "--init-from", tmp_path / "ckpt", "--qk-norm", "none"),
                          "--qk-norm none disagrees with its qk_norm head")
