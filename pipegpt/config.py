"""Configuration as frozen dataclasses in sections, every default defined once, checked before any process starts.

TrainConfig = model + parallel (dp x pp x cp x tp, schedule, microbatches) + optim + data + runtime + checkpoint + eval. Fields
with help text are also `pipegpt run` options (pipegpt.options derives them from here). Nothing here imports
torch: `validate()` runs before any worker exists. Every check raises ConfigError with a one-line
message that names the bad value and says what would be valid, so the driver can print it as it is.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Mapping

from pipegpt.dims import AXES, AXIS_FIELDS, Carve, ParallelDims, Sharding, expert_axes
# The model's shape and its layout checks live one layer down; re-exported here, where most callers look.
from pipegpt.model_config import (ARCHS, MODEL_PRESETS, ConfigError, ModelConfig, model_config,  # noqa: F401
                                  nearest_multiples, validate_cp, validate_tp)
from pipegpt.model_config import check_positive_int as _check_positive_int


DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "float64")
RECOMPUTE = ("none", "full", "selective")
ZERO = (0, 1, 2, 3)
UNSHARD = ("step", "microbatch")
TOKENIZERS = ("bytes", "gpt2")
LR_SCHEDULES = ("cosine", "constant")
PRECISIONS = ("fp32", "bf16")
BALANCE = ("even", "cost")
CP_COMM = ("ring", "allgather")
ON_NONFINITE = ("stop", "skip")
P2P_MATCHING = ("auto", "tag", "order")
P2P_GROUPS = ("auto", "pairs", "world")
GLOO_LOOPS = ("batch", "as-is")
COMPILE_TIMEOUT_S = 900.0  # the first steps' timeout under --compile (RuntimeConfig.wait_timeout_s)
COMPILE_STEPS = 2  # steps of a job that may compile: the first, and a recompilation on the second
STEP_TIMEOUT_FACTOR = 10.0  # a step's deadline without --step-timeout, in --timeout's: a step is many waits
FIRST_STEPS_FACTOR = 3.0  # the first COMPILE_STEPS steps' deadline: communicators made, memory and kernels warmed
P2P_DTYPES = ("auto", "bf16", "fp32")
OVERLAP = ("on", "off")


def setting(default, help: str = "", flag: str | None = None, short: str | None = None, choices=None):
    """A config field; with help text it is also a `pipegpt run` option (--name-with-dashes unless flag)."""
    return field(default=default, metadata={"help": help, "flag": flag, "short": short, "choices": choices})


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is laid out over ranks (dp x pp x cp x tp) and how a step is cut into microbatches."""

    stages: int = setting(4, "Pipeline ranks (one worker process each; under torchrun, default "
                             "WORLD_SIZE / (dp x tp)).", short="-p")
    dp: int = setting(1, "Data-parallel replicas.")
    tp: int = setting(1, "Tensor-parallel ranks per stage.")
    cp: int = setting(1, "Context-parallel ranks per stage: each holds 1/cp of every sequence (two chunks, so "
                         "causal attention's work is even).")
    ep: int = setting(1, "Expert-parallel ranks: each MoE layer's experts spread over ep ranks carved out of dp x cp "
                         "(the world unchanged), tokens moved to them and back by all-to-all.")
    cp_comm: str = setting("ring", "With --cp: how attention sees the other ranks' keys and values: a ring of "
                                   "point-to-point blocks overlapped with compute, or one all-gather (Llama 3's).",
                           choices=CP_COMM)
    schedule: str = setting("1f1b", "A schedule from `pipegpt simulate --schedule all`.", short="-s")
    schedule_file: str | None = setting(None, "Train with a schedule written by hand, one line of actions per rank "
                                              "(the format `pipegpt simulate --schedule-file` reads).")
    virtual_stages: int | None = setting(None, "Model chunks per rank (interleaved-1f1b).", short="-v")
    layers_per_stage: tuple[int, ...] | None = setting(None, "Explicit split such as 3,3,2,2 (one entry per model stage).")
    balance: str = setting("even", "How blocks are split over the stages: evenly, or by cost (measured on the workers "
                                   "before step 0: the split that makes the busiest rank's work the least).",
                           choices=BALANCE)
    # With balance=cost, what the run measured (seconds of forward + backward: embedding, one block, head and
    # loss) and so where its layers_per_stage came from; set by the driver, never an option.
    balanced_costs: tuple[float, float, float] | None = None
    max_live: int | None = setting(None, "With --schedule auto or auto-v: the most stage-microbatches' activations "
                                         "a rank may hold at once (default 1F1B's memory: stages x stages per rank).")
    # With schedule auto/auto-v, the measured seconds the order was written for: forward, backward and the
    # backward's weight-gradient part of the embedding, of one block and of the head with its loss (nine
    # numbers); set by the driver, never an option.
    schedule_costs: tuple[float, ...] | None = None
    overlap: str = setting("on", "A schedule's pairs (a forward and a backward of two microbatches run as one "
                                 "action, their pieces in turns, each half's communication under the other's "
                                 "compute): on, or off (each pair's halves one after the other).", choices=OVERLAP)
    microbatches: int = setting(8, "Microbatches per step.", short="-m")
    microbatch_size: int = setting(4, "Sequences per microbatch.")
    recompute: str = setting("none", "Activation recomputation: every block, or only the attention core.",
                             choices=RECOMPUTE)
    zero: int = setting(0, "Shard over the data-parallel replicas (dp x cp): 1 the optimizer state (ZeRO-1), 2 also "
                           "the gradients, 3 also the parameters, gathered by the plan's UNSHARD actions.",
                        choices=ZERO)
    unshard: str | None = setting(None, "With --zero 3: where the plan gathers a stage's parameters: once per step "
                                        "(before its first action, freed after its last; the default) or around "
                                        "each run of its consecutive actions, prefetched one run ahead (two stages "
                                        "gathered at most: least memory).", choices=UNSHARD)
    sequence_parallel: bool = setting(False, "With --tp: shard the LayerNorm/dropout regions along the sequence "
                                             "(Megatron SP).")

    @property
    def expert_carving(self) -> Carve | None:
        """Where ep ranks come from (pipegpt.dims.expert_axes): dp x cp, or dp x cp x tp under sequence
        parallelism (experts then whole on each tp rank); None without expert parallelism."""
        if self.ep == 1:
            return None
        return expert_axes(self.ep, tensor_parallel=not (self.sequence_parallel and self.tp > 1))

    @property
    def dims(self) -> ParallelDims:
        dims = ParallelDims(**{axis: getattr(self, name) for axis, name in AXIS_FIELDS.items()})
        return dims if self.expert_carving is None else dims.carve(self.expert_carving)

    @property
    def sharding(self) -> Sharding:
        return Sharding(*self.dims.sizes, sequence_parallel=self.sequence_parallel, zero=self.zero,
                        carved=self.dims.carved)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with decoupled weight decay on matrices, and global-norm gradient clipping."""

    lr: float = setting(1e-3, "Learning rate.")
    weight_decay: float = setting(0.1, "AdamW weight decay (matrices only).")
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = setting(1.0, "Global gradient-norm clip (0: off).")
    warmup_steps: int = setting(0, "Steps of linear learning-rate warmup, lr*(step+1)/(warmup+1), as nanoGPT.")
    min_lr: float | None = setting(None, "Learning rate the cosine schedule decays to at the end of the run "
                                         "(default: lr/10).")
    lr_schedule: str = setting("cosine", "After warmup: cosine decay from lr to min-lr over the run's steps, "
                                         "or constant lr.", choices=LR_SCHEDULES)
    on_nonfinite: str = setting("stop", "A non-finite loss or gradient norm: stop the run before the update is "
                                        "applied (no checkpoint from it), or skip that step's update and go on "
                                        "(counted in metrics.jsonl as skipped_steps).", choices=ON_NONFINITE)
    max_skipped_steps: int = setting(5, "With --on-nonfinite skip: stop the run (exit 1, its last checkpoint kept) "
                                        "once this many steps in a row were skipped (0: never stop).")

    @property
    def final_lr(self) -> float:
        """The learning rate cosine decay ends at: min_lr, or a tenth of lr when not set (nanoGPT's choice)."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


@dataclass(frozen=True)
class DataConfig:
    data: str | None = setting(None, "Tokens: a `pipegpt prepare` directory, nanoGPT's train.bin/val.bin, "
                                               "llm.c shards or one flat uint16 file (default: built-in corpus).")
    tokenizer: str = setting("bytes", "bytes (vocabulary 256, offline), gpt2 (tiktoken BPE) or the path of a Hugging "
                                      "Face tokenizer.json (the tokenizers library, offline).")
    document_mask: bool = setting(False, "Packed data: attention stays within each document (a document ends at the "
                                         "tokenizer's end-of-text token).")
    position_reset: bool = setting(False, "With --document-mask: positions restart at 0 at each document.")


@dataclass(frozen=True)
class RuntimeConfig:
    steps: int = setting(100, "Training steps.")
    seed: int = setting(1337, "Seed of the initial weights and of the batches.")
    device: str = setting("auto", "auto: CUDA when every rank on this machine has a GPU.", choices=DEVICES)
    dtype: str = setting("float32", "Parameters and activations (float64: for exact comparisons on CPU).",
                         choices=DTYPES)
    timeout_s: float = setting(60.0, "Seconds any wait may take before the job is brought down.", flag="--timeout")
    step_timeout_s: float | None = setting(None, "Seconds a whole step may take before the job is brought down "
                                                 "(default: 10 x --timeout; the first two steps get 3 times as "
                                                 "long). Each wait inside a step keeps --timeout.",
                                           flag="--step-timeout")
    steps_per_call: int | str = setting("auto", "Training steps the driver asks of the workers in one call: one RPC "
                                                "round trip (about 1 ms on a CPU host) for them all, as Keras' "
                                                "steps_per_execution. auto: one a call, and after 10 steps as many "
                                                "as bring the round trip under 0.5% of the time, where it costs 2% "
                                                "or more (steps of a few ms; GPU-sized steps stay at one), a call "
                                                "lasting at most 0.5 s. Each step keeps its metrics row. A call ends "
                                                "early where an evaluation, checkpoint, snapshot or profile is due, "
                                                "and the first two steps run one a call.")
    threads_per_worker: int | None = setting(None, "Intra-op threads per worker (default: the cores this process "
                                                   "may use / ranks).")
    bind_cores: bool = setting(False, "Pin each worker on this machine to cores of its own (local rank r with t "
                                      "threads: the t cores from r x t among those this process may use), as "
                                      "DeepSpeed's --bind_cores_to_rank: no rank migrates or shares a core. "
                                      "Needs ranks x threads cores; leave it off when two jobs share a machine.")
    precision: str = setting("fp32", "bf16: autocast each stage's forward to bfloat16, weights and optimizer state "
                                     "stay fp32. fp32 on CUDA means TF32 matmuls (as nanoGPT).", choices=PRECISIONS)
    compile: bool = setting(False, "torch.compile each stage's module (split-backward schedules then compute the "
                                   "weight gradients together with the input gradients).")
    peak_tflops: float | None = setting(None, "Peak TFLOPS of one device for MFU (default: looked up by GPU name "
                                              "and precision; none on CPU).")
    trace_steps: str = setting("last", "Steps whose measured timeline goes to traces/step-N.json: last, all, or "
                                       "step numbers such as 3,7,10 (from 1, as every step number). trace.json "
                                       "is always the last step's; other steps record nothing.")
    profile: bool = setting(False, "Run py-spy on every worker over the traced steps (first to last): a flame graph "
                                   "per rank, profiles/rank-N.svg and profiles/rank-N.speedscope.json.")
    wandb: str | None = setting(None, "Also log every metrics row to Weights & Biases, in this project (needs "
                                      "`pip install wandb`; WANDB_MODE=offline keeps it in the run directory).")
    p2p_dtype: str = setting("auto", "Pipeline messages (activations and their gradients between stages): auto is "
                                     "bf16 under --precision bf16, else --dtype. A stage computes in its own "
                                     "dtype whatever its messages carry.", choices=P2P_DTYPES)
    # How point-to-point messages are matched (pipegpt.comm.p2p): "tag" as gloo (host waits, eager sends) or
    # "order" as NCCL (sends in the plan's places, a settle at the end of the step); auto: order on CUDA, tag
    # elsewhere. order on CPU runs the CUDA control path there, for tests. Not an option: only order is right
    # on CUDA, and on CPU tag lets a send go as soon as its tensor exists.
    p2p_matching: str = "auto"
    # Which process groups messages matched by order go on (pipegpt.comm.mesh pair_groups): "pairs", one group a
    # direction of each pair of pipeline neighbours, so that no NCCL stream holds a message behind another lane's;
    # "world", the default group. auto: pairs on CUDA, world elsewhere: gloo's sends do not queue on a stream, and
    # each gloo group brings its own device and loop thread (bench_p2p_matching's interleaved-1f1b, p 4, ran 10%
    # slower on them). pairs on CPU runs the CUDA path's groups there, for tests. NCCL's kernels wait on the GPU, so
    # lanes posted in different orders at their two ends rely on the GPU running them side by side; "world" on a
    # GPU is the way back to one communicator.
    p2p_groups: str = "auto"
    # gloo's event-loop threads (comm/mesh.py batch_gloo_loops): "batch", under SCHED_BATCH, so a peer's message
    # never preempts the stepping thread in the middle of its own write (the loop then spins on the pair's lock
    # until the scheduler's tick, ~4 ms, at every exchange both ranks post at once); "as-is", as torch leaves them,
    # where a message's handling never waits for the stepping thread to block (benchmarks/README.md, bench_host:
    # x0.6-0.77 a step with batch on a host-bound model, x1.03-1.04 on a compute-bound one at a rank a core).
    gloo_loops: str = "batch"

    @property
    def wait_timeout_s(self) -> float:
        """Seconds a wait may take inside the workers and, for the first COMPILE_STEPS steps, a step: with
        --compile the first steps compile (Inductor: minutes on a large model) while the other ranks wait.
        NCCL fixes a group's timeout when it is made, so the workers' waits keep it for the run; the stall
        watchdog still bounds every step after the first."""
        return max(self.timeout_s, COMPILE_TIMEOUT_S) if self.compile else self.timeout_s

    def step_deadline_s(self, first: bool) -> float:
        """Seconds the driver waits for a step's answers: --step-timeout (default 10 x --timeout), apart from the
        communication timeout, since a step is many waits and its compute; the first steps (first=True) get
        FIRST_STEPS_FACTOR times as long (a cold start: NCCL's communicators, the allocator, kernels' tuning),
        and with --compile at least the compile timeout. The stall watchdog still bounds every later step."""
        step = self.step_timeout_s or STEP_TIMEOUT_FACTOR * self.timeout_s
        return max(FIRST_STEPS_FACTOR * step, self.wait_timeout_s) if first else step

    @property
    def message_dtype(self) -> str:
        """The torch dtype name pipeline messages travel in (p2p_dtype resolved)."""
        if self.p2p_dtype == "bf16" or (self.p2p_dtype == "auto" and self.precision == "bf16"):
            return "bfloat16"
        return "float32" if self.p2p_dtype == "fp32" else self.dtype

    def traced_steps(self) -> tuple[int, ...]:
        """The steps --trace-steps names, sorted, as the loop's indices (from 0; ConfigError if it names none
        that this run has)."""
        return trace_step_list(self.trace_steps, self.steps)


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = setting(0, "Save a checkpoint every N steps and after the last (0: never).")
    save_final: bool = setting(True, "Save a checkpoint after the last step (so `pipegpt sample RUN_DIR` works "
                                     "after any run).")
    keep: int = setting(3, "Keep the newest N checkpoints (0: all).")
    resume: str | None = setting(None, "Resume from a checkpoint, or a run directory's latest; any layout. auto: "
                                       "the --run-dir's latest checkpoint if it has one, else start fresh there.")
    init_from: str | None = setting(None, "Start from a checkpoint's weights with a fresh optimizer, at step 0.")
    max_restarts: int = setting(0, "When a worker fails, dies or stalls, restart every worker in the same layout "
                                   "from the run's latest checkpoint (or its start), up to N times.")
    min_ranks: int | None = setting(None, "With --max-restarts: when a rank's device is gone, go on with the ranks "
                                          "that remain if they are at least K, in a layout chosen for them.")
    snapshot_every: int = setting(0, "With --max-restarts: every N steps each rank copies its state (weights, Adam "
                                     "moments, RNG) and writes it to the host's shared memory in the background; a "
                                     "restart takes the newest complete snapshot newer than the last checkpoint "
                                     "(0: never).")


@dataclass(frozen=True)
class EvalConfig:
    eval_every: int = setting(0, "Validation loss every N steps and after the last (0: never).")
    eval_batches: int = setting(4, "Global batches per evaluation (the same ones each time).")
    hellaswag: str | None = setting(None, "HellaSwag jsonl (nanoGPT's format): accuracy at every evaluation, "
                                          "scored on the workers in the run's layout.")


SECTIONS = {"parallel": ParallelConfig, "optim": OptimizerConfig, "data": DataConfig, "runtime": RuntimeConfig,
            "checkpoint": CheckpointConfig, "eval": EvalConfig}


def section_of(name: str) -> str:
    """The section holding the field called `name` (field names are unique across sections)."""
    for section, cls in SECTIONS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return section
    valid = sorted(f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls))
    raise ConfigError(f"unknown setting {name!r}: valid settings are {', '.join(valid)}")


def option_flags(name: str) -> tuple[str, ...]:
    """The `pipegpt run` flags of the setting `name`: its field's flag (--name-with-dashes unless it names
    another), then its short form; a name no section holds is a command-line option of that name."""
    meta = next((f.metadata for cls in SECTIONS.values() for f in dataclasses.fields(cls) if f.name == name), {})
    return tuple(x for x in (meta.get("flag") or "--" + name.replace("_", "-"), meta.get("short")) if x)


@dataclass(frozen=True)
class TrainConfig:
    """One training job: the model, its layout over ranks, the optimizer, the data, the runtime."""

    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    optim: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()

    @classmethod
    def build(cls, model: ModelConfig = ModelConfig(), **settings) -> "TrainConfig":
        """A config from the model and settings named by field (`stages=4, lr=3e-4`), whatever their section."""
        return cls(model=model).replace(**settings)

    def replace(self, **settings) -> "TrainConfig":
        """This config with settings changed by field name (`model=` replaces the model)."""
        changes: dict[str, dict] = {}
        for name, value in settings.items():
            if name == "model":
                continue
            changes.setdefault(section_of(name), {})[name] = value
        sections = {s: dataclasses.replace(getattr(self, s), **c) for s, c in changes.items()}
        return dataclasses.replace(self, model=settings.get("model", self.model), **sections)

    @property
    def world_size(self) -> int:
        return self.parallel.dims.world_size

    @property
    def batch_size(self) -> int:
        """Sequences per step across all data-parallel replicas."""
        p = self.parallel
        return p.dp * p.microbatches * p.microbatch_size

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    def validate(self, env: Mapping[str, str] | None = None) -> "TrainConfig":
        """Every check that needs no process, no plan and no torch. With env (os.environ), also the world
        size torchrun started, if it did."""
        self.model.validate()
        p, o, r = self.parallel, self.optim, self.runtime
        for name in ("stages", "dp", "cp", "tp", "ep", "microbatches", "microbatch_size"):
            _check_positive_int(name, getattr(p, name))
        _check_positive_int("steps", r.steps)
        per_call = r.steps_per_call
        if per_call != "auto" and (isinstance(per_call, bool) or not isinstance(per_call, int) or per_call < 1):
            raise ConfigError(f"steps_per_call={per_call!r} must be a positive integer (>= 1) or auto")
        for name, value in (("virtual_stages", p.virtual_stages), ("threads_per_worker", r.threads_per_worker)):
            if value is not None:  # None: the default (the schedule's, cores / ranks)
                _check_positive_int(name, value)
        _check_choice("recompute", p.recompute, RECOMPUTE)
        _check_choice("overlap", p.overlap, OVERLAP)
        _check_choice("device", r.device, DEVICES)
        _check_choice("dtype", r.dtype, DTYPES)
        check_tokenizer_name(self.data.tokenizer)
        if self.data.position_reset and not self.data.document_mask:
            raise ConfigError("--position-reset restarts positions at document boundaries: give --document-mask too")
        if self.data.document_mask and self.data.tokenizer == "bytes":
            raise ConfigError("--document-mask finds documents by the end-of-text token, and the bytes tokenizer has "
                              "none: use --tokenizer gpt2 or a tokenizer.json with one")
        _check_choice("zero", p.zero, ZERO)
        if p.zero >= 1 and p.dims.replicas == 1:
            raise ConfigError(f"--zero {p.zero} shards over the data-parallel replicas, and dp x cp = 1: nothing to "
                              f"shard: give --dp 2 or more, or --zero 0")
        if p.unshard is not None:
            _check_choice("unshard", p.unshard, UNSHARD)
            if p.zero < 3:
                raise ConfigError(f"--unshard {p.unshard} places ZeRO-3's parameter gathers, and --zero is {p.zero}: "
                                  f"give --zero 3 or leave --unshard out")
        for name in ("lr", "weight_decay", "grad_clip", "min_lr"):  # inf or nan would train on in nan
            value = getattr(o, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ConfigError(f"{name}={value!r} must be a finite number ({'> 0' if name == 'lr' else '>= 0'})")
        _check_choice("on_nonfinite", o.on_nonfinite, ON_NONFINITE)
        if o.max_skipped_steps < 0:
            raise ConfigError(f"--max-skipped-steps {o.max_skipped_steps} must be 0 (never stop) or more")
        for name, value in (("lr", o.lr), ("timeout_s", r.timeout_s)):
            if not value > 0:
                raise ConfigError(f"{name}={value} must be > 0")
        if r.step_timeout_s is not None and not r.step_timeout_s >= r.timeout_s:
            raise ConfigError(f"step_timeout_s={r.step_timeout_s} must be at least timeout_s={r.timeout_s}: a step is "
                              f"many waits, each bounded by --timeout (leave --step-timeout out for "
                              f"{STEP_TIMEOUT_FACTOR:g} x --timeout)")
        if o.grad_clip < 0 or o.weight_decay < 0:
            raise ConfigError("grad_clip and weight_decay must be >= 0")
        _check_choice("lr_schedule", o.lr_schedule, LR_SCHEDULES)
        if isinstance(o.warmup_steps, bool) or not isinstance(o.warmup_steps, int) or o.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={o.warmup_steps!r} must be an integer >= 0")
        if o.min_lr is not None and not 0 <= o.min_lr <= o.lr:
            raise ConfigError(f"min_lr={o.min_lr} must be in [0, lr={o.lr}] (default lr/10)")
        _check_choice("precision", r.precision, PRECISIONS)
        _check_choice("p2p_matching", r.p2p_matching, P2P_MATCHING)
        _check_choice("p2p_groups", r.p2p_groups, P2P_GROUPS)
        _check_choice("gloo_loops", r.gloo_loops, GLOO_LOOPS)
        _check_choice("p2p_dtype", r.p2p_dtype, P2P_DTYPES)
        if r.p2p_matching == "tag" and r.device == "cuda":
            raise ConfigError("p2p_matching='tag' needs gloo: NCCL matches point-to-point messages by order "
                              "(use auto or order)")
        if r.precision == "bf16" and r.dtype != "float32":
            raise ConfigError(f"precision=bf16 keeps float32 master weights: use it with dtype=float32, "
                              f"not {r.dtype}")
        if r.peak_tflops is not None and not r.peak_tflops > 0:
            raise ConfigError(f"peak_tflops={r.peak_tflops} must be > 0 (or left out)")
        if r.wandb is not None and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"wandb={r.wandb!r} needs Weights & Biases, which is not installed: pip install wandb "
                              f"(or leave out --wandb)")
        r.traced_steps()
        if not isinstance(r.profile, bool):
            raise ConfigError(f"profile={r.profile!r} must be True or False")
        if p.sequence_parallel and p.tp == 1:
            raise ConfigError("sequence parallelism shards along the sequence across tensor-parallel ranks: "
                              "use it with --tp 2 or more")
        validate_ep(self.model, p)
        validate_tp(self.model, p.tp, p.sequence_parallel, p.cp)
        validate_cp(self.model, p.cp)
        _check_choice("cp_comm", p.cp_comm, CP_COMM)
        c, e = self.checkpoint, self.eval
        for name in ("eval_every", "eval_batches"):
            value = getattr(e, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "eval_every" else 1):
                raise ConfigError(f"{name}={value!r} must be an integer >= {0 if name == 'eval_every' else 1}")
        if isinstance(c.save_every, bool) or not isinstance(c.save_every, int) or c.save_every < 0 or c.keep < 0:
            raise ConfigError(f"save_every={c.save_every} and keep={c.keep} must be integers >= 0")
        if isinstance(c.max_restarts, bool) or not isinstance(c.max_restarts, int) or c.max_restarts < 0:
            raise ConfigError(f"max_restarts={c.max_restarts!r} must be an integer >= 0")
        if c.min_ranks is not None:
            if not c.max_restarts:
                raise ConfigError(f"--min-ranks {c.min_ranks} says how few ranks a restart may go on with: give "
                                  f"--max-restarts N too")
            if not 1 <= c.min_ranks <= self.world_size:
                raise ConfigError(f"min_ranks={c.min_ranks} must be between 1 and this job's {self.world_size} ranks "
                                  f"({' x '.join(AXES)})")
        if isinstance(c.snapshot_every, bool) or not isinstance(c.snapshot_every, int) or c.snapshot_every < 0:
            raise ConfigError(f"snapshot_every={c.snapshot_every!r} must be an integer >= 0")
        if c.snapshot_every and not c.max_restarts:
            raise ConfigError(f"--snapshot-every {c.snapshot_every} keeps snapshots for restarts: give --max-restarts N "
                              f"too")
        if c.max_restarts and env is not None and under_torchrun(env):
            raise ConfigError("under torchrun the restarts are torchrun's: give torchrun --max-restarts N and "
                              "pipegpt run --resume auto, and leave out --max-restarts")
        if c.resume is not None and c.init_from is not None:
            raise ConfigError("give --resume (weights, optimizer, step, data position) or --init-from (weights "
                              "only, step 0), not both")
        _check_choice("balance", p.balance, BALANCE)
        if p.balance == "cost" and p.layers_per_stage is not None and p.balanced_costs is None:
            raise ConfigError(f"--balance cost chooses the layers per stage from measured costs: leave out "
                              f"--layers-per-stage {','.join(map(str, p.layers_per_stage))}, or use --balance even")
        if p.schedule_file is not None and p.virtual_stages is not None:
            raise ConfigError("--virtual-stages does not apply to --schedule-file (the file fixes the stages)")
        if env is not None and under_torchrun(env) and int(env["WORLD_SIZE"]) != self.world_size:
            raise ConfigError(f"torchrun started {env['WORLD_SIZE']} processes but {' x '.join(AXES)} = "
                              f"{' x '.join(map(str, p.dims.sizes))} = {self.world_size}")
        local = env.get("LOCAL_WORLD_SIZE") if env is not None and under_torchrun(env) else None
        if local is not None and int(local) % p.tp:
            # tp ranks are consecutive (pipegpt.comm.mesh): a group crossing nodes would run its collectives
            # (every layer, forward and backward) over the network.
            fits = [t for t in range(1, int(local) + 1) if int(local) % t == 0]
            raise ConfigError(f"--tp {p.tp} does not divide the {local} processes per node (LOCAL_WORLD_SIZE): "
                              f"a tensor-parallel group must stay on one node; use --tp {', '.join(map(str, fits))}")
        return self


def validate_ep(model: ModelConfig, p: ParallelConfig) -> None:
    """--ep spreads a MoE model's experts evenly over ranks carved out of dp x cp (x tp under sequence
    parallelism): one line naming what does not fit."""
    if p.ep == 1:
        return
    if not model.n_experts:
        raise ConfigError(f"--ep {p.ep} spreads experts over ranks, and the model has none: give --n-experts, or "
                          f"leave --ep out")
    if model.n_experts % p.ep:
        fits = [e for e in range(1, model.n_experts + 1) if model.n_experts % e == 0]
        raise ConfigError(f"--ep {p.ep} does not divide the {model.n_experts} experts: use --ep "
                          f"{', '.join(map(str, fits))}")
    carving = p.expert_carving
    span = math.prod(getattr(p, AXIS_FIELDS[a]) for a in carving.over)
    if span % p.ep:
        over = " x ".join(carving.over)
        raise ConfigError(f"--ep {p.ep} is carved out of {over} = {span} and does not divide it: give --ep a "
                          f"divisor of {span}, or more {over}")


def trace_step_list(text, steps: int) -> tuple[int, ...]:
    """'last', 'all' or comma-separated step numbers (from 1, as the console, metrics.jsonl and checkpoint names
    count; 'last' may be one of them) -> the loop's indices of those steps (from 0), sorted."""
    words = [w.strip().lower() for w in str(text).split(",")] if isinstance(text, str) else []
    try:
        if words == ["all"]:
            return tuple(range(steps))
        chosen = {steps if w == "last" else int(w) for w in words}
    except ValueError:
        chosen = set()
    if not chosen:
        raise ConfigError(f"trace_steps={text!r} must be last, all, or comma-separated step numbers such as "
                          f"{'1,' if steps > 1 else ''}{steps} (counted from 1)")
    outside = sorted(s for s in chosen if not 1 <= s <= steps)
    if outside:
        raise ConfigError(f"trace_steps={text!r}: step {outside[0]} is not in this run, whose steps are 1 to "
                          f"{steps} (steps={steps})")
    return tuple(sorted(s - 1 for s in chosen))


def is_tokenizer_file(name) -> bool:
    """A tokenizer named by the path of a Hugging Face tokenizer.json rather than by a built-in name."""
    return isinstance(name, str) and name not in TOKENIZERS and name.endswith(".json")


def canonical_tokenizer(name):
    """The name checkpoints and data remember: a built-in name as it is, a tokenizer.json by its absolute path
    (so a run started elsewhere, or its resume, finds the same file)."""
    return str(Path(name).expanduser().resolve()) if is_tokenizer_file(name) else name


def check_tokenizer_name(name) -> None:
    if name not in TOKENIZERS and not is_tokenizer_file(name):
        raise ConfigError(f"tokenizer={name!r} is not one of {', '.join(TOKENIZERS)} nor the path of a Hugging Face "
                          f"tokenizer.json")


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, choices))}")


def under_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torchrun started this process (its variables are in env)."""
    return "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(env)


def usable_cores() -> int:
    """The cores this process may run on: its affinity (taskset, a container's or a batch scheduler's cpuset), not
    the machine's count (by which 2 workers pinned to 2 of 16 cores got 8 threads each)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def microbatch_size_for(batch_size: int, dp: int, microbatches: int) -> int:
    """Sequences per microbatch for a global batch, or a ConfigError naming the nearest valid batches."""
    per_step = dp * microbatches
    if batch_size < 1 or batch_size % per_step:
        raise ConfigError(f"batch-size={batch_size} does not split into dp x microbatches = {dp} x {microbatches} "
                          f"equal microbatches: use a multiple of {per_step} such as "
                          f"{nearest_multiples(batch_size, per_step)}")
    return batch_size // per_step
