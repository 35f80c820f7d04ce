"""Lower bounds the search prunes with (pipegpt.planner.search's docstring says how): a layout's, below every
plan of it, and a candidate's, below the simulator's makespan for any schedule on its placement. A bound
that overestimated would drop the best plan unseen; tests/unit/test_plan.py checks both against the
simulator."""
from __future__ import annotations

import math

from pipegpt.costs.stage_costs import PER_SEQUENCE


def layout_lower_bound(pieces, blocks, sequences: int, pp: int) -> float:
    """Below any plan of a layout: a replica's least work (its `sequences`, no recomputation) spread evenly
    over its pp ranks. pieces: pipegpt.costs.cost.Pieces at PER_SEQUENCE sequences per microbatch (its embed
    and head read); blocks: (how many, one block's Piece at PER_SEQUENCE) per layer kind of the model."""
    per = lambda p: p.f + p.b + p.comm_f + p.comm_b  # noqa: E731
    work = (sum(n * per(block) for n, block in blocks) + per(pieces.embed) + per(pieces.head)) / PER_SEQUENCE
    return sequences * work / pp


def makespan_lower_bound(F, B, W, TP, comm, dpc, placement, m, split) -> float:
    """Below the simulator's makespan for ANY schedule with this placement: for each rank, the forward chain
    that must reach its first stage, all its work (m microbatches), and what must follow its last action
    -- the backward chain below it (less the W work that may fill it, when `split`) or its smallest stage's
    gradient all-reduce; the largest over the ranks."""
    S = len(placement)
    p = max(placement) + 1
    smin = [S] * p
    busy = [0.0] * p
    wsum = [0.0] * p
    mindp = [math.inf] * p
    for s, r in enumerate(placement):
        if s < smin[r]:
            smin[r] = s
        busy[r] += F[s] + B[s] + 2 * TP[s]
        wsum[r] += W[s]
        if dpc[s] < mindp[r]:
            mindp[r] = dpc[s]
    fwd = bwd = 0.0
    chain_f, chain_b = [0.0], [0.0]
    for s in range(S - 1):
        hop = comm if placement[s] != placement[s + 1] else 0.0
        fwd += F[s] + TP[s] + hop
        bwd += (B[s] - W[s] if split else B[s]) + TP[s] + hop
        chain_f.append(fwd)
        chain_b.append(bwd)
    best = 0.0
    for r in range(p):
        tail = chain_b[smin[r]]
        if split:
            tail = max(0.0, tail - m * wsum[r])
        best = max(best, chain_f[smin[r]] + m * busy[r] + max(tail, mindp[r]))
    return best
