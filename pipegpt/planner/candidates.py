"""What the planner is asked, what it weighs and what it answers: the request, the layouts and candidates it
searches (with the ZeRO levels a candidate may take), a plan with its predictions, and a layout refused for memory.
Pure data: pipegpt.planner.search fills them, pipegpt.planner.report prints them."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Mapping

from pipegpt.config import ConfigError, ModelConfig, option_flags
from pipegpt.model_config import MOE_FLAG_FIELDS
from pipegpt.dims import AXES, LAYOUT_FIELDS, ParallelDims, Sharding
from pipegpt.schedule import SCHEDULES
from pipegpt.schedule.simulate import Costs

from pipegpt.costs import memory as memory_model
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import Cluster
from pipegpt.costs.experts import carve, expert_ranks

MAX_ACTIONS = 60_000  # compute actions per plan: larger plans are not simulated


@dataclass(frozen=True)
class Request:
    model: ModelConfig
    batch_size: int  # sequences per step, all replicas together
    cluster: Cluster
    costs: AnalyticalCosts
    top: int = 5
    explain: bool = False
    # auto and auto-v when named: all would synthesize a plan per (p, m), too slow at thousands of microbatches
    schedules: tuple = tuple(name for name, spec in SCHEDULES.items() if not spec.synthesized and not spec.for_overlap)
    exact_gpus: bool = False  # only layouts using every GPU
    only: Mapping[str, int] = field(default_factory=dict)  # axis (pipegpt.dims.AXES, or ep) -> its only size searched
    cp_comm: str | None = None  # how K/V travel with cp > 1 (None: both are weighed)
    zero: int | None = None  # only this ZeRO level (None: 0-3, whichever is fastest and fits)


# ---------------------------------------------------------------------------------------------------------
# what the search weighs


@dataclass(frozen=True)
class LayoutChoice:
    """A layout the search expands: its axes (pipegpt.dims), with what that tp asks of the model."""

    sharding: Sharding  # sequence parallelism taken whenever validate_tp allows it (see pipegpt.planner.search)
    model: ModelConfig  # as it runs on this tp (vocabulary padded to 64 where tp needs it)
    pad_vocab: bool  # model is the request's with its vocabulary padded
    cp_comm: str = "ring"  # how K/V travel with cp > 1

    @property
    def dims(self) -> ParallelDims:
        return self.sharding.dims


@dataclass(frozen=True, slots=True)
class Candidate:
    """One plan to check and simulate, as the search queues it: its microbatches follow (batch / (dp x
    microbatch_size)), its layer split too (the even one, or the balanced one), and its ZeRO level (with
    ZeRO-3's unshard policy) is the faster choice that fits."""

    sharding: Sharding  # its layout's (ZeRO still undecided: 0)
    pad_vocab: bool
    schedule: str
    v: int | None  # the schedule's virtual-stages argument (None: the schedule's own)
    virtual_stages: int  # model stages per rank
    microbatch_size: int
    recompute: str
    balanced: bool
    cp_comm: str = "ring"
    per_block: bool = False  # weighed under ZeRO-3's microbatch policy only (FSDP per block)

    @property
    def dims(self) -> ParallelDims:
        return self.sharding.dims

    @property
    def family(self) -> Candidate:
        """The candidate whatever its recomputation: once one of a family fits, a heavier one is only slower."""
        return replace(self, recompute="")


@lru_cache(maxsize=None)
def zero_choices(sharding: Sharding, only: int | None = None, stages_per_rank: int = 1,
                 per_block: bool = False) -> dict:
    """{(ZeRO level, unshard policy): the sharding at that level}: levels 0-3 where dp x cp > 1 (ZeRO shards over
    both), else 0; only `only` with plan --zero. Level 3 under both policies, microbatch only where a rank holds
    more than two stages (with one or two its stages are all gathered at the peak either way); per_block
    candidates (pipegpt.planner.search.Search.groups) only ZeRO-3 under the microbatch policy."""
    sharded = memory_model.gradient_group(sharding) > 1
    levels = (0, 1, 2, 3) if sharded else (0,)
    if only is not None:
        levels = (only,) if only in levels or not sharded and only == 0 else ()
    out = {}
    for z in levels:
        for policy in (("step", "microbatch") if z == 3 and stages_per_rank > 2 else ("step",)):
            if not per_block or (z, policy) == (3, "microbatch"):
                out[(z, policy)] = sharding._replace(zero=z)
    return out


def zero_name(zero: int, unshard: str) -> str:
    return f"ZeRO-{zero}{' (unshard microbatch)' if unshard == 'microbatch' else ''}, " if zero else ""


# ---------------------------------------------------------------------------------------------------------
# what a plan is


@dataclass(frozen=True)
class Layout:
    """Everything `pipegpt run` needs to run one plan (see command())."""

    dp: int
    pp: int
    tp: int
    schedule: str
    virtual_stages: int  # model stages per rank (1, or the schedule's)
    microbatches: int
    microbatch_size: int
    recompute: str = "none"
    zero: int = 0
    sequence_parallel: bool = False
    layers_per_stage: tuple = ()
    balanced: bool = False  # layers_per_stage from balance.py rather than the even split
    pad_vocab: bool = False
    cp: int = 1
    cp_comm: str = "ring"  # how K/V travel with cp > 1
    unshard: str | None = None  # ZeRO-3's gather policy when not the run's default (step): "microbatch"
    ep: int = 1  # expert parallelism, carved out of dp x cp x tp (pipegpt.costs.experts)

    @property
    def sharding(self) -> Sharding:
        return carve(Sharding(*(getattr(self, axis) for axis in AXES), sequence_parallel=self.sequence_parallel,
                              zero=self.zero), self.ep)

    @property
    def unshard_policy(self) -> str:
        return self.unshard or "step"

    @property
    def world(self) -> int:
        return self.sharding.world_size

    @property
    def mesh_name(self) -> str:
        """dp4 pp16 cp16(ring) tp8 sp (cp and how K/V travel only when cp > 1)."""
        sp = " sp" if self.sequence_parallel else ""
        return mesh_name(self.sharding, {"cp": self.cp_comm}) + sp

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def takes_virtual_stages(self) -> bool:
        return SCHEDULES[self.schedule].takes_virtual_stages

    def short(self) -> str:
        v = f" v{self.virtual_stages}" if self.takes_virtual_stages else ""
        return (f"{self.mesh_name} {self.schedule}{v} "
                f"m{self.microbatches}x{self.microbatch_size} rc={self.recompute} zero{self.zero}"
                + (f" unshard={self.unshard}" if self.unshard else "") + (" balanced" if self.balanced else ""))

    def settings(self) -> dict:
        """The run settings (config fields: pipegpt.dims.LAYOUT_FIELDS) that build this plan: virtual stages where
        the schedule takes them, the split where it is not the run's even one (None: the run's default)."""
        told = {"virtual_stages": self.virtual_stages if self.takes_virtual_stages else None,
                "layers_per_stage": tuple(self.layers_per_stage) if self.balanced else None}
        return {f.name: told.get(f.name, getattr(self, f.planned)) for f in LAYOUT_FIELDS if f.planned}

    def run_args(self, model: ModelConfig, precision: str) -> list[str]:
        """The `pipegpt run` arguments (as that command spells them) that build this plan (--cp and --cp-comm
        only with cp > 1, --ep only with ep > 1: a command without them reads as it did before they existed)."""
        args = model_args(model, self.pad_vocab)
        for name, value in self.settings().items():
            if (name in ("cp", "cp_comm") and self.cp == 1) or (name == "ep" and self.ep == 1):
                continue
            flag = option_flags(name)[0]
            if value is True:
                args.append(flag)
            elif value is not None and value is not False:  # None and False: the run's default
                args += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
        return args + ["--precision", precision]

    def command(self, model: ModelConfig, precision: str) -> str:
        return "pipegpt run " + " ".join(self.run_args(model, precision))


SHAPE_FLAGS = {"n_layer": "--n-layer", "n_embd": "--n-embd", "n_head": "--n-head", "seq_len": "--seq-len",
               "vocab_size": "--vocab-size"}  # the shape's options


def model_args(model: ModelConfig, pad_vocab: bool = False) -> list[str]:
    """The `pipegpt run` model flags that build exactly this model: a preset's name, or its shape; then
    --no-tie-embeddings and --pad-vocab (padding to 64) as they apply. pad_vocab: the plan pads."""
    from pipegpt.config import MODEL_PRESETS

    if model.pad_vocab_to not in (1, 64):
        raise ConfigError(f"pad_vocab_to={model.pad_vocab_to}: `pipegpt run` pads only to 64 (--pad-vocab)")
    norm = lambda m: replace(m, pad_vocab_to=1, tie_embeddings=True)  # noqa: E731
    core = norm(model)
    arch_fields = {"n_kv_head": "--n-kv-head", "ffn_hidden": "--ffn-hidden", "rope_theta": "--rope-theta",
                   "norm_eps": "--norm-eps", "qkv_bias": "--qkv-bias",  # what a flag sets beyond the shape
                   "head_size": "--head-dim", "qk_norm": "--qk-norm",
                   **{name: f"--{name.replace('_', '-')}" for name in MOE_FLAG_FIELDS}}
    shape = lambda m: replace(m, n_layer=core.n_layer, n_embd=core.n_embd, n_head=core.n_head,  # noqa: E731
                              seq_len=core.seq_len, vocab_size=core.vocab_size,
                              **{name: getattr(core, name) for name in arch_fields})
    preset = next((name for name, m in MODEL_PRESETS.items() if norm(m) == core), None)
    # a preset of the same width with some of its shape changed reads as that preset and the flags changing it
    changed = lambda m: [(flag, str(getattr(core, name))) for name, flag in SHAPE_FLAGS.items()  # noqa: E731
                         if getattr(core, name) != getattr(m, name)]
    base = min((name for name, m in MODEL_PRESETS.items() if norm(shape(m)) == core and m.n_embd == core.n_embd),
               key=lambda name: len(changed(MODEL_PRESETS[name])), default=None)
    if preset is not None:
        args = ["--model", preset]
    else:
        preset = base or next((name for name, m in MODEL_PRESETS.items() if norm(shape(m)) == core), None)
        if preset is None:
            raise ConfigError("the model differs from every preset in more than its shape (dropout, bias): "
                              "`pipegpt run` cannot build it from flags")
        args = ["--model", base, *(x for pair in changed(MODEL_PRESETS[base]) for x in pair)] if base else (
            ([] if preset == "tiny" else ["--model", preset]) + [
                "--n-layer", str(core.n_layer), "--n-embd", str(core.n_embd), "--n-head", str(core.n_head),
                "--seq-len", str(core.seq_len), "--vocab-size", str(core.vocab_size)])
        for name, flag in arch_fields.items():
            value = getattr(core, name)
            if value == getattr(MODEL_PRESETS[preset], name):
                continue
            if name == "qkv_bias":
                args.append(flag if value else "--no-qkv-bias")
            else:  # a None stated as the width or head count it means
                args += [flag, str({"ffn_hidden": core.ffn_width, "n_kv_head": core.kv_heads, "expert_hidden":
                                    core.expert_width, "n_experts_per_token": core.experts_per_token,
                                    "head_size": core.head_dim}.get(name, value))]
    if model.tie_embeddings and not MODEL_PRESETS[preset].tie_embeddings:
        args.append("--tie-embeddings")
    if not model.tie_embeddings and MODEL_PRESETS[preset].tie_embeddings:
        args.append("--no-tie-embeddings")
    if pad_vocab or model.pad_vocab_to == 64:
        args.append("--pad-vocab")
    return args


@dataclass
class Result:
    """One plan with its predictions."""

    layout: Layout
    model: ModelConfig  # as the plan runs it (vocabulary padded where tp needs it)
    step_time: float
    makespan: float
    after: float  # after the last action and the last all-reduce: optimizer, ZeRO's all-gather, tied sum
    bubble: float  # the simulator's idle share of the ranks' time, up to the end of the gradient all-reduce
    tokens_per_s: float
    mfu: float | None
    memory: list  # per pipeline rank: bytes by part (see memory_parts) and "total"
    peak_rank: int
    breakdown: dict  # seconds on the busiest rank: compute, tp_comm, idle; exposed dp all-reduce; after
    costs: Costs | None = None
    summary: dict = field(default_factory=dict)

    @property
    def peak_bytes(self) -> float:
        return self.memory[self.peak_rank]["total"]

    def as_dict(self, precision: str) -> dict:
        L = self.layout
        return {
            **{axis: getattr(L, axis) for axis in LAYOUT_AXES}, "cp_comm": L.cp_comm, "gpus": L.world,
            "schedule": L.schedule,
            "virtual_stages": L.virtual_stages, "microbatches": L.microbatches, "microbatch_size": L.microbatch_size,
            "recompute": L.recompute, "zero": L.zero, "unshard": L.unshard_policy if L.zero >= 3 else None,
            "sequence_parallel": L.sequence_parallel,
            "layers_per_stage": list(L.layers_per_stage), "layer_split": "balanced" if L.balanced else "even",
            "pad_vocab": L.pad_vocab, **({"ep": L.ep} if self.model.n_experts else {}),
            "step_time_s": self.step_time, "makespan_s": self.makespan, "after_s": self.after,
            "bubble_fraction": self.bubble, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "peak_memory_bytes": self.peak_bytes, "peak_memory_rank": self.peak_rank,
            "memory_per_rank": self.memory, "breakdown_s": self.breakdown,
            "command": L.command(self.model, precision), "args": L.run_args(self.model, precision),
        }


# The order a plan's JSON lists the axes in: Layout's (dp pp tp, then cp, which came later).
LAYOUT_AXES = tuple(f.name for f in fields(Layout) if f.name in AXES)


def mesh_name(dims: ParallelDims | Sharding, details: Mapping[str, str | None] | None = None) -> str:
    """A layout's axes as the report names them, in rank order: dp2 pp4 cp2 tp8, or with details {"cp": "ring"}
    (how K/V travel) dp2 pp4 cp2(ring) tp8 (cp only when > 1): pipegpt.dims's label; then ep32 where it carves."""
    ep = expert_ranks(dims)
    return dims.label(details) + (f" ep{ep}" if ep > 1 else "")


def memory_parts(x) -> dict:
    """A pipegpt.costs.memory.MemoryBreakdown as the parts printed (bytes)."""
    return {"weights": x.weights, "gradients": x.gradients, "optimizer": x.optimizer, "activations": x.activations,
            "workspace": getattr(x, "workspace", 0), "communication": x.p2p_buffers + x.dp_buffers,
            "total": x.total}


@dataclass
class Refusal:
    """A layout that cannot fit, with what its leanest variant needs."""

    dims: ParallelDims
    needs: float
    parts: dict
    what: str  # the variant measured (recompute, zero, microbatch size)

    @property
    def name(self) -> str:
        return mesh_name(self.dims)

    @property
    def model_parallel(self) -> int:
        """Ranks one copy of the model is cut over: pp x cp x tp."""
        return self.dims.replica_size

    def dominant(self) -> str:
        parts = {k: v for k, v in self.parts.items() if k != "total"}
        return max(parts, key=parts.get) if parts else "?"


@dataclass
class SearchResult:
    request: Request
    best: list[Result]
    runners: dict  # schedule -> its best Result (with --explain), or a reason string
    refusals: list[Refusal]
    stats: dict
