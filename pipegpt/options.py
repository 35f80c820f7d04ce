"""Command-line options made from the configuration, and the configuration made from them.

`pipegpt run` has one option per config field with help text, so pipegpt.config holds every default once;
`run` and `plan` share the model's shape options. Torch-free, like pipegpt.config.
"""
from __future__ import annotations

import dataclasses
import os

import click
from click.core import ParameterSource

from pipegpt.config import (MODEL_PRESETS, SECTIONS, ConfigError, ModelConfig, TrainConfig, microbatch_size_for,
                            model_config)
from pipegpt.schedule.schedule_file import check_against_file, load_schedule_file

MODEL_OPTIONS = ("preset", "n_layer", "n_embd", "n_head", "seq_len", "vocab_size", "pad_vocab", "no_tie_embeddings")


def int_tuple(value: str | None) -> tuple[int, ...] | None:
    """'3,3,2,2' -> (3, 3, 2, 2); None stays None."""
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers such as 3,3,2,2") from None


def _option_kind(f) -> dict:
    """click's type and default for a config field (annotations are strings: `from __future__`)."""
    meta, kind = f.metadata, {"default": f.default, "show_default": f.default is not None}
    if f.type == "bool":
        return {"is_flag": True, "default": f.default}
    if meta["choices"]:
        kind["type"] = click.Choice([str(c) for c in meta["choices"]])
        if all(isinstance(c, int) for c in meta["choices"]):
            kind["callback"] = lambda ctx, param, value: int(value)
        kind["default"] = str(f.default)
    elif f.type.startswith("tuple[int"):
        kind["callback"] = lambda ctx, param, value: int_tuple(value)
    else:
        kind["type"] = {"int": int, "float": float, "str": str}[f.type.split(" |")[0]]
    return kind


def config_options(command):
    """One option per config field that has help text."""
    for section in reversed(list(SECTIONS.values())):
        for f in reversed(dataclasses.fields(section)):
            if f.metadata.get("help"):
                names = [f.metadata["flag"] or "--" + f.name.replace("_", "-")] + [n for n in [f.metadata["short"]] if n]
                command = click.option(*names, f.name, help=f.metadata["help"], **_option_kind(f))(command)
    return command


def model_options(command):
    """The model's shape: a preset and the settings that override it (their names: MODEL_OPTIONS)."""
    for option in reversed([
        click.option("--model", "preset", default="tiny", show_default=True,
                     help="tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl."),
        click.option("--n-layer", type=int, default=None), click.option("--n-embd", type=int, default=None),
        click.option("--n-head", type=int, default=None), click.option("--seq-len", type=int, default=None),
        click.option("--vocab-size", type=int, default=None),
        click.option("--pad-vocab", is_flag=True,
                     help="Pad the vocabulary to a multiple of 64 (padded logits are never predicted)."),
        click.option("--no-tie-embeddings", is_flag=True, help="Separate LM-head weight instead of the token embedding."),
    ]):
        command = option(command)
    return command


def model_from_options(options: dict, vocab_size: int | None = None) -> ModelConfig:
    """The model model_options describe: the preset with the shape given overriding it (vocab_size: the
    default when --vocab-size is not given)."""
    o = {name: options[name] for name in MODEL_OPTIONS}
    return model_config(o["preset"], n_layer=o["n_layer"], n_embd=o["n_embd"], n_head=o["n_head"],
                        seq_len=o["seq_len"], vocab_size=vocab_size if o["vocab_size"] is None else o["vocab_size"],
                        tie_embeddings=False if o["no_tie_embeddings"] else None,
                        pad_vocab_to=64 if o["pad_vocab"] else None)


def model_flags(model: ModelConfig, tokenizer: str) -> str:
    """The `pipegpt run` model flags that build exactly this model (as --init-from requires)."""
    preset = next((name for name, m in MODEL_PRESETS.items() if m == model), None)
    if preset is not None:
        flags = f"--model {preset}"
    else:
        flags = (f"--n-layer {model.n_layer} --n-embd {model.n_embd} --n-head {model.n_head} "
                 f"--seq-len {model.seq_len} --vocab-size {model.vocab_size}")
        flags += "" if model.tie_embeddings else " --no-tie-embeddings"
    return f"{flags} --tokenizer {tokenizer}"


def train_config(ctx: click.Context, batch_size: int | None, options: dict) -> TrainConfig:
    """`pipegpt run`'s TrainConfig from its options (the config fields and model_options)."""
    settings = {k: v for k, v in options.items() if k not in MODEL_OPTIONS}
    if settings["schedule_file"] is not None:
        _from_schedule_file(ctx, settings)
    if batch_size is not None:
        settings["microbatch_size"] = microbatch_size_for(batch_size, settings["dp"], settings["microbatches"])
    model = model_from_options(options, vocab_size=50257 if settings["tokenizer"] == "gpt2" else None)
    cfg = TrainConfig.build(model, **settings)
    data = cfg.data.data
    if data is not None and not os.path.exists(data):
        raise ConfigError(f"--data {data}: no such file or directory (a directory from `pipegpt prepare`, nanoGPT "
                          f"or llm.c token files, or a flat uint16 file; leave it out for the built-in corpus)")
    return cfg


def _from_schedule_file(ctx: click.Context, settings: dict) -> None:
    """A schedule file fixes the ranks and microbatches: take them from it, refusing contradictions."""
    path = settings["schedule_file"]
    if ctx.get_parameter_source("schedule") is not ParameterSource.DEFAULT:
        raise click.UsageError("give either --schedule or --schedule-file, not both")
    plan = load_schedule_file(path)
    given = {name: None if ctx.get_parameter_source(name) is ParameterSource.DEFAULT else settings[name]
             for name in ("stages", "microbatches")}
    check_against_file(plan, path, given["stages"], given["microbatches"])
    settings.update(schedule=plan.name, stages=plan.num_ranks, microbatches=plan.num_microbatches)
