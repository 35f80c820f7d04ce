"""A model whose layers differ: a toy second layer kind (a dense block with twice the MLP width) registered in one
place (pipegpt.arch's LAYER_KINDS, and a rule saying which layers are of it), then counted layer by layer by the
model, tensor parallelism, the FLOPs, the parameter counts, the planner's stage costs and its memory. Every
expected value below is worked out by hand from the shapes (GPT-2 block, C = 128, T = 64, V = 256, biases, tied)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt import arch
from pipegpt.config import ConfigError, ModelConfig
from pipegpt.costs import memory
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import Cluster
from pipegpt.costs.stage_costs import StageCosts
from pipegpt.dims import Sharding
from pipegpt.model import flops
from pipegpt.model.gpt import GPT
from pipegpt.schedule import build_plan
from pipegpt.tensor_parallel.layout import shard_tensor

pytestmark = pytest.mark.usefixtures("one_thread")

WIDE = arch.LayerKind("wide", "wide MLP", lambda model: dataclasses.replace(model, ffn_hidden=2 * model.ffn_width))
C, T, V = 128, 64, 256
DENSE_BLOCK = 12 * C * C + 13 * C  # qkv, proj, fc, proj (F = 4C) with their biases, ln1 and ln2: 198,272
WIDE_BLOCK = 4 * C * C + 2 * C * 8 * C + 3 * C + C + 8 * C + C + 4 * C  # F = 8C: 329,856
EMBED, HEAD = V * C + T * C, 2 * C  # wte and wpe; ln_f (lm_head tied: wte's)


@pytest.fixture
def mixed(monkeypatch):
    """An architecture "toymix": GPT-2 whose first half of layers are dense and the rest wide (DeepSeek-like)."""
    monkeypatch.setitem(arch.LAYER_KINDS, WIDE.name, WIDE)
    monkeypatch.setitem(arch.ARCHITECTURES, "toymix", dataclasses.replace(arch.GPT2, name="toymix"))
    monkeypatch.setitem(arch.LAYER_RULES, "toymix",
                        lambda model: ("dense",) * (model.n_layer // 2) + ("wide",) * -(-model.n_layer // 2))
    return ModelConfig(vocab_size=V, seq_len=T, n_layer=4, n_head=4, n_embd=C, arch="toymix").validate()


def test_the_toy_kind_is_counted_by_hand():
    assert (DENSE_BLOCK, WIDE_BLOCK) == (198_272, 329_856)


def test_the_model_builds_each_layer_at_its_kind(mixed):
    assert [k.name for k in arch.layer_kinds(mixed)] == ["dense", "dense", "wide", "wide"]
    assert not arch.uniform(mixed) and arch.uniform(dataclasses.replace(mixed, arch="gpt2"))
    gpt = GPT(mixed, init_seed=0)
    assert list(arch.named_shapes(mixed).items()) == [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]
    assert tuple(gpt.blocks["1"].mlp.fc.weight.shape) == (4 * C, C)
    assert tuple(gpt.blocks["2"].mlp.fc.weight.shape) == (8 * C, C)
    assert gpt.num_parameters() == EMBED + 2 * DENSE_BLOCK + 2 * WIDE_BLOCK + HEAD == 1_097_472


def test_flops_count_each_layer(mixed):
    assert flops.block_parameters(mixed, WIDE) == WIDE_BLOCK
    n = 2 * DENSE_BLOCK + 2 * WIDE_BLOCK + HEAD + V * C  # the head's matmul once; wpe a lookup
    assert flops.matmul_parameters(mixed) == n == 1_089_280
    assert flops.flops_per_token(mixed) == 6 * n + 12 * 4 * C * T == 6_928_896


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_follow_each_layers_kind(mixed, tp):
    """Each tp rank's shard of a slice holding a dense and a wide layer is what arch.stage_shapes lists."""
    layers = range(1, 3)
    gpt = GPT(mixed, layers=layers, embed=False, head=False, init_seed=0)
    for rank in range(tp):
        real = [(n.split(".", 2)[2], tuple(shard_tensor(n, p, rank, tp, mixed.kv_heads).shape))
                for n, p in gpt.named_parameters()]
        assert list(arch.stage_shapes(mixed, layers, False, False, tp)) == real
    # per rank: the split matrices and column biases over tp; attn.proj's and mlp.proj's biases and the norms whole
    dense, wide = (12 * C * C + 7 * C) // tp + 6 * C, (20 * C * C + 11 * C) // tp + 6 * C
    assert (dense, wide) == ((DENSE_BLOCK, WIDE_BLOCK) if tp == 1 else (99_520, 165_312))
    assert memory.parameter_count(mixed, layers, False, False, tp) == dense + wide
    assert [lin.rows for lin in arch.block_linears(mixed, tp, WIDE)] == [3 * C // tp, C, 8 * C // tp, C]


def test_a_count_of_layers_is_refused_where_layers_differ(mixed):
    with pytest.raises(ConfigError, match="range"):
        memory.parameter_count(mixed, 2, False, False)
    assert memory.parameter_count(mixed, range(0, 2), False, False) == 2 * DENSE_BLOCK


def _costs() -> StageCosts:
    cluster = Cluster(gpus=2, gpus_per_node=2, memory_bytes=80e9, peak_flops=1e12, intra_node_bytes_per_s=1e11,
                      inter_node_bytes_per_s=1e10, hbm_bytes_per_s=1e12, precision="fp32")
    return StageCosts(cluster, AnalyticalCosts(cluster, efficiency=1.0, layer_overhead_s=0.0))


def test_stage_costs_sum_their_layers(mixed):
    cs, sh = _costs(), Sharding(pp=3)
    assert cs.stage_params(mixed, sh, [1, 2, 1]) == [EMBED + DENSE_BLOCK, DENSE_BLOCK + WIDE_BLOCK,
                                                     WIDE_BLOCK + HEAD + V * C]  # the last stage's own lm_head
    assert cs.stage_tensors(mixed, [1, 2, 1]) == [2 + 12, 12 + 12, 12 + 3]  # wte, wpe; 12 a block; ln_f, lm_head
    F, B, W, TP, saved, deferred, _ = cs.vectors(mixed, sh, "none", 1, [1, 2, 1])
    dense_f = 2 * T * 12 * C * C + 4 * T * T * C  # 27,262,976 FLOPs forward, at 1e12 FLOP/s
    wide_f = 2 * T * (4 * C * C + 2 * C * 8 * C) + 4 * T * T * C  # 44,040,192
    assert F[1] == pytest.approx((dense_f + wide_f) / 1e12, rel=1e-12)
    assert B[1] == pytest.approx(2 * (dense_f + wide_f) / 1e12, rel=1e-12)  # input and weight gradients
    assert W[1] == pytest.approx((dense_f + wide_f) / 1e12, rel=1e-12) and TP == [0.0, 0.0, 0.0]
    # saved per layer (fp32, one sequence): 16 hidden-wide elements (the MLP's 8 of them F/C-wide) of 4 bytes,
    # the norms' statistics and attention's logsumexp
    dense_act, wide_act = 16 * T * C * 4 + 2048, 24 * T * C * 4 + 2048
    assert (dense_act, wide_act) == (526_336, 788_480)
    assert saved[1] == dense_act + wide_act
    assert saved[1] == memory.activation_bytes(mixed, range(1, 3), microbatch_size=1)
    # deferred: each linear's input and output gradient, and the stage's input and its gradient
    dense_dfr = (2 * C + 3 * C + 2 * C + 4 * C + 5 * C) * T * 4
    wide_dfr = dense_dfr + (4 * C + 4 * C) * T * 4
    assert deferred[1] == dense_dfr + wide_dfr + 2 * T * C * 4


def test_the_balance_weighs_the_wide_layers(mixed):
    """Six layers, three dense then three wide (a block's forward and backward: 3 x 27.3 and 3 x 44.0 MFLOP per
    sequence), on two stages: the even split loads the wide stage with 396 MFLOP and the head; 4 + 2 loads the
    first with 377, the second with 264 and the head (12.6): the balance moves a wide layer."""
    six, cs, sh = dataclasses.replace(mixed, n_layer=6), _costs(), Sharding(pp=2)
    assert cs.split(six, sh, "none", (0, 1), False) == (3, 3)
    assert cs.split(six, sh, "none", (0, 1), True) == (4, 2)
    assert cs.split(mixed, sh, "none", (0, 1), True) is None  # four layers: 2 + 2 (109 and 176) is the best


def test_the_planners_memory_counts_each_layer(mixed):
    plan = build_plan("1f1b", 2, 4)
    ranks = memory.plan_memory(mixed, plan, [3, 1], microbatch_size=1, precision="fp32")
    assert [r.parameters for r in ranks] == [EMBED + 2 * DENSE_BLOCK + WIDE_BLOCK, WIDE_BLOCK + HEAD + V * C]
    assert [r.weights for r in ranks] == [4 * r.parameters for r in ranks]
    saved, _, _ = memory.stage_activation_bytes(mixed, [range(0, 3), range(3, 4)], microbatch_size=1)
    assert memory.stage_activation_bytes(mixed, [3, 1], microbatch_size=1)[0] == saved  # a split's counts
    dense_act, wide_act = 526_336, 788_480
    assert saved[1] - memory.activation_bytes(mixed, range(4, 4), microbatch_size=1, head=True) == wide_act
    assert saved[0] - memory.activation_bytes(mixed, range(0), microbatch_size=1, embed=True) == \
        2 * dense_act + wide_act
    # 1F1B at pp 2: rank 0 holds two microbatches in flight, rank 1 one
    assert [r.activations for r in ranks] == [2 * saved[0], saved[1]]


def test_measured_costs_are_per_layer_kind(mixed):
    """--balance cost measures one block of each kind; each layer then costs its kind's."""
    from pipegpt.costs.balance import per_layer_costs
    from pipegpt.stages.measure import measure_layer_costs

    costs = measure_layer_costs(mixed, 1, torch.device("cpu"), torch.float32, repeats=1, warmup=0)
    assert {"embed", "block", "block.wide", "head"} <= costs.keys()
    assert per_layer_costs(mixed, costs) == [costs["block"]] * 2 + [costs["block.wide"]] * 2
    assert per_layer_costs(dataclasses.replace(mixed, arch="gpt2"), costs) == [costs["block"]] * 4
