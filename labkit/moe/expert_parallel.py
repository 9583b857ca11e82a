"""Expert parallelism: the experts of every MoE layer sharded over an `ep` group, tokens moved to
their experts and back by all-to-all (GShard, Lepikhin et al. 2020; DeepSpeed-MoE; Megatron-LM).

    apply_ep(model, ep_group)          # in place: rank r keeps experts r*E/ep ... (r+1)*E/ep - 1

Each rank of the ep group holds different tokens (its rows of the batch) and E/ep experts. Per
layer, forward:

    route          each rank routes its own tokens (the router is replicated): (n, k) choices
    counts         how many assignments go to each rank: all_to_all_single of ep integers,
                   so every rank knows how many rows it will receive from each peer
    dispatch       all_to_all_single of the assignments' hidden states (A, h) with those
                   variable split sizes (and of their expert ids)
    experts        each local expert runs on the rows it received
    combine        the reverse all_to_all_single brings each output row home; it is weighted by
                   the gate and added to its token

Backward runs the two all-to-alls in reverse (the gradient of a dispatch is a combine), so an
MoE layer moves two all-to-alls forward and two backward, each about (ep-1)/ep * k * n * h
elements per rank. The router, the shared expert and everything outside the MoE layers stay
replicated over ep and are reduced like data-parallel parameters; the experts are not: each
lives on one rank, and its gradient already sums every rank's tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.moe.layer import MoE, add_load, route_group
from labkit.moe.router import switch_loss
from labkit.observe import commlog


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, where):        # x: (sum in_splits, h)
        ctx.splits, ctx.group, ctx.where = (out_splits, in_splits), group, where
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))    # (sum out_splits, h)
        commlog.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                  where=f"{where} forward")
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        commlog.all_to_all_single(back, grad.contiguous(), in_splits, out_splits,
                                  group=ctx.group, where=f"{ctx.where} backward")
        return back, None, None, None, None


def all_to_all(x, out_splits, in_splits, group, where=""):
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group, where)


class ExpertParallelMoE(nn.Module):
    """An MoE layer whose experts live on the ranks of `group`; see the module docstring."""

    def __init__(self, moe: MoE, group):
        super().__init__()
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.n_expert % ep:
            raise ValueError(f"n_expert={moe.n_expert} experts cannot be split evenly over "
                             f"ep={ep} ranks; use an ep that divides {moe.n_expert}")
        self.group, self.ep, self.rank = group, ep, rank
        self.n_expert, self.k, self.gate = moe.n_expert, moe.k, moe.gate
        self.capacity_factor, self.bias_rate = moe.capacity_factor, moe.bias_rate
        self.per_rank = moe.n_expert // ep
        self.first = rank * self.per_rank
        self.router, self.shared = moe.router, moe.shared
        self.local_experts = nn.ModuleList(moe.experts[self.first:self.first + self.per_rank])
        self.register_buffer("balance_bias", moe.balance_bias.clone())
        self.aux, self.stats, self.step_load = self.router.weight.new_zeros(()), {}, None

    def forward(self, x):                                            # (B, T, h) my tokens
        B, T, h = x.shape
        flat = x.reshape(-1, h)                                      # (n, h)
        r, _ = route_group(self, flat)                               # the reference's routing
        tok, slot = torch.nonzero(r.kept, as_tuple=True)             # kept assignments (A,)
        expert = r.expert[tok, slot]                                 # (A,)
        order = torch.argsort(expert, stable=True)                   # grouped by expert
        tok, slot, expert = tok[order], slot[order], expert[order]
        dev = flat.device
        send = torch.bincount(expert // self.per_rank, minlength=self.ep)   # (ep,) rows per peer
        recv = torch.empty_like(send)
        commlog.all_to_all_single(recv, send, group=self.group, where="MoE counts")
        send_l, recv_l = send.tolist(), recv.tolist()
        ids = torch.empty(sum(recv_l), dtype=expert.dtype, device=dev)
        commlog.all_to_all_single(ids, expert, recv_l, send_l, group=self.group,
                                  where="MoE expert ids")
        rows = all_to_all(flat[tok], recv_l, send_l, self.group, "MoE dispatch")  # (A_in, h)
        # rows * 0, not zeros: the output must depend on the dispatch even on a rank whose
        # experts got no rows, or its backward would skip the all-to-all the others wait in
        out = rows * 0                                               # (A_in, h)
        for j, e in enumerate(self.local_experts):
            idx = torch.nonzero(ids == self.first + j, as_tuple=True)[0]
            if idx.numel():
                out = out.index_copy(0, idx, e(rows[idx]))
        back = all_to_all(out, send_l, recv_l, self.group, "MoE combine")     # (A, h)
        y = torch.zeros_like(flat).index_add(0, tok, back * r.weight[tok, slot].unsqueeze(-1))
        if self.shared is not None:
            y = y + self.shared(flat)
        self.aux = switch_loss(r, self.n_expert)
        self.stats = {"load": r.load.detach(), "dropped": int((~r.kept).sum()),
                      "assignments": flat.shape[0] * self.k}
        add_load(self, r.load)
        return y.view(B, T, h)

    def update_bias(self, load=None) -> None:
        MoE.update_bias(self, load)


def apply_ep(model, group) -> object:
    """Shard every MoE layer's experts over `group` (in place)."""
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            block.mlp = ExpertParallelMoE(block.mlp, group)
    model.ep_group = group
    return model


def expert_parameters(model) -> set:
    """ids of the routed experts' parameters (local experts of an expert-parallel layer, or every
    expert of a one-process MoE layer)."""
    out = set()
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            out |= {id(p) for p in m.local_experts.parameters()}
        elif isinstance(m, MoE):
            out |= {id(p) for p in m.experts.parameters()}
    return out
