"""Llama-family models in Hugging Face layout in and out of pipegpt checkpoints (`pipegpt convert`).

LlamaForCausalLM, MistralForCausalLM (without a sliding window), Qwen2ForCausalLM (q/k/v biases) and
Qwen3ForCausalLM (q/k RMSNorm per head: self_attn.q_norm, self_attn.k_norm; head_dim its own) have one block
structure, which is pipegpt's arch "llama". Hugging Face keeps q and k in the rotate-half layout
pipegpt's rotary code uses, so every tensor maps by name alone (no transposes, no permutations):

    model.embed_tokens.weight                     wte.weight
    model.layers.{i}.input_layernorm.weight       blocks.{i}.ln1.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.*     blocks.{i}.attn.{q,k,v}.*
    model.layers.{i}.self_attn.o_proj.*           blocks.{i}.attn.proj.*
    model.layers.{i}.post_attention_layernorm.*   blocks.{i}.ln2.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.*    blocks.{i}.mlp.{gate,up,proj}.*
    model.norm.weight                             ln_f.weight
    lm_head.weight                                lm_head.weight              (untied models only)

Only what pipegpt computes exactly is accepted: SiLU, plain rotary positions (rope_type "default"), no sliding
window, no experts (mixtures of experts are pipegpt.tools.convert_moe's), head_dim = hidden_size /
num_attention_heads (but Qwen3's), q/k/v biases alone (Qwen2) or every bias (Llama's attention_bias with
mlp_bias); anything else is one line naming the config field.

The rotary settings come in two forms: top-level rope_theta and rope_scaling (older transformers, most files on
the Hub) and transformers 5's rope_parameters {"rope_type": ..., "rope_theta": ...}. Both are read (rope_theta
from either, and where both give one they must agree); an export writes both, so that either reads it.
"""
from __future__ import annotations

import re

import torch

from pipegpt.arch import hf_names
from pipegpt.config import ConfigError, ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


class ConvertError(ConfigError):
    """A Hugging Face directory or a conversion target is unusable (one line; the CLI prints it, exit 2).
    Defined here, where both converters reach it (pipegpt.tools.convert imports this module)."""


_EXPERT_FIELDS = ("num_local_experts", "num_experts", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size")

_NOT_WEIGHTS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # buffers of older files


def is_llama_family(config: dict) -> bool:
    return config.get("model_type") in ARCHITECTURES


def model_config_from_hf(config: dict, where) -> ModelConfig:
    """pipegpt's ModelConfig (arch llama) of a Llama, Mistral or Qwen2 config.json, or a ConfigError naming
    the field pipegpt's model cannot compute exactly."""
    kind = config["model_type"]

    def refuse(field, why):
        raise ConvertError(f"{where}: {field}={config.get(field)!r} is not supported: {why}")

    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(config.get(field), int):
            refuse(field, "a whole number is needed")
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "pipegpt's SwiGLU uses silu")
    rope_theta = rope_theta_from_hf(config, where)
    if kind == "mistral" and config.get("sliding_window") is not None:
        refuse("sliding_window", "pipegpt's attention is full causal attention (sliding_window null)")
    if kind in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        refuse("use_sliding_window", "pipegpt's attention is full causal attention")
    for field in _EXPERT_FIELDS:
        if config.get(field):
            refuse(field, f"a {kind} has no experts (pipegpt converts mixtures of experts of model_type mixtral, "
                          f"qwen3_moe or olmoe)")
    C, H = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if kind != "qwen3" and (head_dim not in (None, C // H) or C % H):
        refuse("head_dim", f"pipegpt's heads are hidden_size / num_attention_heads = {C / H:g} wide")
    if kind == "qwen3" and config.get("attention_bias"):
        refuse("attention_bias", "Qwen3's covers q, k, v and o_proj but not the MLP: pipegpt's biases do not")
    if kind == "qwen2":
        qkv_bias, bias = True, False
    else:
        attention_bias, mlp_bias = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
        if attention_bias != mlp_bias:
            refuse("mlp_bias", f"pipegpt's bias covers o_proj and the MLP together (attention_bias={attention_bias})")
        qkv_bias = bias = attention_bias
    try:
        return ModelConfig(arch="llama", vocab_size=config["vocab_size"], seq_len=config.get("max_position_embeddings", 2048),
                           n_layer=config["num_hidden_layers"], n_head=H, n_embd=C,
                           n_kv_head=config.get("num_key_value_heads") or H, ffn_hidden=config["intermediate_size"],
                           rope_theta=rope_theta, qk_norm="head" if kind == "qwen3" else "none",
                           head_size=None if head_dim in (None, C // H) and C % H == 0 else head_dim,
                           norm_eps=float(config.get("rms_norm_eps", 1e-6)), qkv_bias=qkv_bias, bias=bias,
                           dropout=0.0, tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                           pad_vocab_to=1).validate()
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from None


def rope_theta_from_hf(config: dict, where) -> float:
    """The rotary base of a config.json in either form (the module's docstring); a ConvertError names a rope type
    other than the plain one, a partial rotary factor, or two rotary bases that disagree."""
    found = {"": config}  # where rotary settings are, by prefix
    for field in ("rope_scaling", "rope_parameters"):  # transformers 5 reads rope_scaling first, then rope_parameters
        params = config.get(field)
        if not params:
            continue
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ConvertError(f"{where}: {field}={params!r} is not supported: pipegpt computes one plain rotary "
                               f"embedding for every layer")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ConvertError(f"{where}: {field}={params!r} is not supported: rope_type {rope_type!r} scales the "
                               f"rotary positions; pipegpt computes plain ones (rope_type 'default')")
        found[f"{field}."] = params
    thetas = {}
    for prefix, params in found.items():
        if params.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ConvertError(f"{where}: {prefix}partial_rotary_factor={params['partial_rotary_factor']!r} is not "
                               f"supported: pipegpt rotates whole heads")
        theta = params.get("rope_theta")
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0):
            raise ConvertError(f"{where}: {prefix}rope_theta={theta!r} is not supported: a positive rotary base is "
                               f"needed")
        if theta is not None:
            thetas[f"{prefix}rope_theta"] = theta
    if len(set(thetas.values())) > 1:
        raise ConvertError(f"{where}: {' and '.join(f'{f}={t!r}' for f, t in thetas.items())} disagree: which rotary "
                           f"base? (transformers 5 reads rope_parameters, older versions the top-level rope_theta)")
    return float(next(iter(thetas.values()), 10000.0))


def from_hf_state_dict(weights: dict, model: ModelConfig, shapes: dict, where) -> dict:
    """pipegpt's one-process state dict (float32); a ConvertError names the first missing, unexpected or
    misshapen tensor."""
    mapping = hf_names(model)
    expected = {hf for hf, _, _ in mapping}
    if model.tie_embeddings and "lm_head.weight" in weights:
        if not torch.equal(weights["lm_head.weight"], weights.get("model.embed_tokens.weight")):
            raise ConvertError(f"{where}: tie_word_embeddings=True, but lm_head.weight differs from "
                               f"model.embed_tokens.weight: set tie_word_embeddings false in config.json")
        expected.add("lm_head.weight")
    return checked_weights(weights, mapping, shapes, expected, _NOT_WEIGHTS,
                           where, "a model", f"num_hidden_layers={model.n_layer}, "
                                             f"tie_word_embeddings={model.tie_embeddings}")


def checked_weights(weights: dict, mapping, shapes: dict, expected: set, buffers: re.Pattern, where, kind: str,
                    config_says: str) -> dict:
    """Our float32 state dict of a Hugging Face one by `mapping` ((hf name, ours, transposed) triples); a
    ConvertError names the first unexpected tensor (other than `buffers`), missing, non-float or misshapen one."""
    unexpected = sorted(k for k in weights if k not in expected and not buffers.match(k))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConvertError(f"{where}: unexpected tensor {unexpected[0]!r}{more}: not {kind} of this config.json")
    out = {}
    for hf, ours, transpose in mapping:
        if hf not in weights:
            raise ConvertError(f"{where}: holds no {hf!r} (config.json says {config_says})")
        t = weights[hf]
        if not torch.is_tensor(t) or not t.is_floating_point():
            raise ConvertError(f"{where}: {hf!r} is not a floating-point tensor")
        t = t.t() if transpose else t
        if tuple(t.shape) != shapes[ours]:
            raise ConvertError(f"{where}: {hf!r} has shape {list(weights[hf].shape)}, config.json implies "
                               f"{list(shapes[ours][::-1] if transpose else shapes[ours])}")
        out[ours] = t.to(torch.float32).contiguous()
    return out


def common_hf_config(model: ModelConfig) -> dict:
    """The config.json fields every Llama-shaped family shares (pipegpt.tools.convert_moe's too)."""
    return {"vocab_size": model.vocab_size, "hidden_size": model.n_embd, "intermediate_size": model.ffn_width,
            "num_hidden_layers": model.n_layer, "num_attention_heads": model.n_head,
            "num_key_value_heads": model.kv_heads, "hidden_act": "silu",
            "max_position_embeddings": model.seq_len, "rms_norm_eps": model.norm_eps,
            "rope_theta": model.rope_theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
            "tie_word_embeddings": model.tie_embeddings,
            "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32"}


def hf_config(model: ModelConfig) -> dict:
    """config.json for the model: Qwen3 with a per-head q/k norm, Qwen2 when only q/k/v have biases, else Llama."""
    if model.bias and not model.qkv_bias:
        raise ConvertError("a Llama with o_proj and MLP biases but none on q/k/v has no Hugging Face architecture")
    kind = "qwen3" if model.qk_norm == "head" else "qwen2" if model.qkv_bias and not model.bias else "llama"
    why = [(model.qk_norm == "projection", f"qk_norm={model.qk_norm}"),
           (kind == "qwen3" and (model.bias or model.qkv_bias), "biases with a q/k norm"),
           (kind == "qwen2" and model.head_size is not None, "q/k/v biases with head_size")]
    refused = [what for bad, what in why if bad]
    if refused:
        raise ConvertError(f"a dense Llama with {refused[0]} has no Hugging Face architecture here (Llama, Qwen2: "
                           f"no q/k norm; Qwen3: q/k norm per head, no biases)")
    config = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, **common_hf_config(model)}
    if kind == "llama":
        config.update(attention_bias=model.bias, mlp_bias=model.bias, head_dim=model.head_dim)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    if kind == "qwen3":
        config.update(attention_bias=False, head_dim=model.head_dim)
    return config


def to_hf_state_dict(state: dict, model: ModelConfig) -> dict:
    """Hugging Face names of a one-process state dict (padded vocabulary rows dropped)."""
    out = {}
    for hf, ours, _ in hf_names(model):
        if ours not in state:
            raise ConvertError(f"the checkpoint holds no param/{ours}")
        t = state[ours]
        if ours in ("wte.weight", "lm_head.weight"):
            t = t[:model.vocab_size]
        out[hf] = t.to(torch.float32).contiguous()
    return out
