"""`pipegpt run`'s work: start the job, say where it runs, a progress line every few steps, and a summary.

Torch and everything that needs it are imported inside launch(), so the command line loads them only
when it runs a job. Text goes out through `echo(text, err=False)` (the command passes click.echo).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

from pipegpt.config import TrainConfig, under_torchrun
from pipegpt import run_files
from pipegpt.engine.placement import resolve_device
from pipegpt.observe.progress import Clock, crowding, progress_line, summary_lines, unused_vocabulary
from pipegpt.train.restart import drop_snapshots, exit_now, restart, restart_state
from pipegpt.state.owner import release
from pipegpt.train.run_dir import abandon_later, check_run_dir, move_aside, own_run_dir, resumed_run_dir


def launch(cfg: TrainConfig, preset: str, run_dir: str | None, port: int | None, log_every: int,
           echo: Callable, overwrite: bool = False, continuing: bool = False) -> None:
    """Run the job here (or join it, under torchrun); a worker failure stops every worker and exits 1, or, with
    --max-restarts, starts the run again from its latest checkpoint. continuing: the run directory holds an
    earlier attempt of this run with no checkpoint (--resume auto, a restart): this attempt goes on there."""
    import warnings

    # TensorPipe reports each connection a stopping job closes; failures reach us as WorkerFailure.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=UserWarning)
    from pipegpt.train.driver import Job, resumed_step

    driver = not under_torchrun() or os.environ.get("RANK") == "0"  # the one process that writes the run directory
    out = Path(run_dir) if run_dir else resumed_run_dir(cfg)
    if driver and out is not None and out.is_dir():
        own_run_dir(out)  # first: a live run's directory is refused naming its pid, even with nothing to do
    try:
        job = Job(cfg, port)  # refuses a bad configuration, schedule, checkpoint or port before any process starts
        if not under_torchrun() and resumed_step(cfg) < cfg.runtime.steps:
            from pipegpt.comm.preload import PRELOADED, start_early

            # the workers' torch import, once, while the driver takes its run directory (not before a refusal: it
            # would compete with the refusing check for the cores)
            start_early(PRELOADED + ("pipegpt.train.worker",))
        restarts, job.failed_at, job.steps_lost = restart_state(out)
        continuing = continuing or restarts > 0
        steps = cfg.runtime.steps
        done = resumed_step(cfg)
        if done >= steps:
            if driver:
                echo(f"nothing to do: the checkpoint was taken after step {done} of {steps}; nothing written "
                     f"(give --steps above {done} to train on)")
            return
        if driver:  # the one process that writes the run directory, from its lock on
            try:
                out = _own(cfg, out, overwrite, continuing, done, echo)
            except OSError as e:  # a full disk, before any worker started
                exit_now(echo, f"Error: {run_files.failure_line(e)}", 1)
        try:
            _run(job, preset, out, driver, restarts, log_every, echo, done)
        except OSError as e:  # a run file not written (a full disk): the job was killed on the way out
            drop_snapshots(cfg, out if driver else None)
            exit_now(echo, f"Error: {run_files.failure_line(e)}; all workers stopped", 1)
    finally:
        if driver and out is not None:
            release(out)  # the run is over: a process that goes on (a test) no longer holds the directory


def _own(cfg: TrainConfig, out: Path | None, overwrite: bool, continuing: bool, done: int, echo: Callable) -> Path:
    """The driver takes the run directory (a new runs/<time> for None): its lock, the checks, then what earlier
    runs left there; still before any process starts. Returns the directory."""
    from pipegpt.observe.metrics import new_run_dir

    try:
        if out is not None and out.is_dir():
            own_run_dir(out)  # before the checks: a live run's directory is refused naming its pid
        check_run_dir(out, cfg, overwrite, continuing)
        out = new_run_dir() if out is None else out
        out.mkdir(parents=True, exist_ok=True)
        own_run_dir(out, warn=lambda line: echo(line, err=True))
        _take_over(out, overwrite, done, echo)
    except BaseException:
        if out is not None:
            release(out)
        raise
    return out


def _run(job, preset: str, out: Path, driver: bool, restarts: int, log_every: int, echo: Callable,
         done: int) -> None:
    """Start the job, print as it goes, and the summary; on a failure, a restart or one line and exit 1."""
    from pipegpt.comm.rpc import WorkerFailure
    from pipegpt.train.driver import NonFiniteError, learning_rate_jump, run_job

    cfg = job.cfg
    model, p, steps = cfg.model, cfg.parallel, cfg.runtime.steps
    device = resolve_device(cfg.runtime.device, cfg.world_size)
    if driver:
        echo(f"pipegpt: {model.n_layer}-layer {model.architecture.family} ({preset}), {cfg.world_size} "
             f"worker{'s' * (cfg.world_size > 1)} on "
             f"{device}, schedule {p.schedule}, "
             f"{p.microbatches} microbatches x {p.microbatch_size} sequences x {model.seq_len} tokens; "
             f"run dir {out}")
        jump = learning_rate_jump(cfg)
        if jump:
            echo(jump)
        for warning in (crowding(cfg, device), unused_vocabulary(cfg)):
            if warning:
                echo(warning, err=True)

    clock = Clock(done, steps)  # from where this attempt starts (job.first_step is known only once it started)

    def on_step(m):
        clock.tick(m.step - 1)
        if m.step == job.first_step + 1 and job.loaded:
            echo(f"started from {job.loaded[0]} (after step {job.first_step}; loaded in {job.loaded[1]:.2f} s)")
        if m.recovery_s is not None:
            lost = f"; {m.steps_lost} completed step{'s' if m.steps_lost != 1 else ''} done again" \
                if m.steps_lost is not None else ""
            echo(f"pipegpt: recovered: step {m.step} done {m.recovery_s:.1f} s after the failure{lost}")
        if m.step == 1 or m.step % log_every == 0 or m.step == steps:
            echo(progress_line(m, steps, clock.elapsed(), clock.eta()))
        if m.val_loss is not None:
            echo(f"step {m.step}: val loss {m.val_loss:.4f}")
        if m.checkpoint_s is not None:
            echo(f"step {m.step}: checkpoint saved in {m.checkpoint_s:.2f} s")

    mine = out if driver else None  # the snapshots to drop: the driver's
    if driver:  # a scheduler's SIGTERM ends the job as Ctrl-C does: every worker stopped, one line
        signal.signal(signal.SIGTERM, _terminated)
    try:
        history = run_job(job, out, on_step)
    except WorkerFailure as e:
        if e.report:  # the stall watchdog's table: where each rank was
            echo(e.report, err=True)
        if driver and restarts < cfg.checkpoint.max_restarts:
            restart(echo, e, job, out, restarts + 1)
        drop_snapshots(cfg, mine)
        exit_now(echo, f"Error: {e}; all workers stopped" + (
            f" (after {restarts} restart{'s' if restarts > 1 else ''}, --max-restarts {cfg.checkpoint.max_restarts})"
            if restarts else ""), 1)
    except NonFiniteError as e:  # the job was closed cleanly; nothing was applied or saved from that state
        drop_snapshots(cfg, mine)
        exit_now(echo, f"Error: {e}", 1)
    except KeyboardInterrupt:
        drop_snapshots(cfg, mine)
        exit_now(echo, "Interrupted: all workers stopped", 130)
    except Terminated:
        drop_snapshots(cfg, mine)
        exit_now(echo, "Terminated (SIGTERM): all workers stopped", 143)
    drop_snapshots(cfg, mine)
    if not history:
        if history is not None:
            echo(f"nothing to do: the checkpoint was taken after step {job.first_step} of {steps}")
        return
    for line in summary_lines(history, cfg, out):
        echo(line)


def _take_over(out: Path, overwrite: bool, done: int, echo: Callable) -> None:
    """The driver, holding the run directory: what earlier runs left there is settled before anything is
    written: --overwrite moves the earlier run aside; snapshots whose driver is gone leave the memory; saves
    cut short leave the disk; checkpoints later than where this run goes on move off its line."""
    from pipegpt.state import checkpoint, snapshot

    if overwrite and run_files.holds_run(out):
        echo(f"pipegpt: moved the earlier run in {out} to {move_aside(out)}")
    snapshot.sweep()
    checkpoint.remove_unfinished(out / run_files.CHECKPOINTS)
    moved = abandon_later(out, done)
    if moved:
        names, dest = moved
        echo(f"pipegpt: the run goes on after step {done}, before its latest checkpoint: moved the later ones "
             f"({', '.join(names)}) to {dest}; their metrics rows are marked abandoned")


class Terminated(BaseException):
    """SIGTERM reached the driver (a BaseException, as KeyboardInterrupt: no `except Exception` swallows it)."""


def _terminated(signum, frame):
    raise Terminated()
