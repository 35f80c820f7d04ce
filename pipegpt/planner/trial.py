"""`pipegpt plan --try K`: run the top plans here for a few steps each, as `pipegpt run` (the exact command the
plan prints), and set the measured step time beside the predicted one: the check AMP-style planners make
before anyone trusts a prediction. Each tried run keeps its directory (metrics, trace, plan), so
`pipegpt simulate --trace DIR` and `pipegpt plan --calibrate DIR` can read it."""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipegpt.config import ConfigError
from pipegpt.run_files import read_metrics
from pipegpt.schedule.render import text_table

from .candidates import mesh_name


def trials_dir(given: str | None) -> Path:
    """Where the tried runs go: --try-dir (new or empty), else a new runs/plan-try-<time>."""
    if given is not None:
        path = Path(given)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ConfigError(f"--try-dir {given} exists and is not an empty directory: name a new one")
        return path
    path = Path("runs") / time.strftime("plan-try-%Y%m%d-%H%M%S")
    suffix, candidate = 1, path
    while candidate.exists():
        suffix += 1
        candidate = Path(f"{path}-{suffix}")
    return candidate


def try_plans(best: list, precision: str, steps: int, device: str, root: Path) -> list[dict]:
    """Each plan's command, run directory, predicted and measured step time (the median after the first, warm-up
    step). Plan K runs in root/plan-K."""
    tried = []
    for k, r in enumerate(best, start=1):
        args = r.layout.run_args(r.model, precision)
        run_dir = root / f"plan-{k}"
        run_dir.mkdir(parents=True)
        proc = subprocess.run([*_pipegpt(), "run", *args, "--steps", str(steps), "--lr-schedule", "constant",
                               "--device", device, "--run-dir", str(run_dir), "--log-every", "1000000"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise ConfigError(f"plan #{k} failed when tried ({run_dir}): {last}")
        rows = read_metrics(run_dir)
        measured = statistics.median([row["step_time_s"] for row in rows][1:])
        tried.append({"plan": k, "command": "pipegpt run " + " ".join(args), "run_dir": str(run_dir),
                      "predicted_step_s": r.step_time, "measured_step_s": measured,
                      "measured_over_predicted": measured / r.step_time})
    return tried


def trials_text(best: list, tried: list[dict], steps: int) -> str:
    """The tried plans, measured beside predicted, as a table."""
    rows = [["#", "plan", "predicted", "measured", "measured/predicted", "run directory"]]
    for r, t in zip(best, tried):
        layout = r.layout
        mesh = mesh_name(layout.sharding, {"cp": layout.cp_comm})
        rows.append([str(t["plan"]), f"{mesh} {layout.schedule} "
                     f"m{layout.microbatches}x{layout.microbatch_size} rc={layout.recompute}",
                     f"{r.step_time * 1e3:.1f} ms", f"{t['measured_step_s'] * 1e3:.1f} ms",
                     f"{t['measured_over_predicted']:.2f}", t["run_dir"]])
    return (f"tried the top {len(tried)} plans here, {steps} steps each (median after the first):\n"
            + text_table(rows, right={2, 3, 4}, rule=True, free_last=True))


def _pipegpt() -> list[str]:
    """The `pipegpt` beside this interpreter, or `python -m pipegpt` where there is none."""
    exe = Path(sys.executable).with_name("pipegpt")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pipegpt"]
