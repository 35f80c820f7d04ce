"""Channels between stages: which messages a plan needs and who is on the other end.

Shared by lowering (which inserts the messages), validation (which checks
them), the runtime and the simulator; it depends on the action types alone, so
none of those has to import another to get it.
"""
from __future__ import annotations

from .actions import Action, Kind, Plan


def sends_after(action: Action, plan: Plan) -> list[Action]:
    """The SEND a compute action's output needs when its consumer stage lives on another rank."""
    s, mb, owner = action.stage, action.microbatch, plan.stage_to_rank[action.stage]
    if action.kind is Kind.F and s + 1 < plan.num_stages and plan.stage_to_rank[s + 1] != owner:
        return [Action(s, Kind.SEND_F, mb)]
    if action.kind in (Kind.B, Kind.I) and s > 0 and plan.stage_to_rank[s - 1] != owner:
        return [Action(s, Kind.SEND_B, mb)]
    return []


def recvs_before(action: Action, plan: Plan) -> list[Action]:
    """The RECV a compute action needs when its input comes from a stage on another rank."""
    s, mb, owner = action.stage, action.microbatch, plan.stage_to_rank[action.stage]
    if action.kind is Kind.F and s > 0 and plan.stage_to_rank[s - 1] != owner:
        return [Action(s, Kind.RECV_F, mb)]
    if action.kind in (Kind.B, Kind.I) and s + 1 < plan.num_stages and plan.stage_to_rank[s + 1] != owner:
        return [Action(s, Kind.RECV_B, mb)]
    return []


def messages(plan: Plan) -> list[set[Action]]:
    """Per rank, the SEND and RECV actions a lowered plan must contain."""
    wanted: list[set[Action]] = [set() for _ in range(plan.num_ranks)]
    for r, actions in enumerate(plan.ranks):
        for a in actions:
            if a.kind.is_compute:
                wanted[r].update(recvs_before(a, plan) + sends_after(a, plan))
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
