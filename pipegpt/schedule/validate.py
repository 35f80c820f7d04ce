"""The validator: a plan the runtime may execute is complete, ordered and deadlock-free.

Errors name the rank and the step and show the plan around it.

Collectives are checked where a plan has them: a stage's REDUCE_GRAD comes once, after its last B or W on
its rank, and a plan that reduces one stage's gradients reduces every stage's. A stage with an UNSHARD is
sharded until it (ZeRO-3): UNSHARD and RESHARD alternate, starting with an UNSHARD and ending with a RESHARD,
and no compute action of the stage runs while it is sharded (whether a run shards every stage is the
training role's to check: pipegpt.train.grad_sync). They block nothing here: a gather waits only for the
stage's replicas, which run the same plan and so launch their collectives in the same order: they cannot
deadlock with each other or with messages.

A composite (actions.Composite) is checked as its parts in order: each part's dependencies, counts and
messages as if the parts stood one after the other where the composite stands (errors then count steps
with the parts apart). And as one action: a pair starts once, so what either part needs from outside it
must be there before it. A pair's halves run at once, so they are of one rank's stages and neither needs the
other (_check_pairs). held_live / check_max_live: what a rank holds at each action in plan order, a pair
holding both halves' microbatches together (its forward's new one before its backward frees the other).
"""
from __future__ import annotations

from collections import defaultdict

from .actions import COLLECTIVE_KINDS, NO_MICROBATCH, Action, Kind, Plan, PlanError, ScheduleError, parts_of
from .messages import comm_batches, comm_runs, messages, peer


def dependencies(action: Action, plan: Plan) -> list[Action]:
    """Compute actions that must finish before this compute action may start (a composite: its parts', but
    those on each other)."""
    if action.kind is Kind.OVERLAP:
        deps = [d for part in action.parts for d in dependencies(part, plan)]
        return [d for d in dict.fromkeys(deps) if d not in action.parts]
    s, mb, last = action.stage, action.microbatch, plan.num_stages - 1
    if action.kind is Kind.F:
        if s > 0:
            return [Action(s - 1, Kind.F, mb)]
        groups = plan.meta.get("decode_groups")  # generation: a group's next step takes its last stage's token
        return [Action(last, Kind.F, mb - groups)] if groups and mb >= groups else []
    if action.kind in (Kind.B, Kind.I):
        deps = [Action(s, Kind.F, mb)]
        if s < last:
            deps.append(plan.backward_of(s + 1, mb))
        return deps
    if action.kind is Kind.W:
        return [Action(s, Kind.I, mb)]
    return []


def validate(plan: Plan) -> Plan:
    """Raise PlanError/ScheduleError if the plan is not executable; return it unchanged otherwise."""
    if plan.has_composites:
        _check_pairs(plan)
        validate(plan.flattened())
        _check_order(plan.compute_only())
        return plan
    has_collectives = _check_shape(plan)
    _check_counts(plan)
    _check_order(plan.compute_only())
    if has_collectives:
        _check_collectives(plan)
    if plan.is_lowered:
        _check_messages(plan)
        check_deadlock_free(plan)
    return plan


def _check_pairs(plan: Plan) -> None:
    """Each pair's halves on the rank of its line, and neither needing the other (they run at once)."""
    for r, actions in enumerate(plan.ranks):
        for k, a in enumerate(actions):
            if a.kind is not Kind.OVERLAP:
                continue
            for part in a.parts:
                if 0 <= part.stage < plan.num_stages and plan.stage_to_rank[part.stage] != r:
                    raise PlanError(plan, r, k, f"pair {a}: stage {part.stage} belongs to rank "
                                                f"{plan.stage_to_rank[part.stage]}; a pair's halves run on one rank")
            first, second = a.parts
            for needs, needed in ((first, second), (second, first)):
                if needed in dependencies(needs, plan):
                    raise PlanError(plan, r, k, f"pair {a}: {needs} needs {needed}, the other half; a pair's "
                                                f"halves run at once, so neither may depend on the other")


def held_live(plan: Plan, rank: int) -> list[int]:
    """Per action of the rank, the stage-microbatches whose activations it holds while the action runs (an F
    started, its backward B or I not yet done; W holds none: what it needs is the weight gradient's inputs, which
    the I left): a pair holds its forward's new microbatch together with its backward's."""
    live, held = 0, []
    for a in plan.ranks[rank]:
        parts = parts_of(a)
        forwards = sum(p.kind is Kind.F for p in parts)
        held.append(live + forwards)
        live += forwards - sum(p.kind in (Kind.B, Kind.I) for p in parts)
    return held


def check_max_live(plan: Plan, max_live: int) -> None:
    """Refuse a rank that holds more than max_live stage-microbatches at any action, naming the action."""
    for r in range(plan.num_ranks):
        for k, held in enumerate(held_live(plan, r)):
            if held > max_live:
                a = plan.ranks[r][k]
                what = (f"pair {a} holds {held} stage-microbatches together (its forward's and its backward's)"
                        if a.kind is Kind.OVERLAP else f"holds {held} stage-microbatches")
                raise PlanError(plan, r, k, f"{what}, more than the memory limit max_live={max_live}")


def _check_shape(plan: Plan) -> bool:
    """Raise on a rank, stage or microbatch out of place; return whether the plan has collectives."""
    if plan.num_ranks < 1 or not plan.stage_to_rank:
        raise ScheduleError("a plan needs at least one rank and one stage")
    if sorted(set(plan.stage_to_rank)) != list(range(plan.num_ranks)):
        raise ScheduleError(f"stage_to_rank {list(plan.stage_to_rank)} must use every rank 0..{plan.num_ranks - 1}")
    collectives = False
    for r, actions in enumerate(plan.ranks):
        for k, a in enumerate(actions):
            if not 0 <= a.stage < plan.num_stages:
                raise PlanError(plan, r, k, f"stage {a.stage} out of range 0..{plan.num_stages - 1}")
            if a.kind in COLLECTIVE_KINDS:
                if a.microbatch != NO_MICROBATCH:
                    raise PlanError(plan, r, k, f"{a.kind.value} acts on a whole stage: it takes no microbatch")
                collectives = True
            elif not 0 <= a.microbatch < plan.num_microbatches:
                raise PlanError(plan, r, k, f"microbatch {a.microbatch} out of range 0..{plan.num_microbatches - 1}")
            if plan.stage_to_rank[a.stage] != r:
                raise PlanError(plan, r, k, f"stage {a.stage} belongs to rank {plan.stage_to_rank[a.stage]}")
    return collectives


def _check_counts(plan: Plan) -> None:
    where: dict[Action, tuple[int, int]] = {}
    for r, actions in enumerate(plan.ranks):
        for k, a in enumerate(actions):
            if a.kind in (Kind.UNSHARD, Kind.RESHARD):  # as often as a policy gathers: _check_collectives pairs them
                continue
            if a in where:
                raise PlanError(plan, r, k, f"{a} appears twice (first at rank {where[a][0]} step {where[a][1]})")
            where[a] = (r, k)
    training = not plan.is_forward_only  # an evaluation plan has forwards only
    for s in range(plan.num_stages):
        r = plan.stage_to_rank[s]
        for mb in range(plan.num_microbatches):
            has = {kind for kind in Kind if kind.is_compute and Action(s, kind, mb) in where}
            end = len(plan.ranks[r])
            if Kind.F not in has:
                raise PlanError(plan, r, end, f"missing {Action(s, Kind.F, mb)}")
            if not training:
                continue
            if Kind.B in has and has & {Kind.I, Kind.W}:
                raise PlanError(plan, r, where[Action(s, Kind.B, mb)][1],
                                f"stage {s} microbatch {mb} has both B and an I/W split")
            if Kind.B not in has and has & {Kind.I, Kind.W} != {Kind.I, Kind.W}:
                missing = "B" if not has & {Kind.I, Kind.W} else ("I" if Kind.I not in has else "W")
                raise PlanError(plan, r, end, f"missing {s}{missing}{mb}")


def _check_order(plan: Plan) -> None:
    """Run the plan on dependencies alone; a rank that can never proceed is an error."""
    done: set[Action] = set()
    pos = [0] * plan.num_ranks
    where = {p: (r, k) for r, acts in enumerate(plan.ranks) for k, a in enumerate(acts) for p in parts_of(a)}
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(plan.ranks):
            while pos[r] < len(actions) and all(d in done for d in dependencies(actions[pos[r]], plan)):
                done.update(parts_of(actions[pos[r]]))
                pos[r] += 1
                progress = True
    stuck = [r for r in range(plan.num_ranks) if pos[r] < len(plan.ranks[r])]
    if not stuck:
        return
    waits = []
    for r in stuck:
        a = plan.ranks[r][pos[r]]
        missing = next(d for d in dependencies(a, plan) if d not in done)
        dr, dk = where[missing]
        if dr == r and dk > pos[r]:
            raise PlanError(plan, r, pos[r], f"needs {missing}, which comes later on the same rank (step {dk})")
        waits.append(f"rank {r} step {pos[r]} ({a}) waits for {missing} (rank {dr} step {dk})")
    r = stuck[0]
    raise PlanError(plan, r, pos[r], "circular wait: " + "; ".join(waits))


def _check_collectives(plan: Plan) -> None:
    """Each collective where the module docstring says (duplicates are _check_counts' to refuse)."""
    reduced = {a.stage for acts in plan.ranks for a in acts if a.kind is Kind.REDUCE_GRAD}
    for r, actions in enumerate(plan.ranks):
        gradients: dict[int, int] = {}  # stage -> the step of its last B or W
        for k, a in enumerate(actions):
            if a.kind is Kind.B or a.kind is Kind.W:
                gradients[a.stage] = k
        for k, a in enumerate(actions):
            # A plan with a REDUCE_GRAD is a training plan: _check_counts saw every stage's B or W.
            if a.kind is Kind.REDUCE_GRAD and k < gradients[a.stage]:
                last = actions[gradients[a.stage]]
                raise PlanError(plan, r, k, f"reduces stage {a.stage}'s gradients before {last}, its last gradient")
        for s in plan.stages_of(r):
            _check_sharding(plan, r, s)
            if reduced and s not in reduced:
                raise PlanError(plan, r, len(actions), f"missing {s}{Kind.REDUCE_GRAD.value}: the plan "
                                                       f"reduces other stages' gradients")


def _check_sharding(plan: Plan, r: int, s: int) -> None:
    """Stage s's UNSHARD/RESHARD on rank r alternate, and it computes only while gathered."""
    actions = plan.ranks[r]
    steps = [(k, a) for k, a in enumerate(actions) if a.stage == s and (a.kind.is_compute or a.kind in
                                                                        (Kind.UNSHARD, Kind.RESHARD))]
    if not any(a.kind in (Kind.UNSHARD, Kind.RESHARD) for _, a in steps):
        return  # not sharded
    gathered, unused = False, None  # unused: a compute that ran sharded, not yet explained
    freed_at = None
    for k, a in steps:
        if a.kind is Kind.UNSHARD:
            if gathered:
                raise PlanError(plan, r, k, f"gathers stage {s}'s parameters again: no {s}RESHARD since the last")
            if unused is not None:
                if freed_at is not None:
                    raise PlanError(plan, r, freed_at, f"frees stage {s}'s parameters before {unused} uses them")
                raise PlanError(plan, r, k, f"gathers stage {s}'s parameters after {unused} used them")
            gathered = True
        elif a.kind is Kind.RESHARD:
            if not gathered:
                raise PlanError(plan, r, k, f"has no {s}{Kind.UNSHARD.value} to go with it")
            gathered, freed_at = False, k
        elif not gathered and unused is None:
            unused = a
    if unused is not None:
        if freed_at is not None:
            raise PlanError(plan, r, freed_at, f"frees stage {s}'s parameters before {unused} uses them")
        first = next(k for k, a in steps if a == unused)
        raise PlanError(plan, r, first, f"computes on stage {s} while its parameters are sharded (no {s}UNSHARD "
                                        f"before it)")
    if gathered:
        last = max(k for k, a in steps if a.kind is Kind.UNSHARD)
        raise PlanError(plan, r, last, f"has no {s}{Kind.RESHARD.value} to go with it")


def _check_messages(plan: Plan) -> None:
    """Every cross-rank edge has one SEND after its producer and one RECV before its consumer, in FIFO order."""
    for r, (got, want) in enumerate(zip(plan.ranks, messages(plan))):
        got_comm = {a for a in got if a.kind.is_p2p}
        for a in sorted(got_comm - want):
            raise PlanError(plan, r, got.index(a), f"{a} matches no message between ranks")
        for a in sorted(want - got_comm):
            raise PlanError(plan, r, len(got), f"missing {a}")
        index = {a: k for k, a in enumerate(got)}
        for k, a in enumerate(got):
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                producer = Action(a.stage, Kind.F, a.microbatch) if a.kind is Kind.SEND_F \
                    else plan.backward_of(a.stage, a.microbatch)
                if index[producer] > k:
                    raise PlanError(plan, r, k, f"sends before {producer} has computed it")
            elif a.kind.is_p2p:
                consumer = Action(a.stage, Kind.F, a.microbatch) if a.kind is Kind.RECV_F \
                    else plan.backward_of(a.stage, a.microbatch)
                if index[consumer] < k:
                    raise PlanError(plan, r, k, f"receives after {consumer} needed it")
    # NCCL matches point-to-point messages per pair of ranks in posting order.
    sent, received = defaultdict(list), defaultdict(list)
    for r, actions in enumerate(plan.ranks):
        for k, a in enumerate(actions):
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                dst, partner = peer(a, plan)
                sent[(r, dst)].append((a, k))
            elif a.kind.is_p2p:
                src, _ = peer(a, plan)
                received[(src, r)].append((a, k))
    for (src, dst), sends in sent.items():
        for (send, k), (recv, j) in zip(sends, received[(src, dst)]):
            if peer(send, plan)[1] != recv:
                raise PlanError(plan, dst, j, f"receives {recv} from rank {src} while rank {src} sends {send} "
                                              f"(its step {k}) first: messages between two ranks must keep order")


def check_deadlock_free(plan: Plan) -> None:
    """Execute the lowered plan with blocking point-to-point and prove every rank finishes.

    Each comm batch on a rank (messages.comm_batches: a maximal run of comm actions, whose sends after
    its last receive are a batch of their own, as NCCL's order matching posts them) is posted together,
    and the rank waits there until every message in it has met its partner. Compute never blocks here
    because _check_order and _check_messages already hold.
    """
    stuck = _first_deadlock(plan, comm_batches)
    if stuck is not None:
        r, at, waits = stuck
        why = "deadlock with blocking point-to-point: " + "; ".join(waits)
        if _first_deadlock(plan, comm_runs) is None:
            why += (" (a run's sends after its last receive are posted as a batch of their own, behind it: "
                    "put each such send before the receive its peer posts first)")
        raise PlanError(plan, r, at, why)


def _first_deadlock(plan: Plan, batches_of) -> tuple[int, int, list[str]] | None:
    """(the first stuck rank, its step, what each stuck rank waits for) when the plan's batches, as batches_of
    cuts a rank's actions, cannot all complete; None when they can."""
    batches = [batches_of(acts) for acts in plan.ranks]
    batch_at = [{start: end for start, end in b} for b in batches]
    pos = [0] * plan.num_ranks
    posted: set[tuple[int, Action]] = set()
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(plan.ranks):
            while pos[r] < len(actions):
                end = batch_at[r].get(pos[r])
                if end is None:  # compute, or a collective: launched, not waited for
                    pos[r] += 1
                    progress = True
                    continue
                ops = actions[pos[r]:end]
                posted.update((r, a) for a in ops)
                if all(peer(a, plan) in posted for a in ops):
                    pos[r] = end
                    progress = True
                else:
                    break
    stuck = [r for r in range(plan.num_ranks) if pos[r] < len(plan.ranks[r])]
    if not stuck:
        return None
    waits = []  # only on failure, so the linear .index() lookups below are fine
    for r in stuck:
        end = batch_at[r][pos[r]]
        for a in plan.ranks[r][pos[r]:end]:
            pr, pa = peer(a, plan)
            if (pr, pa) not in posted:
                waits.append(f"rank {r} ({a}) waits for rank {pr} to post {pa} "
                             f"(its step {plan.ranks[pr].index(pa)}, it is at step {pos[pr]})")
                break
    return stuck[0], pos[stuck[0]], waits
