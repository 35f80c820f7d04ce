"""pipegpt.dims: the named axes (rank order, coordinates, groups), a layout's sharding, and the one table of layout
settings the run flags, restart arguments and --layout auto's settings come from."""
from __future__ import annotations

import itertools
import math

import pytest

from pipegpt.comm.mesh import GROUP_AXES, group_members
from pipegpt.config import TrainConfig, option_flags
from pipegpt.dims import AXES, LAYOUT_FIELDS, ParallelDims, Sharding
from pipegpt.options import AUTO_LAYOUT_FIELDS
from pipegpt.planner.auto import AutoLayout
from pipegpt.planner.candidates import Layout
from pipegpt.train.restart import LAYOUT_FLAGS

SHAPES = [(1, 1, 1, 1), (2, 3, 1, 2), (1, 4, 1, 1), (3, 1, 1, 4), (2, 2, 2, 2), (3, 1, 2, 4), (1, 4, 3, 1),
          (2, 3, 4, 2)]


@pytest.mark.parametrize("shape", SHAPES)
def test_coordinates_and_ranks_round_trip_in_the_documented_order(shape):
    dims = ParallelDims(*shape)
    assert dims.world_size == math.prod(shape) and dims.sizes == shape
    seen = []
    for rank in range(dims.world_size):
        at = dims.coords(rank)
        assert all(0 <= getattr(at, axis) < getattr(dims, axis) for axis in AXES)
        assert dims.rank_of(**at._asdict()) == rank
        assert rank == ((at.dp * dims.pp + at.pp) * dims.cp + at.cp) * dims.tp + at.tp  # tp fastest
        assert rank == sum(getattr(at, axis) * dims.stride(axis) for axis in AXES)
        seen.append(tuple(at))
    assert seen == sorted(seen) == list(itertools.product(*(range(n) for n in shape)))  # every coordinate once


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 3, 2), (1, 4, 1), (3, 1, 4), (2, 2, 2), (4, 2, 1)])
def test_without_cp_every_rank_keeps_its_number(dp, pp, tp):
    """cp has size 1 until it exists: rank = (dp_i * pp + pp_i) * tp + tp_i, as comm/mesh.py numbered them."""
    dims = ParallelDims(dp=dp, pp=pp, tp=tp)
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        rank = (d * pp + p) * tp + t
        assert dims.rank_of(dp=d, pp=p, tp=t) == rank
        assert tuple(dims.coords(rank)) == (d, p, 0, t)


def _hand_written_groups(dp, pp, tp, embedding_pp_indices):
    """comm/mesh.py's process groups as it listed them before the table (cp = 1)."""
    rank_of = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731
    groups = {
        "dp": [[rank_of(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "tp": [[rank_of(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pp": [[rank_of(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "model": [[rank_of(d, p, t) for p in range(pp) for t in range(tp)] for d in range(dp)],
    }
    groups["dp_cp"] = groups["dp"]  # cp = 1: a cp group is one rank, dp x cp the dp group
    groups["cp"] = [[r] for r in range(dp * pp * tp)]
    if len(set(embedding_pp_indices)) > 1:
        groups["embedding"] = [[rank_of(d, p, t) for p in sorted(set(embedding_pp_indices))]
                               for d in range(dp) for t in range(tp)]
    return groups


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 3, 2), (1, 4, 1), (3, 1, 4), (2, 2, 2), (4, 2, 1), (2, 4, 2)])
def test_the_group_table_builds_the_groups_mesh_listed_by_hand(dp, pp, tp):
    dims = ParallelDims(dp=dp, pp=pp, tp=tp)
    ends = (0, pp - 1)  # the worker's embedding positions
    want = _hand_written_groups(dp, pp, tp, ends)
    assert group_members(dims, ends) == {name: want[name] for name in group_members(dims, ends)}
    assert group_members(dims, ends).keys() == want.keys()  # same groups, same order (every rank creates them in one order)
    assert ("embedding" in want) == (pp > 1)
    for name, groups in want.items():
        for group in groups:
            for rank in group:
                at = {"pp": ends} if name == "embedding" else None
                assert dims.members(rank, GROUP_AXES[name], at) == group


@pytest.mark.parametrize("shape", [(2, 2, 2, 2), (3, 1, 2, 4), (2, 3, 4, 2)])
def test_the_groups_of_any_axes_partition_the_ranks(shape):
    dims = ParallelDims(*shape)
    for n in range(len(AXES) + 1):
        for axes in itertools.combinations(AXES, n):
            groups = dims.groups(axes)
            assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
            for group in groups:
                assert len(group) == math.prod(getattr(dims, a) for a in axes) and group == sorted(group)
                fixed = {tuple(getattr(dims.coords(r), a) for a in AXES if a not in axes) for r in group}
                assert len(fixed) == 1  # the members differ only along the group's axes


def test_a_member_list_can_take_some_positions_only():
    dims = ParallelDims(dp=2, pp=4, cp=2, tp=2)
    rank = dims.rank_of(dp=1, pp=2, cp=1, tp=1)
    assert dims.members(rank, ("pp",), {"pp": (3, 0)}) == [dims.rank_of(dp=1, pp=p, cp=1, tp=1) for p in (0, 3)]
    assert dims.members(rank, ("pp", "cp")) == [dims.rank_of(dp=1, pp=p, cp=c, tp=1)
                                                for p in range(4) for c in range(2)]


def test_bad_ranks_and_axes_are_refused():
    dims = ParallelDims(dp=2, tp=2)
    with pytest.raises(ValueError, match="rank 4 is outside the 4 ranks"):
        dims.coords(4)
    with pytest.raises(ValueError, match="tp index 2 is outside tp = 2"):
        dims.rank_of(tp=2)
    with pytest.raises(ValueError, match="unknown axes"):
        dims.rank_of(ep=0)
    with pytest.raises(ValueError, match="unknown axes"):
        dims.members(0, ("xp",))


def test_a_sharding_is_its_axes_with_sequence_parallelism_and_zero():
    s = Sharding(dp=2, pp=3, tp=4, sequence_parallel=True, zero=1)
    assert s.dims == ParallelDims(dp=2, pp=3, tp=4) and s.world_size == 24
    assert s.coords(23) == ParallelDims(dp=2, pp=3, tp=4).coords(23)
    assert s.tensor_cut == Sharding(tp=4, sequence_parallel=True)
    assert s.tensor_cut == Sharding(dp=8, pp=1, tp=4, sequence_parallel=True).tensor_cut
    assert s.tensor_cut != Sharding(tp=4).tensor_cut


def test_the_tokens_a_rank_holds():
    assert Sharding(tp=4).tokens_per_rank(64) == 64  # tp alone: every rank holds the whole sequence
    assert Sharding(tp=4, sequence_parallel=True).tokens_per_rank(64) == 16
    assert Sharding(tp=4, sequence_parallel=True).tokens_per_rank(64, microbatch_size=3) == 48
    assert Sharding(tp=1, sequence_parallel=True).tokens_per_rank(64) == 64  # nothing to cut over
    assert Sharding(cp=2, tp=4, sequence_parallel=True).tokens_per_rank(64) == 8  # its cp share, then tp's
    cfg = TrainConfig.build(stages=2, dp=3, tp=2, sequence_parallel=True)
    assert cfg.parallel.sharding.tokens_per_rank(cfg.model.seq_len) == cfg.model.seq_len // 2
    assert cfg.parallel.dims == ParallelDims(dp=3, pp=2, tp=2) and cfg.world_size == 12


def test_the_layout_maps_come_from_one_table():
    """What the five maps held before LAYOUT_FIELDS, now derived from it."""
    assert [f.name for f in LAYOUT_FIELDS if f.planned] == list(Layout(1, 1, 1, "1f1b", 1, 1, 1).settings())
    assert AUTO_LAYOUT_FIELDS == ("stages", "dp", "tp", "cp", "cp_comm", "ep", "schedule", "virtual_stages",
                                  "microbatches", "microbatch_size", "recompute", "zero", "unshard",
                                  "sequence_parallel", "layers_per_stage", "schedule_file")
    assert LAYOUT_FLAGS == {"--stages", "-p", "--dp", "--tp", "--cp", "--cp-comm", "--ep", "--microbatches", "-m",
                            "--schedule", "-s", "--virtual-stages", "-v", "--layers-per-stage", "--batch-size",
                            "--max-live", "--balance", "--layout"}
    assert option_flags("stages") == ("--stages", "-p") and option_flags("timeout_s") == ("--timeout",)


def test_a_planned_layout_becomes_the_same_settings_and_flags():
    lay = Layout(2, 4, 2, "interleaved-1f1b", 2, 16, 2, "selective", 1, True, (2, 1, 1, 1, 1, 1, 1, 0), True)
    assert AutoLayout(lay, 1.0, "").settings() == dict(
        stages=4, dp=2, tp=2, cp=1, cp_comm="ring", ep=1, schedule="interleaved-1f1b", virtual_stages=2,
        microbatches=16, microbatch_size=2, recompute="selective", zero=1, unshard=None, sequence_parallel=True,
        layers_per_stage=(2, 1, 1, 1, 1, 1, 1, 0))
    tail = ["--stages", "4", "--dp", "2", "--tp", "2", "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
            "--microbatches", "16", "--microbatch-size", "2", "--recompute", "selective", "--zero", "1",
            "--sequence-parallel", "--layers-per-stage", "2,1,1,1,1,1,1,0", "--precision", "bf16"]
    assert lay.run_args(TrainConfig().model, "bf16") == ["--model", "tiny"] + tail
    plain = Layout(1, 2, 1, "1f1b", 1, 8, 4)  # no virtual stages, no sp, the even split: left to the run
    assert plain.run_args(TrainConfig().model, "fp32") == [
        "--model", "tiny", "--stages", "2", "--dp", "1", "--tp", "1", "--schedule", "1f1b", "--microbatches", "8",
        "--microbatch-size", "4", "--recompute", "none", "--zero", "0", "--precision", "fp32"]
    assert AutoLayout(plain, 1.0, "").settings()["layers_per_stage"] is None
