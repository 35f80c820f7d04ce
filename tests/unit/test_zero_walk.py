"""The planner's walk of ZeRO's state over a run's plan (pipegpt.costs.memory.walked_zero_state, held_peak): worked
by hand for FSDP per block (one pipeline rank, a stage per block, interleaved v = 4, one microbatch) on a tiny
tied GPT at dp 2, where the tied embedding is a unit of its own (the measured side, to the byte:
tests/distributed/test_peak_tensor_bytes.py). Elements, 4 bytes each:

    T (the tied wte) 256 x 32 = 8192; stage 0's own: wpe 16 x 32 + a block = 13216; stages 1, 2: a block 12704;
    stage 3's own: a block + ln_f = 12768; P = 59584, S = P / 2

The plan: 0UNSHARD 1UNSHARD 0F0 0RESHARD 2UNSHARD 1F0 1RESHARD 3UNSHARD 2F0 3F0 3B0 3REDUCE_GRAD 3RESHARD
1UNSHARD 2B0 2REDUCE_GRAD 2RESHARD 0UNSHARD 1B0 1REDUCE_GRAD 1RESHARD 0B0 0REDUCE_GRAD 0RESHARD.
"""
from __future__ import annotations

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.costs.memory import plan_memory, state_bytes, walked_zero_state
from pipegpt.dims import Sharding
from pipegpt.planner.run_plan import make_plan
from pipegpt.schedule import build_plan, lower

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=2, n_embd=32)
T, OWN = 8192, [13216, 12704, 12704, 12768]
P = T + sum(OWN)
S = P // 2
STAGES = tuple((1, s == 0, s == 3) for s in range(4))


def run_plan(zero: int, unshard: str = "microbatch"):
    extra = {"unshard": unshard} if zero == 3 else {}
    return make_plan(TrainConfig.build(MODEL, dp=2, stages=1, zero=zero, schedule="interleaved-1f1b",
                                       virtual_stages=4, microbatches=1, microbatch_size=1, device="cpu", **extra))


def test_fsdp_per_block_walks_to_the_hand_counted_peaks():
    z3 = Sharding(dp=2, zero=3)
    # gathered: stage 0's run (its own, T) with stage 1's prefetch, larger than the head's (3, T, 2's prefetch);
    # full gradients: T from the head's backward on, stage 0's own and stage 1's (reduce-scatter in flight)
    weights, gradients = walked_zero_state(MODEL, run_plan(3), 0, STAGES, z3)
    assert (weights, gradients) == (4 * (S + T + OWN[0] + OWN[1]), 4 * (S + T + OWN[0] + OWN[1]))
    # the step policy gathers all; the gradients as above
    assert walked_zero_state(MODEL, run_plan(3, "step"), 0, STAGES, z3) == (4 * (S + P), gradients)
    # zero 2: the parameters whole
    assert walked_zero_state(MODEL, run_plan(2), 0, STAGES, Sharding(dp=2, zero=2)) == (4 * P, gradients)
    # plan_memory walks the run's plan; the policy's bound (the tied tensor and the two largest stages' own) is
    # above it, as on a plan without its collectives
    rank = plan_memory(MODEL, run_plan(3), [1] * 4, microbatch_size=1, sharding=z3, unshard="microbatch")[0]
    assert (rank.weights, rank.gradients) == (weights, gradients)
    bound = state_bytes(MODEL, list(STAGES), sharding=z3, unshard="microbatch", microbatches=1)
    assert (bound.weights, bound.gradients) == (4 * (S + T + OWN[0] + OWN[3]),) * 2
    bare = plan_memory(MODEL, lower(build_plan("interleaved-1f1b", 1, 1, 4)), [1] * 4, microbatch_size=1,
                       sharding=z3, unshard="microbatch")[0]
    assert (bare.weights, bare.gradients) == (bound.weights, bound.gradients)


def test_the_walk_applies_only_where_the_runtime_frees_and_gathers():
    assert walked_zero_state(MODEL, run_plan(1), 0, STAGES, Sharding(dp=2, zero=1)) is None  # flat through the step
    plain = lower(build_plan("interleaved-1f1b", 1, 1, 4))  # no REDUCE_GRAD, no UNSHARD
    assert walked_zero_state(MODEL, plain, 0, STAGES, Sharding(dp=2, zero=3)) is None
    assert walked_zero_state(MODEL, run_plan(3), 0, STAGES, Sharding(dp=1, zero=3)) is None
