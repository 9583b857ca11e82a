"""Mixed precision for ZeRO-3 the way FSDP2 sets it (torch.distributed.fsdp.MixedPrecisionPolicy),
and which parameters to keep whole instead of sharding.

    from labkit.zero import MixedPrecisionPolicy, ZeRO3
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    zero = ZeRO3(model, torch.optim.AdamW, mp_policy=policy, replicate=one_dimensional, lr=1e-3)

    master shards, optimizer state   the model's own dtype (fp32), sharded: the optimizer never
                                     sees a low-precision number
    all-gather, forward, backward    param_dtype: each rank casts its fp32 shard BEFORE the
                                     all-gather, so the gather moves half the bytes in bf16
    gradients' reduce-scatter        reduce_dtype (None: param_dtype), then cast up to the fp32
                                     shard gradients the optimizer reads
    each unit's floating inputs      cast to param_dtype (cast_forward_inputs)
    each unit's floating outputs     cast to output_dtype (None: left as computed)

Module-level casts, not op-level ones (torch.autocast): they happen at unit boundaries only, and
backward uses low-precision activations. A torch.distributed.fsdp.MixedPrecisionPolicy is
accepted as well (same fields). None (the default): every dtype stays the model's own.

labkit is stricter than FSDP2 on one point: reduce_dtype may not be narrower than the dtype the
gradients are computed in (param_dtype, or the model's dtype): that would round every gradient
before the sum over ranks, where precision matters most. Compress the all-gather with param_dtype
instead, or reduce in bf16 only when computing in bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# reduce-scatter and all-gather must work on them with a plain cast (float8 needs scales: ch. 09)
CAST_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's fields and defaults; checked at construction (a ValueError says what to change)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            check_dtype(field, getattr(self, field))


def check_dtype(field: str, dtype) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{field}={dtype!r} is not a torch.dtype: pass torch.bfloat16, "
                         f"torch.float16 or torch.float32 (or None: keep the model's dtype)")
    if not dtype.is_floating_point:
        raise ValueError(f"{field}={dtype} is not a floating dtype: parameters and gradients "
                         f"cannot be cast to it; use torch.bfloat16, torch.float16 or "
                         f"torch.float32 (or None)")
    if dtype not in CAST_DTYPES:
        raise ValueError(f"{field}={dtype}: a plain cast to it loses the range (float8 needs a "
                         f"scale per tensor or block, chapter 09); use one of "
                         f"{', '.join(str(d) for d in CAST_DTYPES)}")


def resolve(policy, master_dtype: torch.dtype) -> tuple:
    """(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs) with FSDP2's defaults:
    reduce_dtype None -> param_dtype; a None left means "the parameter's own dtype"."""
    if policy is None:
        return None, None, None, False
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        check_dtype(field, getattr(policy, field, None))   # torch's policy is not checked
    param = policy.param_dtype
    reduce = policy.reduce_dtype or param
    compute = param or master_dtype
    if reduce is not None and reduce.itemsize < compute.itemsize:
        raise ValueError(
            f"reduce_dtype={reduce} is narrower than the dtype gradients are computed in "
            f"({compute}, param_dtype or the model's own): every gradient would be rounded "
            f"before the sum over ranks. Use reduce_dtype={compute} or None (= param_dtype), "
            f"or set param_dtype={reduce} too")
    return param, reduce, policy.output_dtype, bool(policy.cast_forward_inputs)


def resolve_model_policy(policy, params) -> tuple:
    """(param_dtype, reduce_dtype) for ZeRO-1/2, which cast the model's parameters themselves
    (the model computes in param_dtype; fp32 master shards hold the optimizer's copy):
    output_dtype has no unit boundary to act at there, so it is refused."""
    if policy is None:
        return None, None
    if getattr(policy, "output_dtype", None) is not None:
        raise ValueError("output_dtype applies to ZeRO-3's units; ZeRO-1/2 cast the whole model "
                         "to param_dtype: leave output_dtype=None (cast the loss yourself)")
    master = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    param, reduce, _, _ = resolve(policy, master)
    return param, reduce


def cast_floating(x, dtype):
    """x (a tensor, or a tuple/list of them) with its floating tensors cast to dtype (None:
    unchanged). Integers (token ids) and bools are never cast."""
    if dtype is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(cast_floating(v, dtype) for v in x)
    return x


# ----------------------------------------------------------------------------- replication
def one_dimensional(name: str, p: torch.Tensor) -> bool:
    """replicate= choice: norm weights and biases (1-D) stay whole on every rank."""
    return p.dim() < 2


def smaller_than(numel: int):
    """replicate= choice: parameters with fewer than `numel` elements stay whole (DeepSpeed's
    stage3_param_persistence_threshold draws the same line for gathering)."""
    def small(name: str, p: torch.Tensor) -> bool:
        return p.numel() < numel
    return small


def replicated_ids(model, replicate) -> set:
    """ids of the parameters `replicate(name, p)` keeps whole (None: none)."""
    if replicate is None:
        return set()
    if not callable(replicate):
        raise ValueError(f"replicate={replicate!r} must be None or a function (name, parameter) "
                         f"-> bool, e.g. labkit.zero.precision.one_dimensional or "
                         f"smaller_than(1000)")
    return {id(p) for n, p in model.named_parameters() if replicate(n, p)}
