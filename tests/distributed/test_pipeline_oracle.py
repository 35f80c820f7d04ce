"""The oracle: a pipelined run equals the same model in one process.

Loss and every named parameter's gradient after one step, and every parameter
after 3 AdamW steps (with gradient clipping), for every schedule, on CPU with
gloo across real worker processes. Workers start once per grid and point-to-point
behaviour and are rebuilt per case over RPC, which keeps the matrix cheap.

Every case runs under both point-to-point behaviours (pipegpt.comm.p2p): "tag", gloo's own,
and "order", the CUDA control path (NCCL's matching by order, sends in the plan's places, a
settle at the end of the step) run on CPU. The default suite runs "order" on a few
representative cases; `pytest -m slow` runs the whole suite under it.
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
from pipegpt.schedule import SCHEDULES, ScheduleError, build_plan
from pipegpt.schedule.schedule_file import load_schedule_file
from pipegpt.train.driver import check
from pipegpt.train.optim import lr_at, make_optimizer, set_lr

from cluster_host import ClusterHost
from helpers import one_thread

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=8, n_head=4, n_embd=32)
RTOL, ATOL = 1e-5, 1e-7
NOISE = 1e-7  # |grad| below this is fp32 rounding noise here (real gradients are ~1e-4 and up)


def base_config(p: int, **changes) -> TrainConfig:
    cfg = TrainConfig.build(MODEL, stages=p, microbatches=p, microbatch_size=2, device="cpu", seed=7,
                            lr=1e-3, timeout_s=60)  # the CLI default; 1e-2 (half the init scale per step) drowns fp32 in Adam noise
    return cfg.replace(**changes)


def reference(cfg: TrainConfig, steps: int):
    """The same model in one process: step-0 loss and (clipped) grads on the whole batch, and the
    parameters after `steps` AdamW steps that accumulate gradients over the same microbatches.

    Why two forms: both are correct, but AdamW's normalisation turns the rounding difference
    between one-batch and accumulated gradients into up to 2e-4 relative parameter differences
    after 3 steps (measured), far above fp32 tolerance. Accumulating like the pipeline makes the
    multi-step comparison a test of the pipeline, not of summation order.
    """
    with one_thread():  # as the workers: the thread count changes reduction order, and AdamW
        return _reference(cfg, steps)  # amplifies that rounding to ~1e-4 after 3 steps (measured)


def _reference(cfg: TrainConfig, steps: int):
    model = build_reference_model(cfg.model, cfg.runtime.seed).to(getattr(torch, cfg.runtime.dtype))
    named = list(model.named_parameters())
    optimizer = make_optimizer(named, cfg.optim)
    sampler = BatchSampler(builtin_tokens(get_tokenizer(cfg.data.tokenizer)), cfg.batch_size, cfg.model.seq_len,
                           cfg.runtime.seed)
    grad_clip = cfg.optim.grad_clip
    x, y = sampler.batch(0)
    loss0 = model(x, y)
    loss0.backward()
    if grad_clip > 0:  # workers report gradients as the optimizer saw them: clipped
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grads0 = {n: p.grad.clone() for n, p in named}
    signal = {n: torch.zeros_like(p) for n, p in named}  # largest |grad| each element ever saw
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x, y = sampler.batch(step)
        mbs = cfg.parallel.microbatch_size
        chunks = list(zip(x.split(mbs), y.split(mbs)))  # dp x m of them
        for xm, ym in chunks:
            (model(xm, ym) / len(chunks)).backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for n, p in named:
            signal[n] = torch.maximum(signal[n], p.grad.abs())
        set_lr(optimizer, lr_at(step, cfg.optim, cfg.runtime.steps))  # the schedule the workers follow
        optimizer.step()
    return loss0.item(), grads0, {n: p.detach().clone() for n, p in named}, signal


def assert_matches(cfg: TrainConfig, cluster, steps: int = 3) -> None:
    ref_loss, ref_grads, ref_params, signal = reference(cfg, steps)
    loss, grads, params = cluster.run(cfg, steps)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    assert {n for n, _ in grads} == set(ref_grads), "every parameter must get a gradient somewhere"
    for name, grad in grads:
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"grad {name}: {m}")
    assert {n for n, _ in params} == set(ref_params)
    for name, value in params:
        # Adam divides by sqrt(v), so an element whose gradient is only rounding noise moves by up to
        # a whole step, differently in any two runs. The key biases are such elements: softmax
        # ignores a shift shared by all scores, so their true gradient is exactly 0. Compare the
        # elements whose gradient carried signal (the rest must still have moved by <= lr per step).
        # Small gradients carry large relative rounding errors for the same reason, so elements get
        # an absolute bound (a fraction of one step) and the tensor a relative one, norm-wise.
        rtol, step_fraction = (RTOL, 1e-3) if cfg.runtime.dtype == "float32" else (1e-9, 1e-6)
        ref, real = ref_params[name], signal[name] > NOISE
        assert float((value[real] - ref[real]).norm() / ref[real].norm()) <= rtol, f"param {name}"
        torch.testing.assert_close(value[real], ref[real], rtol=RTOL, atol=cfg.optim.lr * step_fraction,
                                   msg=lambda m: f"param {name}: {m}")
        assert float((value - ref).abs().max()) <= 2 * cfg.optim.lr * steps, f"param {name} moved too far"


@pytest.fixture(scope="module")
def workers():
    hosts = {}

    def get(cfg: TrainConfig) -> ClusterHost:
        """Workers for cfg's grid (fixed when they start; build() brings the rest, the p2p behaviour too)."""
        par = cfg.parallel
        key = (par.dp, par.stages, par.cp, par.tp, par.ep)
        # One grid's workers alive at a time keeps memory flat; tests of a grid run together.
        if key not in hosts:
            for host in hosts.values():
                host.close()
            hosts.clear()
            hosts[key] = ClusterHost(cfg if par.ep > 1 else base_config(par.stages, dp=par.dp, cp=par.cp, tp=par.tp))
        return hosts[key]

    yield get
    for host in hosts.values():
        host.close()


# Module-scoped, so pytest runs every test under "tag" first, then every one under "order".
@pytest.fixture(scope="module", params=["tag", pytest.param("order", marks=pytest.mark.slow)])
def matching(request) -> str:
    return request.param


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_a_rebuild_takes_the_new_point_to_point_behaviour(workers):
    host = workers(base_config(2))
    for matching in ("order", "tag"):
        assert [d["p2p_matching"] for d in host.build(base_config(2, p2p_matching=matching))] == [matching] * 2


def valid_microbatches(schedule: str, p: int) -> list[int]:
    """m = 1, m = p and an odd m > p, where the schedule accepts them."""
    ms = []
    for m in (1, p, p + 1 if p % 2 == 0 else p + 2, 2 * p):
        try:
            build_plan(schedule, p, m)
        except ScheduleError:
            continue
        if m not in ms:
            ms.append(m)
    return ms[:3]


# The default matrix (CI): every fixed schedule at every accepted microbatch count on 2 ranks; the synthesized
# ones (auto, auto-v: written for the estimated costs) at an odd count, and on 4 ranks, with tp and dp below.
CASES = [(s, 2, m) for s in SCHEDULES if not SCHEDULES[s].synthesized and not SCHEDULES[s].for_overlap
         for m in valid_microbatches(s, 2)] + \
    [("auto", 2, 3), ("auto-v", 2, 3), pytest.param("auto-v", 4, 5, marks=pytest.mark.slow),
     pytest.param("auto", 4, 6, marks=pytest.mark.slow)]


@pytest.mark.parametrize("schedule,p,m", CASES, ids=[f"{s}-p{p}-m{m}" for s, p, m in
                                                     (c.values if hasattr(c, "values") else c for c in CASES)])
def test_schedule_matches_one_process(workers, matching, schedule, p, m):
    cfg = base_config(p, schedule=schedule, microbatches=m, p2p_matching=matching)
    check(cfg)
    assert_matches(cfg, workers(cfg))


# The CUDA control path in the default suite: the default schedule, and a V whose rank holds both ends
# (local hand-over, split backward, messages both ways in one batch).
@pytest.mark.parametrize("schedule,m", [("1f1b", 3), ("zbv", 4)])
def test_order_matching_matches_one_process(workers, schedule, m):
    cfg = base_config(2, schedule=schedule, microbatches=m, p2p_matching="order")
    check(cfg)
    assert_matches(cfg, workers(cfg))


# The CUDA path's groups on gloo: each direction of each pair of pipeline neighbours on a group of its own
# (comm/mesh.py pair_groups), where a peer's rank is not its global one: the second pipeline of dp 2, and
# interleaved's hand-over from the last rank to the first.
@pytest.mark.parametrize("p,dp,schedule", [(2, 2, "zb-h1"), (4, 1, "interleaved-1f1b")])
def test_order_matching_on_pair_groups_matches_one_process(workers, p, dp, schedule):
    cfg = base_config(p, dp=dp, schedule=schedule, microbatches=4, p2p_matching="order", p2p_groups="pairs")
    check(cfg)
    host = workers(cfg)
    assert {d["p2p_groups"] for d in host.build(cfg)} == {"pairs"}
    assert_matches(cfg, host)


# The same on every schedule at 4 stages (the interleaved ones use the wrap-around pair) and on a dp x pp x tp grid
# with sequence parallelism: the slow set's pass over the CUDA path's groups.
PAIRED = [(s, 4, 8) for s in SCHEDULES if not SCHEDULES[s].synthesized and not SCHEDULES[s].for_overlap] + \
    [("auto", 4, 6), ("auto-v", 4, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,m", PAIRED, ids=[f"{s}-p{p}-m{m}" for s, p, m in PAIRED])
def test_every_schedule_on_pair_groups_matches_one_process(workers, schedule, p, m):
    cfg = base_config(p, schedule=schedule, microbatches=m, p2p_matching="order", p2p_groups="pairs")
    check(cfg)
    assert_matches(cfg, workers(cfg))


@pytest.mark.slow
def test_a_grid_on_pair_groups_matches_one_process(workers):
    cfg = base_config(2, dp=2, tp=2, schedule="zb-h1", microbatches=4, sequence_parallel=True, p2p_matching="order",
                      p2p_groups="pairs")
    check(cfg)
    assert_matches(cfg, workers(cfg), steps=1)
    assert_matches(cfg.replace(dtype="float64"), workers(cfg), steps=3)


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_recompute_matches(workers, matching, schedule, recompute):
    cfg = base_config(2, schedule=schedule, microbatches=3, recompute=recompute, p2p_matching=matching)
    assert_matches(cfg, workers(cfg))


def test_untied_embeddings_and_uneven_split(workers, matching):
    model = dataclasses.replace(MODEL, tie_embeddings=False)
    cfg = base_config(2, model=model, microbatches=3, layers_per_stage=(5, 3), p2p_matching=matching)
    assert_matches(cfg, workers(cfg))


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_four_stages_interleaved_uneven(workers, matching):
    cfg = base_config(4, schedule="interleaved-1f1b", microbatches=4, layers_per_stage=(0, 1, 1, 2, 1, 1, 1, 1),
                      p2p_matching=matching)
    assert_matches(cfg, workers(cfg))


# 1f1b on four stages is in the slow matrix; zbv and the interleaved test above keep four stages in the default run.
@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.slow), "zbv"])
def test_four_stages(workers, matching, schedule):
    cfg = base_config(4, schedule=schedule, microbatches=8, p2p_matching=matching)
    assert_matches(cfg, workers(cfg))


@pytest.mark.parametrize("dp,p,schedule,zero,clip", [(2, 2, "1f1b", 0, 1.0), pytest.param(2, 2, "1f1b", 0, 0.0, marks=pytest.mark.slow),
                                                      (2, 2, "zb-h1", 1, 1.0), (2, 2, "zbv", 0, 1.0),
                                                      pytest.param(2, 1, "1f1b", 0, 1.0, marks=pytest.mark.slow)])
def test_data_parallel_matches(workers, matching, dp, p, schedule, zero, clip):
    cfg = base_config(p, dp=dp, schedule=schedule, microbatches=2 * p, zero=zero, grad_clip=clip,
                      p2p_matching=matching)
    check(cfg)
    assert_matches(cfg, workers(cfg))


# Written by hand, unlike any generator: one rank mixes whole backwards (B) with split ones (I, W).
HAND_WRITTEN = """# name: hand-mixed
0F0 0F1 0F2 0B0 0I1 0W1 0B2
1F0 1I0 1F1 1B1 1W0 1F2 1B2
"""


def test_a_hand_written_schedule_file_trains_like_one_process(workers, matching, tmp_path):
    path = tmp_path / "hand.txt"
    path.write_text(HAND_WRITTEN)
    plan = load_schedule_file(path)
    for name in SCHEDULES:
        try:
            generated = build_plan(name, 2, 3)
        except ScheduleError:
            continue
        assert generated.ranks != plan.ranks, f"the hand-written plan is {name}'s"
    cfg = base_config(2, schedule_file=str(path), microbatches=3, p2p_matching=matching)
    assert_matches(cfg, workers(cfg))


# Composite actions (a forward and a backward of two microbatches run as one, by pieces in turns): rank 1's steady
# state in pairs; then with split backwards under ZeRO-2, whose buffers a pair's backward part must find ready.
PAIRED = "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3\n1F0 (1F1;1B0) (1F2;1B1) (1F3;1B2) 1B3\n"
PAIRED_SPLIT = "0F0 0F1 0I0 0F2 0I1 0W0 0F3 0I2 0W1 0I3 0W2 0W3\n1F0 (1F1;1I0) (1F2;1W0) 1I1 (1F3;1W1) 1I2 1I3 1W2 1W3\n"


@pytest.mark.parametrize("text,dp,zero", [(PAIRED, 1, 0), pytest.param(PAIRED_SPLIT, 2, 2, marks=pytest.mark.slow)])
def test_composite_actions_train_like_one_process(workers, matching, tmp_path, text, dp, zero):
    path = tmp_path / "paired.txt"
    path.write_text(text)
    assert "(1F1;1" in load_schedule_file(path).to_text()
    cfg = base_config(2, schedule_file=str(path), microbatches=4, dp=dp, zero=zero, p2p_matching=matching)
    check(cfg)
    assert_matches(cfg, workers(cfg))


# Schedules with pairs (dualpipev's main phase; combined 1F1B's steady state), under recomputation and both
# matchings: the default suite runs one (rank 1 of 1f1b-overlap at m 3 pairs (1F1;1B0) and (1F2;1B1), recomputing
# every block, under the CUDA control path); dualpipev (tag) is in CASES, the rest here and in FULL are slow.
OVERLAPPED = [("1f1b-overlap", 2, 3, "full", "order"),
              pytest.param("1f1b-overlap", 2, 5, "selective", "tag", marks=pytest.mark.slow),
              pytest.param("dualpipev", 2, 4, "selective", "order", marks=pytest.mark.slow),
              pytest.param("dualpipev", 2, 5, "full", "order", marks=pytest.mark.slow),
              pytest.param("1f1b-overlap", 4, 9, "none", "order", marks=pytest.mark.slow)]


@pytest.mark.parametrize("schedule,p,m,recompute,p2p", OVERLAPPED)
def test_schedules_with_pairs_match_one_process(workers, schedule, p, m, recompute, p2p):
    cfg = base_config(p, schedule=schedule, microbatches=m, recompute=recompute, p2p_matching=p2p)
    check(cfg)
    assert_matches(cfg, workers(cfg))


# The full matrix, on demand: pytest -m slow
FULL = [(s, p, m, rc, tie) for s in SCHEDULES for p in (2, 4) for m in valid_microbatches(s, p)
        for rc in ("none", "full", "selective") for tie in (True, False)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,m,recompute,tie", FULL,
                         ids=[f"{s}-p{p}-m{m}-{rc}-{'tied' if t else 'untied'}" for s, p, m, rc, t in FULL])
def test_full_matrix(workers, matching, schedule, p, m, recompute, tie):
    model = dataclasses.replace(MODEL, tie_embeddings=tie)
    cfg = base_config(p, schedule=schedule, microbatches=m, recompute=recompute, model=model, p2p_matching=matching)
    assert_matches(cfg, workers(cfg))


# The dp x pp x tp grid. Tensor-parallel gradients are gathered to full shape (tensor_parallel.gather_full).
# Slow: tp alone (pp x tp covers it), dp x interleaved (dp is in test_data_parallel_matches) and dp x tp with
# sequence parallelism (test_zero's test_tensor_and_sequence_parallel_zero3_matches_one_process runs it, float64).
# pp x tp stays in the default run as zb-h1 with sequence parallelism; tp without it as test_tensor_parallel's cases
GRIDS = [pytest.param(1, 1, 2, "1f1b", False, marks=pytest.mark.slow),
         pytest.param(1, 2, 2, "1f1b", False, marks=pytest.mark.slow), (1, 2, 2, "zb-h1", True),
         pytest.param(2, 2, 1, "interleaved-1f1b", False, marks=pytest.mark.slow),
         pytest.param(2, 1, 2, "1f1b", True, marks=pytest.mark.slow),
         pytest.param(1, 2, 2, "auto-v", False, marks=pytest.mark.slow),
         pytest.param(2, 2, 1, "auto", False, marks=pytest.mark.slow)]


@pytest.mark.parametrize("dp,p,tp,schedule,sp", GRIDS, ids=[f"{d}x{p}x{t}-{s}{'-sp' if sp else ''}" for d, p, t, s, sp in
                                                             (g.values if hasattr(g, "values") else g for g in GRIDS)])
def test_grid_matches(workers, matching, dp, p, tp, schedule, sp):
    """Step 0's loss and gradients in fp32; the 3 AdamW steps in float64.

    Tensor parallelism sums each layer's partial products in another order (split K), and AdamW's
    normalisation amplifies that fp32 rounding in the parameters to 1e-5..4e-5 relative after 3
    steps (measured), the noise floor of any reordering. In float64 rounding vanishes, so the
    multi-step comparison is exact to 1e-9 and a real error (O(1e-3)) cannot hide in it.
    """
    cfg = base_config(p, dp=dp, tp=tp, schedule=schedule, microbatches=2 * p, sequence_parallel=sp,
                      p2p_matching=matching)
    check(cfg)
    assert_matches(cfg, workers(cfg), steps=1)
    assert_matches(cfg.replace(dtype="float64"), workers(cfg), steps=3)
