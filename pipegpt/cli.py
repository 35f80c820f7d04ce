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

from pipegpt import command_options
from pipegpt.config import ConfigError
from pipegpt.options import SectionedCommand, config_options, dry_run_option
from pipegpt.schedule.actions import ScheduleError
from pipegpt.state.checkpoint import CheckpointError

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
# simulate: the pure-Python schedule package only (pipegpt.observe.simulate_report does the work)

@main.command()
@command_options.simulate_options
def simulate(**options):
    """Simulate pipeline schedules: ASCII chart, bubble %, makespan, peak live activations.

    \b
    pipegpt simulate --schedule 1f1b --stages 4 --microbatches 16
    pipegpt simulate --schedule all -p 4 -m 16 --costs F=1,B=2,W=1,comm=0.1
    pipegpt simulate --schedule-file my_plan.txt --out plan.html
    pipegpt simulate --trace runs/20250101-120000 --out measured_vs_predicted.html
    pipegpt simulate -p 4 -m 16 --layer-costs embed=0.1,block=1,head=4 --layers 8 --balance cost
    pipegpt simulate --schedule auto -p 4 -m 16 --costs F=1,B=2,W=1,comm=0.2 --max-live 4
    pipegpt simulate --forward-only -p 4 -m 8                  # evaluation's plan
    pipegpt simulate --decode-steps 16 -p 4 -m 4 --costs F=1,comm=0.1   # generation: 4 prompt groups
    pipegpt simulate --schedule zb-h1 -p 4 -m 8 --p2p-matching order
    """
    # The planner reads --layer-costs; pipegpt.schedule sits below it, so the reader is handed in.
    from pipegpt.costs.balance import parse_layer_costs
    from pipegpt.observe.simulate_report import SimulateOptions, simulate_command

    out = options["out"]
    if out is not None and os.path.splitext(out)[1].lower() not in (".svg", ".html", ".htm", ".json"):
        raise click.BadParameter(f"{out!r} must end in .svg, .html or .json", param_hint="--out")
    simulate_command(SimulateOptions(**options), click.echo, parse_layer_costs)


# --------------------------------------------------------------------------------------------------------------
# plot: runs' metrics.jsonl as one SVG (pipegpt.observe.plot: no torch)

@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(), metavar="RUN_DIR...")
@click.option("--out", "-o", type=click.Path(dir_okay=False), default=None,
              help="The SVG to write (default: plot.svg in the run directory; with several runs, ./plot.svg).")
@click.option("--title", default=None, help="The picture's title (default: the run's name, or 'N runs').")
def plot(run_dirs, out, title):
    """Loss, val loss, learning rate and tokens/s against the step, as SVG; several runs overlay, a color each.

    \b
    pipegpt plot runs/20250101-120000                       # writes runs/20250101-120000/plot.svg
    pipegpt plot runs/a runs/b --out a_vs_b.svg
    """
    from pipegpt.observe.plot import PlotError, plot_command

    try:
        click.echo(f"wrote {plot_command(run_dirs, out, title)}")
    except PlotError as e:  # a ValueError, not one of USER_ERRORS: made one `Error:` line here
        raise click.ClickException(str(e)) from None


# --------------------------------------------------------------------------------------------------------------
# run: torch and everything that needs it are imported inside the command, so `simulate` starts without them.

@main.command(cls=SectionedCommand)
@config_options
@click.option("--batch-size", type=int, default=None,
              help="Sequences per step in all (sets the microbatch size: batch / (dp x microbatches)).")
@command_options.model_options
@click.option("--run-dir", type=click.Path(), default=None,
              help="The run's directory: metrics.jsonl, checkpoints, traces (default: runs/<time>; with --resume, "
                   "the checkpoint's run). One run per directory: continue one with --resume.")
@click.option("--overwrite", is_flag=True,
              help="Start afresh in a --run-dir that holds a run: its content is moved into <run-dir>/previous-<time>/.")
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Port for the workers' process group (default: a free one).")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Settings from a TOML or JSON file (a run's config.json works; keys: sections or option names); "
                   "options given here override it. Not with --resume.")
@click.option("--log-every", type=click.IntRange(min=1), default=10, show_default=True,
              help="Print a line every N steps.")
@click.option("--layout", type=click.Choice(["given", "auto"]), default="given", show_default=True,
              help="auto: the planner chooses stages, dp, tp, schedule, microbatches and recomputation for the ranks "
                   "this run has (torchrun's world size, the GPUs here, or a rank per core), keeping the global "
                   "batch; with --resume auto under torchrun --nnodes MIN:MAX, an elastic job.")
@dry_run_option
@click.pass_context
def run(ctx, batch_size, run_dir, overwrite, port, log_every, config_file, layout, dry_run, **options):
    """Train a GPT across pipeline stage workers (launches them here; under torchrun, joins them).

    --resume takes every setting from the checkpoint's run except those given here (each change is printed).
    """
    from pipegpt.arch import ARCHITECTURES
    from pipegpt.config import MODEL_PRESETS
    from pipegpt.options import given, resume_auto, train_config
    from pipegpt.train.dry_run import dry_run as dry_run_job
    from pipegpt.train.launch import launch

    if dry_run is not None and layout == "auto":
        raise click.UsageError("--dry-run checks the layout given; `pipegpt plan --gpus N --device D` chooses one")
    continuing = False
    if options["resume"] == "auto":
        options["resume"], continuing = resume_auto(run_dir)
    cfg = train_config(ctx, batch_size, options, say=click.echo, config_file=config_file, layout=layout)
    preset = options["preset"]
    if options["arch"] in ARCHITECTURES and not given(ctx, "preset"):  # --arch alone: that architecture's own preset
        preset = ARCHITECTURES[options["arch"]].default_preset
    started = cfg.checkpoint.resume or cfg.checkpoint.init_from
    if started is not None and not given(ctx, "preset"):  # the model is the checkpoint's
        preset = next((name for name, m in MODEL_PRESETS.items() if m == cfg.model),
                      "resumed" if cfg.checkpoint.resume is not None else "from checkpoint")
    if dry_run is not None:  # checked and predicted on the devices named; nothing starts
        return dry_run_job(cfg, dry_run, preset, click.echo)
    launch(cfg, preset, run_dir, port, log_every, click.echo, overwrite=overwrite, continuing=continuing)


# --------------------------------------------------------------------------------------------------------------
# prepare: text files -> token shards (pipegpt.data.prepare needs numpy and a tokenizer, not torch)

@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@command_options.prepare_options
def prepare(inputs, out, tokenizer, val_fraction, shard_tokens):
    """Tokenize text files into uint16 token shards (llm.c's format) with a train/val split.

    \b
    pipegpt prepare book.txt --out data/book                     # bytes tokenizer, 1% val
    pipegpt prepare docs/*.txt --out data/docs --tokenizer gpt2
    pipegpt prepare docs/*.txt --out data/llama --tokenizer path/to/tokenizer.json   # a Hugging Face tokenizer
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

@main.command()
@command_options.convert_options
def convert(from_hf, out, tokenizer, to_hf, source):
    """GPT-2 or Llama/Mistral/Qwen2 weights in Hugging Face layout into a pipegpt checkpoint, or back.

    \b
    pipegpt convert --from-hf gpt2/ --out ckpt/gpt2          # weights only, step 0
    pipegpt run --init-from ckpt/gpt2 --model gpt2 --tokenizer gpt2 ...
    pipegpt convert --to-hf exported/ --checkpoint runs/my-run  # GPT2LMHeadModel.from_pretrained("exported/")
    """
    from pipegpt.tools.convert import convert_command

    for line in convert_command(from_hf, out, tokenizer, to_hf, source, command_options.model_flags):
        click.echo(line)


def layout_options(command):
    """--stages, --tp, --dp, --ep and --timeout of the commands that can run on workers (sample, hellaswag)."""
    for option in reversed([
        click.option("--stages", "-p", type=click.IntRange(min=1), default=None,
                     help="Run on workers: pipeline stages (one worker each), the model cut into them. Without "
                          "--stages, --tp or --dp the whole model runs in this process."),
        click.option("--tp", type=click.IntRange(min=1), default=None, help="Run on workers: tensor-parallel ranks "
                                                                             "per stage."),
        click.option("--dp", type=click.IntRange(min=1), default=None, help="Run on workers: replicas, each taking "
                                                                             "its share of the prompts or examples."),
        click.option("--ep", type=click.IntRange(min=1), default=None,
                     help="Run on workers: a mixture of experts' experts spread over this many of the --dp replicas "
                          "(as pipegpt run --ep)."),
        click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=60.0,
                     show_default=True, help="On workers: seconds any wait may take before the job is brought down."),
    ]):
        command = option(command)
    return command


def _layout(stages, tp, dp, ep=None):
    """The workers' layout the options ask for, or None (one process)."""
    from pipegpt.infer.job import Layout

    if stages is None and tp is None and dp is None and ep is None:
        return None
    return Layout(stages or 1, tp or 1, dp or 1, ep or 1)


def _on_workers(work):
    """work() whose worker failure is one `Error:` line and exit status 1, as `pipegpt run`'s."""
    from pipegpt.comm.rpc import WorkerFailure

    try:
        return work()
    except WorkerFailure as e:
        if e.report:
            click.echo(e.report, err=True)
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)


@main.command()
@click.argument("path", type=click.Path())
@layout_options
@command_options.sample_options
def sample(path, prompt, prompts_file, batch, max_new_tokens, temperature, top_k, seed, tokenizer, device, stages,
           tp, dp, ep, timeout_s, as_json):
    """Generate text from a checkpoint (or a run directory's latest), in one process or on workers.

    With --stages/--tp/--dp the model is cut over workers in that layout, each stage keeping the KV caches of its
    blocks; the prompts flow through the stages in groups, so every stage works while the others decode. Prompt i
    draws from a generator seeded with --seed + i: the same tokens in any batch and any layout.

    \b
    pipegpt sample runs/my-run --prompt "def main(" --max-new-tokens 100
    pipegpt sample ckpt/gpt2 --prompt "Hello, I'm a language model," --temperature 0   # greedy
    pipegpt sample runs/my-run --prompts-file prompts.txt --stages 4 --tp 2 --max-new-tokens 64
    """
    from pipegpt.infer.sampling import SamplingSettings
    from pipegpt.tools.sample import check_settings, read_prompts, sample_many
    from pipegpt.tools.sample import sample as run_sample

    check_settings(max_new_tokens, temperature, top_k)  # refused before the checkpoint is read
    if prompts_file is not None and prompt:
        raise click.UsageError("give --prompt or --prompts-file, not both")
    prompts = read_prompts(prompts_file) if prompts_file is not None else list(prompt) or ["\n"]
    layout = _layout(stages, tp, dp, ep)
    if layout is None and len(prompts) == 1 and not as_json:  # one prompt in one process: nanoGPT's loop
        click.echo(run_sample(path, prompts[0], max_new_tokens, temperature, top_k, seed, tokenizer, device).text)
        return
    settings = SamplingSettings(max_new_tokens, temperature, top_k, seed)
    result = _on_workers(lambda: sample_many(path, prompts, settings, tokenizer, device, batch, layout, timeout_s))
    for k, s in enumerate(result.samples):
        if as_json:
            click.echo(json.dumps({"prompt": prompts[k], "text": s.text, "new_tokens": s.new_tokens}))
        else:
            click.echo(s.text if k == 0 else "---------------\n" + s.text)
    click.echo(f"pipegpt: {len(prompts)} prompt{'s' * (len(prompts) > 1)} x {max_new_tokens} new tokens in "
               f"{result.seconds:.2f} s, {result.tokens_per_s:.1f} tokens/s ({result.where})", err=True)


@main.command()
@click.argument("path", type=click.Path())
@layout_options
@command_options.hellaswag_options
def hellaswag(path, jsonl, limit, tokenizer, device, stages, tp, dp, ep, timeout_s, as_json):
    """HellaSwag accuracy of a checkpoint (or a run directory's latest), nanoGPT's scoring, in one process or on
    workers (--stages/--tp/--dp: each holds a slice of the model, the examples flow through the stages).

    Each ending is scored by the cross-entropy of its tokens after ctx + " ": acc picks the ending with the
    smallest sum of losses, acc_norm the smallest mean loss per ending token (nanoGPT's number). A candidate
    longer than seq_len keeps its last seq_len tokens.

    \b
    pipegpt hellaswag ckpt/gpt2 --file hellaswag_val.jsonl --limit 1000 --json
    pipegpt hellaswag runs/my-run --file hellaswag_val.jsonl --stages 4 --tp 2
    """
    from pipegpt.tools.hellaswag import evaluate

    layout = _layout(stages, tp, dp, ep)
    result = _on_workers(lambda: evaluate(path, jsonl, limit, tokenizer, device, layout, timeout_s))
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(f"hellaswag: {result.examples} examples, acc {result.acc:.4f}, acc_norm {result.acc_norm:.4f}")


# --------------------------------------------------------------------------------------------------------------
# plan: choose the layout before spending GPU time (pure Python: pipegpt.planner imports no torch)

@main.command()
@command_options.model_options
@command_options.plan_options
def plan(**options):
    """Choose dp x pp x cp x tp, schedule, microbatches, recomputation and ZeRO 0-3; predict step time and memory.

    Every candidate's step is simulated (pipegpt simulate's simulator) with per-stage costs from FLOPs at a
    device efficiency, collectives and messages from bytes and bandwidths (or costs calibrated from a run),
    and its memory is pipegpt.costs.memory's; the best plans come with the `pipegpt run` command that runs them.

    \b
    pipegpt plan --model gpt2 --gpus 8 --device h100 --batch-size 512
    pipegpt plan --n-layer 96 --n-embd 12288 --n-head 96 --seq-len 2048 --vocab-size 51200 \\
                 --gpus 1024 --device a100-80gb --batch-size 1536 --explain
    pipegpt plan --model tiny --gpus 2 --gpu-memory 8GiB --gpu-tflops 1 --intra-node-gbps 80 \\
                 --batch-size 16 --calibrate runs/<time>
    """
    from pipegpt.planner.command import PlanOptions, plan_command

    model = command_options.model_from_options(options)
    plan_settings = {k: v for k, v in options.items() if k not in command_options.MODEL_OPTIONS}
    click.echo(plan_command(model, PlanOptions(**plan_settings)))


if __name__ == "__main__":
    main()
