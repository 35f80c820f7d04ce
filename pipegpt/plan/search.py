"""Search layouts, schedules, microbatching and recomputation for the fastest step that fits.

What is searched, for a model, a global batch and a cluster:

* dp x pp x tp over at most the cluster's GPUs: tp divides the GPUs of a node (a tensor-parallel group never
  leaves its node) and passes pipegpt.config.validate_tp (padding the vocabulary to 64 where that is what
  tp needs, as `pipegpt run --pad-vocab` does); dp divides the batch.
* every schedule of the registry (pipegpt.schedule.SCHEDULES): interleaved-1f1b with v in {2, 4}, zbv and
  dualpipev with their 2 stages per rank; model stages <= n_layer. With pp = 1 only 1f1b (gradient
  accumulation: the other schedules are the same work in another order, or need two ranks).
* microbatch size: every divisor of the replica's batch (m = batch / (dp x size)), the schedule's own rules
  (ScheduleError) refusing what they refuse; at most MAX_ACTIONS actions per plan.
* recomputation none / selective / full; ZeRO-1 on/off when dp > 1; sequence parallelism when tp > 1 (in
  this model it moves the same bytes as tensor parallelism without it and holds less, so it is taken
  whenever validate_tp allows it, the other way otherwise);
* the layer split: even (what `pipegpt run` does without --layers-per-stage), or balanced by cost
  (pipegpt.plan.balance: embedding and head counted, for the schedule's placement) when that differs.

How it stays fast (branch and bound over two levels):

* a layout's bound: a replica's least work (per-sequence costs, no recomputation) spread evenly over its pp
  ranks. Layouts are expanded into candidates in the order of these bounds, and only while a bound is below
  the K-th best step time found so far.
* a candidate's bound, valid for ANY schedule on its placement: for each rank r, the forward chain that must
  reach its first stage before it can start, plus all its work (m microbatches), plus what must follow its
  last action -- the backward chain below it (less the W work that may fill it, for split-backward plans) or
  its smallest stage's gradient all-reduce -- max over ranks, plus the time after the step. For 1F1B, GPipe
  and interleaved 1F1B at uniform costs it equals the simulator's makespan, so few candidates get simulated.
* memory before time: a family whose weights, gradients and optimizer state (at ZeRO-1's even share) plus
  one microbatch per stage does not fit is dropped with all its larger microbatches; a popped candidate is
  checked against its held activations at the schedule's peak (live sets read once from the plan's action
  order, then one matrix-vector product per candidate) and then against pipegpt.plan.memory's full
  breakdown, before it is simulated.
* the simulator's results are cached by (schedule, p, m, v, costs normalised and rounded to 3 significant
  digits); the plans printed are simulated again with their exact costs.

The list shown holds the best plan of each (dp, pp, tp, schedule) -- variants differing only in microbatch
size or recomputation are not shown twice. With --explain the search also finds each schedule's best plan,
and says which lighter layouts were refused for memory (only those every candidate of which was refused).
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache

from pipegpt.config import ConfigError, ModelConfig, validate_tp
from pipegpt.model.flops import flops_per_token
from pipegpt.schedule import SCHEDULES, ScheduleError, build_plan
from pipegpt.schedule.actions import Kind
from pipegpt.schedule.simulate import Costs, simulate

from . import memory as memory_model
from .balance import balance_layers, even_layers
from .cost import AnalyticalCosts, Shape
from .devices import Cluster, format_bytes

MAX_ACTIONS = 60_000  # compute actions per plan: larger plans are not simulated
RECOMPUTE_ORDER = ("none", "selective", "full")
ROUND_DIGITS = 3


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

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def takes_virtual_stages(self) -> bool:
        return SCHEDULES[self.schedule].takes_virtual_stages

    def short(self) -> str:
        v = f" v{self.virtual_stages}" if self.takes_virtual_stages else ""
        return (f"dp{self.dp} pp{self.pp} tp{self.tp}{' sp' if self.sequence_parallel else ''} {self.schedule}{v} "
                f"m{self.microbatches}x{self.microbatch_size} rc={self.recompute} zero{self.zero}"
                + (" balanced" if self.balanced else ""))

    def run_args(self, model: ModelConfig, precision: str) -> list[str]:
        """The `pipegpt run` arguments (as that command spells them) that build this plan."""
        args = model_args(model, self.pad_vocab)
        args += ["--stages", str(self.pp), "--dp", str(self.dp), "--tp", str(self.tp), "--schedule", self.schedule]
        if self.takes_virtual_stages:
            args += ["--virtual-stages", str(self.virtual_stages)]
        args += ["--microbatches", str(self.microbatches), "--microbatch-size", str(self.microbatch_size),
                 "--recompute", self.recompute, "--zero", str(self.zero)]
        if self.sequence_parallel:
            args.append("--sequence-parallel")
        if self.balanced:
            args += ["--layers-per-stage", ",".join(map(str, self.layers_per_stage))]
        args += ["--precision", precision]
        return args

    def command(self, model: ModelConfig, precision: str) -> str:
        return "pipegpt run " + " ".join(self.run_args(model, precision))


def model_args(model: ModelConfig, pad_vocab: bool = False) -> list[str]:
    """The `pipegpt run` model flags that build exactly this model: a preset's name, or its shape; then
    --no-tie-embeddings and --pad-vocab (padding to 64) as they apply. pad_vocab: the plan pads."""
    from pipegpt.config import MODEL_PRESETS

    if model.pad_vocab_to not in (1, 64):
        raise ConfigError(f"pad_vocab_to={model.pad_vocab_to}: `pipegpt run` pads only to 64 (--pad-vocab)")
    core = replace(model, pad_vocab_to=1, tie_embeddings=True)
    shape = lambda m: replace(m, n_layer=core.n_layer, n_embd=core.n_embd, n_head=core.n_head,  # noqa: E731
                              seq_len=core.seq_len, vocab_size=core.vocab_size)
    preset = next((name for name, m in MODEL_PRESETS.items() if m == core), None)
    if preset is not None:
        args = ["--model", preset]
    else:
        similar = next((name for name, m in MODEL_PRESETS.items() if shape(m) == core), None)
        if similar is None:
            raise ConfigError("the model differs from every preset in more than its shape (dropout, bias): "
                              "`pipegpt run` cannot build it from flags")
        args = ([] if similar == "tiny" else ["--model", similar]) + [
            "--n-layer", str(core.n_layer), "--n-embd", str(core.n_embd), "--n-head", str(core.n_head),
            "--seq-len", str(core.seq_len), "--vocab-size", str(core.vocab_size)]
    if not model.tie_embeddings:
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
    after: float  # after the last action and the last all-reduce: optimizer, ZeRO-1 broadcast, tied sum
    bubble: float  # the simulator's idle share of the ranks' time, up to the end of the gradient all-reduce
    tokens_per_s: float
    mfu: float | None
    memory: list  # per pipeline rank: bytes by part (see _parts) and "total"
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
            "dp": L.dp, "pp": L.pp, "tp": L.tp, "gpus": L.world, "schedule": L.schedule,
            "virtual_stages": L.virtual_stages, "microbatches": L.microbatches, "microbatch_size": L.microbatch_size,
            "recompute": L.recompute, "zero": L.zero, "sequence_parallel": L.sequence_parallel,
            "layers_per_stage": list(L.layers_per_stage), "layer_split": "balanced" if L.balanced else "even",
            "pad_vocab": L.pad_vocab,
            "step_time_s": self.step_time, "makespan_s": self.makespan, "after_s": self.after,
            "bubble_fraction": self.bubble, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "peak_memory_bytes": self.peak_bytes, "peak_memory_rank": self.peak_rank,
            "memory_per_rank": self.memory, "breakdown_s": self.breakdown,
            "command": L.command(self.model, precision), "args": L.run_args(self.model, precision),
        }


@dataclass
class Refusal:
    """A layout that cannot fit, with what its leanest variant needs."""

    dp: int
    pp: int
    tp: int
    needs: float
    parts: dict
    what: str  # the variant measured (recompute, zero, microbatch size)

    def dominant(self) -> str:
        parts = {k: v for k, v in self.parts.items() if k != "total"}
        return max(parts, key=parts.get) if parts else "?"


@dataclass
class SearchResult:
    request: "Request"
    best: list[Result]
    runners: dict  # schedule -> its best Result (with --explain), or a reason string
    refusals: list[Refusal]
    stats: dict


@dataclass(frozen=True)
class Request:
    model: ModelConfig
    batch_size: int  # sequences per step, all replicas together
    cluster: Cluster
    costs: AnalyticalCosts
    top: int = 5
    explain: bool = False
    schedules: tuple = tuple(SCHEDULES)
    exact_gpus: bool = False  # only layouts using every GPU


# ---------------------------------------------------------------------------------------------------------
# schedule structure (cost-independent, cached)


@dataclass
class Structure:
    """A schedule's compute plan for (p, m, v), built once: the simulator and the memory model read it."""

    plan: object  # pipegpt.schedule.Plan, compute only
    split: bool  # whether it splits backward into I and W


@lru_cache(maxsize=256)
def structure(schedule: str, p: int, m: int, v: int | None) -> Structure:
    plan = build_plan(schedule, p, m, v)
    return Structure(plan, any(a.kind is Kind.W for r in plan.ranks for a in r))


@lru_cache(maxsize=8192)
def live_sets(schedule: str, p: int, m: int, v: int | None) -> tuple:
    """Per rank, (its stages, a matrix whose rows are the count vectors at which its held activations may peak).

    pipegpt.plan.memory counts saved[s] from a stage-microbatch's F to its B, or to its I and then
    deferred[s] until its W; a rank's level changes only at its own actions, so it peaks right after one of
    its F or I actions whatever the costs and the bytes. The distinct (saved counts, deferred counts)
    vectors of those moments give every rank's peak for any bytes as one matrix-vector product (held_peaks)."""
    import numpy as np

    plan = structure(schedule, p, m, v).plan
    out = []
    for r, actions in enumerate(plan.ranks):
        stages = plan.stages_of(r)
        index = {s: i for i, s in enumerate(stages)}
        k = len(stages)
        live = [0] * (2 * k)
        seen = set()
        for a in actions:
            i = index[a.stage]
            if a.kind is Kind.F:
                live[i] += 1
                seen.add(tuple(live))
            elif a.kind is Kind.B:
                live[i] -= 1
            elif a.kind is Kind.I:
                live[i] -= 1
                live[k + i] += 1
                seen.add(tuple(live))
            elif a.kind is Kind.W:
                live[k + i] -= 1
        rows = np.array(sorted(seen), dtype=np.float64).reshape(-1, 2 * k)
        if k == 1 and len(rows) > 1:  # two columns: keep the undominated rows (few)
            rows = rows[np.lexsort((-rows[:, 1], -rows[:, 0]))]
            keep = rows[:, 1] > np.maximum.accumulate(np.concatenate(([-1.0], rows[:-1, 1])))
            rows = rows[keep]
        out.append((tuple(stages), rows))
    return tuple(out)


def held_peaks(schedule: str, p: int, m: int, v: int | None, saved, deferred) -> list:
    """Each rank's peak of held activation bytes: memory.peak_activation_bytes(plan, saved, deferred)."""
    import numpy as np

    out = []
    for stages, rows in live_sets(schedule, p, m, v):
        if not len(rows):
            out.append(0)
            continue
        weights = np.array([saved[s] for s in stages] + [deferred[s] for s in stages], dtype=np.float64)
        out.append(float((rows @ weights).max()))
    return out


@lru_cache(maxsize=None)
def _placement(schedule: str, p: int, v: int | None) -> tuple:
    return SCHEDULES[schedule].stage_to_rank(p, v)


@lru_cache(maxsize=None)
def _splits_backward(schedule: str) -> bool:
    return structure(schedule, 2, 4, None).split


# ---------------------------------------------------------------------------------------------------------
# the search


@dataclass
class _Eval:
    """A simulated candidate (light: no timeline)."""

    step: float
    layout: Layout
    makespan: float
    bubble: float
    after: float
    peak: float
    model: ModelConfig


class _Search:
    def __init__(self, req: Request):
        self.req, self.model, self.cluster, self.cost = req, req.model, req.cluster, req.costs
        self.precision = req.cluster.precision
        self.sim_cache: dict = {}
        self.stats = {"layouts": 0, "candidates": 0, "memory_refused": 0, "schedule_refused": 0,
                      "simulated": 0, "cache_hits": 0, "popped": 0, "seconds": 0.0}
        self.refusals: dict = {}  # (dp, pp, tp) -> Refusal with the least memory seen
        self._pieces: dict = {}
        self._splits: dict = {}
        self._crossings: dict = {}
        self._linear: dict = {}
        self._params: dict = {}

    # --- pieces and per-stage vectors ----------------------------------------------------------------
    def pieces(self, model: ModelConfig, tp: int, sp: bool, recompute: str, mbs: int):
        key = (model.padded_vocab_size, tp, sp, recompute, mbs)
        hit = self._pieces.get(key)
        if hit is None:
            hit = self._pieces[key] = self.cost.pieces(model, Shape(tp, sp, recompute, mbs))
        return hit

    def message_time(self, nbytes, placement, dp, pp, tp) -> float:
        """The mean time of one message over the placement's links between ranks, in the slowest replica."""
        key = (placement, dp, pp, tp)
        hit = self._crossings.get(key)
        if hit is None:
            links = [(placement[s], placement[s + 1]) for s in range(len(placement) - 1)
                     if placement[s] != placement[s + 1]]
            G = self.cluster.gpus_per_node
            worst = 0
            for d in range(min(dp, G)):
                worst = max(worst, sum(((d * pp + a) * tp) // G != ((d * pp + b) * tp) // G for a, b in links))
            hit = self._crossings[key] = (len(links), worst)
        links, worst = hit
        if not links:
            return 0.0
        t_in, t_out = self.cost.message_time(nbytes, True), self.cost.message_time(nbytes, False)
        return (worst * t_out + (links - worst) * t_in) / links

    def dp_comm(self, stage_params, dp, world):
        """Each stage's gradient all-reduce over the dp replicas (fp32 gradients, per tp rank)."""
        inside = world <= self.cluster.gpus_per_node
        return [self.cost.group_allreduce_time(4 * n, dp, inside) for n in stage_params]

    def after_time(self, model, placement, stage_params, stage_tensors, dp, pp, tp, zero) -> float:
        """After the last action and all-reduce: the slowest rank's optimizer step (+ ZeRO-1's broadcast),
        and the tied embedding's gradient sum between the first and the last stage."""
        c = self.cluster
        params = [0.0] * pp
        tensors = [0] * pp
        for s, r in enumerate(placement):
            params[r] += stage_params[s]
            tensors[r] += stage_tensors[s]
        inside = dp * pp * tp <= c.gpus_per_node
        worst = 0.0
        for r in range(pp):
            if zero and dp > 1:
                t = self.cost.optimizer_time(params[r] / dp, max(1, -(-tensors[r] // dp)))
                t += self.cost.broadcast_shards_time(params[r] * 4, dp, inside)
            else:
                t = self.cost.optimizer_time(params[r], tensors[r])
            worst = max(worst, t)
        if model.tie_embeddings and placement[0] != placement[-1]:
            G = c.gpus_per_node
            same = (placement[0] * tp) // G == (placement[-1] * tp) // G
            worst += self.cost.group_allreduce_time(model.padded_vocab_size * model.n_embd / tp * 4, 2, same)
        return worst

    @staticmethod
    def stage_tensors(model, layers):
        S, per_layer = len(layers), 12 if model.bias else 6
        ln = 2 if model.bias else 1
        return [n * per_layer + (2 if s == 0 else 0) + ((ln + 1) if s == S - 1 else 0) for s, n in enumerate(layers)]

    # --- lower bound ---------------------------------------------------------------------------------
    @staticmethod
    def lower_bound(F, B, W, TP, comm, dpc, placement, m, split) -> float:
        """A lower bound on the simulator's makespan for ANY schedule with this placement (module docstring)."""
        S = len(placement)
        p = max(placement) + 1
        smin = [S] * p
        busy = [0.0] * p
        wsum = [0.0] * p
        mindp = [math.inf] * p
        for s, r in enumerate(placement):
            if s < smin[r]:
                smin[r] = s
            busy[r] += F[s] + B[s] + 2 * TP[s]
            wsum[r] += W[s]
            if dpc[s] < mindp[r]:
                mindp[r] = dpc[s]
        fwd = bwd = 0.0
        chain_f, chain_b = [0.0], [0.0]
        for s in range(S - 1):
            hop = comm if placement[s] != placement[s + 1] else 0.0
            fwd += F[s] + TP[s] + hop
            bwd += (B[s] - W[s] if split else B[s]) + TP[s] + hop
            chain_f.append(fwd)
            chain_b.append(bwd)
        best = 0.0
        for r in range(p):
            tail = chain_b[smin[r]]
            if split:
                tail = max(0.0, tail - m * wsum[r])
            best = max(best, chain_f[smin[r]] + m * busy[r] + max(tail, mindp[r]))
        return best

    # --- simulation ----------------------------------------------------------------------------------
    def simulate(self, schedule, p, m, v, F, B, W, TP, comm, dpc):
        """(makespan, bubble) from the simulator, cached by normalised rounded costs."""
        scale = max(max(F), 1e-30)
        r = lambda xs: tuple(_round(x / scale) for x in xs)  # noqa: E731
        key = (schedule, p, m, v, r(F), r(B), r(W), r(TP), _round(comm / scale), r(dpc))
        hit = self.sim_cache.get(key)
        if hit is not None:
            self.stats["cache_hits"] += 1
            return hit[0] * scale, hit[1]
        Fr, Br, Wr, TPr, dpr = (list(xs) for xs in (key[4], key[5], key[6], key[7], key[9]))
        Wr = [min(w, b) for w, b in zip(Wr, Br)]
        costs = Costs(tuple(Fr), tuple(Br), tuple(Wr), key[8], None, tuple(TPr), tuple(dpr))
        timeline = simulate(structure(schedule, p, m, v).plan, costs)
        self.stats["simulated"] += 1
        out = (float(timeline.makespan), float(timeline.bubble_fraction))
        self.sim_cache[key] = out
        return out[0] * scale, out[1]

    # --- enumeration ---------------------------------------------------------------------------------
    def layouts(self):
        """(dp, pp, tp, sequence parallel, model as run, vocabulary padded) to consider."""
        req, model, c = self.req, self.model, self.cluster
        out = []
        for tp in (t for t in range(1, c.gpus_per_node + 1) if c.gpus_per_node % t == 0):
            m_tp, pad = model, False
            try:
                validate_tp(model, tp)
            except ConfigError:
                if model.pad_vocab_to != 1 or 64 % tp:
                    continue
                m_tp, pad = replace(model, pad_vocab_to=64), True
                try:
                    validate_tp(m_tp, tp)
                except ConfigError:
                    continue
            sp = False
            if tp > 1:
                try:
                    validate_tp(m_tp, tp, True)
                    sp = True
                except ConfigError:
                    pass
            for pp in range(1, min(model.n_layer, c.gpus // tp) + 1):
                for dp in _divisors(req.batch_size):
                    world = dp * pp * tp
                    if world <= c.gpus and (not req.exact_gpus or world == c.gpus):
                        out.append((dp, pp, tp, sp, m_tp, pad))
        return out

    def groups(self, pp):
        """Placements to consider with pp ranks: (placement, v argument, model stages per rank, schedules),
        each schedule as (name, splits its backward)."""
        out: dict = {}
        for name in self.req.schedules:
            spec = SCHEDULES[name]
            if pp == 1 and name != "1f1b":
                continue
            options = [(v, v) for v in (2, 4)] if spec.takes_virtual_stages else [(None, spec.default_virtual_stages)]
            for v, vs in options:
                if pp * vs <= self.model.n_layer:
                    placement = _placement(name, pp, v)
                    out.setdefault((placement, v, vs), []).append((name, _splits_backward(name)))
        return [(placement, v, vs, names) for (placement, v, vs), names in out.items()]

    def linear(self, model, tp, sp, rc, mbs):
        """Per-stage quantities as (per block, {(embed, head): the stage's fixed part}): parameters, saved and
        deferred activation bytes, and F, B, W, tp_comm -- all linear in the stage's block count."""
        key = (model.padded_vocab_size, tp, sp, rc, mbs)
        hit = self._linear.get(key)
        if hit is not None:
            return hit
        ends = [(False, False), (True, False), (False, True), (True, True)]

        def lin(fn):
            base = {eh: fn(0, *eh) for eh in ends}
            return fn(1, False, False) - base[(False, False)], base

        kw = dict(microbatch_size=mbs, tp=tp, sequence_parallel=sp, precision=self.precision)
        act = lin(lambda n, e, h: memory_model.activation_bytes(model, n, recompute=rc, embed=e, head=h, **kw))
        dfr = lin(lambda n, e, h: memory_model.deferred_bytes(model, n, embed=e, head=h, **kw))
        P = self.pieces(model, tp, sp, rc, mbs)

        def piece_parts(piece):
            sym = min(piece.comm_f, piece.comm_b)
            return (piece.f + piece.comm_f - sym, piece.b + piece.comm_b - sym, piece.w, sym)

        layer, embed, head = piece_parts(P.layer), piece_parts(P.embed), piece_parts(P.head)
        vec = (layer, {(e, h): tuple((embed[i] if e else 0.0) + (head[i] if h else 0.0) for i in range(4))
                       for e, h in ends})
        hit = self._linear[key] = (act, dfr, vec, P.message_bytes)
        return hit

    def params_linear(self, model, tp):
        key = (model.padded_vocab_size, tp)
        hit = self._params.get(key)
        if hit is None:
            base = {(e, h): memory_model.parameter_count(model, 0, e, h, tp)
                    for e in (False, True) for h in (False, True)}
            hit = self._params[key] = (memory_model.parameter_count(model, 1, False, False, tp), base)
        return hit

    @staticmethod
    def compose(lin, layers):
        per, base = lin
        S = len(layers)
        return [n * per + base[(s == 0, s == S - 1)] for s, n in enumerate(layers)]

    def vectors(self, model, tp, sp, rc, mbs, layers):
        """Per stage F, B, W, tp_comm, saved and deferred activation bytes; one message's bytes."""
        act, dfr, (layer, base), msg = self.linear(model, tp, sp, rc, mbs)
        S = len(layers)
        ends = [base[(s == 0, s == S - 1)] for s in range(S)]
        F = [n * layer[0] + e[0] for n, e in zip(layers, ends)]
        B = [n * layer[1] + e[1] for n, e in zip(layers, ends)]
        W = [min(n * layer[2] + e[2], b) for n, e, b in zip(layers, ends, B)]
        TP = [n * layer[3] + e[3] for n, e in zip(layers, ends)]
        return F, B, W, TP, self.compose(act, layers), self.compose(dfr, layers), msg

    def split(self, model, tp, sp, rc, placement, balanced):
        """The even split, or the one balanced by cost (None when that is the even one). Costs per sequence
        (forward + backward + collectives of a block, the embedding, the head: their FLOP parts, which set
        the balance at any microbatch size)."""
        S = len(placement)
        even = tuple(even_layers(model.n_layer, S))
        if not balanced or S == 1:
            return None if balanced else even
        big = 1 << 20  # a microbatch this large leaves only the per-sequence parts
        P = self.pieces(model, tp, sp, rc, big)
        cost = lambda piece: piece.f + piece.b + piece.comm_f + piece.comm_b  # noqa: E731
        unit = cost(P.layer)
        key = (placement, model.n_layer, round(cost(P.embed) / unit, 2), round(cost(P.head) / unit, 2))
        hit = self._splits.get(key)
        if hit is None:
            layers = tuple(balance_layers([1.0] * model.n_layer, key[2], key[3], placement))
            hit = self._splits[key] = (None if layers == even else layers,)
        return hit[0]

    def _refuse(self, dp, pp, tp, needs, parts, what):
        key = (dp, pp, tp)
        old = self.refusals.get(key)
        if old is None or needs < old.needs:
            self.refusals[key] = Refusal(dp, pp, tp, needs, parts, what)

    def layout_bound(self, layout) -> float:
        """A lower bound on any plan of the layout: a replica's least work spread evenly over its pp ranks."""
        dp, pp, tp, sp, m_tp, pad = layout
        big = 1 << 20
        P = self.pieces(m_tp, tp, sp, "none", big)
        per = lambda p: p.f + p.b + p.comm_f + p.comm_b  # noqa: E731
        work = (m_tp.n_layer * per(P.layer) + per(P.embed) + per(P.head)) / big
        return self.req.batch_size // dp * work / pp

    def expand(self, layout):
        """The layout's candidates with their lower bounds: (bound, key) where key rebuilds the candidate."""
        dp, pp, tp, sp, m_tp, pad = layout
        cap, r_bytes = self.cluster.memory_bytes, 4
        b = self.req.batch_size // dp
        world = dp * pp * tp
        zeros = (0, 1) if dp > 1 else (0,)
        opt = 2 * r_bytes / dp  # AdamW state per parameter at ZeRO-1's even share: a lower bound of the greedy one
        for placement, v, vs, schedules in self.groups(pp):
            S = len(placement)
            for balanced in (False, True):
                for rc in RECOMPUTE_ORDER:
                    layers = self.split(m_tp, tp, sp, rc, placement, balanced)
                    if layers is None:
                        continue
                    params = self.compose(self.params_linear(m_tp, tp), layers)
                    rank_params = [0] * pp
                    for s, r in enumerate(placement):
                        rank_params[r] += params[s]
                    static = [(2 * r_bytes + opt) * x for x in rank_params]
                    if max(static) > cap:
                        r = max(range(pp), key=static.__getitem__)
                        self._refuse(dp, pp, tp, static[r], {"weights": r_bytes * rank_params[r],
                                                             "gradients": r_bytes * rank_params[r],
                                                             "optimizer": opt * rank_params[r]},
                                     "weights, gradients and optimizer state alone" + (" (ZeRO-1)" if dp > 1 else ""))
                        self.stats["memory_refused"] += 1
                        continue
                    dpc = self.dp_comm(params, dp, world)
                    tensors = self.stage_tensors(m_tp, layers)
                    after = min(self.after_time(m_tp, placement, params, tensors, dp, pp, tp, z) for z in zeros)
                    for mbs in _divisors(b):
                        m = b // mbs
                        if 3 * m * S > MAX_ACTIONS:
                            continue
                        F, B, W, TP, saved, _, msg = self.vectors(m_tp, tp, sp, rc, mbs, layers)
                        least = list(static)
                        for s, r in enumerate(placement):
                            least[r] += saved[s]  # every stage of a rank holds a microbatch at some moment
                        if max(least) > cap:
                            r = max(range(pp), key=least.__getitem__)
                            self._refuse(dp, pp, tp, least[r], {
                                "weights": r_bytes * rank_params[r], "gradients": r_bytes * rank_params[r],
                                "optimizer": opt * rank_params[r], "activations": least[r] - static[r]},
                                f"{rc} recomputation, {'ZeRO-1, ' if dp > 1 else ''}{mbs} sequence"
                                f"{'s' if mbs > 1 else ''} per microbatch")
                            self.stats["memory_refused"] += 1
                            break  # larger microbatches hold more
                        comm = self.message_time(msg, placement, dp, pp, tp)
                        bounds = {}
                        for name, split in schedules:
                            if split not in bounds:
                                bounds[split] = self.lower_bound(F, B, W, TP, comm, dpc, placement, m, split) + after
                            self.stats["candidates"] += 1
                            yield bounds[split], (dp, pp, tp, sp, pad, name, v, vs, mbs, rc, balanced)

    def evaluate(self, key) -> _Eval | None:
        """Memory (exact), then the simulator; None when it does not fit or the schedule refuses."""
        dp, pp, tp, sp, pad, schedule, v, vs, mbs, rc, balanced = key
        cap = self.cluster.memory_bytes
        m_tp = replace(self.model, pad_vocab_to=64) if pad else self.model
        m = self.req.batch_size // dp // mbs
        placement = _placement(schedule, pp, v)
        layers = self.split(m_tp, tp, sp, rc, placement, balanced)
        try:
            st = structure(schedule, pp, m, v)
        except ScheduleError:
            self.stats["schedule_refused"] += 1
            return None
        F, B, W, TP, saved, deferred, msg = self.vectors(m_tp, tp, sp, rc, mbs, layers)
        zeros = (0, 1) if dp > 1 else (0,)
        what = lambda z: (f"{schedule}, {rc} recomputation, {'ZeRO-1, ' if z else ''}{mbs} sequence"  # noqa: E731
                          f"{'s' if mbs > 1 else ''} per microbatch")
        # A lower bound first (state + held activations, no walk over the plan), then the memory model.
        held = held_peaks(schedule, pp, m, v, saved, deferred)
        S = len(layers)
        states = {z: [memory_model.state_bytes(m_tp, [(layers[s], s == 0, s == S - 1) for s in st.plan.stages_of(r)],
                                               tp=tp, precision=self.precision, dp=dp, zero=bool(z))
                      for r in range(pp)] for z in zeros}
        least = {z: [x.weights + x.gradients + x.optimizer + h for x, h in zip(states[z], held)] for z in zeros}
        if min(max(least[z]) for z in zeros) > cap:
            self.stats["memory_refused"] += 1
            z = min(zeros, key=lambda z: max(least[z]))
            r = max(range(pp), key=least[z].__getitem__)
            x = states[z][r]
            self._refuse(dp, pp, tp, least[z][r], {"weights": x.weights, "gradients": x.gradients,
                                                    "optimizer": x.optimizer, "activations": held[r]}, what(z))
            return None
        base = memory_model.plan_memory(m_tp, st.plan, layers, microbatch_size=mbs, tp=tp, sequence_parallel=sp,
                                        recompute=rc, precision=self.precision, dp=dp, zero=False)
        mem = {z: [replace(x, optimizer=states[z][x.rank].optimizer) for x in base] for z in zeros}
        fits = [z for z, ranks in mem.items() if max(x.total for x in ranks) <= cap]
        if not fits:
            self.stats["memory_refused"] += 1
            z = min(mem, key=lambda z: max(x.total for x in mem[z]))
            worst = max(mem[z], key=lambda x: x.total)
            self._refuse(dp, pp, tp, worst.total, _parts(worst), what(z))
            return None
        params = self.compose(self.params_linear(m_tp, tp), layers)
        comm = self.message_time(msg, placement, dp, pp, tp)
        dpc = self.dp_comm(params, dp, dp * pp * tp)
        makespan, bubble = self.simulate(schedule, pp, m, v, F, B, W, TP, comm, dpc)
        tensors = self.stage_tensors(m_tp, layers)
        step, zero = min((makespan + self.after_time(m_tp, placement, params, tensors, dp, pp, tp, z), z) for z in fits)
        layout = Layout(dp, pp, tp, schedule, vs, m, mbs, rc, zero, sp, tuple(layers), balanced, pad)
        return _Eval(step, layout, makespan, bubble, step - makespan, max(x.total for x in mem[zero]), m_tp)

    def run(self) -> SearchResult:
        t0 = time.perf_counter()
        req = self.req
        layouts = self.layouts()
        self.stats["layouts"] = len(layouts)
        heap = [(self.layout_bound(x), i, "layout", x) for i, x in enumerate(layouts)]
        heapq.heapify(heap)
        counter = len(heap)
        top: dict = {}  # (dp, pp, tp, schedule, v) -> its best _Eval: one plan per layout and schedule is shown
        by_schedule: dict = {}
        fitted: dict = {}  # a candidate without its recomputation -> True once one fits
        k = max(1, req.top)
        kth = math.inf

        def bar(schedule=None):
            if not req.explain:
                return kth
            others = [by_schedule[s].step if s in by_schedule else math.inf for s in req.schedules]
            if schedule is None:
                return max([kth] + others)
            return max(kth, by_schedule[schedule].step if schedule in by_schedule else math.inf)

        expanded = 0
        done: set = set()  # layouts expanded
        pushed: dict = {}  # layout -> candidates pushed
        refused: dict = {}  # layout -> candidates refused (memory or schedule)
        while heap:
            lb, _, what, item = heapq.heappop(heap)
            if lb >= bar() * (1 - 1e-9):
                break
            if what == "layout":
                expanded += 1
                done.add(item[:3])
                for bound, key in self.expand(item):
                    counter += 1
                    pushed[item[:3]] = pushed.get(item[:3], 0) + 1
                    heapq.heappush(heap, (max(bound, lb), counter, "candidate", key))
                continue
            key = item
            if lb >= bar(key[5]) * (1 - 1e-9):
                continue
            family = key[:9] + (key[10],)
            if fitted.get(family):  # a lighter recomputation of the same candidate fits, and is faster
                continue
            self.stats["popped"] += 1
            ev = self.evaluate(key)
            if ev is None:
                refused[key[:3]] = refused.get(key[:3], 0) + 1
                continue
            fitted[family] = True
            L = ev.layout
            slot = (L.dp, L.pp, L.tp, L.schedule, L.virtual_stages)
            if slot not in top or _order(ev) < _order(top[slot]):
                top[slot] = ev
                steps = sorted(e.step for e in top.values())
                kth = steps[k - 1] if len(steps) >= k else math.inf
            if L.schedule not in by_schedule or _order(ev) < _order(by_schedule[L.schedule]):
                by_schedule[L.schedule] = ev
        top = sorted(top.values(), key=_order)[:k]
        self.stats["layouts_expanded"] = expanded
        self.stats["seconds"] = time.perf_counter() - t0
        best = sorted((self.finish(ev) for ev in top), key=_order)
        runners = {}
        if req.explain:
            shown = {r.layout for r in best}
            for s in req.schedules:
                if s in by_schedule and by_schedule[s].layout not in shown:
                    runners[s] = self.finish(by_schedule[s])
                elif s not in by_schedule:
                    runners[s] = "no plan with it fits"
        # Refused for sure: every candidate of the layout was refused (or none passed the static check).
        if req.explain and best:
            limit = best[0].layout.pp * best[0].layout.tp
            for layout in layouts:
                if layout[:3] not in done and layout[1] * layout[2] < limit:
                    done.add(layout[:3])
                    pushed[layout[:3]] = sum(1 for _ in self.expand(layout))
                    refused[layout[:3]] = 0
        refusals = sorted((r for key, r in self.refusals.items()
                           if key in done and refused.get(key, 0) == pushed.get(key, 0)),
                          key=lambda r: (r.pp * r.tp, r.needs))
        self.stats["seconds_total"] = time.perf_counter() - t0
        return SearchResult(req, best, runners, refusals, dict(self.stats))

    # --- the exact numbers of a chosen plan ----------------------------------------------------------
    def finish(self, ev: _Eval) -> Result:
        """Simulate a plan with its exact costs and gather everything printed about it."""
        L, model, c = ev.layout, ev.model, self.cluster
        v = L.virtual_stages if L.takes_virtual_stages else None
        st = structure(L.schedule, L.pp, L.microbatches, v)
        placement = st.plan.stage_to_rank
        layers = list(L.layers_per_stage)
        F, B, W, TP, saved, deferred, msg = self.vectors(model, L.tp, L.sequence_parallel, L.recompute,
                                                         L.microbatch_size, layers)
        params = self.compose(self.params_linear(model, L.tp), layers)
        comm = self.message_time(msg, placement, L.dp, L.pp, L.tp)
        dpc = self.dp_comm(params, L.dp, L.world)
        costs = Costs(tuple(F), tuple(B), tuple(W), comm, tuple(saved), tuple(TP), tuple(dpc))
        timeline = simulate(st.plan, costs)
        makespan = float(timeline.makespan)
        tensors = self.stage_tensors(model, layers)
        after = self.after_time(model, placement, params, tensors, L.dp, L.pp, L.tp, L.zero)
        step = makespan + after
        mem = memory_model.plan_memory(model, st.plan, layers, microbatch_size=L.microbatch_size, tp=L.tp,
                                       sequence_parallel=L.sequence_parallel, recompute=L.recompute,
                                       precision=self.precision, dp=L.dp, zero=bool(L.zero))
        memory = [_parts(x) for x in mem]
        peak_rank = max(range(len(memory)), key=lambda r: memory[r]["total"])
        tokens = self.req.batch_size * model.seq_len

        mfu = flops_per_token(model) * tokens / step / (L.world * c.peak_flops) if c.peak_flops else None
        # Where the busiest rank's time goes.
        busy = timeline.busy_per_rank
        r = max(range(L.pp), key=lambda r: busy[r])
        tp_time = sum(2 * TP[s] for s in range(len(placement)) if placement[s] == r) * L.microbatches
        rc_extra = 0.0
        if L.recompute != "none":
            B0 = self.vectors(model, L.tp, L.sequence_parallel, "none", L.microbatch_size, layers)[1]
            rc_extra = sum(B[s] - B0[s] for s in range(len(placement)) if placement[s] == r) * L.microbatches
        end = float(timeline.end_time - timeline.start_time)
        breakdown = {"compute": float(busy[r]) - tp_time, "recompute": rc_extra, "tp_comm": tp_time,
                     "idle": end - float(busy[r]), "dp_exposed": makespan - end, "after": after, "rank": r}
        summary = timeline.summary()
        return Result(L, model, step, makespan, after, float(timeline.bubble_fraction), tokens / step, mfu, memory,
                      peak_rank, breakdown, costs, {k: summary[k] for k in ("bubble_fraction_per_rank",
                                                                           "peak_live_microbatches_per_rank")})


def _parts(x) -> dict:
    """A memory_model.MemoryBreakdown as the parts printed (bytes)."""
    return {"weights": x.weights, "gradients": x.gradients, "optimizer": x.optimizer, "activations": x.activations,
            "workspace": getattr(x, "workspace", 0), "communication": x.p2p_buffers + x.dp_buffers,
            "total": x.total}


def _order(ev):
    """Faster first; steps within 0.1% are ties, which go to fewer GPUs, then less memory."""
    step = ev.step if isinstance(ev, _Eval) else ev.step_time
    peak = ev.peak if isinstance(ev, _Eval) else ev.peak_bytes
    return (round(math.log(step) / math.log1p(1e-3)) if step > 0 else 0, ev.layout.world, peak, step,
            ev.layout.short())


def search(req: Request) -> SearchResult:
    """The best plans for a request (see the module docstring)."""
    return _Search(req).run()


def evaluate_layout(req: Request, layout: Layout) -> Result:
    """One given layout's predictions, exact (no search): what `search` would print for it.

    layout.layers_per_stage may be empty (the even split). Raises ConfigError when the schedule refuses it."""
    s = _Search(req)
    model = replace(req.model, pad_vocab_to=64) if layout.pad_vocab else req.model
    if not layout.layers_per_stage:
        layout = replace(layout, layers_per_stage=tuple(even_layers(model.n_layer, layout.stages)))
    v = layout.virtual_stages if layout.takes_virtual_stages else None
    try:
        structure(layout.schedule, layout.pp, layout.microbatches, v)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    return s.finish(_Eval(0.0, layout, 0.0, 0.0, 0.0, 0.0, model))


def _round(x: float) -> float:
    if x == 0:
        return 0.0
    return round(x, ROUND_DIGITS - 1 - int(math.floor(math.log10(abs(x)))))


@lru_cache(maxsize=None)
def _divisors(n: int) -> tuple:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


# ---------------------------------------------------------------------------------------------------------
# what is printed


def format_seconds(x: float) -> str:
    x = float(x)
    if x == 0:
        return "0"
    if x >= 1:
        return f"{x:.3g} s" if x < 100 else f"{x:.0f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} us"


def format_count(x: float, sep: str = "") -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{sep}{unit}"
    return f"{x:.3g}{sep}"


def memory_line(parts: dict) -> str:
    shown = [("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer"),
             ("activations", "activations"), ("workspace", "workspace"), ("communication", "communication")]
    return ", ".join(f"{label} {format_bytes(parts[key])}" for key, label in shown if parts.get(key))


def explain(runner: Result, best: Result) -> str:
    """Why `runner` is slower than `best`: the step-time part that grew the most, in numbers."""
    rb, bb = runner.breakdown, best.breakdown
    slower = runner.step_time / best.step_time - 1
    head = f"+{100 * slower:.1f}% step time"
    if slower < 1e-3:
        why = ("ties within 0.1%" + (f"; uses {runner.layout.world} GPUs vs {best.layout.world}"
                                     if runner.layout.world != best.layout.world else "")
               + (f"; peak memory {format_bytes(runner.peak_bytes)} vs {format_bytes(best.peak_bytes)}"
                  if runner.peak_bytes != best.peak_bytes else ""))
        return f"{head}: {why}"
    work = lambda b: b["compute"] - b["recompute"]  # noqa: E731
    deltas = {
        "compute": work(rb) - work(bb),
        "recompute": rb["recompute"] - bb["recompute"],
        "tp_comm": rb["tp_comm"] - bb["tp_comm"],
        "idle": rb["idle"] - bb["idle"],
        "dp_exposed": rb["dp_exposed"] - bb["dp_exposed"],
        "after": rb["after"] - bb["after"],
    }
    reasons = []
    for part, delta in sorted(deltas.items(), key=lambda kv: -kv[1])[:2]:
        if delta <= 0.05 * (runner.step_time - best.step_time) and reasons:
            break
        if part == "idle":
            reasons.append(f"bubble {100 * runner.bubble:.1f}% vs {100 * best.bubble:.1f}%")
        elif part == "compute":
            what = (f"{runner.layout.world} GPUs vs {best.layout.world}: " if runner.layout.world != best.layout.world
                    else "")
            reasons.append(f"{what}{format_seconds(work(rb))} of compute on its busiest GPU vs "
                           f"{format_seconds(work(bb))}")
        elif part == "recompute":
            reasons.append(f"{runner.layout.recompute} recomputation adds {format_seconds(rb['recompute'])} "
                           f"to its busiest GPU")
        elif part == "tp_comm":
            reasons.append(f"tensor-parallel collectives {format_seconds(rb['tp_comm'])} vs "
                           f"{format_seconds(bb['tp_comm'])}")
        elif part == "dp_exposed":
            reasons.append(f"gradient all-reduce not hidden: {format_seconds(rb['dp_exposed'])} vs "
                           f"{format_seconds(bb['dp_exposed'])}")
        else:
            reasons.append(f"after the last action (optimizer{', ZeRO-1 broadcast' if runner.layout.zero else ''}) "
                           f"{format_seconds(rb['after'])} vs {format_seconds(bb['after'])}")
    return f"{head}: " + "; ".join(reasons)


def refusal_line(r: Refusal, capacity: float) -> str:
    parts = {k: v for k, v in r.parts.items() if k != "total"}
    dominant = r.dominant()
    share = parts[dominant] / r.needs if r.needs else 0
    return (f"dp{r.dp} pp{r.pp} tp{r.tp}: needs at least {format_bytes(r.needs)} > {format_bytes(capacity)} "
            f"({dominant} {format_bytes(parts[dominant])}, {100 * share:.0f}%; {r.what})")


def no_fit_message(res: SearchResult) -> str:
    """The one line printed when no plan fits."""
    c = res.request.cluster
    if not res.refusals:
        return (f"no plan for this model on {c.gpus} GPUs: no layout passes the checks (tensor parallelism within "
                f"{c.gpus_per_node} GPUs per node, schedules, at most {MAX_ACTIONS} actions per plan)")
    lean = min(res.refusals, key=lambda r: r.needs)
    parts = {k: v for k, v in lean.parts.items() if k != "total"}
    dominant = lean.dominant()
    return (f"no plan fits {c.gpus} x {format_bytes(c.memory_bytes)}: the leanest, dp{lean.dp} pp{lean.pp} tp{lean.tp} "
            f"({lean.what}), needs at least {format_bytes(lean.needs)} per GPU, most of it {dominant} "
            f"({format_bytes(parts[dominant])}, {100 * parts[dominant] / lean.needs:.0f}%): use more or larger GPUs, "
            f"a smaller model or sequence")


def describe_model(model: ModelConfig) -> str:

    params = memory_model.parameter_count(model, model.n_layer, True, True, 1)
    flops = format_count(flops_per_token(model), " ")
    return (f"{format_count(params)} parameters: {model.n_layer} layers, width {model.n_embd}, {model.n_head} heads, "
            f"seq {model.seq_len}, vocabulary {model.vocab_size}; {flops}FLOP per token")


def format_text(res: SearchResult) -> str:
    req, c = res.request, res.request.cluster
    precision = c.precision
    from pipegpt.config import MODEL_PRESETS

    name = next((n for n, m in MODEL_PRESETS.items() if m == req.model), "custom")
    lines = [f"model: {name}, {describe_model(req.model)}",
             f"batch: {req.batch_size} sequences x {req.model.seq_len} tokens = "
             f"{req.batch_size * req.model.seq_len:,} tokens per step",
             f"cluster: {c.describe()}",
             f"costs: {req.costs.describe()}",
             f"best plan per layout and schedule; searched {res.stats['layouts']} layouts "
             f"({res.stats['layouts_expanded']} expanded), "
             f"{res.stats['candidates']} candidates; {res.stats['popped']} checked, {res.stats['simulated']} simulated "
             f"(+{res.stats['cache_hits']} from cache) in {res.stats['seconds_total']:.2f} s", ""]
    rows = [["#", "layout", "GPUs", "schedule", "m x mbs", "recompute", "zero", "split", "step", "tokens/s", "MFU",
             "bubble", "peak memory"]]
    for i, r in enumerate(res.best, 1):
        L = r.layout
        sched = L.schedule + (f" v{L.virtual_stages}" if L.takes_virtual_stages else "")
        rows.append([i, f"dp{L.dp} pp{L.pp} tp{L.tp}" + (" sp" if L.sequence_parallel else ""), L.world, sched,
                     f"{L.microbatches} x {L.microbatch_size}", L.recompute, L.zero,
                     "balanced" if L.balanced else "even", format_seconds(r.step_time), format_count(r.tokens_per_s),
                     "-" if r.mfu is None else f"{100 * r.mfu:.1f}%", f"{100 * r.bubble:.1f}%",
                     f"{format_bytes(r.peak_bytes)} (rank {r.peak_rank})"])
    from pipegpt.schedule.render import text_table

    lines.append(text_table(rows, right={0, 2, 6, 8, 9, 10, 11}, rule=True))
    for i, r in enumerate(res.best, 1):
        L, b = r.layout, r.breakdown
        lines += ["", f"#{i} {L.short()}",
                  f"  peak memory {format_bytes(r.peak_bytes)} of {format_bytes(c.memory_bytes)} on pipeline rank "
                  f"{r.peak_rank}: {memory_line(r.memory[r.peak_rank])}",
                  f"  busiest rank {b['rank']}: compute {format_seconds(b['compute'])}"
                  + (f" (recomputation {format_seconds(b['recompute'])})" if b["recompute"] else "")
                  + (f", tensor-parallel collectives {format_seconds(b['tp_comm'])}" if b["tp_comm"] else "")
                  + f", idle {format_seconds(b['idle'])}"
                  + (f"; gradient all-reduce exposed {format_seconds(b['dp_exposed'])}" if b["dp_exposed"] > 0 else "")
                  + f"; after the last action {format_seconds(b['after'])}",
                  f"  layers per stage {','.join(map(str, L.layers_per_stage))}",
                  f"  {L.command(r.model, precision)}"]
        if L.world > c.gpus_per_node:
            lines.append(f"  (on {-(-L.world // c.gpus_per_node)} nodes: torchrun --nnodes "
                         f"{-(-L.world // c.gpus_per_node)} --nproc-per-node {c.gpus_per_node} ... -m pipegpt run ...)")
    if req.explain and res.best:
        best = res.best[0]
        lines += ["", "why the others lost (against #1):"]
        for i, r in enumerate(res.best[1:], 2):
            lines.append(f"  #{i} {r.layout.short()}: {explain(r, best)}")
        for s, r in res.runners.items():
            if isinstance(r, Result):
                lines.append(f"  best {s}: {r.layout.short()}: {explain(r, best)}")
            else:
                lines.append(f"  {s}: {r}")
        lighter = sorted((x for x in res.refusals if x.pp * x.tp < best.layout.pp * best.layout.tp),
                         key=lambda x: (-x.pp * x.tp, x.needs))
        if lighter:
            lines.append("  less model parallelism does not fit (the nearest layouts):")
            seen = set()
            for x in lighter:
                if (x.pp, x.tp) in seen:
                    continue
                seen.add((x.pp, x.tp))
                lines.append("    " + refusal_line(x, c.memory_bytes))
                if len(seen) == 4:
                    break
    return "\n".join(lines)


def as_json(res: SearchResult) -> dict:
    req, c = res.request, res.request.cluster
    from dataclasses import asdict

    return {
        "model": asdict(req.model), "batch_size": req.batch_size, "tokens_per_step": req.batch_size * req.model.seq_len,
        "cluster": asdict(c), "costs": req.costs.describe(), "stats": res.stats,
        "plans": [r.as_dict(c.precision) for r in res.best],
        "runners": {s: (r.as_dict(c.precision) if isinstance(r, Result) else r) for s, r in res.runners.items()},
        "why": ({f"#{i}": explain(r, res.best[0]) for i, r in enumerate(res.best[1:], 2)} if res.best else {}),
        "refused": [{"dp": r.dp, "pp": r.pp, "tp": r.tp, "needs_bytes": r.needs, "parts": r.parts, "variant": r.what}
                    for r in res.refusals[:20]],
    }
