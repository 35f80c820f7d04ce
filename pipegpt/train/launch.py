"""`pipegpt run`'s work: start the job, say where it runs, a progress line every few steps, and a summary.

Torch and everything that needs it are imported inside launch(), so the command line loads them only
when it runs a job. Text goes out through `echo(text, err=False)` (the command passes click.echo).
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Callable

from pipegpt.config import TrainConfig, under_torchrun
from pipegpt.train.placement import resolve_device


def launch(cfg: TrainConfig, preset: str, run_dir: str | None, port: int | None, log_every: int,
           echo: Callable) -> None:
    """Run the job here (or join it, under torchrun); a worker failure stops every worker and exits 1."""
    import warnings

    # TensorPipe reports each connection a stopping job closes; failures reach us as WorkerFailure.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=UserWarning)
    from pipegpt.comm.rpc import WorkerFailure
    from pipegpt.train.driver import Job, run_job
    from pipegpt.train.metrics import new_run_dir

    job = Job(cfg, port)  # refuses a bad configuration, schedule, checkpoint or port before any process starts
    out = Path(run_dir) if run_dir else _resumed_run_dir(cfg) or new_run_dir()
    out.mkdir(parents=True, exist_ok=True)
    model, p, steps = cfg.model, cfg.parallel, cfg.runtime.steps
    if not under_torchrun() or os.environ.get("RANK") == "0":
        echo(f"pipegpt: {model.n_layer}-layer GPT ({preset}), {cfg.world_size} workers on "
             f"{resolve_device(cfg.runtime.device, cfg.world_size)}, schedule {p.schedule}, "
             f"{p.microbatches} microbatches x {p.microbatch_size} sequences x {model.seq_len} tokens; "
             f"run dir {out}")

    def on_step(m):
        if m.step == job.first_step and job.loaded:
            echo(f"started from {job.loaded[0]} at step {job.first_step} (loaded in {job.loaded[1]:.2f} s)")
        if m.step == 0 or (m.step + 1) % log_every == 0 or m.step + 1 == steps:
            echo(progress_line(m, steps))
        if m.val_loss is not None:
            echo(f"step {m.step + 1}: val loss {m.val_loss:.4f}")
        if m.checkpoint_s is not None:
            echo(f"step {m.step + 1}: checkpoint saved in {m.checkpoint_s:.2f} s")

    try:
        history = run_job(job, out, on_step)
    except WorkerFailure as e:
        if e.report:  # the stall watchdog's table: where each rank was
            echo(e.report, err=True)
        _exit_now(echo, f"Error: {e}; all workers stopped", 1)
    except KeyboardInterrupt:
        _exit_now(echo, "Interrupted: all workers stopped", 130)
    if not history:
        if history is not None:
            echo(f"nothing to do: the checkpoint was taken after step {job.first_step} of {steps}")
        return
    for line in summary_lines(history, cfg, out):
        echo(line)


def _resumed_run_dir(cfg: TrainConfig) -> Path | None:
    """A resumed run goes on in the run directory its checkpoint is in (RUN/checkpoints/step-N)."""
    from pipegpt.train.checkpoint import resolve

    if cfg.checkpoint.resume is None:
        return None
    found = resolve(cfg.checkpoint.resume)
    return found.parent.parent if found.parent.name == "checkpoints" else None


def _exit_now(echo: Callable, message: str, code: int):
    """Exit without interpreter teardown: with workers killed mid-call, the RPC agent's
    destructor can abort the process, turning a clean error into a crash."""
    echo(message, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def progress_line(m, steps: int) -> str:
    done = (m.step + 1) * 20 // steps
    return (f"step {m.step + 1:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (20 - done)}] loss {m.loss:.4f}  "
            f"{m.step_time_s * 1000:7.1f} ms  {m.tokens_per_s:9,.0f} tok/s")


def summary_lines(history: list, cfg: TrainConfig, out: Path) -> list[str]:
    """The loss, speed and memory of a finished run, and where its metrics, traces and profiles are."""
    timed = [m.step_time_s for m in history[1:]] or [history[0].step_time_s]  # step 0 includes warm-up
    lines = [f"done: loss {history[0].loss:.4f} -> {history[-1].loss:.4f} in {len(history)} steps; "
             f"median step {statistics.median(timed) * 1000:.1f} ms, "
             f"{statistics.median(m.tokens_per_s for m in history[1:] or history):,.0f} tok/s; "
             f"peak memory per rank {', '.join(f'{b / 2**20:.0f} MiB' for b in history[-1].peak_memory_per_rank)}",
             f"metrics: {out / 'metrics.jsonl'}; last step's measured timeline: {out / 'trace.json'} (Perfetto)"]
    if cfg.runtime.trace_steps != "last":
        lines.append(f"traces of steps {', '.join(map(str, cfg.runtime.traced_steps()))}: {out / 'traces'}/step-N.json "
                     f"(pipegpt simulate --trace {out} --trace-step N)")
    if cfg.runtime.profile and any((out / "profiles").glob("rank-*")):
        lines.append(f"profiles (py-spy): {out / 'profiles'}/rank-N.svg, rank-N.speedscope.json")
    return lines
