"""`pipegpt run`'s options made from the configuration, and the configuration made from them.

`pipegpt run` has one option per config field with help text, so pipegpt.config holds every default once; the
model's shape options are pipegpt.shape_options', the settings a --config file or a --resume checkpoint brings
pipegpt.saved_settings'. Torch-free, like pipegpt.config.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import click
from click.core import ParameterSource

from pipegpt.config import (SECTIONS, ConfigError, ModelConfig, TrainConfig, canonical_tokenizer,
                            microbatch_size_for, option_flags)
from pipegpt.dims import LAYOUT_FIELDS
from pipegpt.saved_settings import (file_model_options, fit_split, given, initial_model, read_config_file,
                                    restore_settings, resume_changes, resumed_model, saved_run)
from pipegpt.schedule.schedule_file import check_against_file, load_schedule_file
from pipegpt.shape_options import MODEL_OPTIONS, model_from_options
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
        restore_settings(ctx, settings, filed["config"], from_file=True)
        options = file_model_options(ctx, options, filed["model"], config_file)
    saved = saved_run(settings["resume"]) if settings["resume"] is not None else None
    if saved is not None:
        restore_settings(ctx, settings, saved["config"])
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
        model = resumed_model(ctx, options, start["model"], settings["tokenizer"], start["checkpoint"])
    elif saved is None:
        model = model_from_options(options, vocab_size=50257 if settings["tokenizer"] == "gpt2" else None)
    else:
        model = resumed_model(ctx, options, saved["model"], settings["tokenizer"], saved["checkpoint"])
        fit_split(ctx, settings, saved, model)
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
    """--layout auto: the planner's layout (pipegpt.plan.auto) for this run's ranks: torchrun's WORLD_SIZE, else
    the GPUs here, else a rank per core (at most 8). The global batch stays; its split may change."""
    from pipegpt.config import under_torchrun
    from pipegpt.plan.auto import choose_layout

    import torch

    cuda = settings["device"] != "cpu" and torch.cuda.is_available()
    if under_torchrun(env):
        ranks, per_node = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    else:
        ranks = torch.cuda.device_count() if cuda else min(os.cpu_count() or 1, 8)
        per_node = ranks
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else None
    chosen = choose_layout(model, global_batch, ranks, per_node, settings["precision"], name, memory)
    say(f"pipegpt: --layout auto on {ranks} rank{'s' if ranks != 1 else ''}: {chosen.text()}")
    return {**chosen.settings(), "schedule_file": None, "balance": "even"}


def _stages_from_world(ctx: click.Context, settings: dict, env=os.environ) -> None:
    """Under torchrun without --stages, every process is a worker: stages = WORLD_SIZE / (dp x tp)."""
    from pipegpt.config import under_torchrun

    if given(ctx, "stages") or not under_torchrun(env) or not env.get("WORLD_SIZE", "").isdigit():
        return
    world, dp, tp = int(env["WORLD_SIZE"]), settings["dp"] or 1, settings["tp"] or 1
    if world % (dp * tp):
        raise ConfigError(f"WORLD_SIZE {world} is not a multiple of --dp {dp} x --tp {tp}: give --stages, or a dp "
                          f"and tp that divide it")
    settings["stages"] = world // (dp * tp)


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
