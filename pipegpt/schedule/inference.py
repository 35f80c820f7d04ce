"""Forward-only plans for inference, as data.

Scoring (validation loss, HellaSwag) runs a training plan's forwards alone (Plan.forward_only, lowered as any plan).
Generation runs a decode plan: the prompts in G groups, each group one microbatch per step (mb = step x G + group):
step 0 is the prefill of the group's prompts, each later step one new token per prompt. A group's next step on the
first stage needs the token its last stage chose the step before; the plan's meta says so (decode_groups = G) and
validate.dependencies adds that edge, so validation, simulation and the pictures see the loop.

With G >= stages every stage works on some group while the others decode: at zero message latency the steady
state has no bubble. With G < stages each rank idles 1 - G / stages of every step (a group's round trip through
the stages is the step's length, and a rank works G forwards of it).
"""
from __future__ import annotations

from numbers import Real

from .actions import Kind, Plan, ScheduleError, F
from .simulate import _ratio

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


def steady_state_bubble(timeline, plan: Plan) -> list[Real] | None:
    """Per rank, the idle share of one decode step late in the loop (its steady state): from the rank's start of
    step k's first group to its start of step k + 1's, k = steps - 2. None below 3 steps (step 0 is the prefill,
    so no decode step is both entered and left inside the loop)."""
    groups, steps = plan.meta.get(DECODE_GROUPS), plan.meta.get("decode_steps", 0)
    if not groups or steps < 3:
        return None
    k = steps - 2
    starts, busy = {}, [0] * timeline.num_ranks
    for e in timeline.events:
        if e.action.kind is not Kind.F:
            continue
        step, _ = divmod(e.action.microbatch, groups)
        if step == k:
            busy[e.rank] += e.end - e.start
        if step in (k, k + 1):
            starts[(e.rank, step)] = min(starts.get((e.rank, step), e.start), e.start)
    bubbles = []
    for r in range(timeline.num_ranks):
        period = starts[(r, k + 1)] - starts[(r, k)]
        bubbles.append(1 - _ratio(busy[r], period) if period else 0)
    return bubbles
