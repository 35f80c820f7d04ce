"""ZeRO 1-3 over flat per-stage buffers (pipegpt.data_parallel) against the same model in one process: the loss
and every gradient after one step and every parameter after 3 AdamW steps, by one-process name
(test_pipeline_oracle's comparison and workers, reused; gradients, parameters and moments gathered from the
shards by one-process name). Both --unshard policies give the same parameters; a rank holds half of what it
holds at zero 0 (counted from the storages); a ZeRO-3 checkpoint resumes in another layout and back.

Default: a representative case per claim; `pytest -m slow` runs the matrix (every schedule at each zero level,
dp 4, tensor and sequence parallelism, Llama's grid).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipegpt.costs.memory import state_bytes
from pipegpt.dims import Sharding
from pipegpt.schedule import SCHEDULES
from pipegpt.state import checkpoint
from pipegpt.train.driver import check

from test_llama_oracle import MODELS, assert_llama_matches
from test_pipeline_oracle import assert_matches, base_config, valid_microbatches, workers  # noqa: F401 (fixture)


def zero_config(p: int, zero: int, dp: int = 2, **changes):
    return base_config(p, dp=dp, zero=zero, **{"microbatches": 2 * p, **changes})


# Default: ZeRO-1 on 1F1B, ZeRO-2 with a split backward, ZeRO-3 on a V whose rank 0 holds both ends of the tied
# embedding (one tensor, two stages: gathered while either computes), gathered per run of actions, recomputed.
@pytest.mark.parametrize("zero,schedule,extra", [
    (1, "1f1b", {}), (2, "zb-h1", {}), (3, "zbv", {"unshard": "microbatch", "recompute": "full"})])
def test_zero_matches_one_process(workers, zero, schedule, extra):
    cfg = zero_config(2, zero, schedule=schedule, **extra)
    check(cfg)
    assert_matches(cfg, workers(cfg))


def test_both_unshard_policies_give_the_same_parameters(workers):
    step = zero_config(2, 3, schedule="interleaved-1f1b", microbatches=4, virtual_stages=2, unshard="step")
    micro = step.replace(unshard="microbatch")
    host = workers(step)
    (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = host.run(step, 3), host.run(micro, 3)
    assert loss_a == loss_b
    for (name, a), (_, b) in zip(params_a + grads_a, params_b + grads_b):
        assert torch.equal(a, b), name  # the same values gathered: the same arithmetic, bit for bit


def test_fsdp_per_block_with_prefetch_matches_one_process(workers):
    """pp 1, a stage per block (interleaved, v = layers), one microbatch, zero 3 over dp 2: FSDP per block. The
    microbatch policy prefetches each gather one stage ahead (two stages gathered, two stages' full gradients at
    most: tests/unit/test_data_parallel.py counts them). Without the prefetch (step: each stage gathered once)
    the same parameters, bit for bit: test_both_unshard_policies_give_the_same_parameters."""
    model = dataclasses.replace(base_config(1).model, n_layer=4)
    cfg = zero_config(1, 3, model=model, schedule="interleaved-1f1b", virtual_stages=4, microbatches=1,
                      unshard="microbatch")
    check(cfg)
    assert_matches(cfg, workers(cfg))


def test_a_hand_written_schedule_file_with_gathers_trains_like_one_process(workers, tmp_path):
    path = tmp_path / "gathers.txt"  # rank 0 frees its parameters between its forwards and its backwards
    path.write_text("0UNSHARD 0F0 0F1 0F2 0F3 0RESHARD 0UNSHARD 0B0 0B1 0B2 0B3 0RESHARD\n"
                    "1UNSHARD 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3 1RESHARD\n")
    cfg = zero_config(2, 3, schedule_file=str(path), microbatches=4)
    check(cfg)
    assert_matches(cfg, workers(cfg))


def test_a_zero3_rank_holds_half_of_what_it_holds_at_zero0(workers):
    """dp 2 x pp 2 after a step: parameters, gradients and Adam moments per rank, from their storages, beside the
    planner's count of what stays between steps (pipegpt.costs.memory.state_bytes)."""
    cfg = zero_config(2, 0)
    host = workers(cfg)
    described = {zero: host.described(cfg.replace(zero=zero), 1) for zero in (0, 1, 2, 3)}
    held = {zero: [d["held_bytes"] for d in ds] for zero, ds in described.items()}
    assert [d["parameters"] for d in described[3]] == [d["parameters"] for d in described[0]]  # counted, not held
    expect = {1: {"parameters": 1, "gradients": 1, "optimizer": 0.5},  # gradients: the full buffer, reduced in place
              2: {"parameters": 1, "gradients": 0.5, "optimizer": 0.5},
              3: {"parameters": 0.5, "gradients": 0.5, "optimizer": 0.5}}
    for rank, whole in enumerate(held[0]):
        for zero, shares in expect.items():
            for part, share in shares.items():
                got = held[zero][rank][part] / whole[part]
                assert share <= got < share + 0.01, (zero, rank, part, got)  # a bucket's padding: a few bytes
    for zero in (0, 1, 2, 3):
        for rank in range(2):  # replica 0's pipeline ranks; stage r on rank r
            p = held[zero][rank]
            x = state_bytes(cfg.model, [(4, rank == 0, rank == 1)], sharding=Sharding(dp=2, pp=2, zero=zero),
                            between_steps=True)
            for part, want in (("parameters", x.weights), ("gradients", x.gradients), ("optimizer", x.optimizer)):
                assert want <= p[part] <= want * 1.01, (zero, rank, part, p[part], want)


def test_llama_zero3_matches_one_process(workers):
    cfg = zero_config(2, 3, model=MODELS["qkv-bias-tied"], schedule="1f1b")  # tied: copies on two ranks
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))


def test_bf16_zero3_equals_zero0(workers):
    """Under bf16 autocast the one-process model sums in another precision; ZeRO must change nothing of a dp run:
    its parameters after 3 steps equal zero 0's (norm sums in another order: within 1e-6)."""
    plain = zero_config(2, 0, precision="bf16")
    host = workers(plain)
    _, _, want = host.run(plain, 3)
    _, _, got = host.run(plain.replace(zero=3), 3)
    for (name, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")


# zero 0 at dp 1 -> zero 3 at dp 2 is slow (6 s): the default set reshards out of zero 3, and into ZeRO sharding in
# tests/distributed/test_checkpoint.py (dp2-zero1).
@pytest.mark.parametrize("direction", ["out-of-zero3", pytest.param("into-zero3", marks=pytest.mark.slow)])
def test_a_zero3_checkpoint_resumes_in_one_replica_and_back(workers, tmp_path, direction):
    """Saved by zero 3 at dp 2 x pp 2 (each rank its pieces), resumed at dp 1 (zero 0) (the same global batch:
    twice the microbatches): every parameter and moment as saved, and the next step's loss within 1e-5; and the
    other way round."""
    three = zero_config(2, 3, microbatches=2)
    one = zero_config(2, 0, dp=1, microbatches=4)  # zero 1 at dp 1 is refused
    saver, loader = (three, one) if direction == "out-of-zero3" else (one, three)
    path, next_loss = workers(saver).save(saver, tmp_path / f"zero{saver.parallel.zero}", 2)
    params, moments, loss = workers(loader).resume(loader, path)
    reader = checkpoint.CheckpointReader(path)
    assert {k for k in moments} == {k for k in reader.where if k.split("/")[0] in ("exp_avg", "exp_avg_sq")}
    for key, value in {**params, **moments}.items():
        assert torch.equal(value, reader.full(key, key.split("/", 1)[1])), key
    assert loss == pytest.approx(next_loss, rel=1e-5)


def test_tensor_and_sequence_parallel_zero3_matches_one_process(workers):
    """dp 2 x tp 2: the tp peers' shards line up, so sequence parallelism's sums act on them (fp32 for step 0;
    float64 for 3 steps, where tp's reordered sums cannot hide an error: test_pipeline_oracle.test_grid_matches)."""
    cfg = zero_config(1, 3, tp=2, sequence_parallel=True, microbatches=2)
    check(cfg)
    assert_matches(cfg, workers(cfg), steps=1)
    assert_matches(cfg.replace(dtype="float64"), workers(cfg), steps=3)


# The matrix, on demand: pytest -m slow
MATRIX = [(z, s, m) for z in (1, 2, 3) for s in SCHEDULES for m in valid_microbatches(s, 2)[-1:]]


@pytest.mark.slow
@pytest.mark.parametrize("zero,schedule,m", MATRIX, ids=[f"zero{z}-{s}-m{m}" for z, s, m in MATRIX])
def test_zero_matrix(workers, zero, schedule, m):
    """fp32 for step 0, float64 for 3 steps: a replica sums its microbatches apart from the other's, and at an odd
    count Adam amplifies that reordering past fp32 tolerance with or without ZeRO (measured at zero 0 too)."""
    cfg = zero_config(2, zero, schedule=schedule, microbatches=m)
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_dp4_matches_one_process(workers, zero):
    cfg = zero_config(1, zero, dp=4, microbatches=2)
    check(cfg)
    assert_matches(cfg, workers(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("zero,unshard,recompute", [(1, None, "selective"), (2, None, "full"),
                                                    (3, "step", "selective"), (3, "microbatch", "full")])
def test_zero_recompute_matches_one_process(workers, zero, unshard, recompute):
    cfg = zero_config(2, zero, schedule="zb-h1", unshard=unshard, recompute=recompute)
    check(cfg)
    assert_matches(cfg, workers(cfg))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_tensor_and_sequence_parallel_zero_matches_one_process(workers, zero):
    cfg = zero_config(1, zero, tp=2, sequence_parallel=True, microbatches=2)
    check(cfg)
    assert_matches(cfg, workers(cfg), steps=1)
    assert_matches(cfg.replace(dtype="float64"), workers(cfg), steps=3)


LLAMA = [(z, s, model) for z in (1, 2, 3) for s, model in (("zb-h1", "mqa"), ("zbv", "gqa"), ("1f1b", "gqa"))]


@pytest.mark.slow
@pytest.mark.parametrize("zero,schedule,model", LLAMA, ids=[f"zero{z}-{s}-{m}" for z, s, m in LLAMA])
def test_llama_zero_matrix(workers, zero, schedule, model):
    cfg = zero_config(2, zero, model=MODELS[model], schedule=schedule, unshard="microbatch" if zero == 3 else None)
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))


@pytest.mark.slow
def test_llama_tensor_parallel_zero3_matches_one_process(workers):
    cfg = zero_config(1, 3, model=MODELS["mqa"], tp=2, sequence_parallel=True, microbatches=2)  # a shared kv head
    check(cfg)
    assert_llama_matches(cfg, workers(cfg))
