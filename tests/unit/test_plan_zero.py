"""The planner with ZeRO 1-3: what a rank holds at a step's peak and between steps (the measured side:
tests/distributed/test_zero.py) under both unshard policies, what the gathers and reduce-scatters cost, `plan
--zero N` keeping only that level, and what it answers for Llama 3 8B on 8 H100s."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipegpt.config import MODEL_PRESETS, ModelConfig, TrainConfig
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import make_cluster
from pipegpt.costs.memory import parameter_count, plan_memory, state_bytes
from pipegpt.costs.stage_costs import StageCosts
from pipegpt.dims import Sharding
from pipegpt.planner.candidates import Layout, Request
from pipegpt.planner.search import evaluate_layout, search
from pipegpt.planner.structure import compute_groups
from pipegpt.schedule import build_plan
from pipegpt.schedule.lowering import add_unshard_reshard
from pipegpt.schedule.simulate import Costs, simulate

from helpers import invoke

MODEL = ModelConfig(vocab_size=1000, seq_len=128, n_layer=8, n_head=8, n_embd=256)


def test_state_by_zero_level_at_the_peak_and_between_steps():
    stages = [(4, True, False)]
    P = state_bytes(MODEL, stages).parameters
    S = -(-P // 4)
    for zero, peak, rest in [(0, (P, P, 2 * P), (P, P, 2 * P)),
                             (1, (P, P, 2 * S), (P, P, 2 * S)),  # reduced in place: no shard of its own
                             (2, (P, P + S, 2 * S), (P, S, 2 * S)),
                             (3, (S + P, P + S, 2 * S), (S, S, 2 * S))]:
        for between, want in ((False, peak), (True, rest)):
            x = state_bytes(MODEL, stages, sharding=Sharding(dp=4, zero=zero), between_steps=between)
            assert (x.weights, x.gradients, x.optimizer) == tuple(4 * n for n in want), (zero, between)


def test_plan_zero_keeps_only_that_level():
    cluster = make_cluster(4, 4, gpu_memory="2GiB", gpu_tflops=50, intra_node="50GB/s")
    for zero in (2, 3):
        best = search(Request(MODEL, 16, cluster, AnalyticalCosts(cluster), top=3, zero=zero)).best
        assert best and all(b.layout.zero == zero and b.layout.dp > 1 for b in best)
    plain = search(Request(MODEL, 16, cluster, AnalyticalCosts(cluster), top=5)).best
    # unasked, ZeRO-2 over several microbatches and ZeRO-3 under the step policy hold at the peak at least what
    # ZeRO-1 holds and take as long: a tie, which goes to the lower level
    assert all(b.layout.zero != 2 and (b.layout.zero != 3 or b.layout.unshard == "microbatch") for b in plain)
    for zero in (0, 1):
        best = search(Request(MODEL, 16, cluster, AnalyticalCosts(cluster), top=3, zero=zero)).best
        assert best and all(b.layout.zero == zero for b in best)


def test_plan_zero_on_the_command_line():
    result = invoke("plan", "--model", "gpt2", "--gpus", "8", "--device", "h100", "--batch-size", "64", "--zero",
                    "3", "--top", "2")
    assert result.exit_code == 0, result.output
    runs = [line for line in result.output.splitlines() if "pipegpt run" in line]
    assert runs and all("--zero 3" in line for line in runs)


def test_microbatch_policy_holds_the_two_largest_stages_and_one_microbatch_frees_gradients():
    model = replace(MODEL, tie_embeddings=False)  # a tied head on the embedding's rank would be counted once
    stages = [(1, True, False), (4, False, False), (1, False, False), (2, False, True)]
    per = [parameter_count(model, n, e, h) for n, e, h in stages]
    P, S = sum(per), -(-sum(per) // 4)
    two = sum(sorted(per)[-2:])
    assert two < P
    z3 = Sharding(dp=4, zero=3)
    for unshard, m, want in [("step", 4, (S + P, P + S)), ("microbatch", 4, (S + two, P + S)),
                             ("microbatch", 1, (S + two, S + two)), ("step", 1, (S + P, S + two))]:
        x = state_bytes(model, stages, sharding=z3, unshard=unshard, microbatches=m)
        assert (x.weights, x.gradients, x.optimizer) == (4 * want[0], 4 * want[1], 4 * 2 * S), (unshard, m)
    z2 = state_bytes(model, stages, sharding=Sharding(dp=4, zero=2), unshard="microbatch", microbatches=1)
    assert (z2.weights, z2.gradients) == (4 * P, 4 * (S + two))  # the policy is ZeRO-3's: weights stay whole
    between = state_bytes(model, stages, sharding=z3, unshard="microbatch", between_steps=True)
    assert (between.weights, between.gradients) == (4 * S, 4 * S)
    # plan_memory passes the policy and the plan's microbatches through
    plan = build_plan("interleaved-1f1b", 1, 1, 4)
    rank = plan_memory(model, plan, [n for n, _, _ in stages], microbatch_size=1, sharding=z3,
                       unshard="microbatch")[0]
    assert (rank.weights, rank.gradients) == (4 * (S + two), 4 * (S + two))


def test_gathers_hide_behind_the_previous_group_and_reduce_scatter_is_half_an_all_reduce():
    cluster = make_cluster(8, 8, device="h100")
    cs = StageCosts(cluster, AnalyticalCosts(cluster))
    sh = Sharding(dp=8)
    ar, rs = cs.dp_comm([1e9], sh)[0], cs.dp_comm([1e9], sh._replace(zero=2))[0]
    assert 0.45 < rs / ar < 0.55
    # one rank, three groups: stage 0's F, stage 1's F, stage 1's B; gathers 2 and 5 s against 3 and 1 s of compute
    groups = ((np.array([0, 1, 1]), np.array([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=float)),)
    F, B, W, TP, G = [3.0, 1.0], [6.0, 2.0], [0.0, 0.0], [0.0, 0.0], [2.0, 5.0]
    # the first in full (2), stage 1's behind stage 0's F (5 - 3), stage 1's again behind its F (5 - 1)
    assert cs.exposed_gathers(groups, F, B, W, TP, G) == 2 + 2 + 4
    # interleaved at pp 1: about a group per F and per B (a stage's F and B back to back share one): 2 x m x v
    stages, counts = compute_groups("interleaved-1f1b", 1, 4, 8)[0]
    assert counts.sum() == 2 * 4 * 8 and 2 * 3 * 8 < len(stages) <= 2 * 4 * 8
    assert all(a != b for a, b in zip(stages, stages[1:]))
    # after the step: ZeRO-3's microbatch policy has no all-gather after the update (its gathers are the groups')
    params, tensors = [1e9, 1e9], [10, 10]
    step = cs.after_time(MODEL, (0, 0), params, tensors, Sharding(dp=8, zero=3))
    micro = cs.after_time(MODEL, (0, 0), params, tensors, Sharding(dp=8, zero=3), unshard="microbatch")
    assert abs(step - micro - AnalyticalCosts(cluster).shard_collective_time(4 * 2e9, 8, True)) < 1e-12


def test_at_pp_1_the_gathers_shown_are_the_simulators_wait_for_the_microbatch_policys_unshards():
    """The search's charge (no plan walked) against the simulator running the prefetched UNSHARDs the runtime
    runs: equal at pp 1 (FSDP per block), where the rank is the step; above it the search charges a rank's whole
    wait, which the simulator may partly hide in the pipeline's bubbles."""
    for p, m, v in ((1, 4, 8), (1, 2, 4), (2, 4, 4)):
        plan = build_plan("interleaved-1f1b", p, m, v)
        S = p * v
        F = [1.0 + (3 * s % 5) / 2 for s in range(S)]
        B, W, TP = [2 * f for f in F], [0.0] * S, [0.1] * S
        G = [0.5 + (7 * s % 9) / 2 for s in range(S)]
        bare = simulate(plan, Costs(tuple(F), tuple(B), tuple(W), 0.0, None, tuple(TP))).makespan
        gathered = simulate(add_unshard_reshard(plan, "microbatch"),
                            Costs(tuple(F), tuple(B), tuple(W), 0.0, None, tuple(TP), gather_comm=tuple(G))).makespan
        shown = StageCosts.exposed_gathers(compute_groups("interleaved-1f1b", p, m, v), F, B, W, TP, G)
        if p == 1:
            assert abs(shown - (gathered - bare)) < 1e-9 and shown > G[0]
        else:
            assert shown >= gathered - bare > 0


def test_a_zero_3_microbatch_layout_becomes_its_run_flags():
    lay = Layout(8, 1, 1, "interleaved-1f1b", 8, 2, 1, "full", 3, False, unshard="microbatch")
    args = lay.run_args(MODEL, "fp32")
    assert args[args.index("--unshard") + 1] == "microbatch" and args[args.index("--zero") + 1] == "3"
    cfg = TrainConfig.build(MODEL, **lay.settings())
    assert (cfg.parallel.zero, cfg.parallel.unshard, cfg.parallel.virtual_stages) == (3, "microbatch", 8)
    assert "--unshard" not in Layout(8, 1, 1, "1f1b", 1, 2, 1, zero=3).run_args(MODEL, "fp32")  # step: the default


def test_llama3_8b_on_8_h100_at_a_million_tokens():
    """What the planner answers, and why FSDP 8 per block (torchtitan's layout) is not it: docs/llama-plan.md."""
    cluster = make_cluster(8, 8, device="h100", precision="bf16")
    req = Request(MODEL_PRESETS["llama3-8b"], 128, cluster, AnalyticalCosts(cluster), top=3)
    best = search(req).best[0]
    L = best.layout
    assert (L.zero, L.unshard, L.dp * L.cp) == (3, "microbatch", 4)  # ZeRO-3 over a cp group, gathered per group
    cap = cluster.usable_bytes
    fsdp = {rc: evaluate_layout(req, Layout(8, 1, 1, "interleaved-1f1b", 32, 16, 1, rc, 3, unshard="microbatch"))
            for rc in ("none", "selective", "full")}
    # FSDP 8: sixteen microbatches keep every block's fp32 gradients through the step (the whole model's, 8 B x
    # 4 bytes), so one 8192-token sequence's activations fit only under full recomputation ...
    for rc in ("none", "selective"):
        peak = fsdp[rc].memory[fsdp[rc].peak_rank]
        assert peak["total"] > cap and peak["gradients"] > 8e9 * 4 and peak["activations"] > cap - peak["gradients"]
    assert fsdp["full"].peak_bytes <= cap
    # ... which costs a third more compute: slower than the plan chosen
    assert fsdp["full"].step_time > 1.2 * best.step_time
