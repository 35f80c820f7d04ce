"""Schedule generators: plain integers in, a Plan of compute actions out.

Each generator returns, per rank, the ordered F/B/I/W actions; lowering.py adds
the communication. registry.py names them and declares their placement.
"""
from __future__ import annotations

from collections import deque


from .actions import Action, Composite, Kind, Plan, ScheduleError, B, F, I, W


def _check_positive(num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1:
        raise ScheduleError(f"stages={num_ranks} must be at least 1")
    if num_microbatches < 1:
        raise ScheduleError(f"microbatches={num_microbatches} must be at least 1")


def gpipe(num_ranks: int, num_microbatches: int) -> Plan:
    """All forwards, then all backwards: simple, but every rank holds m activations."""
    _check_positive(num_ranks, num_microbatches)
    m = num_microbatches
    ranks = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(num_ranks)]
    return Plan("gpipe", m, tuple(range(num_ranks)), tuple(map(tuple, ranks)))


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Plan:
    """1F1B (PipeDream-flush): warm up with p-1-r forwards, then alternate, then drain."""
    _check_positive(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [F(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [F(r, warmup + i), B(r, i)]
        acts += [B(r, i) for i in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return Plan("1f1b", m, tuple(range(p)), tuple(ranks))


def one_f_one_b_overlap(num_ranks: int, num_microbatches: int) -> Plan:
    """Combined 1F1B (Megatron-Core's combined_1f1b, on one stage per rank): in the steady state each rank runs
    the forward of microbatch i + w and the backward of microbatch i as one pair, each half's communication (an
    MoE stage's all-to-all) hidden under the other's compute. A pair hands its outputs on only when it ends, so
    rank r warms up with w = 2(p - r) - 1 forwards, not 1F1B's p - r - 1: its pair k then needs what rank r + 1's
    pair k sends back, which needs rank r's pair k - 2, and the ranks keep pace (with 1F1B's p - r the pairs
    would wait for each other: a third longer). The price is memory: rank r holds 2(p - r) microbatches."""
    _check_positive(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ranks = []
    for r in range(p):
        warmup = min(2 * (p - r) - 1, m)
        acts = [F(r, i) for i in range(warmup)]
        acts += [Composite.of(F(r, warmup + i), B(r, i)) for i in range(m - warmup)]
        acts += [B(r, i) for i in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return Plan("1f1b-overlap", m, tuple(range(p)), tuple(ranks))


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int = 2) -> Plan:
    """Megatron's interleaved 1F1B: rank r owns stages r, r+p, r+2p, ...

    Microbatches go round in rounds: each model chunk takes a round's microbatches before the next
    chunk does. There are m // p rounds (at least one) of equal size, so m must be a multiple of its
    round count (as torch.distributed.pipelining's): any m below 2p, or a multiple of p, or e.g. 10 at p = 4.
    """
    _check_positive(num_ranks, num_microbatches)
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if v < 1:
        raise ScheduleError(f"virtual-stages={v} must be at least 1")
    rounds = max(1, m // p)
    if m % rounds:
        valid = [x for x in range(max(1, m - p), m + p + 1) if x % max(1, x // p) == 0]
        nearest = sorted(valid, key=lambda x: (abs(x - m), x))[:2]
        raise ScheduleError(
            f"interleaved-1f1b runs microbatches in m // stages = {rounds} equal rounds, which microbatches={m} "
            f"does not divide (nearest valid: {' or '.join(map(str, sorted(nearest)))})"
        )
    group = m // rounds  # microbatches per round, at least p

    def order(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // group) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (group * v)) * group + k % group

    total = m * v
    ranks = []
    for r in range(p):
        fwd = [F(c * p + r, mb) for c, mb in (order(k, False) for k in range(total))]
        bwd = [B(c * p + r, mb) for c, mb in (order(k, True) for k in range(total))]
        warmup = min((p - 1 - r) * 2 + (v - 1) * group, total)
        acts = fwd[:warmup]
        for i in range(total - warmup):
            acts += [fwd[warmup + i], bwd[i]]
        acts += bwd[total - warmup:]
        ranks.append(tuple(acts))
    return Plan("interleaved-1f1b", m, looped(p, v), tuple(ranks), meta={"virtual_stages": v})


def looped(num_ranks: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Rank r holds stages r, r+p, r+2p, ...: one stage per rank at v=1, Megatron's interleaving above."""
    return tuple(s % num_ranks for s in range(num_ranks * virtual_stages))


def v_shape(num_ranks: int, virtual_stages: int = 2) -> tuple[int, ...]:
    """Stage s on rank s going down, then back up: rank r holds stages r and 2p-1-r (a zigzag past v=2)."""
    return tuple(r if c % 2 == 0 else num_ranks - 1 - r for c in range(virtual_stages) for r in range(num_ranks))


def _greedy_zero_bubble(stage_to_rank: tuple[int, ...], m: int, limits: list[int]) -> list[list[Action]]:
    """List-schedule F, I, W at unit cost, the way the zero-bubble paper builds its plans.

    At every time step each idle rank takes, in priority order: an input-gradient
    backward that is ready (it is on the critical path), a forward if the rank
    holds fewer than limits[rank] live microbatches, else the oldest pending W.
    W work thus fills what would otherwise be bubbles. Stages process
    microbatches in order. Deterministic: the same integers give the same plan.
    """
    num_stages, num_ranks = len(stage_to_rank), max(stage_to_rank) + 1
    # Deepest stage first, for backwards (it unblocks everything upstream) and forwards (it reaches the loss sooner).
    deepest_first = [[s for s in reversed(range(num_stages)) if stage_to_rank[s] == r] for r in range(num_ranks)]
    # When each F and I finishes, by stage and microbatch (None: not yet): the planner builds thousands of these
    # plans, and looking up Action keys was most of their time.
    done_f = [[None] * m for _ in range(num_stages)]
    done_i = [[None] * m for _ in range(num_stages)]
    last = num_stages - 1
    next_f = [0] * num_stages
    next_i = [0] * num_stages
    pending_w: list[deque[Action]] = [deque() for _ in range(num_ranks)]
    live = [0] * num_ranks
    plan: list[list[Action]] = [[] for _ in range(num_ranks)]
    total = 3 * num_stages * m
    scheduled = 0
    t = 0
    while scheduled < total:
        for r in range(num_ranks):  # every action takes one step, so every rank is free at each step
            choice = None
            for s in deepest_first[r]:
                mb = next_i[s]
                if mb < next_f[s]:
                    downstream = done_i[s + 1][mb] if s != last else t
                    made = done_f[s][mb]
                    if downstream is not None and downstream <= t and made is not None and made <= t:
                        choice = I(s, mb)
                        done_i[s][mb] = t + 1
                        next_i[s] = mb + 1
                        pending_w[r].append(W(s, mb))
                        break
            if choice is None and live[r] < limits[r]:
                for s in deepest_first[r]:
                    mb = next_f[s]
                    if mb < m:
                        upstream = done_f[s - 1][mb] if s else t
                        if upstream is not None and upstream <= t:
                            choice = F(s, mb)
                            done_f[s][mb] = t + 1
                            next_f[s] = mb + 1
                            live[r] += 1
                            break
            if choice is None and pending_w[r]:
                choice = pending_w[r].popleft()
                live[r] -= 1
            if choice is None:
                continue
            plan[r].append(choice)
            scheduled += 1
        t += 1
        if t > 10 * total + 10:  # cannot happen for sane limits; never loop forever
            raise ScheduleError(f"greedy zero-bubble scheduling made no progress (limits={limits})")
    return plan


def zb_h1(num_ranks: int, num_microbatches: int) -> Plan:
    """ZB-H1: 1F1B with B split into I and W; rank r keeps up to r W passes pending.

    I is on the critical path and goes first; the deferred W fill the gaps the
    next I would otherwise leave, which cuts the bubble to a third of 1F1B's at
    F = I = W. Rank r holds p-r forwards plus r deferred W: p live microbatches,
    1F1B's peak (rank 0's).
    """
    _check_positive(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [F(r, i) for i in range(warmup)]
        pending: deque[Action] = deque()

        def backward(mb: int) -> None:
            acts.append(I(r, mb))
            pending.append(W(r, mb))
            if len(pending) > r:
                acts.append(pending.popleft())

        for i in range(m - warmup):
            acts.append(F(r, warmup + i))
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        acts += pending
        ranks.append(tuple(acts))
    return Plan("zb-h1", m, tuple(range(p)), tuple(ranks))


def zbv(num_ranks: int, num_microbatches: int) -> Plan:
    """ZB-V: two stages per rank in a V, split backward, peak memory of 1F1B.

    Each stage holds half a 1F1B stage's layers, so 2p live stage-microbatches
    per rank weigh what 1F1B's p on rank 0 weigh.
    """
    _check_positive(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    stage_to_rank = v_shape(p)
    plan = _greedy_zero_bubble(stage_to_rank, m, [2 * p] * p)
    return Plan("zbv", m, stage_to_rank, tuple(map(tuple, plan)))


def dualpipev(num_ranks: int, num_microbatches: int) -> Plan:
    """DualPipe-V (DeepSeek): V placement, phases of overlapped forward+backward pairs.

    The main phase's pairs (the forward of one stage of the rank with the backward of its other stage, two
    microbatches) are Composite actions: the timing rule hides each half's all-to-all under the other's
    compute, and the runtime runs their pieces in turns (Plan.flattened() is the same order without pairs).
    """
    _check_positive(num_ranks, num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ScheduleError(
            f"dualpipev needs microbatches >= 2 x stages = {2 * p}; microbatches={m} is too few "
            f"(nearest valid: {2 * p})"
        )
    ranks = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        nxt = {}
        weights: deque[Action] = deque()
        acts: list[Action] = []

        def take(kind: Kind, stage: int) -> None:
            key = (Kind.B if kind is Kind.I else kind, stage)
            mb = nxt.get(key, 0)
            nxt[key] = mb + 1
            acts.append(Action(stage, kind, mb))
            if kind is Kind.I:
                weights.append(W(stage, mb))

        def weight() -> None:
            acts.append(weights.popleft())

        for _ in range((p - r - 1) * 2):
            take(Kind.F, s0)
        for _ in range(r + 1):
            take(Kind.F, s0)
            take(Kind.F, s1)
        for _ in range(p - r - 1):
            take(Kind.I, s1)
            weight()
            take(Kind.F, s1)
        for _ in range(m - 2 * p + r + 1):  # the main phase: F0+B1 and F1+B0 pairs
            take(Kind.F, s0)
            take(Kind.B, s1)
            acts[-2:] = [Composite.of(*acts[-2:])]
            take(Kind.F, s1)
            take(Kind.B, s0)
            acts[-2:] = [Composite.of(*acts[-2:])]
        for _ in range(p - r - 1):
            take(Kind.B, s1)
            take(Kind.F, s1)
            take(Kind.B, s0)
        split = False  # the second half of the drain splits backward to let W fill the tail
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            take(Kind.I if split else Kind.B, s1)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            take(Kind.I if split else Kind.B, s0)
        for _ in range(p - r - 1):
            weight()
            take(Kind.I, s0)
        while weights:
            weight()
        ranks.append(tuple(acts))
    return Plan("dualpipev", m, v_shape(p), tuple(ranks))


# ---------------------------------------------------------------------------------------------------------
# Generation's decode plans (forward only)
#
# Forward-only plans for inference, as data.
#
# Scoring (validation loss, HellaSwag) runs a training plan's forwards alone (Plan.forward_only, lowered as any plan).
# Generation runs a decode plan: the prompts in G groups, each group one microbatch per step (mb = step x G + group):
# step 0 is the prefill of the group's prompts, each later step one new token per prompt. A group's next step on the
# first stage needs the token its last stage chose the step before; the plan's meta says so (decode_groups = G) and
# validate.dependencies adds that edge, so validation, simulation and the pictures see the loop.
#
# With G >= stages every stage works on some group while the others decode: at zero message latency the steady
# state has no bubble. With G < stages each rank idles 1 - G / stages of every step (a group's round trip through
# the stages is the step's length, and a rank works G forwards of it).

DECODE_GROUPS = "decode_groups"  # Plan.meta key: the groups of a decode plan (validate.dependencies reads it)


def decode_plan(stages: int, groups: int, steps: int) -> Plan:
    """Every rank one stage; each step every group once, in group order: F(s, k x groups + g)."""
    for name, value in (("stages", stages), ("groups", groups), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}={value!r} must be an integer >= 1")
    ranks = tuple(tuple(F(s, k * groups + g) for k in range(steps) for g in range(groups)) for s in range(stages))
    return Plan("decode", groups * steps, tuple(range(stages)), ranks,
                meta={DECODE_GROUPS: groups, "decode_steps": steps})


def decode_position(plan: Plan, microbatch: int) -> tuple[int, int]:
    """(step, group) of a decode plan's microbatch."""
    return divmod(microbatch, plan.meta[DECODE_GROUPS])
