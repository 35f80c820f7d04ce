"""`pipegpt convert` of mixtures of experts (issue 45): small random Mixtral, Qwen3-MoE and OLMoE models built and
saved by the installed transformers (per-expert tensors, as save_pretrained writes them; and transformers 5's
fused 3-D expert tensors, written from its modules' own state dict) are imported, compared on logits and greedy
text, exported back and reloaded by transformers; routers and settings pipegpt does not compute are refused in
one line naming the field."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from helpers import assert_one_line_error, invoke

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from pipegpt.state import checkpoint  # noqa: E402
from pipegpt.tools.sample import load_model  # noqa: E402
from test_convert_llama import assert_greedy_text_equal  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=48, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=None, pad_token_id=None)
FAMILIES = {  # each family's classes and its MoE settings: 4 or 8 experts, top-2
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=32, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
}
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))


def hf_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config_class, model_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **settings, **overrides})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms away from 1, Qwen3's zero-initialised router away from ties
    return model.eval()


def save(hf, hf_dir, layout: str = "per expert"):
    """save_pretrained's files; "fused": model.safetensors rewritten from the modules' own (3-D) state dict."""
    hf.save_pretrained(hf_dir)
    if layout == "fused":
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        save_file(state, str(hf_dir / "model.safetensors"), {"format": "pt"})
    return hf_dir


def imported(tmp_path, hf, layout: str = "per expert"):
    out = tmp_path / "ckpt"
    result = invoke("convert", "--from-hf", save(hf, tmp_path / "hf", layout), "--out", out, "--tokenizer", "bytes")
    assert result.exit_code == 0, result.output
    assert "experts (top 2)" in result.output, result.output
    return out


@torch.no_grad()
def max_logit_diff(ckpt, hf) -> float:
    model, _, _ = load_model(ckpt)
    return (model(TOKENS) - hf(TOKENS).logits).abs().max().item()


@pytest.mark.parametrize("layout", ["per expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers_logits(family, layout, tmp_path):
    hf = hf_model(family)
    ckpt = imported(tmp_path, hf, layout)
    model = checkpoint.read_manifest(ckpt)["model"]
    assert (model["n_experts"], model["n_experts_per_token"], model["expert_hidden"]) == \
        ((4, 2, 48) if family == "mixtral" else (8, 2, 48))
    assert (model.get("qk_norm", "none"), model.get("head_size"), model["norm_topk_prob"]) == {
        "mixtral": ("none", None, True), "qwen3_moe": ("head", 32, True), "olmoe": ("projection", None, False)}[family]
    assert max_logit_diff(ckpt, hf) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_equals_transformers_greedy_generation(family, tmp_path):
    hf = hf_model(family, seed=4)
    assert_greedy_text_equal(imported(tmp_path, hf), hf, "experts ", 20)


@pytest.mark.parametrize("pattern, kinds", [
    (dict(mlp_only_layers=[0]), ["dense", "moe", "moe"]),
    (dict(decoder_sparse_step=2), ["dense", "moe", "dense"]),
])
def test_qwen3_dense_layers_convert_as_first_dense_layers_and_moe_every(pattern, kinds, tmp_path):
    from pipegpt.arch import layer_kinds
    from pipegpt.config import ModelConfig

    hf = hf_model("qwen3_moe", seed=5, num_hidden_layers=3, **pattern)
    ckpt = imported(tmp_path, hf)
    model = ModelConfig(**checkpoint.read_manifest(ckpt)["model"])
    assert [kind.name for kind in layer_kinds(model)] == kinds
    assert max_logit_diff(ckpt, hf) < 1e-4
    result = invoke("convert", "--to-hf", tmp_path / "out", "--checkpoint", ckpt)
    assert result.exit_code == 0, result.output
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - hf(TOKENS).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_loaded_by_transformers_and_imports_back_bitwise(family, tmp_path):
    hf = hf_model(family, seed=2)
    ckpt = imported(tmp_path, hf, "fused")
    result = invoke("convert", "--to-hf", tmp_path / "out", "--checkpoint", ckpt)
    assert result.exit_code == 0, result.output
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        assert (back(TOKENS).logits - hf(TOKENS).logits).abs().max().item() < 1e-5
    again = tmp_path / "again"
    result = invoke("convert", "--from-hf", tmp_path / "out", "--out", again, "--tokenizer", "bytes")
    assert result.exit_code == 0, result.output
    first, second = checkpoint.read_weights(ckpt), checkpoint.read_weights(again)
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert checkpoint.read_manifest(again)["model"] == checkpoint.read_manifest(ckpt)["model"]


def edited(tmp_path, family: str, **changes):
    hf_dir = save(hf_model(family, seed=6), tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **changes}))
    return hf_dir


@pytest.mark.parametrize("family, changes, fragments", [
    ("qwen3_moe", dict(n_group=8, topk_group=4), ["n_group=8, topk_group=4", "group-limited routing"]),
    ("qwen3_moe", dict(scoring_func="sqrtsoftplus"), ["scoring_func='sqrtsoftplus'", "softmax or sigmoid"]),
    ("qwen3_moe", dict(routed_scaling_factor=2.5), ["routed_scaling_factor=2.5"]),
    ("qwen3_moe", dict(mlp_only_layers=[1]), ["mlp_only_layers=[1]", "first"]),
    ("mixtral", dict(router_jitter_noise=0.1), ["router_jitter_noise=0.1"]),
    ("olmoe", dict(clip_qkv=8.0), ["clip_qkv=8.0", "does not clip"]),
    ("qwen3_moe", dict(num_experts=8, num_local_experts=4), ["num_experts=8 and num_local_experts=4", "disagree"]),
    ("mixtral", dict(num_local_experts=8), ["block_sparse_moe.gate.weight' has shape [4, 64]", "implies [8, 64]"]),
], ids=["group-limited", "scoring", "scaled", "mlp-only", "jitter", "clip", "two counts", "more experts"])
def test_what_pipegpt_does_not_compute_is_one_line_naming_the_field(family, changes, fragments, tmp_path):
    assert_one_line_error(invoke("convert", "--from-hf", edited(tmp_path, family, **changes), "--out",
                                 tmp_path / "ckpt", "--tokenizer", "bytes"), *fragments)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("layout, name", [("per expert", "model.layers.1.block_sparse_moe.experts.3.w3.weight"),
                                          ("fused", "model.layers.1.mlp.experts.down_proj")])
def test_a_missing_expert_tensor_is_named(layout, name, tmp_path):
    from safetensors.torch import load_file, save_file

    hf_dir = save(hf_model("mixtral", seed=7), tmp_path / "hf", layout)
    weights = load_file(str(hf_dir / "model.safetensors"))
    del weights[name]
    save_file(weights, str(hf_dir / "model.safetensors"), {"format": "pt"})
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt", "--tokenizer", "bytes"),
                          f"holds no {name!r}", "num_experts=4, intermediate_size=48")


def test_deepseeks_router_is_refused_by_name_before_its_model_type(tmp_path):
    hf_dir = tmp_path / "deepseek"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "routed_scaling_factor": 2.5}))
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt"),
                          "n_group=8, topk_group=4 is not supported: group-limited routing")


def test_an_moe_no_hugging_face_family_computes_is_refused_on_export(tmp_path):
    """tiny-moe has a shared expert, which Mixtral has not: the export says so and writes nothing."""
    from pipegpt.config import MODEL_PRESETS
    from pipegpt.model.gpt import GPT

    model = MODEL_PRESETS["tiny-moe"]
    checkpoint.write_weights(tmp_path / "ckpt", GPT(model, init_seed=0).state_dict(),
                             {"model": model.settings(), "tokenizer": "bytes"})
    assert_one_line_error(invoke("convert", "--to-hf", tmp_path / "out", "--checkpoint", tmp_path / "ckpt"),
                          "MixtralForCausalLM's, which has no shared experts")
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_the_presets_export_as_transformers_builds_them(preset):
    """Each preset's exported config.json, built by transformers on the meta device, holds as many parameters as
    the preset, its experts (fused in a transformers 5 module) and its q norm (or q) of the preset's shapes."""
    from pipegpt.arch import named_shapes
    from pipegpt.config import model_config
    from pipegpt.tools import convert_moe

    model = model_config(preset)
    config = convert_moe.hf_config(model)
    family = convert_moe.FAMILIES[config["model_type"]]
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    theirs = {name: tuple(p.shape) for name, p in hf.named_parameters()}
    ours = named_shapes(model)
    assert sum(math.prod(s) for s in theirs.values()) == sum(math.prod(s) for s in ours.values())
    E, H, C = model.n_experts, model.expert_width, model.n_embd
    assert theirs["model.layers.1.mlp.experts.gate_up_proj"] == (E, 2 * H, C)
    assert theirs["model.layers.1.self_attn.q_norm.weight" if family.qk_norm != "none" else
                  "model.layers.1.self_attn.q_proj.weight"] == ours[
        "blocks.1.attn.q_norm.weight" if family.qk_norm != "none" else "blocks.1.attn.q.weight"]
