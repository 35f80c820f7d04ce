"""A run's plan lowered with a message latency where the run has one in the unit of its costs
(pipegpt.planner.run_plan.lowering_costs): a GPU run (NCCL matches by order) with measured costs, in seconds, gets
the intra-node latency; estimated or unit costs, and gloo, lower as for none. Simulated, not timed."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipegpt.config import ModelConfig, TrainConfig
from pipegpt.costs.devices import LATENCY_INTRA_S
from pipegpt.planner.run_plan import lowered, lowering_costs, make_plan
from pipegpt.schedule import build_plan, lower, validate
from pipegpt.schedule.simulate import simulate, simulate_order

MODEL = ModelConfig(vocab_size=64, seq_len=8, n_layer=4, n_head=2, n_embd=16)
# --balance cost's measured forward + backward of the embedding, a block, the head (seconds): a block's forward
# is 10 us, so the 5 us latency is half of one
LIGHT = (3e-6, 3e-5, 3e-5)


def measured(schedule: str, device: str, costs=LIGHT, **settings) -> TrainConfig:
    cfg = TrainConfig.build(MODEL, stages=4, microbatches=8, schedule=schedule, device=device, **settings)
    return cfg.replace(balance="cost", balanced_costs=costs, layers_per_stage=(1, 1, 1, 1))


def test_a_gpu_runs_measured_plan_is_placed_for_nccls_latency():
    """1F1B, 4 x 8 on GPUs: placed for the latency, order matching runs 605 us, 2 over tag matching's 603 (0.3%);
    placed as for none (what a run on gloo gets), 663 (+10%): sends waited behind computes their receivers
    did not need. validate() accepts it (make_plan validates; again here)."""
    gpu, cpu = measured("1f1b", "cuda"), measured("1f1b", "cpu")
    costs = lowering_costs(gpu, (0, 1, 2, 3))
    assert costs.comm == LATENCY_INTRA_S and lowering_costs(cpu, (0, 1, 2, 3)).comm == 0
    plan, untimed = make_plan(gpu), make_plan(cpu)
    assert plan != untimed and validate(plan) == plan
    assert plan == validate(lower(build_plan("1f1b", 4, 8), costs))
    tag = simulate(plan, costs).makespan
    assert tag == pytest.approx(603e-6)
    assert simulate_order(plan, costs).makespan == pytest.approx(605e-6)
    assert simulate_order(untimed, costs).makespan == pytest.approx(663e-6)


def test_where_placing_for_the_latency_is_later_the_placement_for_none_is_kept():
    """zb-h1 with a 20 us block forward: placed for the latency, order matching takes 1038 us, 2 more than tag's
    1036, which the placement for none reaches; the run keeps that one."""
    gpu = measured("zb-h1", "cuda", (3e-6, 6e-5, 6e-5))
    costs = lowering_costs(gpu, (0, 1, 2, 3))
    plan = build_plan("zb-h1", 4, 8)
    for_latency = validate(lower(plan, costs))
    assert simulate_order(for_latency, costs).makespan == pytest.approx(1038e-6)
    assert make_plan(gpu) == lowered(plan, costs) == lower(plan, replace(costs, comm=0))
    assert simulate_order(make_plan(gpu), costs).makespan == simulate(plan, costs).makespan == pytest.approx(1036e-6)


def test_costs_without_seconds_or_without_nccl_get_no_latency():
    assert lowering_costs(TrainConfig.build(MODEL, stages=4, microbatches=8, schedule="1f1b", device="cuda"),
                          (0, 1, 2, 3)) is None  # unit costs
    auto = TrainConfig.build(MODEL, stages=4, microbatches=8, schedule="auto", device="cuda")
    assert lowering_costs(auto, (0, 1, 2, 3)).comm == 0  # estimated from the shape: relative units
    forced = measured("1f1b", "cpu", p2p_matching="order")  # gloo in order: its latency is not known before a run
    assert lowering_costs(forced, (0, 1, 2, 3)).comm == 0
