"""The model's shape as command-line options: `pipegpt run` and `pipegpt plan` share them, and model_flags writes
them back for a model. Torch-free, like pipegpt.config.
"""
from __future__ import annotations

import click

from pipegpt.arch import ARCHITECTURES, GPT2
from pipegpt.config import ARCHS, MODEL_PRESETS, ConfigError, ModelConfig, model_config

MODEL_OPTIONS = ("preset", "n_layer", "n_embd", "n_head", "seq_len", "vocab_size", "pad_vocab", "no_tie_embeddings",
                 "tie_embeddings", "dropout", "arch", "n_kv_head", "ffn_hidden", "rope_theta", "norm_eps", "qkv_bias")
# settings of an architectural property (pipegpt.arch): given for an architecture without it, they are refused
# (GPT-2 has no grouping, rotary positions or q/k/v biases of their own)
ARCH_SPECIFIC = {"n_kv_head": ("--n-kv-head", "grouped_kv"), "rope_theta": ("--rope-theta", "rotary"),
                 "qkv_bias": ("--qkv-bias", "own_qkv_bias")}



def model_options(command):
    """The model's shape: a preset and the settings that override it (their names: MODEL_OPTIONS)."""
    for option in reversed([
        click.option("--model", "preset", default="tiny", show_default=True,
                     help=f"{', '.join(MODEL_PRESETS)} (--arch llama alone: tiny-llama)."),
        click.option("--arch", type=click.Choice(list(ARCHS)), default=None,
                     help="gpt2 or llama (rotary, RMSNorm, SwiGLU, grouped-query attention); default: the preset's."),
        click.option("--n-layer", type=int, default=None), click.option("--n-embd", type=int, default=None),
        click.option("--n-head", type=int, default=None), click.option("--seq-len", type=int, default=None),
        click.option("--vocab-size", type=int, default=None),
        click.option("--pad-vocab", is_flag=True,
                     help="Pad the vocabulary to a multiple of 64 (padded logits are never predicted)."),
        click.option("--no-tie-embeddings", is_flag=True, help="Separate LM-head weight instead of the token embedding."),
        click.option("--tie-embeddings", is_flag=True, default=None,
                     help="The LM head is the token embedding (default: the preset's; Llama presets mostly untie)."),
        click.option("--n-kv-head", type=int, default=None,
                     help="Llama: key/value heads (grouped-query attention; must divide --n-head; default n_head)."),
        click.option("--ffn-hidden", type=int, default=None,
                     help="The MLP's hidden width (default: 4 x n_embd for GPT-2; Llama: 8/3 x n_embd rounded up to a "
                          "multiple of 256)."),
        click.option("--rope-theta", type=float, default=None, help="Llama: rotary base (default 10000)."),
        click.option("--norm-eps", type=float, default=None, help="LayerNorm/RMSNorm epsilon (default 1e-5)."),
        click.option("--qkv-bias/--no-qkv-bias", default=None, help="Llama: biases on q, k, v only (Qwen2)."),
        click.option("--dropout", type=float, default=None,
                     help="Dropout probability of the embedding, attention and residual branches (default: the "
                          "preset's, 0.0; fine-tuning often uses 0.1)."),
    ]):
        command = option(command)
    return command


def model_from_options(options: dict, vocab_size: int | None = None) -> ModelConfig:
    """The model model_options describe: the preset with the shape given overriding it (vocab_size: the
    default when --vocab-size is not given)."""
    o = {name: options.get(name) for name in MODEL_OPTIONS}
    preset = o["preset"] or "tiny"
    if o["arch"] in ARCHITECTURES and preset == "tiny":  # --arch alone: its own small preset (GPT-2's is tiny)
        preset = ARCHITECTURES[o["arch"]].default_preset
    arch = MODEL_PRESETS[preset].arch if preset in MODEL_PRESETS else None
    if o["arch"] is not None and arch is not None and o["arch"] != arch:
        raise ConfigError(f"--arch {o['arch']} does not match --model {preset} (a {arch} preset): leave out --arch "
                          f"or name a {o['arch']} preset")
    check_arch_flags(o, o["arch"] or arch)
    return model_config(preset, n_layer=o["n_layer"], n_embd=o["n_embd"], n_head=o["n_head"],
                        seq_len=o["seq_len"], vocab_size=vocab_size if o["vocab_size"] is None else o["vocab_size"],
                        tie_embeddings=tie_from_flags(o), pad_vocab_to=64 if o["pad_vocab"] else None, dropout=o["dropout"],
                        n_kv_head=o["n_kv_head"], ffn_hidden=o["ffn_hidden"], rope_theta=o["rope_theta"],
                        norm_eps=o["norm_eps"], qkv_bias=o["qkv_bias"])


def tie_from_flags(o: dict) -> bool | None:
    """tie_embeddings from --tie-embeddings / --no-tie-embeddings (None: neither given)."""
    if o.get("no_tie_embeddings") and o.get("tie_embeddings"):
        raise ConfigError("give either --tie-embeddings or --no-tie-embeddings, not both")
    return False if o.get("no_tie_embeddings") else (True if o.get("tie_embeddings") else None)


def check_arch_flags(o: dict, arch: str | None) -> None:
    """Refuse a setting of a property the architecture lacks (a Llama-only one given for a GPT-2); its default
    value (what GPT-2 has: a run's config.json holds them all) passes."""
    described, defaults = ARCHITECTURES.get(arch, GPT2), ModelConfig()
    for name, (flag, needs) in ARCH_SPECIFIC.items():
        if not getattr(described, needs) and o.get(name) is not None and o[name] != getattr(defaults, name):
            having = [a.name for a in ARCHITECTURES.values() if getattr(a, needs)]
            raise ConfigError(f"{flag} {shown_value(o[name])} applies to --arch {' or '.join(having)} only (this model "
                              f"is {arch or 'gpt2'}): leave it out or give --arch {having[0]}")


def model_flags(model: ModelConfig, tokenizer: str) -> str:
    """The `pipegpt run` model flags that build exactly this model (as --init-from requires)."""
    preset = next((name for name, m in MODEL_PRESETS.items() if m == model), None)
    if preset is not None:
        flags = f"--model {preset}"
    else:
        flags = (f"--n-layer {model.n_layer} --n-embd {model.n_embd} --n-head {model.n_head} "
                 f"--seq-len {model.seq_len} --vocab-size {model.vocab_size}")
        arch = model.architecture
        if arch is not GPT2:  # its shape in full: `--arch NAME` alone starts from that architecture's own preset
            flags = f"--arch {arch.name} {flags}" + (f" --n-kv-head {model.kv_heads}" if arch.grouped_kv else "")
            flags += f" --ffn-hidden {model.ffn_width}" + (f" --rope-theta {model.rope_theta}" if arch.rotary else "")
            flags += f" --norm-eps {model.norm_eps}" + (" --qkv-bias" if arch.own_qkv_bias and model.qkv_bias else "")
            flags += " --tie-embeddings" if model.tie_embeddings else " --no-tie-embeddings"
        else:
            flags += "" if model.ffn_hidden is None else f" --ffn-hidden {model.ffn_hidden}"
            flags += "" if model.norm_eps == 1e-5 else f" --norm-eps {model.norm_eps}"
            flags += "" if model.tie_embeddings else " --no-tie-embeddings"
    return f"{flags} --tokenizer {tokenizer}"


def shown_value(value) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
