"""When a sent message's buffer may go (pipegpt.schedule.messages.release_points) and how many message
buffers a rank then holds (message_peaks, which the planner's memory model counts).

A release point must be safe in every real run, whatever the timing: each lowered plan is executed
here under many random interleavings of its ranks, with the runtime's semantics (a batch posts its
sends and receives, a compute waits for the receives it reads; eager sends are posted right after the compute
that made them),
and every release must come after the receiver waited for the message.
"""
from __future__ import annotations

import random

import pytest

from pipegpt.config import ModelConfig
from pipegpt.schedule import SCHEDULES, Kind, ScheduleError, build_plan, lower
from pipegpt.schedule.messages import comm_batches, message_peaks, peer, receive_waits, release_points, sends_after
from pipegpt.schedule.simulate import assumed_latency, lowered

SENDS = (Kind.SEND_F, Kind.SEND_B)


def _plans():
    for schedule in SCHEDULES:
        for p in (2, 4):
            for m in (1, p, 2 * p + 1, 3 * p):
                try:
                    yield f"{schedule}-p{p}-m{m}", lower(build_plan(schedule, p, m))
                except ScheduleError:
                    continue


PLANS = dict(_plans())


def run_randomly(plan, eager: bool, releases, rng: random.Random) -> None:
    """One run of the plan in a random interleaving; fails where a send is released before it arrived."""
    n = plan.num_ranks
    batches = [dict(comm_batches(actions, eager)) for actions in plan.ranks]
    waits = [receive_waits(actions) for actions in plan.ranks]
    pos = [0] * n
    posted, arrived, released = set(), set(), set()
    while True:
        ready = []
        for r, actions in enumerate(plan.ranks):
            i = pos[r]
            if i == len(actions):
                continue
            if i in waits[r] and not all(peer(actions[k], plan)[1] in posted for k in waits[r][i]):
                continue  # a compute waits for the receives it reads
            ready.append(r)
        if not ready:
            break
        r = rng.choice(ready)
        actions, i = plan.ranks[r], pos[r]
        if i in batches[r]:  # a batch posts its sends (its receives are waited for by their computes)
            if not eager:
                posted.update(a for a in actions[i:batches[r][i]] if a.kind in SENDS)
            pos[r] = batches[r][i]
            continue
        arrived.update(peer(actions[k], plan)[1] for k in waits[r].get(i, ()))
        for send in releases[r].get(i, ()):
            assert send in arrived, f"rank {r} releases {send} at {actions[i]} before its receiver has it"
            assert send not in released and send in plan.ranks[r][:i]
            released.add(send)
        if eager:
            posted.update(sends_after(actions[i], plan))
        pos[r] += 1
    assert all(pos[r] == len(actions) for r, actions in enumerate(plan.ranks)), "the run did not finish"


@pytest.mark.parametrize("eager", [False, True], ids=["order", "tag"])
@pytest.mark.parametrize("name", PLANS)
def test_a_send_is_released_only_after_its_receiver_has_it(name, eager):
    plan = PLANS[name]
    releases = release_points(plan, eager_sends=eager)
    rng = random.Random(name)
    for _ in range(20):
        run_randomly(plan, eager, releases, rng)


def test_1f1b_releases_each_forward_when_its_backward_comes_back():
    plan = lower(build_plan("1f1b", 2, 4))
    releases = release_points(plan)[0]
    by_compute = {str(plan.ranks[0][i]): [str(a) for a in sends] for i, sends in releases.items()}
    # Rank 1 waits for forward 1 only at 1F1, after it sent gradient 0 back: each backward's gradient, waited for
    # at that backward, frees the forward of its microbatch.
    assert by_compute == {f"0B{mb}": [f"0SEND_F{mb}"] for mb in range(4)}


@pytest.mark.parametrize("eager", [False, True], ids=["order", "tag"])
def test_1f1b_holds_as_many_messages_whatever_m_and_gpipe_all_of_them(eager):
    flat = {m: message_peaks(lower(build_plan("1f1b", 4, m)), eager) for m in (4, 8, 16, 64)}
    assert len({tuple(v) for v in flat.values()}) == 1 and max(flat[4]) <= 4 + 1, flat
    for m in (4, 8, 16, 64):
        assert min(message_peaks(lower(build_plan("gpipe", 4, m)), eager)) >= m


def test_the_memory_model_counts_the_messages_the_runtime_holds():
    from pipegpt.costs.memory import plan_memory

    model = ModelConfig(vocab_size=256, seq_len=64, n_layer=8, n_head=4, n_embd=128)
    message = 2 * 64 * 128 * 4  # microbatch_size x seq_len x n_embd, fp32
    for m in (8, 32):
        plan = build_plan("1f1b", 4, m)  # compute only, as the planner has it: lowered as a CUDA run lowers it
        rows = plan_memory(model, plan, [2, 2, 2, 2], microbatch_size=2)
        run_plan = lowered(plan, assumed_latency(plan.stage_to_rank))
        assert [r.p2p_buffers for r in rows] == [n * message for n in message_peaks(run_plan)]
    assert [r.p2p_buffers // message for r in rows] == [5, 5, 5, 3]  # rank 2 posts a receive as its message leaves
