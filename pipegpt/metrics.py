"""What a run leaves behind: its directory, config.json, metrics.jsonl (a line per step), trace.json."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipegpt.config import TrainConfig
from pipegpt.schedule.actions import Action, Plan
from pipegpt.schedule.render import to_chrome_trace
from pipegpt.schedule.simulate import Event, Timeline


@dataclass
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    grad_norm: float
    peak_memory_per_rank: list[int]


def step_metrics(step: int, results: list[dict], cfg: TrainConfig, elapsed: float) -> StepMetrics:
    """One step's figures from the workers' answers (the last stage's ranks report the losses)."""
    losses = [loss for r in results for loss in r["losses"]]
    return StepMetrics(step, sum(losses) / len(losses) if losses else math.nan, elapsed,
                       cfg.tokens_per_step / elapsed, results[0]["grad_norm"], [r["peak_memory"] for r in results])


def new_run_dir(root: str = "runs") -> Path:
    path = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    suffix, candidate = 1, path
    while candidate.exists():
        suffix += 1
        candidate = Path(f"{path}-{suffix}")
    candidate.mkdir(parents=True)
    return candidate


class RunLog:
    """config.json at the start, a metrics.jsonl line per step (flushed, so a crash keeps them)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig):
        self.run_dir = Path(run_dir)
        (self.run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")

    def step(self, metrics: StepMetrics) -> None:
        self._metrics.write(json.dumps(asdict(metrics)) + "\n")
        self._metrics.flush()

    def trace(self, results: list[dict], plan: Plan) -> None:
        """The step's measured timeline as trace.json (Perfetto), the format `simulate --out x.json` writes."""
        (self.run_dir / "trace.json").write_text(json.dumps(to_chrome_trace(measured_timeline(results, plan))))

    def close(self) -> None:
        self._metrics.close()


def measured_timeline(results: list[dict], plan: Plan) -> Timeline:
    """One step's recorded actions from every rank as the Timeline type the simulator produces."""
    t0 = min((start for r in results for _, start, _ in r["events"]), default=0.0)
    events = [Event(r["rank"], Action.parse(name), start - t0, end - t0)
              for r in results for name, start, end in r["events"]]
    return Timeline(events, len(results), schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=plan.stage_to_rank, time_unit="s")
