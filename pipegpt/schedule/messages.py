"""Channels between stages: which messages a plan needs, who is on the other end, and when a
sent message's buffer may go.

Shared by lowering (which inserts the messages), validation (which checks
them), the runtime, the simulator and the memory model; it depends on the action
types alone, so none of those has to import another to get it.
"""
from __future__ import annotations

from .actions import P2P_KINDS, Action, Kind, Plan, flattened, parts_of


def sends_after(action: Action, plan: Plan) -> list[Action]:
    """The SEND a compute action's output needs when its consumer stage lives on another rank (a composite:
    its parts', in order)."""
    if action.kind is Kind.OVERLAP:
        return [send for part in action.parts for send in sends_after(part, plan)]
    s, mb, owner = action.stage, action.microbatch, plan.stage_to_rank[action.stage]
    if action.kind is Kind.F and s + 1 < plan.num_stages and plan.stage_to_rank[s + 1] != owner:
        return [Action(s, Kind.SEND_F, mb)]
    if action.kind in (Kind.B, Kind.I) and s > 0 and plan.stage_to_rank[s - 1] != owner:
        return [Action(s, Kind.SEND_B, mb)]
    return []


def recvs_before(action: Action, plan: Plan) -> list[Action]:
    """The RECV a compute action needs when its input comes from a stage on another rank (a composite: its
    parts', in order)."""
    if action.kind is Kind.OVERLAP:
        return [recv for part in action.parts for recv in recvs_before(part, plan)]
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


def comm_runs(actions) -> list[tuple[int, int]]:
    """Index ranges [start, end) of each maximal run of point-to-point actions in a rank's list (a collective,
    like a compute action, ends a run)."""
    runs, start = [], None
    for i, a in enumerate(list(actions) + [None]):
        is_p2p = a is not None and a.kind in P2P_KINDS
        if is_p2p and start is None:
            start = i
        elif not is_p2p and start is not None:
            runs.append((start, i))
            start = None
    return runs


def comm_batches(actions, eager_sends: bool = False) -> list[tuple[int, int]]:
    """Index ranges [start, end) of what the runtime posts as one batch. With messages matched by order (NCCL) a
    run's sends after its last receive are a batch of their own, posted right behind it: a batch completes as
    one, and the compute after a run waits for its receives, not for sends whose receivers take them later
    (lowering puts a send there so that neither end waits). With eager sends (tag matching, gloo) a run is one
    batch: its receives and the sends that sit there go in one exchange."""
    runs = comm_runs(actions)
    if eager_sends:
        return runs
    batches = []
    for start, end in runs:
        last_receive = max((i for i in range(start, end) if actions[i].kind in _RECVS), default=None)
        if last_receive is None or last_receive == end - 1:
            batches.append((start, end))
        else:
            batches += [(start, last_receive + 1), (last_receive + 1, end)]
    return batches


_SENDS, _RECVS = (Kind.SEND_F, Kind.SEND_B), (Kind.RECV_F, Kind.RECV_B)


def release_points(plan: Plan, eager_sends: bool = False) -> list[dict[int, tuple[Action, ...]]]:
    """Per rank of a lowered plan: {first index of a comm batch: the SENDs whose buffers may be released
    once that batch's receives are waited for}. A SEND in no entry is released at the end of the step.

    A send's buffer may go once its receiver has it. A rank knows that when it receives a message that the
    receiver posted after waiting for it, directly or through other ranks (happens-before along the plan's
    messages, tracked with vector clocks). The runtime waits for a receive before the next compute, so a
    message carries what its sender had waited for when it was posted: at the start of its SEND's batch
    when sends keep the plan's places (NCCL), right after the compute that made it when sends are posted
    eagerly (gloo). Waiting for a send at its release point then does not stall: its receiver has it.
    """
    return _releases(plan, eager_sends)[1]


def _releases(plan: Plan, eager_sends: bool):
    """(per rank its comm batches as (start, end, receives, sends), release_points' answer); messages by number."""
    ranks, n, owner = plan.ranks, plan.num_ranks, plan.stage_to_rank
    # Messages by number, named by (sending stage, microbatch, backward); a RECV names its sender's stage.
    ids: dict[tuple[int, int, bool], int] = {}
    sends_of: list[Action] = []
    receiver: list[int] = []  # of each message
    arrived: list[int] = []  # position its receiver has passed once it waited for it (end of the RECV's batch)
    post_at: list[int] = []  # its sender's position when it was posted
    batches: list[list[tuple[int, int, list[int], list[int]]]] = []
    send_f, send_b, recv_b = Kind.SEND_F, Kind.SEND_B, Kind.RECV_B
    for actions in ranks:
        mine = []
        for start, end in comm_batches(actions, eager_sends):
            needs, sends = [], []
            for a in actions[start:end]:
                kind = a.kind
                backward = kind is send_b or kind is recv_b
                sending = kind is send_f or kind is send_b
                sender = a.stage if sending else (a.stage + 1 if backward else a.stage - 1)
                key = (sender, a.microbatch, backward)
                k = ids.get(key)
                if k is None:
                    k = ids[key] = len(ids)
                    sends_of.append(Action(sender, send_b if backward else send_f, a.microbatch))
                    receiver.append(owner[sender - 1 if backward else sender + 1])
                    arrived.append(0)
                    post_at.append(0)
                if sending:
                    sends.append(k)
                    post_at[k] = start
                else:
                    needs.append(k)
                    arrived[k] = end
            mine.append((start, end, needs, sends))
        batches.append(mine)
    if eager_sends:  # posted right after the compute that made the tensor
        for actions in ranks:
            for i, action in enumerate(actions):
                for a in parts_of(action):  # a composite's sends after it
                    if a.kind is Kind.F:
                        k = ids.get((a.stage, a.microbatch, False))
                    elif a.kind is Kind.B or a.kind is Kind.I:
                        k = ids.get((a.stage, a.microbatch, True))
                    else:
                        continue
                    if k is not None:
                        post_at[k] = i + 1
    posts = [sorted((post_at[k], k) for _, _, _, sends in mine for k in sends) for mine in batches]

    clock = [[0] * n for _ in range(n)]  # per rank, the furthest position it knows each rank has passed
    posted: list[list[int] | None] = [None] * len(ids)  # a message's sender's clock when it was posted
    # Per rank and receiver, sends not yet known to have arrived: a channel delivers in order (lowering).
    pending: list[dict[int, list[int]]] = [{} for _ in range(n)]
    out: list[dict[int, tuple[Action, ...]]] = [{} for _ in range(n)]
    next_batch, next_post = [0] * n, [0] * n
    moved = True
    while moved:  # each rank runs until it needs a message not yet posted; a lowered plan always completes
        moved = False
        for r in range(n):
            known, mine, queue = clock[r], posts[r], pending[r]
            while next_batch[r] < len(batches[r]):
                start, end, needs, sends = batches[r][next_batch[r]]
                while next_post[r] < len(mine) and mine[next_post[r]][0] <= start:
                    at, k = mine[next_post[r]]
                    posted[k] = known[:r] + [at] + known[r + 1:]
                    next_post[r] += 1
                if any(posted[k] is None for k in needs):
                    break
                for k in needs:
                    known = list(map(max, known, posted[k]))
                    posted[k] = None
                known[r] = end
                clock[r] = known
                for k in sends:
                    queue.setdefault(receiver[k], []).append(k)
                done = []
                for q, waiting in queue.items():
                    j = 0
                    while j < len(waiting) and known[q] >= arrived[waiting[j]]:
                        j += 1
                    if j:
                        done += waiting[:j]
                        del waiting[:j]
                if done:
                    out[r][start] = tuple(sends_of[k] for k in done)
                next_batch[r] += 1
                moved = True
    stuck = [r for r in range(n) if next_batch[r] < len(batches[r])]
    if stuck:
        raise ValueError(f"rank {stuck[0]}: the plan's messages cannot all be delivered (is it lowered and valid?)")
    return batches, out


def message_peaks(plan: Plan, eager_sends: bool = False) -> list[int]:
    """Per rank of a lowered plan, the most message buffers the runtime holds at once beyond what the stages
    count as activations: a tensor to send from the compute that makes it to its release point (or the end
    of the step), a received one from its batch until its compute consumes it (a forward's input then
    belongs to the stage, a gradient is freed after the backward that reads it)."""
    batches, releases = _releases(plan, eager_sends)
    owner, last = plan.stage_to_rank, plan.num_stages - 1
    peaks = []
    for r, actions in enumerate(plan.ranks):
        before = {s: s > 0 and owner[s - 1] != r for s in plan.stages_of(r)}  # the previous stage is remote
        after = {s: s < last and owner[s + 1] != r for s in plan.stages_of(r)}  # the next stage is remote
        level = peak = i = 0
        for start, end, needs, _ in batches[r] + [(len(actions), len(actions), (), ())]:
            for a in flattened(actions[i:start]):
                if a.kind is Kind.F:  # its received input is the stage's now; its output goes on
                    level += after[a.stage] - before[a.stage]
                    peak = max(peak, level)
                elif a.kind is Kind.B or a.kind is Kind.I:  # reads a received gradient, makes one to send
                    level += before[a.stage]
                    peak = max(peak, level)
                    level -= after[a.stage]
            level += len(needs)
            peak = max(peak, level)
            level -= len(releases[r].get(start, ()))
            i = end
        peaks.append(peak)
    return peaks
