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
they followed, so the passes commute.
"""
from __future__ import annotations

import heapq

from .actions import COLLECTIVE_KINDS, NO_MICROBATCH, REDUCE_GRAD, Action, Kind, Plan, PlanError, ScheduleError
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
    collectives = _collectives_by_anchor(plan)
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
    if collectives:
        lowered = [_put_back(acts, anchors) for acts, anchors in zip(lowered, collectives)]
    return plan.with_ranks(lowered)


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
    return {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)}


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
        microbatch  gathered before each run of the stage's consecutive compute actions, freed after it (the
                    least parameter memory where a rank holds several stages: interleaved and V schedules)

    A gather goes before the run of messages that precedes its compute (a run of messages is one batch and is
    never split), a free after the compute and the collectives right behind it (the stage's REDUCE_GRAD).
    A stage that already has its UNSHARD/RESHARD on its rank (a schedule file) keeps them where they stand.
    """
    if policy not in UNSHARD_POLICIES:
        raise ScheduleError(f"unshard policy {policy!r} is not one of {', '.join(UNSHARD_POLICIES)}")
    sharding_kinds = (Kind.UNSHARD, Kind.RESHARD)
    ranks = []
    for actions in plan.ranks:
        placed = {a.stage for a in actions if a.kind in sharding_kinds}
        groups = [g for g in _compute_runs(actions, by_stage=policy == "step") if g[0] not in placed]
        before, after = {}, {}
        for stage, first, last in groups:
            while first > 0 and actions[first - 1].kind.is_p2p:
                first -= 1
            while last + 1 < len(actions) and actions[last + 1].kind.is_collective:
                last += 1
            before.setdefault(first, []).append(Action(stage, Kind.UNSHARD, NO_MICROBATCH))
            after.setdefault(last, []).append(Action(stage, Kind.RESHARD, NO_MICROBATCH))
        out = []
        for i, a in enumerate(actions):
            out += before.get(i, []) + [a] + after.get(i, [])
        ranks.append(out)
    return plan.with_ranks(ranks)


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
