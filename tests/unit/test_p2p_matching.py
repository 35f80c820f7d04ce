"""Messages matched by order (NCCL) against by tag (gloo): the order model on hand-written plans with times worked
out by hand, and the lowering that places each SEND so that a plan costs under order what it costs under tag.

Costs are integers or fractions, so times are exact. The matrix: every schedule at p 2..8, m p..4p, unit costs and a
heavy head (a last stage worth 4 blocks more), order within 1% of tag without latency and with a latency of
0.05-0.2 of a forward; a fast subset runs by default, the whole of it under -m slow.
"""
from fractions import Fraction

import pytest

from pipegpt.schedule import SCHEDULES, Action, Kind, Plan, ScheduleError, build_plan, lower, validate
from pipegpt.schedule.simulate import simulate_matching, simulate_order
from pipegpt.schedule.messages import comm_batches, comm_runs
from pipegpt.schedule.schedule_file import parse_schedule_text
from pipegpt.schedule.simulate import Costs, simulate


def plan_of(text: str) -> Plan:
    return parse_schedule_text(text)


def starts(timeline) -> dict[str, float]:
    return {str(e.action): e.start for e in timeline.events}


# ---------------------------------------------------------------------------------------------------------
# the order model, by hand


def test_a_send_leaves_at_its_send_not_when_its_output_exists():
    plan = plan_of("0F0 0F1 0SEND_F0 0SEND_F1\n1RECV_F0 1F0 1RECV_F1 1F1")
    costs = Costs.uniform(2, F=1)
    assert simulate(plan, costs).makespan == 3  # tag: 1F0 as soon as 0F0 is done
    order = simulate_order(plan, costs)
    # both sends go after 0F1 (t=2): 1F0 waits for them; 1F1's receive posts at 3
    assert starts(order)["1F0"] == 2 and starts(order)["1F1"] == 3 and order.makespan == 4


def test_a_batch_completes_together(monkeypatch):
    # posted as one batch (as a run is where receives are read in the order they are posted: here, with the
    # run one batch), neither forward is there before the later send is posted
    import pipegpt.schedule.simulate as matching

    plan = plan_of("0F0 0SEND_F0 0F1 0SEND_F1\n1RECV_F0 1RECV_F1 1F0 1F1")
    costs = Costs.uniform(2, F=1)
    assert simulate(plan, costs).makespan == 3
    assert comm_batches(plan.ranks[1]) == [(0, 1), (1, 2)]  # F1 is read after F0: a batch each
    assert simulate_order(plan, costs).makespan == 3
    monkeypatch.setattr(matching, "comm_batches", comm_runs)
    order = simulate_order(plan, costs)
    assert starts(order)["1F0"] == 2 and order.makespan == 4


def test_receives_in_a_run_share_a_batch_where_a_later_one_is_read_first():
    """Batches of a rank run one after another: a receive read before the one ahead of it in the run goes in its
    batch (both complete when the later arrives, which its reader waits for anyway); one read after is cut off,
    so that its reader does not wait for the next."""
    actions = [Action.parse(t) for t in "9SEND_B1 2RECV_F5 9RECV_B2 9B2 2F5 2RECV_F6 2RECV_F7 2F6 2F7".split()]
    assert comm_batches(actions) == [(0, 3), (5, 6), (6, 7)]


def test_a_batch_of_sends_alone_holds_no_compute_back():
    # rank 1's second receive posts only at 4; rank 0 computes on meanwhile, and the step ends with the compute
    plan = plan_of("0F0 0SEND_F0 0F1 0SEND_F1\n1RECV_F0 1F0 1RECV_F1 1F1")
    costs = Costs((1, 3), (2, 6), (1, 3))
    order = simulate_order(plan, costs)
    assert starts(order) == {"0F0": 0, "0F1": 1, "1F0": 1, "1F1": 4}
    assert order.makespan == simulate(plan, costs).makespan == 7


def test_a_rank_s_sends_and_receives_with_one_peer_run_on_two_lanes():
    """Rank 0 sends forward 1 (t=2) in the batch where it receives gradient 0; rank 1 takes forward 1 only after
    its long W0 (t=6). The send goes on the communicator for rank 0's messages to rank 1, the receive on the one
    for rank 1's to rank 0: the gradient (sent at t=3) is there at 3, and order costs tag's 12. On one stream a
    pair, the receive queued behind the send until 6, and the step took 14."""
    plan = plan_of("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1\n"
                   "1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1")
    assert comm_batches(plan.ranks[0])[1] == (3, 5)  # 0SEND_F1 0RECV_B0: one batch, two lanes
    costs = Costs((1, 1), (4, 4), (3, 3))
    order = simulate_order(plan, costs)
    assert starts(order)["0I0"] == 3 and order.makespan == simulate(plan, costs).makespan == 12


def test_the_step_ends_when_the_last_batch_completes():
    # rank 0's last send is taken by rank 1 after a long compute: the step's settle waits for it
    plan = plan_of("0F0 0SEND_F0 0F1 0SEND_F1\n1RECV_F0 1F0 1RECV_F1 1F1")
    costs = Costs((1, 5), (2, 10), (1, 5))
    order = simulate_order(plan, costs)
    assert order.makespan == 11 and max(e.end for e in order.events) == 11


def test_order_simulation_refuses_a_plan_that_deadlocks_under_order():
    """Rank 1 posts the receive of forward 1 before forward 0's, each a batch (forward 1 is read first): on the lane
    from rank 0, forward 0's send waits for a receive queued behind forward 1's, whose send is queued behind it.
    validate() says why before any run."""
    text = "0F0 0SEND_F0 0F1 0SEND_F1\n1RECV_F1 1RECV_F0 1F1 1F0"
    with pytest.raises(ScheduleError, match="messages between two ranks must keep order"):
        plan_of(text)
    ranks = tuple(tuple(map(Action.parse, line.split())) for line in text.splitlines())
    with pytest.raises(ScheduleError, match="rank 0 step 3 .0SEND_F1.: deadlocks with messages matched by order"):
        simulate_order(Plan("swapped", 2, (0, 1), ranks), Costs.uniform(2))


def test_a_plan_refused_as_crossing_on_one_stream_runs_on_directed_lanes():
    """Rank 0 sends forward 1 in a batch of its own before it receives gradient 0, rank 1 sends gradient 0 before
    it receives forward 1. On one stream a rank each send waits for a receive queued behind the other's send, and
    validate() still refuses it so (its check assumes one stream, which holds on any backend); on NCCL's directed
    lanes neither send waits for a receive."""
    text = ("0F0 0SEND_F0 0F1 0SEND_F1 0F2 0RECV_B0 0I0 0SEND_F2 0W0 0RECV_B1 0I1 0W1 0RECV_B2 0I2 0W2\n"
            "1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1 1RECV_F2 1F2 1I2 1SEND_B2 1W2")
    with pytest.raises(ScheduleError, match="deadlock with blocking point-to-point"):
        plan_of(text)
    ranks = tuple(tuple(map(Action.parse, line.split())) for line in text.splitlines())
    assert simulate_order(Plan("crossed", 3, (0, 1), ranks), Costs.uniform(2)).makespan == 11


def test_simulate_matching_lowers_a_compute_plan_for_its_costs_and_refuses_an_unknown_matching():
    plan, costs = build_plan("zb-h1", 4, 8), Costs.uniform(4)
    assert simulate_matching(plan, costs, "order").makespan == simulate_matching(plan, costs).makespan == 27
    with pytest.raises(ScheduleError, match="'eager' is not one of tag, order"):
        simulate_matching(plan, costs, "eager")


# ---------------------------------------------------------------------------------------------------------
# the lowering


def _unrelated_computes_before_sends(plan: Plan) -> int:
    """SENDs with a compute action between them and the compute that made their output."""
    late = 0
    for actions in plan.ranks:
        for k, a in enumerate(actions):
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                made = Action(a.stage, Kind.F, a.microbatch) if a.kind is Kind.SEND_F \
                    else plan.backward_of(a.stage, a.microbatch)
                late += any(x.kind.is_compute for x in actions[actions.index(made) + 1:k])
    return late


def test_zb_h1_sends_right_behind_the_compute_that_made_them():
    plan = lower(build_plan("zb-h1", 4, 8))  # unit costs: 14 of its 48 sends came after a W before
    assert _unrelated_computes_before_sends(plan) == 0
    first = plan.ranks[1]
    assert first.index(Action.parse("1SEND_B1")) == first.index(Action.parse("1I1")) + 1


def test_a_late_send_costs_nothing_where_its_receiver_reads_it_after_another_compute():
    """zb-h1 p 4, m 8: 1SEND_B1 moved behind 1W0 leaves at 20, when 1W0 ends. Rank 0 posted 0RECV_B1 before
    0F4 and waits for it only at 0I1, which starts at 20 anyway: order costs what tag costs. (Waited for before
    0F4, as the runtime once did, the late send cost the step; test_a_send_leaves_at_its_send_not_when_its_output_
    exists shows a late send that does cost.)"""
    plan = lower(build_plan("zb-h1", 4, 8))
    ranks = [list(r) for r in plan.ranks]
    ranks[1].remove(Action.parse("1SEND_B1"))  # where the unit-cost lowering put it: behind 1W0
    ranks[1].insert(ranks[1].index(Action.parse("1W0")) + 1, Action.parse("1SEND_B1"))
    late = validate(plan.with_ranks(ranks))
    costs = Costs.uniform(4, F=2, B=4, W=2)
    assert simulate(late, costs).makespan == simulate(plan, costs).makespan
    order = simulate_order(late, costs)
    assert starts(order)["0F4"] == 18 and starts(order)["0I1"] == 20 == starts(order)["1W0"] + 2
    assert order.makespan == simulate_order(plan, costs).makespan == simulate(plan, costs).makespan == 54


def test_a_receive_waited_for_by_its_reader_spares_a_placement_for_other_costs():
    """A heavy first stage: placed for unit costs, a receive that came early waited at the next compute and cost
    38 (the runtime waited for a batch's receives before the next compute); waited for by its reader, 36."""
    costs = Costs((3, 1), (6, 2), (3, 1))
    plan = build_plan("1f1b", 2, 4)
    tag = simulate(plan, costs).makespan
    assert simulate_order(lower(plan, costs), costs).makespan == tag == 36
    assert simulate_order(lower(plan), costs).makespan == 36  # placed for unit costs


def test_lowering_keeps_collectives_where_they_stand_and_reads_costs_duck_typed():
    from pipegpt.schedule import add_reduce_grad

    plan = add_reduce_grad(build_plan("1f1b", 2, 4))
    lowered = validate(lower(plan, Costs.uniform(2, F=3)))
    for actions in lowered.ranks:
        reduce = next(i for i, a in enumerate(actions) if a.kind is Kind.REDUCE_GRAD)
        assert actions[reduce - 1].kind is Kind.B  # after its last backward, as add_reduce_grad put it

    class Durations:  # anything with duration(action) will do; no comm means none
        def duration(self, action):
            return 2 if action.kind is Kind.B else 1

    assert validate(lower(build_plan("1f1b", 2, 4), Durations())).is_lowered


# ---------------------------------------------------------------------------------------------------------
# the matrix: order within 1% of tag, with and without latency


def _costs(name: str, p: int, head: int, comm=0) -> Costs:
    """A rank's share of the model costs F=1, B=2, W=1, split over its v stages; head adds as many blocks to the
    last stage; comm is a message's latency."""
    stages = len(SCHEDULES[name].stage_to_rank(p))
    v = stages // p
    exact = isinstance(comm, Fraction)
    forward = [Fraction(1, v) if exact else 1 / v] * stages
    forward[-1] += Fraction(head, v) if exact else head / v
    return Costs(tuple(forward), tuple(2 * f for f in forward), tuple(forward), comm)


# Order within 1% of tag at comm 0.05-0.2 of a forward too, every p 2..8, m p..4p, unit costs and the heavy head
# (auto and auto-v at m p, 2p+1, 4p). Before each pair of ranks had its own communicator, a rank's batches ran one
# after another on one NCCL stream, and interleaved-1f1b cost up to 3.5% over tag (p 8, m 32, comm 0.2), auto-v
# up to 1.9%: two messages with two peers less than a latency apart queued behind each other.
LATENCIES = (0.05, 0.1, 0.2)


def _check(name: str, p: int, m: int, head: int, latencies) -> None:
    spec = SCHEDULES[name]
    for comm in latencies:
        costs = _costs(name, p, head, comm)
        try:  # auto and auto-v written for order matching, as `simulate --p2p-matching order` writes them
            plan = spec.synthesize(p, m, None, costs, matching="order").plan if spec.synthesized and comm \
                else spec.build(p, m, None, costs)
        except ScheduleError:  # e.g. dualpipev below 2p microbatches
            return
        lowered = validate(lower(plan, costs))
        tag, order = simulate(plan, costs).makespan, simulate_order(lowered, costs).makespan
        assert tag <= order <= tag * 1.01, (name, p, m, head, comm, tag, order)


@pytest.mark.parametrize("latencies", [(0,), LATENCIES], ids=["no-latency", "latency"])
@pytest.mark.parametrize("head", [0, 4], ids=["unit", "heavy-head"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_order_costs_what_tag_costs_fast_subset(name, head, latencies):
    for p in (2, 4):
        for m in (p, 2 * p + 1, 4 * p)[:2 if latencies != (0,) else 3]:  # with latency, auto-v's search is slow
            _check(name, p, m, head, latencies)


@pytest.mark.slow
@pytest.mark.parametrize("latencies", [(0,), LATENCIES], ids=["no-latency", "latency"])
@pytest.mark.parametrize("head", [0, 4], ids=["unit", "heavy-head"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_order_costs_what_tag_costs_every_size(name, head, latencies):
    for p in range(2, 9):
        for m in range(p, 4 * p + 1):
            _check(name, p, m, head, latencies)


# ---------------------------------------------------------------------------------------------------------
# the matrix with latency: comm 0.05, 0.1 and 0.2 of a forward


def test_with_latency_a_receive_posted_when_its_message_leaves_costs_what_tag_costs():
    """gpipe, p 2, m 2, F=1, B=2, comm=1, worked by hand. Under tag a message is there 1 after its compute
    ends: 1F1 at 3 (0F1 ends at 2), 0B1 at 9 (1B1 ends at 8); makespan 11. Lowered on that timeline, rank 1
    posts both receives before 1F0, a batch each (1F1 reads the second): the first moves when 0SEND_F0 is
    posted at 1 and is there at 2; the second starts then, as 0SEND_F1 is posted, and is there at 3, which
    only 1F1 waits for. Rank 0 posts 0RECV_B0 and 0RECV_B1 after 0F1 (2): they move at 6 and 8 and are there
    at 7 and 9. Order runs as tag does: 11. (Waiting for a batch's receives before the next compute, as the
    runtime once did, the same plan cost 14, and no placement less than 13.)"""
    plan, costs = build_plan("gpipe", 2, 2), Costs.uniform(2, F=1, B=2, W=1, comm=1)
    lowered = validate(lower(plan, costs))
    assert lowered.to_text() == ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B0 0B1\n"
                                 "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1\n")
    assert comm_batches(lowered.ranks[1])[:2] == [(0, 1), (1, 2)]
    assert simulate(plan, costs).makespan == 11
    order = simulate_order(lowered, costs)
    assert starts(order) == {"0F0": 0, "0F1": 1, "0B0": 7, "0B1": 9, "1F0": 2, "1F1": 3, "1B0": 4, "1B1": 6}
    assert order.makespan == 11


def test_a_send_goes_with_the_receive_posted_at_its_producer_s_end():
    """1F1B, p 4, m 8, comm 0.2. Rank 2 posts its receives of forwards 0 and 1 at the start (both leave rank 1
    before 2F0 ends), and after 2F0 its send with the receive of forward 2, one batch: the send moves at once,
    and 2F2 waits only for what it reads. Order costs what tag costs, 36.2 (the runtime that waited for a
    batch's receives before the next compute: 36.6 at best, 39.0 as lowered before that)."""
    costs = _costs("1f1b", 4, 0, comm=Fraction(1, 5))
    plan = build_plan("1f1b", 4, 8)
    lowered = validate(lower(plan, costs))
    rank = [str(a) for a in lowered.ranks[2]]
    assert rank[:6] == ["2RECV_F0", "2RECV_F1", "2F0", "2SEND_F0", "2RECV_F2", "2F1"]
    assert comm_batches(lowered.ranks[2])[:3] == [(0, 1), (1, 2), (3, 5)]
    assert simulate(plan, costs).makespan == simulate_order(lowered, costs).makespan == Fraction(181, 5)


def test_messages_with_two_peers_do_not_queue_behind_each_other():
    """interleaved-1f1b, p 3, m 4, comm 0.2 (chunks of half a forward): rank 0 receives forward 0 of stage 3 from
    rank 2 at 1.9 (2F0's end) and sends 0F3's output to rank 1 at 2.0. Each direction of each pair of ranks has
    its own communicator (comm/mesh.py), so the receive moves on its lane from rank 2 while the send waits on its
    lane to rank 1: order costs tag's 15.9. On one stream a rank (one communicator for the whole pipeline),
    the send queued behind the receive until 2.1, and the step cost 16.2. Posted in one run after 0F3, the
    receive starts only at 2.0: 16."""
    costs = _costs("interleaved-1f1b", 3, 0, comm=Fraction(1, 5))
    plan = SCHEDULES["interleaved-1f1b"].build(3, 4, None, costs)
    lowered = validate(lower(plan, costs))
    assert [str(a) for a in lowered.ranks[0][4:10]] == ["0F2", "0SEND_F2", "3RECV_F0", "0F3", "0SEND_F3", "3RECV_F1"]
    ranks = [list(r) for r in lowered.ranks]
    ranks[0].remove(Action.parse("3RECV_F0"))
    ranks[0].insert(ranks[0].index(Action.parse("0SEND_F3")) + 1, Action.parse("3RECV_F0"))
    together = validate(lowered.with_ranks(ranks))
    assert simulate(plan, costs).makespan == simulate_order(lowered, costs).makespan == Fraction(159, 10)
    assert simulate_order(together, costs).makespan == 16


def test_a_run_s_sends_after_its_last_receive_are_a_batch_of_their_own():
    actions = [Action.parse(t) for t in "1RECV_F0 1F0 1RECV_B0 1SEND_F0 1SEND_B1 1B0 1SEND_F2 1RECV_F3 1F3".split()]
    assert comm_batches(actions) == [(0, 1), (2, 3), (3, 5), (6, 8)]  # order matching: no compute waits for 3-4
    assert comm_batches(actions, eager_sends=True) == comm_runs(actions) == [(0, 1), (2, 5), (6, 8)]  # gloo: one post


def test_a_written_plan_whose_trailing_sends_cross_is_refused_saying_where_to_put_them():
    """Each rank receives first and then sends to the other in one run. Posted as one batch, each run would
    complete; but a run's trailing sends go behind its receives (NCCL), so each rank waits for a send the other
    posts only after its own receive. The plan is refused with a message that says what to change; with rank
    0's send first it runs."""
    crossing = ("0F0 0SEND_F0 0F1 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1\n"
                "1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1F1 1B1 1SEND_B1")
    with pytest.raises(ScheduleError, match="deadlock.*sends after its last receive are posted as a batch of their"):
        plan_of(crossing)  # a schedule file is validated as it is read
    fixed = crossing.replace("0RECV_B0 0SEND_F1", "0SEND_F1 0RECV_B0")
    assert simulate_order(validate(plan_of(fixed)), Costs.uniform(2)).makespan > 0


def test_a_send_behind_the_receives_makes_neither_end_wait(monkeypatch):
    """DualPipeV, p 4, m 8, unit costs. Rank 2 makes 5F4's output, then receives 2B0's gradient and computes 2B0;
    rank 1 needs that output only once its 6B2 ends, half a forward later. In the batch of that receive, 2B0
    would wait for rank 1; after 2B0, rank 1 would wait for 2B0. As a batch of its own behind the receive, it
    leaves when rank 1 is ready and no compute waits: order costs what tag costs (the lowering that put it
    after 2B0 cost 26). The receive is from rank 3 and the send to rank 1: on their own lanes they do not
    wait for each other even posted as one run (on one stream a rank, as one batch, the plan cost 27.5)."""
    import pipegpt.schedule.simulate as matching

    costs = _costs("dualpipev", 4, 0)
    plan = SCHEDULES["dualpipev"].build(4, 8, None, costs).flattened()  # its order, the pairs' halves apart
    lowered = validate(lower(plan, costs))
    rank = [str(a) for a in lowered.ranks[2]]
    at = rank.index("5F4")
    assert rank[at:at + 4] == ["5F4", "2RECV_B0", "5SEND_F4", "2B0"]
    assert (at + 2, at + 3) in comm_batches(lowered.ranks[2])
    assert simulate_order(lowered, costs).makespan == simulate(plan, costs).makespan == 25.5
    monkeypatch.setattr(matching, "comm_batches", comm_runs)
    assert simulate_order(lowered, costs).makespan == 25.5


def test_a_runs_plan_is_lowered_for_its_measured_costs():
    from pipegpt.config import ModelConfig, TrainConfig
    from pipegpt.planner.run_plan import lowering_costs, make_plan

    model = ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)
    cfg = TrainConfig.build(model, stages=2, microbatches=4, schedule="1f1b")
    assert lowering_costs(cfg, (0, 1)) is None and make_plan(cfg) == lower(build_plan("1f1b", 2, 4))
    # --balance cost measured a heavy embedding (forward + backward of embedding, block, head): B = 2F, W = F
    measured = cfg.replace(balance="cost", balanced_costs=(3.0, 0.3, 0.3), layers_per_stage=(1, 1))
    costs = lowering_costs(measured, (0, 1))
    assert costs.forward == pytest.approx((1.1, 0.2)) and costs.backward == pytest.approx((2.2, 0.4))
    plan = make_plan(measured)
    assert plan == lower(build_plan("1f1b", 2, 4), costs) != make_plan(cfg)
    # waited for by its reader, a receive placed for other costs costs nothing more here (it cost 13.2 < 13.4)
    assert simulate_order(plan, costs).makespan == simulate(plan, costs).makespan \
        == simulate_order(make_plan(cfg), costs).makespan == pytest.approx(13.2)
    # auto: the costs its order was written for, estimated from the model's shape until measured
    auto = cfg.replace(schedule="auto")
    assert make_plan(auto) == lower(make_plan(auto).compute_only(), lowering_costs(auto, (0, 1)))


# ---------------------------------------------------------------------------------------------------------
# the synthesizer written for order matching


def test_the_fast_simulator_times_what_order_matching_costs_where_receives_are_posted_early():
    """The hand-worked gpipe 2x2 above: 11 by tag, by the synthesizer's simulator and by order matching (a receive
    waited for by its reader no longer has a floor of its own, which the search once added)."""
    from pipegpt.schedule.synthesis.fast_simulate import evaluate
    from pipegpt.schedule.synthesis.list_scheduler import Problem

    plan, costs = build_plan("gpipe", 2, 2), Costs.uniform(2, F=1, B=2, W=1, comm=1)
    problem = Problem(plan.stage_to_rank, 2, costs)
    codes = problem.encode(plan)
    assert evaluate(problem, codes) == (11, 2) and simulate_order(lower(plan, costs), costs).makespan == 11


def test_auto_written_for_order_matching_is_timed_under_it():
    """auto, p 4, m 4, comm 0.2: written for tag it costs 16.8 under tag and under order (18.4 under order when the
    runtime waited for a batch's receives before the next compute, and zb-h1's 17 was the best then); written for
    order its makespan is order's. Without latency the objective changes nothing."""
    costs = Costs.uniform(4, F=1, B=2, W=1, comm=Fraction(1, 5))
    by_tag = SCHEDULES["auto"].synthesize(4, 4, None, costs)
    by_order = SCHEDULES["auto"].synthesize(4, 4, None, costs, matching="order")
    assert simulate(by_tag.plan, costs).makespan == Fraction(84, 5)
    assert simulate_order(lower(by_tag.plan, costs), costs).makespan == Fraction(84, 5)
    assert by_order.makespan == simulate_order(lower(by_order.plan, costs), costs).makespan == Fraction(84, 5)
    assert by_order.plan.meta["p2p_matching"] == "order" and "p2p_matching" not in by_tag.plan.meta
    free = Costs.uniform(4)
    assert SCHEDULES["auto"].synthesize(4, 4, None, free, matching="order") == \
        SCHEDULES["auto"].synthesize(4, 4, None, free)


def test_simulate_writes_auto_for_the_matching_it_is_asked_for():
    import json

    from pipegpt.observe.simulate_report import SimulateOptions, simulate_command

    def makespan(matching):
        out = []
        simulate_command(SimulateOptions(schedule="auto", stages=4, microbatches=4, as_json=True,
                                         costs_spec="F=1,B=2,W=1,comm=0.2", p2p_matching=matching),
                         lambda text, err=False: out.append(text), None)
        return json.loads(out[0])["makespan"]

    assert makespan("order") == pytest.approx(16.8) == makespan(None)
