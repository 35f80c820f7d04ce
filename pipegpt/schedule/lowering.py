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
"""
from __future__ import annotations

import heapq

from .actions import Action, Kind, Plan


def _sends_after(action: Action, plan: Plan) -> list[Action]:
    s, mb, owner = action.stage, action.microbatch, plan.stage_to_rank[action.stage]
    if action.kind is Kind.F and s + 1 < plan.num_stages and plan.stage_to_rank[s + 1] != owner:
        return [Action(s, Kind.SEND_F, mb)]
    if action.kind in (Kind.B, Kind.I) and s > 0 and plan.stage_to_rank[s - 1] != owner:
        return [Action(s, Kind.SEND_B, mb)]
    return []


def _recvs_before(action: Action, plan: Plan) -> list[Action]:
    s, mb, owner = action.stage, action.microbatch, plan.stage_to_rank[action.stage]
    if action.kind is Kind.F and s > 0 and plan.stage_to_rank[s - 1] != owner:
        return [Action(s, Kind.RECV_F, mb)]
    if action.kind in (Kind.B, Kind.I) and s + 1 < plan.num_stages and plan.stage_to_rank[s + 1] != owner:
        return [Action(s, Kind.RECV_B, mb)]
    return []


# Unit costs used only to pick where messages meet; any valid costs give a valid order.
_LOWERING_COST = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}


def lower(plan: Plan) -> Plan:
    """Return the plan with SEND/RECV actions inserted, deadlock-free by construction.

    The plan is run once at unit cost with rendezvous messages: a finished
    output waits in its producer's outbox until the consumer needs it, and the
    SEND and its RECV are appended to both ranks at the moment they meet. That
    run is itself the proof that blocking point-to-point cannot deadlock, and
    every pair of ranks sees its messages in the same order at both ends (NCCL
    matches point-to-point by order).
    """
    plan = plan.compute_only()
    num_ranks = plan.num_ranks
    lowered: list[list[Action]] = [[] for _ in range(num_ranks)]
    pos = [0] * num_ranks
    outbox: list[list[Action]] = [[] for _ in range(num_ranks)]  # produced SENDs not yet matched
    waiting: list[Action | None] = [None] * num_ranks  # the RECV a blocked rank needs
    running: list[Action | None] = [None] * num_ranks
    events = [(0, r) for r in range(num_ranks)]  # (time, rank): the rank reaches a boundary
    idle = [False] * num_ranks
    received: list[set[Action]] = [set() for _ in range(num_ranks)]

    def match(sender: int, send: Action, receiver: int, recv: Action, now: int) -> None:
        outbox[sender].remove(send)
        lowered[sender].append(send)
        lowered[receiver].append(recv)
        received[receiver].add(recv)
        waiting[receiver] = None
        idle[receiver] = False
        heapq.heappush(events, (now, receiver))

    while events:
        now, r = heapq.heappop(events)
        if running[r] is not None:
            outbox[r] += _sends_after(running[r], plan)
            running[r] = None
        for send in list(outbox[r]):  # hand outputs to consumers already waiting for them
            dst, recv = peer(send, plan)
            if waiting[dst] == recv:
                match(r, send, dst, recv, now)
        if pos[r] == len(plan.ranks[r]):
            idle[r] = True
            continue
        action = plan.ranks[r][pos[r]]
        needs = [a for a in _recvs_before(action, plan) if a not in received[r]]
        if needs:
            src, send = peer(needs[0], plan)
            if send in outbox[src] and idle[src]:
                match(src, send, r, needs[0], now)
            else:
                waiting[r], idle[r] = needs[0], True
            continue
        lowered[r].append(action)
        pos[r] += 1
        running[r] = action
        heapq.heappush(events, (now + _LOWERING_COST[action.kind], r))

    stuck = [r for r in range(num_ranks) if pos[r] < len(plan.ranks[r]) or outbox[r]]
    if stuck:
        from .validate import PlanError  # only reached for plans that fail validation anyway

        r = stuck[0]
        raise PlanError(plan, r, pos[r], f"cannot be lowered: waits for {waiting[r]}")
    return plan.with_ranks(lowered)


def messages(plan: Plan) -> list[set[Action]]:
    """Per rank, the SEND and RECV actions a lowered plan must contain."""
    wanted: list[set[Action]] = [set() for _ in range(plan.num_ranks)]
    for r, actions in enumerate(plan.ranks):
        for a in actions:
            if a.kind.is_compute:
                wanted[r].update(_recvs_before(a, plan) + _sends_after(a, plan))
    return wanted


def peer(action: Action, plan: Plan) -> tuple[int, Action]:
    """The rank on the other end of a comm action, and the action it runs there."""
    kind = action.kind
    if kind is Kind.SEND_F:
        partner = Action(action.stage + 1, Kind.RECV_F, action.microbatch)
    elif kind is Kind.RECV_F:
        partner = Action(action.stage - 1, Kind.SEND_F, action.microbatch)
    elif kind is Kind.SEND_B:
        partner = Action(action.stage - 1, Kind.RECV_B, action.microbatch)
    else:
        partner = Action(action.stage + 1, Kind.SEND_B, action.microbatch)
    return plan.stage_to_rank[partner.stage], partner


def comm_batches(actions) -> list[tuple[int, int]]:
    """Index ranges [start, end) of each maximal run of comm actions in a rank's list."""
    batches, start = [], None
    for i, a in enumerate(list(actions) + [None]):
        is_comm = a is not None and a.kind.is_comm
        if is_comm and start is None:
            start = i
        elif not is_comm and start is not None:
            batches.append((start, i))
            start = None
    return batches
