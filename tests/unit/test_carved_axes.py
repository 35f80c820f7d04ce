"""pipegpt.dims: axes carved out of others (expert parallelism's ep and edp, a toy that splits dp in two), their
groups, and comm/mesh building them from the one table."""
from __future__ import annotations

import itertools

import pytest

from pipegpt.comm.mesh import Mesh, group_members
from pipegpt.dims import AXES, GROUP_AXES, Carve, ParallelDims, Sharding, expert_axes

HALVES = Carve("dp_in", 2, ("dp",), "dp_out")  # a toy: dp split into an inner pair of replicas and the pairs


@pytest.mark.parametrize("dp,pp,cp,tp", [(2, 1, 1, 1), (4, 1, 1, 2), (4, 3, 1, 1), (6, 2, 2, 2)])
def test_an_axis_that_splits_dp_into_two_named_halves(dp, pp, cp, tp):
    plain = ParallelDims(dp=dp, pp=pp, cp=cp, tp=tp)
    dims = plain.carve(HALVES)
    assert dims.world_size == plain.world_size and dims.axis_names == AXES + ("dp_in", "dp_out")
    assert dims.size("dp_in") == 2 and dims.size("dp_out") == dp // 2
    rank = lambda d, p, c, t: plain.rank_of(dp=d, pp=p, cp=c, tp=t)  # noqa: E731
    others = list(itertools.product(range(pp), range(cp), range(tp)))
    inner = [[rank(2 * half + i, *o) for i in range(2)] for half in range(dp // 2) for o in others]
    outer = [[rank(2 * half + i, *o) for half in range(dp // 2)] for i in range(2) for o in others]
    assert sorted(dims.groups(("dp_in",))) == sorted(inner)  # neighbouring replicas: the fast half
    assert sorted(dims.groups(("dp_out",))) == sorted(outer)  # every other replica: the slow half
    assert dims.groups(("dp_in", "dp_out")) == plain.groups(("dp",))  # together: dp again
    for r in range(dims.world_size):
        assert dims.coords(r) == plain.coords(r)  # every rank keeps its number
        d = plain.coords(r).dp
        assert (dims.index(r, "dp_in"), dims.index(r, "dp_out")) == (d % 2, d // 2)
        assert dims.members(r, ("dp_in", "pp")) == sorted(rank(d - d % 2 + i, p, plain.coords(r).cp,
                                                               plain.coords(r).tp) for i in range(2) for p in range(pp))


@pytest.mark.parametrize("dp,pp,cp,tp,ep", [(2, 1, 2, 1, 4), (4, 2, 2, 2, 2), (4, 2, 2, 2, 4), (3, 2, 4, 1, 2),
                                            (2, 3, 2, 2, 1)])
def test_expert_parallelism_carved_out_of_dp_x_cp(dp, pp, cp, tp, ep):
    dims = ParallelDims(dp=dp, pp=pp, cp=cp, tp=tp).carve(expert_axes(ep))
    assert dims.size("edp") * ep == dp * cp
    for name, size in (("ep", ep), ("edp", dp * cp // ep)):
        groups = dims.groups((name,))
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))  # a partition
        for g in groups:
            assert len(g) == size
            assert len({(dims.coords(r).pp, dims.coords(r).tp) for r in g}) == 1  # one stage, one tp position
            flat = sorted(dims.coords(r).dp * cp + dims.coords(r).cp for r in g)
            if name == "ep":  # consecutive positions of dp x cp in rank order: cp first
                assert flat == list(range(flat[0], flat[0] + ep)) and flat[0] % ep == 0
            else:
                assert flat == list(range(flat[0], dp * cp, ep))
    ep_of = {r: frozenset(dims.members(r, ("ep",))) for r in range(dims.world_size)}
    for g in dims.groups(("edp",)):  # an expert's replicas: one from each ep group at the same place in it
        assert len({ep_of[r] for r in g}) == len(g) and len({dims.index(r, "ep") for r in g}) == 1


def test_experts_not_cut_over_tp_carve_ep_out_of_dp_x_cp_x_tp():
    dims = ParallelDims(dp=2, pp=2, cp=2, tp=2).carve(expert_axes(4, tensor_parallel=False))
    assert dims.size("edp") == 2
    rank = lambda d, p, c, t: dims.rank_of(dp=d, pp=p, cp=c, tp=t)  # noqa: E731
    assert dims.members(0, ("ep",)) == [rank(0, 0, c, t) for c in range(2) for t in range(2)]  # cp x tp: tp fastest
    assert dims.members(0, ("edp",)) == [rank(d, 0, 0, 0) for d in range(2)]


@pytest.mark.parametrize("cp,tp,ep,per_node,inside", [(2, 2, 2, 4, True), (4, 2, 2, 8, True), (4, 2, 4, 8, True),
                                                      (2, 2, 4, 4, False), (2, 4, 2, 8, True)])
def test_an_ep_that_divides_cp_stays_inside_a_node_where_tp_x_cp_fits(cp, tp, ep, per_node, inside):
    """The planner's node model: rank r on node r // gpus_per_node; ep the fast part of dp x cp."""
    dims = ParallelDims(dp=4, pp=2, cp=cp, tp=tp).carve(expert_axes(ep))
    one_node = all(len({r // per_node for r in g}) == 1 for g in dims.groups(("ep",)))
    assert one_node == inside


def test_mesh_builds_the_carved_groups_from_the_one_table():
    plain = ParallelDims(dp=4, pp=2, cp=2, tp=2)
    dims = plain.carve(expert_axes(4))
    ends = (0, 1)
    dense, carved = group_members(plain, ends), group_members(dims, ends)
    assert "ep" not in dense and "edp" not in dense  # nothing carved: no new group, none created
    assert list(carved) == list(dense) + ["ep", "edp"]  # the dense groups first, in their order, unchanged
    assert all(carved[name] == dense[name] for name in dense)
    assert carved["ep"] == dims.groups(GROUP_AXES["ep"]) and carved["edp"] == dims.groups(GROUP_AXES["edp"])
    assert carved["ep"][0] == [0, 2, 8, 10] and carved["edp"][0] == [0, 16]
    for rank in (0, 13, 31):
        mesh = Mesh(dims, rank)
        assert (mesh.dp_index, mesh.pp_index, mesh.cp_index, mesh.tp_index) == tuple(dims.coords(rank))
        assert (mesh.ep_index, mesh.edp_index) == (dims.index(rank, "ep"), dims.index(rank, "edp"))
    assert Mesh(dims, dims.rank_of(dp=1, pp=1, cp=1, tp=1)).index("ep") == (1 * 2 + 1) % 4  # (dp_i x cp + cp_i) % ep
    with pytest.raises(AttributeError, match="xp_index"):
        Mesh(plain, 0).xp_index
    with pytest.raises(AttributeError, match="ep_index"):
        Mesh(plain, 0).ep_index  # not carved in this layout


def test_a_sharding_keeps_its_carving_and_counts_its_replicas():
    s = Sharding(dp=4, cp=2, tp=2, zero=1).carve(expert_axes(2))
    assert s.dims == ParallelDims(dp=4, cp=2, tp=2).carve(expert_axes(2)) and s.zero == 1
    assert s.replicas == 8 and ParallelDims(dp=3, pp=2, tp=4).replicas == 3
    assert s.span(("ep", "tp")) == 4 and s.span(()) == 1
    assert Sharding(dp=4, cp=2) == Sharding(dp=4, cp=2, carved=())  # an uncarved layout as it was


def test_carvings_that_do_not_fit_are_refused():
    dims = ParallelDims(dp=3, cp=2, tp=2)
    with pytest.raises(ValueError, match="ep = 4 does not divide dp x cp = 6"):
        dims.carve(expert_axes(4))
    with pytest.raises(ValueError, match="name axes of dp, pp, cp, tp"):
        dims.carve(Carve("ep", 2, ("xp",), "edp"))
    with pytest.raises(ValueError, match="names of new axes"):
        dims.carve(Carve("tp", 2, ("dp",), "edp"))
    carved = dims.carve(expert_axes(2))
    with pytest.raises(ValueError, match="dp x cp is carved already"):
        carved.carve(Carve("half", 3, ("dp", "cp"), "rest"))
    with pytest.raises(ValueError, match="cut dp x cp another way"):
        carved.members(0, ("ep", "dp"))
    with pytest.raises(ValueError, match="unknown axes"):
        dims.members(0, ("ep",))
    with pytest.raises(ValueError, match="unknown axes"):
        dims.index(0, "ep")


def test_a_layouts_label_names_its_axes_in_rank_order():
    dims = ParallelDims(dp=2, pp=4, cp=2, tp=8)
    assert dims.label() == "dp2 pp4 cp2 tp8" and dims.label({"cp": "ring"}) == "dp2 pp4 cp2(ring) tp8"
    assert dims.label({"cp": "ring"}, spaced=True) == "dp 2 x pp 4 x cp 2 (ring) x tp 8"
    assert ParallelDims(pp=2).label({"cp": "ring"}) == "dp1 pp2 tp1"  # cp only where it cuts
    assert dims.carve(expert_axes(4)).label() == dims.label()  # a carving renames no rank
