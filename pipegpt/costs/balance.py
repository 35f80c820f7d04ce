"""Cost-balanced stages: how many blocks each model stage gets so that the busiest RANK does the least work.

    balance_layers(layer_costs, embed_cost, head_cost, stage_to_rank) -> layers per model stage

Stage s holds a contiguous run of blocks; stage 0 also runs the embedding, the last stage the head and the loss;
every stage but the first and the last holds at least one block (pipegpt's rule, as in partition_layers). A rank
runs all the stages placed on it (V-shapes and interleaved schedules put several stages on one rank), so its load
is the sum of its stages' costs, and the quantity minimised is the largest rank load (the pipeline's bottleneck:
in steady state every rank waits for the slowest one). Pure Python, no torch.

Three methods, chosen by the input (`Balance.method` says which ran), the first two exact and polynomial:

* "uniform" -- every block costs the same (what `pipegpt run --balance cost` measures: all blocks have one
  shape, so one block's cost stands for all), any placement. Contiguity then does not constrain the rank loads:
  a rank's load is extra_r + b * N_r, where extra_r is its share of embedding and head and N_r the blocks it
  holds (any N_r >= its middle stages' minimum is realisable by some contiguous split, since the blocks are
  interchangeable). Adding the blocks one at a time, each to the rank whose load after the addition is the
  smallest, minimises the largest load. Proof: let M* be the optimum and suppose the greedy reaches a load
  M > M* when it adds some block to a rank. Greedy picked the smallest load-after-adding, so at that moment
  every rank r, holding N_r blocks, had extra_r + b * (N_r + 1) >= M > M*; an optimal split therefore gives
  every rank at most N_r blocks, i.e. at most sum N_r < n_layer blocks in all (this block was still to place):
  a contradiction. Among the splits that reach M*, the one nearest the even split (fewest blocks moved) is
  returned: each rank over its capacity under M* gives up exactly its excess (from its costliest stage), and
  the blocks freed go, one at a time, to the lightest rank with room. O(n_layer log ranks + stages).
* "chain" -- every rank holds one stage (1f1b, gpipe, zb-h1), any block costs: the classic min-max contiguous
  partition, an O(stages x n_layer^2) dynamic program over (stage, blocks used); a second DP then picks, among
  the splits within the optimum, the one nearest the even split.
* "search" -- several stages on a rank and unequal block costs (only per-layer costs given by hand, e.g.
  `simulate --layer-costs costs.json`, get here). A rank's load is then a sum of non-adjacent segments, so the
  contiguous-partition DP does not apply (its state would have to carry every open rank's load; a DP over the
  ranks with the open boundaries as state works for one placement at a time, O(L^2) states for a V and O(L^3)
  for looped v=2, and grows as L^(2v-1)). Branch and bound over the stage boundaries in stage order: the
  incumbent starts as the better of the even split and the "uniform" answer for the mean block cost (evaluated
  with the real costs), and counts near it are tried first; a branch is cut when a rank reaches the incumbent,
  or when relaxations that forget contiguity prove it cannot beat it: each rank with stages to come has a
  slack (incumbent - its load - the head if the last stage is its) which its remaining blocks' total must stay
  under, so it holds at most as many blocks as its slack holds of the cheapest remaining ones and at least its
  middle stages' minimum; together they must hold every remaining block, and the remaining total must fit in
  the slacks. More blocks on a stage only raise its rank's load, so the upward loop over counts stops at the
  first at or above the incumbent; states seen (stage, block, open ranks' loads, largest closed load) are not
  explored twice. Exact when it finishes; its worst case is exponential, so after `node_limit` nodes (~0.5 s)
  it returns its best split with exact=False and `lower_bound`, what the relaxations prove at the root (no
  split does better): a bound on the gap for that input. The brute-force tests always finish; random inputs
  with 8 ranks x 2 stages and 48 layers stop within 0.3-6% of their lower bound.

Costs are any non-negative numbers in one unit (seconds of forward + backward, say). Loads are compared with a
relative tolerance of 1e-9: floating-point noise in sums does not decide a split.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from numbers import Real

from pipegpt.arch import layer_kinds
from pipegpt.config import ConfigError
from pipegpt.schedule.simulate import Costs

TOLERANCE = 1e-9  # relative: two loads this close are equal
NODE_LIMIT = 50_000  # branch-and-bound nodes before "search" settles for its best split so far


@dataclass(frozen=True)
class Balance:
    """A split and what it costs: per stage, per rank (indexed by rank), and the largest rank load."""

    layers: tuple[int, ...]
    stage_costs: tuple[float, ...]
    rank_loads: tuple[float, ...]
    bottleneck: float
    method: str  # "uniform", "chain" or "search" (see the module's docstring)
    exact: bool = True  # False only when "search" stopped at its node limit
    lower_bound: float | None = None  # no split does better (the bottleneck itself when exact)

    def __post_init__(self):
        if self.lower_bound is None:
            object.__setattr__(self, "lower_bound", self.bottleneck)


def balance_layers(layer_costs: list[float], embed_cost: float, head_cost: float,
                   stage_to_rank: tuple[int, ...]) -> list[int]:
    """Blocks per model stage minimising the busiest rank's total cost (see the module's docstring)."""
    return list(balance(layer_costs, embed_cost, head_cost, stage_to_rank).layers)


def balance(layer_costs, embed_cost: float, head_cost: float, stage_to_rank, node_limit: int = NODE_LIMIT) -> Balance:
    """balance_layers with its costs: the split, each stage's and each rank's cost, the method used."""
    costs, placement = _check(layer_costs, embed_cost, head_cost, stage_to_rank)
    S, L = len(placement), len(costs)
    mins = _minimum_layers(S)
    if L < sum(mins):
        raise ConfigError(f"n_layer={L} is fewer than the {sum(mins)} middle stages that need a layer each "
                          f"({S} stages): use fewer stages or more layers")
    extra = _stage_extras(S, float(embed_cost), float(head_cost))
    if S == 1:
        return _result([L], costs, extra, placement, "uniform")
    if _uniform(costs):
        layers = _uniform_split(L, costs[0] if costs else 0.0, extra, mins, placement)
        return _result(layers, costs, extra, placement, "uniform")
    if len(set(placement)) == S:
        return _result(_chain_split(costs, extra, mins), costs, extra, placement, "chain")
    layers, exact, lower = _search_split(costs, extra, mins, placement, node_limit)
    return _result(layers, costs, extra, placement, "search", exact, lower)


def stage_costs(layers, layer_costs, embed_cost: float, head_cost: float) -> list[float]:
    """Each stage's cost for a split: its blocks, plus the embedding on stage 0 and the head on the last."""
    extra = _stage_extras(len(layers), float(embed_cost), float(head_cost))
    out, start = [], 0
    for s, n in enumerate(layers):
        out.append(extra[s] + sum(layer_costs[start:start + n]))
        start += n
    return out


def rank_loads(layers, layer_costs, embed_cost: float, head_cost: float, stage_to_rank) -> list[float]:
    """Each rank's total (the sum of its stages' costs), indexed by rank."""
    loads = [0.0] * (max(stage_to_rank) + 1)
    for s, c in enumerate(stage_costs(layers, layer_costs, embed_cost, head_cost)):
        loads[stage_to_rank[s]] += c
    return loads


def even_layers(n_layer: int, num_stages: int) -> list[int]:
    """The even split partition_layers makes (remainder to the middle stages, then the first, then the last);
    with fewer layers than stages, the middle stages get one each (the ends none) as far as they go."""
    base, extra = divmod(n_layer, num_stages)
    preference = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    counts = [base] * num_stages
    for s in preference[:extra]:
        counts[s] += 1
    return counts


# ---------------------------------------------------------------------------------------------------------
# checks and small helpers


def _check(layer_costs, embed_cost, head_cost, stage_to_rank):
    costs = list(layer_costs)
    for name, value in [("embed_cost", embed_cost), ("head_cost", head_cost)] + \
            [(f"layer_costs[{i}]", c) for i, c in enumerate(costs)]:
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"balance: {name}={value!r} must be a finite number >= 0")
    placement = tuple(stage_to_rank)
    if not placement:
        raise ConfigError("balance: stage_to_rank is empty; give the rank of each model stage")
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in placement):
        raise ConfigError(f"balance: stage_to_rank={placement} must hold ranks (integers >= 0)")
    return [float(c) for c in costs], placement


def _minimum_layers(S: int) -> list[int]:
    return [0 if s in (0, S - 1) else 1 for s in range(S)]


def _stage_extras(S: int, embed: float, head: float) -> list[float]:
    extra = [0.0] * S
    extra[0] += embed
    extra[S - 1] += head
    return extra


def _uniform(costs: list[float]) -> bool:
    return not costs or max(costs) - min(costs) <= TOLERANCE * max(costs)


def _at_most(x: float, limit: float) -> bool:
    return x <= limit + TOLERANCE * max(abs(limit), 1e-300)


def _result(layers, costs, extra, placement, method, exact=True, lower_bound=None) -> Balance:
    per_stage, start = [], 0
    for s, n in enumerate(layers):
        per_stage.append(extra[s] + math.fsum(costs[start:start + n]))
        start += n
    loads = [0.0] * (max(placement) + 1)
    for s, c in enumerate(per_stage):
        loads[placement[s]] += c
    return Balance(tuple(layers), tuple(per_stage), tuple(loads), max(loads), method, exact,
                   None if exact else min(lower_bound, max(loads)))


# ---------------------------------------------------------------------------------------------------------
# "uniform": every block costs b


def _uniform_split(L: int, b: float, extra: list[float], mins: list[int], placement: tuple[int, ...]) -> list[int]:
    S = len(placement)
    ranks = sorted(set(placement))
    stages_of = {r: [s for s in range(S) if placement[s] == r] for r in ranks}
    rank_extra = {r: sum(extra[s] for s in stages_of[r]) for r in ranks}
    rank_min = {r: sum(mins[s] for s in stages_of[r]) for r in ranks}
    # 1. The optimum M: blocks one at a time to the rank lightest after the addition (proof in the docstring).
    held = dict(rank_min)
    heap = [(rank_extra[r] + b * (held[r] + 1), r) for r in ranks]
    heapq.heapify(heap)
    for _ in range(L - sum(rank_min.values())):
        _, r = heapq.heappop(heap)
        held[r] += 1
        heapq.heappush(heap, (rank_extra[r] + b * (held[r] + 1), r))
    M = max(rank_extra[r] + b * held[r] for r in ranks)
    # 2. Capacities under M, and the split nearest the even one within them.
    cap = {r: (L if b == 0 else max(rank_min[r], math.floor((M - rank_extra[r]) / b * (1 + TOLERANCE) + TOLERANCE)))
           for r in ranks}
    layers = even_layers(L, S)
    cost = lambda s: extra[s] + b * layers[s]  # noqa: E731
    freed = 0
    for r in ranks:
        while sum(layers[s] for s in stages_of[r]) > cap[r]:  # the costliest stage gives up a block
            s = max((s for s in stages_of[r] if layers[s] > mins[s]), key=lambda s: (cost(s), s))
            layers[s] -= 1
            freed += 1
    for _ in range(freed):  # each to the lightest rank with room, its cheapest stage
        room = [r for r in ranks if sum(layers[s] for s in stages_of[r]) < cap[r]]
        r = min(room, key=lambda r: (sum(cost(s) for s in stages_of[r]) + b, _middle_first(stages_of[r], S)))
        s = min(stages_of[r], key=lambda s: (cost(s), _middle_first([s], S)))
        layers[s] += 1
    return layers


def _middle_first(stages: list[int], S: int) -> int:
    """A tie-break: ranks (stages) without the ends first, as partition_layers gives remainders."""
    return sum(2 if s == S - 1 else 1 if s == 0 else 0 for s in stages)


# ---------------------------------------------------------------------------------------------------------
# "chain": one stage per rank


def _chain_split(costs: list[float], extra: list[float], mins: list[int]) -> list[int]:
    S, L = len(extra), len(costs)
    pref = [0.0]
    for c in costs:
        pref.append(pref[-1] + c)
    tail = [sum(mins[s:]) for s in range(S + 1)]  # blocks the stages from s on need at least
    INF = math.inf
    # best[s][j]: the smallest bottleneck of stages 0..s covering blocks [0, j)
    best = [[INF] * (L + 1) for _ in range(S)]
    for j in range(L - tail[1] + 1):
        best[0][j] = extra[0] + pref[j]
    for s in range(1, S):
        hi = L - tail[s + 1] if s < S - 1 else L
        lo = L if s == S - 1 else 0
        for j in range(lo, hi + 1):
            row, v = best[s - 1], INF
            for i in range(0, j - mins[s] + 1):
                if row[i] < v:
                    v = min(v, max(row[i], extra[s] + pref[j] - pref[i]))
            best[s][j] = v
    T = best[S - 1][L]
    # Among the splits whose every stage is within T, the nearest to the even split.
    even = even_layers(L, S)
    dev = [[INF] * (L + 1) for _ in range(S)]
    back = [[-1] * (L + 1) for _ in range(S)]
    for j in range(L - tail[1] + 1):
        if _at_most(extra[0] + pref[j], T):
            dev[0][j] = abs(j - even[0])
    for s in range(1, S):
        hi = L - tail[s + 1] if s < S - 1 else L
        lo = L if s == S - 1 else 0
        for j in range(lo, hi + 1):
            for i in range(0, j - mins[s] + 1):
                if dev[s - 1][i] < INF and _at_most(extra[s] + pref[j] - pref[i], T):
                    d = dev[s - 1][i] + abs(j - i - even[s])
                    if d < dev[s][j]:
                        dev[s][j], back[s][j] = d, i
    layers, j = [0] * S, L
    for s in range(S - 1, 0, -1):
        i = back[s][j]
        layers[s], j = j - i, i
    layers[0] = j
    return layers


# ---------------------------------------------------------------------------------------------------------
# "search": several stages on a rank, unequal blocks


def _search_split(costs, extra, mins, placement, node_limit: int) -> tuple[list[int], bool, float]:
    S, L = len(placement), len(costs)
    pref = [0.0]
    for c in costs:
        pref.append(pref[-1] + c)
    ranks = max(placement) + 1
    last_stage = [-1] * ranks
    for s, r in enumerate(placement):
        last_stage[r] = s
    tail = [sum(mins[s:]) for s in range(S + 1)]
    head_rank, head = placement[S - 1], extra[S - 1]

    def value(layers):
        return _result(layers, costs, extra, placement, "search").bottleneck

    mean = pref[L] / L if L else 0.0
    starts = [_uniform_split(L, mean, extra, mins, placement), even_layers(L, S)]
    incumbent = start = min(starts, key=value)
    state = {"best": value(incumbent), "layers": list(incumbent), "nodes": 0}
    seen: set = set()
    layers = [0] * S
    loads = [0.0] * ranks

    # cheapest[i][k]: the k cheapest of blocks i.. summed (a rank with slack x takes fewer than x's worth)
    cheapest = []
    for i in range(L + 1):
        acc = [0.0]
        for c in sorted(costs[i:]):
            acc.append(acc[-1] + c)
        cheapest.append(acc)
    # still_needs[s][r]: the blocks rank r's middle stages from stage s on need at least
    still_needs = [[sum(mins[t] for t in range(s, S) if placement[t] == r) for r in range(ranks)]
                   for s in range(S + 1)]

    def hopeless(s: int, i: int, best: float) -> bool:
        """Whether no completion of stages s.. from block i can keep every rank strictly below best.

        Relaxations that forget contiguity: each rank with stages still to come has a slack (best less its
        load so far, less the head if the last stage is its); the blocks it takes must cost less than that
        slack, so it takes at most as many as its slack holds of the cheapest remaining blocks, and at least
        its middle stages' minimum; all of them together must hold every remaining block, and the remaining
        blocks' total must fit in the slacks."""
        if s >= S:
            return False
        margin = TOLERANCE * abs(best)
        left, acc = L - i, cheapest[i]
        water, capacity = pref[L] - pref[i], 0
        for r in range(ranks):
            if last_stage[r] < s:
                continue
            slack = best - loads[r] - (head if r == head_rank else 0.0) - margin
            if slack <= 0:
                return True
            water -= slack
            k = min(left, bisect.bisect_left(acc, slack) - 1)  # the most blocks costing less than slack
            if k < still_needs[s][r]:
                return True
            capacity += k
        return capacity < left or water >= 0

    def visit(s: int, i: int) -> bool:
        """Explore stages s.. from block i; False once the node limit is reached."""
        state["nodes"] += 1
        if state["nodes"] > node_limit:
            return False
        if s == S:
            v = max(loads)
            if not _at_most(state["best"], v):  # strictly better
                state["best"], state["layers"] = v, list(layers)
            return True
        # What the rest depends on: the open ranks' loads, and the largest closed one (only the maximum counts).
        key = (s, i, max((loads[r] for r in range(ranks) if last_stage[r] < s), default=0.0),
               tuple(loads[r] for r in range(ranks) if last_stage[r] >= s))
        if key in seen:
            return True
        seen.add(key)
        r = placement[s]
        lo, hi = (L - i, L - i) if s == S - 1 else (mins[s], L - i - tail[s + 1])
        base, near = loads[r], min(max(start[s], lo), hi)
        # The starting split's count first, then up (until the rank's load reaches the best: more blocks only
        # add to it), then down: improvements near the starting split are found first.
        for counts in (range(near, hi + 1), range(near - 1, lo - 1, -1)):
            for n in counts:
                load = base + extra[s] + pref[i + n] - pref[i]
                if _at_most(state["best"], load):
                    if n >= near:
                        break
                    continue
                loads[r], layers[s] = load, n
                if not hopeless(s + 1, i + n, state["best"]):
                    if not visit(s + 1, i + n):
                        loads[r] = base
                        return False
                loads[r] = base
        layers[s] = 0
        return True

    finished = visit(0, 0)
    if finished:
        return state["layers"], True, state["best"]
    # Stopped early: what the relaxations prove at the root (the largest T they show hopeless) bounds the gap.
    loads[:] = [0.0] * ranks
    loads[placement[0]] = extra[0]
    lo, hi = 0.0, state["best"]
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hopeless(0, 0, mid) else (lo, mid)
    return state["layers"], False, lo


# ---------------------------------------------------------------------------------------------------------
# per-layer costs as `pipegpt simulate --layer-costs` reads them

BALANCE_CHOICES = ("even", "cost")


@dataclass(frozen=True)
class LayerCosts:
    """Forward cost of the embedding, of each block and of the head with its loss; a stage's backward costs
    `backward` times its forward (B = 2F by default) and the weight-gradient part of it `weight` times (W = F)."""

    embed: float
    blocks: tuple[float, ...]
    head: float
    backward: float = 2.0
    weight: float = 1.0
    comm: float = 0.0

    def split(self, balance: str, stage_to_rank) -> list[int]:
        """Layers per stage: the even split (as partition_layers), or balance_layers'. B and W are multiples of
        F, so balancing the forwards balances every rank's whole work."""
        S, L = len(stage_to_rank), len(self.blocks)
        if balance not in BALANCE_CHOICES:
            raise ConfigError(f"balance={balance!r} is not one of {', '.join(BALANCE_CHOICES)}")
        if balance == "cost":
            return balance_layers(list(self.blocks), self.embed, self.head, tuple(stage_to_rank))
        if L < S:
            raise ConfigError(f"{L} layers are fewer than the {S} stages an even split must fill: give at least "
                              f"{S} layers, or --balance cost (the first and last stage may then hold none)")
        return even_layers(L, S)

    def stage_forward(self, layers) -> list[float]:
        """Each stage's forward cost for a split."""
        return stage_costs(layers, list(self.blocks), self.embed, self.head)

    def plan_costs(self, plan, balance: str) -> tuple[Costs, list[int]]:
        """The costs of a plan's stages (F their layers' sum, B and W its multiples) and the split they follow."""
        split = self.split(balance, plan.stage_to_rank)
        forward = self.stage_forward(split)
        return Costs(tuple(forward), tuple(f * self.backward for f in forward),
                     tuple(f * self.weight for f in forward), self.comm), split


def per_layer_costs(model, measured: dict) -> list[float]:
    """Each of the model's layers' cost from what was measured per layer kind (LayerKind.piece's names), for
    balance_layers: [measured["block"]] x n_layer where every layer is dense."""
    return [measured[kind.piece] for kind in layer_kinds(model)]


_LAYER_KEYS = {"embed": "embed", "block": "block", "blocks": "blocks", "head": "head", "b": "backward",
               "w": "weight", "comm": "comm"}
_LAYER_EXAMPLE = "embed=0.1,block=1,head=3 (forward costs; optional B=2,W=1 as multiples of F, comm=0)"


def parse_layer_costs(spec: str, n_layer: int | None = None) -> LayerCosts:
    """"embed=E,block=B,head=H[,B=2,W=1,comm=C]" with n_layer blocks, or a .json file holding the same keys,
    where "blocks" may list one cost per block instead of "block" (then n_layer may be left out)."""
    import json
    import os

    if spec.lower().endswith(".json") or os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as fh:
                data = json.load(fh)
        except OSError as e:
            raise ConfigError(f"cannot read {spec}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(f"{spec}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{spec}: expected an object such as {{\"embed\": 0.1, \"block\": 1, \"head\": 3}}")
        raw = {str(k).lower(): v for k, v in data.items()}
    else:
        raw = {}
        for item in spec.replace(";", ",").split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or not value.strip():
                raise ConfigError(f"layer costs: {item.strip()!r} is not KEY=VALUE; write e.g. {_LAYER_EXAMPLE}")
            if key in raw:
                raise ConfigError(f"layer costs: {key!r} given twice in {spec!r}")
            try:
                raw[key] = float(value)
            except ValueError:
                raise ConfigError(f"layer costs: {key}={value.strip()!r} is not a number") from None
    unknown = sorted(set(raw) - set(_LAYER_KEYS))
    if unknown:
        raise ConfigError(f"layer costs: unknown key {unknown[0]!r}; write e.g. {_LAYER_EXAMPLE}")
    values = {_LAYER_KEYS[k]: v for k, v in raw.items()}
    for name in ("embed", "head"):
        if name not in values:
            raise ConfigError(f"layer costs: {name}= is missing; write e.g. {_LAYER_EXAMPLE}")
    if ("block" in values) == ("blocks" in values):
        raise ConfigError(f"layer costs: give block= (every block's cost) or, in a .json file, blocks= (a list), "
                          f"not {'both' if 'block' in values else 'neither'}; write e.g. {_LAYER_EXAMPLE}")
    if "blocks" in values:
        blocks = values.pop("blocks")
        if not isinstance(blocks, list) or not blocks:
            raise ConfigError("layer costs: blocks must be a non-empty list of numbers, one per block")
        if n_layer is not None and n_layer != len(blocks):
            raise ConfigError(f"--layers {n_layer} does not match the {len(blocks)} block costs given; leave "
                              f"--layers out")
    else:
        if n_layer is None:
            raise ConfigError("layer costs: with block= (one cost for every block) give --layers N, the number "
                              "of blocks")
        blocks = [values.pop("block")] * n_layer
    for name, value in list(values.items()) + [(f"blocks[{i}]", c) for i, c in enumerate(blocks)]:
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"layer costs: {name}={value!r} must be a finite number >= 0")
    costs = LayerCosts(blocks=tuple(float(c) for c in blocks), **{k: float(v) for k, v in values.items()})
    if costs.weight > costs.backward:
        raise ConfigError(f"layer costs: W={costs.weight:g} > B={costs.backward:g}; W is the weight-gradient part "
                          f"of B, so 0 <= W <= B")
    return costs
