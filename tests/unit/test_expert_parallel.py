"""Expert parallelism's one-process pieces: the table's sums and ownership with ep (pipegpt.parallelisms), the
experts each ep rank keeps (shard_for_ep), the dispatch over a group of one, and an expert computation with no
rows that stays in the autograd graph (so every ep rank's backward runs the same all-to-alls). The exchanges
themselves: tests/unit/test_expert_all_to_all.py; a run against one process: tests/distributed/test_moe_oracle.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipegpt.config import ModelConfig
from pipegpt.dims import Sharding, expert_axes
from pipegpt.engine.parallelize import parallelize
from pipegpt.expert_parallel.dispatch import ExpertGroup
from pipegpt.expert_parallel.layers import shard_for_ep
from pipegpt.model.gpt import GPT
from pipegpt.model.moe import EXPERT_PARAMS, MoE, expert_outputs, moe_layers
from pipegpt.parallelisms import EXPERT_PARAMS as TABLE_EXPERT_PARAMS
from pipegpt.parallelisms import Reduction, stage_parallelism

MOE = ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  ffn_hidden=48, bias=False, tie_embeddings=False, n_experts=4, n_experts_per_token=2,
                  n_shared_experts=1, expert_hidden=16)


def test_the_table_sums_dense_parameters_over_dp_x_cp_and_experts_over_edp():
    layout = stage_parallelism(Sharding(dp=4, cp=1).carve(expert_axes(2)))
    assert layout.ep == 2 and layout.expert_replicas == 2
    assert layout.reductions == (Reduction("gradients", "dp_cp", "dense", average=True),
                                 Reduction("experts", "edp", "experts", average=True, divisor=4))
    assert stage_parallelism(Sharding(dp=4)).reductions == (Reduction("gradients", "dp_cp", "all", average=True),)
    assert TABLE_EXPERT_PARAMS == EXPERT_PARAMS  # the torch-free table names the model's stacked experts
    name = "blocks.1.mlp.experts_up"
    assert layout.expert(name) and not layout.expert("blocks.1.mlp.router.weight")
    assert layout.expert_slice(name, 8, 1) == slice(4, 8) and layout.expert_slice("blocks.1.mlp.router.weight", 8, 1) is None
    # replica 0 stores the dense values, edp index 0 the experts' slices
    assert layout.stored_by(name, replica_index=3, edp_index=0) and not layout.stored_by(name, 0, 1)
    assert layout.stored_by("wte.weight", 0, 1) and not layout.stored_by("wte.weight", 1, 0)


@pytest.mark.parametrize("ep, index", [(2, 0), (2, 1), (4, 3)])
def test_each_ep_rank_keeps_its_slice_of_the_one_process_experts(ep, index):
    whole = GPT(MOE, init_seed=3)
    mine = GPT(MOE, init_seed=3)
    group = ExpertGroup(None, ep, index)
    shard_for_ep(mine, group)
    layers = moe_layers(mine)
    assert layers and all(layer.expert_parallel is group for layer in layers)
    full = dict(whole.named_parameters())
    for name, p in mine.named_parameters():
        if name.rsplit(".", 1)[-1] in EXPERT_PARAMS:
            assert p.shape[0] == MOE.n_experts // ep
            assert torch.equal(p, full[name][group.local_experts(MOE.n_experts)])
        else:
            assert torch.equal(p, full[name])


def test_parallelize_cuts_the_experts_where_the_layout_carves_ep():
    mesh = SimpleNamespace(tp_index=0, cp_index=0, ep_index=1, group=lambda name: None)
    layout = stage_parallelism(Sharding(dp=2).carve(expert_axes(2)))
    done = parallelize(GPT(MOE, init_seed=3), layout, mesh, device=torch.device("cpu"), dtype=torch.float32)
    assert [layer.experts_gate.shape[0] for layer in moe_layers(done.module)] == [2, 2]
    assert moe_layers(done.module)[0].expert_parallel.index == 1


def test_a_dispatch_over_one_rank_equals_the_layer_without_it():
    torch.manual_seed(0)
    layer = MoE(MOE).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, MOE.n_embd, dtype=torch.float64, requires_grad=True)
    plain = layer(x)
    layer.expert_parallel = ExpertGroup(None, 1, 0)
    over_one = layer(x)
    torch.testing.assert_close(over_one, plain, rtol=0, atol=1e-12)


def test_experts_with_no_rows_stay_in_the_graph():
    """An ep rank whose experts got no token this call computes nothing, yet its output is a function of its
    input: the backward then reaches the dispatch's all-to-all on that rank as on the others (without it, the
    ranks' backward exchanges paired with different calls: a real run aborted in gloo)."""
    E, H, C = 2, 3, 4
    x = torch.zeros(0, C, requires_grad=True)
    y = expert_outputs(x, [0, 0], torch.ones(E, H, C), torch.ones(E, H, C), torch.ones(E, C, H), grouped=False)
    assert y.shape == (0, C) and y.requires_grad and y.grad_fn is not None
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, C)
