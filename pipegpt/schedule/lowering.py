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

from .actions import Action, Kind, Plan, PlanError
from .messages import peer, recvs_before, sends_after


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
            outbox[r] += sends_after(running[r], plan)
            running[r] = None
        for send in list(outbox[r]):  # hand outputs to consumers already waiting for them
            dst, recv = peer(send, plan)
            if waiting[dst] == recv:
                match(r, send, dst, recv, now)
        if pos[r] == len(plan.ranks[r]):
            idle[r] = True
            continue
        action = plan.ranks[r][pos[r]]
        needs = [a for a in recvs_before(action, plan) if a not in received[r]]
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
        r = stuck[0]
        raise PlanError(plan, r, pos[r], f"cannot be lowered: waits for {waiting[r]}")
    return plan.with_ranks(lowered)

