"""A run's settings from files: a --config file (TOML or JSON), the run a --resume checkpoint was saved by, the model
an --init-from checkpoint holds; the options given on the command line win over each. Torch-free, like
pipegpt.config (the checkpoint's manifest is read by pipegpt.state.checkpoint, imported when needed).
"""
from __future__ import annotations

import dataclasses

import click
from click.core import ParameterSource

from pipegpt.arch import ARCHITECTURES, GPT2
from pipegpt.config import MODEL_PRESETS, SECTIONS, ConfigError, ModelConfig, TrainConfig
from pipegpt.shape_options import shown_value, tie_from_flags, check_arch_flags, model_from_options


# --------------------------------------------------------------------------------------------------------------
# --config FILE: TOML or JSON, in a run's config.json sections or flat by setting name

def read_config_file(path: str) -> dict:
    """{"config": sections, "model": fields or a preset's name} from a TOML or JSON file. Keys are a section's
    name (model, parallel, ...: a run's config.json) or a setting's own name (stages = 2); unknown keys are
    refused in one line naming the valid ones."""
    import json
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f) if path.lower().endswith(".toml") else json.load(f)
    except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise ConfigError(f"--config {path}: {str(e).splitlines()[0][:120]} (TOML if it ends in .toml, else JSON)")
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a table of settings, not {type(raw).__name__}")
    owner = {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    model_keys = [f.name for f in dataclasses.fields(ModelConfig)]
    sections: dict = {section: {} for section in SECTIONS}
    model: dict = {}
    for key, value in raw.items():
        if key == "model" and isinstance(value, str):  # model = "gpt2": a preset
            model["preset"] = value
        elif key == "model" or key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"--config {path}: section {key!r} must be a table of settings")
            valid = model_keys if key == "model" else [f.name for f in dataclasses.fields(SECTIONS[key])]
            unknown = [k for k in value if k not in valid]
            if unknown:
                raise ConfigError(f"--config {path}: unknown key {key}.{unknown[0]} (valid: {', '.join(valid)})")
            target = model if key == "model" else sections[key]
            twice = next((k for k in value if k in target), None)
            if twice is not None:
                raise ConfigError(f"--config {path}: {twice} is given twice ({twice} = {target[twice]!r} and "
                                  f"[{key}] {twice} = {value[twice]!r}): keep one")
            target.update(value)
        elif key in owner:
            if key in sections[owner[key]]:
                raise ConfigError(f"--config {path}: {key} is given twice ([{owner[key]}] {key} = "
                                  f"{sections[owner[key]][key]!r} and {key} = {value!r}): keep one")
            sections[owner[key]][key] = value
        elif key in model_keys or key == "preset":
            model[key] = value
        else:
            import difflib

            names = sorted(set(owner) | set(model_keys))
            near = difflib.get_close_matches(key, names, n=1)
            raise ConfigError(f"--config {path}: unknown key {key!r}{f' (did you mean {near[0]}?)' if near else ''}; "
                              f"valid: the sections model, {', '.join(SECTIONS)}, or a setting: {', '.join(names)}")
    return {"config": sections, "model": model}


def file_model_options(ctx: click.Context, options: dict, model: dict, path: str) -> dict:
    """The model options with the file's shape filling those not given on the command line."""
    if given(ctx, "preset") or not model:  # a --model given names the whole shape
        return options
    arch = model.get("arch") or (MODEL_PRESETS[model["preset"]].arch if model.get("preset") in MODEL_PRESETS
                                 else "gpt2")
    bias = ARCHITECTURES.get(arch, GPT2).bias  # each architecture's own: GPT-2 has biases, Llama none
    if model.get("bias", bias) is not bias:
        raise ConfigError(f"--config {path}: model.bias = {model['bias']!r}: only {str(bias).lower()} "
                          f"is supported for arch {arch}")
    filled = dict(options)
    as_options = {k: v for k, v in model.items() if k in ("preset", "n_layer", "n_embd", "n_head", "seq_len",
                                                        "vocab_size", "dropout", "arch", "n_kv_head", "ffn_hidden",
                                                        "rope_theta", "norm_eps", "qkv_bias")}
    if "pad_vocab_to" in model:
        as_options["pad_vocab"] = model["pad_vocab_to"] not in (None, 1)
    if "tie_embeddings" in model and not (given(ctx, "tie_embeddings") or given(ctx, "no_tie_embeddings")):
        as_options["no_tie_embeddings"] = not model["tie_embeddings"]
        as_options["tie_embeddings"] = bool(model["tie_embeddings"])
    for name, value in as_options.items():
        if not given(ctx, name):
            filled[name] = value
    return filled

# --------------------------------------------------------------------------------------------------------------
# --resume: the run's own settings, except those given on the command line

NOT_RESUMED = ("resume", "init_from")  # where this attempt starts from is the command line's
LAYOUT = ("stages", "virtual_stages", "schedule", "schedule_file")  # a split of layers per stage is for one layout


def given(ctx: click.Context, name: str) -> bool:
    """Whether the option called `name` was given (on the command line or in the environment), not defaulted."""
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)


def saved_run(resume: str) -> dict | None:
    """{"config": sections, "model": fields} of the run a --resume checkpoint was saved by, None for a checkpoint
    that holds no run (weights only: the driver refuses to resume it, in one line)."""
    from pipegpt.state import checkpoint

    found = checkpoint.resolve(resume)
    manifest = checkpoint.read_manifest(found, verify=False)  # the driver verifies the files before loading
    if not isinstance(manifest.get("config"), dict) or not isinstance(manifest.get("model"), dict):
        return None
    return {"config": manifest["config"], "model": manifest["model"], "checkpoint": found}


def initial_model(init_from: str) -> dict | None:
    """{"model": fields, "checkpoint": path} of an --init-from checkpoint; None where it cannot be read or holds no
    model (the driver then refuses it in one line, as it verifies the files)."""
    from pipegpt.state import checkpoint

    try:
        found = checkpoint.resolve(init_from)
        manifest = checkpoint.read_manifest(found, verify=False)
    except (checkpoint.CheckpointError, OSError, ValueError):
        return None
    if not isinstance(manifest.get("model"), dict):
        return None
    return {"model": manifest["model"], "checkpoint": found, "tokenizer": manifest.get("tokenizer")}


def _as_field(value):
    """A value read back from JSON as the config holds it (its lists were tuples)."""
    return tuple(value) if isinstance(value, list) else value


def restore_settings(ctx: click.Context, settings: dict, saved: dict, from_file: bool = False) -> None:
    """Every setting of the saved run (`saved`: its config's sections) that the command line does not give.
    A checkpoint older than a setting leaves it at its default. A --config file (from_file) may say where the
    run starts (init_from); a saved run's own start is not this attempt's."""
    skipped = () if from_file else NOT_RESUMED
    for section, cls in SECTIONS.items():
        stored = saved.get(section) or {}
        for f in dataclasses.fields(cls):
            if f.name in skipped or f.name not in stored or (f.metadata.get("help") and given(ctx, f.name)):
                continue
            settings[f.name] = _as_field(stored[f.name])
    old = saved.get("parallel") or {}
    if given(ctx, "schedule") and not given(ctx, "schedule_file"):
        settings["schedule_file"] = None  # the named schedule replaces the saved run's file
    if (given(ctx, "schedule_file") or settings["schedule"] != old.get("schedule")) and not given(ctx, "virtual_stages"):
        settings["virtual_stages"] = None  # the saved run's value was for its schedule


# model options that set the field of the same name
_SAME_NAME = ("n_layer", "n_embd", "n_head", "seq_len", "vocab_size", "dropout", "arch", "n_kv_head", "ffn_hidden",
              "rope_theta", "norm_eps", "qkv_bias")


def resumed_model(ctx: click.Context, options: dict, saved: dict, tokenizer: str,
                   where="the checkpoint") -> ModelConfig:
    """The checkpoint's model (a --resume's or --init-from's) with the shape options given on the command line
    applied (a --model preset given names the whole shape). A given option that disagrees with the checkpoint is
    refused in one line naming it, before any worker starts; dropout may differ."""
    known = [f.name for f in dataclasses.fields(ModelConfig)]  # in order: the line names the same field each time
    theirs = ModelConfig(**{k: _as_field(v) for k, v in saved.items() if k in known})
    if given(ctx, "preset"):
        model = model_from_options(options, vocab_size=50257 if tokenizer == "gpt2" else None)
        flags = {name: f"--model {options['preset']}" for name in known}
    else:
        changes = {name: options[name] for name in _SAME_NAME if given(ctx, name) and options[name] is not None}
        flags = {name: f"--{name.replace('_', '-')} {shown_value(value)}" for name, value in changes.items()}
        if changes.get("qkv_bias") is False:
            flags["qkv_bias"] = "--no-qkv-bias"
        if given(ctx, "pad_vocab") and options["pad_vocab"]:
            changes["pad_vocab_to"], flags["pad_vocab_to"] = 64, "--pad-vocab"
        tie = tie_from_flags({name: options.get(name) if given(ctx, name) else None
                    for name in ("tie_embeddings", "no_tie_embeddings")})
        if tie is not None:
            changes["tie_embeddings"] = tie
            flags["tie_embeddings"] = "--tie-embeddings" if tie else "--no-tie-embeddings"
        check_arch_flags(changes, changes.get("arch", theirs.arch))
        if changes.get("ffn_hidden") == theirs.ffn_width:  # the width the checkpoint's rule gives, stated
            changes["ffn_hidden"] = theirs.ffn_hidden
        model = dataclasses.replace(theirs, **changes)  # validated below: the disagreement is the news
    diff = [name for name in known if name != "dropout" and getattr(model, name) != getattr(theirs, name)]
    if diff:
        name = diff[0]
        raise ConfigError(f"{where}: checkpoint of another model: "
                          f"{', '.join(f'{k}={getattr(theirs, k)!r} (this run: {getattr(model, k)!r})' for k in diff)}"
                          f"; {flags.get(name, 'the options given')} disagrees with its {name} "
                          f"{shown_value(getattr(theirs, name))}: leave it out to take the checkpoint's")
    return model.validate()


def fit_split(ctx: click.Context, settings: dict, saved: dict, model: ModelConfig) -> None:
    """A saved split of the layers (--layers-per-stage, or the one --balance cost measured, with its costs) fits
    the saved run's layout: under another layout or --balance, the split is made again (even, or measured)."""
    old = saved["config"].get("parallel") or {}
    if given(ctx, "layers_per_stage"):  # the split given replaces the measured one
        settings["balanced_costs"] = None
        if not given(ctx, "balance"):
            settings["balance"] = "even"
        return
    moved = any(settings[name] != _as_field(old.get(name)) for name in (*LAYOUT, "balance")) or \
        model.n_layer != saved["model"].get("n_layer")
    if moved:
        settings.update(layers_per_stage=None, balanced_costs=None, schedule_costs=None)


# The model's fields that options set, by the option's name
MODEL_FLAGS = {"n_layer": "--n-layer", "n_embd": "--n-embd", "n_head": "--n-head", "seq_len": "--seq-len",
               "vocab_size": "--vocab-size", "pad_vocab_to": "--pad-vocab", "tie_embeddings": "--no-tie-embeddings",
               "dropout": "--dropout", "arch": "--arch", "n_kv_head": "--n-kv-head", "ffn_hidden": "--ffn-hidden",
               "rope_theta": "--rope-theta", "norm_eps": "--norm-eps", "qkv_bias": "--qkv-bias"}


def resume_changes(ctx: click.Context, cfg: TrainConfig, saved: dict) -> list[str]:
    """One line per option whose value differs from the saved run's: `--stages 4 -> 2`, and what follows from
    those given (`--virtual-stages 2 -> default (follows the options given)`)."""
    lines = []
    for key, flag, old, new in _option_values(cfg, saved):
        if key in NOT_RESUMED or old is _MISSING or _as_field(old) == new:
            continue
        if key == "tie_embeddings":  # the flag says the opposite
            old, new = not old, not new
        why = "" if given(ctx, key) or key in MODEL_FLAGS else " (follows the options given)"
        if key == "microbatch_size" and given(ctx, "batch_size"):
            why = " (from --batch-size)"
        lines.append(f"{flag} {shown_value(old)} -> {shown_value(new)}{why}")
    return lines


_MISSING = object()


def _option_values(cfg: TrainConfig, saved: dict):
    """(field, flag, the saved run's value or _MISSING, this run's value) of every option."""
    for name, flag in MODEL_FLAGS.items():
        yield name, flag, saved["model"].get(name, _MISSING), getattr(cfg.model, name)
    for section, cls in SECTIONS.items():
        stored = saved["config"].get(section) or {}
        for f in dataclasses.fields(cls):
            if f.metadata.get("help"):
                yield (f.name, f.metadata["flag"] or "--" + f.name.replace("_", "-"), stored.get(f.name, _MISSING),
                       getattr(getattr(cfg, section), f.name))
