"""benchmarks/bench_floor.py's arithmetic, worked by hand (no run, no timing): the step's parts sum to it, the
split's cap for whole and half layers, the attention's FLOP share, a compute action's wait for its input."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_floor  # noqa: E402

from pipegpt.schedule import Action, Kind, build_plan  # noqa: E402
from pipegpt.schedule.simulate import Event, Timeline  # noqa: E402


def test_gap_parts_by_hand():
    # Fc 600 ms, Fo 50; e 1.1, a 1.05, b 1.02: the model's span 0.6 x 1.1 x 1.05 x 1.02 = 706.86 ms; the plan
    # at the run's own compute times 750 ms; the actions' span 900 ms of a 1000 ms step
    # (e) 60 ms: 30 of it the machine shared (every core busy, the floor computes 5% slower), 30 the ranks
    parts = dict(bench_floor.gap_parts(1.0, 0.9, 0.75, 0.6, 0.05, 1.1, 1.05, 1.02, shared=1.05))
    expected = {"floor": 0.65, "(e1) cores shared": 0.03, "(e2) ranks": 0.03, "(a) split": 0.033, "(b) bubble": 0.01386,
                "(f) run's costs": 0.75 - 0.70686, "(c) runtime": 0.15, "(d) outside": 0.05}
    assert list(parts) == list(bench_floor.GAP_PARTS)
    for name, seconds in expected.items():
        assert parts[name] == pytest.approx(seconds, abs=1e-12), name
    assert sum(parts.values()) == pytest.approx(1.0, abs=1e-12)


def test_split_cap_whole_and_half_layers():
    # 8 blocks of 1, embedding 0.1, head 4.7: 12.8 in all, 6.4 a rank at best. Whole layers: 6,2 puts 6.7 on the
    # head's rank (7,1 puts 7.1 on the first). Halves (attention 0.4 | MLP 0.6): the head's rank takes block 6's
    # MLP and block 7, 6.3, the first 6.5.
    two_ranks = (0, 1)
    caps = bench_floor.finer_caps(1.0, 0.1, 4.7, 8, 0.4, two_ranks)
    assert caps["layers"] == pytest.approx(6.7 / 6.4)
    assert caps["attention | MLP"] == pytest.approx(6.5 / 6.4)
    assert caps["anywhere"] == 1.0
    # a given split: 7,1
    assert bench_floor.split_cap([1.0] * 8, 0.1, 4.7, two_ranks, [7, 1]) == pytest.approx(7.1 / 6.4)


def test_attention_share_of_the_heavy_head_block():
    from pipegpt.config import model_config

    model = model_config("tiny", n_layer=8, n_embd=256, n_head=4, seq_len=256, vocab_size=16384)
    # attention 6 x 4C^2 + 12 C T, the MLP 6 x 8C^2: with C = T, 36 C^2 of 84 C^2 = 3/7
    share = bench_floor.attention_share({k: getattr(model, k) for k in model.__dataclass_fields__})
    assert share == pytest.approx(3 / 7)


def test_compute_less_the_wait_for_the_other_rank():
    plan = build_plan("1f1b", 2, 2)  # rank 0: 0F0 0F1 0B0 0B1; rank 1: 1F0 1B0 1F1 1B1
    times = {"0F0": (0, 0, 1), "0F1": (0, 1, 2), "0B0": (0, 2, 5), "0B1": (0, 5, 7),
             "1F0": (1, 0.5, 2), "1B0": (1, 2, 4), "1F1": (1, 4, 5), "1B1": (1, 5, 6.5)}
    events = [Event(rank, Action.parse(name), start, end) for name, (rank, start, end) in times.items()]
    computing = bench_floor.without_waits(Timeline(events, 2), plan)
    # 0B0 waits for 1B0 (ends 4): 2 of its 3; 0B1 for 1B1 (6.5): 1.5 of 2; 1F0 for 0F0 (1): 0.5 of 1.5;
    # 1F1's input (0F1, ended 2) was there at its start 4; 1B0 depends on its own rank only
    starts = {str(e.action): e.start for e in computing.events}
    assert starts == {"0F0": 0, "0F1": 1, "0B0": 4, "0B1": 6.5, "1F0": 1, "1B0": 2, "1F1": 4, "1B1": 5}
    assert computing.busy_per_rank == pytest.approx([3.5, 5.5])
    # the plan replayed at those times, messages free: rank 1 from 0F0's end at 1: F 1, B 2, F 1, B 1.5 to 6.5,
    # then rank 0's 0B1 0.5
    assert bench_floor.compute_span(plan, computing) == pytest.approx(7.0)
    slower = Timeline([e if str(e.action) != "1B1" else Event(1, e.action, 5, 8) for e in computing.events], 2)
    assert bench_floor.compute_span(plan, slower) == pytest.approx(8.5)  # 1B1 takes 3: 0B1 from 8
    assert {a.kind for a in plan.ranks[0]} == {Kind.F, Kind.B}


def test_run_gap_sums_to_the_traced_steps_mean():
    def step(s, span, c0, c1):
        return {"step": s, "span": span, "compute_span": span - 0.1, "parts": {"actions": span, "optimizer": s - span},
                "compute": [c0, c1], "waits": [0.0, 0.0], "messages": [0.0, 0.0], "gaps": [0.0, 0.0],
                "clip": [0.0, 0.0], "optimizer": [s - span] * 2}

    run = {"traced": [step(1.0, 0.9, 0.6, 0.7), step(1.2, 1.1, 0.7, 0.8)],
           "planned": {"cap": 1.05, "bubble": 1.02, "finer": {"layers": 1.05, "attention | MLP": 1.0,
                                                              "anywhere": 1.0}}}
    gap = bench_floor.run_gap(run, floor_compute=0.6, floor_outside=0.05)
    assert gap["step"] == pytest.approx(1.1) and gap["span"] == pytest.approx(1.0)
    assert gap["inflation"] == pytest.approx(0.7 / 0.6)  # the ranks' mean compute, 0.65 and 0.75
    assert gap["measured_cap"] == pytest.approx(0.75 / 0.7)
    assert sum(gap["parts"].values()) == pytest.approx(1.1)
    assert gap["parts"]["(d) outside"] == pytest.approx(1.1 - 1.0 - 0.05)
    # a = 1 takes Fc e b (a - 1) = 0.6 x 7/6 x 1.02 x 0.05 off the step, as does a' = 1 between attention and MLP
    saved = bench_floor.finer_savings(gap, run["planned"], floor_compute=0.6)
    assert saved == pytest.approx({"layers": 0.0, "attention | MLP": 0.7 * 1.02 * 0.05, "anywhere": 0.7 * 1.02 * 0.05})
    # the bound: e = 1, the plan's costs, nothing else: (0.6 + 0.05) / (0.6 x 1.05 x 1.02 + 0.05)
    assert bench_floor.bound(0.6, 0.05, 1.05, 1.02) == pytest.approx(0.65 / 0.6926)
