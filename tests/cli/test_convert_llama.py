"""`pipegpt convert` of Llama-family models: a small random LlamaForCausalLM with grouped-query attention (and
Mistral, Qwen2 with its q/k/v biases, Qwen3 with its wider heads and q/k norm) saved by transformers is
imported, compared on logits, sampled greedily beside transformers' generate, exported back and reloaded;
configs pipegpt cannot compute exactly are refused in one line naming the field."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import assert_one_line_error, invoke

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from pipegpt.tools.sample import generate, load_model, sample  # noqa: E402
from pipegpt.state import checkpoint  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=48, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))


def hf_model(kind: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    extra = {"sliding_window": None} if kind in ("mistral", "qwen2", "qwen3") else {}
    extra.update({"head_dim": 32} if kind == "qwen3" else {})  # twice hidden_size / num_attention_heads
    model = model_class(config_class(**{**SHAPE, **extra, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms and biases away from their initial 1 and 0
    return model.eval()


def imported(tmp_path, hf, **save):
    hf_dir, out = tmp_path / "hf", tmp_path / "ckpt"
    hf.save_pretrained(hf_dir, **save)
    result = invoke("convert", "--from-hf", hf_dir, "--out", out)
    assert result.exit_code == 0, result.output
    assert "Llama" in result.output and "tokenizer bytes" in result.output
    return out


@torch.no_grad()
def max_logit_diff(ckpt, hf) -> float:
    model, _, _ = load_model(ckpt)
    return (model(TOKENS) - hf(TOKENS).logits).abs().max().item()


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_import_matches_transformers_logits(kind, tmp_path):
    hf = hf_model(kind)
    ckpt = imported(tmp_path, hf)
    model = checkpoint.read_manifest(ckpt)["model"]
    assert (model["arch"], model["n_kv_head"], model["ffn_hidden"], model["qkv_bias"]) == \
        ("llama", 2, 176, kind == "qwen2")
    assert (model.get("head_size"), model.get("qk_norm", "none")) == \
        ((32, "head") if kind == "qwen3" else (None, "none"))
    assert max_logit_diff(ckpt, hf) < 1e-4


def test_sharded_safetensors_with_their_index(tmp_path):
    hf = hf_model(seed=1)
    ckpt = imported(tmp_path, hf, max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert max_logit_diff(ckpt, hf) < 1e-4


def test_export_is_loaded_by_transformers_unchanged(tmp_path):
    for kind in ("llama", "qwen2", "qwen3"):
        hf = hf_model(kind, seed=2)
        ckpt = imported(tmp_path / kind, hf)
        result = invoke("convert", "--to-hf", tmp_path / kind / "out", "--checkpoint", ckpt)
        assert result.exit_code == 0, result.output
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / kind / "out").eval()
        assert type(back) is type(hf)
        with torch.no_grad():
            assert (back(TOKENS).logits - hf(TOKENS).logits).abs().max().item() < 1e-5


def assert_greedy_text_equal(ckpt, hf, prompt: str, steps: int) -> None:
    """pipegpt sample's greedy tokens from the checkpoint are transformers' generate's from hf."""
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0)[0, ids.size(1):].tolist()
    ours = sample(ckpt, prompt, max_new_tokens=steps, temperature=0, top_k=None, seed=0)
    assert len(theirs) == steps and ours.new_tokens == theirs


def test_sample_equals_transformers_greedy_generation(tmp_path):
    hf = hf_model(seed=4)
    assert_greedy_text_equal(imported(tmp_path, hf), hf, "pipeline ", 20)


def test_without_tokenizer_json_bytes_is_said_or_the_tokenizer_asked_for(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_model(seed=10).save_pretrained(hf_dir)
    result = invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt")
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "no tokenizer.json" in line]
    assert len(said) == 1 and said[0].startswith("tokenizer bytes: ") and "--tokenizer" in said[0], result.output
    hf_dir = tmp_path / "hf-1000"
    hf_model(seed=10, vocab_size=1000).save_pretrained(hf_dir)
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt-1000"),
                          "holds no tokenizer.json", "vocabulary of 1000", "--tokenizer")
    assert not (tmp_path / "ckpt-1000").exists()
    result = invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt-1000", "--tokenizer", "bytes")
    assert result.exit_code == 0 and checkpoint.read_manifest(tmp_path / "ckpt-1000")["tokenizer"] == "bytes"


def set_rope(hf_dir, form: str, theta: float):
    """config.json's rotary settings in one form: transformers 5's rope_parameters, or the top-level rope_theta and
    rope_scaling that older transformers and the Hub's files hold."""
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_parameters", None), config.pop("rope_theta", None), config.pop("rope_scaling", None)
    if form == "rope_parameters":
        config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    else:
        config.update(rope_theta=theta, rope_scaling=None)
    (hf_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("form", ["as saved", "rope_parameters", "top-level rope_theta"])
def test_a_rotary_base_other_than_10000_is_read_in_either_form(form, tmp_path):
    """The config as the installed transformers saves it (5.x: rope_parameters), and each form written out."""
    hf = hf_model(seed=7, rope_theta=100000.0)
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    hf.save_pretrained(hf_dir)
    if form != "as saved":
        set_rope(hf_dir, form, 100000.0)
    result = invoke("convert", "--from-hf", hf_dir, "--out", ckpt)
    assert result.exit_code == 0, result.output
    assert checkpoint.read_manifest(ckpt)["model"]["rope_theta"] == 100000.0
    assert max_logit_diff(ckpt, hf) < 1e-4
    assert_greedy_text_equal(ckpt, hf, "rotary ", 30)


def test_export_of_a_rotary_base_is_read_by_transformers(tmp_path):
    hf = hf_model(seed=8, rope_theta=100000.0)
    ckpt = imported(tmp_path, hf)
    assert invoke("convert", "--to-hf", tmp_path / "out", "--checkpoint", ckpt).exit_code == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"] == 100000.0  # both forms
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.to_dict().get("rope_parameters") == hf.config.to_dict().get("rope_parameters")
    with torch.no_grad():
        assert (back(TOKENS).logits - hf(TOKENS).logits).abs().max().item() < 1e-5


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}


@pytest.mark.parametrize("change, fragments", [
    ({"rope_parameters": LLAMA3_ROPE}, ["rope_parameters=", "rope_type 'llama3'"]),
    ({"rope_parameters": None, "rope_theta": 500000.0,
      "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}, ["rope_scaling=", "'llama3'"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta": 10000.0},
     ["rope_theta=10000.0", "rope_parameters.rope_theta=500000.0", "disagree"]),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     ["rope_parameters.partial_rotary_factor=0.5"]),
], ids=["llama3 in rope_parameters", "llama3 in rope_scaling", "two bases", "partial rotary"])
def test_rotary_settings_pipegpt_does_not_compute_are_one_line(change, fragments, tmp_path):
    hf_dir = tmp_path / "hf"
    hf_model(seed=9).save_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("rope_theta", None)
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt"), *fragments)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_kv_cache_gives_the_tokens_of_the_whole_context(arch, tmp_path):
    """Greedy with the cache equals greedy recomputing the context, past seq_len too (the window crops)."""
    from pipegpt.config import MODEL_PRESETS
    from pipegpt.model.gpt import GPT

    model = GPT(MODEL_PRESETS["tiny-llama" if arch == "llama" else "tiny"], init_seed=1).eval()
    prompt = TOKENS[0, :10].tolist()
    steps = model.config.seq_len + 5  # beyond the context: the cached path hands over to the cropped window
    cached = generate(model, prompt, steps, temperature=0)
    whole = generate(model, prompt, steps, temperature=0, use_cache=False)
    assert cached == whole


@pytest.mark.parametrize("field, value, kind", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "llama"),
    ("hidden_act", "gelu", "llama"),
    ("sliding_window", 16, "mistral"),
    ("use_sliding_window", True, "qwen2"),
    ("num_local_experts", 8, "llama"),
    ("head_dim", 32, "llama"),
    ("mlp_bias", True, "llama"),
    ("attention_bias", True, "qwen3"),
])
def test_what_pipegpt_does_not_compute_is_one_line_naming_the_field(field, value, kind, tmp_path):
    hf_dir = tmp_path / "hf"
    hf_model(kind, seed=5).save_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config[field] = value
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt"), f"{field}=")
    assert not (tmp_path / "ckpt").exists()


def test_tied_config_with_a_separate_head_is_refused(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_model(seed=6).save_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (hf_dir / "config.json").write_text(json.dumps(config))
    assert_one_line_error(invoke("convert", "--from-hf", hf_dir, "--out", tmp_path / "ckpt"),
                          "tie_word_embeddings=True", "lm_head.weight differs")
