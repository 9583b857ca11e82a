"""The tensor-parallel MLP and attention of a transformer block (Megatron-LM, section 3).

MLP: fc column-parallel, GELU on the slice (elementwise, so it needs no communication), proj
row-parallel. Forward: one all-reduce (g). Backward: one all-reduce (f). Both carry the
activations (B, T, h), never the (h, 4h) weights.

Attention: heads are independent, so q, k, v projections are column-parallel by whole heads
(rank r keeps heads r*nh/tp ... (r+1)*nh/tp - 1, and the matching key-value heads), attention
runs on local heads only, and o_proj is row-parallel. Again one all-reduce forward, one backward.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from labkit.tp.layers import ColumnParallelLinear, RowParallelLinear, check_divisible
from labkit.tp.operators import f, world_of


class NaiveTensorParallelMLP(nn.Module):
    """The naive split: both layers column-parallel, each output all-gathered before the next.

    Correct, but it moves an all-gather of (B, T, 4h) and one of (B, T, h) forward and two
    all-reduces backward, where Megatron's column-then-row pairing moves one all-reduce of
    (B, T, h) each way. Kept beside TensorParallelMLP so the difference can be measured."""

    def __init__(self, fc: ColumnParallelLinear, proj: ColumnParallelLinear, dropout: float = 0.0):
        super().__init__()
        self.fc, self.proj, self.dropout = fc, proj, dropout

    @classmethod
    def from_mlp(cls, mlp, group=None):
        return cls(ColumnParallelLinear.from_linear(mlp.fc, group, gather_output=True),
                   ColumnParallelLinear.from_linear(mlp.proj, group, gather_output=True),
                   mlp.dropout)

    def forward(self, x):                                    # (B, T, h)
        x = F.gelu(self.fc(x))                               # (B, T, 4h) gathered
        return F.dropout(self.proj(x), self.dropout, self.training)  # (B, T, h) gathered


class TensorParallelMLP(nn.Module):
    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear, dropout: float = 0.0):
        super().__init__()
        self.fc, self.proj, self.dropout = fc, proj, dropout

    @classmethod
    def from_mlp(cls, mlp, group=None):
        """Shard labkit.model.MLP (fc: h -> 4h, proj: 4h -> h) over `group`."""
        return cls(ColumnParallelLinear.from_linear(mlp.fc, group),
                   RowParallelLinear.from_linear(mlp.proj, group, input_is_parallel=True),
                   mlp.dropout)

    def forward(self, x):                                    # (B, T, h) whole on every rank
        x = F.gelu(self.fc(x))                               # (B, T, 4h/tp) f inside fc
        return F.dropout(self.proj(x), self.dropout, self.training)  # (B, T, h) g inside proj


class TensorParallelAttention(nn.Module):
    """Causal self-attention with this rank's n_head/tp query heads and n_kv_head/tp kv heads."""

    def __init__(self, q_proj, k_proj, v_proj, o_proj, head_dim: int, dropout: float = 0.0):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.head_dim, self.dropout = head_dim, dropout

    @classmethod
    def from_attention(cls, attn, group=None):
        """Shard labkit.model.CausalSelfAttention over `group`, whole heads per rank."""
        _, tp = world_of(group)
        check_divisible("n_head", attn.n_head, tp)
        check_divisible("n_kv_head", attn.n_kv_head, tp)
        col = [ColumnParallelLinear.from_linear(p, group)
               for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        o = RowParallelLinear.from_linear(attn.o_proj, group, input_is_parallel=True)
        return cls(*col, o, attn.head_dim, attn.dropout)

    def forward(self, x):                                    # (B, T, h)
        B, T, _ = x.shape
        x = f(x, self.q_proj.group)  # one f for q, k and v: dL/dx is all-reduced once, not 3x
        q = self._heads(self._local(self.q_proj, x), B, T)   # (B, nh/tp, T, d)
        k = self._heads(self._local(self.k_proj, x), B, T)   # (B, nkv/tp, T, d)
        v = self._heads(self._local(self.v_proj, x), B, T)   # (B, nkv/tp, T, d)
        if k.shape[1] != q.shape[1]:  # grouped-query: the rank's q heads use its own kv heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)              # (B, T, nh/tp * d)
        return F.dropout(self.o_proj(y), self.dropout, self.training)  # (B, T, h) after g

    def _heads(self, t, B, T):
        return t.view(B, T, -1, self.head_dim).transpose(1, 2)

    @staticmethod
    def _local(layer: ColumnParallelLinear, x):
        """The column-parallel projection without its own f (the block applied f once)."""
        return F.linear(x, layer.weight, layer.bias)         # (B, T, heads/tp * d)
