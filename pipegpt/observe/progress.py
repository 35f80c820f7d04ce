"""What `pipegpt run` prints as it goes: the crowding (pipegpt.observe.crowding: inference prints it too) and
vocabulary warnings, progress lines (elapsed, ETA) and the summary."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

from pipegpt import run_files
from pipegpt.config import TrainConfig
from pipegpt.observe.crowding import crowding  # noqa: F401  (launch.py takes it from here with the rest)
from pipegpt.run_files import read_metrics


def unused_vocabulary(cfg: TrainConfig) -> str | None:
    """A warning when the tokenizer gives fewer ids than the model's vocabulary (`--model gpt2 --tokenizer bytes`):
    the embedding rows above its ids never see a token."""
    from pipegpt.data.tokenizers import tokenizer_size

    ids, vocab = tokenizer_size(cfg.data.tokenizer), cfg.model.vocab_size
    if ids >= vocab:
        return None
    return (f"pipegpt: warning: tokenizer {cfg.data.tokenizer} gives {ids:,} token ids but the model's vocabulary "
            f"is {vocab:,}: {vocab - ids:,} embedding rows are never trained (give --vocab-size {ids}, or the "
            f"tokenizer the model was made for)")


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
    line = (f"step {m.step:>{len(str(steps))}}/{steps} [{'#' * done}{'.' * (20 - done)}] loss {m.loss:.4f}"
            f"{moe_figure(getattr(m, 'moe', None))}  {m.step_time_s * 1000:7.1f} ms  {m.tokens_per_s:9,.0f} tok/s")
    if elapsed_s is not None:
        line += f"  elapsed {duration(elapsed_s)}"
        if m.step < steps:
            line += f"  eta {duration(eta_s) if eta_s is not None else '?'}"
    return line


def moe_figure(moe: dict | None) -> str:
    """A MoE run's one figure beside the loss: its aux loss where the model has one (aux_loss_coef or the z-loss),
    else the worst layer's imbalance (max / mean tokens per expert); '' for a dense run."""
    if not moe:
        return ""
    if moe.get("aux_loss"):
        return f" aux {moe['aux_loss']:.4f}"
    return f" imb {moe.get('moe_imbalance', 0.0):.2f}"


def summary_lines(history: list, cfg: TrainConfig, out: Path) -> list[str]:
    """The loss, speed and memory of a finished run, and where its metrics, traces and profiles are."""
    timed = [m.step_time_s for m in history[1:]] or [history[0].step_time_s]  # the first step includes warm-up
    first, steps = history[0].loss, f"{len(history)} steps"
    rows = read_metrics(out)  # the whole run, across its attempts (resumes, restarts)
    if rows and rows[0]["step"] < history[0].step and rows[0].get("loss") is not None:
        first = rows[0]["loss"]
        steps = f"{len(rows)} steps ({len(history)} in this attempt, from step {history[0].step})"
    lines = [f"done: loss {first:.4f} -> {history[-1].loss:.4f} in {steps}; "
             f"median step {statistics.median(timed) * 1000:.1f} ms, "
             f"{statistics.median(m.tokens_per_s for m in history[1:] or history):,.0f} tok/s; "
             f"peak memory per rank {', '.join(f'{b / 2**20:.0f} MiB' for b in history[-1].peak_memory_per_rank)}",
             f"metrics: {out / run_files.METRICS}, plotted in {out / run_files.PLOT}; last step's measured timeline: "
             f"{out / run_files.TRACE} (Perfetto)"]
    if cfg.runtime.trace_steps != "last":
        lines.append(f"traces of steps {', '.join(str(s + 1) for s in cfg.runtime.traced_steps())}: {out / run_files.TRACES}/step-N.json "
                     f"(pipegpt simulate --trace {out} --trace-step N)")
    if cfg.runtime.profile and any((out / run_files.PROFILES).glob("rank-*")):
        lines.append(f"profiles (py-spy): {out / run_files.PROFILES}/rank-N.svg, rank-N.speedscope.json")
    return lines
