"""apply_cp: the one GPT with its sequence split over a context-parallel group.

    from labkit.context.context_parallel import apply_cp, average_cp_grads
    model = apply_cp(GPT(cfg, seed=0), cp_group, layout="zigzag")
    logits, loss = model(x, y)      # x, y: the whole (B, T) on every cp rank; logits whole
    loss.backward()
    average_cp_grads(model, cp_group)   # standalone; under labkit.parallel: dp x cp averaging

Each rank embeds the whole sequence (cheap), keeps its tokens (labkit.context.layout: rank r of
the zig-zag layout holds chunks r and 2cp-1-r), runs every block on them alone, with attention
as ring attention over the cp group, then all-gathers the hidden states (in position order)
before the final norm and head, so logits and loss are whole and the same on every cp rank.

Gradients: every parameter is replicated over cp, and each rank's backward sees only its own
tokens, so its gradients are partial. They are made to AVERAGE to the whole-batch gradient, like
data parallelism's: the gather before the head passes back cp times this rank's slice of the
gradient (the head and final norm, replicated, already hold the whole gradient, whose average
over cp is itself). So CP folds into DP: average gradients over the dp x cp ranks together
(Megatron-LM does the same), and nothing else changes in the DP stage.

A block already split by labkit.tp (TensorParallelAttention) keeps its heads: f before the
local projections, g inside o_proj, ring attention on this rank's heads in between; the MLP
works token by token and needs nothing. (Sequence parallelism splits the same sequence over tp
and is not combined with this transform here.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.context.layout import LAYOUTS, positions, sizes
from labkit.context.ring_attention import all_gather_kv_attention, ring_attention
from labkit.flat import all_gather_flat
from labkit.observe import commlog
from labkit.tp.blocks import TensorParallelAttention
from labkit.tp.operators import f

METHODS = {"ring": ring_attention, "all_gather": all_gather_kv_attention}


class _GatherTokens(torch.autograd.Function):
    """(B, T_r, h) this rank's tokens -> (B, T, h) in position order. Backward: cp x my rows."""

    @staticmethod
    def forward(ctx, x, group, T, layout):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        n = sizes(T, cp, layout)
        m = max(n)
        mine = F.pad(x, (0, 0, 0, m - x.shape[1])).contiguous()        # (B, m, h) padded
        flat = all_gather_flat(mine.reshape(-1), group, "CP gather for the head")
        parts = flat.view(cp, *mine.shape)                             # (cp, B, m, h)
        pos = torch.cat([positions(T, r, cp, layout, device=x.device) for r in range(cp)])
        rows = torch.cat([parts[r, :, :n[r]] for r in range(cp)], dim=1)  # (B, T, h) rank order
        out = torch.empty_like(rows).index_copy_(1, pos, rows)         # (B, T, h) position order
        ctx.mine, ctx.cp = positions(T, rank, cp, layout, device=x.device), cp
        return out

    @staticmethod
    def backward(ctx, grad):                                 # (B, T, h), the same on every rank
        return grad.index_select(1, ctx.mine) * ctx.cp, None, None, None


def _seq_len(seq: dict, local: int, group) -> int:
    """The whole T: set by the first block; a pipeline stage without it assumes equal chunks."""
    return seq.get("T") or local * dist.get_world_size(group)


class ContextParallelAttention(nn.Module):
    """Causal self-attention over this rank's tokens, keys and values from the whole cp group."""

    def __init__(self, attn, group, layout: str, method: str, seq: dict):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (attn.q_proj, attn.k_proj,
                                                              attn.v_proj, attn.o_proj)
        self.head_dim = attn.head_dim
        self.tp_group = attn.q_proj.group if isinstance(attn, TensorParallelAttention) else False
        self.group, self.layout, self.method, self.seq = group, layout, method, seq

    def forward(self, x):                                    # (B, T_r, h)
        B, Tr, _ = x.shape
        if self.tp_group is not False:
            x = f(x, self.tp_group)                          # Megatron's f, once for q, k, v
        heads = [F.linear(x, p.weight, p.bias).view(B, Tr, -1, self.head_dim).transpose(1, 2)
                 for p in (self.q_proj, self.k_proj, self.v_proj)]
        q, k, v = heads                                      # (B, nh, T_r, d), (B, nkv, T_r, d)
        # k, v stay at nkv heads: the ring moves (and saves) only those
        y = METHODS[self.method](q, k, v, self.group, self.layout,
                                 seq_len=_seq_len(self.seq, Tr, self.group))
        y = y.transpose(1, 2).reshape(B, Tr, -1)             # (B, T_r, nh * d)
        return self.o_proj(y)                                # (B, T_r, h); g inside if TP


class ContextParallelBlock(nn.Module):
    def __init__(self, block, group, layout, method, seq, first: bool):
        super().__init__()
        self.ln_1, self.ln_2, self.mlp = block.ln_1, block.ln_2, block.mlp  # same names
        self.attn = ContextParallelAttention(block.attn, group, layout, method, seq)
        self.group, self.layout, self.seq, self.first = group, layout, seq, first

    def forward(self, x):                                    # first: (B, T, h); else (B, T_r, h)
        if self.first:
            T = self.seq["T"] = x.shape[1]
            rank, cp = dist.get_rank(self.group), dist.get_world_size(self.group)
            x = x.index_select(1, positions(T, rank, cp, self.layout, device=x.device))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GatheringNorm(nn.LayerNorm):
    """The final norm, after the tokens of every cp rank are gathered in position order."""

    def forward(self, x):                                    # (B, T_r, h) -> (B, T, h)
        return super().forward(_GatherTokens.apply(x, self.cp_group,
                                                   _seq_len(self.seq, x.shape[1], self.cp_group),
                                                   self.layout))


def apply_cp(model, group=None, layout: str = "zigzag", method: str = "ring"):
    """Split the sequence of `model` (labkit.model.GPT, optionally after labkit.tp.apply_tp)
    over `group`. In place. method: 'ring' or 'all_gather' (K/V all-gathered, Llama 3 style)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if model.config.dropout:
        raise ValueError(f"dropout={model.config.dropout}: context-parallel dropout needs per-rank "
                         "RNG tracking, not built; use dropout=0.0")
    seq: dict = {}                                           # the whole T, set by the first block
    for i, block in enumerate(model.blocks):
        model.blocks[i] = ContextParallelBlock(block, group, layout, method, seq, first=(i == 0))
    ln = model.ln_f
    norm = GatheringNorm(ln.normalized_shape, eps=ln.eps, bias=ln.bias is not None)
    norm.weight, norm.bias = ln.weight, ln.bias              # the same Parameter objects
    norm.cp_group, norm.seq, norm.layout = group, seq, layout
    model.ln_f = norm
    model.cp_group = group
    return model


@torch.no_grad()
def average_cp_grads(model, group=None) -> None:
    """Average every gradient over the cp group (one flat all-reduce, logged by commlog). Under
    labkit.parallel this is the dp stage's averaging, over dp x cp ranks instead of dp."""
    cp = dist.get_world_size(group)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if cp == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    commlog.all_reduce(flat, group=group, where="CP gradient average")
    flat /= cp
    i = 0
    for g in grads:
        g.copy_(flat[i:i + g.numel()].view_as(g))
        i += g.numel()
