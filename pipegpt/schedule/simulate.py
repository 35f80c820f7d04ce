"""Simulate a plan: per-stage costs in, a Timeline of when every action ran out.

Costs are plain data (per-stage F, B, W seconds or units, one comm latency),
so a calibration step can fill them from a measured run; how an action is
charged against them is the timing rule's (timing_rule.py). A Timeline is just
events (rank, action, start, end) plus a little metadata; the runtime's
measured traces build the same type, so every metric and renderer works on
both.

Messages matched by tag (gloo) are simulate()'s model; matched by order (NCCL), simulate_order()'s, below.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from fractions import Fraction
from numbers import Real

from .actions import COMPUTE_KINDS, Action, Kind, Plan, ScheduleError, parts_of
from .lowering import last_gradient_actions, lower
from .messages import comm_batches, peer, receive_waits, release_points
from .timing_rule import Costs, costs_for_plan, hop, load_costs_json, queued, spans_of
from .validate import dependencies, validate

__all__ = ["Costs", "Event", "MATCHINGS", "Timeline", "costs_for_plan", "load_costs_json", "simulate",
           "simulate_matching", "simulate_order", "simulate_unchecked"]

@dataclass
class Event:
    """One action on one rank, from start to end (simulated units or measured seconds)."""

    rank: int
    action: Action
    start: Real
    end: Real
    pair: object = field(default=None, compare=False)  # the Composite this is a half of, where it is one

    @property
    def duration(self) -> Real:
        return self.end - self.start


@dataclass
class Timeline:
    """What ran where and when. Built by simulate() or from a measured trace.

    Metrics count compute actions (F, B, I, W) as busy; comm events, which a
    measured trace may hold, are kept but count as neither busy nor live.
    """

    events: list[Event]
    num_ranks: int
    schedule: str = ""
    num_microbatches: int = 0
    stage_to_rank: tuple[int, ...] = ()
    activation_bytes: tuple | None = None  # per stage, for one microbatch
    time_unit: str = "unit"  # "unit" (simulated) or "s" (measured)
    meta: dict = field(default_factory=dict)

    def compute_events(self) -> list[Event]:
        return [e for e in self.events if e.action.kind.is_compute]

    def events_of(self, rank: int) -> list[Event]:
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: (e.start, e.end))

    @property
    def start_time(self) -> Real:
        return min((e.start for e in self.events), default=0)

    @property
    def end_time(self) -> Real:
        return max((e.end for e in self.events), default=0)

    @property
    def makespan(self) -> Real:
        """Until the step ends: the last action, or the last gradient all-reduce if later (meta step_end)."""
        return max(self.end_time, self.meta.get("step_end", self.end_time)) - self.start_time

    @property
    def busy_per_rank(self) -> list[Real]:
        busy = [0] * self.num_ranks
        for e in self.compute_events():
            busy[e.rank] += e.end - e.start
        return busy

    @property
    def bubble_fraction(self) -> Real:
        """Idle share of all ranks' time: 1 - total busy / (num_ranks * makespan)."""
        span = self.makespan
        if not span:
            return 0
        return 1 - _ratio(sum(self.busy_per_rank), self.num_ranks * span)

    @property
    def bubble_fraction_per_rank(self) -> list[Real]:
        span = self.makespan
        return [1 - _ratio(busy, span) if span else 0 for busy in self.busy_per_rank]

    @property
    def idle_time(self) -> Real:
        """Total idle time over all ranks (the bubble, in time units)."""
        return self.num_ranks * self.makespan - sum(self.busy_per_rank)

    def live_intervals(self) -> list[tuple[int, int, int, Real, Real]]:
        """(rank, stage, microbatch, start, end): from the start of F to the end of its last backward piece.

        A stage-microbatch with no backward event (a cut-off trace) stays live to the end.
        """
        first: dict[tuple[int, int], Event] = {}
        last_end: dict[tuple[int, int], Real] = {}
        for e in self.compute_events():
            key = (e.action.stage, e.action.microbatch)
            if e.action.kind is Kind.F:
                first[key] = e
            else:
                last_end[key] = max(last_end.get(key, e.end), e.end)
        end = self.end_time
        return [(f.rank, s, mb, f.start, last_end.get((s, mb), end)) for (s, mb), f in first.items()]

    def _peak_per_rank(self, weight) -> list:
        changes: list[list[tuple]] = [[] for _ in range(self.num_ranks)]
        for rank, stage, _, start, end in self.live_intervals():
            w = weight(stage)
            changes[rank].append((start, 1, w))   # at equal times releases (0) sort before allocations (1)
            changes[rank].append((end, 0, -w))
        peaks = []
        for ch in changes:
            level = peak = 0
            for _, _, delta in sorted(ch, key=lambda c: (c[0], c[1])):
                level += delta
                peak = max(peak, level)
            peaks.append(peak)
        return peaks

    @property
    def peak_live_microbatches_per_rank(self) -> list[int]:
        """Most stage-microbatches whose activations a rank holds at once (F started, backward not finished)."""
        return self._peak_per_rank(lambda stage: 1)

    @property
    def peak_activation_bytes_per_rank(self) -> list | None:
        """Like peak_live_microbatches_per_rank, weighted by activation_bytes[stage]; None when unknown."""
        if self.activation_bytes is None:
            return None
        return self._peak_per_rank(lambda stage: self.activation_bytes[stage])

    def summary(self) -> dict:
        """Plain numbers (floats) for printing or JSON."""
        peak_bytes = self.peak_activation_bytes_per_rank
        return {
            "schedule": self.schedule,
            "ranks": self.num_ranks,
            "stages": len(self.stage_to_rank) or None,
            "microbatches": self.num_microbatches,
            "time_unit": self.time_unit,
            "makespan": float(self.makespan),
            "bubble_fraction": float(self.bubble_fraction),
            "bubble_fraction_per_rank": [float(x) for x in self.bubble_fraction_per_rank],
            "busy_per_rank": [float(x) for x in self.busy_per_rank],
            "peak_live_microbatches_per_rank": self.peak_live_microbatches_per_rank,
            "peak_activation_bytes_per_rank": None if peak_bytes is None else [_plain(x) for x in peak_bytes],
        }


def _ratio(a, b):
    """a / b, exact (a Fraction) when both are integers."""
    return Fraction(a, b) if isinstance(a, int) and isinstance(b, int) else a / b


def _plain(x):
    return int(x) if x == int(x) else float(x)


def simulate(plan: Plan, costs: Costs) -> Timeline:
    """Run the plan's compute actions against the costs and return when each ran.

    Each rank runs its compute actions in plan order (SEND/RECV are ignored:
    messages are modelled as latency; collectives take no compute time, see
    _gradient_sync_end). An action starts when its rank is free
    and every dependency (validate.dependencies) is available: at once on the
    same rank, costs.comm after it ended on another. The times are computed
    in dependency order, which gives exactly what an event-driven run gives.
    Integer or Fraction costs give exact times (and an exact Fraction bubble).
    """
    validate(plan)  # an unrunnable plan fails here, naming the rank and step
    return simulate_unchecked(plan, costs)


def simulate_unchecked(plan: Plan, costs: Costs) -> Timeline:
    """simulate() without validating first, for a caller that trusts the plan's counts (the synthesizer's
    local search: a reordering that deadlocks still raises ScheduleError, naming where it stuck)."""
    _check_stages(plan, costs)
    actions = plan.compute_only().ranks
    launches, waits = _gathers(plan, costs)
    gathered: dict[tuple[int, int], tuple[Action, Real]] = {}  # (rank, index of an UNSHARD) -> it, when done
    channel: list[Real] = [0] * plan.num_ranks  # when each rank's gathers posted so far are done
    rank_of = plan.stage_to_rank
    ends: dict[Action, Real] = {}
    waiters: dict[Action, list[int]] = defaultdict(list)
    pos = [0] * plan.num_ranks
    free: list[Real] = [0] * plan.num_ranks
    events: list[Event] = []
    todo = list(range(plan.num_ranks))
    while todo:
        r = todo.pop()
        while pos[r] < len(actions[r]):
            action = actions[r][pos[r]]
            deps = dependencies(action, plan)
            missing = next((d for d in deps if d not in ends), None)
            if missing is not None:
                waiters[missing].append(r)
                break
            start = free[r]
            for key, unshard, took in launches.get(action, ()):  # posted where the rank reached them
                channel[r] = queued(channel[r], free[r], took)
                gathered[key] = unshard, channel[r]
            for key in waits.get(action, ()):  # its stage's gathers: the rank's wait for them is their event
                unshard, done = gathered.pop(key)
                if done > start:
                    events.append(Event(r, unshard, start, done))
                    start = done
            for d in deps:
                available = ends[d]
                latency = hop(costs.comm, rank_of[d.stage], r)
                if latency:
                    available = available + latency
                if available > start:
                    start = available
            free[r] = _charge(r, action, start, costs, events, ends)
            pos[r] += 1
            for part in parts_of(action):
                todo.extend(waiters.pop(part, ()))
    stuck = [r for r in range(plan.num_ranks) if pos[r] < len(actions[r])]
    if stuck:  # validate() proves this cannot happen; kept so a validator bug cannot pass silently
        r = stuck[0]
        raise ScheduleError(f"rank {r} step {pos[r]} ({actions[r][pos[r]]}): simulation cannot progress")
    events.sort(key=lambda e: e.rank)  # stable: each rank keeps its plan order
    meta = {**plan.meta, "costs": costs.as_dict()}
    if any(costs.dp_comm):
        meta["step_end"] = _gradient_sync_end(plan, ends, costs)
    return Timeline(events, plan.num_ranks, schedule=plan.name, num_microbatches=plan.num_microbatches,
                    stage_to_rank=tuple(plan.stage_to_rank), activation_bytes=costs.activation_bytes, meta=meta)


def _check_stages(plan: Plan, costs: Costs) -> None:
    if costs.num_stages != plan.num_stages:
        raise ScheduleError(f"costs are for {costs.num_stages} stages but plan {plan.name!r} has "
                            f"{plan.num_stages}; give one cost per stage")


def _charge(rank: int, action, start: Real, costs: Costs, events: list[Event], ends: dict) -> Real:
    """Run a compute action from `start` on its rank's compute line, by the timing rule: its events (a composite's,
    one per part), when its outputs are ready (ends; a composite's parts' at its end); returns its end."""
    if action.kind is Kind.OVERLAP:
        spans = spans_of(costs, action, start)
        end = spans[-1][1]
        for part, (begin, finish) in zip(action.parts, spans):
            events.append(Event(rank, part, begin, finish, action))
            ends[part] = end
    else:
        end = start + costs.duration(action)
        events.append(Event(rank, action, start, end))
    ends[action] = end
    return end


def _gathers(plan: Plan, costs: Costs) -> tuple[dict[Action, list], dict[Action, list]]:
    """Per compute action, the UNSHARDs its rank posts just before it (since its previous compute action), as
    ((rank, index), UNSHARD, gather time), and the UNSHARDs it waits for (its stages' since their previous
    compute action), as (rank, index)."""
    launches: dict[Action, list] = {}
    waits: dict[Action, list] = {}
    for r, actions in enumerate(plan.ranks):
        posted: list = []
        pending: dict[int, list[tuple[int, int]]] = {}
        for i, a in enumerate(actions):
            if a.kind is Kind.UNSHARD:
                posted.append(((r, i), a, costs.gather_comm[a.stage]))
                pending.setdefault(a.stage, []).append((r, i))
            elif a.kind in COMPUTE_KINDS:
                if posted:
                    launches[a], posted = posted, []
                keys = [key for stage in dict.fromkeys(p.stage for p in parts_of(a)) for key in pending.pop(stage, ())]
                if keys:
                    waits[a] = keys
    return launches, waits


def _gradient_sync_end(plan: Plan, ends: dict[Action, Real], costs: Costs) -> Real:
    """When the last data-parallel gradient reduction ends. A REDUCE_GRAD is launched where it stands: once
    its rank has finished the compute action before it; launching takes no compute time (the reduction is
    asynchronous), and it then takes dp_comm[stage] on its rank's one reduction channel, after the reductions
    launched before it (timing_rule.queued). A rank without REDUCE_GRAD launches where add_reduce_grad would
    put them."""
    end = 0
    for actions in plan.ranks:
        placed = [i for i, a in enumerate(actions) if a.kind is Kind.REDUCE_GRAD]
        if placed:
            launches = [(_reached(actions, i, ends), actions[i].stage) for i in placed]
        else:
            after = last_gradient_actions(actions)
            launches = [(ends[actions[i]], s) for s, i in sorted(after.items(), key=lambda item: item[1])]
        channel = 0
        for at, stage in launches:
            channel = queued(channel, at, costs.dp_comm[stage])
        end = max(end, channel)
    return end


def _reached(actions, i: int, ends: dict[Action, Real]) -> Real:
    """When a rank reaches step i of its actions: the end of the compute action before it (0 if none)."""
    for k in range(i - 1, -1, -1):
        if actions[k].kind in COMPUTE_KINDS:
            return ends[actions[k]]
    return 0


# Messages matched by tag or by order.

MATCHINGS = ("tag", "order")


def simulate_matching(plan: Plan, costs: Costs, matching: str = "tag") -> Timeline:
    """The plan simulated under a matching of point-to-point messages; a plan without its messages is lowered
    first, for these costs, as a run lowers it. "tag" (gloo): a send goes out as soon as its tensor exists,
    whatever its SEND's place, so a message is ready costs.comm after the compute that made it (simulate(),
    the model every other caller uses). "order" (NCCL): simulate_order()."""
    if matching not in MATCHINGS:
        raise ScheduleError(f"p2p matching {matching!r} is not one of {', '.join(MATCHINGS)}")
    if matching == "tag":
        return simulate(plan, costs)
    return simulate_order(plan if plan.is_lowered else lower(plan, costs), costs)


def simulate_order(plan: Plan, costs: Costs) -> Timeline:
    """The lowered plan run with messages matched by order (NCCL): a send goes out where its SEND stands.
    What pipegpt.stages.runtime and comm/p2p.py do there on a GPU, modelled action by action:
    * each comm batch is posted per peer and direction: one batch_isend_irecv (one NCCL group) of its sends to
      a peer on the communicator that carries that rank's messages to that peer alone, one of its receives from
      a peer on the one that carries that peer's to it (comm/mesh.py's pair groups, two per pair of neighbours).
      So a rank's messages in one direction of one pair run one batch after another on that communicator's
      stream, and every other lane's beside them. A run of comm actions is one batch, or two where sends follow
      its last receive (messages.comm_batches): those sends then hold no compute back;
    * a lane's batch starts once the compute before it has ended (the NCCL stream waits for the compute stream
      when the batch is enqueued) and the rank's previous batch on that lane has completed;
    * a message moves once both of its batches have started (rendezvous: activations are larger than NCCL's
      buffers), and takes costs.comm; a batch completes when all its messages have moved, together (NCCL
      hands back one Work for the batch);
    * a compute waits for the batch of each receive it reads (the runtime waits for a receive at the compute
      that reads it, and its wait waits for the batch), and for the batch of every send released there
      (release points; the same Work). A batch whose receives are read later, or that holds sends alone,
      holds nothing back: the host and the compute stream go on;
    * the step ends when every batch has completed (settle()).
    On CPU "order" runs with gloo (the CUDA control path): a receive's wait blocks the host and gloo's sends
    run beside each other, so CPU times sit between the two models.
    """
    _check_stages(plan, costs)
    ranks, n = plan.ranks, plan.num_ranks
    # Batches by number, one per (run of comm actions, lane): owner rank, its lane (rank, peer, whether it
    # sends); each message's two batches; per compute, the batches it waits for.
    bounds: list[list[tuple[int, int]]] = [comm_batches(acts) for acts in ranks]
    batches_at: list[dict[int, list[int]]] = []  # per rank: first index of a run's batch -> its lanes' batches
    owner: list[int] = []
    lane: list[tuple[int, int, bool]] = []
    where: dict = {}  # (rank, comm action) -> its batch
    for r, mine in enumerate(bounds):
        ids = {}
        for start, end in mine:
            by_lane: dict[tuple, int] = {}
            for a in ranks[r][start:end]:
                key = (r, peer(a, plan)[0], a.kind in (Kind.SEND_F, Kind.SEND_B))
                if key not in by_lane:
                    by_lane[key] = len(owner)
                    owner.append(r)
                    lane.append(key)
                where[(r, a)] = by_lane[key]
            ids[start] = list(by_lane.values())
        batches_at.append(ids)
    partners: list[list[int]] = [[] for _ in owner]
    for (r, a), b in where.items():
        q, other = peer(a, plan)
        if (q, other) not in where:
            raise ScheduleError(f"rank {r}: {a} has no {other} on rank {q} (validate the plan)")
        partners[b].append(where[(q, other)])
    releases = release_points(plan, eager_sends=False)
    waits: list[dict[int, list[int]]] = []  # per rank: compute index -> the batches it waits for
    for r, actions in enumerate(ranks):
        reads = receive_waits(actions)
        waits.append({i: sorted({where[(r, actions[k])] for k in reads.get(i, ())}
                                | {where[(r, send)] for send in releases[r].get(i, ())})
                      for i in set(reads) | set(releases[r])})
    started: list[Real | None] = [None] * len(owner)
    completed: list[Real | None] = [None] * len(owner)
    batch_end = [dict(mine) for mine in bounds]

    pos, compute_free = [0] * n, [0] * n
    lane_free: dict[tuple, Real | None] = {}  # end of the lane's last batch; None while not known
    lane_last: dict[tuple, int] = {}  # the lane's last started batch
    ends: dict = {}
    events: list[Event] = []
    todo = list(range(n))

    def complete(b: int) -> None:  # once it and every partner have started
        if completed[b] is None and all(started[p] is not None for p in partners[b]):
            completed[b] = max(max(started[b], started[p]) + costs.comm for p in partners[b])
            if lane_last[lane[b]] == b:
                lane_free[lane[b]] = completed[b]
            todo.append(owner[b])

    while todo:
        r = todo.pop()
        actions = ranks[r]
        while pos[r] < len(actions):
            i, a = pos[r], actions[pos[r]]
            if a.kind in COMPUTE_KINDS:
                needs = waits[r].get(i, ())
                if any(completed[b] is None for b in needs):
                    break
                start = max([compute_free[r]] + [completed[b] for b in needs])
                compute_free[r] = _charge(r, a, start, costs, events, ends)
                pos[r] += 1
            elif i in batches_at[r]:
                mine = batches_at[r][i]
                if any(lane_free.get(lane[b], 0) is None for b in mine):
                    break
                for b in mine:
                    started[b] = max(compute_free[r], lane_free.get(lane[b], 0))
                    lane_free[lane[b]], lane_last[lane[b]] = None, b
                pos[r] = batch_end[r][i]
                for b in mine:
                    complete(b)
                    for p in partners[b]:
                        if started[p] is not None:
                            complete(p)
            else:  # a collective: launched, not waited for
                pos[r] += 1
    stuck = [r for r in range(n) if pos[r] < len(ranks[r])] + \
        [r for (r, _, _), free in lane_free.items() if free is None]
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


# ---------------------------------------------------------------------------------------------------------
# Lowering for order matching: where a run knows no latency in its costs' unit

# The latency, in forwards of a rank's share, that an order-matched run places its messages for where it knows
# none in its costs' unit (unit or estimated costs, gloo in order). Placed for no latency, a plan loses under order
# matching as soon as messages take time: at a tenth of a forward up to 1.4% (1f1b), 4.3% (interleaved-1f1b),
# 5.2% (gpipe). Placed for this one, every fixed schedule at p 2..8 costs what tag matching costs at true
# latencies from a fiftieth to a fifth of a forward (tests/unit/test_run_plan_latency.py).
ASSUMED_LATENCY_FORWARDS = 0.05


def assumed_latency(stage_to_rank) -> Costs:
    """Lowering's unit costs (schedule.lowering: F 1, B 2, W 1 a stage), scaled so that a rank's forward is 1,
    with a message latency of ASSUMED_LATENCY_FORWARDS."""
    share = (max(stage_to_rank) + 1) / len(stage_to_rank)
    return Costs.uniform(len(stage_to_rank), F=share, B=2 * share, W=share, comm=ASSUMED_LATENCY_FORWARDS)


def lowered(plan: Plan, costs: Costs | None) -> Plan:
    """The plan lowered for its costs: with a latency, placed for it or as for none, whichever order matching
    (simulate_order, at that latency) runs sooner, the latency's on a tie. Placing for the latency reaches tag
    matching's makespan on every fixed schedule measured; the placement for none is the fallback where it would
    not (with one NCCL stream a rank, zb-h1 at some costs by 0.1-0.2%)."""
    if costs is None or not costs.comm:
        return lower(plan, costs)
    return min((lower(plan, costs), lower(plan, replace(costs, comm=0))),
               key=lambda placed: simulate_order(placed, costs).makespan)
