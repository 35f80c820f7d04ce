"""What expert parallelism changes in a layout's costs (torch-free): which ep sizes a layout may carve, where an ep
group lands on the nodes, the experts' part of a stage's parameters and the group that averages their gradients.

The planner's experts are never cut over tp (Megatron's ETP 1, torchtitan's default): ep is carved out of dp x cp x
tp (pipegpt.dims.expert_axes(ep, tensor_parallel=False); at tp 1 the same groups as out of dp x cp), so each rank
holds n_experts / ep whole experts and their gradients are averaged over the complement, edp = dp x cp x tp / ep
ranks. With tp > 1 a rank's MoE layer routes its sequence-parallel share of the tokens (mbs x seq / (cp x tp)),
which is why experts with tp need sequence parallelism (as Megatron-Core requires with EP and TP), and attention
and the dense layers are tensor-parallel as in a dense model (tp_model).

The all-to-all's time and the imbalance factor are pipegpt.costs.cost's (AnalyticalCosts.all_to_all_time,
with_experts); this module says where the group's ranks sit: rank r on node r // gpus_per_node, the planner's node
model (pipegpt.costs.stage_costs), and dims' rank order, in which ep takes the fast part of dp x cp x tp.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from pipegpt.config import ConfigError, ModelConfig
from pipegpt.dims import Sharding, expert_axes

# Imbalance: the busiest ep rank's routed tokens over the mean. The default is the headroom Switch Transformers
# give a trained router's busiest expert, capacity factor 1.25 (Fedus, Zoph and Shazeer 2022,
# JMLR 23(120), section 2.2 and Table 1: capacity factors 1.0, 1.25, 2.0); Megatron-Core's Qwen3-235B-A22B at 16k
# tokens measured 237 TFLOPS per GPU dropless against 295 with the load forced even (x1.245, whole steps;
# yanring/Megatron-MoE-ModelZoo best_practice/Qwen3).
DEFAULT_MOE_IMBALANCE = 1.25
# How tokens travel to their experts: pipegpt's all-to-all (a copy per (token, expert) pair, as Megatron-Core's
# alltoall dispatcher), or DeepEP's (a copy per (token, node) across the network, forwarded over NVLink there): a
# what-if for runs made with DeepEP (`pipegpt run` dispatches with all-to-alls)
DISPATCHERS = ("alltoall", "deepep")
# Whose rank order places an ep group on the nodes: pipegpt's (pipegpt.dims: dp outermost), or Megatron-Core's
# (tp-cp-ep-dp-pp, pp outermost: an ep group is consecutive ranks), a what-if for runs made with Megatron-Core
RANK_ORDERS = ("pipegpt", "megatron")
EXPERT_PREFIX = "mlp.experts_"  # the stacked routed experts' parameters (pipegpt.arch's MoE block shapes)


def carve(sharding: Sharding, ep: int) -> Sharding:
    """The layout with ep carved out of dp x cp x tp (ep 1: the layout as it is, nothing carved)."""
    return sharding.carve(expert_axes(ep, tensor_parallel=False)) if ep > 1 else sharding


def expert_ranks(sharding: Sharding) -> int:
    """ep: the ranks a layer's experts are spread over (1: nothing carved)."""
    return sharding.size("ep") if "ep" in sharding.axis_names else 1


def expert_replicas(sharding: Sharding) -> int:
    """edp: the ranks holding the same experts, whose gradients are averaged and ZeRO-sharded over them
    (dp x cp x tp / ep: with tp > 1 each tp rank's experts saw its own tokens)."""
    return sharding.dp * sharding.cp * sharding.tp // expert_ranks(sharding)


def ep_choices(model: ModelConfig, dp: int, cp: int, tp: int) -> tuple[int, ...]:
    """The ep sizes a layout of these axes may carve: the divisors of dp x cp x tp that divide the expert count
    (1 alone for a dense model)."""
    if not model.n_experts:
        return (1,)
    product = dp * cp * tp
    return tuple(e for e in range(1, product + 1) if not product % e and not model.n_experts % e)


def check_ep(model: ModelConfig, ep: int, dp: int | None = None, cp: int = 1, tp: int | None = None) -> None:
    """ConfigError (one line) unless ep can be carved: a model with experts, ep dividing their count, and, where
    the axes are given, ep dividing dp x cp x tp."""
    if ep == 1:
        return
    if not model.n_experts:
        raise ConfigError(f"--ep {ep} on a model without experts (n_experts=0): expert parallelism needs a mixture "
                          f"of experts; leave out --ep")
    if model.n_experts % ep:
        ok = [e for e in range(1, model.n_experts + 1) if not model.n_experts % e]
        raise ConfigError(f"--ep {ep} does not divide n_experts={model.n_experts}: use one of "
                          f"{', '.join(map(str, ok))}")
    if dp is not None and tp is not None and (dp * cp * tp) % ep:
        raise ConfigError(f"--ep {ep} does not divide dp x cp x tp = {dp} x {cp} x {tp} = {dp * cp * tp}, which "
                          f"expert parallelism is carved out of")


@functools.lru_cache(maxsize=4096)
def ranks_on_node(sharding: Sharding, gpus_per_node: int) -> int:
    """The fewest members of an ep group that share a node with one of them (itself counted), over every group:
    what the all-to-all of its most spread rank keeps on the node's links (ep: the whole group is in a node)."""
    ep = expert_ranks(sharding)
    if ep == 1:
        return 1
    fewest, seen = ep, set()
    for rank in range(sharding.world_size):  # each group once
        if rank not in seen:
            group = sharding.members(rank, ("ep",))
            seen.update(group)
            nodes = [r // gpus_per_node for r in group]
            fewest = min(fewest, min(nodes.count(n) for n in nodes))
    return fewest


def megatron_ranks_on_node(ep: int, gpus_per_node: int) -> int:
    """ranks_on_node under Megatron-Core's order: an ep group is ep consecutive ranks (tp, cp and ep fastest, pp
    outermost), so it shares a node with min(ep, G) of its members where one divides the other (the gcd else)."""
    return math.gcd(ep, gpus_per_node) if ep > 1 else 1


def expected_destinations(n_experts: int, top_k: int, places: int) -> float:
    """How many of `places` equal parts of the experts (ranks, nodes) a token's top-k distinct experts fall in, on
    average, the experts drawn uniformly (the balanced load the imbalance factor scales): places x (1 - C(E - E/places,
    k) / C(E, k))."""
    if places <= 1:
        return 1.0
    per = n_experts // places
    return places * (1 - math.comb(n_experts - per, top_k) / math.comb(n_experts, top_k))


def dispatch_copies(n_experts: int, top_k: int, ep: int, on_node: int, dispatcher: str) -> tuple[float, float]:
    """(over NVLink, across the network): copies of one token a rank sends in one dispatch (or receives back in one
    combine) to its ep group's other ranks, on_node of them sharing each node (nodes = ep / on_node).

    alltoall: a copy per (token, expert) pair, k of them spread evenly: k (on_node - 1) / ep to the node's peers, k
    (ep - on_node) / ep across. deepep: one copy per remote node holding any of the token's experts (the expected
    count, expected_destinations over the nodes, less its own), forwarded over NVLink there; over NVLink, one per
    other rank of its own node holding one (expected_destinations over the ranks, times the share of them on the
    node, less its own)."""
    if ep <= 1:
        return 0.0, 0.0
    if dispatcher == "alltoall":
        return top_k * (on_node - 1) / ep, top_k * (ep - on_node) / ep
    if dispatcher != "deepep":
        raise ConfigError(f"--moe-dispatcher {dispatcher!r} is not valid: use {' or '.join(DISPATCHERS)}")
    nodes = max(1, ep // on_node)
    across = expected_destinations(n_experts, top_k, nodes) * (nodes - 1) / nodes
    inside = expected_destinations(n_experts, top_k, ep) * (on_node - 1) / ep
    return inside, across


def expert_weights(model: ModelConfig, ep: int) -> int:
    """The routed experts' weight elements one rank holds in an MoE layer: n_experts / ep whole experts (never cut
    over tp), each the architecture's MLP matrices of n_embd x expert_width."""
    return model.n_experts // ep * model.architecture.mlp_matrices * model.n_embd * model.expert_width


# HBM bytes per expert weight element and microbatch, besides the FLOPs: the matmuls read the weights in the
# compute dtype (bf16: the cast made once per step, pipegpt.model.moe.CastOnce; fp32 the parameters themselves);
# the weight gradient is written in that dtype, read by the cast's backward and written as fp32, and then added
# into the fp32 .grad (read both, write one), as eager autograd runs it each microbatch.
WEIGHT_READ_BYTES = {"bf16": 2, "fp32": 4}
GRADIENT_BYTES = {"bf16": 2 + 2 + 4 + 4 + 4 + 4, "fp32": 4 + 4 + 4 + 4}


def expert_weight_bytes(model: ModelConfig, ep: int, precision: str) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) HBM bytes of one MoE layer's routed experts on one rank per
    microbatch that do not shrink with the microbatch: the weights read forward and again for the input gradient,
    the weight gradient's traffic into the fp32 .grad (WEIGHT_READ_BYTES, GRADIENT_BYTES). The activations' bytes
    are left out: per row they are C + 2H values against 2 x 3 C H FLOPs, far above any GPU's FLOPs per byte."""
    n = expert_weights(model, ep)
    return n * WEIGHT_READ_BYTES[precision], n * WEIGHT_READ_BYTES[precision], n * GRADIENT_BYTES[precision]


def tp_model(model: ModelConfig, tp: int) -> ModelConfig:
    """The model whose tensor-parallel split pipegpt.config.validate_tp checks: a model with experts as its
    attention and dense layers alone (its experts stay whole on each tp rank; the planner pairs them with sequence
    parallelism, pipegpt.planner.search)."""
    if not model.n_experts or tp == 1:
        return model
    return dataclasses.replace(model, n_experts=0)
