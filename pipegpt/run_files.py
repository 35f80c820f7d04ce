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
(pipegpt.state.owner). Its readers are here too (read_metrics, read_measured_run): what reads a run's files
(the simulator's --trace, the planner's --calibrate, the summary, plots) gets their parsed contents.
"""
from __future__ import annotations

import errno
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace

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


# --------------------------------------------------------------------------------------------------------------
# reading a run directory

class RunReadError(ValueError):
    """A run directory, or one of its files, that cannot be read: its str is one line naming it."""


def read_json(path, what: str):
    """A JSON file's contents; a file that is missing or not JSON is one line naming it (RunReadError)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as e:
        raise RunReadError(f"cannot read {what} {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunReadError(f"{path} is not valid JSON ({e})") from None


def read_metrics(run_dir) -> list[dict]:
    """A run directory's metrics.jsonl rows as the run went, one per step in step order ([] without the file).

    Every row names the attempt that wrote it (`attempt`: 1 for the fresh run, +1 per resume). A resume goes
    on from its checkpoint, so an attempt's first row replaces the rows of the steps from there on that
    earlier attempts wrote (an interrupted attempt's steps past the checkpoint): each step's last row, and no
    stale row after it. Rows marked "abandoned" (steps a later attempt did again: pipegpt.observe.metrics) and
    a line cut short by a crash are skipped."""
    path = os.path.join(os.fspath(run_dir), METRICS)
    if not os.path.isfile(path):
        return []
    kept: dict[int, dict] = {}
    attempt = None
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, TypeError, KeyError):
                continue
            if row.get("abandoned"):
                continue
            if row.get("attempt", 1) != attempt:
                attempt = row.get("attempt", 1)
                kept = {s: r for s, r in kept.items() if s < step}
            kept[step] = row
    return [kept[s] for s in sorted(kept)]


def traced_steps(run_dir) -> list[int]:
    """The steps a run directory holds traces/step-N.json of, sorted."""
    try:
        names = os.listdir(os.path.join(os.fspath(run_dir), TRACES))
    except OSError:
        return []
    return sorted(int(n[5:-5]) for n in names if n.startswith("step-") and n.endswith(".json") and n[5:-5].isdigit())


@dataclass(frozen=True)
class MeasuredRun:
    """A run directory's record of one measured step: where the lowered plan every rank ran is (plan.txt, a
    schedule file: pipegpt.schedule.schedule_file reads it), the step's Chrome trace (trace.json: the last step;
    traces/step-N.json) and the run's settings (config.json; None where there is none)."""

    run_dir: str
    plan_path: str
    trace_path: str
    trace: object
    config: dict | None
    step: int | None = None  # the step the trace measured (metrics.jsonl's number), where known


def read_measured_run(run_dir, step: int | None = None) -> MeasuredRun:
    """trace.json (with a step, traces/step-N.json) and config.json of a run directory, read, and its plan.txt
    found; what is missing is one line saying what a `pipegpt run` leaves there (RunReadError)."""
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise RunReadError(f"--trace {run_dir}: no such run directory (give the directory a `pipegpt run` "
                           f"wrote, holding {PLAN} and {TRACE})")
    for name in (PLAN, TRACE) if step is None else (PLAN,):
        if not os.path.isfile(os.path.join(run_dir, name)):
            raise RunReadError(f"--trace {run_dir}: no {name} in it (a `pipegpt run` writes {PLAN} at the "
                               f"start and {TRACE} after the last step)")
    trace = os.path.join(run_dir, TRACE)
    if step is not None:
        trace = os.path.join(run_dir, TRACES, f"step-{step}.json")
        if not os.path.isfile(trace):
            steps = traced_steps(run_dir)
            raise RunReadError(f"{run_dir} has no trace of step {step}; traced steps: "
                               f"{', '.join(map(str, steps)) or 'none'}")
    config_path = os.path.join(run_dir, CONFIG)
    config = read_json(config_path, "config") if os.path.isfile(config_path) else None
    return MeasuredRun(run_dir, os.path.join(run_dir, PLAN), trace, read_json(trace, "trace"), config, step)


def read_measured_steps(run_dir) -> list[MeasuredRun]:
    """Every step a run directory has a trace of, each once: the steps --trace-steps named (traces/step-N.json)
    and the last (trace.json). The first step, which warms up (allocations, threads starting), is left out
    where another is there. A calibration takes the median over them: one step's time moves by a few percent
    from the next's on a CPU."""
    rows = read_metrics(run_dir)
    last = int(rows[-1]["step"]) if rows else None
    runs = [read_measured_run(run_dir, s) for s in traced_steps(run_dir) if s != last]
    runs.append(replace(read_measured_run(run_dir), step=last))  # trace.json: the last step's
    return [r for r in runs if r.step != 1] or runs
