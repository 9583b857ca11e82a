"""The same state through torch.distributed.checkpoint (DCP), for comparison with labkit's own.

DCP stores each rank's chunks plus a `.metadata` file of chunk boxes: the same idea as
labkit.checkpoint.sharded. Tensors are DTensors sharded along dim 0 of the flattened tensor
(like ZeRO/FSDP2); loading into DTensors on a mesh of another size reshards.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from labkit.checkpoint import sharded as sh
from labkit.launch import device


def _mesh(group=None):
    """1-D over the world, on the backend's device (labkit.launch.device: CUDA under NCCL)."""
    return init_device_mesh(device().type, (dist.get_world_size(group),))


def to_dtensors(state: dict, mesh) -> dict:
    """Whole tensors (the same on every rank) -> flat DTensors sharded along dim 0 over mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor  # on use, as DCP below

    return {k: distribute_tensor(v.reshape(-1), mesh, [Shard(0)]) for k, v in state.items()}


def dcp_save(state: dict, path: str, group=None) -> None:
    # imported on use: torch.distributed.checkpoint takes seconds to import (8 s measured on a
    # loaded 2-core machine), which the rest of labkit.checkpoint never needs
    import torch.distributed.checkpoint as dcp

    dcp.save(to_dtensors(state, _mesh(group)), checkpoint_id=path)


def dcp_load(shapes: dict, path: str, group=None) -> dict:
    """Load into fresh DTensors on this world size; return the whole tensors (for checking)."""
    import torch.distributed.checkpoint as dcp

    # distribute_tensor moves each to the mesh's device (torch/distributed/tensor/_api.py)
    empty = {k: torch.zeros(s, dtype=getattr(torch, d))  # cpu: moved to the mesh's device
             for k, (s, d) in shapes.items()}
    target = to_dtensors(empty, _mesh(group))
    dcp.load(target, checkpoint_id=path)
    return {k: target[k].full_tensor().reshape(shapes[k][0]) for k in target}


def reshard_both(root: str, mode: str, seed: int = 0):
    """One rank of the chapter's side-by-side: mode "save" writes the demo state (GPT weights +
    Adam moments) sharded with labkit (ZeRO layout) and with DCP; mode "load" reads both back at
    this world size (resharding) and returns (labkit equal?, DCP equal?, labkit pieces held)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = sh.demo_state(seed=seed)
    shapes = sh.shapes_of(state)
    layout = sh.zero_layout(shapes, world)
    if mode == "save":
        sh.save_sharded(f"{root}/labkit", 1, sh.shard_state(state, layout, rank), layout)
        dcp_save(state, f"{root}/dcp")
        return None
    got = sh.load_sharded(f"{root}/labkit", layout, rank)
    mine = sh.shard_state(state, layout, rank)
    labkit_ok = all(torch.equal(got[k], v) for k, v in mine.items())
    whole = dcp_load(shapes, f"{root}/dcp")
    dcp_ok = all(torch.equal(whole[k], v) for k, v in state.items())
    return labkit_ok, dcp_ok, sum(v.numel() for v in got.values())
