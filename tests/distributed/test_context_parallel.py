"""Context parallelism against the one-process model: each cp rank holds two chunks of every sequence, attention
sees the others' keys and values (ring or all-gather), and the loss and every named gradient equal the whole model's
on the whole sequences (tests/distributed/test_pipeline_oracle.py's comparison and workers, reused).

Default: cp 2 with GPT-2 (ring) and a GQA Llama across two stages (all-gather, zbv); the rest of the grid is slow.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.config import ModelConfig
from pipegpt.train.driver import check

from test_llama_oracle import MODELS, assert_llama_matches as assert_matches_reordered
from test_pipeline_oracle import MODEL, base_config, workers  # noqa: F401 (fixture)

# cp sums attention's blocks and averages gradients over cp ranks in another order than one process: step 0's loss
# and gradients are compared in fp32, the parameters after 3 AdamW steps in float64 (Adam amplifies fp32 rounding
# past fp32 tolerance: 1.5e-5 relative measured, as for tensor parallelism), where a real error cannot hide.


def cp_config(p: int, cp: int, model: ModelConfig = MODEL, **changes):
    return base_config(p, cp=cp, model=model, **changes)


@pytest.mark.parametrize("comm", ["ring", pytest.param("allgather", marks=pytest.mark.slow)])
def test_gpt2_cp2_matches_one_process(workers, comm):
    cfg = cp_config(2, 2, cp_comm=comm, microbatches=4)  # the grid of the other default cases: one start
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))


def test_zero3_shards_over_cp_alone_and_matches_one_process(workers):
    """dp 1 x cp 2: the cp ranks hold the same weights, so ZeRO-3 shards them over cp (dp_cp group)."""
    cfg = cp_config(2, 2, microbatches=4, zero=3, unshard="microbatch", schedule="zb-h1")
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))


@pytest.mark.parametrize("schedule,comm,model", [("zbv", "allgather", "gqa"),
                                                 pytest.param("1f1b", "ring", "mqa", marks=pytest.mark.slow),
                                                 pytest.param("auto", "ring", "gqa", marks=pytest.mark.slow),
                                                 pytest.param("zb-h1", "ring", "qkv-bias-tied", marks=pytest.mark.slow)])
def test_llama_cp2_pp2_matches_one_process(workers, schedule, comm, model):
    cfg = cp_config(2, 2, MODELS[model], schedule=schedule, cp_comm=comm, microbatches=4)
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))


# The rest of the grid: cp 4, with dp and ZeRO-1, with tp and sequence parallelism, recomputation, bf16.
GRID = [(4, 1, 1, 1, "ring", {}), (4, 1, 1, 1, "allgather", {}),
        (2, 2, 1, 1, "ring", {"zero": 1}), (2, 1, 2, 1, "ring", {"sequence_parallel": True}),
        (2, 1, 2, 1, "allgather", {}), (2, 2, 1, 1, "allgather", {"recompute": "selective"}),
        (2, 1, 1, 2, "ring", {"recompute": "full", "schedule": "zb-h1"}),
        (2, 2, 1, 1, "allgather", {"zero": 2}), (2, 2, 1, 1, "ring", {"zero": 3, "unshard": "step"})]


@pytest.mark.slow
@pytest.mark.parametrize("cp,dp,tp,p,comm,extra", GRID, ids=[
    f"cp{c}-dp{d}-tp{t}-pp{p}-{comm}-{'-'.join(f'{k}={v}' for k, v in e.items())}" for c, d, t, p, comm, e in GRID])
@pytest.mark.parametrize("model", ["gpt2", "gqa"])
def test_cp_grid_matches_one_process(workers, cp, dp, tp, p, comm, extra, model):
    m = MODEL if model == "gpt2" else MODELS[model]
    if cp * dp * tp * p > 4:
        pytest.skip("more than 4 ranks")
    cfg = cp_config(p, cp, m, dp=dp, tp=tp, cp_comm=comm, microbatches=2 * p, **extra)
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory):
    """Short documents packed into shards by pipegpt prepare (each opened by the end-of-text token, id 0) with a
    small tokenizer.json: several documents fall in every 16-token window."""
    pytest.importorskip("tokenizers")
    from helpers import make_tokenizer_json
    from pipegpt.data.prepare import prepare

    root = tmp_path_factory.mktemp("packed")
    tokenizer = make_tokenizer_json(root / "tokenizer.json")
    words = "the pipeline sends activations forward and gradients back".split()  # the tokenizer's own words
    files = []
    for i in range(300):
        path = root / f"doc{i:03d}.txt"
        path.write_text(" ".join(words[(i * 7 + j) % len(words)] for j in range(1 + i % 2)))
        files.append(str(path))
    prepare(files, str(root / "data"), tokenizer=tokenizer, val_fraction=0.1)
    return str(root / "data"), tokenizer


def document_reference(cfg):
    """Step 0's loss and clipped gradients of the one-process model on the whole batch, documents masked."""
    from helpers import one_thread
    from pipegpt.data.loader import BatchSampler, document_starts
    from pipegpt.data.tokenizers import get_tokenizer
    from pipegpt.data.tokens import open_tokens
    from pipegpt.model.gpt import Documents, build_reference_model

    with one_thread():
        model = build_reference_model(cfg.model, cfg.runtime.seed)
        x, y = BatchSampler(open_tokens(cfg.data.data, "train"), cfg.batch_size, cfg.model.seq_len,
                            cfg.runtime.seed).batch(0)
        starts = document_starts(x, get_tokenizer(cfg.data.tokenizer).eot_token)
        assert min(len(set(row.tolist())) for row in starts) >= 3, "each window must hold several documents"
        unmasked = model(x, y).item()
        loss = model(x, y, documents=Documents(starts, cfg.data.position_reset))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        return loss.item(), unmasked, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("p,cp,reset,model", [(2, 2, True, "gpt2"),
                                              pytest.param(2, 2, False, "gqa", marks=pytest.mark.slow),
                                              pytest.param(1, 4, True, "gqa", marks=pytest.mark.slow),
                                              pytest.param(2, 1, False, "gpt2", marks=pytest.mark.slow)])
def test_document_mask_matches_one_process(workers, packed_data, p, cp, reset, model):
    data, tokenizer = packed_data
    from pipegpt.data.tokenizers import get_tokenizer

    vocab = get_tokenizer(tokenizer).vocab_size
    m = dataclasses.replace(MODEL if model == "gpt2" else MODELS[model], vocab_size=vocab)
    cfg = cp_config(p, cp, m, data=data, tokenizer=tokenizer, document_mask=True, position_reset=reset,
                    microbatches=2 * p)
    check(cfg)
    ref_loss, unmasked, ref_grads = document_reference(cfg)
    assert abs(ref_loss - unmasked) > 1e-4  # the mask matters on this data
    loss, grads, _ = workers(cfg).run(cfg, 1)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, grad in grads:
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=lambda msg: f"{name}: {msg}")


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["ring", "allgather"])
def test_bf16_cp2_is_the_one_process_model_under_autocast(workers, comm):
    """Under --precision bf16 the ring merges its blocks in fp32: loss and gradients within bf16's rounding of the
    one-process model under the same autocast (2^-8 relative per value; normwise bounds)."""
    from helpers import one_thread
    from pipegpt.data.loader import BatchSampler
    from pipegpt.data.tokenizers import get_tokenizer
    from pipegpt.data.tokens import builtin_tokens
    from pipegpt.model.gpt import build_reference_model

    cfg = cp_config(2, 2, MODELS["gqa"], cp_comm=comm, microbatches=4, precision="bf16")
    check(cfg)
    with one_thread():
        model = build_reference_model(cfg.model, cfg.runtime.seed)
        x, y = BatchSampler(builtin_tokens(get_tokenizer("bytes")), cfg.batch_size, cfg.model.seq_len,
                            cfg.runtime.seed).batch(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    got_loss, grads, _ = workers(cfg).run(cfg, 1)
    assert got_loss == pytest.approx(loss.item(), rel=1e-2)
    for name, grad in grads:
        ref = dict(model.named_parameters())[name].grad
        assert float((grad - ref).norm() / ref.norm()) < 3e-2, name


@pytest.mark.slow
@pytest.mark.parametrize("schedule,comm,groups", [("zbv", "ring", "auto"), ("1f1b", "allgather", "auto"),
                                                  ("zbv", "ring", "pairs")])
def test_cp2_pp2_under_order_matching_matches_one_process(workers, schedule, comm, groups):
    """The CUDA control path (NCCL's matching by order) with the cp ring's own point-to-point beside the pipeline's;
    and on the CUDA path's pair groups (a communicator per direction of each pair of pipeline neighbours)."""
    cfg = cp_config(2, 2, MODELS["gqa"], schedule=schedule, cp_comm=comm, microbatches=4, p2p_matching="order",
                    p2p_groups=groups)
    check(cfg)
    assert_matches_reordered(cfg, workers(cfg))
