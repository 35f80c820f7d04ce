"""One description of a stage's parallelisms (pipegpt.parallelisms) and one step that applies it
(pipegpt.engine.parallelize): the gradient sums it lists, the parameters each sum takes (the same as the tensor-parallel
layers' own lists), who owns and counts what, and the planner's gradient group, all read from it."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from pipegpt.config import ModelConfig
from pipegpt.costs import memory
from pipegpt.comm.mesh import group_members
from pipegpt.dims import GROUP_AXES, Sharding
from pipegpt.engine.parallelize import Parallelized, parallelize
from pipegpt.model.gpt import GPT
from pipegpt.parallelisms import GRADIENT_AXES, ORDER, stage_parallelism
from pipegpt.tensor_parallel.layers import TPLayout, replicated_kv_params, partial_grad_params

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = ModelConfig(arch="llama", vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                    ffn_hidden=48, bias=False, tie_embeddings=False)


def test_the_order_is_torchtitans():
    assert ORDER == ("tp", "ep", "cp", "recompute", "compile", "dp")


@pytest.mark.parametrize("sharding, kv_heads, sums", [
    (Sharding(), 4, []),
    (Sharding(dp=2), 4, [("gradients", "dp_cp")]),
    (Sharding(cp=2), 4, [("gradients", "dp_cp")]),
    (Sharding(tp=2), 4, []),  # tp alone: every gradient whole on its rank
    (Sharding(dp=2, tp=2, sequence_parallel=True), 4, [("gradients", "dp_cp"), ("partial", "tp")]),
    (Sharding(tp=4, sequence_parallel=True), 2, [("partial", "tp"), ("shared kv", "tp")]),
    (Sharding(tp=4), 2, [("shared kv", "tp")]),
])
def test_the_sums_a_layout_needs(sharding, kv_heads, sums):
    layout = stage_parallelism(sharding, kv_heads)
    assert [(r.name, r.group) for r in layout.reductions] == sums
    assert layout.gradient_ranks == sharding.dp * sharding.cp


@pytest.mark.parametrize("qk_norm", ["head", "projection"])
@pytest.mark.parametrize("sp, rule", [(False, "qk-norms"), (True, "replicated")])
def test_qk_norm_gains_are_summed_over_tp_with_or_without_sequence_parallelism(sp, rule, qk_norm):
    """The gains are whole on every tp rank, each applying them to its own heads: one sum over tp, of the gains
    alone without sequence parallelism, among every replicated parameter with it (never twice)."""
    layout = stage_parallelism(Sharding(tp=4, sequence_parallel=sp), kv_heads=2, qk_norm=qk_norm)
    assert [(r.name, r.group, r.params) for r in layout.reductions] == [("partial", "tp", rule),
                                                                        ("shared kv", "tp", "shared-kv")]
    assert layout.partial("blocks.0.attn.q_norm.weight") and layout.partial("blocks.3.attn.k_norm.weight")
    assert layout.partial("blocks.0.ln1.weight") == sp and not layout.partial("blocks.0.attn.k.weight")
    assert [layout.counted("blocks.0.attn.k_norm.weight", r) for r in range(4)] == [True, False, False, False]
    assert stage_parallelism(Sharding(tp=4), kv_heads=2).reductions[0].name == "shared kv"  # no gains: no sum
    assert not stage_parallelism(Sharding(dp=2), qk_norm="head").partial("blocks.0.attn.q_norm.weight")


def test_the_planner_reads_the_same_gradient_group():
    for sharding in (Sharding(dp=2, cp=3), Sharding(dp=4, tp=2), Sharding(cp=2, pp=4)):
        assert memory.gradient_group(sharding) == stage_parallelism(sharding).gradient_ranks \
            == sharding.dp * sharding.cp


def test_the_gradient_sum_runs_over_the_mesh_group_of_its_axes():
    """One table says which ranks average a stage's gradients: the mesh builds that group, the syncs reduce over it."""
    sharding = Sharding(dp=2, pp=2, cp=2, tp=2)
    layout = stage_parallelism(sharding)
    (gradients,) = [r for r in layout.reductions if r.name == "gradients"]
    assert GRADIENT_AXES == GROUP_AXES[gradients.group] == ("dp", "cp")
    groups = group_members(sharding.dims)[gradients.group]
    assert {len(g) for g in groups} == {layout.gradient_ranks} == {4} and len(groups) == 4
    assert groups[0] == [0, 2, 8, 10]  # rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i


@pytest.mark.parametrize("tp, sp, qk_norm", [(2, True, "none"), (4, False, "none"), (4, True, "none"),
                                             (2, False, "head"), (4, True, "head"), (4, False, "projection")])
def test_the_parameters_each_sum_takes_are_the_tp_layers(tp, sp, qk_norm):
    """The description's rules pick, by name, what tensor_parallel.layers' own lists pick on a slice."""
    model = dataclasses.replace(LLAMA, qk_norm=qk_norm)
    module = GPT(model, init_seed=0)
    module.tensor_parallel = TPLayout(0, tp, sp)  # the lists read only this (no group needed)
    layout = stage_parallelism(Sharding(tp=tp, sequence_parallel=sp), LLAMA.kv_heads, qk_norm=qk_norm)
    names = {id(p): n for n, p in module.named_parameters()}
    record = Parallelized(module, layout)
    assert [names[id(p)] for p in record.partial_params()] == [names[id(p)] for p in
                                                               partial_grad_params(module)]
    assert [names[id(p)] for p in record.shared_kv_params()] == [names[id(p)] for p in replicated_kv_params(module)]
    assert bool(record.partial_params()) == (sp or qk_norm != "none")
    gains = [n for n in map(names.get, map(id, record.partial_params())) if "_norm." in n]
    assert len(gains) == (0 if qk_norm == "none" else 4)  # q_norm, k_norm of two blocks, with or without sp
    assert len(record.shared_kv_params()) == (4 if tp == 4 else 0)  # attn.k, attn.v weights of two blocks


def test_who_owns_and_counts_what():
    layout = stage_parallelism(Sharding(tp=4), kv_heads=2)  # each kv head shared by two tp ranks
    assert layout.owned("blocks.0.ln1.weight", 0) and not layout.owned("blocks.0.ln1.weight", 1)
    assert layout.owned("blocks.0.attn.q.weight", 3) and layout.counted("blocks.0.attn.q.weight", 3)
    assert [layout.counted("blocks.1.attn.k.weight", r) for r in range(4)] == [True, False, True, False]
    assert [layout.owned("blocks.1.attn.k.weight", r) for r in range(4)] == [True] * 4
    alone = stage_parallelism(Sharding(dp=2))
    assert alone.owned("blocks.0.ln1.weight", 0) and alone.counted("blocks.0.attn.k.weight", 0)


def test_parallelize_places_and_records_a_stage():
    module = GPT(LLAMA, layers=range(1), embed=True, head=False, init_seed=0)
    mesh = SimpleNamespace(tp_index=0, cp_index=0, group=lambda name: None)
    layout = stage_parallelism(Sharding(dp=2), LLAMA.kv_heads)
    done = parallelize(module, layout, mesh, device=torch.device("cpu"), dtype=torch.float64)
    assert done.module is module and done.layout is layout and done.tp_rank == 0
    assert {p.dtype for p in module.parameters()} == {torch.float64}
    assert module.context_parallel is None and getattr(module, "tensor_parallel", None) is None
    with pytest.raises(ValueError, match="recompute"):
        parallelize(GPT(LLAMA, init_seed=0), stage_parallelism(Sharding(), recompute="full"), mesh,
                    device=torch.device("cpu"), dtype=torch.float32)
