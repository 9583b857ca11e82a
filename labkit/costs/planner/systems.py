"""A Cluster from a named system: the NVLink domain, the links and the chip in one call.

    from labkit.costs import planner
    planner.system_cluster("GB200 NVL72", n_gpus=144)   # 2 racks: domain 72, NVLink 5, 50 GB/s NIC
    planner.system_cluster("HGX H100", n_gpus=144)      # 18 nodes: domain 8, NVLink 4

The system's record (costs.chips.SYSTEMS) says how many GPUs one NVLink domain joins (8 on an HGX
board, 72 in an NVL72 rack) and the NIC per GPU; the chip's record (costs.chips.CHIPS) its NVLink
bandwidth per direction and its peaks. The planner then keeps TP, CP and EP inside the domain
and sends what leaves it over the NIC.
"""
from __future__ import annotations

from labkit.costs import chips
from labkit.costs.plan_inputs import Cluster


def system_cluster(system, n_gpus: int, **overrides) -> Cluster:
    """The Cluster of n_gpus GPUs of `system` (a costs.chips.SYSTEMS name or a chips.System):
    gpus_per_node, nvlink_domain, gpu, intra_bw (the chip's NVLink, one direction) and inter_bw
    (the NIC) from the records; any other Cluster field, or any of these, as a keyword."""
    s = chips.system(system)
    c = chips.chip(s.gpu)
    if c.nvlink is None:
        raise ValueError(f"{s.gpu} has no NVLink bandwidth in costs.chips: pass intra_bw=... "
                         f"(bytes/s per direction, e.g. 450e9 for NVLink 4)")
    kw = dict(gpus_per_node=s.gpus_per_node, nvlink_domain=s.nvlink_domain, gpu=s.gpu,
              intra_bw=c.nvlink, inter_bw=s.nic)
    kw.update(overrides)
    return Cluster(n_gpus, **kw)
