"""Channels between stages: which messages a plan needs, who is on the other end, and when a
sent message's buffer may go.

Shared by lowering (which inserts the messages), validation (which checks
them), the runtime, the simulator and the memory model; it depends on the action
types alone, so none of those has to import another to get it.
"""
from __future__ import annotations

from .actions import P2P_KINDS, Action, Kind, Plan, parts_of


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
    batch completes as one (one Work), and a rank's batches on one lane (a peer and a direction) run one after
    another: a run is cut after each receive, so that a compute waits only for what it reads, unless the receive
    after it is read no later (its reader waits for it anyway: together, neither waits for the other to move); sends
    after a run's last receive are a batch of their own, which no compute waits for (lowering puts a send there so
    that neither end waits). With eager sends (tag matching, gloo) a run is one batch: its receives and the sends
    that sit there go in one exchange."""
    runs = comm_runs(actions)
    if eager_sends:
        return runs
    read_at = {k: i for i, recvs in receive_waits(actions).items() for k in recvs}
    batches = []
    for start, end in runs:
        for i in range(start, end):
            if i == end - 1 or actions[i].kind in _RECVS and not (
                    actions[i + 1].kind in _RECVS and read_at.get(i + 1, -1) <= read_at.get(i, -1)):
                batches.append((start, i + 1))
                start = i + 1
    return batches


_SENDS, _RECVS = (Kind.SEND_F, Kind.SEND_B), (Kind.RECV_F, Kind.RECV_B)


def receive_waits(actions) -> dict[int, tuple[int, ...]]:
    """{index of a compute action: the indices of the RECVs whose messages it reads}: where the runtime waits for
    a receive (at the compute that reads it, not at its batch: a receive posted early moves while the rank
    computes on, as torch.distributed.pipelining's irecv does until its wait())."""
    recv_at = {(a.kind is Kind.RECV_B, a.stage, a.microbatch): i for i, a in enumerate(actions) if a.kind in _RECVS}
    waits = {}
    if not recv_at:
        return waits
    for i, action in enumerate(actions):
        if not action.kind.is_compute:
            continue
        found = tuple(recv_at[key] for part in parts_of(action) if part.kind is not Kind.W
                      for key in [(part.kind is not Kind.F, part.stage, part.microbatch)] if key in recv_at)
        if found:
            waits[i] = found
    return waits


def release_points(plan: Plan, eager_sends: bool = False) -> list[dict[int, tuple[Action, ...]]]:
    """Per rank of a lowered plan: {index of a compute action that waits for a receive (receive_waits): the SENDs
    whose buffers may be released once it has}. A SEND in no entry is released at the end of the step.

    A send's buffer may go once its receiver has it. A rank knows that when it receives a message that the
    receiver posted after waiting for it, directly or through other ranks (happens-before along the plan's
    messages, tracked with vector clocks). The runtime waits for a receive at the compute that reads it, so a
    message carries what its sender had waited for when it was posted: at the start of its SEND's batch
    when sends keep the plan's places (NCCL), right after the compute that made it when sends are posted
    eagerly (gloo). Where sends keep their places, a batch is one Work (NCCL coalesces it): its sends go
    together, once all of them have arrived and the rank has waited for every receive of the batch. Waiting
    for a send at its release point then does not stall: its receiver has it.
    """
    return _releases(plan, eager_sends)[1]


def _releases(plan: Plan, eager_sends: bool):
    """(per rank its comm batches as (start, end, receives, sends), release_points' answer); messages by number."""
    ranks, n, owner = plan.ranks, plan.num_ranks, plan.stage_to_rank
    # Messages by number, named by (sending stage, microbatch, backward); a RECV names its sender's stage.
    ids: dict[tuple[int, int, bool], int] = {}
    sends_of: list[Action] = []
    receiver: list[int] = []  # of each message
    arrived: list[int] = []  # the index of the compute at which its receiver waits for it
    post_at: list[int] = []  # its sender's position when it was posted
    batch_of: list[list[int]] = []  # of each message: every message of its sender's batch (order matching)
    batches: list[list[tuple[int, int, list[int], list[int]]]] = []
    waits: list[dict[int, list[int]]] = []  # per rank: compute index -> the messages it waits for there
    send_f, send_b, recv_b = Kind.SEND_F, Kind.SEND_B, Kind.RECV_B
    for actions in ranks:
        mine, waited_at = [], {}
        consumer = {k: i for i, recvs in receive_waits(actions).items() for k in recvs}
        for start, end in comm_batches(actions, eager_sends):
            needs, sends = [], []
            for j in range(start, end):
                a = actions[j]
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
                    batch_of.append([])
                if sending:
                    sends.append(k)
                    post_at[k] = start
                else:
                    needs.append(k)
                    arrived[k] = consumer[j]
                    waited_at.setdefault(consumer[j], []).append(k)
            for k in sends:
                batch_of[k] = needs + sends
            mine.append((start, end, needs, sends))
        batches.append(mine)
        waits.append(waited_at)
    if eager_sends:  # posted right after the compute that made the tensor; a Work per message
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
                        batch_of[k] = [k]
    # Per rank, its steps in order: posts (position, 0, message) before waits (compute index, 1, messages).
    steps = [sorted([(post_at[k], 0, k) for _, _, _, sends in mine for k in sends]
                    + [(i, 1, tuple(ks)) for i, ks in waited.items()])
             for mine, waited in zip(batches, waits)]
    clock = [[0] * n for _ in range(n)]  # per rank, the furthest position it knows each rank has passed
    posted: list[list[int] | None] = [None] * len(ids)  # a message's sender's clock when it was posted
    is_waited = [False] * len(ids)  # its receiver has waited for it
    pending: list[list[int]] = [[] for _ in range(n)]  # per rank, its sends not yet released
    out: list[dict[int, tuple[Action, ...]]] = [{} for _ in range(n)]
    nxt = [0] * n
    moved = True
    while moved:  # each rank runs until it needs a message not yet posted; a lowered plan always completes
        moved = False
        for r in range(n):
            known, mine = clock[r], steps[r]
            while nxt[r] < len(mine):
                at, is_wait, what = mine[nxt[r]]
                if not is_wait:
                    posted[what] = known[:r] + [at] + known[r + 1:]
                    pending[r].append(what)
                else:
                    if any(posted[k] is None for k in what):
                        break
                    for k in what:
                        known = list(map(max, known, posted[k]))
                        is_waited[k] = True
                    known[r] = at
                    clock[r] = known
                    done = [k for k in pending[r]
                            if all(is_waited[j] if receiver[j] == r else known[receiver[j]] >= arrived[j]
                                   for j in batch_of[k])]
                    if done:
                        out[r][at] = tuple(sends_of[k] for k in done)
                        gone = set(done)
                        pending[r] = [k for k in pending[r] if k not in gone]
                nxt[r] += 1
                moved = True
    stuck = [r for r in range(n) if nxt[r] < len(steps[r])]
    if stuck:
        raise ValueError(f"rank {stuck[0]}: the plan's messages cannot all be delivered (is it lowered and valid?)")
    return batches, out


def message_peaks(plan: Plan, eager_sends: bool = False) -> list[int]:
    """Per rank of a lowered plan, the most message buffers the runtime holds at once beyond what the stages
    count as activations: a tensor to send from the compute that makes it to its release point (or the end
    of the step), a received one from its batch until its compute consumes it (a forward's input then
    belongs to the stage, a gradient is freed after the backward that reads it). Sends released at a compute
    go once it has its receives, before it runs (a composite pair waits for them inside: after it)."""
    batches, releases = _releases(plan, eager_sends)
    owner, last = plan.stage_to_rank, plan.num_stages - 1
    peaks = []
    for r, actions in enumerate(plan.ranks):
        before = {s: s > 0 and owner[s - 1] != r for s in plan.stages_of(r)}  # the previous stage is remote
        after = {s: s < last and owner[s + 1] != r for s in plan.stages_of(r)}  # the next stage is remote
        receives = {start: len(needs) for start, _, needs, _ in batches[r]}
        level = peak = 0
        for i, action in enumerate(actions):
            if i in receives:
                level += receives[i]
                peak = max(peak, level)
            if not action.kind.is_compute:
                continue
            released = len(releases[r].get(i, ()))
            pair = action.kind is Kind.OVERLAP
            level -= 0 if pair else released
            for a in parts_of(action):
                if a.kind is Kind.F:  # its received input is the stage's now; its output goes on
                    level += after[a.stage] - before[a.stage]
                    peak = max(peak, level)
                elif a.kind is Kind.B or a.kind is Kind.I:  # reads a received gradient, makes one to send
                    level += before[a.stage]
                    peak = max(peak, level)
                    level -= after[a.stage]
            level -= released if pair else 0
        peaks.append(peak)
    return peaks
