"""The run directory: one run per directory, owned by one driver while it runs (its lock), writable, checked
before any work starts; --overwrite moves an earlier run aside; a resumed run goes on in its checkpoint's
directory, and its history stays a line (later checkpoints move aside). The file names are pipegpt.run_files'."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from pipegpt import run_files
from pipegpt.config import TrainConfig


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
    if run_dir.is_dir() and run_files.holds_run(run_dir) and not overwrite and not (continuing and resume is None):
        if resume is None:
            raise ConfigError(f"--run-dir {run_dir} holds a run (metrics.jsonl or checkpoints/): continue it with "
                              f"--resume {run_dir}, give a new --run-dir, or --overwrite to move it aside")
        own = resumed_run_dir(cfg)
        if own is None or own.resolve() != run_dir.resolve():
            raise ConfigError(f"--run-dir {run_dir} holds another run than the checkpoint's: leave out --run-dir "
                              f"to go on in the checkpoint's run, or give a new directory")
    checkpoints = run_dir / run_files.CHECKPOINTS
    if cfg.checkpoint.save_every and checkpoints.exists():
        _check_writable(checkpoints, f"{checkpoints} (where --save-every {cfg.checkpoint.save_every} saves)",
                        "make it writable, give another --run-dir, or --save-every 0 --no-save-final")
    elif cfg.checkpoint.save_final and checkpoints.exists():
        _check_writable(checkpoints, f"{checkpoints} (where the last step is saved)",
                        "make it writable, give another --run-dir, or --no-save-final")


def own_run_dir(run_dir: Path, warn: Callable[[str], None] | None = None) -> None:
    """This process owns run_dir until it ends (pipegpt.state.owner): refused in one line while another run
    holds it. Where it cannot be locked, `warn` (if given) says so and the run goes on unguarded."""
    from pipegpt.config import ConfigError
    from pipegpt.state.owner import RunDirBusy, lock_run_dir

    try:
        why = lock_run_dir(run_dir)
    except RunDirBusy as e:
        who = f"pid {e.pid}" if e.pid else "another process"
        raise ConfigError(f"{run_dir} is in use by another pipegpt run ({who}): wait for it to end or stop it, "
                          f"or give another --run-dir") from None
    if why and warn:
        warn(f"pipegpt: {run_dir} could not be locked ({why}): nothing keeps a second run out of it")


def abandon_later(run_dir: Path, step: int) -> tuple[list[str], Path] | None:
    """History is a line: a run going on after `step` in a directory that holds later checkpoints (a resume of
    an older one) moves them into RUN/abandoned-<time>/checkpoints/, so that the latest and --keep follow the
    branch that runs (their metrics rows are marked by the run's log: pipegpt.observe.metrics). Returns
    (the names moved, where) or None."""
    import time

    from pipegpt.state.checkpoint import DIR_PREFIX, complete_checkpoints

    def step_of(path: Path) -> int:
        digits = path.name.removeprefix(DIR_PREFIX)
        return int(digits) if digits.isdigit() else -1

    later = [p for p in complete_checkpoints(run_dir / run_files.CHECKPOINTS) if step_of(p) > step]
    if not later:
        return None
    dest = _fresh(run_dir / f"{run_files.ABANDONED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}") / run_files.CHECKPOINTS
    dest.mkdir(parents=True)
    for path in later:
        path.rename(dest / path.name)
    return [p.name for p in later], dest.parent


def _fresh(path: Path) -> Path:
    """path, or path-2, path-3, ... : the first that does not exist."""
    found, n = path, 1
    while found.exists():
        n += 1
        found = path.with_name(f"{path.name}-{n}")
    return found


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

    dest = _fresh(run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
    dest.mkdir()
    for entry in list(run_dir.iterdir()):
        if entry != dest and not entry.name.startswith("previous-"):
            entry.rename(dest / entry.name)
    return dest


def resumed_run_dir(cfg: TrainConfig) -> Path | None:
    """A resumed run goes on in the run directory its checkpoint is in (RUN/checkpoints/step-N)."""
    from pipegpt.state.checkpoint import read_manifest, resolve

    if cfg.checkpoint.resume is None:
        return None
    found = resolve(cfg.checkpoint.resume)
    if found.parent.name == run_files.CHECKPOINTS:
        return found.parent.parent
    run_dir = read_manifest(found, verify=False).get("run_dir")  # a snapshot in shared memory names its run
    return Path(run_dir) if run_dir else None
