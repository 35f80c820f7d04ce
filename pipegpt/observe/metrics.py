"""What a run leaves behind: its directory, config.json and configs/attempt-N.json (each attempt's), plan.txt
(the lowered plan every rank ran, in the schedule-file format), metrics.jsonl (a line per step, naming its attempt),
trace.json (the last step's measured timeline), traces/step-N.json (those of --trace-steps), plot.svg (loss, val
loss, learning rate and tokens/s against the step, redrawn as each attempt closes)."""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipegpt.config import TrainConfig
from pipegpt.model.flops import flops_per_token
from pipegpt.model.moe import merge_stats
from pipegpt.costs.devices import device_peak_tflops
from pipegpt.observe.exchanges import trace_events
from pipegpt.observe.plot import write_plot
from pipegpt.observe.step_time import trace_events as step_parts
from pipegpt.engine.results import WorkerStep
from pipegpt.schedule.actions import Action, Plan
from pipegpt.schedule.render import to_chrome_trace
from pipegpt.schedule.schedule_file import dump_schedule_text
from pipegpt.schedule.simulate import Event, Timeline
from pipegpt import run_files


@dataclass
class StepMetrics:
    step: int  # the step's number, from 1 (as the console, checkpoint names and --trace-steps count)
    loss: float
    step_time_s: float
    tokens_per_s: float
    grad_norm: float
    peak_memory_per_rank: list[int]
    lr: float | None = None  # the learning rate this step's optimizer update used
    flops_per_s: float | None = None  # model FLOPs (flops_per_token x tokens) per second, all ranks together
    mfu: float | None = None  # flops_per_s / (ranks x one device's peak); None where the peak is unknown
    val_loss: float | None = None  # on evaluation steps (--eval-every), after this step's update
    hellaswag_acc: float | None = None  # with --hellaswag, on evaluation steps: argmin of the summed ending loss
    hellaswag_acc_norm: float | None = None  # ... of the mean ending loss per token (what nanoGPT reports)
    checkpoint_s: float | None = None  # on checkpoint steps (--save-every): seconds to save, commit included
    snapshot_s: float | None = None  # on snapshot steps (--snapshot-every): seconds until every rank had copied its
    #                                  state (the writing goes on in the background)
    control_s: float | None = None  # step_time_s minus the slowest worker's step(): the RPC round trip and pickling
    cpu_per_rank: list[float] | None = None  # each worker process's CPU time in its step() / step_time_s (1.0: a core)
    driver_cpu: float | None = None  # the driver's CPU time during the step / step_time_s
    skipped_steps: int = 0  # steps whose update was dropped (non-finite loss or grad norm) since this process began
    nonfinite: str | None = None  # on such a step: what was not finite and where it appeared first
    recovery_s: float | None = None  # on an attempt's first step after a restart (--max-restarts): seconds from the
    #                                  failure to this step's end
    steps_lost: int | None = None  # on that step too: the steps completed before the failure that were done again
    #                                (the failed step's index minus the resumed checkpoint's or snapshot's step)
    # On recorded steps (--trace-steps and the last), per rank: the peak of tensor bytes (on CUDA the allocator's
    # max_memory_allocated), what was held at it by kind, and the planner's peak (pipegpt.observe.tensor_bytes;
    # None where the memory model does not cover the plan)
    peak_tensor_bytes: list[int] | None = None
    peak_tensor_bytes_by_kind: list[dict] | None = None
    predicted_peak_bytes: list[int | None] | None = None
    predicted_peak_bytes_by_kind: list[dict | None] | None = None
    # With experts: aux_loss (the MoE layers' aux losses, summed over layers, averaged over microbatches and
    # replicas), moe_imbalance (the worst layer's max / mean tokens per expert), moe_dropped (assignments over
    # capacity) and moe_layers (per MoE layer: layer, imbalance, dropped, aux_loss, bias_min, bias_max; the
    # router bias after the step's update); in a row as their own keys, absent without experts
    moe: dict = field(default_factory=dict)


def json_line(row: dict) -> str:
    """A metrics row as strict JSON: a non-finite number (a nan loss) is null, since Python's NaN and
    Infinity are not JSON and strict readers refuse them."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):  # moe_layers' rows
            return {k: finite(v) for k, v in value.items()}
        return [finite(v) for v in value] if isinstance(value, (list, tuple)) else value

    return json.dumps({k: finite(v) for k, v in row.items()}, allow_nan=False)


def step_metrics(step: int, results: list[WorkerStep], cfg: TrainConfig, elapsed: float,
                 driver_cpu_s: float | None = None) -> StepMetrics:
    """One step's figures from the workers' answers (the last stage's ranks report the losses)."""
    losses = [loss for r in results for loss in r.losses]
    flops_per_s = flops_per_token(cfg.model) * cfg.tokens_per_step / elapsed
    peak = peak_tflops(cfg, results[0].device_name)
    return StepMetrics(step, sum(losses) / len(losses) if losses else math.nan, elapsed,
                       cfg.tokens_per_step / elapsed, results[0].grad_norm, [r.peak_memory for r in results],
                       lr=results[0].lr, flops_per_s=flops_per_s,
                       mfu=None if peak is None else flops_per_s / (cfg.world_size * peak * 1e12),
                       control_s=_control_s(results, elapsed),
                       cpu_per_rank=None if any(r.cpu_s is None for r in results) else
                       [r.cpu_s / elapsed for r in results],
                       driver_cpu=None if driver_cpu_s is None else driver_cpu_s / elapsed,
                       moe=merge_stats([r.moe for r in results], cfg.parallel.dims.replicas),
                       **tensor_bytes_fields(results))


def tensor_bytes_fields(results: list[WorkerStep]) -> dict:
    """StepMetrics' peak_tensor_bytes fields from the ranks' answers (none where a rank did not measure)."""
    got = [r.tensor_bytes for r in results]
    if any(t is None for t in got):
        return {}
    predicted = [t.get("predicted") for t in got]
    return {"peak_tensor_bytes": [t["total"] for t in got], "peak_tensor_bytes_by_kind": [t["by_kind"] for t in got],
            "predicted_peak_bytes": [None if p is None else p["total"] for p in predicted],
            "predicted_peak_bytes_by_kind": [None if p is None else p["by_kind"] for p in predicted]}


def _control_s(results: list[WorkerStep], elapsed: float) -> float | None:
    if any(r.compute_s is None for r in results):
        return None
    return max(0.0, elapsed - max(r.compute_s for r in results))


def peak_tflops(cfg: TrainConfig, device_name: str) -> float | None:
    """One device's peak for this run: --peak-tflops, else the table's (None on CPU and in float64)."""
    if cfg.runtime.peak_tflops is not None:
        return cfg.runtime.peak_tflops
    if device_name == "cpu" or cfg.runtime.dtype != "float32":
        return None
    return device_peak_tflops(device_name, cfg.runtime.precision)


def new_run_dir(root: str = "runs") -> Path:
    path = Path(root) / time.strftime("%Y%m%d-%H%M%S")
    suffix, candidate = 1, path
    while candidate.exists():
        suffix += 1
        candidate = Path(f"{path}-{suffix}")
    candidate.mkdir(parents=True)
    return candidate


CONFIGS_DIR = run_files.CONFIGS


def attempts(run_dir: Path) -> list[int]:
    """The attempts a run directory kept the config of (configs/attempt-N.json), sorted."""
    names = [p.name[len("attempt-"):-len(".json")] for p in (Path(run_dir) / CONFIGS_DIR).glob("attempt-*.json")]
    return sorted(int(n) for n in names if n.isdigit())


class RunLog:
    """An attempt at a run, in its directory: its config and plan at the start, a metrics.jsonl line per step
    (flushed, so a crash keeps them); with TensorBoard installed (it is no dependency), the same figures as
    event files in the run directory, and with --wandb PROJECT in a Weights & Biases run.

    A run directory holds one run, attempt after attempt: the fresh run is attempt 1, each --resume into it
    or start again there (--resume auto without a checkpoint, a restart) the next (a resume into a new
    directory is attempt 2). Every metrics.jsonl row names its attempt; the rows of the steps after
    `first_step` (where this attempt goes on from) that earlier attempts wrote are marked "abandoned" as it
    opens, and readers skip them (pipegpt.run_files.read_metrics). Each attempt's config is kept as
    configs/attempt-N.json; config.json and plan.txt are the latest attempt's, the layout trace.json was
    measured in. Each is written whole or not at all (a full disk leaves no empty file)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, plan: Plan, first_step: int = 0):
        self.run_dir = Path(run_dir)
        configs = self.run_dir / CONFIGS_DIR
        earlier = attempts(self.run_dir)
        in_rows = settle_metrics(self.run_dir / run_files.METRICS, first_step)
        if cfg.checkpoint.resume is None:
            self.attempt = max([0, in_rows, *earlier]) + 1
        else:
            if not earlier and (self.run_dir / run_files.CONFIG).is_file():  # a run from before configs/ was kept
                configs.mkdir(exist_ok=True)
                run_files.write_whole(self.run_dir / run_files.attempt_config(1),
                                      (self.run_dir / run_files.CONFIG).read_text())
                earlier = [1]
            self.attempt = max([1, in_rows, *earlier]) + 1
        text = json.dumps(asdict(cfg), indent=2, default=str)
        with run_files.writing(configs):
            configs.mkdir(exist_ok=True)
        run_files.write_whole(self.run_dir / run_files.attempt_config(self.attempt), text)
        run_files.write_whole(self.run_dir / run_files.CONFIG, text)
        run_files.write_whole(self.run_dir / run_files.PLAN, dump_schedule_text(plan))
        with run_files.writing(self.run_dir / run_files.METRICS):
            # unbuffered: a failed write leaves nothing pending for close() to fail on again
            self._metrics = open(self.run_dir / run_files.METRICS, "ab", buffering=0)
        self._tensorboard = _tensorboard_writer(self.run_dir)
        self._wandb = _wandb_run(self.run_dir, cfg, self.attempt)

    def step(self, metrics: StepMetrics) -> None:
        row = asdict(metrics)
        row = {"step": row.pop("step"), "attempt": self.attempt, **row}
        row.update(row.pop("moe"))
        data = memoryview((json_line(row) + "\n").encode())
        with run_files.writing(self.run_dir / run_files.METRICS):  # a torn row is cut as the next attempt opens
            while data:
                data = data[self._metrics.write(data):]
        if self._tensorboard is not None:
            for tag, value in tensorboard_scalars(metrics):
                self._tensorboard.add_scalar(tag, value, metrics.step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(dict(tensorboard_scalars(metrics)), step=metrics.step)

    def trace(self, results: list[WorkerStep], plan: Plan, step: int | None = None,
              call: tuple | None = None) -> None:
        """The step's measured timeline as trace.json (Perfetto), the format `simulate --out x.json` writes;
        with a step's number (--trace-steps, from 1), as traces/step-N.json. With --ep, the expert all-to-alls
        are events of their own on each rank (pipegpt.observe.exchanges); the parts of each rank's step outside
        its actions and the driver's `call` (send, receipt, steps) too (pipegpt.observe.step_time)."""
        path = self.run_dir / (run_files.TRACE if step is None else run_files.step_trace(step))
        with run_files.writing(path.parent):
            path.parent.mkdir(exist_ok=True)
        trace = to_chrome_trace(measured_timeline(results, plan))
        if any(r.exchanges for r in results):
            trace["traceEvents"] += trace_events([(r.rank, r.exchanges) for r in results], _first_start(results))
        trace["traceEvents"] += step_parts([(r.rank, r.phases) for r in results], _first_start(results), call)
        run_files.write_whole(path, json.dumps(trace))

    def close(self, plot: bool = True) -> None:
        """plot: redraw plot.svg (not after a failed write: the run's one line says why it stopped)."""
        self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if not plot:
            return
        try:
            write_plot(self.run_dir)  # plot.svg: the loss curve without TensorBoard
        except OSError as e:  # a picture is not worth failing a run that trained
            print(f"pipegpt: plot.svg not written: {e}", file=sys.stderr)


def settle_metrics(path: Path, first_step: int) -> int:
    """metrics.jsonl as an attempt that goes on after `first_step` opens it: a last row cut short (a writer
    killed mid-line) is cut off, so the next row starts a line of its own; the rows of later steps, which this
    attempt does again (an interrupted attempt's steps past its checkpoint, the branch a resume of an older
    checkpoint left), are marked "abandoned". Rewritten whole, only where something changed. Returns the
    highest attempt the rows name (0: no rows)."""
    try:
        lines = Path(path).read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    changed, latest, kept = False, 0, []
    for line in lines:
        try:
            row = json.loads(line)
            step, attempt = int(row["step"]), int(row.get("attempt", 1))
        except (ValueError, TypeError, KeyError, AttributeError):
            changed |= not line.endswith("\n")  # torn: the last line (a whole one always ends in a newline)
            if line.endswith("\n"):
                kept.append(line)  # not a row: readers skip it
            continue
        latest = max(latest, attempt)
        if step > first_step and not row.get("abandoned"):
            line, changed = json_line({**row, "abandoned": True}) + "\n", True
        elif not line.endswith("\n"):  # a whole row whose newline was lost
            line, changed = line + "\n", True
        kept.append(line)
    if changed:
        run_files.write_whole(path, "".join(kept))
    return latest


EVAL_METRICS = ("val_loss", "hellaswag_acc", "hellaswag_acc_norm")


def tensorboard_scalars(metrics: StepMetrics) -> list[tuple[str, float]]:
    """Every number of a metrics row as (tag, value): evaluations under eval/, the rest under train/, a value per
    rank as train/NAME/rankR. Absent (None) and non-finite values are left out, as TensorBoard cannot plot them."""
    out = []
    row = asdict(metrics)
    row.update(row.pop("moe"))
    for layer in row.pop("moe_layers", ()):  # train/moe/layerN/imbalance, ...
        out += [(f"train/moe/layer{layer['layer']}/{key}", float(v)) for key, v in layer.items()
                if key != "layer" and isinstance(v, (int, float)) and math.isfinite(v)]
    for name, value in row.items():
        if name == "step" or isinstance(value, bool):
            continue
        group = "eval" if name in EVAL_METRICS else "train"
        values = [(f"{group}/{name}/rank{r}", v) for r, v in enumerate(value)] if isinstance(value, list) \
            else [(f"{group}/{name}", value)]
        out += [(tag, float(v)) for tag, v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return out


def _tensorboard_writer(run_dir: Path):
    """A SummaryWriter into run_dir if TensorBoard is installed, else None (silently)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(run_dir))


def _first_start(results: list[WorkerStep]) -> float:
    """When the step's first recorded action began: the trace's time 0."""
    return min((start for r in results for _, start, _ in r.events), default=0.0)


def _wandb_run(run_dir: Path, cfg: TrainConfig, attempt: int):
    """--wandb PROJECT: a Weights & Biases run (wandb is no dependency; the config refuses the option without it)
    under the run directory, a W&B run per attempt grouped by the directory; None without --wandb."""
    if cfg.runtime.wandb is None:
        return None
    import wandb

    return wandb.init(project=cfg.runtime.wandb, dir=str(run_dir), group=run_dir.name,
                      name=f"{run_dir.name}-attempt-{attempt}", config=asdict(cfg))


def measured_timeline(results: list[WorkerStep], plan: Plan) -> Timeline:
    """One step's recorded actions from every rank as the Timeline type the simulator produces."""
    t0 = _first_start(results)
    events = [Event(r.rank, Action.parse(name), start - t0, end - t0)
              for r in results for name, start, end in r.events]
    return Timeline(events, len(results), schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=plan.stage_to_rank, time_unit="s", meta={"recorded": True})
