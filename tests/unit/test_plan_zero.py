"""The planner with ZeRO 1-3: what a rank holds at a step's peak and between steps (the measured side:
tests/distributed/test_zero.py), and `plan --zero N` keeping only that level."""
from __future__ import annotations

from pipegpt.config import ModelConfig
from pipegpt.costs.cost import AnalyticalCosts
from pipegpt.costs.devices import make_cluster
from pipegpt.costs.memory import state_bytes
from pipegpt.dims import Sharding
from pipegpt.plan.candidates import Request
from pipegpt.plan.search import search

from helpers import invoke

MODEL = ModelConfig(vocab_size=1000, seq_len=128, n_layer=8, n_head=8, n_embd=256)


def test_state_by_zero_level_at_the_peak_and_between_steps():
    stages = [(4, True, False)]
    P = state_bytes(MODEL, stages).parameters
    S = -(-P // 4)
    for zero, peak, rest in [(0, (P, P, 2 * P), (P, P, 2 * P)),
                             (1, (P, P + S, 2 * S), (P, P + S, 2 * S)),
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
    assert {b.layout.zero for b in plain} <= {0, 1}  # 2 and 3 only when asked: at the peak they hold what 1 does


def test_plan_zero_on_the_command_line():
    result = invoke("plan", "--model", "gpt2", "--gpus", "8", "--device", "h100", "--batch-size", "64", "--zero",
                    "3", "--top", "2")
    assert result.exit_code == 0, result.output
    runs = [line for line in result.output.splitlines() if "pipegpt run" in line]
    assert runs and all("--zero 3" in line for line in runs)
