"""A named mesh over the world: this rank's coordinates and its process group along each dimension.

    mesh = build_mesh(plan)            # inside a launched rank; collective over the world
    mesh.coords                        # {'pp': 1, 'dp': 0, 'tp': 1}
    mesh.group("tp")                   # this rank's TP process group (pass it, never a global)

Built with torch's `init_device_mesh` (the DeviceMesh torchtitan and FSDP2 use) over the
dimensions of labkit.topology in its order, outermost first: pp, dp, tp, so that a TP group is
consecutive ranks (inside one node) and PP stretches across nodes. Each group is named in
labkit.observe.commlog, so every logged call says which dimension it ran along.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from labkit.launch import device
from labkit.observe import commlog
from labkit.topology import DIMS, Topology


@dataclass
class Mesh:
    topology: Topology
    rank: int
    coords: dict          # {'pp': i, 'dp': j, 'tp': k}
    groups: dict          # {'pp': ProcessGroup, ...}
    device_mesh: object   # torch.distributed.device_mesh.DeviceMesh
    ep: int = 1           # expert-parallel degree (groups "ep" and "edp" exist when > 1)

    def group(self, dim: str):
        if dim not in self.groups:
            raise KeyError(f"mesh dimension {dim!r}: this mesh has {', '.join(self.groups)}")
        return self.groups[dim]

    def size(self, dim: str) -> int:
        if dim in ("ep", "edp"):
            return self.ep if dim == "ep" else self.topology.dp // self.ep
        return self.topology.sizes[dim]


def build_mesh(plan, device_type: str | None = None) -> Mesh:
    """Every rank calls this, together: creates the groups of every dimension (a Plan, or a
    bare Topology). The only place in labkit's core that creates process groups."""
    topo = plan.topology() if not isinstance(plan, Topology) else plan
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != topo.world:
        raise ValueError(f"the plan is for {topo.world} ranks but torch.distributed has {world}: "
                         f"launch {topo.world} processes")
    # the device type from the backend (labkit.launch.device: CUDA under NCCL, else the CPU)
    dm = init_device_mesh(device_type or device().type, tuple(topo.sizes[d] for d in DIMS),
                          mesh_dim_names=DIMS)
    groups = {d: dm[d].get_group() for d in DIMS}
    for d, g in groups.items():
        commlog.name_group(g, d)
    coords = topo.coords(rank)
    assert {d: dm.get_local_rank(d) for d in DIMS} == coords, "DeviceMesh and Topology disagree"
    ep = getattr(plan, "ep", 1)
    if ep > 1:
        groups["ep"], groups["edp"] = _expert_groups(topo, ep, rank)
        coords["ep"] = coords["dp"] % ep
    if topo.cp > 1:   # gradients average over dp x cp together (context parallelism folds into DP)
        groups["dp_cp"] = _dp_cp_group(topo, rank)
    return Mesh(topo, rank, coords, groups, dm, ep)


def _dp_cp_group(topo: Topology, rank: int):
    """The ranks that differ only in dp and cp: one group of its own (even where dp = 1 makes it
    the cp group's ranks), so that the log tells gradient averaging from ring attention."""
    mine = None
    for pp, tp in itertools.product(range(topo.pp), range(topo.tp)):
        ranks = [topo.rank_of(pp=pp, dp=d, cp=c, tp=tp)
                 for d, c in itertools.product(range(topo.dp), range(topo.cp))]
        g = dist.new_group(ranks)
        commlog.name_group(g, "dp_cp")
        if rank in ranks:
            mine = g
    return mine


def _expert_groups(topo: Topology, ep: int, rank: int) -> tuple:
    """Split every dp group into consecutive runs of ep ranks ("ep": they share out the experts)
    and group the ranks that hold the same experts ("edp": they average those experts'
    gradients). Every rank creates every group, in the same order (new_group is collective)."""
    mine = {}
    for dp_ranks in topo.groups("dp"):
        runs = [dp_ranks[i:i + ep] for i in range(0, len(dp_ranks), ep)]
        for name, sets in (("ep", runs), ("edp", [list(c) for c in zip(*runs)])):
            for ranks in sets:
                g = dist.new_group(ranks)
                commlog.name_group(g, name)
                if rank in ranks:
                    mine[name] = g
    return mine["ep"], mine["edp"]
