"""The run directory's layout, named once: every module that reads or writes a run's files takes the names
from here (torch-free, so the simulator's --trace and the planner read runs without loading torch).

    RUN/
      config.json, plan.txt        the latest attempt's settings and plan
      configs/attempt-N.json       each attempt's settings
      metrics.jsonl                one row per step, naming its attempt ("abandoned": a step done again later)
      trace.json, traces/step-N.json, profiles/rank-N.svg, plot.svg
      checkpoints/step-NNNNNNNN/   layout-free checkpoints (pipegpt.state.checkpoint)
      abandoned-<time>/checkpoints/  those a resume from an older checkpoint moved off the line (train.run_dir)
      restart.json                 what a restart carries into the next attempt (pipegpt.train.restart)
      snapshots.json               the run id its snapshots in shared memory are kept under, and their owner
                                   (pipegpt.state.snapshot)

One process owns the directory while it runs: the driver, holding a lock on the directory itself
(pipegpt.state.owner).
"""
from __future__ import annotations

import errno
import os
from contextlib import contextmanager

CONFIG, PLAN, METRICS, TRACE, PLOT = "config.json", "plan.txt", "metrics.jsonl", "trace.json", "plot.svg"
CONFIGS, TRACES, PROFILES, CHECKPOINTS = "configs", "traces", "profiles", "checkpoints"
RESTART, SNAPSHOTS = "restart.json", "snapshots.json"
ABANDONED_PREFIX = "abandoned-"


def attempt_config(n: int) -> str:
    return os.path.join(CONFIGS, f"attempt-{n}.json")


def step_trace(step: int) -> str:
    return os.path.join(TRACES, f"step-{step}.json")


def holds_run(run_dir) -> bool:
    """Whether a directory holds a run's results: metrics or checkpoints."""
    metrics, checkpoints = os.path.join(run_dir, METRICS), os.path.join(run_dir, CHECKPOINTS)
    return (os.path.isfile(metrics) and os.path.getsize(metrics) > 0) or \
        (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints)))


class RunFileError(OSError):
    """A run file could not be written: its str is one line naming the file and the cause ("disk full writing
    runs/a/metrics.jsonl: No space left on device"). An OSError still, for callers that catch those."""

    def __init__(self, path, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause), os.fspath(path))
        full = cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        self.line = f"{'disk full writing' if full else 'cannot write'} {os.fspath(path)}: {cause.strerror or cause}"

    def __str__(self) -> str:
        return self.line


def failure_line(e: OSError) -> str:
    """One line for an OSError that stopped a run: the file and the cause."""
    if isinstance(e, RunFileError):
        return e.line
    if e.filename is not None and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunFileError(e.filename, e).line
    return f"{e.strerror}: {os.fspath(e.filename)}" if e.strerror and e.filename is not None else str(e)


@contextmanager
def writing(path):
    """Any OSError inside becomes a RunFileError naming `path`."""
    try:
        yield
    except RunFileError:
        raise
    except OSError as e:
        raise RunFileError(path, e) from e


def write_whole(path, text: str) -> None:
    """`text` into `path`, whole or not at all: written beside it, then renamed over it. A full disk leaves
    the file as it was (never empty or half-written) and no temporary file behind; it raises a RunFileError
    naming `path`."""
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    try:
        with writing(path):
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
