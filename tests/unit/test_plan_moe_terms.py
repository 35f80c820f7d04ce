"""The planner's terms for mixtures of experts beyond the dense-equivalent block (docs/moe-planning.md): what an MoE
block keeps per microbatch (the dispatched rows and the experts' outputs, the bf16 casts of the rank's experts, what
full recomputation keeps with ep), Megatron-Core's selective recomputation of the norms and the expert activation
(norm-act, a what-if), DeepEP's deduplicated dispatch (a what-if), Megatron-Core's rank order (a what-if) and the
all-to-alls full recomputation does not repeat. Expected values are worked out by hand in the comments."""
from __future__ import annotations

import dataclasses
import math

import pytest

from pipegpt.arch import MOE
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.costs import memory as memory_model
from pipegpt.costs.cost import AnalyticalCosts, Shape
from pipegpt.costs.devices import make_cluster
from pipegpt.costs.experts import carve, dispatch_copies, expected_destinations, megatron_ranks_on_node
from pipegpt.costs.stage_costs import StageCosts
from pipegpt.dims import Sharding

# C 128, 4 heads (2 key/value, head 32), T 64, 8 experts of width 96, top-2, a shared one (test_plan_moe's)
MOE_MODEL = ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn_hidden=352,
                        n_experts=8, n_experts_per_token=2, n_shared_experts=1, expert_hidden=96, arch="llama",
                        bias=False, tie_embeddings=False)
# its MoE block's dense equivalent as a dense model: a SwiGLU as wide as 2 routed + 1 shared experts (288)
DENSE_EQUIVALENT = dataclasses.replace(MOE.block_model(MOE_MODEL), n_experts=0)
H100 = make_cluster(16, None, "h100", None, None, None, None, "bf16")
ONE = range(0, 1)  # the first layer: an MoE block


def one_block(model, **kw):
    return memory_model.activation_bytes(model, ONE, microbatch_size=1, **kw)


def test_an_moe_block_keeps_its_rows_and_outputs():
    # fp32, no ep: beyond the dense equivalent, the rows its matmuls read, the experts' outputs and the weighted
    # outputs: 64 tokens x top-2 = 128 assignments of 128 values, 4 bytes: 3 x 65,536 = 196,608; the routing: 64
    # tokens x (8 fp32 scores + a 4-byte sum) = 2,304 and 33 bytes per assignment = 4,224
    assert one_block(MOE_MODEL) - one_block(DENSE_EQUIVALENT) == 196_608 + 2_304 + 4_224


def test_an_moe_block_keeps_the_bf16_casts_of_its_ranks_experts_once_per_step():
    # bf16, ep 2 out of dp 2, per microbatch: rows and outputs 3 x 128 x 128 x 2 bytes = 98,304, the routing 6,528
    # (above); each call's casts of the router (8 x 128 = 1,024) and the shared expert (3 x 96 x 128 = 36,864) in
    # place of the dense equivalent's MLP (3 x 288 x 128 = 110,592): -72,704 x 2 bytes
    sh = carve(Sharding(dp=2), 2)
    extra = one_block(MOE_MODEL, sharding=sh, precision="bf16") - one_block(DENSE_EQUIVALENT, sharding=sh,
                                                                           precision="bf16")
    assert extra == 98_304 + 6_528 - 145_408
    # once per step, whatever the microbatches in flight: the cast of the rank's 4 experts' gate, up, proj
    # (4 x 3 x 96 x 128 = 147,456 x 2 bytes), beside their fp32 master weights; nothing between steps
    def weights(precision, between_steps=False, recompute="none"):
        return memory_model.state_bytes(MOE_MODEL, [(ONE, False, False)], sharding=sh, precision=precision,
                                        between_steps=between_steps, recompute=recompute).weights
    assert weights("bf16") - weights("fp32") == 294_912
    assert weights("bf16", between_steps=True) == weights("fp32", between_steps=True)
    assert weights("bf16", recompute="full") == weights("fp32")  # a cast per call, which its checkpoint drops


def test_full_recomputation_with_ep_keeps_what_block_steps_checkpoints():
    # ep 2, fp32: the block's input 64 x 128 x 4 = 32,768, and with ep the received rows and the combined outputs
    # (128 assignments x 128 x (4 + 4)), their weights (128 x 4) and the residual stream (32,768)
    sh = carve(Sharding(dp=2), 2)
    assert one_block(MOE_MODEL, sharding=sh, recompute="full") == 32_768 + 131_072 + 512 + 32_768
    assert one_block(MOE_MODEL, recompute="full") == 32_768  # one process: the whole block checkpointed
    # bf16: the rows received and combined in bf16 (128 x 128 x (2 + 2)), the weights and residual stream in fp32
    assert one_block(MOE_MODEL, sharding=sh, recompute="full", precision="bf16") == 32_768 + 65_536 + 512 + 32_768


def test_norm_act_recomputation_drops_the_norm_outputs_and_the_activation():
    # bf16: the five column-parallel linears' own inputs (q, k, v, gate, up: 5 x 64 x 128 x 2 = 81,920) and the
    # SiLU output and the product (2 x 64 x 288 x 2 = 73,728)
    kw = dict(precision="bf16")
    assert one_block(MOE_MODEL, **kw) - one_block(MOE_MODEL, recompute="norm-act", **kw) == 155_648
    # ... recomputed in the backward as HBM passes: two norms (64 x 128 x (4 + 2) bytes each) and SiLU x up
    # (3 x 64 x 288 x 2): 208,896 bytes
    cost = AnalyticalCosts(H100, efficiency=1.0, layer_overhead_s=0.0)
    block, sh = MOE.block_model(MOE_MODEL), Sharding()
    extra = cost.pieces(block, Shape(sh, "norm-act", 1)).layer.b - cost.pieces(block, Shape(sh, "none", 1)).layer.b
    assert extra == pytest.approx(208_896 / H100.hbm_bytes_per_s)


def test_deepep_sends_a_token_once_per_node():
    # Qwen3-235B-A22B on Megatron-Core's ep 32, 8 of a group per node (4 nodes of 32 experts): a token's top-8 of
    # 128 miss a node with probability C(96, 8) / C(128, 8) = prod (96 - i) / (128 - i), i < 8, = 0.0927473; it
    # reaches 4 x (1 - 0.0927473) = 3.62901 nodes, 3/4 of them remote: 2.72176 copies across the network, where
    # an all-to-all sends 8 x 24/32 = 6
    assert expected_destinations(128, 8, 4) == pytest.approx(4 * (1 - 0.0927473), rel=1e-6)
    inside, across = dispatch_copies(128, 8, 32, 8, "deepep")
    assert across == pytest.approx(3.629011 * 3 / 4, rel=1e-6)
    # over NVLink: the distinct ranks of the group it reaches, 32 x (1 - C(124, 8) / C(128, 8)) = 7.35937, 7/32 of
    # them its node's peers
    assert inside == pytest.approx(7.359370 * 7 / 32, rel=1e-6)
    assert dispatch_copies(128, 8, 32, 8, "alltoall") == (8 * 7 / 32, 8 * 24 / 32)
    # one expert per rank: every expert a token picks is another rank, so DeepEP sends what an all-to-all does
    assert dispatch_copies(8, 2, 8, 8, "deepep") == pytest.approx(dispatch_copies(8, 2, 8, 8, "alltoall"))
    assert dispatch_copies(8, 2, 1, 1, "deepep") == (0.0, 0.0)
    with pytest.raises(ConfigError, match="--moe-dispatcher 'nccl' is not valid"):
        dispatch_copies(8, 2, 8, 8, "nccl")


def test_an_moe_block_with_deepep_moves_fewer_bytes_across_nodes():
    # ep 8 out of dp 8, two of a group per node (on_node 2, 4 nodes of 2 experts): a token's top-2 of 8 reaches
    # 4 x (1 - C(6, 2) / C(8, 2)) = 4 x 13/28 nodes, 3/4 of them remote: 39/28 copies across, against 2 x 6/8
    cost = AnalyticalCosts(H100, efficiency=1.0, layer_overhead_s=0.0, moe_imbalance=1.0, moe_dispatcher="deepep")
    block, sh = MOE.block_model(MOE_MODEL), carve(Sharding(dp=8), 8).tensor_cut
    shape = Shape(sh, "none", 1)
    base = cost.pieces(block, shape).layer
    piece = cost.with_experts(base, block, shape, on_node=2)
    row = 64 * 128 * 2  # the rank's 64 tokens, 128 values of 2 bytes
    a2a = row * 39 / 28 / 50e9 + 10e-6  # the network's side is the slower
    assert piece.comm_f - base.comm_f == pytest.approx(2 * a2a) and piece.comm_b - base.comm_b == pytest.approx(2 * a2a)


def test_full_recomputation_does_not_repeat_the_all_to_alls():
    cost = AnalyticalCosts(H100, efficiency=1.0, layer_overhead_s=0.0, moe_imbalance=1.0)
    block, sh = MOE.block_model(MOE_MODEL), carve(Sharding(dp=8), 8).tensor_cut
    shape = Shape(sh, "full", 1)
    base = cost.pieces(block, shape).layer
    piece = cost.with_experts(base, block, shape, on_node=8)
    # 64 tokens x top-2 x 128 values in bf16 (the rows travel in the experts' dtype), 7/8 of them to the node's
    # peers
    a2a = 64 * 2 * 128 * 2 * 7 / 8 / 450e9 + 5e-6
    assert piece.comm_b - base.comm_b == pytest.approx(2 * a2a)  # dispatch and combine, once each


def test_megatrons_rank_order_puts_an_ep_group_on_consecutive_ranks():
    assert megatron_ranks_on_node(32, 8) == 8 and megatron_ranks_on_node(4, 8) == 4
    assert megatron_ranks_on_node(12, 8) == math.gcd(12, 8) == 4 and megatron_ranks_on_node(1, 8) == 1
    # dp16 pp8 tp2 with ep 32: pipegpt's order puts 2 of a group on each node, Megatron-Core's 8
    sh = carve(Sharding(dp=16, pp=8, tp=2), 32)
    cluster = make_cluster(256, None, "h100", None, None, None, None, "bf16")
    ours = StageCosts(cluster, AnalyticalCosts(cluster))
    theirs = StageCosts(cluster, AnalyticalCosts(cluster, rank_order="megatron"))
    assert (ours.ep_ranks_on_node(sh), theirs.ep_ranks_on_node(sh)) == (2, 8)
    with pytest.raises(ConfigError, match="rank_order 'x' is not valid"):
        AnalyticalCosts(cluster, rank_order="x")


def test_the_moe_terms_are_what_the_saved_tensor_hooks_see():
    """fp32 on CPU (the loop over experts: no casts), a middle stage of two MoE blocks, 2 sequences: the MoE model's
    count misses exactly what its dense equivalent's misses, so the MoE terms (three rows per assignment, the
    routing) are the saved tensors' bytes."""
    from plan_memory_harness import Layout, saved_tensor_bytes

    dense = dataclasses.replace(DENSE_EQUIVALENT, n_experts_per_token=None, expert_hidden=None, n_shared_experts=0)
    misses = []
    for model in (MOE_MODEL, dense):
        model = dataclasses.replace(model, n_layer=2)
        layout = Layout("moe", model, "1f1b", 3, 1, microbatch_size=2, layers_per_stage=(0, 2, 0))
        predicted = memory_model.activation_bytes(model, range(0, 2), microbatch_size=2, device="cpu")
        misses.append(predicted - saved_tensor_bytes(layout, 1, 3))
    assert misses[0] == misses[1] and abs(misses[0]) < 0.01 * predicted
