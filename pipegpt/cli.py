"""The `pipegpt` command line.

`pipegpt simulate` needs only the pure-Python schedule package, so this module
must not import torch (or anything that does) at import time: torch-dependent
modules are imported inside the commands that need them. Every user error
(ScheduleError, ConfigError, a bad option) prints one `Error: ...` line on
stderr and exits with status 2.
"""
from __future__ import annotations

import json
import os
import sys

import click

from pipegpt.train.checkpoint import CheckpointError
from pipegpt.config import ConfigError, TOKENIZERS
from pipegpt.schedule.actions import ScheduleError

USER_ERRORS = (ScheduleError, ConfigError, CheckpointError)


class _Main(click.Group):
    """A click group whose user errors are one line on stderr, exit status 2, no traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help() if e.ctx else str(e))
            sys.exit(0)
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except click.ClickException as e:
            _fail(e.format_message())
        except USER_ERRORS as e:
            _fail(str(e))
        except BrokenPipeError:  # `pipegpt simulate ... | head`
            sys.stderr.close()
            sys.exit(1)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str):
    click.echo("Error: " + " ".join(str(message).split()), err=True)
    sys.exit(2)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Pipeline-parallel GPT training whose schedules are data."""


# --------------------------------------------------------------------------------------------------------------
# simulate

def _costs_for(spec: str | None, plan):
    """Costs for this plan from --costs text or a .json path.

    Numbers are for one rank's share of the model (a 1F1B stage): a plan with
    v stages per rank (interleaved, zbv, dualpipev) runs each stage at 1/v of
    them, so every schedule does the same total work and makespans compare.
    Per-stage lists (JSON) are taken as they are, one value per stage of the plan.
    """
    from fractions import Fraction

    from pipegpt.schedule.simulate import Costs

    factor = Fraction(plan.num_ranks, plan.num_stages)
    factor = 1 if factor == 1 else float(factor)
    spec = spec or ""
    if spec.lower().endswith(".json") or (spec and os.path.isfile(spec)):
        from pipegpt.schedule.simulate import load_costs_json

        data = load_costs_json(spec)
        scaled = {k: (v if isinstance(v, list) or str(k).lower() == "comm" or isinstance(v, bool)
                      or not isinstance(v, (int, float)) else v * factor)
                  for k, v in data.items()}
        return Costs.from_json(scaled, plan.num_stages)
    costs = Costs.parse(spec, plan.num_stages)
    return costs if factor == 1 else costs.scaled(factor)


def _layer_costs(spec, n_layers, balance, costs_spec):
    """--layer-costs (with --layers, --balance) read, or None; the options' misfits refused."""
    if spec is None:
        if n_layers is not None or balance is not None:
            raise click.UsageError(f"{'--layers' if n_layers is not None else '--balance'} goes with --layer-costs "
                                   f"(e.g. --layer-costs embed=0.1,block=1,head=3 --layers 8)")
        return None
    if costs_spec is not None:
        raise click.UsageError("give --costs (the same F, B, W for every stage) or --layer-costs (each stage's "
                               "from its layers), not both")
    from pipegpt.plan.balance import parse_layer_costs

    return parse_layer_costs(spec, n_layers)


def _costs_from_layers(layer_costs, balance: str, plan):
    """Per-stage costs of this plan's stages from per-layer costs and the split (even or balanced)."""
    from pipegpt.schedule.simulate import Costs

    split = layer_costs.split(balance, plan.stage_to_rank)
    forward = layer_costs.stage_forward(split)
    return Costs(tuple(forward), tuple(f * layer_costs.backward for f in forward),
                 tuple(f * layer_costs.weight for f in forward), layer_costs.comm), split


def _split_names(schedule: str) -> list[str]:
    from pipegpt.schedule.registry import SCHEDULES

    if schedule.strip().lower() == "all":
        return list(SCHEDULES)
    names = [n.strip() for n in schedule.split(",") if n.strip()]
    if not names:
        raise ScheduleError(f"--schedule is empty; known schedules: {', '.join(SCHEDULES)} (or 'all')")
    for n in names:
        if n not in SCHEDULES:
            raise ScheduleError(f"unknown schedule {n!r}; known schedules: {', '.join(SCHEDULES)} (or 'all')")
    return names


def _out_path(out: str, name: str, several: bool) -> str:
    if not several:
        return out
    stem, ext = os.path.splitext(out)
    return f"{stem}.{name}{ext}"


def _record(plan, timeline, costs) -> dict:
    s = timeline.summary()
    record = {
        "schedule": plan.name,
        "applies": True,
        "stages": plan.num_ranks,
        "microbatches": plan.num_microbatches,
        "model_stages": plan.num_stages,
        "stage_to_rank": list(plan.stage_to_rank),
        "virtual_stages": plan.meta.get("virtual_stages", plan.num_stages // plan.num_ranks),
        "costs": {k: (list(map(float, v)) if isinstance(v, list) else float(v)) for k, v in costs.as_dict().items()},
    }
    record.update({k: s[k] for k in ("makespan", "bubble_fraction", "bubble_fraction_per_rank", "busy_per_rank",
                                     "peak_live_microbatches_per_rank", "peak_activation_bytes_per_rank")})
    record["plan"] = plan.compute_only().as_strings()
    return record


def _summary_text(record: dict) -> str:
    from pipegpt.schedule.render import human_bytes

    pct = ", ".join(f"{100 * b:.1f}%" for b in record["bubble_fraction_per_rank"])
    lines = [
        f"schedule {record['schedule']}: {record['stages']} ranks, {record['model_stages']} stages, "
        f"{record['microbatches']} microbatches",
        f"makespan          {record['makespan']:g}",
        f"bubble            {100 * record['bubble_fraction']:.1f}%  (per rank: {pct})",
        "peak live         " + " ".join(map(str, record["peak_live_microbatches_per_rank"]))
        + "  stage-microbatches per rank",
    ]
    if record["peak_activation_bytes_per_rank"] is not None:
        lines.append("peak activations  " + ", ".join(human_bytes(b) for b in record["peak_activation_bytes_per_rank"]))
    return "\n".join(lines)


def _table(records: list[dict]) -> str:
    from pipegpt.schedule import render
    from pipegpt.schedule.render import human_bytes

    has_bytes = any(r.get("peak_activation_bytes_per_rank") for r in records)
    head = ["schedule", "makespan", "bubble", "peak live max/min"] + (["peak bytes max"] if has_bytes else []) \
        + ["applies"]
    rows = []
    for r in records:
        if not r["applies"]:
            rows.append([r["schedule"], "-", "-", "-"] + (["-"] if has_bytes else []) + ["no: " + r["reason"]])
            continue
        live = r["peak_live_microbatches_per_rank"]
        row = [r["schedule"], f"{r['makespan']:g}", f"{100 * r['bubble_fraction']:.1f}%", f"{max(live)}/{min(live)}"]
        if has_bytes:
            pb = r["peak_activation_bytes_per_rank"]
            row.append(human_bytes(max(pb)) if pb else "-")
        rows.append(row + ["yes"])
    return render.text_table([head] + rows, right=set(range(1, len(head))), free_last=True)


@main.command()
@click.option("--schedule", "-s", default=None, metavar="NAME",
              help="Schedule name, a comma list, or 'all' to compare (default 1f1b).")
@click.option("--stages", "-p", type=click.IntRange(min=1), default=None,
              help="Pipeline ranks p (each holds one stage, or v for interleaved/V schedules).")
@click.option("--microbatches", "-m", type=click.IntRange(min=1), default=None, help="Microbatches per step.")
@click.option("--costs", "costs_spec", default=None, metavar="SPEC",
              help="'F=1,B=2,W=1,comm=0.1' (act_bytes= too) or a .json file with per-stage lists. Numbers are "
                   "per rank's share of the model: schedules with v stages per rank run each at 1/v. "
                   "Default F=1,B=2,W=1,comm=0.")
@click.option("--virtual-stages", "-v", type=click.IntRange(min=1), default=None,
              help="Stages per rank for interleaved-1f1b (default 2).")
@click.option("--schedule-file", type=click.Path(dir_okay=False), default=None,
              help="Simulate a plan from a file (one line of actions per rank) instead of a generator.")
@click.option("--trace", "trace_dir", type=click.Path(), default=None, metavar="RUN_DIR",
              help="Measured beside predicted: calibrate costs from a run directory's trace.json, simulate "
                   "its plan.txt with them, show both and the fidelity (predicted / measured).")
@click.option("--trace-step", type=click.IntRange(min=0), default=None, metavar="N",
              help="With --trace: read the run's traces/step-N.json (a step `pipegpt run --trace-steps` named) "
                   "instead of trace.json (the last step).")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default=None,
              help="Also write a picture: .svg, .html or .json (Chrome trace for Perfetto). With several "
                   "schedules the name goes before the extension (out.1f1b.svg); with --trace, .html is one "
                   "page with both timelines, .svg/.json two files (out.measured.svg, out.predicted.svg).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (a list with several schedules).")
@click.option("--no-chart", is_flag=True, help="Leave out the ASCII chart.")
@click.option("--width", type=click.IntRange(min=40), default=None, help="Chart width (default: the terminal's).")
@click.option("--layer-costs", "layer_costs_spec", default=None, metavar="SPEC",
              help="Per-layer forward costs instead of --costs: 'embed=0.1,block=1,head=3' (B=2,W=1 as multiples "
                   "of F and comm= may follow) with --layers N, or a .json file with the same keys (\"blocks\": "
                   "one cost per block). Each stage's F is its layers' sum, plus the embedding on the first and "
                   "the head on the last.")
@click.option("--layers", "n_layers", type=click.IntRange(min=1), default=None,
              help="With --layer-costs: the number of blocks.")
@click.option("--balance", type=click.Choice(["even", "cost"]), default=None,
              help="With --layer-costs: split the layers evenly (as pipegpt run does by default) or by cost (as "
                   "pipegpt run --balance cost does). Default even.")
def simulate(schedule, stages, microbatches, costs_spec, virtual_stages, schedule_file, trace_dir, trace_step, out,
             as_json, no_chart, width, layer_costs_spec, n_layers, balance):
    """Simulate pipeline schedules: ASCII chart, bubble %, makespan, peak live activations.

    \b
    pipegpt simulate --schedule 1f1b --stages 4 --microbatches 16
    pipegpt simulate --schedule all -p 4 -m 16 --costs F=1,B=2,W=1,comm=0.1
    pipegpt simulate --schedule-file my_plan.txt --out plan.html
    pipegpt simulate --trace runs/20250101-120000 --out measured_vs_predicted.html
    pipegpt simulate -p 4 -m 16 --layer-costs embed=0.1,block=1,head=4 --layers 8 --balance cost
    """
    from pipegpt.schedule import render
    from pipegpt.schedule.registry import schedule_spec
    from pipegpt.schedule.simulate import simulate as run_simulation

    if out is not None:
        ext = os.path.splitext(out)[1].lower()
        if ext not in (".svg", ".html", ".htm", ".json"):
            raise click.BadParameter(f"{out!r} must end in .svg, .html or .json", param_hint="--out")

    if trace_dir is not None:
        given = [flag for flag, value in (("--schedule", schedule), ("--schedule-file", schedule_file),
                                          ("--costs", costs_spec), ("--virtual-stages", virtual_stages),
                                          ("--layer-costs", layer_costs_spec), ("--layers", n_layers),
                                          ("--balance", balance))
                 if value is not None]
        if given:
            raise click.UsageError(f"--trace simulates the run's own plan with costs calibrated from its trace; "
                                   f"leave out {' and '.join(given)}")
        return _simulate_trace(trace_dir, stages, microbatches, out, as_json, no_chart, width, trace_step)
    if trace_step is not None:
        raise click.UsageError("--trace-step N picks a traced step of a run: give it with --trace RUN_DIR")
    layer_costs = _layer_costs(layer_costs_spec, n_layers, balance, costs_spec)

    if schedule_file is not None:
        if schedule is not None:
            raise click.UsageError("give either --schedule or --schedule-file, not both")
        if virtual_stages is not None:
            raise click.UsageError("--virtual-stages does not apply to --schedule-file (the file fixes the stages)")
        from pipegpt.schedule.schedule_file import load_schedule_file

        plan = load_schedule_file(schedule_file)
        for flag, given, actual in (("--stages", stages, plan.num_ranks),
                                    ("--microbatches", microbatches, plan.num_microbatches)):
            if given is not None and given != actual:
                raise click.UsageError(f"{flag} {given} does not match {schedule_file}, which has {actual}; "
                                       f"leave {flag} out")
        jobs = [(plan.name, lambda plan=plan: plan)]
    else:
        if stages is None or microbatches is None:
            raise click.UsageError("--stages and --microbatches are required (or give --schedule-file)")
        names = _split_names(schedule or "1f1b")
        several = len(names) > 1

        def job(name):
            spec = schedule_spec(name)
            # Among several schedules, --virtual-stages goes to those it applies to; alone, a misfit is an error.
            v = virtual_stages if (spec.takes_virtual_stages or not several) else None
            return lambda: spec.build(stages, microbatches, v)

        jobs = [(name, job(name)) for name in names]

    several = len(jobs) > 1
    records, timelines = [], []
    for name, make in jobs:
        try:
            plan = make()
            split = None
            if layer_costs is None:
                costs = _costs_for(costs_spec, plan)
            else:
                costs, split = _costs_from_layers(layer_costs, balance or "even", plan)
            timeline = run_simulation(plan, costs)
        except USER_ERRORS as e:
            if not several:
                raise
            records.append({"schedule": name, "applies": False, "reason": " ".join(str(e).split())})
            timelines.append(None)
            continue
        records.append(_record(plan, timeline, costs))
        if split is not None:
            records[-1].update(layers_per_stage=split, balance=balance or "even")
        timelines.append(timeline)

    if out is not None:
        for record, timeline in zip(records, timelines):
            if timeline is not None:
                path = _out_path(out, record["schedule"], several)
                render.write(timeline, path)
                click.echo(f"wrote {path}", err=True)

    if as_json:
        click.echo(json.dumps(records if several else records[0], indent=None))
        return
    if several:
        if layer_costs is not None:
            click.echo(f"{stages} ranks, {microbatches} microbatches; {len(layer_costs.blocks)} layers costing "
                       f"{layer_costs_spec}, split {balance or 'even'} per schedule")
        else:
            click.echo(f"{stages} ranks, {microbatches} microbatches; costs {costs_spec or 'F=1,B=2,W=1,comm=0'} "
                       f"per rank's share of the model (v stages per rank: 1/v each)")
        click.echo(_table(records))
        return
    if not no_chart:
        click.echo(render.ascii_gantt(timelines[0], width=width), nl=False)
        click.echo()
    click.echo(_summary_text(records[0]))
    if "layers_per_stage" in records[0]:
        click.echo(f"layers per stage  {','.join(map(str, records[0]['layers_per_stage']))}  "
                   f"(balance {records[0]['balance']})")


def _write_text(path: str, text: str) -> None:
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as e:
        raise ScheduleError(f"cannot write {path}: {e.strerror}") from None


def _simulate_trace(run_dir, stages, microbatches, out, as_json, no_chart, width, step=None):
    """`simulate --trace RUN_DIR`: the run's measured timeline beside its plan simulated with calibrated costs."""
    from pipegpt.schedule import render
    from pipegpt.schedule.calibrate import compare, comparison_text

    comparison = compare(run_dir, step)
    plan = comparison.plan
    for flag, given, actual in (("--stages", stages, plan.num_ranks),
                                ("--microbatches", microbatches, plan.num_microbatches)):
        if given is not None and given != actual:
            raise click.UsageError(f"{flag} {given} does not match the run in {run_dir}, which has {actual}; "
                                   f"leave {flag} out")
    measured, predicted = comparison.measured, comparison.predicted
    text = comparison_text(comparison)
    if out is not None:
        stem, ext = os.path.splitext(out)
        if ext.lower() in (".html", ".htm"):
            html = render.to_html_side_by_side([("measured", measured), ("predicted", predicted)], text=text,
                                               title=f"{plan.name}: measured vs predicted ({run_dir})")
            _write_text(out, html)
            click.echo(f"wrote {out}", err=True)
        else:
            span = max(measured.makespan, predicted.makespan)
            for name, timeline in (("measured", measured), ("predicted", predicted)):
                path = f"{stem}.{name}{ext}"
                if ext.lower() == ".svg":  # one time scale for both pictures
                    _write_text(path, render.to_svg(timeline, span=span))
                else:
                    render.write(timeline, path)
                click.echo(f"wrote {path}", err=True)
    if as_json:
        click.echo(json.dumps(comparison.summary()))
        return
    if not no_chart:
        span = max(measured.makespan, predicted.makespan)  # one scale: a shorter prediction ends early
        for name, timeline in (("measured", measured), ("predicted (calibrated costs)", predicted)):
            click.echo(f"{name}:")
            click.echo(render.ascii_gantt(timeline, width=width, span=span), nl=False)
            click.echo()
    click.echo(text)


# --------------------------------------------------------------------------------------------------------------
# run: torch and everything that needs it are imported inside the command, so `simulate` starts without them.

def _int_list(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers such as 3,3,2,2") from None


def _exit_now(message: str, code: int):
    """Exit without interpreter teardown: with workers killed mid-call, the RPC agent's
    destructor can abort the process, turning a clean error into a crash."""
    click.echo(message, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _resumed_run_dir(cfg):
    """A resumed run goes on in the run directory its checkpoint is in (RUN/checkpoints/step-N)."""
    from pipegpt.train.checkpoint import resolve

    if cfg.checkpoint.resume is None:
        return None
    found = resolve(cfg.checkpoint.resume)
    return found.parent.parent if found.parent.name == "checkpoints" else None


def _progress_line(m, steps: int) -> str:
    done = (m.step + 1) * 20 // steps
    return (f"step {m.step + 1:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (20 - done)}] loss {m.loss:.4f}  "
            f"{m.step_time_s * 1000:7.1f} ms  {m.tokens_per_s:9,.0f} tok/s")


def _int_tuple(value):
    return None if value is None else _int_list(value)


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
        kind["callback"] = lambda ctx, param, value: _int_tuple(value)
    else:
        kind["type"] = {"int": int, "float": float, "str": str}[f.type.split(" |")[0]]
    return kind


def config_options(command):
    """One option per config field that has help text: pipegpt.config holds every default once."""
    import dataclasses

    from pipegpt.config import SECTIONS

    for section in reversed(list(SECTIONS.values())):
        for f in reversed(dataclasses.fields(section)):
            if f.metadata.get("help"):
                names = [f.metadata["flag"] or "--" + f.name.replace("_", "-")] + [n for n in [f.metadata["short"]] if n]
                command = click.option(*names, f.name, help=f.metadata["help"], **_option_kind(f))(command)
    return command


def _from_schedule_file(ctx, settings: dict) -> None:
    """A schedule file fixes the ranks and microbatches: take them from it, refusing contradictions."""
    from click.core import ParameterSource

    from pipegpt.schedule.schedule_file import load_schedule_file

    path = settings["schedule_file"]
    if ctx.get_parameter_source("schedule") is not ParameterSource.DEFAULT:
        raise click.UsageError("give either --schedule or --schedule-file, not both")
    plan = load_schedule_file(path)
    settings["schedule"] = plan.name
    for name, actual in (("stages", plan.num_ranks), ("microbatches", plan.num_microbatches)):
        if ctx.get_parameter_source(name) is ParameterSource.DEFAULT:
            settings[name] = actual
        elif settings[name] != actual:
            raise ConfigError(f"--{name} {settings[name]} does not match {path}, which has {actual} "
                              f"{'ranks' if name == 'stages' else name}: leave --{name} out")


def model_options(command):
    """The model's shape: a preset and the settings that override it (`run` and `plan` share them)."""
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


@main.command()
@config_options
@click.option("--batch-size", type=int, default=None,
              help="Sequences per step in all (sets the microbatch size: batch / (dp x microbatches)).")
@model_options
@click.option("--run-dir", type=click.Path(), default=None, help="Where metrics.jsonl goes (default: runs/<time>).")
@click.option("--port", type=int, default=None, help="Port for the workers' process group (default: a free one).")
@click.option("--log-every", default=10, show_default=True, help="Print a line every N steps.")
@click.pass_context
def run(ctx, batch_size, preset, n_layer, n_embd, n_head, seq_len, vocab_size, pad_vocab, no_tie_embeddings, run_dir,
        port, log_every, **settings):
    """Train a GPT across pipeline stage workers (launches them here; under torchrun, joins them)."""
    import statistics
    import warnings
    from pathlib import Path

    # TensorPipe reports each connection a stopping job closes; failures reach us as WorkerFailure.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from pipegpt.config import TrainConfig, microbatch_size_for, model_config

    if settings["schedule_file"] is not None:
        _from_schedule_file(ctx, settings)
    if batch_size is not None:
        settings["microbatch_size"] = microbatch_size_for(batch_size, settings["dp"], settings["microbatches"])
    if settings["tokenizer"] == "gpt2" and vocab_size is None:
        vocab_size = 50257
    model = model_config(preset, n_layer=n_layer, n_embd=n_embd, n_head=n_head, seq_len=seq_len,
                         vocab_size=vocab_size, tie_embeddings=False if no_tie_embeddings else None,
                         pad_vocab_to=64 if pad_vocab else None)
    cfg = TrainConfig.build(model, **settings)
    data = cfg.data.data
    if data is not None and not os.path.exists(data):
        raise ConfigError(f"--data {data}: no such file or directory (a directory from `pipegpt prepare`, nanoGPT "
                          f"or llm.c token files, or a flat uint16 file; leave it out for the built-in corpus)")
    warnings.filterwarnings("ignore", category=UserWarning)
    from pipegpt.comm.rpc import WorkerFailure
    from pipegpt.train.placement import resolve_device, under_torchrun
    from pipegpt.train.driver import Job, run_job
    from pipegpt.train.metrics import new_run_dir

    job = Job(cfg, port)  # refuses a bad configuration, schedule, checkpoint or port before any process starts
    out = Path(run_dir) if run_dir else _resumed_run_dir(cfg) or new_run_dir()
    out.mkdir(parents=True, exist_ok=True)
    p, steps = cfg.parallel, cfg.runtime.steps
    if not under_torchrun() or os.environ.get("RANK") == "0":
        click.echo(f"pipegpt: {model.n_layer}-layer GPT ({preset}), {cfg.world_size} workers on "
                   f"{resolve_device(cfg.runtime.device, cfg.world_size)}, schedule {p.schedule}, "
                   f"{p.microbatches} microbatches x {p.microbatch_size} sequences x {model.seq_len} tokens; "
                   f"run dir {out}")

    def on_step(m):
        if m.step == job.first_step and job.loaded:
            click.echo(f"started from {job.loaded[0]} at step {job.first_step} (loaded in {job.loaded[1]:.2f} s)")
        if m.step == 0 or (m.step + 1) % log_every == 0 or m.step + 1 == steps:
            click.echo(_progress_line(m, steps))
        if m.val_loss is not None:
            click.echo(f"step {m.step + 1}: val loss {m.val_loss:.4f}")
        if m.checkpoint_s is not None:
            click.echo(f"step {m.step + 1}: checkpoint saved in {m.checkpoint_s:.2f} s")

    try:
        history = run_job(job, out, on_step)
    except WorkerFailure as e:
        if e.report:  # the stall watchdog's table: where each rank was
            click.echo(e.report, err=True)
        _exit_now(f"Error: {e}; all workers stopped", 1)
    except KeyboardInterrupt:
        _exit_now("Interrupted: all workers stopped", 130)
    if not history:
        if history is not None:
            click.echo(f"nothing to do: the checkpoint was taken after step {job.first_step} of {steps}")
        return
    timed = [m.step_time_s for m in history[1:]] or [history[0].step_time_s]  # step 0 includes warm-up
    click.echo(f"done: loss {history[0].loss:.4f} -> {history[-1].loss:.4f} in {len(history)} steps; "
               f"median step {statistics.median(timed) * 1000:.1f} ms, "
               f"{statistics.median(m.tokens_per_s for m in history[1:] or history):,.0f} tok/s; "
               f"peak memory per rank {', '.join(f'{b / 2**20:.0f} MiB' for b in history[-1].peak_memory_per_rank)}")
    click.echo(f"metrics: {out / 'metrics.jsonl'}; last step's measured timeline: {out / 'trace.json'} (Perfetto)")
    if cfg.runtime.trace_steps != "last":
        click.echo(f"traces of steps {', '.join(map(str, cfg.runtime.traced_steps()))}: {out / 'traces'}/step-N.json "
                   f"(pipegpt simulate --trace {out} --trace-step N)")
    if cfg.runtime.profile and any((out / "profiles").glob("rank-*")):
        click.echo(f"profiles (py-spy): {out / 'profiles'}/rank-N.svg, rank-N.speedscope.json")


# --------------------------------------------------------------------------------------------------------------
# prepare: text files -> token shards (pipegpt.data.prepare needs numpy and a tokenizer, not torch)

@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="Directory for the shards and meta.json (created; must not hold prepared tokens already).")
@click.option("--tokenizer", type=click.Choice(["bytes", "gpt2"]), default="bytes", show_default=True,
              help="bytes (vocabulary 256, offline) or gpt2 (tiktoken BPE; documents start with token 50256).")
@click.option("--val-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.01, show_default=True,
              help="The tail of the input that becomes the val split (cut at a line start).")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=100_000_000, show_default=True,
              help="Tokens per shard file.")
def prepare(inputs, out, tokenizer, val_fraction, shard_tokens):
    """Tokenize text files into uint16 token shards (llm.c's format) with a train/val split.

    \b
    pipegpt prepare book.txt --out data/book                     # bytes tokenizer, 1% val
    pipegpt prepare docs/*.txt --out data/docs --tokenizer gpt2
    pipegpt run --data data/docs --tokenizer gpt2 ...
    """
    from pipegpt.data.prepare import check_prepare, input_bytes
    from pipegpt.data.prepare import prepare as run_prepare

    check_prepare(inputs, out, tokenizer, val_fraction, shard_tokens)  # refusals come before the progress bar
    with click.progressbar(length=input_bytes(inputs), label="tokenizing", file=sys.stderr) as bar:
        meta = run_prepare(inputs, out, tokenizer, val_fraction, shard_tokens, on_bytes=bar.update)
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    click.echo(f"wrote {train['tokens']:,} train tokens ({len(train['shards'])} shards) and {val['tokens']:,} val "
               f"tokens ({len(val['shards'])} shards) to {out}; tokenizer {meta['tokenizer']}, max token id "
               f"{meta['max_token_id']}")
    click.echo(f"train on it: pipegpt run --data {out} --tokenizer {meta['tokenizer']}")


# --------------------------------------------------------------------------------------------------------------
# convert: GPT-2 in Hugging Face layout <-> a pipegpt checkpoint; sample: text from a checkpoint (torch inside)

def _run_flags(model, tokenizer: str) -> str:
    """The `pipegpt run` model flags that build exactly this model (as --init-from requires)."""
    from pipegpt.config import MODEL_PRESETS

    preset = next((name for name, m in MODEL_PRESETS.items() if m == model), None)
    if preset is not None:
        flags = f"--model {preset}"
    else:
        flags = (f"--n-layer {model.n_layer} --n-embd {model.n_embd} --n-head {model.n_head} "
                 f"--seq-len {model.seq_len} --vocab-size {model.vocab_size}")
        flags += "" if model.tie_embeddings else " --no-tie-embeddings"
    return f"{flags} --tokenizer {tokenizer}"


@main.command()
@click.option("--from-hf", "from_hf", type=click.Path(), default=None,
              help="Import: a Hugging Face GPT-2 directory (config.json and model.safetensors or pytorch_model.bin).")
@click.option("--out", type=click.Path(), default=None, help="Import: the checkpoint directory to create.")
@click.option("--tokenizer", type=click.Choice(list(TOKENIZERS)), default=None,
              help="Import: the tokenizer the checkpoint remembers (default: gpt2).")
@click.option("--to-hf", "to_hf", type=click.Path(), default=None,
              help="Export: the directory for config.json and model.safetensors.")
@click.option("--checkpoint", "source", type=click.Path(), default=None,
              help="Export: a checkpoint, or a run directory (its latest checkpoint).")
def convert(from_hf, out, tokenizer, to_hf, source):
    """GPT-2 weights in Hugging Face layout into a pipegpt checkpoint, or back.

    \b
    pipegpt convert --from-hf gpt2/ --out ckpt/gpt2          # weights only, step 0
    pipegpt run --init-from ckpt/gpt2 --model gpt2 --tokenizer gpt2 ...
    pipegpt convert --to-hf exported/ --checkpoint runs/my-run  # GPT2LMHeadModel.from_pretrained("exported/")
    """
    if (from_hf is None) == (to_hf is None):
        raise click.UsageError("give --from-hf HF_DIR --out CHECKPOINT (import) or --to-hf HF_DIR "
                               "--checkpoint CHECKPOINT (export)")
    if from_hf is not None:
        if out is None or source is not None:
            raise click.UsageError("--from-hf HF_DIR needs --out CHECKPOINT (and no --checkpoint)")
        from pipegpt.tools.convert import import_hf

        tokenizer = tokenizer or "gpt2"
        path, model = import_hf(from_hf, out, tokenizer)
        click.echo(f"wrote {path}: {model.n_layer}-layer GPT-2, n_embd {model.n_embd}, {model.n_head} heads, "
                   f"vocabulary {model.vocab_size}, seq_len {model.seq_len}, "
                   f"{'tied' if model.tie_embeddings else 'untied'} embeddings; tokenizer {tokenizer}")
        click.echo(f"train from it: pipegpt run --init-from {path} {_run_flags(model, tokenizer)}")
        click.echo(f"sample from it: pipegpt sample {path} --prompt ...")
        return
    if source is None or out is not None or tokenizer is not None:
        raise click.UsageError("--to-hf HF_DIR needs --checkpoint CHECKPOINT (and no --out or --tokenizer)")
    from pipegpt.tools.convert import export_hf

    found, model = export_hf(source, to_hf)
    click.echo(f"wrote {to_hf}/config.json and model.safetensors from {found}: {model.n_layer}-layer GPT-2, "
               f"n_embd {model.n_embd}, vocabulary {model.vocab_size}")


@main.command()
@click.argument("path", type=click.Path())
@click.option("--prompt", default="\n", show_default="a newline", help="The text to continue.")
@click.option("--max-new-tokens", type=int, default=200, show_default=True, help="Tokens to generate.")
@click.option("--temperature", type=float, default=0.8, show_default=True,
              help="Softmax temperature; 0: always the most likely token (greedy).")
@click.option("--top-k", type=int, default=200, show_default=True, help="Draw only from the k most likely tokens.")
@click.option("--seed", type=int, default=1337, show_default=True, help="Seed of the draws.")
@click.option("--tokenizer", type=click.Choice(list(TOKENIZERS)), default=None,
              help="Override the tokenizer the checkpoint remembers.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CUDA when a GPU is visible.")
def sample(path, prompt, max_new_tokens, temperature, top_k, seed, tokenizer, device):
    """Generate text from a checkpoint (or a run directory's latest) in one process.

    \b
    pipegpt sample runs/my-run --prompt "def main(" --max-new-tokens 100
    pipegpt sample ckpt/gpt2 --prompt "Hello, I'm a language model," --temperature 0   # greedy
    """
    from pipegpt.tools.sample import check_settings
    from pipegpt.tools.sample import sample as run_sample

    check_settings(max_new_tokens, temperature, top_k)  # refused before the checkpoint is read
    result = run_sample(path, prompt, max_new_tokens, temperature, top_k, seed, tokenizer, device)
    click.echo(result.text)


@main.command()
@click.argument("path", type=click.Path())
@click.option("--file", "jsonl", required=True, type=click.Path(), metavar="FILE",
              help="HellaSwag jsonl (nanoGPT's hellaswag_val.jsonl): ctx, endings (4), label per line.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Score only the first N examples.")
@click.option("--tokenizer", type=click.Choice(list(TOKENIZERS)), default=None,
              help="Override the tokenizer the checkpoint remembers.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="auto: CUDA when a GPU is visible.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def hellaswag(path, jsonl, limit, tokenizer, device, as_json):
    """HellaSwag accuracy of a checkpoint (or a run directory's latest), nanoGPT's scoring.

    Each ending is scored by the cross-entropy of its tokens after ctx + " ": acc picks the ending with the
    smallest sum of losses, acc_norm the smallest mean loss per ending token (nanoGPT's number). A candidate
    longer than seq_len keeps its last seq_len tokens.

    \b
    pipegpt hellaswag ckpt/gpt2 --file hellaswag_val.jsonl --limit 1000 --json
    """
    from pipegpt.tools.hellaswag import evaluate

    result = evaluate(path, jsonl, limit, tokenizer, device)
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(f"hellaswag: {result.examples} examples, acc {result.acc:.4f}, acc_norm {result.acc_norm:.4f}")


# --------------------------------------------------------------------------------------------------------------
# plan: choose the layout before spending GPU time (pure Python: pipegpt.plan imports no torch)

@main.command()
@model_options
@click.option("--batch-size", type=int, default=None, help="Sequences per step, all replicas together.")
@click.option("--batch-tokens", type=int, default=None, help="Tokens per step (a multiple of seq_len).")
@click.option("--gpus", type=int, required=True, help="GPUs available (a plan may use fewer).")
@click.option("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's node, 8).")
@click.option("--device", default=None, metavar="PRESET",
              help="GPU preset: h100, h100-pcie, h200, a100-80gb, a100-40gb, l4, a10g, v100 (datasheet peak and "
                   "memory, links of the usual DGX/HGX node); the options below override it.")
@click.option("--gpu-memory", default=None, metavar="SIZE", help="Memory per GPU: 80GiB, 40GB, 81920MiB.")
@click.option("--gpu-tflops", type=float, default=None, help="Peak dense TFLOPS per GPU at --precision.")
@click.option("--intra-node-gbps", default=None, metavar="RATE",
              help="Bandwidth per GPU and direction inside a node: Gbit/s, or with a unit (450GB/s).")
@click.option("--inter-node-gbps", default=None, metavar="RATE",
              help="Bandwidth per GPU and direction between nodes: Gbit/s, or with a unit (50GB/s).")
@click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="What the plan runs with (pipegpt run --precision).")
@click.option("--efficiency", type=float, default=None,
              help="Achieved / peak matmul FLOP/s of the analytical model (default 0.5).")
@click.option("--layer-overhead-us", type=float, default=None,
              help="Least host time of one block's forward, microseconds (default 100; backward twice).")
@click.option("--calibrate", "calibrate_dir", type=click.Path(), default=None, metavar="RUN_DIR",
              help="Scale compute to a run's measured F/B/W (its trace.json) instead of --efficiency.")
@click.option("--schedule", "-s", "schedules", default="all", show_default=True,
              help="Schedules to consider: a comma list or 'all'.")
@click.option("--all-gpus", is_flag=True, help="Only layouts that use every GPU (dp x pp x tp = --gpus).")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Plans to print.")
@click.option("--explain", is_flag=True, help="Also say why the runners-up lost (and what does not fit).")
@click.option("--try", "try_top", type=click.IntRange(min=1), default=None, metavar="K",
              help="Run the top K plans here for --try-steps steps each (pipegpt run, device as --try-device) and "
                   "print measured step time beside predicted.")
@click.option("--try-steps", type=click.IntRange(min=2), default=5, show_default=True,
              help="Steps per tried plan; the first (warm-up) is left out of the median.")
@click.option("--try-device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan(preset, n_layer, n_embd, n_head, seq_len, vocab_size, pad_vocab, no_tie_embeddings, batch_size, batch_tokens,
         gpus, gpus_per_node, device, gpu_memory, gpu_tflops, intra_node_gbps, inter_node_gbps, precision, efficiency,
         layer_overhead_us, calibrate_dir, schedules, all_gpus, top, explain, try_top, try_steps, try_device, as_json):
    """Choose dp x pp x tp, schedule, microbatches and recomputation; predict step time and memory.

    Every candidate's step is simulated (pipegpt simulate's simulator) with per-stage costs from FLOPs at a
    device efficiency, collectives and messages from bytes and bandwidths (or costs calibrated from a run),
    and its memory is pipegpt.plan.memory's; the best plans come with the `pipegpt run` command that runs them.

    \b
    pipegpt plan --model gpt2 --gpus 8 --device h100 --batch-size 512
    pipegpt plan --n-layer 96 --n-embd 12288 --n-head 96 --seq-len 2048 --vocab-size 51200 \\
                 --gpus 1024 --device a100-80gb --batch-size 1536 --explain
    pipegpt plan --model tiny --gpus 2 --gpu-memory 8GiB --gpu-tflops 1 --intra-node-gbps 80 \\
                 --batch-size 16 --calibrate runs/<time>
    """
    from pipegpt.config import model_config
    from pipegpt.plan import search as plan_search
    from pipegpt.plan.cost import AnalyticalCosts, DEFAULT_EFFICIENCY, DEFAULT_LAYER_OVERHEAD_S, calibrate_costs
    from pipegpt.plan.devices import make_cluster

    model = model_config(preset, n_layer=n_layer, n_embd=n_embd, n_head=n_head, seq_len=seq_len, vocab_size=vocab_size,
                         tie_embeddings=False if no_tie_embeddings else None, pad_vocab_to=64 if pad_vocab else None)
    if (batch_size is None) == (batch_tokens is None):
        raise click.UsageError("give the global batch as --batch-size SEQUENCES or --batch-tokens TOKENS (one of them)")
    if batch_tokens is not None:
        if batch_tokens < 1 or batch_tokens % model.seq_len:
            lo = batch_tokens // model.seq_len * model.seq_len
            hi = lo + model.seq_len
            raise ConfigError(f"--batch-tokens {batch_tokens} is not a whole number of sequences of seq_len="
                              f"{model.seq_len}: use {lo or hi}" + (f" or {hi}" if lo else ""))
        batch_size = batch_tokens // model.seq_len
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1 sequence")
    cluster = make_cluster(gpus, gpus_per_node, device, gpu_memory, gpu_tflops, intra_node_gbps, inter_node_gbps,
                           precision)
    if calibrate_dir is not None:
        if efficiency is not None or layer_overhead_us is not None:
            raise click.UsageError("--calibrate takes the compute from the run: leave out --efficiency and "
                                   "--layer-overhead-us")
        costs = calibrate_costs(calibrate_dir, cluster)
    else:
        costs = AnalyticalCosts(cluster, DEFAULT_EFFICIENCY if efficiency is None else efficiency,
                                DEFAULT_LAYER_OVERHEAD_S if layer_overhead_us is None else layer_overhead_us * 1e-6)
    names = tuple(_split_names(schedules))
    request = plan_search.Request(model, batch_size, cluster, costs, top=top, explain=explain, schedules=names,
                                  exact_gpus=all_gpus)
    result = plan_search.search(request)
    if not result.best:
        raise ConfigError(plan_search.no_fit_message(result))
    if as_json and not try_top:
        click.echo(json.dumps(plan_search.as_json(result)))
    elif not try_top:
        click.echo(plan_search.format_text(result))
    else:
        _try_plans(result.best[:try_top], precision, try_steps, try_device, as_json,
                   lambda: plan_search.as_json(result))


def _try_plans(best, precision: str, steps: int, device: str, as_json: bool, plans_json) -> None:
    """Run each plan for a few steps, as `pipegpt run` (its exact command), and set measured beside predicted:
    the check AMP-style planners make before anyone trusts a prediction."""
    import statistics
    import subprocess
    import tempfile
    from pathlib import Path

    from pipegpt.schedule.render import text_table

    exe = Path(sys.executable).with_name("pipegpt")
    rows, tried = [["#", "plan", "predicted", "measured", "measured/predicted"]], []
    for k, r in enumerate(best, start=1):
        args = r.layout.run_args(r.model, precision)
        with tempfile.TemporaryDirectory() as run_dir:
            proc = subprocess.run([str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else
                                   ["-m", "pipegpt"]), "run", *args, "--steps", str(steps), "--lr-schedule",
                                   "constant", "--device", device, "--run-dir", run_dir, "--log-every", "1000000"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
                raise ConfigError(f"plan #{k} failed when tried: {last}")
            times = [json.loads(line)["step_time_s"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        measured = statistics.median(times[1:])
        tried.append({"plan": k, "command": "pipegpt run " + " ".join(args), "predicted_step_s": r.step_time,
                      "measured_step_s": measured, "measured_over_predicted": measured / r.step_time})
        layout = r.layout
        rows.append([str(k), f"dp{layout.dp} pp{layout.pp} tp{layout.tp} {layout.schedule} "
                     f"m{layout.microbatches}x{layout.microbatch_size} rc={layout.recompute}",
                     f"{r.step_time * 1e3:.1f} ms", f"{measured * 1e3:.1f} ms", f"{measured / r.step_time:.2f}"])
    if as_json:
        click.echo(json.dumps({**plans_json(), "tried": tried}))
        return
    click.echo(f"tried the top {len(tried)} plans here, {steps} steps each (median after the first):")
    click.echo(text_table(rows, right={2, 3, 4}, rule=True))

if __name__ == "__main__":
    main()
