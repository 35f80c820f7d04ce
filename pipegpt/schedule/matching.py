"""A lowered plan's cost under each way point-to-point messages are matched.

- "tag" (gloo): a send goes out as soon as its tensor exists, whatever its SEND's place; a message is
  then ready costs.comm after the compute that made it (simulate.simulate, the model every other caller uses).
- "order" (NCCL): messages are matched by order per pair of ranks, so a send goes out where its SEND stands.
  What pipegpt.runtime and comm/p2p.py do there on a GPU, modelled action by action:
  * each comm batch is one batch_isend_irecv: one NCCL group, on the communicator of the whole pipeline
    group (a coalesced batch uses the device's communicator, not a per-pair one), so a rank's batches run
    one after another on one NCCL stream. A run of comm actions is one batch, or two where sends follow its
    last receive (messages.comm_batches): those sends then hold no compute back;
  * a batch starts once the compute before it has ended (the NCCL stream waits for the compute stream when
    the batch is enqueued) and the rank's previous batch has completed;
  * a message moves once both of its batches have started (rendezvous: activations are larger than NCCL's
    buffers), and takes costs.comm; a batch completes when all its messages have moved, together (NCCL
    hands back one Work for the batch);
  * the compute after a batch waits for it when it holds a receive (the runtime's wait on the receive waits
    for the batch), and for the batch of every send released there (release points; the same Work). A
    batch of sends alone is not waited for: the host and the compute stream go on;
  * the step ends when every batch has completed (settle()).
On CPU "order" runs with gloo (the CUDA control path): a receive's wait blocks the host and gloo's sends
run beside each other, so CPU times sit between these two models.
"""
from __future__ import annotations

from numbers import Real

from .actions import COMPUTE_KINDS, Kind, Plan, ScheduleError
from .lowering import lower
from .messages import comm_batches, peer, release_points
from .simulate import Costs, Event, Timeline, _gradient_sync_end, simulate

MATCHINGS = ("tag", "order")
_SENDS = (Kind.SEND_F, Kind.SEND_B)


def simulate_matching(plan: Plan, costs: Costs, matching: str = "tag") -> Timeline:
    """The plan simulated under a matching ("tag" or "order"); a plan without its messages is lowered first,
    for these costs, as a run lowers it."""
    if matching not in MATCHINGS:
        raise ScheduleError(f"p2p matching {matching!r} is not one of {', '.join(MATCHINGS)}")
    if matching == "tag":
        return simulate(plan, costs)
    return simulate_order(plan if plan.is_lowered else lower(plan, costs), costs)


def simulate_order(plan: Plan, costs: Costs) -> Timeline:
    """The lowered plan run with messages matched by order (the module docstring's model)."""
    if costs.num_stages != plan.num_stages:
        raise ScheduleError(f"costs are for {costs.num_stages} stages but plan {plan.name!r} has "
                            f"{plan.num_stages}; give one cost per stage")
    ranks, n = plan.ranks, plan.num_ranks
    # Batches by number: bounds, rank; each message's two batches; per batch start, what its compute waits for.
    bounds: list[list[tuple[int, int]]] = [comm_batches(acts) for acts in ranks]
    batch_id: list[dict[int, int]] = []  # per rank: first index of a batch -> its number
    owner: list[int] = []
    where: dict = {}  # (rank, comm action) -> its batch
    for r, mine in enumerate(bounds):
        ids = {}
        for start, end in mine:
            ids[start] = len(owner)
            for a in ranks[r][start:end]:
                where[(r, a)] = len(owner)
            owner.append(r)
        batch_id.append(ids)
    partners: list[list[int]] = [[] for _ in owner]
    for (r, a), b in where.items():
        q, other = peer(a, plan)
        if (q, other) not in where:
            raise ScheduleError(f"rank {r}: {a} has no {other} on rank {q} (validate the plan)")
        partners[b].append(where[(q, other)])
    releases = release_points(plan, eager_sends=False)
    waits: list[list[int]] = []  # per batch: the batches the compute after it waits for
    for r, mine in enumerate(bounds):
        for start, end in mine:
            b = batch_id[r][start]
            receives = any(a.kind not in _SENDS for a in ranks[r][start:end])
            waits.append(([b] if receives else []) + [where[(r, s)] for s in releases[r].get(start, ())])
    started: list[Real | None] = [None] * len(owner)
    completed: list[Real | None] = [None] * len(owner)
    batch_end = [dict(mine) for mine in bounds]

    pos, compute_free = [0] * n, [0] * n
    stream_free: list[Real | None] = [0] * n  # end of the rank's last batch; None while it is not known
    pending: list[list[int]] = [[] for _ in range(n)]  # batches the next compute waits for
    ends: dict = {}
    events: list[Event] = []
    todo = list(range(n))

    def complete(b: int) -> None:  # once it and every partner have started
        if completed[b] is None and all(started[p] is not None for p in partners[b]):
            completed[b] = max(max(started[b], started[p]) + costs.comm for p in partners[b])
            r = owner[b]
            if stream_free[r] is None and batch_at[r] == b:
                stream_free[r] = completed[b]
            todo.append(r)

    batch_at: list[int | None] = [None] * n  # the rank's last started batch
    while todo:
        r = todo.pop()
        actions = ranks[r]
        while pos[r] < len(actions):
            i, a = pos[r], actions[pos[r]]
            if a.kind in COMPUTE_KINDS:
                if any(completed[b] is None for b in pending[r]):
                    break
                start = max([compute_free[r]] + [completed[b] for b in pending[r]])
                pending[r] = []
                end = start + costs.duration(a)
                events.append(Event(r, a, start, end))
                ends[a] = compute_free[r] = end
                pos[r] += 1
            elif i in batch_id[r]:
                if stream_free[r] is None:
                    break
                b = batch_id[r][i]
                started[b] = max(compute_free[r], stream_free[r])
                stream_free[r], batch_at[r] = None, b
                pending[r] += waits[b]
                pos[r] = batch_end[r][i]
                complete(b)
                for p in partners[b]:
                    if started[p] is not None:
                        complete(p)
            else:  # a collective: launched, not waited for
                pos[r] += 1
    stuck = [r for r in range(n) if pos[r] < len(ranks[r]) or stream_free[r] is None]
    if stuck:
        r = stuck[0]
        at = ranks[r][pos[r]] if pos[r] < len(ranks[r]) else "the end of the step"
        raise ScheduleError(f"rank {r} step {pos[r]} ({at}): deadlocks with messages matched by order")
    events.sort(key=lambda e: e.rank)  # stable: each rank keeps its plan order
    meta = {**plan.meta, "costs": costs.as_dict(), "p2p_matching": "order"}
    step_end = max(completed, default=0)
    if any(costs.dp_comm):
        step_end = max(step_end, _gradient_sync_end(plan, ends, costs))
    if step_end > max((e.end for e in events), default=0):
        meta["step_end"] = step_end
    return Timeline(events, n, schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=tuple(plan.stage_to_rank), activation_bytes=costs.activation_bytes, meta=meta)
