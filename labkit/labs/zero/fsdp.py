"""The same training with PyTorch's own ZeRO-3: FSDP2's `fully_shard` (and ZeRO-1's
`ZeroRedundancyOptimizer`), on CPU with Gloo, for comparison with labkit.zero.

    run(fsdp2_train, 2, args=(TINY, "adamw"))   # -> per rank {"params": {name: full tensor}}

fully_shard is applied bottom-up as FSDP2's docs do: each transformer block is one unit, then the
root (embeddings, final norm, tied head). Its parameters become DTensors sharded on dim 0;
`full_tensor()` all-gathers one for checking.
"""
from __future__ import annotations

from labkit.labs.zero.train import optimizer_spec
from labkit.model import GPT, get_batch, shard_rows, tiny_corpus


def fsdp2_train(cfg, optimizer: str, steps: int = 3, batch_size: int = 12, seed: int = 0,
                mp_policy=None, grad_scaler: bool = False, replicate: int = 1) -> dict:
    """mp_policy: labkit's or torch's MixedPrecisionPolicy (None: fp32 throughout).
    grad_scaler: torch's ShardedGradScaler (fp16's dynamic loss scaling); "scales" then holds
    the scale each step used. replicate > 1: HSDP, fully_shard on a 2-D ("replicate", "shard")
    mesh (FSDP2's hybrid sharding: sharded inside a group, replicated across the groups)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,)) if replicate == 1 else init_device_mesh(
        "cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    model = GPT(cfg, seed=seed)
    shard_kw = {}
    if mp_policy is not None:   # the same four fields
        shard_kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
            output_dtype=mp_policy.output_dtype, cast_forward_inputs=mp_policy.cast_forward_inputs)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **shard_kw)
    fully_shard(model, mesh=mesh, **shard_kw)
    opt_class, kw = optimizer_spec(optimizer)
    opt = opt_class(model.parameters(), **kw)
    scaler = None
    if grad_scaler:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler(device=str(mesh.device_type))
    tokens, losses, scales = tiny_corpus(), [], []
    for step in range(steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)
        loss = model(shard_rows(x, rank, world), shard_rows(y, rank, world))[1]
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    local = sum(p.to_local().numel() for p in model.parameters())
    # the optimizer ran on DTensors: its state is sharded like the parameters
    state = sum(v.to_local().numel() for s in opt.state.values() for k, v in s.items()
                if k == "exp_avg" or k == "momentum_buffer")
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "losses": losses, "local_numel": local, "state_local_numel": state,
            "numel": sum(t.numel() for t in params.values()), "scales": scales}


def zero_redundancy_train(cfg, optimizer: str, steps: int = 3, batch_size: int = 12,
                          seed: int = 0) -> dict:
    """ZeRO-1 the PyTorch way: DDP + torch.distributed.optim.ZeroRedundancyOptimizer."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=seed)
    ddp = DDP(model)
    opt_class, kw = optimizer_spec(optimizer)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=opt_class, **kw)
    tokens = tiny_corpus()
    for step in range(steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)
        ddp(shard_rows(x, rank, world), shard_rows(y, rank, world))[1].backward()
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
