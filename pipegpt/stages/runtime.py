"""The runtime walks plan.ranks[rank] and dispatches each action to a Stage, to comm or to a collective.

It decides nothing about order: the lowered plan from pipegpt.schedule does.
A collective action runs by its kind's row in COLLECTIVE_RUNS: the `collectives` method that runs it and the
process group it acts on (by its name in pipegpt.dims.GROUP_AXES), which refusals and the watchdog's labels name.
A REDUCE_GRAD launches the stage's gradient reduction on the `collectives`
object it is given (the training role's train.grad_sync.PlanCollectives); it
overlaps what follows, and the worker waits for it after the step. An UNSHARD
launches the gather of the stage's parameters there (ZeRO-3), a RESHARD frees
them; before the stage's first compute after an UNSHARD (and before its first
backward of the step) the runtime calls the collectives' ready(), which waits
for the gather (so one the plan posts a compute ahead overlaps that compute).
Each run of consecutive SEND/RECV actions is posted as one batch; a receive is
waited for at the compute that reads it (messages.receive_waits), so one posted
early moves while the rank computes on, as torch.distributed.pipelining's irecv
does until its wait(). Sends are waited for at the compute where the schedule says their receiver
has them, once it has its receives (pipegpt.schedule.messages.release_points), the rest
at the end of the step. Then the send's message is dropped, and with it the last
reference to its tensor: message memory follows the schedule, not the microbatch
count.
Where the backend matches messages by tag (gloo), a send is posted as soon as
its tensor exists, and its SEND action only takes it in: lowering places a SEND
where its receiver needs it in a unit-cost run, which in a real run can be a
whole compute action after the output was ready, with the receiver waiting.
A send whose SEND is in the batch right after its compute goes with that batch
instead: as early, and one gloo exchange with the batch's receives, not two.
A composite pair runs its halves' pieces in turns (stages.stage.interleave): a receive feeding a half (in the
dtype it computes in) is waited for just before that half's first piece (the other half may compute meanwhile),
each half's output is handed on (its send posted, where sends go eagerly) as soon as that half ends, and the
communication a piece posts (stages.overlap) is waited for just before the piece goes on, after the other half's
next piece.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import torch

from pipegpt.comm.p2p import Message, PointToPoint
from pipegpt.dims import REPLICAS
from pipegpt.schedule.actions import COLLECTIVE_KINDS, Action, Kind, Plan, ScheduleError
from pipegpt.schedule.messages import comm_batches, release_points
from pipegpt.stages.stage import PieceRun, Stage, interleave
from pipegpt.stages.timing import clock_for, device_marker

DEVICE_QUERY_S = 1.0  # how long where() waits for the device's marks: a query can block while the host synchronises
DEVICE_UNKNOWN = (None, "unknown action", (), f"unknown (its device marks did not answer within {DEVICE_QUERY_S:g}s)")
OPTIMIZER_STEP = (None, "optimizer step", (), "nobody (updating the parameters)")  # a role's phase after the plan


@dataclass
class StepResult:
    losses: list[float]  # per microbatch, on the rank holding the last stage
    # (action, start_s, end_s) on time.perf_counter()'s time line, which on Linux is one clock for
    # every process of the machine, so ranks' events line up in one timeline (pipegpt.stages.timing).
    events: list[tuple[str, float, float]] = field(default_factory=list)


def _ranks(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def ready_points(actions) -> dict[int | tuple[int, int], tuple[int, bool]]:
    """Index -> (stage, backward) of each compute action before which the collectives' ready() runs: a stage's
    first compute after each of its UNSHARDs, and its first backward (B, I or W) of the step. A composite's part j
    is keyed (index, j)."""
    out, gathering, backed = {}, set(), set()
    for i, a in enumerate(actions):
        if a.kind is Kind.UNSHARD:
            gathering.add(a.stage)
        elif a.kind.is_compute:
            parts = list(enumerate(a.parts)) if a.kind is Kind.OVERLAP else [(None, a)]
            for j, part in parts:
                backward = part.kind is not Kind.F and part.stage not in backed
                if backward:
                    backed.add(part.stage)
                if backward or part.stage in gathering:
                    gathering.discard(part.stage)
                    out[i if j is None else (i, j)] = (part.stage, backward)
    return out


def _outbox_key(send: Action) -> tuple[Kind, int, int]:
    """Where a SEND's tensor waits in the outbox: (F|B, sending stage, microbatch)."""
    return Kind.F if send.kind is Kind.SEND_F else Kind.B, send.stage, send.microbatch


class _Compute(NamedTuple):
    """A compute action with what the step needs of it, looked up once when the runtime is built."""

    index: int
    action: Action
    where: tuple
    name: str
    kind: Kind  # F, B, I or W
    stage: Stage | None
    mb: int
    take: tuple[Kind, int, int] | None  # the inbox key of its input (F) or output gradient (B, I)
    cast: bool  # whether that tensor needs .to(dtype): a message in another dtype, or handed over on this rank
    # Where its result goes: (inbox key,) on this rank, else (outbox key, its SEND's fields, posted at once).
    hand: tuple | None
    ready: tuple | None  # (stage, backward, whereabouts) of the collectives' ready() before it (ZeRO-3), or None
    releases: tuple = ()  # (SEND, whereabouts): the sends to drop once it has its input (release_points)


class _Pair(NamedTuple):
    """A composite action: its parts' compute entries, whose pieces (embedding, each block, head) run in turns."""

    index: int
    action: Action
    where: tuple
    name: str
    parts: tuple  # a _Compute per part, in the plan's order
    releases: tuple = ()  # as a _Compute's, dropped after the pair (its parts wait for their inputs inside)


class _Arrival:
    """A posted receive as a piece's handle (stages.overlap): wait() waits for it, the watchdog told where."""

    __slots__ = ("runtime", "message", "where", "after")

    def __init__(self, runtime, message, where, after):
        self.runtime, self.message, self.where, self.after = runtime, message, where, after

    def wait(self) -> None:
        self.runtime.now = self.where
        self.runtime.p2p.wait(self.message)
        self.runtime.now = self.after


class _Collective(NamedTuple):
    index: int
    action: Action
    where: tuple
    name: str
    run: Callable[[int], None]  # the collectives' method for its kind


class _Batch(NamedTuple):
    """A run of point-to-point actions, posted as one, with its messages' peers, tags and labels."""

    index: int
    action: Action  # its first
    where: tuple
    names: tuple[str, ...]
    sends: tuple  # (outbox key, SEND, peer, tag, label, the sending stage's release_output or None, microbatch)
    recvs: tuple  # (inbox key, peer, tag, label, whereabouts): each waited for by the compute that reads it


class CollectiveKind(NamedTuple):
    """How the runtime runs one kind of collective action, and what it says of a rank inside one."""

    method: str  # the collectives' method that runs it: method(stage)
    group: str  # the process group it acts on, by its name in pipegpt.dims.GROUP_AXES
    purpose: str  # what the rank would do with the group, for a refusal ("to reduce its gradients with")
    doing: str  # what a rank in it does, for the watchdog ("gathering stage {stage}'s parameters")
    waits_for_group: bool  # False: launched, waited for after the step; True: the rank may wait for its peers


# Every collective kind of the schedule (pipegpt.schedule.actions.COLLECTIVE_KINDS), by kind: a new one is a row.
COLLECTIVE_RUNS = {
    Kind.REDUCE_GRAD: CollectiveKind("reduce_grad", REPLICAS, "to reduce its gradients with",
                                     "launching a gradient reduction", False),
    Kind.UNSHARD: CollectiveKind("unshard", REPLICAS, "to gather its parameters from",
                                 "gathering stage {stage}'s parameters", True),
    Kind.RESHARD: CollectiveKind("reshard", REPLICAS, "to free its parameters with",
                                 "freeing stage {stage}'s parameters", True),
}

# A group's ranks in words, by its name in pipegpt.dims.GROUP_AXES: (who they are, what each one is to another).
GROUP_WORDS = {
    "dp": ("data-parallel", "replicas"),
    "dp_cp": ("data-parallel", "replicas"),  # cp ranks hold the same weights: replicas to the gradients' average
    "cp": ("context-parallel", "peers"),
    "tp": ("tensor-parallel", "peers"),
    "pp": ("pipeline", "peers"),
    "model": ("model-replica", "peers"),
    "embedding": ("tied-embedding", "peers"),
    "ep": ("expert-parallel", "peers"),
    "edp": ("expert data-parallel", "replicas"),
}


class Collectives(Protocol):
    """What runs a plan's collective actions on this rank."""

    def reduce_grad(self, stage: int) -> None:
        """Launch the reduction of the stage's gradients over its replicas (asynchronous)."""

    def unshard(self, stage: int) -> None:
        """Gather the stage's parameters from its replicas' shards (done when it returns)."""

    def reshard(self, stage: int) -> None:
        """Free the stage's gathered parameters."""

    def ready(self, stage: int, backward: bool) -> None:
        """The stage computes next: wait for its gathers; before its first backward, its gradient buffers."""


class PipelineRuntime:
    def __init__(self, plan: Plan, rank: int, stages: dict[int, Stage], p2p: PointToPoint,
                 pipeline_ranks: list[int], activation_shape: tuple[int, ...], dtype, device,
                 collectives: Collectives | None = None, message_dtype=None,
                 group_members: dict[str, list[int]] | None = None):
        """group_members: the ranks of each of this rank's groups by name (comm.mesh.Mesh.members), whom a
        collective action waits for (the watchdog's edges); without them its whereabouts name the group only."""
        self.plan, self.rank, self.stages, self.p2p = plan, rank, stages, p2p
        self.actions = plan.ranks[pipeline_ranks.index(rank)]
        self.names = [str(a) for a in self.actions]  # trace labels, formatted once, not per step
        self.batch_end = dict(comm_batches(self.actions, eager_sends=p2p.matches_by_tag))
        self.collective_at = {i: a for i, a in enumerate(self.actions) if a.kind in COLLECTIVE_KINDS}
        self.collectives = collectives
        self.group_members = group_members or {}
        self.run_collective = {kind: getattr(collectives, run.method, None) for kind, run in COLLECTIVE_RUNS.items()}
        for a in self.collective_at.values():
            run = COLLECTIVE_RUNS[a.kind]
            if collectives is None:
                who, members = GROUP_WORDS[run.group]
                raise ScheduleError(f"rank {rank}: the plan has {a}, but this rank has no {who} {members} "
                                    f"{run.purpose}")
            if self.run_collective[a.kind] is None:
                raise ScheduleError(f"rank {rank}: the plan has {a}, and this rank's collectives do not run "
                                    f"{a.kind.value}")
        self.ready = getattr(collectives, "ready", None)
        if self.ready is None and any(a.kind is Kind.UNSHARD for a in self.collective_at.values()):
            raise ScheduleError(f"rank {rank}: the plan gathers parameters, and this rank's collectives have no "
                                f"ready() to wait for them before a compute")
        # Global rank that owns each stage in this rank's pipeline.
        self.owner = [pipeline_ranks[r] for r in plan.stage_to_rank]
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        # Messages may travel narrower than the stages compute (--p2p-dtype bf16 with fp32 residual streams):
        # cast on sending, and back to `dtype` on receiving, so a stage sees the dtype it computes in.
        self.message_dtype = dtype if message_dtype is None else message_dtype
        self.clock = clock_for(torch.device(device))
        # Where step() is, for the stall watchdog (read from another thread by Worker.where()):
        # (action index, action, ranks it waits for, what it waits for), one prebuilt tuple per action
        # so that keeping it costs one attribute store; None between steps.
        self.now: tuple[int | None, str, tuple[int, ...], str] | None = None
        # On CUDA the host runs ahead of the GPU: a mark after each action (an event) tells device_now() which
        # action the GPU is in; (whereabouts, mark) of this step.
        self.marker = device_marker(torch.device(device))
        self.marks: list = []
        self.arriving: dict = {}  # inbox key -> a step's posted receive (Message, whereabouts), until read (step())
        self.in_flight: dict = {}  # a step's SENDs posted, not yet released, with their Messages (step())
        self.at = [self._whereabouts(i, a) for i, a in enumerate(self.actions)]
        # Index of a compute action -> the ready() call before it: (stage, backward, where the wait is).
        self.ready_at = {} if self.ready is None else {
            key: (s, backward, (i, self.names[i], *self._in_group(COLLECTIVE_RUNS[Kind.UNSHARD], s)))
            for key, (s, backward) in ready_points(self.actions).items()
            for i in [key if isinstance(key, int) else key[0]]}
        # A comm batch is posted, and marked, as one: its whereabouts name every peer in it, not its first action's.
        self.batch_at = {i: self._batch_whereabouts(i, end) for i, end in self.batch_end.items()}
        self.index_of = {a: i for i, a in enumerate(self.actions)}
        self.eager_sends = p2p.matches_by_tag
        self.send_of = {_outbox_key(a): a for a in self.actions if a.kind in (Kind.SEND_F, Kind.SEND_B)}
        # Per compute action (by its index): the sends to wait for and drop once its receives are in.
        releases = release_points(plan, self.eager_sends)[pipeline_ranks.index(rank)]
        self.releases = {i: tuple((a, self.at[self.index_of[a]]) for a in sends) for i, sends in releases.items()}
        # What step() does, one entry per compute action, collective and comm batch: every lookup, tag and label
        # an action needs is made here, once, so that the host's cost per action is the work itself.
        self.program = self._program()
        # Hook points (intercept): rehearsed faults reach into a step only here.
        self.before_compute: Callable[[Action], None] | None = None
        self.before_settle: Callable[[], None] | None = None
        # Called after each action with the step's message maps (inbox, outbox, in flight), where set: the
        # worker's count of tensor bytes (pipegpt.observe.tensor_bytes) on the steps it measures.
        self.after_action: Callable[..., None] | None = None

    def intercept(self, before_compute: Callable[[Action], None] | None = None, marker=None,
                  before_settle: Callable[[], None] | None = None) -> None:
        """Call before_compute before each compute action and before_settle before the step's settle, and mark
        actions with `marker` instead of the device's events (pipegpt.resilience.faults rehearses stalls so)."""
        self.before_compute = before_compute or self.before_compute
        self.before_settle = before_settle or self.before_settle
        self.marker = marker or self.marker

    def device_now(self) -> tuple[int | None, str, tuple[int, ...], str] | None:
        """Where the device is, as `now` is where the host is: the first action (or comm batch) of this step
        whose mark has not completed (the GPU is still in it), or None when the device has done every action
        launched (or marks nothing). Called from another thread (Worker.where()); the marks are queried on a
        thread of their own, so a query that blocks (the driver's lock, held by a synchronising host) leaves
        the caller after DEVICE_QUERY_S with DEVICE_UNKNOWN."""
        marks = list(self.marks)
        if not marks:
            return None
        answer: list = []

        def first_unfinished():
            answer.append(next((where for where, mark in marks if not mark.query()), None))

        query = threading.Thread(target=first_unfinished, name="pipegpt-device-query", daemon=True)
        query.start()
        query.join(DEVICE_QUERY_S)
        return answer[0] if answer else DEVICE_UNKNOWN

    def launched(self, where: tuple[int | None, str, tuple[int, ...], str]) -> None:
        """The host launched the work of `where`, a phase of the step after the plan's actions (the gradients'
        syncs and clipping, the optimizer step): a mark after it tells device_now() whether the GPU got
        through it, as for an action."""
        if self.marker is not None:
            self.marks.append((where, self.marker(None)))

    def _whereabouts(self, i: int, a: Action) -> tuple[int, str, tuple[int, ...], str]:
        if a.kind.is_compute:
            return i, self.names[i], (), "nobody (computing)"
        if a.kind.is_collective:
            return (i, self.names[i], *self._in_group(COLLECTIVE_RUNS[a.kind], a.stage))
        receive, forward = a.kind in (Kind.RECV_F, Kind.RECV_B), a.kind in (Kind.SEND_F, Kind.RECV_B)
        peer = self.owner[a.stage + 1 if forward else a.stage - 1]
        return i, self.names[i], (peer,), (f"receive {a} from rank {peer}" if receive else f"send {a} to rank {peer}")

    def _in_group(self, run: CollectiveKind, stage: int) -> tuple[tuple[int, ...], str]:
        """Whom a rank inside a collective of this kind waits for, and what it waits for: the group's other ranks
        (where the runtime knows them) named as the group's, or nobody for one it only launches."""
        doing = run.doing.format(stage=stage)
        if not run.waits_for_group:  # launched, not waited for: the worker waits after the step
            return (), f"nobody ({doing})"
        who, _ = GROUP_WORDS[run.group]
        peers = tuple(r for r in self.group_members.get(run.group, ()) if r != self.rank)
        named = f", {_ranks(peers)}" if peers else ""
        return peers, f"its {who} peers{named} ({doing})"

    def _batch_whereabouts(self, start: int, end: int) -> tuple[int, str, tuple[int, ...], str]:
        """A comm batch's whereabouts: its actions, every peer and what it exchanges with each."""
        parts = [self.at[i] for i in range(start, end)]
        if len(parts) == 1:
            return parts[0]
        peers = tuple(sorted({peer for _, _, ps, _ in parts for peer in ps}))
        return start, "+".join(name for _, name, _, _ in parts), peers, "; ".join(what for *_, what in parts)

    def _tag(self, sender_stage: int, mb: int, backward: bool) -> int:
        # Tags keep messages apart where the backend honours them (gloo); NCCL matches by
        # order instead, which lowering guarantees is the same at both ends.
        return (mb * self.plan.num_stages + sender_stage) * 2 + int(backward)

    def _program(self) -> list:
        program, i, actions = [], 0, self.actions
        while i < len(actions):
            a, end = actions[i], self.batch_end.get(i)
            if end is not None:
                program.append(self._batch(i, end))
                i = end
                continue
            if a.kind in COLLECTIVE_KINDS:
                program.append(_Collective(i, a, self.at[i], self.names[i], self.run_collective[a.kind]))
            elif a.kind is Kind.OVERLAP:
                program.append(_Pair(i, a, self.at[i], self.names[i],
                                     tuple(self._compute_entry(i, p, (i, j)) for j, p in enumerate(a.parts)),
                                     self.releases.get(i, ())))
            else:
                program.append(self._compute_entry(i, a))
            i += 1
        return program

    def _compute_entry(self, i: int, a: Action, ready_key: int | tuple[int, int] | None = None) -> _Compute:
        stage, s, mb = self.stages.get(a.stage), a.stage, a.microbatch
        take = hand = None
        cast = False
        if a.kind in (Kind.F, Kind.B, Kind.I) and stage is not None:
            forward = a.kind is Kind.F
            kind, source, to = (Kind.F, s - 1, s + 1) if forward else (Kind.B, s + 1, s - 1)
            if not (stage.is_first if forward else stage.is_last):
                take = (kind, s, mb)
                # A message arrives in message_dtype; a tensor handed over on this rank is cast as it always was.
                cast = self.owner[source] == self.rank or self.message_dtype != self.dtype
            if not (stage.is_last if forward else stage.is_first):
                if self.owner[to] == self.rank:  # the next stage lives here too (V-shape turn)
                    hand = ((kind, to, mb),)
                else:
                    send = self.send_of.get((kind, s, mb))
                    hand = ((kind, s, mb), None if send is None else self._send_fields(send),
                            self.eager_sends and not self._sent_next(i, send))
        return _Compute(i, a, self.at[i], self.names[i], a.kind, stage, mb, take, cast, hand,
                        self.ready_at.get(i if ready_key is None else ready_key),
                        self.releases.get(i, ()) if ready_key is None else ())

    def _sent_next(self, i: int, send: Action | None) -> bool:
        """Whether `send` is in the comm batch right after action i: posted there with that batch's receives,
        it leaves as early as an eager post would, and gloo moves the pair in one exchange (posted alone, a
        send's handshake costs both ranks' gloo threads a round of their own, and the step waits on them)."""
        end = self.batch_end.get(i + 1)
        return send is not None and end is not None and i + 1 <= self.index_of[send] < end

    def _batch(self, first: int, end: int) -> _Batch:
        sends, recvs = [], []
        for i in range(first, end):
            a = self.actions[i]
            s, mb = a.stage, a.microbatch
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                key = _outbox_key(a)
                release = self.stages[s].release_output if key[0] is Kind.F and s in self.stages else None
                sends.append((key, a, *self._send_fields(a), release, mb))
            else:
                backward = a.kind is Kind.RECV_B
                sender = s + 1 if backward else s - 1
                key = (Kind.B if backward else Kind.F, s, mb)
                recvs.append((key, self.owner[sender], self._tag(sender, mb, backward), f"receive {a}", self.at[i]))
        return _Batch(first, self.actions[first], self.batch_at[first], tuple(self.names[first:end]), tuple(sends),
                      tuple(recvs))

    def _send_fields(self, a: Action) -> tuple[int, int, str]:
        """A SEND's (peer, tag, label)."""
        forward = a.kind is Kind.SEND_F
        return self.owner[a.stage + 1 if forward else a.stage - 1], self._tag(a.stage, a.microbatch, not forward), \
            f"send {a}"

    def step(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None,
             record: bool = True, documents: list | None = None,
             activation_shape: tuple[int, ...] | None = None) -> StepResult:
        """Run one training step's forward and backward; gradients accumulate in the stages' params.
        record=False: no per-action timestamps (no clock reads; on CUDA no events and no synchronisation).
        documents: per microbatch, its document boundaries (pipegpt.model.gpt.Documents), for every stage.
        activation_shape: this step's messages' shape, when not the run's (scoring: sequences of another length)."""
        shape = activation_shape or self.activation_shape
        inbox: dict[tuple[Kind, int, int], torch.Tensor] = {}  # (F|B, stage, mb) -> tensor to consume
        self.arriving = {}  # inbox key -> (its receive's Message, whereabouts): posted, waited for by its consumer
        outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}  # (F|B, stage, mb) -> tensor to send
        self.in_flight = in_flight = {}
        events: list = []
        if record:
            self.clock.start()
        clock = self.clock.mark
        self.marks = marks = []
        for entry in self.program:
            self.now = entry.where
            t0 = clock() if record else None
            if type(entry) is _Batch:
                self._communicate(entry, inbox, outbox, in_flight, shape)
                if record:
                    t1 = clock()
                    events.extend((name, t0, t1) for name in entry.names)
            else:
                if type(entry) is _Compute:
                    self._before(entry, entry.where)
                    self._compute(entry, inputs, targets, inbox, outbox, documents)
                elif type(entry) is _Pair:
                    self._compute_pair(entry, inputs, targets, inbox, outbox, documents)
                else:
                    entry.run(entry.action.stage)
                if record:
                    events.append((entry.name, t0, clock()))
            if self.marker is not None:
                marks.append((entry.where, self.marker(entry.action)))
            if self.after_action is not None:
                self.after_action(inbox, outbox, in_flight)
        for message, now in self.arriving.values():  # none: every compute takes its receives (kept for safety)
            self.now = now
            self.p2p.wait(message)
        self.arriving.clear()
        for action, message in in_flight.items():  # sends no later message of the plan acknowledged
            self.now = self.at[self.index_of[action]]
            self.p2p.wait(message)
        in_flight.clear()
        peers = self.p2p.unsettled_peers()
        if peers:  # CUDA: the host waits for the step's communication here
            self.now = (None, "end of step", peers, f"this step's communication with {_ranks(peers)}")
        if self.before_settle is not None:
            self.before_settle()
        self.p2p.settle()
        self.now = None
        losses = [loss for stage in self.stages.values() for loss in stage.pop_losses()]
        losses = torch.stack(losses).tolist() if losses else []  # one device-to-host transfer
        return StepResult(losses, self.clock.resolve(events) if record else [])

    def _compute(self, c: _Compute, inputs, targets, inbox, outbox, documents=None) -> None:
        stage, mb, kind = c.stage, c.mb, c.kind
        if kind is Kind.W:
            stage.backward_weight(mb)
            return
        received = self._take(c, inbox)
        if c.releases:
            self._release(c.releases)
        if kind is Kind.F:
            out = stage.forward(mb, inputs[mb] if stage.is_first else received,
                                targets[mb] if stage.is_last else None, None if documents is None else documents[mb])
        else:
            out = stage.backward(mb, received, split=kind is Kind.I)
        if c.hand is not None:
            self._hand_over(c, out, inbox, outbox)

    def _before(self, c: _Compute, where: tuple) -> None:
        """What runs before a compute: the collectives' ready() for its stage (ZeRO), the before_compute hook."""
        if c.ready is not None:
            self.now = c.ready[2]
            self.ready(c.ready[0], c.ready[1])
            self.now = where
        if self.before_compute is not None:
            self.before_compute(c.action)

    def _compute_pair(self, pair: _Pair, inputs, targets, inbox, outbox, documents=None) -> None:
        """The parts' pieces in turns (stages.stage.interleave): a part's receive still arriving is waited for
        before its first piece, and its output handed on as soon as it ends. (validate refuses a pair whose
        halves need each other; a part whose input is not here runs the parts in order, as a safeguard.)"""
        for c in pair.parts:  # every part's stage ready before any piece runs
            self._before(c, pair.where)
        if any(c.take is not None and c.take not in inbox for c in pair.parts):
            for c in pair.parts:
                self._compute(c, inputs, targets, inbox, outbox, documents)
        else:
            self._interleave_parts(pair, inputs, targets, inbox, outbox, documents)
        if pair.releases:  # after the pair: its parts wait for their inputs inside it
            self._release(pair.releases)

    def _interleave_parts(self, pair: _Pair, inputs, targets, inbox, outbox, documents) -> None:
        runs = []
        for c in pair.parts:  # a receive to cast (another dtype) is waited for before the pair, as _take does
            arriving = None if c.cast else self.arriving.pop(c.take, None)
            run = self._piece_run(c, inputs, targets, inbox, documents, waited=arriving is None)
            if arriving is not None:
                run.pending = _Arrival(self, *arriving, pair.where)
            runs.append(run)

        def handed(i: int, out) -> None:
            if pair.parts[i].hand is not None:
                self._hand_over(pair.parts[i], out, inbox, outbox)

        interleave(*runs, done=handed)

    def _take(self, c: _Compute, inbox, waited: bool = True) -> torch.Tensor | None:
        """The compute's input (F) or output gradient (B, I) from the inbox, in the parameters' dtype; waited=False:
        the caller waits for its receive before using it (a pair's part, at its first piece)."""
        if c.take is None:
            return None
        if waited and c.take in self.arriving:
            _Arrival(self, *self.arriving.pop(c.take), self.now).wait()
        received = inbox.pop(c.take)
        return received.to(self.dtype) if c.cast else received

    def _piece_run(self, c: _Compute, inputs, targets, inbox, documents, waited: bool = True) -> PieceRun:
        stage, mb, kind = c.stage, c.mb, c.kind
        if kind is Kind.W:
            return stage.weight_pieces(mb)
        received = self._take(c, inbox, waited)
        if kind is Kind.F:
            return stage.forward_pieces(mb, inputs[mb] if stage.is_first else received,
                                        targets[mb] if stage.is_last else None,
                                        None if documents is None else documents[mb])
        return stage.backward_pieces(mb, received, split=kind is Kind.I)

    def _hand_over(self, c: _Compute, tensor, inbox, outbox) -> None:
        if len(c.hand) == 1:  # the next stage lives here too (V-shape turn)
            inbox[c.hand[0]] = tensor
            return
        key, fields, eager = c.hand
        if eager:  # posted now; its SEND action takes the Message in
            if fields is None:
                raise KeyError(key)  # the plan has no SEND for this tensor
            message = Message(self._on_the_wire(tensor), *fields)
            self.p2p.post([message], [])
            outbox[key] = message
            if key[0] is Kind.F:  # a tensor went to a send: the message holds its storage, the stage need not
                c.stage.release_output(c.mb)
        else:
            outbox[key] = tensor

    def _on_the_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dtype == self.message_dtype else tensor.to(self.message_dtype)

    def _communicate(self, batch: _Batch, inbox, outbox, in_flight, shape: tuple[int, ...]) -> None:
        sends, posted, recvs = [], [], []
        for key, a, peer, tag, label, release, mb in batch.sends:
            item = outbox.pop(key)
            if isinstance(item, Message):
                posted.append((item, a))
            else:
                sends.append((Message(self._on_the_wire(item), peer, tag, label), a))
                if release is not None:  # the message holds the output's storage now, the stage need not
                    release(mb)
        for key, peer, tag, label, _ in batch.recvs:
            buffer = torch.empty(shape, dtype=self.message_dtype, device=self.device)
            recvs.append(Message(buffer, peer, tag, label))
            inbox[key] = buffer
        self.p2p.post([m for m, _ in sends], recvs)
        for message, (key, *_, now) in zip(recvs, batch.recvs):  # waited for by the compute that reads it
            self.arriving[key] = (message, now)
        in_flight.update((a, m) for m, a in posted + sends)

    def _release(self, releases: tuple) -> None:
        """Wait for and drop the sends whose receivers have them (release_points): waiting does not stall."""
        where = self.now
        for action, now in releases:
            self.now = now
            self.p2p.wait(self.in_flight.pop(action))
        self.now = where
