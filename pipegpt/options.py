"""`pipegpt run`'s options made from the configuration, and the configuration made from them.

`pipegpt run` has one option per config field with help text, so pipegpt.config holds every default once; the
model's shape options (`run` and `plan` share them) are pipegpt.command_options'. Torch-free, like pipegpt.config.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import click
from click.core import ParameterSource

from pipegpt.arch import ARCHITECTURES, GPT2
from pipegpt.command_options import (EXPERT_OPTIONS, MODEL_OPTIONS, check_arch_flags, model_from_options, shown_value,
                                     tie_from_flags)
from pipegpt.config import (MODEL_PRESETS, SECTIONS, ConfigError, ModelConfig, TrainConfig, canonical_tokenizer,
                            microbatch_size_for, option_flags)
from pipegpt.dims import LAYOUT_FIELDS
from pipegpt.schedule.schedule_file import check_against_file, load_schedule_file
from pipegpt import run_files


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
        kind["default"] = None if f.default is None else str(f.default)
    elif f.type.startswith("tuple[int"):
        kind["callback"] = lambda ctx, param, value: int_tuple(value)
    elif f.type == "int | str":  # a count or a word (auto); the config's validate() refuses anything else
        kind["callback"] = lambda ctx, param, value: int(value) if value.lstrip("-").isdigit() else value
        kind["metavar"] = "N|AUTO"
    else:
        kind["type"] = {"int": int, "float": float, "str": str}[f.type.split(" |")[0]]
    return kind


def config_options(command):
    """One option per config field that has help text."""
    for section in reversed(list(SECTIONS.values())):
        for f in reversed(dataclasses.fields(section)):
            if f.metadata.get("help"):
                flag, *short = option_flags(f.name)
                if f.type == "bool":  # --resume restores a run's settings: an on/off one can be turned off
                    flag += "/--no-" + flag[2:]
                names = [flag, *short]
                command = click.option(*names, f.name, help=f.metadata["help"], **_option_kind(f))(command)
    return command


def dry_run_option(command):
    """--dry-run [DEVICE]: check the job and predict it on DEVICE (pipegpt.train.dry_run), starting nothing."""
    return click.option("--dry-run", "dry_run", is_flag=False, flag_value="here", default=None, metavar="[DEVICE]",
                        help="Check the settings and the plan, print the layout, the predicted step time and each "
                             "rank's memory on DEVICE (a `pipegpt plan --device` preset such as h100; alone: this "
                             "machine's) for this world size, and exit without starting a worker.")(command)


def train_config(ctx: click.Context, batch_size: int | None, options: dict,
                 say: Callable[[str], None] = lambda line: None, config_file: str | None = None,
                 layout: str = "given") -> TrainConfig:
    """`pipegpt run`'s TrainConfig from its options (the config fields and model_options).

    With --resume, every setting comes from the checkpoint's run except those given on the command line;
    say() gets one line per setting that differs from that run's (`--stages 4 -> 2`). With --config, the
    file's settings replace the defaults the same way (the options given still win). With layout "auto" the
    planner chooses the layout for the ranks this run has (auto_layout)."""
    settings = {k: v for k, v in options.items() if k not in MODEL_OPTIONS}
    if layout == "auto":
        clash = [f"--{name.replace('_', '-')}" for name in AUTO_LAYOUT_FIELDS if given(ctx, name)]
        if clash:
            raise click.UsageError(f"--layout auto chooses the layout: leave out {', '.join(clash)} (or give the "
                                   f"layout and leave out --layout auto)")
    filed = None
    if config_file is not None:
        if settings["resume"] is not None:
            raise click.UsageError("give either --config or --resume, not both (a resume takes its run's settings; "
                                   "options given override them)")
        filed = read_config_file(config_file)
        if filed["config"]["checkpoint"].get("resume") is not None:
            raise ConfigError(f"--config {config_file}: resume is not read from a file (a resume takes its run's "
                              f"settings): give --resume {filed['config']['checkpoint']['resume']} on the command line")
        _restore(ctx, settings, filed["config"], from_file=True)
        options = _file_model_options(ctx, options, filed["model"], config_file)
    saved = saved_run(settings["resume"]) if settings["resume"] is not None else None
    if saved is not None:
        _restore(ctx, settings, saved["config"])
    if settings["schedule_file"] is not None:
        _from_schedule_file(ctx, settings)
    elif saved is None and not (config_file is not None and "stages" in filed["config"]["parallel"]):
        _stages_from_world(ctx, settings)
    global_batch = batch_size or settings["dp"] * settings["microbatches"] * settings["microbatch_size"]
    if batch_size is not None and layout != "auto":
        settings["microbatch_size"] = microbatch_size_for(batch_size, settings["dp"], settings["microbatches"])
    start = initial_model(settings["init_from"]) if saved is None and settings["init_from"] is not None else None
    if start is not None and start.get("tokenizer") and not given(ctx, "tokenizer"):
        settings["tokenizer"] = start["tokenizer"]  # the checkpoint's (a converted model's tokenizer.json)
    settings["tokenizer"] = canonical_tokenizer(settings["tokenizer"])
    if start is not None:  # --init-from: the checkpoint's shape, as --resume
        model = _resumed_model(ctx, options, start["model"], settings["tokenizer"], start["checkpoint"])
    elif saved is None:
        model = model_from_options(options, vocab_size=50257 if settings["tokenizer"] == "gpt2" else None)
    else:
        model = _resumed_model(ctx, options, saved["model"], settings["tokenizer"], saved["checkpoint"])
        _fit_split(ctx, settings, saved, model)
    if layout == "auto":
        settings.update(auto_layout(model, global_batch, settings, say))
    cfg = TrainConfig.build(model, **settings)
    if saved is not None:
        changes = resume_changes(ctx, cfg, saved)
        if changes:
            say(f"pipegpt: resuming {saved['checkpoint']} with its run's settings, except:")
        for line in changes:
            say(line)
    data = cfg.data.data
    if data is not None and not os.path.exists(data):
        raise ConfigError(f"--data {data}: no such file or directory (a directory from `pipegpt prepare`, nanoGPT "
                          f"or llm.c token files, or a flat uint16 file; leave it out for the built-in corpus)")
    return cfg


# the settings --layout auto chooses: giving one of them as well is refused
AUTO_LAYOUT_FIELDS = tuple(f.name for f in LAYOUT_FIELDS if f.auto)


def auto_layout(model: ModelConfig, global_batch: int, settings: dict, say: Callable[[str], None],
                env=os.environ) -> dict:
    """--layout auto: the planner's layout (pipegpt.planner.auto) for this run's ranks: torchrun's WORLD_SIZE, else
    the GPUs here, else a rank per core this process may use (at most 8). The global batch stays; its split may
    change."""
    from pipegpt.config import under_torchrun, usable_cores
    from pipegpt.planner.auto import choose_layout

    import torch

    cuda = settings["device"] != "cpu" and torch.cuda.is_available()
    if under_torchrun(env):
        ranks, per_node = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    else:
        ranks = torch.cuda.device_count() if cuda else min(usable_cores(), 8)
        per_node = ranks
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else None
    chosen = choose_layout(model, global_batch, ranks, per_node, settings["precision"], name, memory)
    say(f"pipegpt: --layout auto on {ranks} rank{'s' if ranks != 1 else ''}: {chosen.text()}")
    return {**chosen.settings(), "schedule_file": None, "balance": "even"}


# --------------------------------------------------------------------------------------------------------------
# --config FILE: TOML or JSON, in a run's config.json sections or flat by setting name

def _stages_from_world(ctx: click.Context, settings: dict, env=os.environ) -> None:
    """Under torchrun without --stages, every process is a worker: stages = WORLD_SIZE / (dp x cp x tp)."""
    from pipegpt.config import under_torchrun
    from pipegpt.dims import AXES, AXIS_FIELDS, ParallelDims

    if given(ctx, "stages") or not under_torchrun(env) or not env.get("WORLD_SIZE", "").isdigit():
        return
    world = int(env["WORLD_SIZE"])
    stage = ParallelDims(**{axis: settings[name] or 1 for axis, name in AXIS_FIELDS.items() if axis != "pp"})
    if world % stage.world_size:  # the ranks of one pipeline position: every axis but pp
        sizes = " x ".join(f"--{AXIS_FIELDS[axis]} {n}" for axis, n in zip(AXES, stage.sizes) if axis != "pp")
        raise ConfigError(f"WORLD_SIZE {world} is not a multiple of {sizes}: give --stages, or sizes that divide it")
    settings["stages"] = world // stage.world_size


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


def _file_model_options(ctx: click.Context, options: dict, model: dict, path: str) -> dict:
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
                                                        "rope_theta", "norm_eps", "qkv_bias", "head_size", "qk_norm",
              *EXPERT_OPTIONS)}
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


def resume_auto(run_dir: str | None) -> tuple[str | None, bool]:
    """--resume auto (an elastic job's restarts under torchrun): the run directory's latest checkpoint, else a
    fresh start there; and whether the directory already holds an attempt of the run (it then goes on)."""
    from pipegpt.state import checkpoint

    if run_dir is None:
        raise click.UsageError("--resume auto resumes the run in --run-dir: give --run-dir DIR (the same on every "
                               "restart)")
    if checkpoint.complete_checkpoints(os.path.join(run_dir, run_files.CHECKPOINTS)):
        return run_dir, True
    held = os.path.isfile(os.path.join(run_dir, run_files.METRICS)) or os.path.isdir(os.path.join(run_dir, run_files.CONFIGS))
    return None, held


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


def _restore(ctx: click.Context, settings: dict, saved: dict, from_file: bool = False) -> None:
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
              "rope_theta", "norm_eps", "qkv_bias", "head_size", "qk_norm",
              *EXPERT_OPTIONS)


def _resumed_model(ctx: click.Context, options: dict, saved: dict, tokenizer: str,
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
        if "head_size" in changes:
            flags["head_size"] = f"--head-dim {changes['head_size']}"
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


def _fit_split(ctx: click.Context, settings: dict, saved: dict, model: ModelConfig) -> None:
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
               "rope_theta": "--rope-theta", "norm_eps": "--norm-eps", "qkv_bias": "--qkv-bias",
               **{name: f"--{name.replace('_', '-')}" for name in EXPERT_OPTIONS}}


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


# `pipegpt run --help` in sections, in this order: each option's section is its config section's (config.json's
# [parallel], [optim], ...) as HELP_OF_SECTION names it, unless HELP_MOVED places it (an option of the command
# line alone, or one that config.json keeps with others than a user looks for it beside).
HELP_ORDER = ("Model", "Layout", "Schedule", "Training", "Data", "Checkpoints", "Resilience", "Observability")
HELP_OF_SECTION = {"parallel": "Layout", "optim": "Training", "data": "Data", "runtime": "Training",
                   "checkpoint": "Checkpoints", "eval": "Observability"}
HELP_MOVED = {
    "Layout": ("layout", "port", "dry_run"),
    "Schedule": ("schedule", "schedule_file", "virtual_stages", "max_live", "microbatches", "microbatch_size"),
    "Training": ("config_file", "batch_size"),
    "Checkpoints": ("run_dir", "overwrite"),
    "Resilience": ("max_restarts", "min_ranks", "snapshot_every", "timeout_s", "step_timeout_s", "on_nonfinite",
                   "max_skipped_steps"),
    "Observability": ("log_every", "trace_steps", "profile", "peak_tflops", "wandb"),
}


def help_section(name: str) -> str:
    """The `run --help` section of the option whose parameter is `name` ("Other" for one no list places)."""
    moved = next((title for title, names in HELP_MOVED.items() if name in names), None)
    if moved is not None:
        return moved
    if name in MODEL_OPTIONS:
        return "Model"
    return next((HELP_OF_SECTION[s] for s, cls in SECTIONS.items()
                 if any(f.name == name for f in dataclasses.fields(cls))), "Other")


RUN_EXAMPLES = (
    "pipegpt run --stages 4 --microbatches 16 --steps 100 --run-dir runs/a     # tiny model, built-in text",
    "pipegpt run --model gpt2 --data data/books --tokenizer gpt2 --stages 4 --microbatches 32 --device cuda",
    "pipegpt run --resume runs/a --steps 200                                   # on from its last checkpoint",
)


class SectionedCommand(click.Command):
    """A click command whose --help shows the most used examples, then lists its options under HELP_ORDER's
    headings (click has no option groups)."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help_text(ctx, formatter)
        formatter.write_paragraph()
        with formatter.indentation():
            for line in RUN_EXAMPLES:
                formatter.write(f"{' ' * formatter.current_indent}{line}\n")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                records.setdefault(help_section(param.name), []).append(record)
        for title in (*HELP_ORDER, "Other"):
            if title in records:
                with formatter.section(f"{title} options"):
                    formatter.write_dl(records[title])
