"""apply_tp: labkit.model's GPT turned into its tensor-parallel version over a process group.

    model = apply_tp(GPT(cfg, seed=0), group)   # in place; every rank keeps its own shards
    full = gather_tp_state(model)               # the one-process state_dict, every rank

As in torchtitan, parallelism is a transform of a plain model: every rank builds the same full
model (same seed), then keeps its slice of each attention and MLP weight. Embeddings, layer norms
and the (tied) output head stay replicated; their gradients come out whole and identical on
every rank because f all-reduces the gradient entering each block's TP half. So the per-layer
communication is 2 all-reduces forward (g after attention, g after MLP) and 2 backward (f before
each), each of b*s*h elements.
"""
from __future__ import annotations

import torch

from labkit.layers import MLP
from labkit.tp.blocks import TensorParallelAttention, TensorParallelMLP
from labkit.tp.layers import ColumnParallelLinear, RowParallelLinear, _gather_dim
from labkit.tp.operators import world_of


def check_tp_sizes(cfg, tp: int) -> None:
    """Raise one error listing every size of `cfg` that the TP degree `tp` does not divide."""
    sizes = {"n_head": cfg.n_head, "n_kv_head": cfg.kv_heads,
             "ffn hidden (ffn_mult*n_embd)": cfg.ffn_mult * cfg.n_embd}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        listing = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"tensor-parallel degree {tp} must divide {', '.join(bad)}; model has "
                         f"{listing}. Choose a TP degree that divides all of them.")
    if cfg.dropout:
        raise ValueError(f"dropout={cfg.dropout}: tensor-parallel dropout needs per-rank RNG "
                         "tracking, which this book's TP does not do; use dropout=0.0")


def apply_tp(model, group=None):
    """Shard every block's attention (by heads) and MLP (column then row) over `group`. In place.

    A mixture-of-experts layer (labkit.moe) is left whole on every TP rank: its input is whole
    there (after g) and so is its output, so it is correct, only computed tp times; experts are
    split over ranks by expert parallelism (labkit.moe.expert_parallel) instead."""
    _, tp = world_of(group)
    check_tp_sizes(model.config, tp)
    for block in model.blocks:
        block.attn = TensorParallelAttention.from_attention(block.attn, group)
        if isinstance(block.mlp, MLP):
            block.mlp = TensorParallelMLP.from_mlp(block.mlp, group)
    model.tp_group = group
    return model


@torch.no_grad()
def gather_tp_state(model) -> dict:
    """Full parameters by the one-process GPT's names (tied weights once), on every rank."""
    return _gather(model, lambda p: p.detach())


@torch.no_grad()
def gather_tp_grads(model) -> dict:
    """Full gradients by the one-process GPT's parameter names (None where a grad is missing)."""
    return _gather(model, lambda p: None if p.grad is None else p.grad.detach())


def _gather(model, pick) -> dict:
    return gather_tp_tensors(model, {n: pick(p) for n, p in model.named_parameters()})


@torch.no_grad()
def gather_tp_tensors(model, local: dict) -> dict:
    """{name: full tensor} from {name: this rank's tensor (a parameter, its gradient, or None)}
    named as model.named_parameters(): sharded ones are all-gathered over the layer's TP group
    (collective: every rank of the group passes the same names, None in the same places)."""
    out = {}
    tp_layers = {name: m for name, m in model.named_modules()
                 if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    for name, layer in tp_layers.items():
        for pname in ("weight", "bias"):
            key = f"{name}.{pname}"
            if getattr(layer, pname) is None or key not in local:
                continue
            t = local[key]
            out[key] = None if t is None else _whole(layer, pname, t)
    for name, t in local.items():
        if name not in out:
            out[name] = None if t is None else t.clone()
    return out


def _whole(layer, pname: str, t: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, ColumnParallelLinear):
        return _gather_dim(t, 0, layer.group)
    if pname == "weight":
        return _gather_dim(t, 1, layer.group)
    return t.clone()  # row-parallel bias: whole on every rank
