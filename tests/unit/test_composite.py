"""A composite action (two compute actions of one rank run as one, DualPipe's overlapped F and B): it prints and
parses back, validates as its parts in order, lowers whole, and every engine times it by the one timing rule."""
from __future__ import annotations

import pytest

from pipegpt.schedule import timing_rule
from pipegpt.schedule.actions import Action, Composite, Kind, Plan, ScheduleError
from pipegpt.schedule.lowering import lower
from pipegpt.schedule.simulate import Costs, simulate, simulate_order
from pipegpt.schedule.synthesis.fast_simulate import evaluate
from pipegpt.schedule.synthesis.list_scheduler import Problem
from pipegpt.schedule.validate import validate

# 1F1B on two ranks, four microbatches, the last stage's steady state as composite pairs.
RANK0 = "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
RANK1 = "1F0 (1F1;1B0) (1F2;1B1) (1F3;1B2) 1B3"


def _plan(rank1: str = RANK1, rank0: str = RANK0) -> Plan:
    ranks = [tuple(Action.parse(t) for t in line.split()) for line in (rank0, rank1)]
    return Plan("toy-composite", 4, (0, 1), tuple(ranks))


def test_a_composite_prints_and_parses_back():
    pair = Action.parse("(1F1;1B0)")
    assert isinstance(pair, Composite) and pair.kind is Kind.OVERLAP and pair.kind.is_compute
    assert pair.parts == (Action(1, Kind.F, 1), Action(1, Kind.B, 0))
    assert str(pair) == "(1F1;1B0)" and Action.parse(str(pair)) == pair
    assert _plan().to_text() == f"{RANK0}\n{RANK1}\n"


@pytest.mark.parametrize("text", ["(1F1)", "(1F1;1B0;1F2)", "(1F1;1B1)", "(1F1;1SEND_F1)", "(1F1;(1F2;1B0))",
                                  "1F1;1B0)"])
def test_a_bad_composite_is_refused(text):
    with pytest.raises(ScheduleError, match="composite|bad action"):
        Action.parse(text)


def test_validate_checks_the_parts_as_if_in_order():
    assert validate(_plan()) is not None
    with pytest.raises(ScheduleError, match="1F1"):  # its F comes after the B that needs it
        validate(_plan("1F0 (1B1;1F1) (1F2;1B0) (1F3;1B2) 1B3"))
    with pytest.raises(ScheduleError, match="belongs to rank"):
        validate(_plan("1F0 (1F1;1B0) (1F2;1B1) (1F3;1B2) 1B3", "0F0 (0F1;1B3) 0B0 0F2 0B1 0F3 0B2 0B3"))


def test_lowering_keeps_a_composite_whole_with_its_parts_messages_around_it():
    costs = Costs.uniform(2, comm=0.5)
    lowered = validate(lower(_plan(), costs))
    rank1 = [str(a) for a in lowered.ranks[1]]
    at = rank1.index("(1F1;1B0)")
    assert "1RECV_F1" in rank1[:at] and rank1.index("1SEND_B0") > at
    assert [a for a in rank1 if not a.startswith("1SEND") and not a.startswith("1RECV")] == RANK1.split()


def _times(plan: Plan, costs: Costs):
    """Makespan by simulate (tag), simulate_order (lowered for these costs), and the synthesizer's simulator."""
    tag = simulate(plan, costs)
    order = simulate_order(lower(plan, costs), costs)
    problem = Problem(plan.stage_to_rank, plan.num_microbatches, costs)
    fast, peak = evaluate(problem, problem.encode(plan))
    assert problem.decode(problem.encode(plan)) == plan.ranks
    assert peak == max(tag.peak_live_microbatches_per_rank)
    return tag.makespan, order.makespan, fast, tag


@pytest.mark.parametrize("costs", [Costs.uniform(2), Costs((1.3, 0.7), (2.9, 1.1), (1.0, 0.5), comm=0),
                                   Costs((1.3, 0.7), (2.9, 1.1), (1.0, 0.5), comm=0.25, dp_comm=(3, 1))],
                         ids=["unit", "uneven", "latency"])
def test_a_composite_action_is_timed_by_every_engine_alike(costs):
    tag, order, fast, timeline = _times(_plan(), costs)
    assert tag == fast  # to the bit
    if not costs.comm:
        assert order == tag
    # No communication inside the parts: a pair costs the sum of its parts, back to back.
    pair = [e for e in timeline.events if e.rank == 1][1:3]
    assert [str(e.action) for e in pair] == ["1F1", "1B0"]
    assert pair[0].end == pair[1].start
    assert pair[1].end - pair[0].start == pytest.approx(costs.duration(Action(1, Kind.F, 1))
                                                        + costs.duration(Action(1, Kind.B, 0)))


def test_unit_costs_give_the_pairs_makespan_in_every_engine():
    """By hand (F 1, B 2): rank 1's pairs run [2, 5], [8, 11], [14, 17], each waiting for rank 0's next forward,
    which waits for the backward its pair sent back; rank 0's last two backwards end at 21."""
    assert _times(_plan(), Costs.uniform(2))[:3] == (21.0, 21.0, 21.0)


def test_a_parts_communication_hides_under_the_other_parts_compute(monkeypatch):
    """The overlap is one number, timing_rule.part_comm: with a forward's all-to-all of 2.5 under a backward of 2,
    the backward's slot grows to 2.5 (three pairs: 1.5 later), in every engine."""
    monkeypatch.setattr(timing_rule, "part_comm", lambda costs, part: 2.5 if part.kind is Kind.F else 0)
    assert timing_rule.spans_of(Costs.uniform(2), Composite.of(Action(1, Kind.F, 1), Action(1, Kind.B, 0)), 0) \
        == [(0, 1.0), (1.0, 3.5)]
    tag, order, fast, _ = _times(_plan(), Costs.uniform(2))
    assert tag == order == fast == 22.5


def test_a_schedule_file_holds_composites():
    from pipegpt.schedule.schedule_file import dump_schedule_text, parse_schedule_text

    plan = parse_schedule_text(f"{RANK0}\n{RANK1}\n")
    assert plan.ranks == _plan().ranks and plan.num_microbatches == 4
    assert parse_schedule_text(dump_schedule_text(plan)).ranks == plan.ranks
    with pytest.raises(ScheduleError, match="bad token '\\(1F1'"):
        parse_schedule_text(f"{RANK0}\n1F0 (1F1\n")


def test_a_pair_waiting_for_what_its_own_first_part_feeds_is_a_circular_wait():
    """Rank 0's pair (0F1;0B0) needs 1B0, which rank 1 runs after 1F1, which needs 0F1 from the pair: with the
    parts one after the other the plan runs; as one action the pair would wait for itself through rank 1."""
    plan = _plan("1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3", "0F0 (0F1;0B0) 0F2 0F3 0B1 0B2 0B3")
    assert validate(plan.flattened())
    with pytest.raises(ScheduleError, match="circular wait"):
        validate(plan)
    assert validate(_plan("1F0 1F1 (1B0;1B1) 1F2 1B2 1F3 1B3", "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3"))


def _paired(plan: Plan) -> Plan:
    """The plan with each forward and the backward right after it (two microbatches) as a composite, where the
    pair as one action still validates."""
    for r in range(plan.num_ranks):
        k = 0
        while k + 1 < len(plan.ranks[r]):
            first, second = plan.ranks[r][k], plan.ranks[r][k + 1]
            if first.kind is Kind.F and second.kind in (Kind.B, Kind.I) and first.microbatch != second.microbatch:
                ranks = list(plan.ranks)
                ranks[r] = ranks[r][:k] + (Composite.of(first, second),) + ranks[r][k + 2:]
                try:
                    plan = validate(plan.with_ranks(ranks))
                except ScheduleError:
                    pass
            k += 1
    return plan


@pytest.mark.parametrize("name,ranks,microbatches", [("dualpipev", 4, 8), ("1f1b", 4, 8), ("zbv", 3, 6),
                                                     ("interleaved-1f1b", 2, 4)])
def test_pairs_in_real_schedules_are_timed_alike(name, ranks, microbatches):
    from pipegpt.schedule.registry import schedule_spec

    spec = schedule_spec(name)
    n = spec.num_stages(ranks)
    costs = Costs(tuple(1 + 0.1 * s for s in range(n)), tuple(2.2 + 0.05 * s for s in range(n)), (0.9,) * n,
                  comm=0.15, dp_comm=(0.5,) * n)
    plan = _paired(spec.build(ranks, microbatches))
    pairs = sum(a.kind is Kind.OVERLAP for acts in plan.ranks for a in acts)
    assert pairs >= ranks - 1
    tag, order, fast, _ = _times(plan, costs)
    assert tag == fast and order >= tag - 1e-9
    lowered = validate(lower(plan, costs))
    assert [a for acts in lowered.compute_only().ranks for a in acts] == [a for acts in plan.ranks for a in acts]


def test_message_memory_and_evaluation_read_a_pairs_parts():
    """The message buffers a rank holds (messages.message_peaks) count a pair's parts as the same plan with the
    parts apart does (zbv's paired plan holds 5 on rank 2 either way), but for the sends released at a pair, which
    the runtime drops after it (its parts wait for their receives inside): one more on rank 1."""
    from pipegpt.schedule.messages import message_peaks
    from pipegpt.schedule.registry import schedule_spec

    plan = _paired(schedule_spec("zbv").build(3, 6))
    lowered = lower(plan, Costs.uniform(plan.num_stages, comm=0.3))
    assert message_peaks(lowered) == message_peaks(lowered, True) == [6, 9, 5]
    assert message_peaks(lowered.flattened()) == message_peaks(lowered.flattened(), True) == [6, 8, 5]
    assert validate(_plan().forward_only()).ranks[1] == tuple(Action(1, Kind.F, mb) for mb in range(4))


def test_a_pair_is_also_written_with_an_ampersand():
    """"0F5&3B2" (a V's two stages on one rank) reads as the composite "(0F5;3B2)" does."""
    assert Action.parse("0F5&3B2") == Action.parse("(0F5;3B2)") == Composite.of(Action(0, Kind.F, 5),
                                                                                Action(3, Kind.B, 2))
    for bad in ("0F5&0B5", "0F5&", "0F5&3B2&1F1", "0F5&(3B2;1F1)", "0F5&1SEND_F1"):
        with pytest.raises(ScheduleError, match="composite"):
            Action.parse(bad)


def _file(tmp_path, text: str):
    from pipegpt.schedule.schedule_file import load_schedule_file

    path = tmp_path / "pairs.txt"
    path.write_text(text)
    return load_schedule_file(path)


def test_a_schedule_file_with_ampersand_pairs_runs_and_a_bad_pair_is_refused_naming_its_line(tmp_path):
    rank1 = RANK1.replace("(1F1;1B0)", "1F1&1B0").replace("(1F2;1B1)", "1F2&1B1")
    assert _file(tmp_path, f"{RANK0}\n{rank1}\n").ranks == _plan().ranks
    with pytest.raises(ScheduleError, match=r"pairs.txt:3: bad token '1F1&1B1'.*two microbatches"):
        _file(tmp_path, f"# name: x\n{RANK0}\n1F0 1F1&1B1 1F2 1B0 1F3 1B2 1B3\n")
    # Halves on two ranks: stage 0 lives on rank 0 (the file's first line).
    with pytest.raises(ScheduleError, match=r"pairs.txt:3: .*pair \(0F3;1B2\): stage 0 belongs to rank 0; a pair's "
                                            r"halves run on one rank"):
        _file(tmp_path, f"# stages: 0 1\n{RANK0}\n1F0 1F1&1B0 1F2&1B1 0F3&1B2 1B3\n")


def test_a_pair_whose_halves_depend_on_each_other_is_refused():
    """The only dependency between two microbatches is a decode plan's token loop: a group's next step on the first
    stage takes its last stage's token. On one rank (stages 0 and 1 there) such a pair would wait for itself."""
    bad = Plan("decode-pair", 4, (0, 0), ((Action(0, Kind.F, 0), Action(0, Kind.F, 1),
                                           Composite.of(Action(1, Kind.F, 0), Action(0, Kind.F, 2)),
                                           Action(1, Kind.F, 1), Action(0, Kind.F, 3), Action(1, Kind.F, 2),
                                           Action(1, Kind.F, 3)),), meta={"decode_groups": 2})
    with pytest.raises(ScheduleError, match=r"pair \(1F0;0F2\): 0F2 needs 1F0, the other half"):
        validate(bad)


def test_the_memory_a_pair_holds_together_is_checked_against_the_limit(tmp_path):
    """Rank 0 holds two microbatches before its pair (0F2;0B0) and three during it (the pair's forward's new one
    before its backward frees the other), two at most elsewhere: a limit of 3 runs, 2 refuses the pair, naming
    its line."""
    from pipegpt.schedule.validate import held_live

    assert held_live(_plan(), 1) == [1, 2, 2, 2, 1]
    assert held_live(_plan(), 0) == [1, 2, 2, 2, 2, 2, 2, 1]
    rank0, rank1 = "0F0 0F1 0F2&0B0 0B1 0F3 0B2 0B3", "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    assert str(_file(tmp_path, f"# max_live: 3\n{rank0}\n{rank1}\n").ranks[0][2]) == "(0F2;0B0)"
    with pytest.raises(ScheduleError, match=r"pairs.txt:2: rank 0 step 2 \(\(0F2;0B0\)\): pair \(0F2;0B0\) holds 3 "
                                            r"stage-microbatches together .* more than the memory limit max_live=2"):
        _file(tmp_path, f"# max_live: 2\n{rank0}\n{rank1}\n")


def test_the_all_to_all_cost_parses_scales_and_round_trips():
    costs = Costs.parse("F=1,B=2,a2a=0.5", 2)
    assert costs.a2a_comm == (0.5, 0.5) and costs.as_dict()["a2a"] == [0.5, 0.5]
    assert Costs.from_json(costs.as_dict(), 2) == costs
    assert costs.scaled(0.5).a2a_comm == (0.25, 0.25)
    assert Costs.parse("F=1,B=2", 2).a2a_comm == (0, 0) and "a2a" not in Costs.parse("F=1", 2).as_dict()
    with pytest.raises(ScheduleError, match="a2a"):
        Costs.parse("a2a=-1", 2)


@pytest.mark.parametrize("a2a,alone,pair", [(0.5, (1.5, 2.5), 3.0), (3, (4, 5), 6), (0, (1, 2), 3)])
def test_a_pairs_halves_hide_each_others_all_to_all(a2a, alone, pair):
    """F 1, B 2, all-to-all a2a each: alone F takes 1 + a2a and B 2 + a2a (nothing hides their all-to-all); a pair
    takes max(1, a2a) + max(2, a2a), each half's compute hiding the other's all-to-all."""
    costs = Costs.uniform(2, comm=0).__class__((1, 1), (2, 2), (1, 1), a2a_comm=(a2a, a2a))
    f, b = Action(1, Kind.F, 1), Action(1, Kind.B, 0)
    assert (costs.duration(f), costs.duration(b)) == alone
    assert costs.duration(Composite.of(f, b)) == pair
    assert timing_rule.spans_of(costs, Composite.of(f, b), 10) == [(10, 10 + max(1, a2a)), (10 + max(1, a2a),
                                                                                            10 + pair)]


def test_a_pairs_gain_worked_by_hand_in_every_engine():
    """F 1, B 2, all-to-all 0.5 (alone F 1.5, B 2.5; a pair 3). Rank 1's pairs start when rank 0's forward
    arrives: 0F0 [0, 1.5], 0F1 [1.5, 3], 1F0 [1.5, 3], (1F1;1B0) [3, 6], 0B0 [6, 8.5], 0F2 [8.5, 10],
    (1F2;1B1) [10, 13], 0B1 [13, 15.5], 0F3 [15.5, 17], (1F3;1B2) [17, 20], 1B3 [20, 22.5], 0B3 [22.5, 25].
    The halves apart (--overlap off): each pair 4 instead of 3, and the chain it sits on 28."""
    costs = Costs((1, 1), (2, 2), (1, 1), a2a_comm=(0.5, 0.5))
    tag, order, fast, timeline = _times(_plan(), costs)
    assert tag == order == fast == 25
    pair = [(str(e.action), e.start, e.end) for e in timeline.events if e.rank == 1][1:3]
    assert pair == [("1F1", 3, 4), ("1B0", 4, 6)]
    assert _times(_plan().flattened(), costs)[:3] == (28, 28, 28)
    # Dense (no all-to-all): the pair is its halves' sum, as before this cost existed.
    assert _times(_plan(), Costs((1, 1), (2, 2), (1, 1)))[:3] == (21, 21, 21)


def test_the_chart_draws_a_pair_as_one_block_with_both_labels():
    from pipegpt.schedule.render import to_svg
    from pipegpt.schedule.simulate import Event, Timeline

    svg = to_svg(simulate(_plan(), Costs((1, 1), (2, 2), (1, 1), a2a_comm=(0.5, 0.5))))
    assert svg.count('class="pair"') == 3
    assert ">F1&amp;B0<" in svg and ">F3&amp;B2<" in svg and ">F1<" not in svg.split('class="pair"')[1][:400]
    measured = Timeline([Event(0, Action.parse("(0F1;0B0)"), 0.0, 3.0)], 1, time_unit="s")
    drawn = to_svg(measured)
    assert drawn.count('class="pair"') == 1 and ">F1&amp;B0<" in drawn and "backward" in drawn


def test_combined_1f1b_pairs_the_steady_state_and_hides_the_all_to_all():
    """1f1b-overlap warms up with 2(p - r) - 1 forwards, then pairs F(i + w) with B(i): dense, it runs as 1F1B does
    (here to within the message latency it saves); with all-to-alls it hides them, where 1F1B cannot."""
    from pipegpt.schedule.registry import build_plan

    plan = build_plan("1f1b-overlap", 2, 5)
    assert plan.to_text() == ("0F0 0F1 0F2 (0F3;0B0) (0F4;0B1) 0B2 0B3 0B4\n"
                              "1F0 (1F1;1B0) (1F2;1B1) (1F3;1B2) (1F4;1B3) 1B4\n")
    for p, m in ((1, 1), (3, 2), (4, 8), (5, 13)):
        validate(lower(build_plan("1f1b-overlap", p, m)))
    dense, moe = Costs.parse("F=1,B=2,W=1,comm=0.05", 4), Costs.parse("F=1,B=2,W=1,comm=0.05,a2a=0.5", 4)
    paired, plain = build_plan("1f1b-overlap", 4, 16), build_plan("1f1b", 4, 16)
    assert simulate(paired, dense).makespan <= simulate(plain, dense).makespan
    assert simulate(paired, moe).makespan == pytest.approx(62.0)  # 1F1B: 77.4
    assert simulate(plain, moe).makespan == pytest.approx(77.4)
    assert simulate(paired.flattened(), moe).makespan == pytest.approx(76.3)  # its order, the halves apart


def test_dualpipev_runs_its_main_phase_as_pairs():
    from pipegpt.schedule.registry import build_plan

    plan = build_plan("dualpipev", 2, 4)
    assert [str(a) for a in plan.ranks[1] if a.kind is Kind.OVERLAP] == ["(1F2;2B0)", "(2F2;1B0)", "(1F3;2B1)",
                                                                         "(2F3;1B1)"]
    costs = Costs.parse("F=0.5,B=1,W=0.5,a2a=0.5", 8)
    big = build_plan("dualpipev", 4, 16)
    tag, order, fast, _ = _times(big, costs)
    assert tag == fast and order >= tag
    assert tag < simulate(big.flattened(), costs).makespan


def test_overlap_off_runs_the_halves_apart(tmp_path):
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.planner.run_plan import make_plan

    model = ModelConfig(vocab_size=64, seq_len=8, n_layer=4, n_head=2, n_embd=16)
    cfg = TrainConfig.build(model, stages=2, microbatches=4, schedule="1f1b-overlap")
    assert make_plan(cfg).has_composites
    apart = make_plan(cfg.replace(overlap="off"))
    assert not apart.has_composites
    assert [a for acts in apart.compute_only().ranks for a in acts] == \
        [a for acts in make_plan(cfg).compute_only().flattened().ranks for a in acts]


def test_simulate_shows_the_pairs_gain(tmp_path):
    from click.testing import CliRunner

    from pipegpt.cli import main

    args = ["simulate", "-s", "1f1b-overlap", "-p", "2", "-m", "6", "--costs", "F=1,B=2,W=1,a2a=1", "--no-chart"]
    out = CliRunner().invoke(main, args).output
    assert "makespan          25\n" in out and "without pairs (--overlap off) 35: pairs save 28.6%" in out
    off = CliRunner().invoke(main, args + ["--overlap", "off"]).output
    assert "makespan          35\n" in off and "pairs" not in off


def test_the_synthesizer_pairs_where_the_all_to_all_pays():
    """With all-to-alls and room for a pair's extra microbatch (max live 6 at p 4), auto pairs forwards with
    backwards and beats every fixed schedule that fits (zb-h1, 40.2); dense, no pair pays, and none is made."""
    from pipegpt.schedule.registry import schedule_spec

    moe = Costs.parse("F=1,B=2,W=1,a2a=0.6", 4)
    synthesis = schedule_spec("auto").synthesize(4, 8, None, moe, 6)
    assert synthesis.plan.has_composites and synthesis.best_fixed_makespan == pytest.approx(40.2)
    assert synthesis.lower_bound <= synthesis.makespan == pytest.approx(37.4)
    validate(lower(synthesis.plan, moe))
    assert simulate(synthesis.plan, moe).makespan == synthesis.makespan
    assert max(simulate(synthesis.plan, moe).peak_live_microbatches_per_rank) <= 6
    dense = schedule_spec("auto").synthesize(4, 8, None, Costs.parse("F=1,B=2,W=1", 4), 6)
    assert not dense.plan.has_composites
