"""How long each piece of a step takes on a cluster: per-layer F, B, I, W, collectives, messages, the optimizer.

The planner never adds these up into a step time itself: they become a schedule.simulate.Costs (per-stage F,
B, W, tp_comm, dp_comm and the message latency comm) and the simulator gives the makespan. Only what happens
after the last gradient all-reduce (the optimizer step, ZeRO's parameter all-gather, the tied embedding's
gradient sum) is added to it: it follows every pipeline action, so a sum is exact there.

Analytical model (AnalyticalCosts), per microbatch of `mbs` sequences of T tokens, model width C, padded
vocabulary V, tp tensor-parallel ranks, one device of peak P FLOP/s at efficiency e:

* a block's forward: FLOPs_fwd = mbs * (2 T W + 4 T^2 C) / tp (the matmuls of its W weight elements and
  attention's two T x T products: pipegpt.model.flops.flops_per_token / 3 per layer and token; W = 12 C^2 for
  GPT-2, 2 C^2 + 2 K C + 3 F C for Llama: K the k/v width, F SwiGLU's) -> F = FLOPs_fwd / (P e), B = 2F,
  I = W = F. A pass never takes less than the host needs to launch it (`layer_overhead_s`, default 100 us
  per block forward, twice that backward: eager PyTorch issues a dozen or two kernels per block and pass);
  the GPU runs ahead of the host otherwise, so the larger of the two counts, not their sum.
* recomputation: full adds the block's forward (and its collectives) to the backward (its I half),
  selective adds attention's T x T products (4 T^2 C mbs / tp FLOPs).
* the head: 2 T C V mbs / tp FLOPs forward (B = 2F, W = F), plus the cross-entropy's passes over the logits
  at HBM speed; the embedding: memory-bound (a gather forward, the dense V x C gradient backward, all W).
* tensor parallelism (Megatron): two all-reduces of mbs T C activations per block forward and two in its
  backward (sequence parallelism turns each into a reduce-scatter + all-gather of the same volume, so the
  same time); the vocabulary-parallel embedding one forward, the head one backward; ring all-reduce time
  2 (n-1)/n bytes / B_intra + 2 (n-1) latency. Forward and backward collectives go into the simulator's
  tp_comm (which it charges to F, B and I, never W); any difference between the two into F or B.
* pipeline messages: mbs T C values in the compute precision (bf16 under bf16: --p2p-dtype's default, though the
  residual stream stays fp32 inside a stage; 1/tp of them with sequence parallelism) per microbatch, at intra-node bandwidth when the neighbouring stage's rank is in the
  same node, inter-node otherwise. The simulator has one message latency for every link: it gets the mean
  over the links the placement uses (on the critical path every link is crossed about equally often).
* data-parallel gradient all-reduce of each stage's fp32 gradients (1/tp of the sharded matrices), ring
  bandwidth term, tree latency term, at intra-node bandwidth only when the whole group is in one node:
  the simulator's dp_comm (started when the stage's last backward ends, overlapping the rest); with ZeRO a
  reduce-scatter (shard_collective_time: half the all-reduce's bytes).
* ZeRO-3 under --unshard microbatch: an all-gather of a stage's parameters (in their dtype: fp32 under bf16
  autocast) before each run of its compute actions, posted one run ahead: max(0, gather - the previous run's
  compute) shows, the step's first gather in full (pipegpt.costs.stage_costs.exposed_gathers).
* after the step's last action: AdamW over the rank's parameters (1/dp of them with ZeRO) at HBM speed
  (OPTIMIZER_BYTES_PER_PARAM: torch's per-tensor AdamW reads and writes each value about sixteen times,
  clipping included), or the host's per-tensor overhead if larger; with ZeRO, the updated shards all-gathered
  ((dp-1)/dp of the rank's parameters received; the gradients were reduce-scattered, half an all-reduce);
  the tied embedding's gradient summed between the first and the last stage; with tp > n_kv_head (Llama), the
  replicated key/value heads' gradients summed over the tp group (an all-reduce of kv_heads x one head's k
  and v gradients of the busiest rank's blocks).
* context parallelism (cp ranks per stage, each holding L = T/cp tokens of every sequence, load-balanced):
  every per-token cost above is a rank's L tokens (the block's FLOPs, the head's, the embedding's bytes,
  the tp collectives' volume, the pipeline messages), attention's 4 T^2 C / cp (its L queries against all T
  keys). Per block and pass, K and V travel: a block of K and V is mbs L 2 K' d values in the compute
  precision (K' the kv heads of a tp rank, d the head size: only kv heads travel), over NVLink when the tp x
  cp consecutive ranks of a group share a node (tp x cp divides the GPUs per node), else over the inter-node
  link. ring: cp-1 steps, each one block sent
  while one block's attention is computed (a causal kernel does half of the model's 4 L^2 C: 2 L^2 C mbs / tp
  FLOPs), so only max(0, step - block compute) per step shows; the backward passes K/V and dK/dV (twice the
  bytes) against twice the compute; each step also merges its partial output into the running one by their
  log-sum-exp (forward; the backward accumulates dQ alike): 3 passes over the fp32 output block, mbs L C / tp
  values, at HBM speed, in the block's compute; and its kernels raise the block's host floor by a sixth per
  step (RING_STEP_LAUNCH). allgather: K/V gathered forward ((cp-1) steps of a block), gathered
  again and dK/dV reduce-scattered backward, none of it overlapped; its
  compute is the ring's blocks, at most three, whose one or two merges are not charged. At cp 2 (KEEP_PEER_CP)
  the forward keeps the peer's K/V block, so the backward passes dK/dV only: the ring's one hop home, the
  all-gather's reduce-scatter. On CPU ranks (the cluster's unit "rank": gloo over TCP) the bytes are copied by
  the cores that compute (the sender's writev, the receiver's event-loop thread), so only a transfer's latency
  hides behind the ring's attention, never its copy (block / bandwidth). In this model the ring never costs
  more than the all-gather. Full recomputation reruns the forward's share in the backward; selective
  recomputes nothing of cp's attention (its Function keeps O(L): pipegpt.model.gpt). These exposed times join
  the block's collectives (the simulator's tp_comm); the gradient all-reduce and ZeRO-1 span dp x cp ranks
  (pipegpt.costs.stage_costs).
* Llama's blocks cost what their FLOPs say (above) and move what GPT-2's move (two all-reduces of mbs T C
  activations per pass: attn.proj's and mlp.proj's outputs); RMSNorm, rotary and SiLU are elementwise, counted
  as GPT-2's LayerNorm and GELU are: not at all.
* mixture of experts: an MoE block costs a dense block of the architecture's MLP as wide as a token's active experts
  (top-k and shared), with the routed experts' part of each pass never below the HBM time of their weights on the
  rank (a roofline: n_experts / ep experts read forward and for the input gradient, their weight gradient added into
  the fp32 .grad, every microbatch: pipegpt.costs.experts.expert_weight_bytes), which is what makes few rows per
  expert slow and a rank holding fewer experts faster. With ep > 1 (pipegpt.costs.experts) the routed experts' share
  of its compute is multiplied by moe_imbalance (the busiest rank's tokens over the mean, default 1.25), and four
  all-to-alls join its collectives (dispatch and combine, forward and backward; full recomputation does not repeat
  them: pipegpt.model.moe.block_steps checkpoints the parts between them): each of the rank's tokens x top-k x C
  values in the compute dtype (bf16 rows under bf16: pipegpt.model.moe casts them before the dispatch), times
  moe_imbalance, (ep-1)/ep of them leaving the rank, those to its node's peers over NVLink while the rest cross the
  network, the slower counted, a latency each (dispatch_time; with moe_dispatcher "deepep", a what-if, one copy per
  token and remote node: pipegpt.costs.experts.dispatch_copies; docs/moe-planning.md). Recomputation "norm-act"
  (Megatron-Core's `--recompute-modules layernorm moe_act`, a what-if the search does not propose) adds the two
  norms and SiLU x up again in the backward as HBM passes.

The calibrated model, scaled to a measured run, is pipegpt.costs.calibrated_costs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipegpt.arch import kv_local_heads
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.dims import Sharding
from pipegpt.model.flops import block_matmul_weights

from .activations import KEEP_PEER_CP
from .devices import Cluster
from .experts import DEFAULT_MOE_IMBALANCE, DISPATCHERS, RANK_ORDERS, dispatch_copies, expert_weight_bytes

DEFAULT_EFFICIENCY = 0.5  # achieved / peak matmul FLOP/s: Megatron-LM reports 44-52% on A100 (Narayanan et al. 2021)
DEFAULT_LAYER_OVERHEAD_S = 100e-6  # host time to launch one block's forward (backward: twice)
RING_STEP_LAUNCH = 1 / 6  # a ring step's kernels (block attention, merge, send/receive) over a block's forward's
OPTIMIZER_BYTES_PER_PARAM = 64  # fp32 AdamW plus clipping: ~16 reads/writes of 4 bytes
FP32 = 4


def allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of nbytes over n ranks (reduce-scatter + all-gather: the same time)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def cp_block_bytes(model: ModelConfig, microbatch_size: int, sharding, precision: str = "fp32") -> float:
    """One context-parallel rank's K and V of one layer (kv heads only): the block a ring step passes on."""
    act = 2 if precision == "bf16" else FP32
    L = model.seq_len // sharding.cp
    return microbatch_size * L * 2 * kv_local_heads(model, sharding.tp) * model.head_dim * act


def cp_bytes_per_layer(model: ModelConfig, microbatch_size: int, sharding, comm: str,
                       precision: str = "fp32") -> float:
    """Bytes one cp rank sends per layer in a forward and backward: (cp - 1) K/V blocks forward; backward K/V
    again (but at cp 2, KEEP_PEER_CP: the forward kept the peer's) and (cp - 1) blocks of dK/dV, ring or
    all-gather (the ring's begin at the rank after their owner, so the owner's share never travels; the
    all-gather's reduce-scatter sends the others' shares). This counts no recomputation: under full
    recomputation the recomputed forward passes K/V once more. The time model charges the ring's backward at cp > 2 one overlapped dK/dV block more
    than this (context_parallel: cp - 1 steps of K/V and dK/dV, then the hop home): it shows only where a
    step's transfer outlasts its attention."""
    cp = sharding.cp
    if cp == 1:
        return 0.0
    passes = 2 if cp == KEEP_PEER_CP else 3
    return passes * (cp - 1) * cp_block_bytes(model, microbatch_size, sharding, precision)


@dataclass(frozen=True)
class Piece:
    """One part of a stage (a block, the embedding, the head) for one microbatch, in seconds.

    f, b, w: compute of the forward, the whole backward (recomputation included) and its weight-gradient
    part; comm_f, comm_b: tensor-parallel collectives in the forward and in the backward."""

    f: float
    b: float
    w: float
    comm_f: float = 0.0
    comm_b: float = 0.0

    def scaled(self, k: float) -> "Piece":
        return Piece(self.f * k, self.b * k, self.w * k, self.comm_f * k, self.comm_b * k)


@dataclass(frozen=True)
class Pieces:
    layer: Piece
    embed: Piece
    head: Piece
    message_bytes: float  # one pipeline message (activations or their gradients) per microbatch per tp rank
    cp_comm: tuple = (0.0, 0.0)  # the part of layer.comm_f, layer.comm_b that is context parallelism's


@dataclass(frozen=True)
class Shape:
    """The parallel shape the pieces are for."""

    sharding: Sharding
    recompute: str
    mbs: int
    cp_comm: str = "ring"  # how K/V travel with cp > 1 (pipegpt.config.CP_COMM)


def layer_flops_fwd(model: ModelConfig) -> float:
    """Forward FLOPs of one block for one sequence (matmuls and attention's T x T products): GPT-2's
    24 T C^2 + 4 T^2 C; Llama's 2 T (2 C^2 + 2 K C + 3 F C) + 4 T^2 C (K = kv_heads x head_dim: grouped-query
    attention's smaller k and v projections; F = ffn_width: SwiGLU's gate, up and proj)."""
    T, A = model.seq_len, model.attention_width  # n_head x head_dim: n_embd unless head_size is set
    return 2 * T * block_matmul_weights(model) + 4 * T * T * A


def head_flops_fwd(model: ModelConfig) -> float:
    return 2 * model.seq_len * model.n_embd * model.padded_vocab_size


class AnalyticalCosts:
    """Piece times from FLOPs and bytes (see the module docstring)."""

    kind = "analytical"

    def __init__(self, cluster: Cluster, efficiency: float = DEFAULT_EFFICIENCY,
                 layer_overhead_s: float = DEFAULT_LAYER_OVERHEAD_S, moe_imbalance: float = DEFAULT_MOE_IMBALANCE,
                 moe_dispatcher: str = "alltoall", rank_order: str = "pipegpt"):
        if not 0 < efficiency <= 1:
            raise ConfigError(f"--efficiency {efficiency} must be in (0, 1]: achieved / peak FLOP/s, e.g. 0.5")
        if layer_overhead_s < 0:
            raise ConfigError(f"--layer-overhead-us must be >= 0, got {layer_overhead_s * 1e6:g}")
        if not 1 <= moe_imbalance < math.inf:
            raise ConfigError(f"--moe-imbalance {moe_imbalance} must be >= 1: the busiest expert rank's tokens over "
                              f"the mean, e.g. {DEFAULT_MOE_IMBALANCE}")
        self.cluster, self.efficiency, self.layer_overhead_s = cluster, efficiency, layer_overhead_s
        if moe_dispatcher not in DISPATCHERS:
            raise ConfigError(f"--moe-dispatcher {moe_dispatcher!r} is not valid: use {' or '.join(DISPATCHERS)}")
        if rank_order not in RANK_ORDERS:
            raise ConfigError(f"rank_order {rank_order!r} is not valid: use {' or '.join(RANK_ORDERS)}")
        self.moe_imbalance = moe_imbalance
        # what-ifs for a run made elsewhere (pipegpt.costs.experts): how tokens reach their experts, where ep lands
        self.moe_dispatcher, self.rank_order = moe_dispatcher, rank_order

    def describe(self) -> str:
        return (f"analytical: {self.efficiency:g} of peak, at least {self.layer_overhead_s * 1e6:g} us per block "
                f"forward (host launch)")

    # --- compute ------------------------------------------------------------------------------------
    def _rate(self) -> float:
        return self.cluster.peak_flops * self.efficiency

    def compute(self, model: ModelConfig, shape: Shape) -> tuple[Piece, Piece, Piece]:
        """(layer, embed, head) compute only, no collectives."""
        C, V, cp = model.n_embd, model.padded_vocab_size, shape.sharding.cp
        T = model.seq_len // cp  # the tokens a rank holds (all of them without cp)
        tp, mbs, rate, hbm = shape.sharding.tp, shape.mbs, self._rate(), self.cluster.hbm_bytes_per_s
        floor = self.layer_overhead_s
        f = mbs * layer_flops_fwd(model) / (tp * cp) / rate
        block_floor, merges = floor, 0.0
        if cp > 1 and shape.cp_comm == "ring":
            block_floor *= 1 + (cp - 1) * RING_STEP_LAUNCH
            merges = (cp - 1) * 3 * mbs * T * C / tp * FP32 / hbm
        lf, lw, li = max(f + merges, block_floor), max(f, floor), max(f + merges, block_floor)
        if shape.recompute == "full":
            li += lf
        elif shape.recompute == "selective" and cp == 1:  # cp's attention keeps O(L) and recomputes nothing
            li += mbs * 4 * T * model.seq_len * C / tp / rate
        elif shape.recompute == "norm-act":  # two norms from their inputs, SiLU x up from its inputs: HBM passes
            tokens = shape.sharding.tokens_per_rank(model.seq_len, mbs)
            li += (2 * tokens * C * (FP32 + 2) + 3 * mbs * T * model.ffn_width / tp * 2) / hbm
        layer = Piece(lf, li + lw, lw)
        hf = mbs * head_flops_fwd(model) / (tp * cp) / rate
        logits = mbs * T * V / tp * FP32 / hbm  # one pass over the fp32 logits
        head = Piece(max(hf + 3 * logits, floor / 2), max(2 * hf + 2 * logits, floor), max(hf, floor / 2))
        eb = max((mbs * T * C * FP32 + 2 * V / tp * C * FP32) / hbm, floor / 4)
        embed = Piece(max(3 * mbs * T * C * FP32 / hbm, floor / 4), eb, eb)
        return layer, embed, head

    # --- collectives and messages ---------------------------------------------------------------------
    def collectives(self, model: ModelConfig, shape: Shape) -> tuple[tuple, tuple, tuple]:
        """(layer, embed, head) tensor-parallel collective times: (forward, backward) each."""
        tp = shape.sharding.tp
        if tp == 1:
            return (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)
        c = self.cluster
        act = 2 if c.precision == "bf16" else FP32  # autocast's matmul outputs
        tokens = shape.mbs * model.seq_len // shape.sharding.cp
        ar = lambda nbytes: allreduce_time(nbytes, tp, c.intra_node_bytes_per_s, c.latency_intra_s)  # noqa: E731
        block = ar(tokens * model.n_embd * act)
        layer_b = 2 * block + (2 * block if shape.recompute == "full" else 0.0)
        embed = (ar(tokens * model.n_embd * FP32), 0.0)
        head = (ar(tokens * FP32) + ar(2 * tokens * FP32), ar(tokens * model.n_embd * act))
        return (2 * block, layer_b), embed, head

    def context_parallel(self, model: ModelConfig, shape: Shape) -> tuple[float, float]:
        """Per block, the context-parallel communication not hidden behind attention: (forward, backward),
        seconds (see the module docstring)."""
        sh = shape.sharding
        cp, tp = sh.cp, sh.tp
        if cp == 1:
            return 0.0, 0.0
        c = self.cluster
        L = model.seq_len // cp
        block = cp_block_bytes(model, shape.mbs, sh, c.precision)
        bw, lat = self._link(c.gpus_per_node % (tp * cp) == 0)  # every group of tp x cp consecutive ranks in a node
        step = lat + block / bw
        kept = cp == KEEP_PEER_CP  # the backward passes no K/V: the forward kept the peer's block
        if shape.cp_comm == "allgather":
            forward = (cp - 1) * step
            backward = forward if kept else 2 * forward  # dK/dV reduce-scattered (and K/V gathered again)
        else:
            attention = self.attention_time(shape.mbs * 2 * L * L * model.attention_width / tp)  # a causal block
            copy = block / bw if c.unit == "rank" else 0.0  # CPU ranks copy the bytes on the computing cores

            def exposed(blocks: int, overlapped: float) -> float:  # one ring step moving `blocks` blocks
                return max(0.0, lat + blocks * (block / bw - copy) - overlapped) + blocks * copy

            forward = (cp - 1) * exposed(1, attention)
            backward = step  # dK/dV's last hop home, after the last block
            if not kept:
                backward += (cp - 1) * exposed(2, 2 * attention)  # K/V and dK/dV against a block's backward
        if shape.recompute == "full":
            backward += forward  # the recomputed attention passes K/V again
        return forward, backward

    def attention_time(self, flops: float) -> float:
        """Seconds of `flops` of a cp block's attention, what a ring step's transfer overlaps."""
        return flops / self._rate()

    def _link(self, same_node: bool) -> tuple[float, float]:
        """(bytes per second, latency) of one GPU's link to a peer."""
        c = self.cluster
        return ((c.intra_node_bytes_per_s, c.latency_intra_s) if same_node
                else (c.inter_node_bytes_per_s, c.latency_inter_s))

    def all_to_all_time(self, nbytes: float, n: int, on_node: int) -> float:
        """An all-to-all among n ranks, each holding nbytes for all of them (its own share stays): what goes to
        the on_node - 1 peers of its node over NVLink while the rest crosses the network (dispatch_time)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.dispatch_time(nbytes * (on_node - 1) / n, nbytes * (n - on_node) / n, n, on_node)

    def with_experts(self, piece: Piece, block: ModelConfig, shape: Shape, on_node: int) -> Piece:
        """An MoE block's piece (piece: its block model's, a dense MLP as wide as a token's active experts) with
        the routed experts' compute as the busiest rank's: their share of the block's FLOPs times moe_imbalance
        with ep > 1, and never less than the HBM time of the experts' weights the rank holds
        (pipegpt.costs.experts.expert_weight_bytes: read forward and for the input gradient, the weight gradient
        added into the fp32 .grad, each microbatch), a roofline that makes few rows per expert memory-bound; and,
        with ep > 1, four all-to-alls of its tokens x top-k x n_embd in the compute dtype (dispatch and combine,
        forward and backward, not repeated by full recomputation), as many bytes times moe_imbalance, on the links
        where the ep group lands (on_node of it share each node); with moe_dispatcher "deepep" the copies
        pipegpt.costs.experts.dispatch_copies counts."""
        ep = shape.sharding.size("ep") if "ep" in shape.sharding.axis_names else 1
        k, x = block.experts_per_token, (self.moe_imbalance if ep > 1 else 1.0)
        matrices = block.architecture.mlp_matrices
        share = 2 * block.seq_len * matrices * k * block.expert_width * block.n_embd / layer_flops_fwd(block)
        routed = share * piece.f  # the routed experts' forward (= input gradient = weight gradient) at the mean load
        read, read_again, gradient = (n / self.cluster.hbm_bytes_per_s for n in self.expert_weight_bytes(block, ep))
        busiest = x * routed
        f, i, w = (max(busiest, read), max(busiest, read_again), max(busiest, gradient))
        recompute = max(busiest, read) - routed if shape.recompute == "full" else 0.0
        f, i, w = f - routed, i - routed + recompute, w - routed
        if ep == 1:
            return Piece(piece.f + f, piece.b + i + w, piece.w + w, piece.comm_f, piece.comm_b)
        # the rows travel in the experts' dtype, as DeepEP sends them: the dispatched rows cast to it
        # (pipegpt.model.moe.MoE.dispatched), the combine's the experts' outputs
        width = 2 if self.cluster.precision == "bf16" else FP32
        tokens = shape.sharding.tokens_per_rank(block.seq_len, shape.mbs)
        inside, across = dispatch_copies(block.n_experts, k, ep, on_node, self.moe_dispatcher)
        row = x * tokens * block.n_embd * width  # one copy of the rank's tokens, the busiest rank's share
        a2a = self.dispatch_time(row * inside, row * across, ep, on_node)
        return Piece(piece.f + f, piece.b + i + w, piece.w + w, piece.comm_f + 2 * a2a, piece.comm_b + 2 * a2a)

    def expert_weight_bytes(self, block: ModelConfig, ep: int) -> tuple[float, float, float]:
        """The experts' weight traffic per microbatch the roofline in with_experts charges (none when calibrated)."""
        return expert_weight_bytes(block, ep, self.cluster.precision)

    def dispatch_time(self, inside: float, across: float, n: int, on_node: int) -> float:
        """A dispatch (or combine) sending `inside` bytes to the node's peers over NVLink while `across` cross the
        network, the slower counted, a latency each (all_to_all_time's, with the bytes given)."""
        c = self.cluster
        t_in = (inside / c.intra_node_bytes_per_s + c.latency_intra_s) if on_node > 1 else 0.0
        t_out = (across / c.inter_node_bytes_per_s + c.latency_inter_s) if on_node < n else 0.0
        return max(t_in, t_out)

    def message_bytes(self, model: ModelConfig, shape: Shape) -> float:
        width = 2 if self.cluster.precision == "bf16" else FP32  # pipegpt's default --p2p-dtype: the precision
        return shape.sharding.tokens_per_rank(model.seq_len, shape.mbs) * model.n_embd * width

    def group_allreduce_time(self, nbytes: float, n: int, same_node: bool) -> float:
        """An all-reduce of nbytes among n ranks of a data-parallel (or other) group: ring bandwidth term,
        tree latency term (2 log2 n steps), at intra-node bandwidth only when the whole group is in a node."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = self._link(same_node)
        return allreduce_time(nbytes, n, bw, 0.0) + 2 * math.ceil(math.log2(n)) * lat

    def shard_collective_time(self, nbytes: float, n: int, same_node: bool) -> float:
        """A reduce-scatter or an all-gather of nbytes over n ranks (ZeRO's gradients and parameters): each rank
        sends and receives the (n-1)/n of nbytes the others own, a latency per step of the ring."""
        if n <= 1:
            return 0.0
        bw, lat = self._link(same_node)
        return (n - 1) / n * nbytes / bw + (n - 1) * lat

    def message_time(self, nbytes: float, same_node: bool) -> float:
        c = self.cluster
        if same_node:
            return c.latency_intra_s + nbytes / c.intra_node_bytes_per_s
        return c.latency_inter_s + nbytes / c.inter_node_bytes_per_s

    def pieces(self, model: ModelConfig, shape: Shape) -> Pieces:
        (lc, ec, hc) = self.collectives(model, shape)
        cp = self.context_parallel(model, shape)
        layer, embed, head = self.compute(model, shape)
        with_comm = lambda p, cc: Piece(p.f, p.b, p.w, cc[0], cc[1])  # noqa: E731
        return Pieces(with_comm(layer, (lc[0] + cp[0], lc[1] + cp[1])), with_comm(embed, ec), with_comm(head, hc),
                      self.message_bytes(model, shape), cp)

    # --- after the last action ------------------------------------------------------------------------
    def optimizer_time(self, params: float, tensors: int) -> float:
        """AdamW over `params` values in `tensors` tensors on one GPU."""
        return max(params * OPTIMIZER_BYTES_PER_PARAM / self.cluster.hbm_bytes_per_s,
                   tensors * self.layer_overhead_s)

    def per_step_time(self) -> float:
        """What a step spends besides its actions, its gradient sync and its optimizer (the driver's round trip,
        the batch, the clip): none in the analytical model (its host floor is per layer)."""
        return 0.0

    def host_per_action(self) -> float:
        """The host's time before each forward and backward, not scaled with tokens or threads: none in the
        analytical model (its host floor is per layer)."""
        return 0.0

    def compute_scale(self, sharding, mbs: int) -> float:
        """What a layout's compute (F, B, W) is multiplied by for its ranks' threads (sharding: the whole layout's)
        and its microbatch size: 1 here; a calibrated CPU run's measured thread speedup and microbatch-size rate
        (pipegpt.costs.calibrated.ThreadScaling, MicrobatchScaling)."""
        return 1.0

    def optimizer_scale(self, sharding) -> float:
        """What the optimizer's step is multiplied by for the layout's ranks' threads: 1 here; a calibrated CPU
        run's measured speedup of the step (pipegpt.costs.calibrated.ThreadScaling.optimizer_scale)."""
        return 1.0
