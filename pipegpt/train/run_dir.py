"""The run directory: one run per directory, writable, checked before any work starts; --overwrite moves an
earlier run aside; a resumed run goes on in its checkpoint's directory. The file names are pipegpt.run_files'."""
from __future__ import annotations

import os
from pathlib import Path

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
