"""What a run leaves behind: its directory, config.json, plan.txt (the lowered plan every rank ran, in the
schedule-file format), metrics.jsonl (a line per step), trace.json (the last step's measured timeline), traces/step-N.json (those of
--trace-steps)."""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.schedule.actions import Action, Plan
from pipegpt.schedule.render import to_chrome_trace
from pipegpt.schedule.schedule_file import dump_schedule_text
from pipegpt.schedule.simulate import Event, Timeline


@dataclass
class StepMetrics:
    step: int
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
    control_s: float | None = None  # step_time_s minus the slowest worker's step(): the RPC round trip and pickling
    cpu_per_rank: list[float] | None = None  # each worker process's CPU time in its step() / step_time_s (1.0: a core)
    driver_cpu: float | None = None  # the driver's CPU time during the step / step_time_s


def step_metrics(step: int, results: list[dict], cfg: TrainConfig, elapsed: float,
                 driver_cpu_s: float | None = None) -> StepMetrics:
    """One step's figures from the workers' answers (the last stage's ranks report the losses)."""
    losses = [loss for r in results for loss in r["losses"]]
    flops_per_s = flops_per_token(cfg.model) * cfg.tokens_per_step / elapsed
    peak = peak_tflops(cfg, results[0].get("device_name", "cpu"))
    return StepMetrics(step, sum(losses) / len(losses) if losses else math.nan, elapsed,
                       cfg.tokens_per_step / elapsed, results[0]["grad_norm"], [r["peak_memory"] for r in results],
                       lr=results[0].get("lr"), flops_per_s=flops_per_s,
                       mfu=None if peak is None else flops_per_s / (cfg.world_size * peak * 1e12),
                       control_s=_control_s(results, elapsed),
                       cpu_per_rank=[r["cpu_s"] / elapsed for r in results] if all("cpu_s" in r for r in results) else None,
                       driver_cpu=None if driver_cpu_s is None else driver_cpu_s / elapsed)


def _control_s(results: list[dict], elapsed: float) -> float | None:
    if not all("compute_s" in r for r in results):
        return None
    return max(0.0, elapsed - max(r["compute_s"] for r in results))


def matmul_parameters(model: ModelConfig) -> int:
    """N of nanoGPT's FLOPs estimate: every parameter but the position embedding, the LM head (the padded
    vocabulary's rows) counted once, tied or not (an untied token embedding is a lookup, not a matmul)."""
    C, L, V = model.n_embd, model.n_layer, model.padded_vocab_size
    norm = 2 * C if model.bias else C  # a LayerNorm's gain (and bias)
    biases = 3 * C + C + 4 * C + C if model.bias else 0  # qkv, attention proj, fc, mlp proj
    block = 2 * norm + 12 * C * C + biases
    return L * block + norm + V * C


def flops_per_token(model: ModelConfig) -> int:
    """Training FLOPs per token as nanoGPT (PaLM appendix B) counts them: 6N for the forward and backward
    matmuls of N parameters, plus 12*L*H*Q*T for attention's scores and weighted sum over T positions
    (H heads of dimension Q). Recomputation is not counted: MFU counts the model's FLOPs, not the hardware's."""
    return 6 * matmul_parameters(model) + 12 * model.n_layer * model.n_head * model.head_dim * model.seq_len


# Peak dense TFLOPS of one GPU (no 2:4 structured sparsity: where a datasheet gives only the sparse figure,
# it is halved), by a pattern on torch.cuda.get_device_name(). "bf16": BF16 tensor cores with FP32
# accumulation. "fp32": what precision=fp32 runs its matmuls on, TF32 tensor cores (the worker enables TF32
# on CUDA, as nanoGPT), except on the V100, which has no TF32 (and no BF16) tensor cores: plain FP32.
# Sources: NVIDIA's datasheets for H100 (SXM, PCIe, NVL), H200 (SXM, NVL), A100, L4, A10 and V100, and
# the Ada Lovelace architecture whitepaper (appendix, GeForce RTX 4090). The A10G is AWS's A10 variant,
# with no datasheet of its own: the A10's figures are used. --peak-tflops overrides this table.
PEAK_TFLOPS: list[tuple[str, float | None, float]] = [  # (pattern, bf16, fp32); the first match wins
    (r"H100.*NVL", 835.5, 417.5),
    (r"H100.*PCIE", 756.5, 378.0),
    (r"H100", 989.5, 494.5),
    (r"H200.*NVL", 835.5, 417.5),
    (r"H200", 989.5, 494.5),
    (r"A100", 312.0, 156.0),
    (r"\bL4\b", 121.0, 60.0),
    (r"\bA10G?\b", 125.0, 62.5),
    (r"V100S", None, 16.4),
    (r"V100.*PCIE", None, 14.0),
    (r"V100", None, 15.7),
    (r"RTX 4090", 165.2, 82.6),
]


def device_peak_tflops(device_name: str, precision: str) -> float | None:
    """One device's peak TFLOPS at `precision` ("bf16" or "fp32") from PEAK_TFLOPS; None if not listed."""
    for pattern, bf16, fp32 in PEAK_TFLOPS:
        if re.search(pattern, device_name.upper()):
            return bf16 if precision == "bf16" else fp32
    return None


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


class RunLog:
    """config.json and plan.txt at the start, a metrics.jsonl line per step (flushed, so a crash keeps them);
    with TensorBoard installed (it is no dependency), the same figures as event files in the run directory."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, plan: Plan):
        self.run_dir = Path(run_dir)
        (self.run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
        (self.run_dir / "plan.txt").write_text(dump_schedule_text(plan))
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")
        self._tensorboard = _tensorboard_writer(self.run_dir)

    def step(self, metrics: StepMetrics) -> None:
        self._metrics.write(json.dumps(asdict(metrics)) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "flops_per_s", "mfu"):
                value = getattr(metrics, name)
                if value is not None and math.isfinite(value):
                    self._tensorboard.add_scalar(f"train/{name}", value, metrics.step)
            self._tensorboard.flush()

    def trace(self, results: list[dict], plan: Plan, step: int | None = None) -> None:
        """The step's measured timeline as trace.json (Perfetto), the format `simulate --out x.json` writes;
        with a step number (--trace-steps), as traces/step-N.json."""
        path = self.run_dir / "trace.json" if step is None else self.run_dir / "traces" / f"step-{step}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(to_chrome_trace(measured_timeline(results, plan))))

    def close(self) -> None:
        self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _tensorboard_writer(run_dir: Path):
    """A SummaryWriter into run_dir if TensorBoard is installed, else None (silently)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(run_dir))


def measured_timeline(results: list[dict], plan: Plan) -> Timeline:
    """One step's recorded actions from every rank as the Timeline type the simulator produces."""
    t0 = min((start for r in results for _, start, _ in r["events"]), default=0.0)
    events = [Event(r["rank"], Action.parse(name), start - t0, end - t0)
              for r in results for name, start, end in r["events"]]
    return Timeline(events, len(results), schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=plan.stage_to_rank, time_unit="s")
