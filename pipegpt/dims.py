"""The named axes of a layout, torch-free: where each rank sits in dp x pp x cp x tp, the axes carved out of
others (expert parallelism), which ranks share a group, what a rank holds of a sequence; and the settings that
make a layout, each named once.

Rank order (the first axis slowest, tp fastest):

    rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i

Consecutive ranks share a machine (torchrun numbers a node's processes together; the planner's node model,
pipegpt.costs.stage_costs, puts rank r on node r // gpus_per_node), so the axis that talks most sits innermost.
Tensor parallelism all-reduces activations in every block, forward and backward: its peers must share a node's
NVLink (config.validate refuses a tp that does not divide the processes per node). Context parallelism passes K/V
blocks once per attention layer, less than tp moves: next, so a cp ring stays inside a node whenever tp x cp fits
there. A pipeline sends one activation per microbatch to its neighbour and data parallelism reduces gradients
once per step, overlapped with the backward: they go outside. Megatron-Core orders tp-cp-ep-dp-pp (pp outermost:
a replica's stages on different nodes, the dp all-reduce within one), and torchtitan pp outermost too; pipegpt
keeps dp outermost, as it numbered ranks before cp existed: every rank number stays what it was, and one model
replica (pp x cp x tp ranks) is a contiguous block, so a pipeline's messages stay inside a node when a replica
fits there and the planner's node arithmetic reads rank // gpus_per_node.

An axis carved out of others (Carve) divides the product of some of AXES without changing the world: expert
parallelism (expert_axes) spreads a layer's experts over ep ranks carved out of dp x cp (x tp where experts are
not tensor-parallel), and its complement edp (that product / ep) holds the same experts, their gradients
averaged over it. The product's positions are numbered in rank order (dp_i * cp + cp_i), and the carved axis takes
the fast part (ep_i = that % ep), the complement the slow part: the all-to-all, which moves a microbatch's tokens
in every MoE layer forward and backward, talks more than an expert's gradient reduction once a step, so it sits
inside. As Megatron's tp-cp-ep-dp-pp (ep faster than dp) and torchtitan's [pp, dp_replicate, efsdp, ep, etp]
(ep faster than its complement, efsdp): an ep that divides cp takes consecutive cp ranks, inside a node wherever
tp x cp fits there; a larger ep spans replicas, as it does there. Every rank keeps its number: a carving only
names other groups of the same ranks (GROUP_AXES).
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import namedtuple
from typing import Iterable, Mapping, NamedTuple, Sequence

AXES = ("dp", "pp", "cp", "tp")  # rank order, the first slowest; a new axis: its name here, then its table rows
Coords = namedtuple("Coords", AXES)
NAMED_AT_ONE = ("dp", "pp", "tp")  # a layout's label shows these at size 1 too (labels read as before cp came)


class Carve(NamedTuple):
    """An axis of `size` ranks carved out of the product of `over` (axes of AXES, in rank order): the fast part
    of that product; `complement` names the slow part (the product / size). See the module docstring."""

    name: str
    size: int
    over: tuple[str, ...]
    complement: str


def expert_axes(ep: int, tensor_parallel: bool = True) -> Carve:
    """Expert parallelism: ep carved out of dp x cp, or out of dp x cp x tp where the experts are not cut over tp
    (each tp rank then holds whole experts of its own); edp, the complement, an expert's replicas."""
    return Carve("ep", ep, ("dp", "cp") if tensor_parallel else ("dp", "cp", "tp"), "edp")


# Every process group by name: the axes it spans (one group per position on the others). A group over an axis
# the layout does not name (a carving it has not made) is not built (comm/mesh.group_members).
GROUP_AXES = {
    "dp": ("dp",),  # the replicas of one layout position: what a loss is averaged over
    "dp_cp": ("dp", "cp"),  # gradient averaging and ZeRO-1's shards: cp ranks hold the same weights, as replicas
    "cp": ("cp",),  # one stage's context-parallel ranks: K/V travel among them
    "tp": ("tp",),
    "pp": ("pp",),
    "model": ("pp", "tp"),  # one model replica: what a gradient norm sums over
    "embedding": ("pp",),  # the tied embedding's copies: only the pipeline positions holding one (comm/mesh)
    "ep": ("ep",),  # a layer's experts spread over these ranks: tokens travel among them (all-to-all)
    "edp": ("edp",),  # the same experts' replicas: their gradients averaged over them
}
REPLICAS = "dp_cp"  # the group whose ranks hold a stage's same weights (gradients averaged, ZeRO shards over it)


class _Axes:
    """Rank arithmetic over AXES and the layout's carvings, for ParallelDims and Sharding. Both are tuples: the
    planner's caches hash and compare a layout's sharding for every candidate, which a tuple does in C."""

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
        return ParallelDims(*self[:len(AXES)], carved=self.carved)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Every axis this layout names: AXES, then each carved axis and its complement."""
        return AXES + tuple(name for c in self.carved for name in (c.name, c.complement))

    def size(self, axis: str) -> int:
        """Ranks along any axis of axis_names (a complement's: the carved product over the carved axis's size)."""
        if axis in AXES:
            return self[AXES.index(axis)]
        c = self._carve_of(axis)
        return c.size if axis == c.name else math.prod(self.size(a) for a in c.over) // c.size

    def span(self, axes: Iterable[str]) -> int:
        """The ranks of one group spanning `axes`: the product of their sizes."""
        return math.prod(self.size(a) for a in axes)

    @property
    def replicas(self) -> int:
        """Ranks holding a stage's same weights (dp x cp, GROUP_AXES[REPLICAS]): gradients are averaged and ZeRO
        shards over them."""
        return self.span(GROUP_AXES[REPLICAS])

    @property
    def replica_size(self) -> int:
        """Ranks one copy of the model is cut over: every axis but dp (pp x cp x tp)."""
        return self.world_size // self.dp

    def label(self, details: Mapping[str, str | None] | None = None, spaced: bool = False) -> str:
        """The axes in rank order as reports name them, dp, pp and tp always, a later axis only where it cuts:
        dp2 pp4 cp2(ring) tp8, spaced dp 2 x pp 4 x cp 2 (ring) x tp 8 (details: a word after an axis's size)."""
        details = details or {}
        return (" x " if spaced else " ").join(
            f"{axis}{' ' * spaced}{size}" + (f"{' ' * spaced}({details[axis]})" if details.get(axis) else "")
            for axis, size in zip(AXES, self.sizes) if size > 1 or axis in NAMED_AT_ONE)

    def carve(self, carving: Carve):
        """This layout with one more axis carved out of others (the world and every rank number unchanged)."""
        over = tuple(a for a in AXES if a in carving.over)
        taken = {a for c in self.carved for a in c.over}
        if set(carving.over) - set(AXES) or not over or len(over) != len(carving.over):
            raise ValueError(f"{carving.name} is carved out of {carving.over}: name axes of {', '.join(AXES)}, once")
        if {carving.name, carving.complement} & set(self.axis_names) or carving.name == carving.complement:
            raise ValueError(f"{carving.name} and {carving.complement}: names of new axes, two, not already named")
        if taken & set(over):
            raise ValueError(f"{' x '.join(a for a in over if a in taken)} is carved already: one carving per axis")
        product = self.span(over)
        if not isinstance(carving.size, int) or carving.size < 1 or product % carving.size:
            raise ValueError(f"{carving.name} = {carving.size} does not divide {' x '.join(over)} = {product}")
        return self._replace(carved=self.carved + (carving._replace(over=over),))

    def _carve_of(self, axis: str) -> Carve:
        for c in self.carved:
            if axis in (c.name, c.complement):
                return c
        raise ValueError(f"unknown axes {[axis]}: the axes are {', '.join(self.axis_names)}")

    def coords(self, rank: int) -> Coords:
        """The coordinates of a global rank, by axis name (coords(r).pp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of {self.dims}")
        out = []
        for size in reversed(self.sizes):
            rank, i = divmod(rank, size)
            out.append(i)
        return Coords(*reversed(out))

    def index(self, rank: int, axis: str) -> int:
        """A rank's position along any axis of axis_names (index(r, "ep"): its place in its ep group)."""
        here = self.coords(rank)
        if axis in AXES:
            return here[AXES.index(axis)]
        c = self._carve_of(axis)
        flat = 0
        for a in c.over:  # the position in the carved product, in rank order
            flat = flat * self.size(a) + here[AXES.index(a)]
        return flat % c.size if axis == c.name else flat // c.size

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

    def _frame(self, named: set) -> list[str]:
        """Axes whose positions name a rank once each: AXES, each carving a group names standing for its product."""
        out = list(AXES)
        for c in self.carved:
            if named & {c.name, c.complement}:
                if named & set(c.over):
                    spans = " x ".join(a for a in self.axis_names if a in named)
                    raise ValueError(f"{spans}: {c.name} and {c.complement} cut {' x '.join(c.over)} another way; a "
                                     f"group spans one cut or the other")
                out = [a for a in out if a not in c.over] + [c.complement, c.name]
        return out

    def _rank_at(self, at: Mapping[str, int]) -> int:
        """The rank at positions along a _frame's axes."""
        base = {a: i for a, i in at.items() if a in AXES}
        for c in self.carved:
            if c.name in at:
                flat = at[c.complement] * c.size + at[c.name]
                for a in reversed(c.over):
                    flat, base[a] = divmod(flat, self.size(a))
        return self.rank_of(**base)

    def members(self, rank: int, axes: Iterable[str], at: Mapping[str, Sequence[int]] | None = None) -> list[int]:
        """The group of `rank` spanning `axes` (carved ones too): the ranks that differ from it only along those
        axes, in rank order. at: only these positions along an axis ({"pp": (0, 3)}: a pipeline's first and last
        ranks)."""
        axes, at = set(axes), at or {}
        unknown = (axes | set(at)) - set(self.axis_names)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}: the axes are {', '.join(self.axis_names)}")
        frame = self._frame(axes)
        spans = [sorted(set(at.get(axis, range(self.size(axis))))) if axis in axes else [self.index(rank, axis)]
                 for axis in frame]
        return sorted(self._rank_at(dict(zip(frame, c))) for c in itertools.product(*spans))

    def groups(self, axes: Iterable[str], at: Mapping[str, Sequence[int]] | None = None) -> list[list[int]]:
        """Every group spanning `axes` (members' groups of all ranks, each once), ordered by their first rank."""
        axes, seen, out = tuple(axes), set(), []
        for rank in range(self.world_size):
            group = tuple(self.members(rank, axes, at))
            if group not in seen:
                seen.add(group)
                out.append(list(group))
        return out


class ParallelDims(_Axes, namedtuple("ParallelDims", AXES + ("carved",), defaults=(1,) * len(AXES) + ((),))):
    """The size of each axis of a layout: ParallelDims(dp=2, pp=4, tp=2) (an axis left out: 1), and the axes
    carved out of them (carve())."""

    __slots__ = ()


class Sharding(_Axes, namedtuple("Sharding", AXES + ("sequence_parallel", "zero", "carved"),
                                 defaults=(1,) * len(AXES) + (False, 0, ()))):
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


# Every layout setting once, in the order a command line spells them (pipegpt.planner's Layout.run_args).
LAYOUT_FIELDS = (
    LayoutField("stages", "pp", auto=True, shrink=True),
    LayoutField("dp", "dp", auto=True, shrink=True),
    LayoutField("tp", "tp", auto=True, shrink=True),
    LayoutField("cp", "cp", auto=True, shrink=True),
    LayoutField("cp_comm", "cp_comm", auto=True, shrink=True),
    LayoutField("ep", "ep", auto=True, shrink=True),  # carved out of dp x cp (x tp): a shrink may lower it
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

# Each axis's config field (ParallelConfig: pp's is "stages"), in rank order.
AXIS_FIELDS = {axis: next(f.name for f in LAYOUT_FIELDS if f.planned == axis) for axis in AXES}
