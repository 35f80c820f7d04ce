"""A candidate's numbers per stage, from the per-layer costs (pipegpt.costs.cost) and the memory model
(pipegpt.costs.memory): F, B, W and tensor-parallel time, held and deferred activation bytes, parameters,
one message's time, the gradient all-reduce and what follows the last action; and the layer split.

Everything per stage is a sum over its layers, each its kind's (pipegpt.arch.layer_kinds: one kind, dense, for every
model today), plus a fixed part for the embedding and the head, so each quantity is computed once per (model, layer
kind, the way a rank's tensors are cut, recompute, microbatch size) and composed for any split. A candidate's layout
comes as one pipegpt.dims.Sharding. One StageCosts serves one search: its caches hold for one cluster, one cost
model and one cp_comm (how K/V travel with cp > 1)."""
from __future__ import annotations

from pipegpt.arch import MOE, block_shapes, embedding_shapes, head_shapes, layer_kinds, layer_mix, stage_ranges
from pipegpt.config import ModelConfig
from pipegpt.dims import Sharding

from . import experts, memory as memory_model
from .balance import balance_layers, even_layers
from .cost import AnalyticalCosts, Shape
from .devices import Cluster

PER_SEQUENCE = 1 << 20  # sequences per microbatch: so many that only the per-sequence parts of a cost remain


class StageCosts:
    def __init__(self, cluster: Cluster, cost: AnalyticalCosts, cp_comm: str = "ring"):
        self.cluster, self.cost, self.cp_comm = cluster, cost, cp_comm
        self.precision = cluster.precision
        self._pieces: dict = {}
        self._splits: dict = {}
        self._crossings: dict = {}
        self._linear: dict = {}
        self._params: dict = {}
        self._kind_pieces: dict = {}
        self._experts: dict = {}

    def pieces(self, model: ModelConfig, sharding: Sharding, recompute: str, mbs: int):
        key = (model.padded_vocab_size, sharding.tensor_cut, recompute, mbs)
        hit = self._pieces.get(key)
        if hit is None:
            shape = Shape(sharding.tensor_cut, recompute, mbs, self.cp_comm)
            hit = self._pieces[key] = self.cost.pieces(model, shape)
        return hit

    def layer_pieces(self, model: ModelConfig, sharding: Sharding, recompute: str, mbs: int) -> dict:
        """{layer kind: one block of it (a cost.Piece)} for the model's kinds; a kind's block costs what a model
        of its block shape's does, an MoE block's with expert parallelism's all-to-alls and imbalance too (where
        the layout's ep groups land: sharding is the whole layout's)."""
        out = {}
        on_node = self.ep_ranks_on_node(sharding)
        for kind in dict.fromkeys(layer_kinds(model)):
            block = kind.block_model(model)
            if block is model:
                out[kind] = self.pieces(model, sharding, recompute, mbs).layer
                continue
            key = (kind, model.padded_vocab_size, sharding.tensor_cut, recompute, mbs, on_node)
            if key not in self._kind_pieces:
                shape = Shape(sharding.tensor_cut, recompute, mbs, self.cp_comm)
                piece = self.cost.pieces(block, shape).layer
                self._kind_pieces[key] = self.cost.with_experts(piece, block, shape, on_node) if kind is MOE else piece
            out[kind] = self._kind_pieces[key]
        return out

    def expert_comm(self, model: ModelConfig, sharding: Sharding, recompute: str, mbs: int) -> dict:
        """{MoE layer kind: its block's expert all-to-alls, (forward, backward) seconds} where ep carves ({} else):
        the part of layer_pieces' comm_f and comm_b that is expert parallelism's."""
        if not sharding.carved:
            return {}
        shape = Shape(sharding.tensor_cut, recompute, mbs, self.cp_comm)
        out = {}
        for kind, piece in self.layer_pieces(model, sharding, recompute, mbs).items():
            if kind is MOE:
                base = self.cost.pieces(kind.block_model(model), shape).layer
                out[kind] = (piece.comm_f - base.comm_f, piece.comm_b - base.comm_b)
        return out

    def ep_ranks_on_node(self, sharding: Sharding) -> int:
        """The fewest ranks of an ep group that share one's node (pipegpt.costs.experts.ranks_on_node; 1 without ep)."""
        if not sharding.carved:
            return 1
        if getattr(self.cost, "rank_order", "pipegpt") == "megatron":  # a what-if: Megatron-Core's order
            return experts.megatron_ranks_on_node(experts.expert_ranks(sharding), self.cluster.gpus_per_node)
        return experts.ranks_on_node(sharding.dims, self.cluster.gpus_per_node)

    def message_time(self, nbytes, placement, sharding: Sharding) -> float:
        """The mean time of one message over the placement's links between ranks, in the slowest replica."""
        key = (placement, sharding)
        hit = self._crossings.get(key)
        if hit is None:
            links = [(placement[s], placement[s + 1]) for s in range(len(placement) - 1)
                     if placement[s] != placement[s + 1]]
            G = self.cluster.gpus_per_node
            worst = 0
            replica, stage = sharding.stride("dp"), sharding.stride("pp")  # rank_of(dp=d, pp=a) = d x replica + a x stage
            for d in range(min(sharding.dp, G)):
                worst = max(worst, sum((d * replica + a * stage) // G != (d * replica + b * stage) // G
                                       for a, b in links))
            hit = self._crossings[key] = (len(links), worst)
        links, worst = hit
        if not links:
            return 0.0
        t_in, t_out = self.cost.message_time(nbytes, True), self.cost.message_time(nbytes, False)
        return (worst * t_out + (links - worst) * t_in) / links

    def dp_comm(self, stage_params, sharding: Sharding):
        """Each stage's gradient reduction over its dp x cp ranks (fp32 gradients, per tp rank): an all-reduce,
        or with ZeRO (sharding.zero >= 1) a reduce-scatter, half its bytes; a rank's experts' (stage_params.experts,
        where a stage has them) over their edp ranks after it."""
        inside = sharding.world_size <= self.cluster.gpus_per_node
        reduce = self.cost.shard_collective_time if sharding.zero else self.cost.group_allreduce_time
        return _by_group(stage_params, lambda n, group: reduce(4 * n, group, inside), sharding)

    def gather_times(self, stage_params, sharding: Sharding):
        """Each stage's ZeRO-3 parameter all-gather over its dp x cp ranks (the parameters in their own dtype:
        fp32 under bf16 autocast, as pipegpt.data_parallel keeps them); its experts' over their edp ranks."""
        inside = sharding.world_size <= self.cluster.gpus_per_node
        r, _ = memory_model._widths(self.precision)
        gather = self.cost.shard_collective_time
        return _by_group(stage_params, lambda n, group: gather(r * n, group, inside), sharding)

    @staticmethod
    def exposed_gathers(groups, F, B, W, TP, gathers) -> float:
        """ZeRO-3's microbatch policy: a gather per run of a stage's compute actions (groups: per rank, the
        runs' stages and F/B/I/W counts, pipegpt.planner.structure.compute_groups), each posted one run ahead so
        that it overlaps the previous run's compute; what it does not hide shows, the step's first in full.
        The most any rank shows: at pp 1 what the simulator charges the plan's UNSHARDs (tests/unit/
        test_plan_zero.py); above it a rank's whole wait, more than the simulator's where bubbles hide some."""
        import numpy as np

        F, B, W, TP, G = (np.asarray(x, dtype=np.float64) for x in (F, B, W, TP, gathers))
        per_kind = np.stack([F + TP, B + TP, B - W + TP, W], axis=1)  # the simulator's durations
        worst = 0.0
        for stages, counts in groups:
            if not len(stages):
                continue
            busy = (counts * per_kind[stages]).sum(axis=1)
            g = G[stages]
            worst = max(worst, float(g[0] + np.maximum(0.0, g[1:] - busy[:-1]).sum()))
        return worst

    def after_time(self, model, placement, stage_params, stage_tensors, sharding: Sharding, layers=(),
                   unshard: str = "step") -> float:
        """After the last action and all-reduce: the slowest rank's optimizer step (+ ZeRO's all-gather of the
        parameters: after the update at ZeRO-1/2, at the stage's UNSHARD at ZeRO-3, once per step either way; both
        over dp x cp; none with ZeRO-3's microbatch policy, whose gathers exposed_gathers charges), the tied
        embedding's gradient sum between the first and the last stage, and with tp > kv_heads
        (Llama; layers: blocks per stage) the replicated key/value heads' gradient sum over the tp group
        (pipegpt.tensor_parallel.layers.sum_replicated_kv_grads: one all-reduce of a [kv_heads, n] buffer); and
        what the cost model counts once a step besides (a calibrated model's round trip, batch and clip)."""
        c, dp, pp, tp = self.cluster, memory_model.gradient_group(sharding), sharding.pp, sharding.tp
        params = [0.0] * pp
        tensors = [0] * pp
        routed, stage_experts = [0.0] * pp, _experts(stage_params)  # a rank's experts: sharded over edp
        for s, r in enumerate(placement):
            params[r] += stage_params[s]
            tensors[r] += stage_tensors[s]
            routed[r] += stage_experts[s]
        inside = sharding.world_size <= c.gpus_per_node
        edp = experts.expert_replicas(sharding)
        worst, threads = 0.0, self.cost.optimizer_scale(sharding)
        for r in range(pp):
            if sharding.zero and dp > 1:
                shard = (params[r] - routed[r]) / dp + routed[r] / edp if routed[r] else params[r] / dp
                t = threads * self.cost.optimizer_time(shard, max(1, -(-tensors[r] // dp)))
                if not (sharding.zero >= 3 and unshard == "microbatch"):
                    t += self.cost.shard_collective_time(params[r] * 4, dp, inside)
            else:
                t = threads * self.cost.optimizer_time(params[r], tensors[r])
            worst = max(worst, t)
        if model.tie_embeddings and placement[0] != placement[-1]:
            G = c.gpus_per_node
            stage = sharding.stride("pp")
            same = placement[0] * stage // G == placement[-1] * stage // G  # rank_of(pp=...) // G
            worst += self.cost.group_allreduce_time(model.padded_vocab_size * model.n_embd / tp * 4, 2, same)
        if layers and tp > model.kv_heads:  # Llama's replicated kv heads: their gradients summed over the tp group
            blocks = [0] * pp
            for s, r in enumerate(placement):
                blocks[r] += layers[s]
            kv_grads = 2 * model.head_dim * (model.n_embd + (1 if model.qkv_bias else 0))  # one head's k and v
            worst += self.cost.group_allreduce_time(model.kv_heads * max(blocks) * kv_grads * 4, tp, True)
        return worst + self.cost.per_step_time()

    @staticmethod
    def stage_tensors(model, layers):
        """Each stage's parameter tensors (the optimizer's per-tensor work)."""
        S = len(layers)
        embed, head = len(embedding_shapes(model)), len(head_shapes(model))  # the head's lm_head counted
        return [sum(n * len(block_shapes(model, 1, kind)) for kind, n in layer_mix(model, r))
                + (embed if s == 0 else 0) + (head if s == S - 1 else 0) for s, r in enumerate(stage_ranges(layers))]

    def linear(self, model, sharding: Sharding, rc, mbs):
        """Per-stage quantities as ({layer kind: per block}, {(embed, head): the stage's fixed part}): saved and
        deferred activation bytes, and F, B, W, tp_comm; and one message's bytes."""
        cut = sharding.tensor_cut
        k = self.cost.compute_scale(sharding, mbs)  # threads per rank, microbatch size against a calibration run's
        key = (model.padded_vocab_size, cut, rc, mbs, self.ep_ranks_on_node(sharding), k)
        hit = self._linear.get(key)
        if hit is not None:
            return hit
        kw = dict(microbatch_size=mbs, sharding=cut, precision=self.precision)
        act = _per_layer(model, lambda r, e, h: memory_model.activation_bytes(model, r, recompute=rc, embed=e,
                                                                              head=h, **kw))
        dfr = _per_layer(model, lambda r, e, h: memory_model.deferred_bytes(model, r, embed=e, head=h, **kw))
        P = self.pieces(model, cut, rc, mbs)

        def piece_parts(piece):
            sym = min(piece.comm_f, piece.comm_b)
            return (piece.f * k + piece.comm_f - sym, piece.b * k + piece.comm_b - sym, piece.w * k, sym)

        per = {kind: piece_parts(piece) for kind, piece in self.layer_pieces(model, sharding, rc, mbs).items()}
        embed, head = piece_parts(P.embed), piece_parts(P.head)
        host = self.cost.host_per_action()  # once per F and B of a stage, whatever its layers (W: I holds it)
        vec = (per, {(e, h): tuple((embed[i] if e else 0.0) + (head[i] if h else 0.0) + (host if i < 2 else 0.0)
                                   for i in range(4)) for e, h in ENDS})
        hit = self._linear[key] = (act, dfr, vec, P.message_bytes)
        return hit

    def params_linear(self, model, sharding: Sharding):
        tp = sharding.tp
        key = (model.padded_vocab_size, tp)
        hit = self._params.get(key)
        if hit is None:
            hit = self._params[key] = _per_layer(model, lambda r, e, h: memory_model.parameter_count(model, r, e, h,
                                                                                                     tp))
        return hit

    @staticmethod
    def compose(model, lin, layers):
        """Each stage's quantity: its layers' (per kind) plus its fixed part."""
        per, base = lin
        S = len(layers)
        return [x + base[(s == 0, s == S - 1)] for s, x in enumerate(_sum_layers(model, per, layers))]

    def stage_params(self, model, sharding: Sharding, layers):
        """Each stage's parameter count (per tp rank; of the routed experts a rank's 1/ep), as a StageParams
        where the model has experts (their part of each count: .experts)."""
        params = self.compose(model, self.params_linear(model, sharding), layers)
        if not model.n_experts:
            return params
        if model not in self._experts:
            self._experts[model] = _per_layer(model, lambda r, e, h: memory_model.expert_parameter_count(model, r))
        ep = experts.expert_ranks(sharding)
        routed = [x / ep for x in self.compose(model, self._experts[model], layers)]
        return StageParams([p - x * (ep - 1) for p, x in zip(params, routed)], routed)

    def vectors(self, model, sharding: Sharding, rc, mbs, layers):
        """Per stage F, B, W, tp_comm, saved and deferred activation bytes; one message's bytes."""
        act, dfr, (per, base), msg = self.linear(model, sharding, rc, mbs)
        S = len(layers)
        ends = [base[(s == 0, s == S - 1)] for s in range(S)]
        F, B, W, TP = ([x + e[i] for x, e in zip(_sum_layers(model, {k: v[i] for k, v in per.items()}, layers), ends)]
                       for i in range(4))
        W = [min(w, b) for w, b in zip(W, B)]
        return F, B, W, TP, self.compose(model, act, layers), self.compose(model, dfr, layers), msg

    def split(self, model, sharding: Sharding, rc, placement, balanced):
        """The even split, or the one balanced by cost (None when that is the even one). Costs per sequence
        (forward + backward + collectives of a block, the embedding, the head: their FLOP parts, which set
        the balance at any microbatch size)."""
        S = len(placement)
        even = tuple(even_layers(model.n_layer, S))
        if not balanced or S == 1:
            return None if balanced else even
        P = self.pieces(model, sharding, rc, PER_SEQUENCE)
        cost = lambda piece: piece.f + piece.b + piece.comm_f + piece.comm_b  # noqa: E731
        kinds, per = layer_kinds(model), self.layer_pieces(model, sharding, rc, PER_SEQUENCE)
        unit = cost(per[kinds[0]])  # the first layer's: 1 for every layer of a model whose layers are alike
        blocks = tuple(round(cost(per[kind]) / unit, 2) for kind in kinds)
        key = (placement, model.n_layer, round(cost(P.embed) / unit, 2), round(cost(P.head) / unit, 2), blocks)
        hit = self._splits.get(key)
        if hit is None:
            layers = tuple(balance_layers(list(blocks), key[2], key[3], placement))
            hit = self._splits[key] = (None if layers == even else layers,)
        return hit[0]


ENDS = [(False, False), (True, False), (False, True), (True, True)]  # (holds the embedding, holds the head)


class StageParams(list):
    """Each stage's parameters on a rank, with .experts: the routed experts' part of each (their gradients are
    averaged, and ZeRO shards them, over edp, not dp x cp)."""

    def __init__(self, params, routed):
        super().__init__(params)
        self.experts = list(routed)


def _experts(stage_params) -> list:
    return getattr(stage_params, "experts", None) or [0.0] * len(stage_params)


def _by_group(stage_params, collective, sharding: Sharding) -> list:
    """Each stage's collective(elements, group size): over dp x cp, a stage's experts over edp after it."""
    group, edp = memory_model.gradient_group(sharding), experts.expert_replicas(sharding)
    routed = getattr(stage_params, "experts", None)
    if not routed:
        return [collective(n, group) for n in stage_params]
    return [collective(n - x, group) + collective(x, edp) for n, x in zip(stage_params, routed)]


def _per_layer(model, fn):
    """fn(layers, embed, head) of a slice as ({layer kind: one block's}, {(embed, head): no block's}): a kind's
    block is its first layer's, alone in a slice."""
    base = {eh: fn(range(0), *eh) for eh in ENDS}
    first = {}
    for i, kind in enumerate(layer_kinds(model)):
        first.setdefault(kind, i)
    return {kind: fn(range(i, i + 1), False, False) - base[(False, False)] for kind, i in first.items()}, base


def _sum_layers(model, per: dict, layers) -> list:
    """Each stage's sum of per (a value per layer kind) over its layers (layers: the stages' counts or ranges)."""
    if len(per) == 1:  # every layer alike (the planner's hot path): n blocks
        (one,) = per.values()
        return [(n if isinstance(n, int) else len(n)) * one for n in layers]
    return [sum(n * per[kind] for kind, n in layer_mix(model, r)) for r in stage_ranges(layers)]
