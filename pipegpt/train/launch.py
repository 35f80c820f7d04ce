"""`pipegpt run`'s work: start the job, say where it runs, a progress line every few steps, and a summary.

Torch and everything that needs it are imported inside launch(), so the command line loads them only
when it runs a job. Text goes out through `echo(text, err=False)` (the command passes click.echo).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from pipegpt.config import TrainConfig, option_flags, under_torchrun
from pipegpt.dims import LAYOUT_FIELDS
from pipegpt.train.placement import resolve_device


RESTART_ENV = "PIPEGPT_RESTART"  # "K FAILED_AT LOST": restart K of the run, after a failure at that time that
#                                   lost LOST completed steps (done again from the checkpoint resumed)


def launch(cfg: TrainConfig, preset: str, run_dir: str | None, port: int | None, log_every: int,
           echo: Callable, overwrite: bool = False, continuing: bool = False) -> None:
    """Run the job here (or join it, under torchrun); a worker failure stops every worker and exits 1, or, with
    --max-restarts, starts the run again from its latest checkpoint. continuing: the run directory holds an
    earlier attempt of this run with no checkpoint (--resume auto, a restart): this attempt goes on there."""
    import warnings

    # TensorPipe reports each connection a stopping job closes; failures reach us as WorkerFailure.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=UserWarning)
    from pipegpt.comm.rpc import WorkerFailure
    from pipegpt.train.driver import Job, NonFiniteError, resumed_step, run_job
    from pipegpt.train.metrics import new_run_dir

    driver = not under_torchrun() or os.environ.get("RANK") == "0"  # the one process that writes the run directory
    out = Path(run_dir) if run_dir else _resumed_run_dir(cfg)
    job = Job(cfg, port)  # refuses a bad configuration, schedule, checkpoint or port before any process starts
    restarts, job.failed_at, job.steps_lost = restart_state()
    continuing = continuing or restarts > 0
    model, p, steps = cfg.model, cfg.parallel, cfg.runtime.steps
    done = resumed_step(cfg)
    if done >= steps:
        if driver:
            echo(f"nothing to do: the checkpoint was taken after step {done} of {steps}; nothing written "
                 f"(give --steps above {done} to train on)")
        return
    if driver:
        check_run_dir(out, cfg, overwrite, continuing)  # still before any process starts, and before anything is written
    if driver and overwrite and out is not None and holds_run(out):
        echo(f"pipegpt: moved the earlier run in {out} to {move_aside(out)}")
    if out is None:
        out = new_run_dir()
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.runtime.device, cfg.world_size)
    if driver:
        echo(f"pipegpt: {model.n_layer}-layer {'Llama' if model.is_llama else 'GPT'} ({preset}), {cfg.world_size} workers on "
             f"{device}, schedule {p.schedule}, "
             f"{p.microbatches} microbatches x {p.microbatch_size} sequences x {model.seq_len} tokens; "
             f"run dir {out}")
        crowded = crowding(cfg, device)
        if crowded:
            echo(crowded, err=True)

    clock = Clock(job.first_step, steps)

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

    try:
        history = run_job(job, out, on_step)
    except WorkerFailure as e:
        if e.report:  # the stall watchdog's table: where each rank was
            echo(e.report, err=True)
        if driver and restarts < cfg.checkpoint.max_restarts:
            restart(echo, e, job, out, restarts + 1)
        _drop_snapshots(cfg, out)
        _exit_now(echo, f"Error: {e}; all workers stopped" + (
            f" (after {restarts} restart{'s' if restarts > 1 else ''}, --max-restarts {cfg.checkpoint.max_restarts})"
            if restarts else ""), 1)
    except NonFiniteError as e:  # the job was closed cleanly; nothing was applied or saved from that state
        _drop_snapshots(cfg, out)
        _exit_now(echo, f"Error: {e}", 1)
    except KeyboardInterrupt:
        _drop_snapshots(cfg, out)
        _exit_now(echo, "Interrupted: all workers stopped", 130)
    _drop_snapshots(cfg, out)
    if not history:
        if history is not None:
            echo(f"nothing to do: the checkpoint was taken after step {job.first_step} of {steps}")
        return
    for line in summary_lines(history, cfg, out):
        echo(line)


# --------------------------------------------------------------------------------------------------------------
# Restarts (--max-restarts): the driver starts itself again, a fresh process, resuming the run's latest checkpoint

def restart_state(env=os.environ) -> tuple[int, float | None, int | None]:
    """(restarts so far, when the failure this attempt restarts after happened, the completed steps it lost),
    from RESTART_ENV."""
    value = env.get(RESTART_ENV)
    if not value:
        return 0, None, None
    count, failed_at, *lost = value.split()
    return int(count), float(failed_at), int(lost[0]) if lost else None


def restart(echo: Callable, failure, job, run_dir: Path, count: int) -> None:
    """Say which rank failed, why, at which step and where the run goes on from; then replace this process with
    `pipegpt run` again, resuming the run's latest checkpoint (or starting it again, without one). The workers are
    already gone (the job was killed on the way out); a fresh process leaves no RPC state behind. A rehearsed
    fault (PIPEGPT_FAULT) fires on the first attempt only (a comma list: one per attempt)."""
    from pipegpt.train import checkpoint, snapshot
    from pipegpt.train.elastic import layout_text
    from pipegpt.train.faults import FAULT_ENV, later_faults
    from pipegpt.train.health import restart_devices

    failed_at = time.time()
    saved = checkpoint.complete_checkpoints(run_dir / "checkpoints")
    step = job.current_step
    at = f" at step {step + 1}" if step is not None else " while starting"
    cfg = job.cfg
    device = resolve_device(cfg.runtime.device, cfg.world_size)
    ranks, device_env, checked = restart_devices(device, cfg.world_size, failure.rank if _lost(failure) else None)
    if checked:
        echo(f"pipegpt: {checked}", err=True)
    on_disk = int(checkpoint.read_manifest(saved[-1], verify=False)["step"]) if saved else 0
    # a snapshot outlives processes, not machines: where a device is gone, its host may be too
    same_devices = ranks == cfg.world_size
    memory = snapshot.newest_complete(snapshot.snapshot_root(run_dir), on_disk) if same_devices else None
    if memory is not None:
        saved = [memory]  # newer than any checkpoint on disk: resumed from shared memory
    if saved:
        done = int(checkpoint.read_manifest(saved[-1], verify=False)["step"])
        lost = f", {step - done} step{'s' if step - done != 1 else ''} to do again" if step is not None else ""
        steps_lost = step - done if step is not None else 0
        kind = "the snapshot in memory " if memory is not None else ""
        source = f"from {kind}{saved[-1]} (after step {done}{lost})"
    else:
        source = "from the start (no checkpoint yet)"
        steps_lost = step or 0
    limit, layout, flags = cfg.checkpoint.max_restarts, "same layout", {}
    if not same_devices:  # a device is gone: go on without it, or stop
        shrunk = _shrink(echo, failure, cfg, ranks)
        layout, flags = f"{layout_text(cfg)} -> {layout_text(shrunk.cfg)}, predicted step x{shrunk.ratio:.2f}", \
            shrunk.flags
    echo(f"pipegpt: rank {failure.rank} {failure.verb}{at} ({failure.cause}); restart {count} of {limit}, "
         f"{layout}, {source}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if later_faults():
        env[FAULT_ENV] = later_faults()
    env[RESTART_ENV] = f"{count} {failed_at!r} {steps_lost}"
    env.update(device_env)  # on GPUs: only those that passed the device check
    resume = None if not saved else str(saved[-1]) if memory is not None else str(run_dir)
    args = restart_args(sys.argv[1:], resume, flags, run_dir=str(run_dir))
    os.execve(sys.executable, [sys.executable, "-m", "pipegpt", *args], env)


def _shrink(echo: Callable, failure, cfg: TrainConfig, remaining: int):
    """The layout for the ranks that remain when devices are gone; the run ends (exit 1) where --min-ranks does
    not allow it or no layout builds."""
    from pipegpt.train.elastic import shrunk_layout

    why = None
    if cfg.checkpoint.min_ranks is None:
        why = "give --min-ranks K to go on with fewer ranks"
    elif remaining < cfg.checkpoint.min_ranks:
        why = f"{remaining} ranks remain, fewer than --min-ranks {cfg.checkpoint.min_ranks}"
    shrunk = None if why else shrunk_layout(cfg, remaining)
    if why is None and shrunk is None:
        why = f"no layout of this model and batch builds on {remaining} ranks"
    if why:
        gone = (f"rank {failure.rank}'s device is gone" if _lost(failure) and remaining == cfg.world_size - 1
                else f"{cfg.world_size - remaining} of {cfg.world_size} devices are gone")
        _exit_now(echo, f"Error: {gone} ({failure.cause}): {why}; all workers stopped", 1)
    return shrunk


# The layout options a shrunk restart sets (and their short forms): the old values go.
LAYOUT_FLAGS = frozenset(flag for f in LAYOUT_FIELDS if f.shrink for flag in option_flags(f.name))


def restart_args(argv: list[str], resume: str | None, layout: dict | None = None, run_dir: str | None = None
                 ) -> list[str]:
    """The command line again, resuming `resume` (None: as given, the run starting over) in `run_dir`: --resume,
    --init-from and --config give way to the checkpoint, which holds the run's settings; --overwrite would move
    the run aside. `layout` (flag -> value) replaces the layout options given, when the run goes on with fewer
    ranks."""
    drop = {"--overwrite"} | ({"--resume", "--init-from", "--config", "--run-dir"} if resume else set())
    if layout:
        drop |= LAYOUT_FLAGS
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg and name != "--overwrite"
            continue
        out.append(arg)
    for flag, value in (layout or {}).items():
        out += [flag, str(value)]
    return out + (["--resume", resume] + (["--run-dir", run_dir] if run_dir else []) if resume else [])


def _drop_snapshots(cfg: TrainConfig, run_dir: Path) -> None:
    """The run is over (done, or failed past --max-restarts): its snapshots in shared memory go (RAM)."""
    if cfg.checkpoint.snapshot_every:
        from pipegpt.train import snapshot

        snapshot.remove(snapshot.snapshot_root(run_dir))


def _lost(failure) -> bool:
    """Whether the failed rank's device is gone for good (a rehearsed `lose`): a shrink, not a restart."""
    from pipegpt.train.faults import LOST_DEVICE_EXIT

    return failure.exit_code == LOST_DEVICE_EXIT


# --------------------------------------------------------------------------------------------------------------
# The run directory: one run per directory, writable, checked before any work starts

def holds_run(run_dir: Path) -> bool:
    """Whether a directory holds a run's results: metrics or checkpoints."""
    metrics, checkpoints = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    return (metrics.is_file() and metrics.stat().st_size > 0) or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def check_run_dir(run_dir: Path | None, cfg: TrainConfig, overwrite: bool, continuing: bool = False) -> None:
    """Refuse, in one line, a run directory that this run could not write or would mix with another run's
    (None: a new runs/<time>). A resume goes on in its checkpoint's run, attempt after attempt; so does a run
    that is `continuing` one whose earlier attempt left no checkpoint."""
    from pipegpt.config import ConfigError

    resume = cfg.checkpoint.resume
    if overwrite and resume is not None:
        raise ConfigError("--overwrite starts a fresh run and --resume continues one: give one of them")
    if run_dir is None:
        _check_writable(Path("runs"), "the default run directory runs/<time> (or give --run-dir)")
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file, not a directory: give a new or empty directory")
    _check_writable(run_dir, f"--run-dir {run_dir}")
    if run_dir.is_dir() and holds_run(run_dir) and not overwrite and not (continuing and resume is None):
        if resume is None:
            raise ConfigError(f"--run-dir {run_dir} holds a run (metrics.jsonl or checkpoints/): continue it with "
                              f"--resume {run_dir}, give a new --run-dir, or --overwrite to move it aside")
        own = _resumed_run_dir(cfg)
        if own is None or own.resolve() != run_dir.resolve():
            raise ConfigError(f"--run-dir {run_dir} holds another run than the checkpoint's: leave out --run-dir "
                              f"to go on in the checkpoint's run, or give a new directory")
    checkpoints = run_dir / "checkpoints"
    if cfg.checkpoint.save_every and checkpoints.exists():
        _check_writable(checkpoints, f"{checkpoints} (where --save-every {cfg.checkpoint.save_every} saves)",
                        "make it writable, give another --run-dir, or --save-every 0")


def _check_writable(path: Path, what: str, fix: str = "choose a directory you can write to") -> None:
    """A ConfigError unless a file can be created in `path`, or in its nearest existing parent if it does not
    exist yet. Tried rather than asked (os.access): root ignores permission bits, not a read-only mount."""
    import tempfile

    from pipegpt.config import ConfigError

    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what}: {existing} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".pipegpt-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "" if existing == path else f" ({existing}, where it would be created)"
        raise ConfigError(f"{what} is not writable{where}: {e.strerror or e}; {fix}") from None


def move_aside(run_dir: Path) -> Path:
    """--overwrite: everything in run_dir (but earlier previous-* folders) into run_dir/previous-<time>/."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = run_dir / f"previous-{stamp}", 1
    while dest.exists():
        n += 1
        dest = run_dir / f"previous-{stamp}-{n}"
    dest.mkdir()
    for entry in list(run_dir.iterdir()):
        if entry != dest and not entry.name.startswith("previous-"):
            entry.rename(dest / entry.name)
    return dest


def crowding(cfg: TrainConfig, device: str) -> str | None:
    """A warning when more worker processes than CPU cores start here on CPU: they take turns on the cores."""
    from pipegpt.train.placement import local_world_size

    if device != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = local_world_size(cfg.world_size)
    if workers <= cores:
        return None
    return (f"pipegpt: warning: {workers} worker processes on {cores} CPU cores: they take turns, so each step "
            f"is slower than on {workers} cores (dp x pp x tp = {cfg.world_size})")


def _resumed_run_dir(cfg: TrainConfig) -> Path | None:
    """A resumed run goes on in the run directory its checkpoint is in (RUN/checkpoints/step-N)."""
    from pipegpt.train.checkpoint import read_manifest, resolve

    if cfg.checkpoint.resume is None:
        return None
    found = resolve(cfg.checkpoint.resume)
    if found.parent.name == "checkpoints":
        return found.parent.parent
    run_dir = read_manifest(found, verify=False).get("run_dir")  # a snapshot in shared memory names its run
    return Path(run_dir) if run_dir else None


def _exit_now(echo: Callable, message: str, code: int):
    """Exit without interpreter teardown: with workers killed mid-call, the RPC agent's
    destructor can abort the process, turning a clean error into a crash."""
    echo(message, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Clock:
    """Wall-clock time of the job's steps, evaluations and saves included, and the time left at that pace.

    The rate is taken from the steps after this attempt's first: the first includes the workers' warm-up."""

    def __init__(self, first_step: int, steps: int, now: Callable[[], float] = time.monotonic):
        self.first_step, self.steps, self.now = first_step, steps, now
        self.start = now()
        self.first_done: float | None = None  # when this attempt's first step ended
        self.step = first_step - 1

    def tick(self, step: int) -> None:
        self.step = step
        if step == self.first_step:
            self.first_done = self.now()

    def elapsed(self) -> float:
        return self.now() - self.start

    def eta(self) -> float | None:
        """Seconds left, or None until a step after the first has ended (no rate yet)."""
        after_first = self.step - self.first_step
        if self.first_done is None or after_first < 1:
            return None
        return (self.now() - self.first_done) / after_first * (self.steps - 1 - self.step)


def duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m: short enough for a progress line."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(m, steps: int, elapsed_s: float | None = None, eta_s: float | None = None) -> str:
    done = m.step * 20 // steps
    line = (f"step {m.step:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (20 - done)}] loss {m.loss:.4f}  "
            f"{m.step_time_s * 1000:7.1f} ms  {m.tokens_per_s:9,.0f} tok/s")
    if elapsed_s is not None:
        line += f"  elapsed {duration(elapsed_s)}"
        if m.step < steps:
            line += f"  eta {duration(eta_s) if eta_s is not None else '?'}"
    return line


def summary_lines(history: list, cfg: TrainConfig, out: Path) -> list[str]:
    """The loss, speed and memory of a finished run, and where its metrics, traces and profiles are."""
    timed = [m.step_time_s for m in history[1:]] or [history[0].step_time_s]  # the first step includes warm-up
    lines = [f"done: loss {history[0].loss:.4f} -> {history[-1].loss:.4f} in {len(history)} steps; "
             f"median step {statistics.median(timed) * 1000:.1f} ms, "
             f"{statistics.median(m.tokens_per_s for m in history[1:] or history):,.0f} tok/s; "
             f"peak memory per rank {', '.join(f'{b / 2**20:.0f} MiB' for b in history[-1].peak_memory_per_rank)}",
             f"metrics: {out / 'metrics.jsonl'}, plotted in {out / 'plot.svg'}; last step's measured timeline: "
             f"{out / 'trace.json'} (Perfetto)"]
    if cfg.runtime.trace_steps != "last":
        lines.append(f"traces of steps {', '.join(str(s + 1) for s in cfg.runtime.traced_steps())}: {out / 'traces'}/step-N.json "
                     f"(pipegpt simulate --trace {out} --trace-step N)")
    if cfg.runtime.profile and any((out / "profiles").glob("rank-*")):
        lines.append(f"profiles (py-spy): {out / 'profiles'}/rank-N.svg, rank-N.speedscope.json")
    return lines
