"""The mixture-of-experts oracle: a tiny MoE (4 experts, top-2, a shared expert) trained in a pipeline equals the
same model in one process. Loss and every named gradient (router included) after one step in fp32; parameters
after 3 AdamW steps and the router bias after its updates (exactly) in float64.

The one-process model accumulates over the pipeline's microbatches in step 0 too: the aux loss is a product of
per-call means (f_i P_i), so one call on the whole batch is another objective than the mean of the microbatches'.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.data.loader import BatchSampler
from pipegpt.data.tokenizers import get_tokenizer
from pipegpt.data.tokens import builtin_tokens
from pipegpt.model.gpt import build_reference_model
from pipegpt.model.moe import end_step, set_aux_loss_scale
from pipegpt.train.driver import check
from pipegpt.train.optim import lr_at, make_optimizer, set_lr

from helpers import one_thread
from test_pipeline_oracle import ATOL, NOISE, RTOL, workers  # noqa: F401 (a fixture)

MOE = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
                  arch="llama", bias=False, tie_embeddings=False, n_experts=4, n_experts_per_token=2,
                  n_shared_experts=1, expert_hidden=32, first_dense_layers=1, router_aux_loss_coef=0.01,
                  router_bias_update_rate=1e-3)
# GPT-2-style blocks: LayerNorm, learned positions, fused q/k/v, biases and tied embeddings; GELU experts (the
# architecture's MLP, without biases)
GPT2_MOE = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, n_embd=32, arch="gpt2", bias=True,
                       tie_embeddings=True, n_experts=4, n_experts_per_token=2, n_shared_experts=1, expert_hidden=32,
                       first_dense_layers=1, router_aux_loss_coef=0.01, router_bias_update_rate=1e-3)


def moe_config(p: int, model: ModelConfig = MOE, **changes) -> TrainConfig:
    cfg = TrainConfig.build(model, stages=p, microbatches=2 * p, microbatch_size=2, device="cpu", seed=7,
                            lr=1e-3, timeout_s=60)
    return cfg.replace(**changes)


class _RoundedToBf16(torch.autograd.Function):
    """What a bf16 pipeline message does to the residual stream at a stage boundary: the activation rounded to bf16
    on its way forward, its gradient on its way back."""

    @staticmethod
    def forward(ctx, x):
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.bfloat16).to(grad.dtype)


def reference(cfg: TrainConfig, steps: int, rounded_after: tuple[int, ...] = ()):
    """Step 0's mean loss and (clipped) gradients, the parameters and router biases after `steps` AdamW steps, and
    the largest |gradient| each element saw; every step accumulated over the dp x m microbatches. Under
    precision bf16 the forward runs under autocast; rounded_after: the blocks whose outputs (and their gradients)
    are rounded to bf16, as --p2p-dtype bf16 sends them to another rank's stage."""
    with one_thread():
        model = build_reference_model(cfg.model, cfg.runtime.seed).to(getattr(torch, cfg.runtime.dtype))
        for block in rounded_after:
            model.blocks[str(block)].register_forward_hook(lambda m, i, out: _RoundedToBf16.apply(out))
        named = list(model.named_parameters())
        optimizer = make_optimizer(named, cfg.optim)
        sampler = BatchSampler(builtin_tokens(get_tokenizer(cfg.data.tokenizer)), cfg.batch_size,
                               cfg.model.seq_len, cfg.runtime.seed)
        signal = {n: torch.zeros_like(p) for n, p in named}
        loss0 = grads0 = None
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            x, y = sampler.batch(step)
            chunks = list(zip(x.split(cfg.parallel.microbatch_size), y.split(cfg.parallel.microbatch_size)))
            set_aux_loss_scale(model, 1 / len(chunks))
            losses = []
            for xm, ym in chunks:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.runtime.precision == "bf16"):
                    loss = model(xm, ym)
                (loss / len(chunks)).backward()
                losses.append(loss.item())
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            if step == 0:
                loss0, grads0 = sum(losses) / len(losses), {n: p.grad.clone() for n, p in named}
            for n, p in named:
                signal[n] = torch.maximum(signal[n], p.grad.abs())
            set_lr(optimizer, lr_at(step, cfg.optim, cfg.runtime.steps))
            optimizer.step()
            end_step(model, cfg.model.router_bias_update_rate)
        biases = {n: b.clone() for n, b in model.state_dict().items() if n.endswith("expert_bias")}
        return loss0, grads0, {n: p.detach().clone() for n, p in named}, signal, biases


def assert_moe_matches(cfg: TrainConfig, host, steps: int) -> None:
    ref_loss, ref_grads, ref_params, signal, ref_biases = reference(cfg, steps)
    loss, grads, params = host.run(cfg, steps)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    assert {n for n, _ in grads} == set(ref_grads), "every parameter must get a gradient somewhere"
    assert any("mlp.router" in n for n in ref_grads) and any("experts_proj" in n for n in ref_grads)
    for name, grad in grads:
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
    if cfg.runtime.dtype == "float64":
        for name, value in params:
            real = signal[name] > NOISE
            torch.testing.assert_close(value[real], ref_params[name][real], rtol=1e-9, atol=cfg.optim.lr * 1e-6,
                                       msg=lambda m: f"param {name}: {m}")
    biases = dict(host.buffers(cfg))
    assert set(biases) == set(ref_biases) == {f"blocks.{i}.mlp.expert_bias" for i in (1, 2, 3)}
    for name, bias in biases.items():
        assert torch.equal(bias, ref_biases[name]), f"{name}: {bias} != {ref_biases[name]}"
    if steps > 1 and cfg.model.router_bias_update_rate:
        assert any(b.abs().sum() > 0 for b in biases.values()), "the bias never moved"


CASES = [(1, 2, "1f1b", 0, MOE, "none"), (1, 2, "zb-h1", 0, MOE, "none"),
         (1, 2, "1f1b", 0, dataclasses.replace(MOE, router_aux_loss_coef=0.0, router_z_loss_coef=1e-3), "none"),
         (2, 2, "1f1b", 1, MOE, "none"), (2, 2, "zb-h1", 3, MOE, "none"), (1, 2, "zb-h1", 0, MOE, "full")]


@pytest.mark.parametrize("dp, p, schedule, zero, model, recompute", CASES,
                         ids=["1f1b", "zb-h1", "no-aux-z-loss", "dp2-zero1", "dp2-zb-h1-zero3", "zb-h1-recompute"])
def test_moe_pipeline_matches_one_process(workers, dp, p, schedule, zero, model, recompute):  # noqa: F811
    cfg = moe_config(p, model, dp=dp, schedule=schedule, zero=zero, recompute=recompute)
    check(cfg)
    host = workers(cfg)
    assert_moe_matches(cfg, host, steps=1)
    assert_moe_matches(cfg.replace(dtype="float64"), host, steps=3)


# Expert parallelism: each dp rank holds E/ep experts and exchanges tokens with its ep group. One fast case in the
# default suite; the pipelined ones slow.
NO_AUX_Z_LOSS = dataclasses.replace(MOE, router_aux_loss_coef=0.0, router_z_loss_coef=1e-3)
EP_CASES = [pytest.param(1, 2, 2, "1f1b", "none", MOE, 0, id="ep2-dp2"),
            pytest.param(2, 2, 2, "1f1b", "none", MOE, 0, id="ep2-dp2-pp2", marks=pytest.mark.slow),
            pytest.param(2, 2, 2, "zb-h1", "none", MOE, 0, id="ep2-dp2-pp2-zb-h1", marks=pytest.mark.slow),
            pytest.param(2, 2, 2, "1f1b", "full", NO_AUX_Z_LOSS, 0, id="ep2-dp2-pp2-recompute-z-loss",
                         marks=pytest.mark.slow),
            # each rank drops what one process drops of the same microbatch: capacity per call, before dispatch
            # (at 0.5 here, half of each layer's assignments)
            pytest.param(1, 2, 2, "1f1b", "none", dataclasses.replace(MOE, moe_capacity_factor=0.5), 0,
                         id="ep2-dp2-capacity", marks=pytest.mark.slow),
            # dp 4: each expert on two ranks (edp 2), its gradient summed over them; ZeRO shards it over them
            pytest.param(1, 4, 2, "1f1b", "none", MOE, 0, id="ep2-dp4", marks=pytest.mark.slow),
            pytest.param(1, 4, 2, "1f1b", "none", MOE, 1, id="ep2-dp4-zero1", marks=pytest.mark.slow),
            pytest.param(1, 4, 4, "1f1b", "none", MOE, 2, id="ep4-dp4-zero2", marks=pytest.mark.slow),
            pytest.param(1, 4, 2, "1f1b", "none", MOE, 3, id="ep2-dp4-zero3", marks=pytest.mark.slow),
            pytest.param(2, 2, 2, "zb-h1", "none", MOE, 3, id="ep2-dp2-pp2-zb-h1-zero3", marks=pytest.mark.slow)]


@pytest.mark.parametrize("p, dp, ep, schedule, recompute, model, zero", EP_CASES)
def test_moe_with_experts_over_ep_ranks_matches_one_process(workers, p, dp, ep, schedule, recompute, model,  # noqa: F811
                                                            zero):
    cfg = moe_config(p, model, dp=dp, ep=ep, schedule=schedule, recompute=recompute, zero=zero)
    check(cfg)
    host = workers(cfg)
    assert_moe_matches(cfg, host, steps=1)
    assert_moe_matches(cfg.replace(dtype="float64"), host, steps=3)


# On 4 ranks, ep 2 x pp 2 (dp 2): GPT-2-style blocks; order matching (NCCL's, the CUDA control path, run on gloo:
# sends in the plan's places, the all-to-alls between them); the synthesized schedule. One order-matched and one
# GPT-2 case in the default suite (fp32 step only: the grid's workers start once for both), the rest slow.
GRID_CASES = [pytest.param(dict(p2p_matching="order"), MOE, False, id="ep2-dp2-pp2-order"),
              pytest.param({}, GPT2_MOE, False, id="gpt2-ep2-dp2-pp2"),
              pytest.param({}, GPT2_MOE, True, id="gpt2-ep2-dp2-pp2-fp64", marks=pytest.mark.slow),
              pytest.param(dict(schedule="zb-h1", zero=3), GPT2_MOE, True, id="gpt2-ep2-dp2-pp2-zb-h1-zero3",
                           marks=pytest.mark.slow),
              pytest.param(dict(p2p_matching="order"), MOE, True, id="ep2-dp2-pp2-order-fp64", marks=pytest.mark.slow),
              pytest.param(dict(p2p_matching="order", schedule="zb-h1"), MOE, True, id="ep2-dp2-pp2-order-zb-h1",
                           marks=pytest.mark.slow),
              pytest.param(dict(p2p_matching="order", schedule="zb-h1", zero=3), MOE, True,
                           id="ep2-dp2-pp2-order-zb-h1-zero3", marks=pytest.mark.slow),
              pytest.param(dict(p2p_matching="order", p2p_groups="pairs", schedule="zb-h1", zero=3), MOE, True,
                           id="ep2-dp2-pp2-order-pair-groups-zb-h1-zero3", marks=pytest.mark.slow),
              pytest.param(dict(p2p_matching="order", recompute="full"), NO_AUX_Z_LOSS, True,
                           id="ep2-dp2-pp2-order-recompute-z-loss", marks=pytest.mark.slow),
              pytest.param(dict(p2p_matching="order"), GPT2_MOE, True, id="gpt2-ep2-dp2-pp2-order",
                           marks=pytest.mark.slow),
              pytest.param(dict(schedule="auto"), MOE, True, id="ep2-dp2-pp2-auto", marks=pytest.mark.slow),
              pytest.param(dict(schedule="auto", p2p_matching="order"), MOE, True, id="ep2-dp2-pp2-auto-order",
                           marks=pytest.mark.slow),
              pytest.param(dict(schedule="auto"), GPT2_MOE, True, id="gpt2-ep2-dp2-pp2-auto", marks=pytest.mark.slow)]


@pytest.mark.parametrize("changes, model, fp64", GRID_CASES)
def test_moe_over_ep_and_stages_matches_one_process(workers, changes, model, fp64):  # noqa: F811
    cfg = moe_config(2, model, dp=2, ep=2, **changes)
    check(cfg)
    host = workers(cfg)
    assert_moe_matches(cfg, host, steps=1)
    if fp64:
        assert_moe_matches(cfg.replace(dtype="float64"), host, steps=3)


# bf16 gradients, normwise: the experts' weight gradients of an ep rank come from one bf16 matmul over the rows of
# both dp ranks' microbatches, one process's from one per microbatch, each rounded to bf16 (2^-8 = 3.9e-3 per value)
# before the fp32 sum. Measured at most 4.0e-3 (Llama's blocks.1.attn.k.weight; any message dtype, any
# recomputation, paired schedules too); a gradient that lost or doubled a rank's share is off by ~0.5.
BF16_GRAD_RTOL = 1e-2


def assert_bf16_matches(cfg: TrainConfig, host, rounded_after: tuple[int, ...]) -> float:
    """One bf16 step of cfg against the one-process model under the same autocast, its messages rounded after the
    blocks rounded_after: the loss within 1e-5 (the same sequence of bf16 operations: measured equal), every named
    gradient within BF16_GRAD_RTOL normwise. Returns the worst gradient's normwise difference."""
    ref_loss, ref_grads, *_ = reference(cfg, 1, rounded_after)
    loss, grads, _ = host.run(cfg, 1)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert {n for n, _ in grads} == set(ref_grads) and any("mlp.router" in n for n in ref_grads)
    differences = {name: float((grad - ref_grads[name]).norm() / ref_grads[name].norm()) for name, grad in grads}
    worst = max(differences, key=differences.get)
    assert differences[worst] < BF16_GRAD_RTOL, f"grad {worst}: {differences[worst]:.2e} normwise"
    return differences[worst]


# Full recomputation casts the expert weights per call (model.moe's cast_once off); selective recomputes the
# attention of MoE blocks too.
BF16_CASES = [pytest.param(MOE, "auto", "none", id="llama-bf16-messages"),
              pytest.param(MOE, "auto", "full", id="llama-bf16-messages-recompute"),
              pytest.param(MOE, "auto", "selective", id="llama-bf16-messages-selective", marks=pytest.mark.slow),
              pytest.param(GPT2_MOE, "auto", "none", id="gpt2-bf16-messages", marks=pytest.mark.slow),
              pytest.param(GPT2_MOE, "auto", "full", id="gpt2-bf16-messages-recompute", marks=pytest.mark.slow),
              pytest.param(MOE, "fp32", "none", id="llama-fp32-messages", marks=pytest.mark.slow),
              pytest.param(MOE, "fp32", "full", id="llama-fp32-messages-recompute", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model, p2p_dtype, recompute", BF16_CASES)
def test_bf16_over_ep_and_stages_matches_one_process_under_autocast(workers, model, p2p_dtype,  # noqa: F811
                                                                    recompute):
    """--precision bf16, dp 2 x ep 2 x pp 2, against the one-process model under the same autocast. Under bf16 the
    stages' messages are bf16 (--p2p-dtype auto): the reference rounds the residual stream after the first stage's
    last block (and its gradient) alike, else a routing choice near a tie may differ (4.7e-2 measured without)."""
    cfg = moe_config(2, model, dp=2, ep=2, precision="bf16", p2p_dtype=p2p_dtype, layers_per_stage=(2, 2),
                     recompute=recompute)
    check(cfg)
    assert_bf16_matches(cfg, workers(cfg), (1,) if p2p_dtype == "auto" else ())


@pytest.mark.slow
def test_validation_with_experts_over_ep_equals_dp_without(workers):  # noqa: F811
    """The forward-only plan moves tokens to their experts too: the validation loss is dp 2's without ep."""
    losses = [workers(cfg).evaluate(cfg) for cfg in (moe_config(1, dp=2, ep=2), moe_config(1, dp=2))]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and 3 < losses[0] < 7


def test_the_router_bias_is_checkpointed_and_restored(workers, tmp_path):  # noqa: F811
    """Saved after 2 steps it is the one-process bias after 2; resumed (a fresh build: biases at 0 until loaded)
    and stepped once, the one-process bias after 3. float64: no rounding flips a routing choice."""
    from pipegpt.state.checkpoint import read_weights

    cfg = moe_config(2, dtype="float64", steps=3)
    host = workers(cfg)
    path, _ = host.save(cfg, tmp_path, 2)
    saved = {n: t for n, t in read_weights(path).items() if n.endswith("expert_bias")}
    after_two, after_three = reference(cfg, 2)[4], reference(cfg, 3)[4]
    assert set(saved) == set(after_two) and all(torch.equal(saved[n], after_two[n]) for n in saved)
    assert any(b.abs().sum() > 0 for b in saved.values())
    host.resume(cfg, path)
    assert all(torch.equal(b, after_three[n]) for n, b in host.buffers(cfg))
    assert not all(torch.equal(after_two[n], after_three[n]) for n in saved)  # the resumed step moved it


def _restored(workers, saved_cfg, path, cfg):  # noqa: F811
    """Resume the checkpoint at path into cfg's layout: every parameter and Adam moment bitwise the one-process
    tensor the checkpoint holds (the experts whole: [E, ...]); the next step's loss; the router biases after it."""
    from pipegpt.state.checkpoint import CheckpointReader

    reader = CheckpointReader(path)
    host = workers(cfg)
    params, moments, loss = host.resume(cfg, path)
    assert any(k.endswith("experts_proj") for k in params) and len(params) == len(
        [k for k in reader.where if k.startswith("param/") and not k.endswith("expert_bias")])
    for key, value in {**params, **moments}.items():
        name = key.split("/", 1)[1]
        assert torch.equal(value, reader.full(key, name)), key
    assert params["param/blocks.1.mlp.experts_proj"].shape[0] == MOE.n_experts
    return loss, dict(host.buffers(cfg))


def _saved(workers, cfg, root):  # noqa: F811
    """Train cfg 2 steps, save, step once more: the checkpoint, that step's loss and the biases after it."""
    host = workers(cfg)
    path, loss = host.save(cfg, root, 2)
    return path, loss, dict(host.buffers(cfg))


@pytest.mark.parametrize("saved, restored, dp, model", [
    pytest.param(dict(ep=2), dict(ep=1), 2, MOE, id="ep2-to-ep1", marks=pytest.mark.slow),
    pytest.param(dict(ep=2), dict(ep=1), 2, GPT2_MOE, id="gpt2-ep2-to-ep1", marks=pytest.mark.slow),
    pytest.param(dict(ep=1), dict(ep=4), 4, MOE, id="ep1-to-ep4", marks=pytest.mark.slow),
    pytest.param(dict(ep=2, zero=1), dict(ep=4, zero=3), 4, MOE, id="ep2-zero1-to-ep4-zero3",
                 marks=pytest.mark.slow)])
def test_expert_checkpoints_reshard_across_ep(workers, tmp_path, saved, restored, dp, model):  # noqa: F811
    """A checkpoint written with experts over one ep (and ZeRO) resumes over another: every tensor bitwise, the
    next step's loss within 1e-5 of the writer's, the router biases after it exactly (float64). Experts under
    their one-process names, whole: [E, ...]."""
    from pipegpt.state.checkpoint import read_weights

    saved_cfg = moe_config(1, model, dp=dp, dtype="float64", steps=3, **saved)
    path, loss, biases = _saved(workers, saved_cfg, tmp_path)
    weights = read_weights(path)
    inputs = ("experts_gate", "experts_up") if model.arch == "llama" else ("experts_fc",)
    assert all(weights[f"blocks.2.mlp.{n}"].shape[0] == model.n_experts for n in (*inputs, "experts_proj"))
    restored_loss, restored_biases = _restored(workers, saved_cfg, path,
                                               moe_config(1, model, dp=dp, dtype="float64", steps=3, **restored))
    assert restored_loss == pytest.approx(loss, rel=1e-5)
    assert set(biases) == set(restored_biases) and all(torch.equal(biases[n], restored_biases[n]) for n in biases)
    assert any(b.abs().sum() > 0 for b in biases.values())
