"""Hybrid sharded data parallelism (HSDP): ZeRO-3 inside a group of S ranks, replicas across R
such groups. PyTorch's FSDP2 does it with `fully_shard(mesh=2-D mesh)` (placements
(Replicate(), Shard(0))); torchtitan names the two degrees `data_parallel_replicate_degree` and
`data_parallel_shard_degree`; FSDP1 called it `ShardingStrategy.HYBRID_SHARD`.

    mesh = hsdp_mesh(replicate=2, shard=2)                 # inside a launched rank; 4 ranks
    hsdp = HSDP(model, torch.optim.AdamW, mesh, lr=1e-3)
    loss = model(x, y)[1]; loss.backward(); hsdp.step(); hsdp.zero_grad()

Rank layout: rank = r * S + s (replica r, shard s), the shard dimension innermost, as
torchtitan and `init_device_mesh` lay out (replicate, shard): the S ranks of a group are
neighbours, i.e. the GPUs of one node on a real cluster.

A step: forward and backward are ZeRO-3's (labkit.zero.zero3) over the shard group only, so
the parameter all-gathers and the gradient reduce-scatter stay inside the node; then, before
the optimizer, each rank all-reduces its gradient *shard* (Ψ/S values, the mean over its
replica group) across the R ranks that hold the same shard. Per rank and step:

    shard dimension       3 (S-1)/S Ψ       (ZeRO-3 over S: gather, gather again, reduce-scatter)
    replicate dimension   2 (R-1)/R Ψ/S     (a ring all-reduce of the shard)

against 3 (N-1)/N Ψ for ZeRO-3 over all N = R·S ranks, all of it crossing the slow links. The
price is memory: model states are sharded S ways, not N (labkit.costs.zero.hsdp_comm_per_rank,
and `hsdp_or_fsdp` for the choice from link speeds).

The mean over all N ranks: ZeRO-3's reduce-scatter averages over S, this all-reduce over R.
Gradient clipping then measures the norm over the shard group only (every replica holds the same
shards after the all-reduce). `no_sync()` holds full gradients as ZeRO-3's does and sends nothing
on either dimension until the last micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.observe import commlog
from labkit.zero.zero3 import ZeRO3


def hsdp_mesh(replicate: int, shard: int, device_type: str = "cpu"):
    """The 2-D DeviceMesh ("replicate", "shard") over every rank (collective: call it on every
    rank of a launched run; replicate * shard must equal the world size)."""
    from torch.distributed.device_mesh import init_device_mesh  # after the process group exists

    world = dist.get_world_size()
    if replicate < 1 or shard < 1 or replicate * shard != world:
        raise ValueError(f"replicate={replicate} x shard={shard} must be the {world} ranks")
    mesh = init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    commlog.name_group(mesh.get_group("replicate"), "replicate")
    commlog.name_group(mesh.get_group("shard"), "shard")
    return mesh


class HSDP:
    """ZeRO-3 over the mesh's "shard" group, gradient shards all-reduced over "replicate".

    Everything ZeRO3 takes (units, mp_policy, replicate=, prefetch, max_grad_norm, ...) is
    passed through. The shards' gradients are all-reduced in the masters' dtype (fp32 under
    mp_policy, FSDP2's reduce_dtype=float32 default for HSDP's replicate all-reduce too)."""

    def __init__(self, model, optimizer_class, mesh, **zero3_kw):
        self.mesh = mesh
        self.replicate_group = mesh.get_group("replicate")
        self.shard_group = mesh.get_group("shard")
        self.replicas = dist.get_world_size(self.replicate_group)
        self.zero3 = ZeRO3(model, optimizer_class, self.shard_group, **zero3_kw)
        self.model, self.optimizer = model, self.zero3.optimizer

    stage = 3

    @property
    def params(self):
        return self.zero3.params

    @property
    def shards(self):
        return self.zero3.shards

    def no_sync(self):
        return self.zero3.no_sync()

    def all_reduce_replicas(self) -> None:
        """The mean over the replica group of every gradient shard, in one message."""
        grads = [s.grad for s in self.zero3.shards if s.grad is not None]
        if self.replicas == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])          # (sum of c_i,)
        commlog.all_reduce(flat, group=self.replicate_group, where="HSDP replicate all-reduce")
        flat.div_(self.replicas)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def step(self) -> None:
        self.all_reduce_replicas()
        self.zero3.step()

    def zero_grad(self) -> None:
        self.zero3.zero_grad()

    def full_parameters(self) -> dict:
        return self.zero3.full_parameters()

    def held_bytes(self) -> dict:
        return self.zero3.held_bytes()
