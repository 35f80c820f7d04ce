"""Lowering: put the point-to-point messages into a compute plan.

A stage's forward output goes to the next stage and its input gradient to the
previous one; when the two stages live on different ranks, that is a message:
a SEND on the producer's rank after the compute and a RECV on the consumer's
rank before the compute that needs it. Stage numbers in comm actions name the stage doing the
sending or receiving: 1SEND_F3 (stage 1 sends mb 3 forward) pairs with
2RECV_F3, and 2SEND_B3 pairs with 1RECV_B3.

The runtime posts each run of consecutive comm actions as one batch
(batch_isend_irecv style); validate.check_deadlock_free checks that, with
blocking semantics, the order cannot deadlock.

Collectives are inserted by passes of their own: add_reduce_grad puts a
stage's data-parallel gradient reduction (1REDUCE_GRAD) right after the action
that completes its gradients; add_unshard_reshard puts ZeRO-3's parameter
gathers and frees (1UNSHARD, 1RESHARD) around a stage's compute by a policy.
lower() keeps a plan's collectives where they stand, after the compute action
they followed, so the passes commute. A composite pair stays whole: its parts'
receives go before it, their sends after it.
"""
from __future__ import annotations

import bisect
import heapq

from .actions import (COLLECTIVE_KINDS, NO_MICROBATCH, REDUCE_GRAD, Action, Kind, Plan, PlanError, ScheduleError,
                      parts_of)
from .messages import peer, recvs_before, sends_after
from .timing_rule import hop
from .validate import dependencies


# Costs when none are given: one unit per forward, two per full backward, every stage alike.
_UNIT_COST = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}


def _unit_duration(action) -> int:
    return sum(_UNIT_COST[part.kind] for part in parts_of(action))


def lower(plan: Plan, costs=None) -> Plan:
    """Return the plan with SEND/RECV actions inserted, deadlock-free by construction.

    The plan is run once with rendezvous messages, at `costs` (anything with a duration(action), such as
    simulate.Costs; unit costs when None): an output waits in its producer's outbox until its consumer's
    rank takes it, when it needs it or earlier when it is at a boundary anyway (its receive then costs no
    wait); the RECV goes where the consumer's rank stands, and the SEND as early on the producer's rank as
    that rank's own messages allow. That run is itself the proof that blocking point-to-point cannot
    deadlock: every rank's comm actions meet their partners in the order of their places, so every pair
    of ranks sees its messages in the same order at both ends (NCCL matches point-to-point by order).

    Where the SEND goes matters under order matching (NCCL), where a send leaves at its SEND and a rank's batches on
    one lane (a peer and a direction) run one after another (schedule/simulate.py, simulate_order): one put where
    the consumer asked for it, after whatever its rank was computing then, makes the consumer wait for that compute.
    So it goes just after the compute that made it, unless the rank has sent or received since: then into that batch
    if it holds sends alone (or was posted at this moment), else after the compute that follows it, so that no
    compute waiting for a receive is held behind a send its receiver takes only later. A rank posting receives with
    outputs still unsent puts each behind those receives, a batch of sends that no compute waits for
    (messages.comm_batches), where its receiver reaches a boundary before this rank's next batch would start:
    neither end waits. Otherwise it weighs its consumer's wait (the costs' timeline says when it needs it) against
    its own (its receiver is busy until its next boundary) and takes the shorter.

    With a message latency (costs.comm), messages go where the timeline of messages matched by tag moves them
    (_placed_on_the_timeline): a receive is posted as its message leaves, often computes before its reader,
    which alone waits for it (the runtime waits for a receive at the compute that reads it).
    """
    duration = _unit_duration if costs is None else costs.duration
    comm = 0 if costs is None else getattr(costs, "comm", 0)
    collectives = _collectives_by_anchor(plan)
    plan = plan.compute_only()
    if comm:
        lowered = _placed_on_the_timeline(plan, duration, comm)
        if collectives:
            lowered = [_put_back(acts, anchors) for acts, anchors in zip(lowered, collectives)]
        return plan.with_ranks(lowered)
    needed_at, latest = _eager_window(plan, duration, 0)
    num_ranks = plan.num_ranks
    lowered: list[list[Action]] = [[] for _ in range(num_ranks)]
    pos = [0] * num_ranks
    outbox: list[dict[Action, int]] = [{} for _ in range(num_ranks)]  # produced, unsent: index after producer
    inbound: list[dict[Action, int]] = [{} for _ in range(num_ranks)]  # the same by receiver: its sender
    waiting: list[Action | None] = [None] * num_ranks  # the RECV a blocked rank needs
    running: list[int | None] = [None] * num_ranks  # index of the compute a rank is in
    started, busy_until = [0] * num_ranks, [0] * num_ranks  # the compute a rank is in
    events = [(0, r) for r in range(num_ranks)]  # (time, rank): the rank reaches a boundary
    received: list[set[Action]] = [set() for _ in range(num_ranks)]
    comm_end = [0] * num_ranks  # index just after the rank's last comm action
    comm_receives: list = [None] * num_ranks  # when that batch's last receive is taken (None: it has none)

    def send_place(r: int, produced: int, now) -> int | None:
        """Where rank r's SEND of an output made just before index `produced` goes now; None: not yet
        (that place is beyond the compute the rank is in)."""
        at = comm_end[r]
        if produced >= at:
            at = produced
        elif not (comm_receives[r] is None or comm_receives[r] == now or at == len(lowered[r])):
            at += 1  # after the compute that follows a batch with older receives
        return at if running[r] is None or at <= running[r] else None

    def match(sender: int, send: Action, at: int, receiver: int, recv: Action, when, recv_at=None) -> None:
        """The SEND at index `at` of the sender, the RECV at the receiver's index `recv_at` (None: its end),
        taken at `when`."""
        del outbox[sender][send], inbound[receiver][send]
        joins = at > 0 and lowered[sender][at - 1].kind.is_p2p  # the sender's last batch
        _insert(sender, at, send)
        comm_end[sender], comm_receives[sender] = at + 1, comm_receives[sender] if joins else None
        recv_at = len(lowered[receiver]) if recv_at is None else recv_at
        _insert(receiver, recv_at, recv)
        received[receiver].add(recv)
        comm_end[receiver], comm_receives[receiver] = recv_at + 1, when
        if waiting[receiver] == recv:
            waiting[receiver] = None
            heapq.heappush(events, (when, receiver))

    def _insert(r: int, at: int, action: Action) -> None:
        lowered[r].insert(at, action)
        for other, place in outbox[r].items():  # outputs made after it moved one place on
            if place > at:
                outbox[r][other] = place + 1
        if running[r] is not None and running[r] >= at:
            running[r] += 1

    def offer(r: int, now) -> None:
        """Rank r's unsent outputs to receivers that take them now at no cost: the one waiting for it, one
        blocked on another, one that started a compute at this very moment (its receive goes before it)."""
        for send in list(outbox[r]):
            dst, recv = peer(send, plan)
            if running[dst] is None:
                if waiting[dst] is not None:
                    match(r, send, send_place(r, outbox[r][send], now), dst, recv, now)
            elif started[dst] == now:
                match(r, send, send_place(r, outbox[r][send], now), dst, recv, now, running[dst])

    def take_ready(r: int, now) -> None:
        """Rank r, at a boundary, receives every output already made for it whose SEND can be placed."""
        for send, src in list(inbound[r].items()):
            at = send_place(src, outbox[src][send], now)
            if at is not None:
                match(src, send, at, r, peer(send, plan)[1], now)

    def hand_over(r: int, now):
        """Rank r has just posted receives at `now`: its outputs still unsent would go after its next compute.
        Each goes with this batch instead where waiting for its receiver's next boundary (which takes it
        there) makes the step longer than the consumer's wait would by less (the eager timeline's latest
        starts say by how much), or as much but is the shorter wait; returns when r may go on."""
        go_on = now
        following = plan.ranks[r][pos[r]] if pos[r] < len(plan.ranks[r]) else None
        after = now + (duration(following) if following is not None else 0)
        for send in list(outbox[r]):
            dst, recv = peer(send, plan)
            if running[dst] is None:
                continue
            consumer, then = _consumer(recv, plan), busy_until[dst]
            if then <= after:  # a batch of its own behind the receives: no compute waits for it
                match(r, send, comm_end[r], dst, recv, then)
                continue
            # Each side: how much later than its latest start it goes (the step that much longer), then its wait.
            wait = (max(0, then - latest[following]) if following is not None else 0, then - now)
            starved_for = max(0, after - max(needed_at[consumer], then))
            starved = (max(0, after - latest[consumer]), starved_for)
            if wait < starved:
                match(r, send, comm_end[r], dst, recv, then)
                go_on = max(go_on, then)
        return go_on

    while events:
        now, r = heapq.heappop(events)
        if running[r] is not None:
            for send in sends_after(lowered[r][running[r]], plan):
                outbox[r][send] = running[r] + 1
                inbound[peer(send, plan)[0]][send] = r
            running[r] = None
        offer(r, now)
        if pos[r] == len(plan.ranks[r]) or waiting[r] is not None:
            continue
        action = plan.ranks[r][pos[r]]
        needs = [a for a in recvs_before(action, plan) if a not in received[r]]
        for need in needs:  # one, or a composite pair's two
            src, send = peer(need, plan)
            at = send_place(src, outbox[src][send], now) if send in outbox[src] else None
            if at is None:
                waiting[r] = need
                break
            match(src, send, at, r, need, now)
        take_ready(r, now)
        if waiting[r] is not None:
            continue
        go_on = hand_over(r, now) if comm_receives[r] == now and comm_end[r] == len(lowered[r]) else now
        if go_on > now:
            heapq.heappush(events, (go_on, r))
            continue
        lowered[r].append(action)
        pos[r] += 1
        running[r] = len(lowered[r]) - 1
        started[r], busy_until[r] = now, now + duration(action)
        heapq.heappush(events, (busy_until[r], r))

    stuck = [r for r in range(num_ranks) if pos[r] < len(plan.ranks[r]) or outbox[r]]
    if stuck:
        r = stuck[0]
        raise PlanError(plan, r, pos[r], f"cannot be lowered: waits for {waiting[r]}")
    if collectives:
        lowered = [_put_back(acts, anchors) for acts, anchors in zip(lowered, collectives)]
    return plan.with_ranks(lowered)


def _placed_on_the_timeline(plan: Plan, duration, comm) -> list[list[Action]]:
    """Each rank's compute actions with their messages placed where the timeline of messages matched by tag
    (_eager_window) moves them: a message moves at its producer's end, t. Its SEND goes right after the
    producer; its RECV at the consumer's last boundary at or before t (after its computes that end by t), so
    that, with the runtime waiting for a receive only at the compute that reads it, the receive is posted
    when the message is sent and neither end holds it back. At a boundary, messages go in order of (t, the
    sending stage, microbatch, direction): every rank posts its messages in that one order, so each pair of
    ranks sees them in the same order at both ends, and a rank's batches, which run one after another
    under order matching, never wait for one another in a cycle."""
    starts, _ = _eager_window(plan, duration, comm)
    ends, position = {}, {}
    rank_ends = []
    for actions in plan.ranks:
        mine = []
        for k, action in enumerate(actions):
            end = starts[action] + duration(action)
            mine.append(end)
            for name in _names(action):
                ends[name], position[name] = end, k
        rank_ends.append(mine)
    placed: list[dict[int, list]] = [{} for _ in plan.ranks]  # per rank: boundary -> [(order key, comm action)]
    for r, actions in enumerate(plan.ranks):
        for k, action in enumerate(actions):
            t = ends[action]
            # Times that are equal but for float rounding count as equal: a tie is broken by the message alone.
            near = round(t, 9)
            for send in sends_after(action, plan):
                dst, recv = peer(send, plan)
                key = (near, send.stage, send.microbatch, send.kind is Kind.SEND_B)
                placed[r].setdefault(k + 1, []).append((key, send))
                at = min(bisect.bisect_right(rank_ends[dst], t + 1e-9 * (1 + abs(t))),
                         position[_consumer(recv, plan)])
                placed[dst].setdefault(at, []).append((key, recv))
    lowered = []
    for r, actions in enumerate(plan.ranks):
        out = []
        for k in range(len(actions) + 1):
            out += [a for _, a in sorted(placed[r].get(k, ()), key=lambda item: item[0])]
            if k < len(actions):
                out.append(actions[k])
        lowered.append(out)
    return lowered


def _consumer(recv: Action, plan: Plan) -> Action:
    """The compute action a RECV feeds."""
    if recv.kind is Kind.RECV_F:
        return Action(recv.stage, Kind.F, recv.microbatch)
    return plan.backward_of(recv.stage, recv.microbatch)


def _eager_window(plan: Plan, duration, comm) -> tuple[dict[Action, float], dict[Action, float]]:
    """When each compute action of a plan without messages starts if every message leaves as soon as it is
    made (simulate()'s timeline, by the same timing rule: lowering cannot import simulate, which imports
    lowering), and the latest it may start without making the step longer."""
    rank_of, starts, ends, order = plan.stage_to_rank, {}, {}, []
    pos, free, todo = [0] * plan.num_ranks, [0] * plan.num_ranks, list(range(plan.num_ranks))
    waiters: dict[Action, list[int]] = {}
    later: dict[Action, list[tuple[Action, float]]] = {}  # action -> (what needs it, the gap between)
    while todo:
        r = todo.pop()
        actions = plan.ranks[r]
        while pos[r] < len(actions):
            action = actions[pos[r]]
            deps = dependencies(action, plan)
            missing = next((d for d in deps if d not in ends), None)
            if missing is not None:
                waiters.setdefault(missing, []).append(r)
                break
            gaps = [(d, hop(comm, rank_of[d.stage], r)) for d in deps]
            if pos[r]:
                gaps.append((actions[pos[r] - 1], 0))
            for d, gap in gaps:
                later.setdefault(d, []).append((action, gap))
            starts[action] = max([free[r]] + [ends[d] + gap for d, gap in gaps])
            ends[action] = free[r] = starts[action] + duration(action)
            order.append(action)
            pos[r] += 1
            for part in parts_of(action):  # a composite's parts: its outputs, there at its end
                starts[part], ends[part] = starts[action], ends[action]
                todo.extend(waiters.pop(part, ()))
    span, latest = max(ends.values(), default=0), {}
    for action in reversed(order):
        names = _names(action)
        finish = min([span] + [latest[n] - gap for name in names for n, gap in later.get(name, ())])
        for name in names:
            latest[name] = finish - duration(action)
    return starts, latest


def _names(action) -> tuple:
    """What a compute action is known by: itself, and a composite its parts too."""
    return (action,) if action.kind is not Kind.OVERLAP else (action,) + action.parts


def _collectives_by_anchor(plan: Plan) -> list[dict[Action | None, list[Action]]] | None:
    """Per rank, {the compute action a run of collectives follows (None: the rank's start): that run};
    None when the plan has no collectives."""
    if not any(a.kind in COLLECTIVE_KINDS for acts in plan.ranks for a in acts):
        return None
    out = []
    for actions in plan.ranks:
        anchors: dict[Action | None, list[Action]] = {}
        anchor = None
        for a in actions:
            if a.kind in COLLECTIVE_KINDS:
                anchors.setdefault(anchor, []).append(a)
            elif a.kind.is_compute:
                anchor = a
        out.append(anchors)
    return out


def _put_back(actions: list[Action], anchors: dict[Action | None, list[Action]]) -> list[Action]:
    out = list(anchors.get(None, ()))
    for a in actions:
        out.append(a)
        out.extend(anchors.get(a, ()))
    return out


def last_gradient_actions(actions) -> dict[int, int]:
    """Per stage, the index of the action after which its weight gradients are complete (last B or W)."""
    return {p.stage: i for i, a in enumerate(actions) for p in parts_of(a) if p.kind in (Kind.B, Kind.W)}


def add_reduce_grad(plan: Plan) -> Plan:
    """Insert each stage's REDUCE_GRAD right after its last B or W, on every rank: the reduction of its
    gradients over the data-parallel replicas starts there and overlaps the compute that follows.

    A stage that already has its REDUCE_GRAD keeps it where it stands (a schedule file may place it later),
    so the pass is idempotent. Which parameters a stage's reduction carries is the worker's business: one
    shared by two stages of a rank (the V-shape's tied embedding) goes with the stage finishing last, whose
    REDUCE_GRAD then follows both stages' gradients. A forward-only plan gets none.
    """
    ranks, added = [], False
    for actions in plan.ranks:
        done = {a.stage for a in actions if a.kind is Kind.REDUCE_GRAD}
        after = {i: s for s, i in last_gradient_actions(actions).items() if s not in done}
        if after:
            added, actions = True, _with_reductions(actions, after)
        ranks.append(actions)
    return plan.with_ranks(ranks) if added else plan


def _with_reductions(actions, after: dict[int, int]) -> list[Action]:
    out = []
    for i, a in enumerate(actions):
        out.append(a)
        if i in after:
            out.append(REDUCE_GRAD(after[i]))
    return out


def without_reduce_grad(plan: Plan) -> Plan:
    """The plan with no REDUCE_GRAD: what runs with one replica, where there is nothing to reduce."""
    if not any(a.kind is Kind.REDUCE_GRAD for acts in plan.ranks for a in acts):
        return plan
    return plan.with_ranks([[a for a in acts if a.kind is not Kind.REDUCE_GRAD] for acts in plan.ranks])


UNSHARD_POLICIES = ("step", "microbatch")


def add_unshard_reshard(plan: Plan, policy: str = "step") -> Plan:
    """Insert ZeRO-3's parameter gathers (UNSHARD) and frees (RESHARD) into a lowered plan, per rank and stage:

        step        gathered before the stage's first compute action of the step, freed after its last
                    (torchtitan's default under pipeline parallelism: microbatches do not gather again)
        microbatch  gathered around each run of the stage's consecutive compute actions, the gather prefetched:
                    posted before the run before it (its compute overlaps the gather), freed after its run; a
                    stage freed and gathered again with no compute between stays gathered. A rank then holds
                    two stages gathered at most (the least parameter memory where it holds three or more)

    A gather goes before the run of messages that precedes a compute (a run of messages is one batch and is
    never split), a free after the compute and the collectives right behind it (the stage's REDUCE_GRAD).
    A stage that already has its UNSHARD/RESHARD on its rank (a schedule file) keeps them where they stand.
    """
    if policy not in UNSHARD_POLICIES:
        raise ScheduleError(f"unshard policy {policy!r} is not one of {', '.join(UNSHARD_POLICIES)}")
    sharding_kinds = (Kind.UNSHARD, Kind.RESHARD)
    ranks = []
    for actions in plan.ranks:
        placed = {a.stage for a in actions if a.kind in sharding_kinds}
        spans = []  # (stage, where its gather goes, where its free goes) per run
        for stage, first, last in _compute_runs(actions, by_stage=policy == "step"):
            while first > 0 and actions[first - 1].kind.is_p2p:
                first -= 1
            while last + 1 < len(actions) and actions[last + 1].kind.is_collective:
                last += 1
            spans.append([stage, first, last])
        if policy == "microbatch":
            spans = _prefetched(spans, actions)
        before, after = {}, {}
        for stage, gather, free in spans:
            if stage in placed:
                continue
            if gather is not None:
                before.setdefault(gather, []).append(Action(stage, Kind.UNSHARD, NO_MICROBATCH))
            if free is not None:
                after.setdefault(free, []).append(Action(stage, Kind.RESHARD, NO_MICROBATCH))
        out = []
        for i, a in enumerate(actions):
            out += before.get(i, []) + [a] + after.get(i, [])
        ranks.append(out)
    return plan.with_ranks(ranks)


def _prefetched(spans: list[list], actions) -> list[list]:
    """Each run's gather moved to where the run before it gathers (the rank's first two runs gather at its start);
    a free followed by the same stage's gather with no compute between: neither (None)."""
    starts = [gather for _, gather, _ in spans]
    last_of: dict[int, list] = {}  # stage -> its latest span
    for k, span in enumerate(spans):
        span[1] = starts[max(k - 1, 0)]
        earlier = last_of.get(span[0])
        if earlier is not None and not any(a.kind.is_compute for a in actions[earlier[2] + 1:span[1]]):
            earlier[2] = span[1] = None
        last_of[span[0]] = span
    return spans


def _compute_runs(actions, by_stage: bool) -> list[tuple[int, int, int]]:
    """(stage, index of its first compute action, index of its last) per run of a stage's consecutive compute
    actions (messages and collectives between them do not break a run), or with by_stage one per stage."""
    runs: list[list[int]] = []
    for i, a in enumerate(actions):
        if not a.kind.is_compute:
            continue
        if runs and actions[runs[-1][1]].stage == a.stage:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    if by_stage:
        spans: dict[int, list[int]] = {}
        for first, last in runs:
            s = actions[first].stage
            spans[s] = [spans[s][0], last] if s in spans else [first, last]
        return sorted(((s, f, l) for s, (f, l) in spans.items()), key=lambda g: g[1])
    return [(actions[first].stage, first, last) for first, last in runs]


def without_unshard_reshard(plan: Plan) -> Plan:
    """The plan with no UNSHARD/RESHARD: what runs when parameters are not sharded (--zero below 3)."""
    kinds = (Kind.UNSHARD, Kind.RESHARD)
    if not any(a.kind in kinds for acts in plan.ranks for a in acts):
        return plan
    return plan.with_ranks([[a for a in acts if a.kind not in kinds] for acts in plan.ranks])
