"""Do the mixed-precision policies train like fp32? 50 steps of the tiny GPT under ZeRO-3 with a
bf16 and an fp16 MixedPrecisionPolicy, next to the one-process fp32 reference and to PyTorch's
FSDP2 (fully_shard with the same policy; fp16 with its ShardedGradScaler) on the same batches.

    from labkit.launch import run
    from labkit.labs.zero.tracking import CURVE_MODEL, policy_curves, summary
    per_rank = run(policy_curves, 2, args=(CURVE_MODEL,))
    summary(per_rank, reference_losses)      # worst relative gap per curve

Policies: param_dtype bf16 or fp16 (gathers and compute), reduce_dtype fp32, fp32 master shards
and Adam state. fp16 uses labkit.zero.scaling.ShardedLossScaler (dynamic loss scaling: skip
and halve on inf/NaN, agreed over the ranks). Losses are global: the mean over ranks of each
rank's mean loss over equal rows, as the reference's mean over the whole batch.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from labkit.labs.zero.fsdp import fsdp2_train
from labkit.labs.zero.train import TINY
from labkit.launch import device
from labkit.model import GPT, get_batch, shard_rows, tiny_corpus
from labkit.reference import optimizer_spec
from labkit.zero.precision import MixedPrecisionPolicy
from labkit.zero.scaling import ShardedLossScaler
from labkit.zero.zero3 import ZeRO3

# untied: labkit's units and FSDP2's groups hold the same parameters (bit-identical in bf16)
CURVE_MODEL = dataclasses.replace(TINY, tie_weights=False)
DTYPES = ("bfloat16", "float16")


def labkit_curve(cfg, dtype: str, steps: int, batch_size: int, seed: int = 0) -> dict:
    """Rank side: ZeRO-3 with the policy; {"losses", "scales" (fp16), "skipped"}."""


    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    model = GPT(cfg, seed=seed).to(dev)
    opt_class, kw = optimizer_spec("adamw")
    zero = ZeRO3(model, opt_class, mp_policy=policy, prefetch=True, **kw)
    scaler = ShardedLossScaler() if dtype == "float16" else None
    tokens, losses, scales, skipped = tiny_corpus(), [], [], 0
    for step in range(steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step, seed)           # (B, T)
        x, y = shard_rows(x, rank, world).to(dev), shard_rows(y, rank, world).to(dev)
        loss = model(x, y)[1]
        if scaler is None:
            loss.backward()
            zero.step()
        else:
            scales.append(scaler.scale)
            scaler.scale_loss(loss).backward()
            skipped += not scaler.step(zero)
        zero.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "scales": scales, "skipped": skipped}


def policy_curves(cfg=CURVE_MODEL, steps: int = 50, batch_size: int = 12,
                  dtypes=DTYPES) -> dict:
    """Rank side: {("labkit", dtype): labkit_curve, ("fsdp2", dtype): {"losses", "scales"}}."""

    out = {}
    for dtype in dtypes:
        out[("labkit", dtype)] = labkit_curve(cfg, dtype, steps, batch_size)
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype),
                                      reduce_dtype=torch.float32)
        res = fsdp2_train(cfg, "adamw", steps=steps, batch_size=batch_size, mp_policy=policy,
                          grad_scaler=dtype == "float16")
        out[("fsdp2", dtype)] = {"losses": res["losses"], "scales": res["scales"]}
    return out


def global_losses(per_rank, key) -> list:
    """Mean over ranks of each rank's loss, per step (the global batch's mean loss)."""
    return torch.tensor([r[key]["losses"] for r in per_rank]).mean(0).tolist()


def summary(per_rank, reference: list) -> dict:
    """{key: {"losses": global losses, "vs_fp32": max |l - l_ref| / l_ref over the steps,
    "vs_fsdp2": max |l - l_fsdp2| / l_fsdp2 (labkit keys only)}}"""
    curves = {key: global_losses(per_rank, key) for key in per_rank[0]}
    ref = torch.tensor(reference)

    def gap(a, b):
        return (torch.tensor(a) - b).abs().div(b).max().item()
    out = {}
    for (who, dtype), losses in curves.items():
        row = {"losses": losses, "vs_fp32": gap(losses, ref)}
        if who == "labkit":
            row["vs_fsdp2"] = gap(losses, torch.tensor(curves[("fsdp2", dtype)]))
            row["skipped"] = per_rank[0][(who, dtype)]["skipped"]
        out[(who, dtype)] = row
    return out
