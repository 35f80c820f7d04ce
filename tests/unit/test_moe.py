"""The mixture-of-experts layer (pipegpt.model.moe) against a naive per-token loop in float64: forward, the aux
loss and every gradient (router included); capacity drops the right tokens; the bias update; the model kind's
config checks, layer rules and parameter counts by hand."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from pipegpt import arch
from pipegpt.config import ConfigError, ModelConfig, model_config
from pipegpt.model import flops
from pipegpt.model.gpt import GPT
from pipegpt.model.moe import MoE, end_step, expert_outputs

pytestmark = pytest.mark.usefixtures("one_thread")

C, E, H, K = 16, 6, 8, 2


def _config(**changes) -> ModelConfig:
    base = dict(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=C, arch="llama", bias=False,
                n_experts=E, n_experts_per_token=K, expert_hidden=H, n_shared_experts=1,
                router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
    return ModelConfig(**{**base, **changes}).validate()


def _layer(config: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(config).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.expert_bias.normal_(0, 0.2)
    return layer


def _swiglu(x, gate, up, proj):
    return proj @ (F.silu(gate @ x) * (up @ x))


def _gelu(x, fc, proj):
    """GPT-2's MLP without biases: its tanh GELU."""
    return proj @ F.gelu(fc @ x, approximate="tanh")


def _expert(layer: MoE, x, e):
    if hasattr(layer, "experts_gate"):
        return _swiglu(x, layer.experts_gate[e], layer.experts_up[e], layer.experts_proj[e])
    return _gelu(x, layer.experts_fc[e], layer.experts_proj[e])


def _shared(layer: MoE, x):
    s = layer.shared
    return (_swiglu(x, s.gate.weight, s.up.weight, s.proj.weight) if hasattr(s, "gate")
            else _gelu(x, s.fc.weight, s.proj.weight))


def _naive(layer: MoE, x: torch.Tensor, capacity: int | None = None):
    """Per token: scores, its top-k by score + bias, their experts' MLPs weighted; the aux loss from its
    definition."""
    N = x.size(0)
    outs, chosen_all, logits_all, scores_all, taken = [], [], [], [], [0] * E
    for t in range(N):
        logits = layer.router.weight @ x[t]
        scores = logits.softmax(-1) if layer.score == "softmax" else logits.sigmoid()
        chosen = sorted(range(E), key=lambda e: -float(scores[e].detach() + layer.expert_bias[e]))[:K]
        weights = scores[chosen] / (scores[chosen].sum() if layer.normalise else 1)
        out = torch.zeros_like(x[t])
        for w, e in zip(weights, chosen):
            if capacity is not None and taken[e] >= capacity:
                continue  # dropped: the expert is full
            taken[e] += 1
            out = out + w * _expert(layer, x[t], e)
        if layer.shared is not None:
            out = out + _shared(layer, x[t])
        outs.append(out)
        chosen_all.append(chosen)
        logits_all.append(logits)
        scores_all.append(scores)
    logits, scores = torch.stack(logits_all), torch.stack(scores_all)
    share = torch.tensor([sum(e in c for c in chosen_all) / N for e in range(E)], dtype=x.dtype)
    probs = scores if layer.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = (layer.aux_coef * E * (share * probs.mean(0)).sum()
           + layer.z_coef * (logits.logsumexp(-1) ** 2).mean())
    return torch.stack(outs), aux, taken


def _grads(layer, loss, x):
    layer.zero_grad()
    x.grad = None
    loss.backward()
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}


# GPT-2-style blocks (LayerNorm, learned positions) get GELU experts: the architecture's own MLP, without biases
GPT2 = dict(arch="gpt2", bias=True)


@pytest.mark.parametrize("score, normalise, changes", [("softmax", True, {}), ("softmax", False, {}),
                                                       ("sigmoid", True, {}), ("softmax", True, GPT2)])
def test_the_layer_equals_a_per_token_loop(score, normalise, changes):
    layer = _layer(_config(router_score=score, norm_topk_prob=normalise, **changes))
    x = torch.randn(12, C, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, C, dtype=torch.float64)
    out = layer(x)
    mine = _grads(layer, (out * weight).sum(), x)  # the aux loss enters through backward, gradient 1
    ref_out, aux, taken = _naive(layer, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    ref = _grads(layer, (ref_out * weight).sum() + aux, x)
    assert set(mine) == set(ref) and "router.weight" in mine
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert layer.tokens_per_expert.tolist() == taken and sum(taken) == 12 * K  # dropless: every assignment
    assert float(layer.aux_sum) == pytest.approx(float(aux.detach()), rel=1e-12)


def test_without_aux_loss_the_router_learns_from_the_weights_alone():
    layer = _layer(_config(router_aux_loss_coef=0.0, router_z_loss_coef=0.0))
    x = torch.randn(10, C, dtype=torch.float64, requires_grad=True)
    mine = _grads(layer, layer(x).sum(), x)
    ref = _grads(layer, _naive(layer, x)[0].sum(), x)
    for name in ref:
        torch.testing.assert_close(mine[name], ref[name], rtol=1e-10, atol=1e-12)
    assert layer.calls == 0  # no aux loss recorded


def test_capacity_drops_the_overflow_in_token_order():
    factor = 0.5
    layer = _layer(_config(moe_capacity_factor=factor))
    N = 12
    capacity = math.ceil(factor * N * K / E)  # 2 per expert: 12 of 24 assignments at most
    x = torch.randn(N, C, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    ref_out, aux, taken = _naive(layer, x, capacity)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    assert max(taken) <= capacity
    assert layer.tokens_per_expert.tolist() == taken
    assert float(layer.dropped) == N * K - sum(taken) > 0


def test_the_expert_loop_equals_each_experts_swiglu():
    """expert_outputs' fallback (the path on CPU) with an expert that gets no token."""
    torch.manual_seed(1)
    gate, up, proj = torch.randn(3, H, C).double(), torch.randn(3, H, C).double(), torch.randn(3, C, H).double()
    counts = [2, 0, 3]
    x = torch.randn(5, C, dtype=torch.float64)
    owner = [0, 0, 2, 2, 2]
    ref = torch.stack([_swiglu(x[i], gate[e], up[e], proj[e]) for i, e in enumerate(owner)])
    torch.testing.assert_close(expert_outputs(x, counts, gate, up, proj, grouped=False), ref)
    assert expert_outputs(x[:0], [0, 0, 0], gate, up, proj, grouped=False).shape == (0, C)
    gelu = torch.stack([_gelu(x[i], gate[e], proj[e]) for i, e in enumerate(owner)])  # two weights: GELU experts
    torch.testing.assert_close(expert_outputs(x, counts, gate, proj, grouped=False), gelu)


def test_the_bias_moves_against_the_load():
    layer = _layer(_config())
    layer.expert_bias.zero_()
    layer.tokens_per_expert.copy_(torch.tensor([6.0, 2, 4, 4, 0, 8]))  # mean 4
    layer.dropped.fill_(3)
    stats = end_step(layer, rate=0.5)
    assert layer.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0, 0.5, -0.5]
    assert stats["moe_imbalance"] == 2.0 and stats["moe_dropped"] == 3.0
    assert layer.tokens_per_expert.tolist() == [0.0] * E  # forgotten until the next step


def test_the_bias_is_checkpointed_state():
    state = GPT(_config(), init_seed=0).state_dict()
    assert sorted(k for k in state if "expert_bias" in k) == ["blocks.0.mlp.expert_bias", "blocks.1.mlp.expert_bias"]
    assert not any("tokens_per_expert" in k for k in state)
    assert arch.buffer_shapes(_config()) == {k: tuple(v.shape) for k, v in state.items() if "expert_bias" in k}
    assert arch.buffer_shapes(dataclasses.replace(_config(), n_experts=0, n_experts_per_token=None,
                                                  n_shared_experts=0, expert_hidden=None, router_aux_loss_coef=0.0,
                                                  router_z_loss_coef=0.0)) == {}


@pytest.mark.parametrize("changes, kinds", [
    (dict(), ["moe"] * 4),
    (dict(moe_every=2), ["moe", "dense", "moe", "dense"]),
    (dict(first_dense_layers=1), ["dense", "moe", "moe", "moe"]),
    (dict(first_dense_layers=1, moe_every=2), ["dense", "moe", "dense", "moe"]),
])
def test_which_layers_are_moe(changes, kinds):
    model = _config(n_layer=4, **changes)
    assert [k.name for k in arch.layer_kinds(model)] == kinds
    gpt = GPT(model, init_seed=0)
    assert list(arch.named_shapes(model).items()) == [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]


def test_parameters_and_active_flops_by_hand():
    model = _config(n_layer=1)
    attn = 4 * C * C  # q, k, v (2 kv heads of 8 = all heads: n_kv_head None) and proj
    experts, router, shared = 3 * E * H * C, E * C, 3 * H * C
    block = attn + experts + router + shared + 2 * C
    assert flops.block_parameters(model, arch.MOE) == block == 3_840
    active = attn + 3 * (K + 1) * H * C + router + 2 * C  # top-2 and the shared expert
    V = model.padded_vocab_size
    assert flops.matmul_parameters(model) == active + C + V * C == 2_304 + 16 + 1_024
    assert GPT(model, init_seed=0).num_parameters() == block + C + V * C  # tied


@pytest.mark.parametrize("changes, message", [
    (dict(n_experts_per_token=7), "n_experts_per_token=7 is above n_experts=6"),
    (dict(moe_capacity_factor=-1.0), "moe_capacity_factor=-1.0 must be a finite number >= 0 \\(0: dropless\\)"),
    (dict(n_experts=0), "set on a model without experts"),
    (dict(router_score="relu"), "router_score='relu' is not valid"),
])
def test_bad_settings_are_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError, match=message):
        _config(**changes)


def test_presets():
    mixtral = model_config("mixtral-8x7b")
    assert arch.uniform(mixtral) and arch.layer_kinds(mixtral)[0] is arch.MOE
    params = sum(math.prod(s) for s in arch.named_shapes(mixtral).values())
    assert round(params / 1e9, 1) == 46.7  # Mixtral 8x7B: 46.7B parameters, 12.9B active
    embedding = mixtral.vocab_size * mixtral.n_embd  # in the published active count, a lookup in the FLOPs'
    assert round((flops.matmul_parameters(mixtral) + embedding) / 1e9, 1) == 12.9
    olmoe = model_config("olmoe-1b-7b")
    assert round(sum(math.prod(s) for s in arch.named_shapes(olmoe).values()) / 1e9, 2) == 6.92
    tiny = model_config("tiny-moe")
    assert (tiny.n_experts, tiny.experts_per_token, tiny.n_shared_experts) == (8, 2, 1)
    assert dataclasses.replace(tiny, n_experts=0, n_experts_per_token=None, n_shared_experts=0, expert_hidden=None,
                               router_aux_loss_coef=0.0).validate()


def test_stats_merge_over_ranks_and_reach_the_metrics():
    from pipegpt.model.moe import merge_stats
    from pipegpt.observe.metrics import StepMetrics, tensorboard_scalars

    ranks = [{"aux_loss": 0.3, "moe_imbalance": 1.5, "moe_dropped": 2.0}, {},  # a dense-only stage reports none
             {"aux_loss": 0.1, "moe_imbalance": 2.5, "moe_dropped": 1.0}]
    merged = merge_stats(ranks, replicas=2)
    assert merged == {"aux_loss": pytest.approx(0.2), "moe_imbalance": 2.5, "moe_dropped": 3.0}
    assert merge_stats([{}, {}]) == {}
    scalars = dict(tensorboard_scalars(StepMetrics(1, 4.0, 1.0, 100.0, 1.0, [0], moe=merged)))
    assert scalars["train/moe_imbalance"] == 2.5 and "train/moe" not in scalars
    assert not any("moe" in tag or "aux" in tag for tag, _ in tensorboard_scalars(
        StepMetrics(1, 4.0, 1.0, 100.0, 1.0, [0])))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [2, 1], ids=["swiglu", "gelu"])
def test_the_grouped_matmul_equals_the_loop(dtype, inputs):
    """Both paths of expert_outputs (torch._grouped_mm runs on CPU too in recent torch), forward and gradients,
    with an expert that gets no token."""
    torch.manual_seed(0)
    shapes = ((3, H, C),) * inputs + ((3, C, H),)
    weights = [torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in shapes]
    x = torch.randn(5, C, dtype=dtype, requires_grad=True)
    weight = torch.randn(5, C, dtype=dtype)
    outs = [expert_outputs(x, [2, 0, 3], *weights, grouped=grouped) for grouped in (True, False)]
    grads = [torch.autograd.grad((out * weight).sum(), (x, *weights)) for out in outs]
    # SwiGLU's are bitwise; GELU's differ in fp32's last bits (2.4e-7 measured): tanh GELU carries them on
    exact = inputs == 2 or dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1], rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5 if dtype == torch.float32 else 1e-2)
        assert b.abs().max() > 1  # real gradients


def test_the_planners_memory_counts_every_expert():
    """Stage parameters (what the planner's memory sizes) are the built slices' own, experts and all."""
    from pipegpt.costs import memory

    model = dataclasses.replace(model_config("tiny-moe"), first_dense_layers=1)
    for layers, embed, head in ((range(0, 2), True, False), (range(2, 4), False, True)):
        built = GPT(model, layers=layers, embed=embed, head=head, init_seed=0).num_parameters()
        assert memory.parameter_count(model, layers, embed, head) == built
    experts = 3 * 8 * 96 * 128  # 8 experts of width 96 at C = 128: gate, up, proj
    assert memory.parameter_count(model, range(1, 2), False, False) - \
        memory.parameter_count(model, range(0, 1), False, False) == experts + 8 * 128 + 3 * 96 * 128 - 3 * 352 * 128


def test_unset_top_k_and_width_take_their_defaults():
    model = _config(n_experts_per_token=None, expert_hidden=None, ffn_hidden=24)
    layer = GPT(model, init_seed=0).blocks["0"].mlp
    assert (layer.top_k, tuple(layer.experts_gate.shape)) == (2, (E, 24, C))
    assert layer(torch.randn(3, C)).shape == (3, C)


def test_gpt2_style_blocks_have_gelu_experts_named_as_the_architecture_data_says():
    """LayerNorm, learned positions, fused q/k/v, and experts_fc / experts_proj (GPT-2's fc, proj): the built
    model's names and shapes are arch.named_shapes', its FLOPs count 2 expert matrices per active expert."""
    model = _config(**GPT2)
    built = GPT(model, init_seed=0)
    assert {n: tuple(p.shape) for n, p in built.named_parameters()} == arch.named_shapes(model)
    block = dict(arch.block_shapes(model, 1, arch.MOE))
    assert block["mlp.experts_fc"] == (E, H, C) and block["mlp.shared.fc.weight"] == (H, C)
    assert "mlp.experts_gate" not in block and "wpe.weight" in arch.named_shapes(model)
    assert isinstance(built.blocks["0"].ln2, torch.nn.LayerNorm)
    attn = 3 * C * C + C * C + 4 * C  # fused qkv, proj and their biases
    norms = 2 * 2 * C  # LayerNorms' gains and biases; experts (and the router) have no biases
    active = attn + 2 * (K + 1) * H * C + E * C + norms
    assert flops.matmul_parameters(model) == 2 * active + 2 * C + model.padded_vocab_size * C  # ln_f, lm_head
    from pipegpt.tools.convert import ConvertError
    from pipegpt.tools.convert_moe import family_of

    with pytest.raises(ConvertError, match="no GPT-2-style blocks"):  # no Hugging Face family computes it
        family_of(dataclasses.replace(model, bias=False, n_shared_experts=0))
