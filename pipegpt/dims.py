"""The named axes of a layout, torch-free: where each rank sits in dp x pp x cp x tp, which ranks share a group,
what a rank holds of a sequence; and the settings that make a layout, each named once.

Rank order (the first axis slowest, tp fastest):

    rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i

Consecutive ranks share a machine (torchrun numbers a node's processes together), so the axis that talks most
sits innermost. Tensor parallelism all-reduces activations in every block, forward and backward: its peers must
share a node's NVLink (config.validate refuses a tp that does not divide the processes per node). Context
parallelism passes K/V blocks once per attention layer, less than tp moves: next, so a cp ring stays inside a
node whenever tp x cp fits there. A pipeline sends one activation per microbatch to its neighbour and data
parallelism reduces gradients once per step, overlapped with the backward: they go outside. Megatron-Core
orders tp-cp-ep-dp-pp (pp outermost: a replica's stages on different nodes, the dp all-reduce within one); pipegpt
keeps dp outermost, as it numbered ranks before cp existed: every rank number stays what it was, and one model
replica (pp x cp x tp ranks) is a contiguous block, so a pipeline's messages stay inside a node when a replica
fits there and the planner's node arithmetic (pipegpt.costs.stage_costs) reads rank // gpus_per_node.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import namedtuple
from typing import Iterable, Mapping, NamedTuple, Sequence

AXES = ("dp", "pp", "cp", "tp")  # rank order, the first slowest; a new axis: its name here, then its table rows
Coords = namedtuple("Coords", AXES)


class _Axes:
    """Rank arithmetic over AXES, for ParallelDims and Sharding. Both are tuples: the planner's caches hash and
    compare a layout's sharding for every candidate, which a tuple does in C."""

    __slots__ = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self[:len(AXES)])

    @property
    def world_size(self) -> int:
        return math.prod(self[:len(AXES)])

    @property
    def dims(self) -> ParallelDims:
        """The axes alone (a Sharding's flags dropped): the key of a mesh."""
        return ParallelDims(*self[:len(AXES)])

    def coords(self, rank: int) -> Coords:
        """The coordinates of a global rank, by axis name (coords(r).pp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of {self.dims}")
        out = []
        for size in reversed(self.sizes):
            rank, i = divmod(rank, size)
            out.append(i)
        return Coords(*reversed(out))

    def rank_of(self, **coords: int) -> int:
        """The global rank at these coordinates (an axis left out: position 0)."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}: the axes are {', '.join(AXES)}")
        rank = 0
        for axis, size in zip(AXES, self.sizes):
            i = coords.get(axis, 0)
            if not 0 <= i < size:
                raise ValueError(f"{axis} index {i} is outside {axis} = {size}")
            rank = rank * size + i
        return rank

    def stride(self, axis: str) -> int:
        """Ranks between neighbours along `axis` (the product of the faster axes' sizes): rank_of(**c) is the
        sum of c[axis] x stride(axis)."""
        return math.prod(self[AXES.index(axis) + 1:len(AXES)])

    def members(self, rank: int, axes: Iterable[str], at: Mapping[str, Sequence[int]] | None = None) -> list[int]:
        """The group of `rank` spanning `axes`: the ranks that differ from it only along those axes, in rank order.
        at: only these positions along an axis ({"pp": (0, 3)}: a pipeline's first and last ranks)."""
        axes, at, here = set(axes), at or {}, self.coords(rank)
        unknown = (axes | set(at)) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}: the axes are {', '.join(AXES)}")
        spans = [sorted(set(at.get(axis, range(size)))) if axis in axes else [i]
                 for axis, size, i in zip(AXES, self.sizes, here)]
        return [self.rank_of(**dict(zip(AXES, c))) for c in itertools.product(*spans)]

    def groups(self, axes: Iterable[str], at: Mapping[str, Sequence[int]] | None = None) -> list[list[int]]:
        """Every group spanning `axes` (members' groups of all ranks, each once), ordered by their first rank."""
        axes, seen, out = tuple(axes), set(), []
        for rank in range(self.world_size):
            group = tuple(self.members(rank, axes, at))
            if group not in seen:
                seen.add(group)
                out.append(list(group))
        return out


class ParallelDims(_Axes, namedtuple("ParallelDims", AXES, defaults=(1,) * len(AXES))):
    """The size of each axis of a layout: ParallelDims(dp=2, pp=4, tp=2) (an axis left out: 1)."""

    __slots__ = ()


class Sharding(_Axes, namedtuple("Sharding", AXES + ("sequence_parallel", "zero"),
                                 defaults=(1,) * len(AXES) + (False, 0))):
    """How a layout cuts the model, its activations and its optimizer state: the axes, and whether tensor
    parallelism also cuts the sequence in its replicated regions (sequence parallelism) and data parallelism the
    optimizer state (ZeRO-1). The planner passes one of these where it passed tp, sp, dp, zero."""

    __slots__ = ()

    @property
    def tensor_cut(self) -> Sharding:
        """What cuts one rank's tensors alone (dp, pp and ZeRO at their defaults): a cache key shared by the
        layouts whose ranks compute alike."""
        return _tensor_cut(self)

    @property
    def splits_sequence(self) -> bool:
        """Sequence parallelism in effect (it needs tp > 1)."""
        return bool(self.sequence_parallel) and self.tp > 1

    def tokens_per_rank(self, seq_len: int, microbatch_size: int = 1) -> int:
        """Token positions of `microbatch_size` sequences one rank holds in the regions every tp rank runs alike
        (norms, dropout, the residual stream; the pipeline's messages): its cp share, cut over tp again under
        sequence parallelism."""
        local = seq_len // self.cp
        return microbatch_size * (local // self.tp if self.splits_sequence else local)


@functools.lru_cache(maxsize=None)
def _tensor_cut(sharding: Sharding) -> Sharding:
    return sharding._replace(dp=1, pp=1, zero=0)


class LayoutField(NamedTuple):
    """A setting that makes a layout: `name` is its config field (run flag from there: config.option_flags), or,
    where config has none, a `pipegpt run` option of that name."""

    name: str
    planned: str | None = None  # the planner's Layout attribute holding it (None: not the planner's choice)
    auto: bool = False  # --layout auto sets it: giving it as well is refused
    shrink: bool = False  # a restart on fewer ranks (train/elastic) sets it anew: its old flag goes


# Every layout setting once, in the order a command line spells them (pipegpt.plan's Layout.run_args).
LAYOUT_FIELDS = (
    LayoutField("stages", "pp", auto=True, shrink=True),
    LayoutField("dp", "dp", auto=True, shrink=True),
    LayoutField("tp", "tp", auto=True, shrink=True),
    LayoutField("cp", "cp", auto=True, shrink=True),
    LayoutField("cp_comm", "cp_comm", auto=True, shrink=True),
    LayoutField("schedule", "schedule", auto=True, shrink=True),
    LayoutField("virtual_stages", "virtual_stages", auto=True, shrink=True),
    LayoutField("microbatches", "microbatches", auto=True, shrink=True),
    LayoutField("microbatch_size", "microbatch_size", auto=True),
    LayoutField("recompute", "recompute", auto=True),
    LayoutField("zero", "zero", auto=True),
    LayoutField("unshard", "unshard", auto=True),
    LayoutField("sequence_parallel", "sequence_parallel", auto=True),
    LayoutField("layers_per_stage", "layers_per_stage", auto=True, shrink=True),
    LayoutField("schedule_file", auto=True),
    LayoutField("max_live", shrink=True),
    LayoutField("balance", shrink=True),
    LayoutField("batch_size", shrink=True),  # `pipegpt run` options, not config fields
    LayoutField("layout", shrink=True),
)
