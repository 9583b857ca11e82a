"""labkit.topology: the grid, its checks, and real process groups (dist.new_group, DeviceMesh)."""
import pytest

from labkit.launch import run
from labkit.topology import DIMS, Topology, TopologyError, factorizations


def test_product_must_equal_world_and_error_names_every_factor():
    with pytest.raises(TopologyError) as err:
        Topology(world=6, dp=2, tp=4, pp=1)
    msg = str(err.value)
    assert "1 x 2 x 4 = 8" in msg and "6 ranks" in msg and "pp=" in msg


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world=4, dp=0, tp=4), "dp must be a positive integer"),
    (dict(world=4, dp=4, zero=4), "ZeRO stage"),
    (dict(world=4, tp=4, zero=1), "dp=1"),
    (dict(world=12, dp=12, gpus_per_node=8), "multiple of 8"),
])
def test_bad_input_says_what_to_change(kwargs, needle):
    with pytest.raises(TopologyError, match=needle):
        Topology(**kwargs)


@pytest.mark.parametrize("world", [1, 6, 8, 12])
def test_coords_round_trip_and_groups_partition_the_world(world):
    for pp, dp, tp in factorizations(world):
        topo = Topology(world, dp=dp, tp=tp, pp=pp)
        for r in range(world):
            assert topo.rank_of(**topo.coords(r)) == r
        for dim in DIMS:
            groups = topo.groups(dim)
            assert sorted(r for g in groups for r in g) == list(range(world))
            assert all(len(g) == topo.sizes[dim] for g in groups)
            for g in groups:  # members differ only along dim
                for other in DIMS:
                    if other != dim:
                        assert len({topo.coords(r)[other] for r in g}) == 1


def test_tp_is_innermost_so_tp_groups_stay_in_a_node():
    topo = Topology(256, dp=8, tp=8, pp=4, zero=2, gpus_per_node=8)
    assert topo.groups("tp")[0] == list(range(8))
    assert topo.nodes_spanned("tp") == 1 and topo.advice() == []
    assert topo.coords(255) == {"pp": 3, "dp": 7, "cp": 0, "tp": 7}
    bad = Topology(16, dp=1, tp=16, pp=1, gpus_per_node=8)
    assert bad.nodes_spanned("tp") == 2 and "spans 2 nodes" in bad.advice()[0]


def test_context_parallel_sits_between_dp_and_tp():
    topo = Topology(8, dp=2, tp=2, cp=2)
    assert topo.groups("cp")[0] == [0, 2] and topo.groups("tp")[0] == [0, 1]
    assert topo.coords(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert "x cp 2" in topo.picture() and "r7(p0 d1 c1 t1)" in topo.picture()
    with pytest.raises(TopologyError, match="2 x 2 x 2 x 2 = 16"):
        Topology(8, dp=2, tp=2, pp=2, cp=2)


def test_picture_shows_nodes_and_groups():
    pic = Topology(8, dp=2, tp=2, pp=2, zero=1, gpus_per_node=4).picture()
    assert "node 1: r4(p1 d0 t0)" in pic and "tp groups: [0, 1] [2, 3] [4, 5] [6, 7]" in pic
    assert "dp groups: [0, 2] [1, 3] [4, 6] [5, 7]" in pic and "ZeRO-1" in pic


def _sum_along_groups(topo):
    """Each rank all-reduces its rank number along each of its groups, two ways."""
    import torch
    import torch.distributed as dist

    from labkit.parallel.mesh import build_mesh
    from labkit.topology import DIMS

    mesh = build_mesh(topo)      # the one place groups are built (labkit.topology has none)
    out = {}
    for dim in DIMS:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.group(dim))
        m = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(m, group=mesh.device_mesh[dim].get_group())
        out[dim] = (t.item(), m.item())
    return out


@pytest.mark.parametrize("world,dp,tp,pp,cp", [(6, 3, 2, 1, 1), (8, 2, 2, 2, 1),
                                               (8, 1, 2, 2, 2)])
def test_real_groups_match_the_grid(world, dp, tp, pp, cp):
    topo = Topology(world, dp=dp, tp=tp, pp=pp, cp=cp)
    results = run(_sum_along_groups, world, args=(topo,), echo=False)
    for rank, res in enumerate(results):
        for dim in DIMS:
            expected = float(sum(topo.group_of(rank, dim)))
            assert res[dim] == (expected, expected), (rank, dim, res[dim], expected)
