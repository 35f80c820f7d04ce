"""Search layouts, schedules, microbatching and recomputation for the fastest step that fits.

What is searched, for a model, a global batch and a cluster:

* dp x pp x cp x tp over at most the cluster's GPUs (only those given with --dp, --stages, --cp, --tp): tp
  divides the GPUs of a node (a tensor-parallel group never leaves its node) and passes
  pipegpt.config.validate_tp (padding the vocabulary to 64 where that is what tp needs, as `pipegpt run
  --pad-vocab` does; for Llama also: tp divides n_kv_head or is a multiple of it, and divides the MLP width,
  else the layout is not a candidate); dp divides the batch; cp (context parallelism) is a power of two that
  pipegpt.config.validate_cp allows (seq_len cut into 2 x cp chunks, no dropout) leaving a rank at least
  MIN_CP_TOKENS (2048) of a sequence (so never at seq_len < 4096 unless --cp), smallest first: a cp group
  inside a node (tp x cp divides the GPUs per node: the rank order puts it there) passes K/V over NVLink, a
  larger one over the inter-node link, which the costs charge. With cp > 1 both ways of moving K/V are
  weighed (only --cp-comm's when given): the ring hides its transfers behind the blocks' attention but merges
  every block's partial output and holds two K/V blocks in flight; the all-gather's transfers show, and it
  holds the whole sequence's K/V for a moment. With few kv heads (GQA) the gather is small and can win.
* with experts, ep carved out of dp x cp x tp (every size dividing it and the expert count; --ep: one), tp > 1
  with sequence parallelism only (pipegpt.costs.experts; docs/moe-planning.md).
* every schedule of the registry (pipegpt.schedule.SCHEDULES): interleaved-1f1b with v in {2, 4}, zbv and
  dualpipev with their 2 stages per rank; model stages <= n_layer. With pp = 1 only 1f1b (gradient
  accumulation: the other schedules are the same work in another order, or need two ranks). FSDP per block:
  where dp x cp > 1 and pp <= FSDP_MAX_PP, also interleaved-1f1b with v = 8, 16, ... and n_layer / pp (one
  block per stage, at pp 1 too), under ZeRO-3's microbatch policy only (a rank gathers one or two small stages
  at a time; at another level so many stages per rank only add work).
* microbatch size: every divisor of the replica's batch (m = batch / (dp x size)), the schedule's own rules
  (ScheduleError) refusing what they refuse; at most MAX_ACTIONS actions per plan.
* recomputation none / selective / full; ZeRO 0-3 when dp x cp > 1, level 3 under --unshard step and, where a
  rank holds more than two stages, microbatch (pipegpt.costs.memory: what each holds at the peak; a level's
  time: the reduce-scatter instead of the all-reduce from level 1, the all-gather after the update at 1-2 and
  3 step, the microbatch policy's gathers per group of compute, each hidden behind the group before it
  (stage_costs.exposed_gathers)); the fastest that fits wins, ties going to the lower level; sequence
  parallelism when tp > 1 (in this model it moves the same bytes as tensor parallelism without it and holds
  less, so it is taken whenever validate_tp allows it, the other way otherwise); plan --zero N: only level N;
* the layer split: even (what `pipegpt run` does without --layers-per-stage), or balanced by cost
  (pipegpt.costs.balance: embedding and head counted, for the schedule's placement) when that differs.

How it stays fast (branch and bound over two levels):

* a layout's bound: a replica's least work (per-sequence costs, no recomputation) spread evenly over its pp
  ranks. Layouts are expanded into candidates in the order of these bounds, and only while a bound is below
  the K-th best step time found so far.
* a candidate's bound, valid for ANY schedule on its placement: for each rank r, the forward chain that must
  reach its first stage before it can start, plus all its work (m microbatches), plus what must follow its
  last action -- the backward chain below it (less the W work that may fill it, for split-backward plans) or
  its smallest stage's gradient all-reduce -- max over ranks, plus the time after the step. For 1F1B, GPipe
  and interleaved 1F1B at uniform costs it equals the simulator's makespan, so few candidates get simulated.
* memory before time: a family whose weights, gradients and optimizer state (the least over its ZeRO
  choices, at one microbatch) plus one microbatch per stage does not fit is dropped with all its larger
  microbatches; a popped candidate is checked against its held activations at the schedule's peak (live sets
  read once from the plan's action order, then one matrix-vector product per candidate) and then against
  pipegpt.costs.memory's full breakdown, before it is simulated.
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
from dataclasses import dataclass, replace
from functools import lru_cache

from pipegpt.arch import layer_kinds, layer_mix, stage_ranges
from pipegpt.config import CP_COMM, ConfigError, ModelConfig, validate_cp
from pipegpt.dims import AXES, ParallelDims, Sharding
from pipegpt.model.flops import flops_per_token
from pipegpt.schedule import SCHEDULES, ScheduleError
from pipegpt.schedule.simulate import Costs, simulate

from pipegpt.costs import experts, memory as memory_model
from pipegpt.costs.balance import even_layers
from pipegpt.costs.cost import Shape
from .bounds import layout_lower_bound, makespan_lower_bound
from .candidates import (MAX_ACTIONS, Candidate, Layout, LayoutChoice, Refusal, Request, Result, SearchResult,
                         memory_parts, zero_choices, zero_name)
from pipegpt.costs.stage_costs import PER_SEQUENCE, StageCosts
from .structure import compute_groups, held_peaks, schedulable, splits_backward, stage_placement, structure

RECOMPUTE_ORDER = ("none", "selective", "full")
_check_tp = memory_model._check_tp  # validate_tp, and the shapes the memory model assumes
# Fewer tokens per context-parallel rank are not searched (--cp still takes them): a ring step's attention
# gets too small to hide its transfer and launches, and the search's time grows with every cp tried.
MIN_CP_TOKENS = 2048
FSDP_MAX_PP = 8  # pipeline ranks up to which FSDP per block (interleaved, many one-block stages per rank) is tried
ROUND_DIGITS = 3


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


class Search:
    """One request's search: run() is the branch and bound; layouts(), expand() and evaluate() its steps."""

    def __init__(self, req: Request):
        self.req, self.model, self.cluster = req, req.model, req.cluster
        self.precision = req.cluster.precision
        self.stage_costs = {name: StageCosts(req.cluster, req.costs, name) for name in CP_COMM}  # by cp_comm
        self.sim_cache: dict = {}
        self.stats = {"layouts": 0, "candidates": 0, "memory_refused": 0, "schedule_refused": 0,
                      "simulated": 0, "cache_hits": 0, "popped": 0, "seconds": 0.0}
        self.refusals: dict = {}  # ParallelDims -> Refusal with the least memory seen
        self._tp_models: dict = {}  # tp -> tp_model's answer

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
    def tp_choices(self, **faster: int) -> list[int]:
        """Divisors of a node's GPUs that the model splits over (padding its vocabulary where that is what tp needs)."""
        g = self.cluster.gpus_per_node
        return [t for t in range(1, g + 1) if g % t == 0 and self.tp_model(t) is not None]

    def tp_model(self, tp: int) -> tuple[ModelConfig, bool] | None:
        """(the model as it runs on tp, whether its vocabulary is padded), or None where it does not split."""
        if tp not in self._tp_models:
            model, padded = self.model, replace(self.model, pad_vocab_to=64)
            sp = bool(model.n_experts)  # experts with tp: sequence parallelism (pipegpt.costs.experts)
            self._tp_models[tp] = (model, False) if _passes(_check_tp, model, tp, sp) else (padded, True) if (
                model.pad_vocab_to == 1 and not 64 % tp and _passes(_check_tp, padded, tp, sp)) else None
        return self._tp_models[tp]

    def cp_choices(self, tp: int, **faster: int) -> list[int]:
        """Context-parallel sizes to consider with tp: --cp's, else 1, 2, 4, ... while validate_cp allows them,
        cp x tp GPUs exist and a rank keeps at least MIN_CP_TOKENS of a sequence."""
        given = self.req.only.get("cp")
        out = []
        for cp in ([given] if given is not None else (1 << i for i in range(self.cluster.gpus.bit_length()))):
            if cp * tp > self.cluster.gpus or (given is None and cp > 1 and self.model.seq_len // cp < MIN_CP_TOKENS):
                break
            try:
                validate_cp(self.model, cp)
            except ConfigError:
                break
            out.append(cp)
        return out

    def pp_choices(self, **faster: int) -> range:
        """Up to one stage per layer, on the GPUs the faster axes leave."""
        return range(1, min(self.model.n_layer, self.cluster.gpus // math.prod(faster.values())) + 1)

    def dp_choices(self, **faster: int) -> tuple:
        return _divisors(self.req.batch_size)

    def ep_choices(self, dp: int, cp: int, tp: int, **others: int) -> tuple:
        """Expert parallelism carved out of dp x cp x tp (pipegpt.costs.experts): --ep's, else every size
        dividing both that product and the expert count (1 alone for a dense model)."""
        out, given = experts.ep_choices(self.model, dp, cp, tp), self.req.only.get("ep")
        return out if given is None else tuple(e for e in out if e == given)

    def _sizes(self, axes: tuple, chosen: dict):
        """Every choice of sizes along `axes` after `chosen` (each axis's from its <axis>_choices, given the sizes
        chosen before it), the first chosen first."""
        if not axes:
            yield chosen
            return
        for size in getattr(self, f"{axes[0]}_choices")(**chosen):
            yield from self._sizes(axes[1:], {**chosen, axes[0]: size})

    def layouts(self) -> list[LayoutChoice]:
        """The layouts to consider, each with its sequence parallelism and model as run: the axes chosen from the
        fastest (tp, whose choices bound the others') to the slowest, in rank order's reverse."""
        req, c = self.req, self.cluster
        out, sp = [], {}
        for sizes in self._sizes(tuple(reversed(AXES)), {}):
            sh = Sharding(**sizes)
            if sh.world_size > c.gpus or (req.exact_gpus and sh.world_size != c.gpus) or any(
                    req.only.get(axis) not in (None, size) for axis, size in sizes.items()) \
                    or (req.zero and memory_model.gradient_group(sh) == 1):  # ZeRO shards over dp x cp
                continue
            m_tp, pad = self.tp_model(sh.tp)
            if (sh.tp, sh.cp) not in sp:  # taken whenever validate_tp allows it (see the module docstring)
                sp[sh.tp, sh.cp] = sh.tp > 1 and _passes(_check_tp, m_tp, sh.tp, True, sh.cp)
            sh = sh._replace(sequence_parallel=sp[sh.tp, sh.cp])
            for ep in self.ep_choices(**sizes) if sh.tp == 1 or sh.sequence_parallel or not m_tp.n_experts else ():
                out += [LayoutChoice(experts.carve(sh, ep), m_tp, pad, name) for name in self.cp_comms(m_tp, sh)]
        return out

    def cp_comms(self, model: ModelConfig, sharding: Sharding) -> tuple:
        """How K/V may travel on a layout: --cp-comm's way; else the ring, and the all-gather where a block (of
        any layer kind) takes no longer with it (with or without recomputation, at one sequence per microbatch or
        many): where every block takes longer no plan of it wins, for it also holds more (the gathered K/V against
        two blocks)."""
        if self.req.cp_comm or sharding.cp == 1:
            return (self.req.cp_comm or "ring",)

        def block(name, rc, mbs, kind):
            p = self.stage_costs[name].layer_pieces(model, sharding, rc, mbs)[kind]
            return (p.f + p.b + p.comm_f + p.comm_b) / mbs

        if any(block("allgather", rc, mbs, kind) <= block("ring", rc, mbs, kind) for rc in ("none", "full")
               for mbs in (1, PER_SEQUENCE) for kind in dict.fromkeys(layer_kinds(model))):
            return CP_COMM
        return ("ring",)

    def groups(self, pp, sharded: bool = False):
        """Placements to consider with pp ranks: (placement, v argument, model stages per rank, schedules,
        per_block), each schedule as (name, splits its backward). sharded (dp x cp > 1, ZeRO-3 allowed): also
        interleaved 1F1B with more stages per rank (8, 16, ... and one block per stage) at pp <= FSDP_MAX_PP,
        per_block: weighed under ZeRO-3's microbatch policy only (FSDP per block: a rank gathers one or two
        small stages at a time), the only setting in which so many stages per rank can pay."""
        out: dict = {}
        for name in self.req.schedules:
            spec = SCHEDULES[name]
            if pp == 1 and name != "1f1b":
                continue
            options = [(v, v) for v in (2, 4)] if spec.takes_virtual_stages else [(None, spec.default_virtual_stages)]
            for v, vs in options:
                if pp * vs <= self.model.n_layer:
                    placement = stage_placement(name, pp, v)
                    out.setdefault((placement, v, vs, False), []).append((name, splits_backward(name)))
        if sharded and pp <= FSDP_MAX_PP and "interleaved-1f1b" in self.req.schedules:
            most = self.model.n_layer // pp
            for v in sorted({1 << i for i in range(3, most.bit_length())} | {most}):
                if v > 4:
                    out[(stage_placement("interleaved-1f1b", pp, v), v, v, True)] = [("interleaved-1f1b", False)]
        return [(placement, v, vs, names, per_block) for (placement, v, vs, per_block), names in out.items()]

    def _refuse(self, dims: ParallelDims, needs, parts, what):
        old = self.refusals.get(dims)
        if old is None or needs < old.needs:
            self.refusals[dims] = Refusal(dims, needs, parts, what)

    def layout_bound(self, mesh: LayoutChoice) -> float:
        """A lower bound on any plan of the layout (bounds.layout_lower_bound)."""
        cs, model, sh = self.stage_costs[mesh.cp_comm], mesh.model, mesh.sharding
        per = cs.layer_pieces(model, sh, "none", PER_SEQUENCE)
        blocks = [(n, per[kind]) for kind, n in layer_mix(model, range(model.n_layer))]
        return layout_lower_bound(cs.pieces(model, sh, "none", PER_SEQUENCE), blocks, self.req.batch_size // sh.dp,
                                  sh.pp)

    def expand(self, mesh: LayoutChoice):
        """The layout's candidates with their lower bounds: (bound, Candidate)."""
        sh, dims, m_tp = mesh.sharding, mesh.dims, mesh.model
        dp, pp = sh.dp, sh.pp
        cs = self.stage_costs[mesh.cp_comm]
        cap, r_bytes = self.cluster.usable_bytes, 4
        b = self.req.batch_size // dp
        group = memory_model.gradient_group(sh)
        for placement, v, vs, schedules, per_block in self.groups(pp, group > 1 and self.req.zero in (None, 3)):
            zoned = zero_choices(sh, self.req.zero, vs, per_block)
            if not zoned:
                continue
            sharded = any(z for z, _ in zoned)
            S = len(placement)
            for balanced in (False, True):
                for rc in RECOMPUTE_ORDER:
                    layers = cs.split(m_tp, sh, rc, placement, balanced)
                    if layers is None:
                        continue
                    params = cs.stage_params(m_tp, sh, layers)
                    per_rank = [[] for _ in range(pp)]
                    for s, r in enumerate(placement):
                        per_rank[r].append(params[s])
                    # the least state over the ZeRO choices (one microbatch: ZeRO-2/3's least gradients)
                    parts = [min((memory_model.zero_state(x, group, z, u, 1) for z, u in zoned), key=sum)
                             for x in per_rank]
                    static = [r_bytes * sum(x) for x in parts]
                    if max(static) > cap:
                        r = max(range(pp), key=static.__getitem__)
                        self._refuse(dims, static[r], dict(zip(("weights", "gradients", "optimizer"),
                                                               (r_bytes * x for x in parts[r]))),
                                     "weights, gradients and optimizer state alone" + (" (ZeRO)" if sharded else ""))
                        self.stats["memory_refused"] += 1
                        continue
                    dpc = cs.dp_comm(params, sh._replace(zero=1) if sharded else sh)  # the least: a reduce-scatter
                    tensors = cs.stage_tensors(m_tp, layers)
                    after = min(cs.after_time(m_tp, placement, params, tensors, zs, layers, u)
                                for (_, u), zs in zoned.items())
                    for mbs in _divisors(b):
                        m = b // mbs
                        if 3 * m * S > MAX_ACTIONS:
                            continue
                        F, B, W, TP, saved, _, msg = cs.vectors(m_tp, sh, rc, mbs, layers)
                        least = list(static)
                        for s, r in enumerate(placement):
                            least[r] += saved[s]  # every stage of a rank holds a microbatch at some moment
                        if max(least) > cap:
                            r = max(range(pp), key=least.__getitem__)
                            self._refuse(dims, least[r], {
                                **dict(zip(("weights", "gradients", "optimizer"), (r_bytes * x for x in parts[r]))),
                                "activations": least[r] - static[r]},
                                f"{rc} recomputation, {'ZeRO, ' if sharded else ''}"
                                f"{mbs} sequence"
                                f"{'s' if mbs > 1 else ''} per microbatch")
                            self.stats["memory_refused"] += 1
                            break  # larger microbatches hold more
                        comm = cs.message_time(msg, placement, sh)
                        bounds = {}
                        for name, split in schedules:
                            if split not in bounds:
                                bounds[split] = makespan_lower_bound(F, B, W, TP, comm, dpc, placement, m,
                                                                     split) + after
                            self.stats["candidates"] += 1
                            yield bounds[split], Candidate(sh, mesh.pad_vocab, name, v, vs, mbs, rc, balanced,
                                                           mesh.cp_comm, per_block)

    def evaluate(self, cand: Candidate) -> _Eval | None:
        """Memory (exact), then the simulator; None when it does not fit or the schedule refuses."""
        sh = cand.sharding
        dp, pp = sh.dp, sh.pp
        schedule, v, mbs, rc = cand.schedule, cand.v, cand.microbatch_size, cand.recompute
        cs = self.stage_costs[cand.cp_comm]
        cap = self.cluster.usable_bytes
        m_tp = replace(self.model, pad_vocab_to=64) if cand.pad_vocab else self.model
        m = self.req.batch_size // dp // mbs
        placement = stage_placement(schedule, pp, v)
        layers = cs.split(m_tp, sh, rc, placement, cand.balanced)
        if not schedulable(schedule, pp, m, v):  # the verdict cached apart from the plan (its cache turns over)
            self.stats["schedule_refused"] += 1
            return None
        F, B, W, TP, saved, deferred, msg = cs.vectors(m_tp, sh, rc, mbs, layers)
        zoned = zero_choices(sh, self.req.zero, cand.virtual_stages, cand.per_block)
        what = lambda z: (f"{schedule}, {rc} recomputation, {zero_name(*z)}{mbs} sequence"  # noqa: E731
                          f"{'s' if mbs > 1 else ''} per microbatch")
        # A lower bound first (state + held activations, no walk over the plan), then the memory model.
        held = held_peaks(schedule, pp, m, v, saved, deferred)
        S, ranges = len(layers), stage_ranges(layers)  # which layers a stage holds: their kinds count
        held_stages = [[(ranges[s], s == 0, s == S - 1) for s, q in enumerate(placement) if q == r] for r in range(pp)]
        states = {z: [memory_model.state_bytes(m_tp, x, sharding=zs, precision=self.precision, unshard=z[1],
                                               microbatches=m, recompute=rc) for x in held_stages]
                  for z, zs in zoned.items()}
        least = {z: [x.weights + x.gradients + x.optimizer + h for x, h in zip(states[z], held)] for z in zoned}
        if min(max(least[z]) for z in zoned) > cap:
            self.stats["memory_refused"] += 1
            z = min(zoned, key=lambda z: max(least[z]))
            r = max(range(pp), key=least[z].__getitem__)
            x = states[z][r]
            self._refuse(cand.dims, least[z][r], {"weights": x.weights, "gradients": x.gradients,
                                                  "optimizer": x.optimizer, "activations": held[r]}, what(z))
            return None
        base = memory_model.plan_memory(m_tp, structure(schedule, pp, m, v).plan, layers, microbatch_size=mbs,
                                        sharding=sh, recompute=rc, precision=self.precision, cp_comm=cand.cp_comm)
        mem = {z: [replace(x, weights=states[z][x.rank].weights, gradients=states[z][x.rank].gradients,
                           optimizer=states[z][x.rank].optimizer) for x in base] for z in zoned}
        fits = [z for z, ranks in mem.items() if max(x.total for x in ranks) <= cap]
        if not fits:
            self.stats["memory_refused"] += 1
            z = min(mem, key=lambda z: max(x.total for x in mem[z]))
            worst = max(mem[z], key=lambda x: x.total)
            self._refuse(cand.dims, worst.total, memory_parts(worst), what(z))
            return None
        params = cs.stage_params(m_tp, sh, layers)
        comm = cs.message_time(msg, placement, sh)
        tensors = cs.stage_tensors(m_tp, layers)
        gathers = cs.gather_times(params, sh) if any(z == (3, "microbatch") for z in fits) else None
        best = None
        # the sharded levels first (a reduce-scatter, the least reduction): zero 0 is simulated only if it can win
        for z in sorted(fits, key=lambda z: (not z[0], z)):
            after = cs.after_time(m_tp, placement, params, tensors, zoned[z], layers, z[1])
            if z == (3, "microbatch"):
                after += cs.exposed_gathers(compute_groups(schedule, pp, m, v), F, B, W, TP, gathers)
            if best is not None and not z[0] and best[3] + after >= best[0]:
                continue  # its all-reduce makes a makespan no shorter than the reduce-scatter's
            makespan, bubble = self.simulate(schedule, pp, m, v, F, B, W, TP, comm, cs.dp_comm(params, zoned[z]))
            if best is None or (makespan + after, z) < best[:2]:
                best = (makespan + after, z, bubble, makespan)
        step, (zero, unshard), bubble, makespan = best
        layout = Layout(**dict(zip(AXES, sh.sizes)), schedule=schedule, virtual_stages=cand.virtual_stages,
                        microbatches=m, microbatch_size=mbs, recompute=rc, zero=zero,
                        sequence_parallel=sh.sequence_parallel, layers_per_stage=tuple(layers), balanced=cand.balanced,
                        pad_vocab=cand.pad_vocab, cp_comm=cand.cp_comm,
                        unshard="microbatch" if unshard == "microbatch" else None, ep=experts.expert_ranks(sh))
        return _Eval(step, layout, makespan, bubble, step - makespan, max(x.total for x in mem[(zero, unshard)]), m_tp)

    def run(self) -> SearchResult:
        t0 = time.perf_counter()
        req = self.req
        layouts = self.layouts()
        self.stats["layouts"] = len(layouts)
        heap = [(self.layout_bound(x), i, "layout", x) for i, x in enumerate(layouts)]
        heapq.heapify(heap)
        counter = len(heap)
        top: dict = {}  # (axes' sizes, schedule, v) -> its best _Eval: one plan per layout and schedule is shown
        by_schedule: dict = {}
        fitted: dict = {}  # a candidate's family (Candidate.family) -> True once one fits
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
        done: set = set()  # the ParallelDims of the layouts expanded
        pushed: dict = {}  # ParallelDims -> candidates pushed
        refused: dict = {}  # ParallelDims -> candidates refused (memory or schedule)
        while heap:
            lb, _, what, item = heapq.heappop(heap)
            if lb >= bar() * (1 - 1e-9):
                break
            if what == "layout":
                expanded += 1
                dims = item.dims
                done.add(dims)
                for bound, cand in self.expand(item):
                    counter += 1
                    pushed[dims] = pushed.get(dims, 0) + 1
                    heapq.heappush(heap, (max(bound, lb), counter, "candidate", cand))
                continue
            cand = item
            if lb >= bar(cand.schedule) * (1 - 1e-9):
                continue
            family = cand.family
            if fitted.get(family):  # a lighter recomputation of the same candidate fits, and is faster
                continue
            self.stats["popped"] += 1
            ev = self.evaluate(cand)
            if ev is None:
                refused[cand.dims] = refused.get(cand.dims, 0) + 1
                continue
            fitted[family] = True
            L = ev.layout
            slot = (L.sharding.sizes, L.schedule, L.virtual_stages)
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
            limit = best[0].layout.sharding.replica_size
            for mesh in layouts:
                if mesh.dims not in done and mesh.sharding.replica_size < limit:
                    done.add(mesh.dims)
                    pushed[mesh.dims] = sum(1 for _ in self.expand(mesh))
                    refused[mesh.dims] = 0
        refusals = sorted((r for key, r in self.refusals.items()
                           if key in done and refused.get(key, 0) == pushed.get(key, 0)),
                          key=lambda r: (r.model_parallel, r.needs))
        self.stats["seconds_total"] = time.perf_counter() - t0
        return SearchResult(req, best, runners, refusals, dict(self.stats))

    # --- the exact numbers of a chosen plan ----------------------------------------------------------
    def finish(self, ev: _Eval) -> Result:
        """Simulate a plan with its exact costs and gather everything printed about it."""
        L, model, c, cs = ev.layout, ev.model, self.cluster, self.stage_costs[ev.layout.cp_comm]
        v = L.virtual_stages if L.takes_virtual_stages else None
        st = structure(L.schedule, L.pp, L.microbatches, v)
        placement = st.plan.stage_to_rank
        layers = list(L.layers_per_stage)
        sh = L.sharding
        F, B, W, TP, saved, deferred, msg = cs.vectors(model, sh, L.recompute, L.microbatch_size, layers)
        params = cs.stage_params(model, sh, layers)
        comm = cs.message_time(msg, placement, sh)
        dpc = cs.dp_comm(params, sh)
        costs = Costs(tuple(F), tuple(B), tuple(W), comm, tuple(saved), tuple(TP), tuple(dpc))
        timeline = simulate(st.plan, costs)
        makespan = float(timeline.makespan)
        tensors = cs.stage_tensors(model, layers)
        after = cs.after_time(model, placement, params, tensors, sh, layers, L.unshard_policy)
        gathers = 0.0
        if L.zero >= 3 and L.unshard_policy == "microbatch" and memory_model.gradient_group(sh) > 1:
            gathers = cs.exposed_gathers(compute_groups(L.schedule, L.pp, L.microbatches, v), F, B, W, TP,
                                         cs.gather_times(params, sh))
            after += gathers
        step = makespan + after
        mem = memory_model.plan_memory(model, st.plan, layers, microbatch_size=L.microbatch_size, sharding=sh,
                                       recompute=L.recompute, precision=self.precision, cp_comm=L.cp_comm,
                                       unshard=L.unshard_policy)
        memory = [memory_parts(x) for x in mem]
        peak_rank = max(range(len(memory)), key=lambda r: memory[r]["total"])
        tokens = self.req.batch_size * model.seq_len

        mfu = flops_per_token(model) * tokens / step / (L.world * c.peak_flops) if c.peak_flops else None
        # Where the busiest rank's time goes.
        busy = timeline.busy_per_rank
        r = max(range(L.pp), key=lambda r: busy[r])
        tp_time = sum(2 * TP[s] for s in range(len(placement)) if placement[s] == r) * L.microbatches
        rc_extra = 0.0
        if L.recompute != "none":
            B0 = cs.vectors(model, sh, "none", L.microbatch_size, layers)[1]
            rc_extra = sum(B[s] - B0[s] for s in range(len(placement)) if placement[s] == r) * L.microbatches
        # context parallelism's exposed K/V time (inside the collectives the simulator charges): out of tp_time
        blocks: dict = {}  # the rank's blocks of each layer kind, over the step's microbatches
        for s, stage in enumerate(stage_ranges(layers)):
            if placement[s] == r:
                for kind, n in layer_mix(model, stage):
                    blocks[kind] = blocks.get(kind, 0) + n * L.microbatches
        kinds, cp_time, ep_time = _kind_parts(cs, model, sh, L.recompute, L.microbatch_size), 0.0, 0.0
        a2a = cs.expert_comm(model, sh, L.recompute, L.microbatch_size)  # expert parallelism's, out of tp_time too
        for kind, n in blocks.items():
            (lc, (cp_f, cp_b)), (ep_f, ep_b) = kinds[kind], a2a.get(kind, (0.0, 0.0))
            # the all-to-alls forward and backward (full recomputation does not repeat them)
            cp_time, ep_time = cp_time + n * (cp_f + cp_b), ep_time + n * (ep_f + min(ep_f, ep_b))
            tp_time -= 2 * n * (min(lc.comm_f, lc.comm_b) - min(lc.comm_f - cp_f - ep_f, lc.comm_b - cp_b - ep_b))
        end = float(timeline.end_time - timeline.start_time)
        breakdown = {"compute": float(busy[r]) - tp_time - cp_time - ep_time, "recompute": rc_extra, "tp_comm": tp_time,
                     "cp_comm": cp_time, "idle": end - float(busy[r]), "dp_exposed": makespan - end,
                     "after": after - gathers, "gathers": gathers, "rank": r, **({"ep_comm": ep_time} if a2a else {})}
        summary = timeline.summary()
        return Result(L, model, step, makespan, after, float(timeline.bubble_fraction), tokens / step, mfu, memory,
                      peak_rank, breakdown, costs, {k: summary[k] for k in ("bubble_fraction_per_rank",
                                                                           "peak_live_microbatches_per_rank")})


def _order(ev):
    """Faster first; steps within 0.1% are ties, which go to fewer GPUs, then less memory."""
    step = ev.step if isinstance(ev, _Eval) else ev.step_time
    peak = ev.peak if isinstance(ev, _Eval) else ev.peak_bytes
    return (round(math.log(step) / math.log1p(1e-3)) if step > 0 else 0, ev.layout.world, peak, step,
            ev.layout.short())


def search(req: Request) -> SearchResult:
    """The best plans for a request (see the module docstring)."""
    return Search(req).run()


def evaluate_layout(req: Request, layout: Layout) -> Result:
    """One given layout's predictions, exact (no search): what `search` would print for it.

    layout.layers_per_stage may be empty (the even split). Raises ConfigError when the schedule refuses it."""
    s = Search(req)
    model = replace(req.model, pad_vocab_to=64) if layout.pad_vocab else req.model
    if not layout.layers_per_stage:
        layout = replace(layout, layers_per_stage=tuple(even_layers(model.n_layer, layout.stages)))
    v = layout.virtual_stages if layout.takes_virtual_stages else None
    try:
        structure(layout.schedule, layout.pp, layout.microbatches, v)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    return s.finish(_Eval(0.0, layout, 0.0, 0.0, 0.0, 0.0, model))


def _kind_parts(cs: StageCosts, model: ModelConfig, sharding: Sharding, rc: str, mbs: int) -> dict:
    """{layer kind: (one block's Piece, the part of its comm_f and comm_b that is context parallelism's)}."""
    shape = Shape(sharding.tensor_cut, rc, mbs, cs.cp_comm)
    return {kind: (p, cs.cost.context_parallel(kind.block_model(model), shape))
            for kind, p in cs.layer_pieces(model, sharding, rc, mbs).items()}


def _passes(check, *args) -> bool:
    try:
        check(*args)
    except ConfigError:
        return False
    return True


def _round(x: float) -> float:
    if x == 0:
        return 0.0
    return round(x, ROUND_DIGITS - 1 - int(math.floor(math.log10(abs(x)))))


@lru_cache(maxsize=None)
def _divisors(n: int) -> tuple:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))

