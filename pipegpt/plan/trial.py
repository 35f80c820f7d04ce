"""`pipegpt plan --try K`: run the top plans here for a few steps each, as `pipegpt run` (the exact command the
plan prints), and set the measured step time beside the predicted one: the check AMP-style planners make
before anyone trusts a prediction."""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pipegpt.config import ConfigError
from pipegpt.schedule.calibrate import read_metrics
from pipegpt.schedule.render import text_table


def try_plans(best: list, precision: str, steps: int, device: str) -> list[dict]:
    """Each plan's command, predicted and measured step time (the median after the first, warm-up step)."""
    tried = []
    for k, r in enumerate(best, start=1):
        args = r.layout.run_args(r.model, precision)
        with tempfile.TemporaryDirectory() as run_dir:
            proc = subprocess.run([*_pipegpt(), "run", *args, "--steps", str(steps), "--lr-schedule", "constant",
                                   "--device", device, "--run-dir", run_dir, "--log-every", "1000000"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
                raise ConfigError(f"plan #{k} failed when tried: {last}")
            rows = read_metrics(run_dir)
        measured = statistics.median([row["step_time_s"] for row in rows][1:])
        tried.append({"plan": k, "command": "pipegpt run " + " ".join(args), "predicted_step_s": r.step_time,
                      "measured_step_s": measured, "measured_over_predicted": measured / r.step_time})
    return tried


def trials_text(best: list, tried: list[dict], steps: int) -> str:
    """The tried plans, measured beside predicted, as a table."""
    rows = [["#", "plan", "predicted", "measured", "measured/predicted"]]
    for r, t in zip(best, tried):
        layout = r.layout
        rows.append([str(t["plan"]), f"dp{layout.dp} pp{layout.pp} tp{layout.tp} {layout.schedule} "
                     f"m{layout.microbatches}x{layout.microbatch_size} rc={layout.recompute}",
                     f"{r.step_time * 1e3:.1f} ms", f"{t['measured_step_s'] * 1e3:.1f} ms",
                     f"{t['measured_over_predicted']:.2f}"])
    return (f"tried the top {len(tried)} plans here, {steps} steps each (median after the first):\n"
            + text_table(rows, right={2, 3, 4}, rule=True))


def _pipegpt() -> list[str]:
    """The `pipegpt` beside this interpreter, or `python -m pipegpt` where there is none."""
    exe = Path(sys.executable).with_name("pipegpt")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pipegpt"]
