"""GPT-2 and Llama-family models in Hugging Face layout in and out of pipegpt checkpoints (`pipegpt convert`).

GPT-2 below; Llama, Mistral, Qwen2 and Qwen3 (model_type llama, mistral, qwen2, qwen3) in
pipegpt.tools.convert_llama and the mixtures of experts Mixtral, Qwen3-MoE and OLMoE in
pipegpt.tools.convert_moe, which share the file handling here.

    HF_DIR/config.json                     GPT-2's shape: n_embd, n_layer, n_head, n_positions, vocab_size, ...
    HF_DIR/model.safetensors               transformer.h.0.attn.c_attn.weight, ... (or pytorch_model.bin,
                                           or either one sharded with its *.index.json)

import_hf reads them into a weights-only checkpoint (step 0, no optimizer state: `pipegpt run --init-from`
starts training from it, `pipegpt sample` generates from it); export_hf writes a checkpoint's parameters
back, so that `transformers.GPT2LMHeadModel.from_pretrained(HF_DIR)` loads them. Hugging Face's GPT-2 keeps
its linear layers as Conv1D, weights [in, out]: they are transposed to nn.Linear's [out, in] both ways.
Names (one-process names on pipegpt's side):

    wte.weight, wpe.weight                 wte.weight, wpe.weight
    h.{i}.ln_1.*, h.{i}.ln_2.*             blocks.{i}.ln1.*, blocks.{i}.ln2.*
    h.{i}.attn.c_attn.*, .c_proj.*         blocks.{i}.attn.qkv.*, .proj.*      (q, k, v in the same order)
    h.{i}.mlp.c_fc.*, .c_proj.*            blocks.{i}.mlp.fc.*, .proj.*
    ln_f.*                                 ln_f.*
    lm_head.weight                         lm_head.weight                      (untied models only)

The Hugging Face names may carry a `transformer.` prefix (save_pretrained) or not (OpenAI's original
upload); the attention-mask buffers some files hold (h.{i}.attn.bias, .masked_bias) are not weights.
Only models pipegpt computes exactly are accepted: GELU with the tanh approximation, LayerNorm epsilon
1e-5, MLP width 4 x n_embd, attention scaled by 1/sqrt(head_dim); anything else is refused with one
line naming the config field. Weights are stored as float32. Nothing read can run code: safetensors
holds tensors only, and a .bin file is read with torch.load(weights_only=True).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Callable

import torch

from pipegpt.arch import hf_names, named_shapes
from pipegpt.state import checkpoint
from pipegpt.config import ConfigError, ModelConfig, canonical_tokenizer

from . import convert_llama, convert_moe
from .convert_llama import ConvertError

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
LAYER_NORM_EPS = 1e-5                                     # torch.nn.LayerNorm's, which pipegpt's model uses
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")          # both are GELU with the tanh approximation
EOT_TOKENS = {"gpt2": 50256}                              # the end-of-text token of each tokenizer that has one
FITTING_TOKENIZERS = {256: "bytes", 50257: "gpt2"}        # the built-in tokenizer whose ids fill a vocabulary

# Hugging Face defaults (GPT2Config) for fields a config.json leaves out.
HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
               "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
               "tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
               "add_cross_attention": False}

_NOT_WEIGHTS = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")  # causal-mask buffers of older files


def name_map(model: ModelConfig) -> list[tuple[str, str, bool]]:
    """(Hugging Face name without `transformer.`, pipegpt one-process name, transpose) for every weight (the
    architecture's names, pipegpt.arch), biases always: Hugging Face's GPT-2 has them (a model without them
    exports zeros)."""
    return hf_names(dataclasses.replace(model, bias=True))


# --------------------------------------------------------------------------------------------------------------
# Hugging Face -> pipegpt

def read_hf_config(hf_dir: Path) -> dict:
    path = Path(hf_dir) / CONFIG_FILE
    if not Path(hf_dir).is_dir():
        raise ConvertError(f"{hf_dir}: no such directory (expected a Hugging Face model directory with "
                           f"{CONFIG_FILE} and {SAFETENSORS_FILE} or {BIN_FILE})")
    if not path.is_file():
        raise ConvertError(f"{path}: not found (a Hugging Face GPT-2 directory holds {CONFIG_FILE} beside its "
                           f"weights)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: not a JSON object")
    return config


def model_config_from_hf(config: dict, where: Path | str = CONFIG_FILE) -> ModelConfig:
    """pipegpt's ModelConfig of a Hugging Face GPT-2 config.json, or a ConvertError naming the field that
    pipegpt's model cannot compute exactly."""
    c = {**HF_DEFAULTS, **config}
    model_type = config.get("model_type")
    if model_type not in (None, "gpt2"):
        raise ConvertError(f"{where}: model_type={model_type!r} is not supported: use gpt2, "
                           f"{', '.join((*convert_llama.ARCHITECTURES, *convert_moe.FAMILIES))}")
    if c["activation_function"] not in ACTIVATIONS:
        raise ConvertError(f"{where}: activation_function={c['activation_function']!r} is not supported: pipegpt "
                           f"computes GELU with the tanh approximation ({' or '.join(map(repr, ACTIVATIONS))})")
    if c["layer_norm_epsilon"] != LAYER_NORM_EPS:
        raise ConvertError(f"{where}: layer_norm_epsilon={c['layer_norm_epsilon']!r} is not supported: pipegpt's "
                           f"LayerNorm uses {LAYER_NORM_EPS}")
    if c["n_inner"] not in (None, 4 * c["n_embd"]):
        raise ConvertError(f"{where}: n_inner={c['n_inner']!r} is not supported: pipegpt's MLP is 4 x n_embd = "
                           f"{4 * c['n_embd']} wide")
    for field, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if c[field] is not want:
            raise ConvertError(f"{where}: {field}={c[field]!r} is not supported (pipegpt's GPT-2 needs {want})")
    try:
        return ModelConfig(vocab_size=c["vocab_size"], seq_len=c["n_positions"], n_layer=c["n_layer"],
                           n_head=c["n_head"], n_embd=c["n_embd"], dropout=0.0,
                           tie_embeddings=c["tie_word_embeddings"], pad_vocab_to=1, bias=True).validate()
    except ConfigError as e:
        raise ConvertError(f"{where}: {e}") from None


def _load_tensor_file(path: Path) -> dict:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)  # tensors only: nothing runs
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ConvertError(f"{path}: unreadable weights ({type(e).__name__}: {first})") from None


def read_hf_weights(hf_dir: Path) -> dict:
    """{Hugging Face name: tensor} of model.safetensors or pytorch_model.bin (either may be sharded, with an
    index), names without their `transformer.` prefix."""
    hf_dir = Path(hf_dir)
    for single in (SAFETENSORS_FILE, BIN_FILE):
        index = hf_dir / f"{single}.index.json"
        if (hf_dir / single).is_file():
            files = [hf_dir / single]
        elif index.is_file():
            try:
                files = [hf_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConvertError(f"{index}: unreadable index ({type(e).__name__})") from None
        else:
            continue
        weights = {}
        for f in files:
            if not f.is_file():
                raise ConvertError(f"{f}: not found (named by {index.name})")
            loaded = _load_tensor_file(f)
            if not isinstance(loaded, dict):
                raise ConvertError(f"{f}: holds a {type(loaded).__name__}, not a state dict")
            weights.update(loaded)
        return {k.removeprefix("transformer."): v for k, v in weights.items()}
    raise ConvertError(f"{hf_dir}: holds no {SAFETENSORS_FILE} or {BIN_FILE} (nor a sharded index of either)")


def from_hf_state_dict(weights: dict, model: ModelConfig, where: Path | str = "") -> dict:
    """pipegpt's one-process state dict (float32) of a Hugging Face GPT-2 state dict (names without
    `transformer.`); a ConvertError names the first missing, unexpected or misshapen tensor."""
    shapes = named_shapes(model)
    mapping = name_map(model)
    expected = {hf for hf, _, _ in mapping} | ({"lm_head.weight"} if model.tie_embeddings else set())
    return convert_llama.checked_weights(weights, mapping, shapes, expected, _NOT_WEIGHTS, where, "a GPT-2",
                                         f"n_layer={model.n_layer}, tie_word_embeddings={model.tie_embeddings}")


def import_hf(hf_dir, out, tokenizer: str | None = None,
              say: Callable[[str], None] = lambda line: None) -> tuple[Path, ModelConfig]:
    """Convert a Hugging Face GPT-2 or Llama-family directory into a weights-only checkpoint at `out`
    (atomically). The tokenizer it remembers: _tokenizer_for (say() gets a line when the vocabulary chose it)."""
    hf_dir, out = Path(hf_dir), Path(out)
    hf_config = read_hf_config(hf_dir)
    convert_moe.check_router(hf_config, hf_dir / CONFIG_FILE)  # by name, whatever the model type
    moe = convert_moe.is_moe_family(hf_config)
    llama = moe or convert_llama.is_llama_family(hf_config)  # Llama-shaped: its tokenizer.json is its own
    if moe:
        model = convert_moe.model_config_from_hf(hf_config, hf_dir / CONFIG_FILE)
    elif llama:
        model = convert_llama.model_config_from_hf(hf_config, hf_dir / CONFIG_FILE)
    else:
        model = model_config_from_hf(hf_config, hf_dir / CONFIG_FILE)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ConvertError(f"--out {out}: already exists: choose a new path for the checkpoint")
    if moe:
        state = convert_moe.from_hf_state_dict(read_hf_weights(hf_dir), model,
                                               convert_moe.FAMILIES[hf_config["model_type"]], hf_dir)
    elif llama:
        state = convert_llama.from_hf_state_dict(read_hf_weights(hf_dir), model, named_shapes(model), hf_dir)
    else:
        state = from_hf_state_dict(read_hf_weights(hf_dir), model, hf_dir)
    tokenizer = _tokenizer_for(hf_dir, tokenizer, llama, model.vocab_size, say)
    source = {"from_hf": str(hf_dir), "hf_config": hf_config}
    path = checkpoint.write_weights(out, state, {"model": model.settings(), "tokenizer": tokenizer,
                                                 "config": source})
    return path, model


def _tokenizer_for(hf_dir: Path, tokenizer: str | None, llama: bool, vocab_size: int,
                   say: Callable[[str], None]) -> str:
    """The tokenizer the checkpoint remembers (loaded once here, so a bad one is refused before anything is
    written): the one given; else a Llama-family directory's own tokenizer.json (by absolute path); gpt2
    (tiktoken's, the same BPE) for a GPT-2 of 50257 tokens or more; else the built-in one whose ids fill the
    vocabulary exactly, said in a line; else none: a ConvertError asks for --tokenizer."""
    from pipegpt.data.tokenizers import get_tokenizer

    if tokenizer is None:
        own = hf_dir / "tokenizer.json"
        if llama and own.is_file():
            tokenizer = str(own)
        elif not llama and vocab_size >= 50257:
            tokenizer = "gpt2"
        elif vocab_size in FITTING_TOKENIZERS:
            tokenizer = FITTING_TOKENIZERS[vocab_size]
            say(f"tokenizer {tokenizer}: {f'{hf_dir} holds no tokenizer.json, and ' if llama else ''}the one whose "
                f"ids fill the {vocab_size}-token vocabulary (give --tokenizer for another)")
        else:
            raise ConvertError(f"{hf_dir}: which tokenizer? {'it holds no tokenizer.json, and ' if llama else ''}"
                               f"a vocabulary of {vocab_size} fits neither bytes (256) nor gpt2 (50257): give "
                               f"--tokenizer (the model's tokenizer.json, gpt2 or bytes)")
    if tokenizer != "gpt2":  # tiktoken may need the network; a GPT-2 import never did
        tokenizer = get_tokenizer(canonical_tokenizer(tokenizer)).name
    return tokenizer


# --------------------------------------------------------------------------------------------------------------
# pipegpt -> Hugging Face

def hf_config(model: ModelConfig, tokenizer: str | None = None) -> dict:
    """A Hugging Face GPT2Config (as config.json) for the model."""
    eot = EOT_TOKENS.get(tokenizer)
    eot = eot if eot is not None and eot < model.vocab_size else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model.vocab_size,
            "n_positions": model.seq_len, "n_ctx": model.seq_len, "n_embd": model.n_embd, "n_layer": model.n_layer,
            "n_head": model.n_head, "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": model.dropout, "embd_pdrop": model.dropout, "attn_pdrop": model.dropout,
            "layer_norm_epsilon": LAYER_NORM_EPS, "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": model.tie_embeddings, "bos_token_id": eot, "eos_token_id": eot,
            "use_cache": True}


def to_hf_state_dict(state: dict, model: ModelConfig) -> dict:
    """Hugging Face names (with `transformer.`, as save_pretrained writes them) of a one-process state dict.
    Padded vocabulary rows are dropped; a model without biases gets zero biases (the same function)."""
    out = {}
    for hf, ours, transpose in name_map(model):
        if ours in state:
            t = state[ours]
        elif not model.bias and ours.endswith(".bias"):
            t = torch.zeros(state[ours.removesuffix(".bias") + ".weight"].shape[0])
        else:
            raise ConvertError(f"the checkpoint holds no param/{ours}")
        if ours in ("wte.weight", "lm_head.weight"):
            t = t[:model.vocab_size]
        t = t.t() if transpose else t
        out[hf if hf == "lm_head.weight" else f"transformer.{hf}"] = t.to(torch.float32).contiguous()
    return out


def export_hf(path, hf_dir) -> tuple[Path, ModelConfig]:
    """Write a checkpoint's (or a run directory's latest's) parameters as HF_DIR/config.json and
    HF_DIR/model.safetensors; refuses to overwrite either."""
    found = checkpoint.resolve(path)
    manifest = checkpoint.read_manifest(found)
    model = ModelConfig(**manifest["model"])
    hf_dir = Path(hf_dir)
    if hf_dir.exists() and not hf_dir.is_dir():
        raise ConvertError(f"--to-hf {hf_dir}: exists and is not a directory")
    for name in (CONFIG_FILE, SAFETENSORS_FILE):
        if (hf_dir / name).exists():
            raise ConvertError(f"--to-hf {hf_dir}: already holds {name}: choose a new directory")
    weights = checkpoint.read_weights(found)
    exporters = {"gpt2": lambda: (to_hf_state_dict(weights, model), hf_config(model, manifest.get("tokenizer"))),
                 "llama": lambda: (convert_llama.to_hf_state_dict(weights, model), convert_llama.hf_config(model)),
                 "moe": lambda: (convert_moe.to_hf_state_dict(weights, model), convert_moe.hf_config(model))}
    tensors, config = exporters["moe" if model.n_experts else model.arch]()
    hf_dir.mkdir(parents=True, exist_ok=True)
    partial = hf_dir / f"{SAFETENSORS_FILE}.partial"
    checkpoint.write_safetensors(partial, tensors, {"format": "pt"})  # follows the umask, as save_file's do not
    os.replace(partial, hf_dir / SAFETENSORS_FILE)
    partial = hf_dir / f"{CONFIG_FILE}.partial"
    partial.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(partial, hf_dir / CONFIG_FILE)  # last: a directory with config.json is whole
    return found, model


def convert_command(from_hf, out, tokenizer, to_hf, source, model_flags) -> list[str]:
    """`pipegpt convert`'s work: an import (--from-hf --out) or an export (--to-hf --checkpoint); the lines it
    prints. model_flags(model, tokenizer): the run flags of a model (the command line's own)."""
    if (from_hf is None) == (to_hf is None):
        raise ConfigError("give --from-hf HF_DIR --out CHECKPOINT (import) or --to-hf HF_DIR "
                          "--checkpoint CHECKPOINT (export)")
    if from_hf is not None:
        if out is None or source is not None:
            raise ConfigError("--from-hf HF_DIR needs --out CHECKPOINT (and no --checkpoint)")
        notes = []
        path, model = import_hf(from_hf, out, tokenizer, notes.append)
        tokenizer = checkpoint.read_manifest(path)["tokenizer"]
        return [f"wrote {path}: {model.n_layer}-layer {model.architecture.title}, n_embd {model.n_embd}, "
                f"{model.n_head} heads" + (f" ({model.kv_heads} key/value)" if model.architecture.grouped_kv else "")
                + (f", {model.n_experts} experts (top {model.experts_per_token})" if model.n_experts else "")
                + f", vocabulary {model.vocab_size}, seq_len {model.seq_len}, "
                f"{'tied' if model.tie_embeddings else 'untied'} embeddings; tokenizer {tokenizer}", *notes,
                f"train from it: pipegpt run --init-from {path} {model_flags(model, tokenizer)}",
                f"sample from it: pipegpt sample {path} --prompt ..."]
    if source is None or out is not None or tokenizer is not None:
        raise ConfigError("--to-hf HF_DIR needs --checkpoint CHECKPOINT (and no --out or --tokenizer)")
    found, model = export_hf(source, to_hf)
    return [f"wrote {to_hf}/config.json and model.safetensors from {found}: {model.n_layer}-layer "
            f"{model.architecture.title}, n_embd {model.n_embd}, vocabulary {model.vocab_size}"]
