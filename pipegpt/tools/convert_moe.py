"""Mixtures of experts in Hugging Face layout in and out of pipegpt checkpoints (`pipegpt convert`): Mixtral,
Qwen3-MoE and OLMoE, one FAMILIES entry each.

Attention, norms, the embedding and the head map by name as Llama's (pipegpt.tools.convert_llama; Qwen3's and
OLMoE's q/k norms are self_attn.q_norm and self_attn.k_norm). An MoE layer's router and experts come in either
of two layouts, read alike (a layer at a time):

    per expert (what transformers save_pretrained writes, and the Hub's files):
        model.layers.{i}.{block}.gate.weight                   blocks.{i}.mlp.router.weight
        model.layers.{i}.{block}.experts.{e}.{gate}.weight     blocks.{i}.mlp.experts_gate[e]
        model.layers.{i}.{block}.experts.{e}.{up}.weight       blocks.{i}.mlp.experts_up[e]
        model.layers.{i}.{block}.experts.{e}.{down}.weight     blocks.{i}.mlp.experts_proj[e]
    (block, gate, up, down: Mixtral's block_sparse_moe, w1, w3, w2; the others' mlp, gate_proj, up_proj, down_proj)

    fused (transformers 5's modules: 3-D tensors, every family under mlp):
        model.layers.{i}.mlp.gate.weight                       blocks.{i}.mlp.router.weight
        model.layers.{i}.mlp.experts.gate_up_proj [E, 2H, C]   experts_gate = [:, :H], experts_up = [:, H:]
        model.layers.{i}.mlp.experts.down_proj [E, C, H]       blocks.{i}.mlp.experts_proj

An export writes the per-expert layout, which every transformers version reads. The routers are all softmax over
every expert, then the top-k (renormalised where norm_topk_prob; Mixtral always): pipegpt's. A config whose router
pipegpt does not compute (group-limited routing, another scoring function, scaled weights, jitter) is refused
naming the field (check_router, for any model_type, before the model type is looked at).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipegpt.arch import MOE, buffer_shapes, layer_kinds, named_shapes
from pipegpt.config import ConfigError, ModelConfig

from . import convert_llama
from .convert_llama import ConvertError


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    block: str                      # the MoE block's name in per-expert files
    expert: tuple[str, str, str]    # an expert's gate, up and down projections there
    qk_norm: str                    # pipegpt's qk_norm for it
    width: str                      # the config field of an expert's width
    always_normalised: bool = False  # the top-k weights renormalised whatever norm_topk_prob says (Mixtral)


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FAMILIES = {f.model_type: f for f in (
    Family("mixtral", "MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2"), "none", "intermediate_size",
           always_normalised=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "mlp", _PROJECTIONS, "head", "moe_intermediate_size"),
    Family("olmoe", "OlmoeForCausalLM", "mlp", _PROJECTIONS, "projection", "intermediate_size"),
)}


def is_moe_family(config: dict) -> bool:
    return config.get("model_type") in FAMILIES


def check_router(config: dict, where) -> None:
    """A ConvertError naming the first router field pipegpt's MoE does not compute (DeepSeek's group-limited
    routing, a scoring function other than softmax or sigmoid, scaled weights); any model_type."""
    def refuse(fields, why):
        shown = ", ".join(f"{f}={config.get(f)!r}" for f in fields)
        raise ConvertError(f"{where}: {shown} is not supported: {why}")

    if (config.get("n_group") or 1) > 1 or (config.get("topk_group") or 1) > 1:
        refuse(("n_group", "topk_group"), "group-limited routing; pipegpt's router takes each token's top-k over "
                                          "every expert")
    if config.get("scoring_func", "softmax") not in ("softmax", "sigmoid"):
        refuse(("scoring_func",), "pipegpt's router scores are softmax or sigmoid")
    if config.get("topk_method", "greedy") not in ("greedy",):
        refuse(("topk_method",), "pipegpt's router takes each token's top-k scores over every expert (greedy)")
    if config.get("routed_scaling_factor", 1.0) not in (1, 1.0):
        refuse(("routed_scaling_factor",), "pipegpt weighs the experts by their router scores unscaled")


def _experts_count(config: dict, where) -> int:
    """num_experts (Qwen3's and OLMoE's files) or num_local_experts (Mixtral's; transformers 5 writes Qwen3's so)."""
    counts = {f: config[f] for f in ("num_experts", "num_local_experts") if config.get(f) is not None}
    if len(set(counts.values())) > 1:
        raise ConvertError(f"{where}: {' and '.join(f'{f}={n!r}' for f, n in counts.items())} disagree: how many "
                           f"experts?")
    count = next(iter(counts.values()), None)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConvertError(f"{where}: num_experts={count!r} is not supported: a mixture of experts needs at least one")
    return count


def _layer_pattern(config: dict, n_layer: int, where) -> dict:
    """Qwen3-MoE's decoder_sparse_step s and mlp_only_layers as pipegpt's moe_every and first_dense_layers: layer i
    is MoE when (i + 1) % s == 0 and it is not MLP-only, so layers s-1, 2s-1, ... (the first dense ones listed)."""
    step, only = config.get("decoder_sparse_step", 1) or 1, sorted(config.get("mlp_only_layers") or [])
    if only and (step != 1 or only != list(range(len(only))) or len(only) >= n_layer):
        raise ConvertError(f"{where}: mlp_only_layers={only!r} is not supported: pipegpt keeps dense only the first "
                           f"k layers (with decoder_sparse_step 1), and at least one MoE layer")
    return {"moe_every": step, "first_dense_layers": len(only) if only else step - 1}


def model_config_from_hf(config: dict, where) -> ModelConfig:
    """pipegpt's ModelConfig of a Mixtral, Qwen3-MoE or OLMoE config.json, or a ConvertError naming the field
    pipegpt's model cannot compute exactly."""
    family = FAMILIES[config["model_type"]]

    def refuse(field, why):
        raise ConvertError(f"{where}: {field}={config.get(field)!r} is not supported: {why}")

    check_router(config, where)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok", family.width,
                  "vocab_size"):
        if isinstance(config.get(field), bool) or not isinstance(config.get(field), int):
            refuse(field, "a whole number is needed")
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "pipegpt's experts are SwiGLU with silu")
    for field in ("sliding_window", "use_sliding_window", "clip_qkv"):
        if config.get(field):
            refuse(field, {"clip_qkv": "pipegpt does not clip q, k and v"}.get(
                field, "pipegpt's attention is full causal attention"))
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            refuse(field, "pipegpt's mixtures of experts have no biases")
    if config.get("router_jitter_noise"):
        refuse("router_jitter_noise", "pipegpt's router does not scale its inputs by noise")
    C, H, L = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim")
    if family.qk_norm == "projection" and head_dim not in (None, C // H):  # OLMoE's q_norm is hidden_size wide
        refuse("head_dim", f"OLMoE's heads are hidden_size / num_attention_heads = {C / H:g} wide")
    pattern = _layer_pattern(config, L, where) if family.model_type == "qwen3_moe" else {}
    normalised = family.always_normalised or bool(config.get("norm_topk_prob", False))
    # transformers adds the aux loss to the loss only with output_router_logits: so does the imported model
    aux = float(config.get("router_aux_loss_coef") or 0.0) if config.get("output_router_logits") else 0.0
    width = config[family.width]
    try:
        return ModelConfig(
            arch="llama", vocab_size=config["vocab_size"], seq_len=config.get("max_position_embeddings", 2048),
            n_layer=L, n_head=H, n_embd=C, n_kv_head=config.get("num_key_value_heads") or H,
            head_size=None if head_dim in (None, C // H) and C % H == 0 else head_dim,
            qk_norm=family.qk_norm, ffn_hidden=config.get("intermediate_size") or width,
            rope_theta=convert_llama.rope_theta_from_hf(config, where),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), bias=False, qkv_bias=False, dropout=0.0,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)), pad_vocab_to=1,
            n_experts=_experts_count(config, where), n_experts_per_token=config["num_experts_per_tok"],
            expert_hidden=width, norm_topk_prob=normalised, router_aux_loss_coef=aux, **pattern).validate()
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from None


def _take(weights: dict, name: str, shape: tuple, where, config_says: str) -> torch.Tensor:
    """weights[name] (removed from weights), a floating-point tensor of `shape`, as float32."""
    if name not in weights:
        raise ConvertError(f"{where}: holds no {name!r} (config.json says {config_says})")
    t = weights.pop(name)
    if not torch.is_tensor(t) or not t.is_floating_point():
        raise ConvertError(f"{where}: {name!r} is not a floating-point tensor")
    if tuple(t.shape) != tuple(shape):
        raise ConvertError(f"{where}: {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}")
    return t.to(torch.float32)


def _layer_in(weights: dict, model: ModelConfig, family: Family, i: int, where) -> dict:
    """One MoE layer's router and experts (ours) from either layout (the module's docstring), taken out of
    weights."""
    E, C, H, p = model.n_experts, model.n_embd, model.expert_width, f"model.layers.{i}."
    says = f"num_experts={E}, {family.width}={H}"
    if f"{p}mlp.experts.gate_up_proj" in weights:  # transformers 5's fused tensors
        router = _take(weights, f"{p}mlp.gate.weight", (E, C), where, says)
        gate_up = _take(weights, f"{p}mlp.experts.gate_up_proj", (E, 2 * H, C), where, says)
        gate, up = gate_up[:, :H], gate_up[:, H:]
        proj = _take(weights, f"{p}mlp.experts.down_proj", (E, C, H), where, says)
    else:
        b, (g, u, d) = f"{p}{family.block}.", family.expert
        router = _take(weights, f"{b}gate.weight", (E, C), where, says)
        gate, up, proj = (torch.stack([_take(weights, f"{b}experts.{e}.{name}.weight", shape, where, says)
                                       for e in range(E)])
                          for name, shape in ((g, (H, C)), (u, (H, C)), (d, (C, H))))
    ours = f"blocks.{i}.mlp."
    return {f"{ours}router.weight": router, f"{ours}experts_gate": gate, f"{ours}experts_up": up,
            f"{ours}experts_proj": proj}


def from_hf_state_dict(weights: dict, model: ModelConfig, family: Family, where) -> dict:
    """pipegpt's one-process state dict (float32; the router biases zero); a ConvertError names the first
    missing, unexpected or misshapen tensor."""
    weights = dict(weights)
    state = {}
    for i, kind in enumerate(layer_kinds(model)):
        if kind is MOE:
            state.update(_layer_in(weights, model, family, i, where))
    state.update(convert_llama.from_hf_state_dict(weights, model, named_shapes(model), where))  # the rest by name
    state.update({name: torch.zeros(shape) for name, shape in buffer_shapes(model).items()})
    return {k: t.contiguous() for k, t in state.items()}


# --------------------------------------------------------------------------------------------------------------
# pipegpt -> Hugging Face

def family_of(model: ModelConfig) -> Family:
    """The Hugging Face family that computes the model (by its q/k norm), or a ConvertError saying what none
    computes."""
    family = next(f for f in FAMILIES.values() if f.qk_norm == model.qk_norm)
    kinds = layer_kinds(model)
    why = [(model.arch != "llama", "GPT-2-style blocks"), (model.bias or model.qkv_bias, "biases"),
           (model.n_shared_experts, "shared experts"),
           (model.router_score != "softmax", f"{model.router_score} router scores"),
           (family.always_normalised and not model.norm_topk_prob, "top-k weights not renormalised"),
           (family.model_type != "qwen3_moe" and MOE in kinds and len(set(kinds)) > 1, "dense layers"),
           (family.qk_norm == "projection" and model.attention_width != model.n_embd,
            "heads other than n_embd / n_head wide")]
    refused = [what for bad, what in why if bad]
    if refused:
        raise ConvertError(f"a mixture of experts with qk_norm={model.qk_norm} is {family.architecture}'s, which "
                           f"has no {', '.join(refused)}: no Hugging Face architecture computes this model")
    return family


def hf_config(model: ModelConfig) -> dict:
    """config.json for the mixture of experts (its family: family_of)."""
    family = family_of(model)
    config = {**convert_llama.common_hf_config(model), "architectures": [family.architecture],
              "model_type": family.model_type, "attention_bias": False, "head_dim": model.head_dim,
              family.width: model.expert_width, "num_experts_per_tok": model.experts_per_token,
              "router_aux_loss_coef": model.router_aux_loss_coef,
              "output_router_logits": model.router_aux_loss_coef > 0}
    if family.model_type == "mixtral":
        config.update(num_local_experts=model.n_experts, sliding_window=None, router_jitter_noise=0.0)
    else:
        config.update(num_experts=model.n_experts, norm_topk_prob=model.norm_topk_prob)
    if family.model_type == "qwen3_moe":
        dense = [i for i, kind in enumerate(layer_kinds(model)) if kind is not MOE]
        config.update(intermediate_size=model.ffn_width, decoder_sparse_step=1, mlp_only_layers=dense,
                      use_sliding_window=False, sliding_window=None)
    if family.model_type == "olmoe":
        config.update(clip_qkv=None)
        config.pop("head_dim")  # OLMoE's are hidden_size / num_attention_heads wide
    return config


def to_hf_state_dict(state: dict, model: ModelConfig) -> dict:
    """Hugging Face names (the per-expert layout) of a one-process state dict; a router bias other than zero
    (which no Hugging Face router of these has) is refused."""
    family = family_of(model)
    out = convert_llama.to_hf_state_dict(state, model)
    g, u, d = family.expert
    for i, kind in enumerate(layer_kinds(model)):
        if kind is not MOE:
            continue
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.{family.block}."
        missing = [n for n in ("router.weight", "experts_gate", "experts_up", "experts_proj") if ours + n not in state]
        if missing:
            raise ConvertError(f"the checkpoint holds no param/{ours}{missing[0]}")
        bias = state.get(f"{ours}expert_bias")
        if bias is not None and bool(bias.any()):
            raise ConvertError(f"param/{ours}expert_bias is not zero (router_bias_update_rate moved it): "
                               f"{family.architecture}'s router has no selection bias")
        out[f"{theirs}gate.weight"] = state[f"{ours}router.weight"].to(torch.float32).contiguous()
        for e in range(model.n_experts):
            for name, tensor in ((g, "experts_gate"), (u, "experts_up"), (d, "experts_proj")):
                out[f"{theirs}experts.{e}.{name}.weight"] = state[ours + tensor][e].to(torch.float32).contiguous()
    return out
