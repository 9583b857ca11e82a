"""The layers of labkit.model's GPT that other layers reuse: attention and the MLP (an MoE's
experts are MLPs: labkit.moe.layer). A leaf: it imports nothing of labkit, so the model and the
mixture of experts both build on it without importing each other.

`cfg` is any object with the fields used (labkit.model.GPTConfig, labkit.moe.layer.MoEConfig).
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, d = cfg.n_embd, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, d
        self.q_proj = nn.Linear(h, cfg.n_head * d, bias=cfg.bias)
        self.k_proj = nn.Linear(h, cfg.kv_heads * d, bias=cfg.bias)
        self.v_proj = nn.Linear(h, cfg.kv_heads * d, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_head * d, h, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):                                                # x: (B, T, h)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, d)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, d)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, d)
        if k.shape[1] != q.shape[1]:  # grouped-query: each kv head serves n_head/n_kv q heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)                          # (B, T, nh*d)
        return F.dropout(self.o_proj(y), self.dropout, self.training)    # (B, T, h)


class MLP(nn.Module):
    def __init__(self, cfg, mult: int | None = None):
        super().__init__()
        hidden = (mult or cfg.ffn_mult) * cfg.n_embd
        self.fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):                                    # (B, T, h)
        x = F.gelu(self.fc(x))                               # (B, T, 4h)
        return F.dropout(self.proj(x), self.dropout, self.training)  # (B, T, h)
