"""A tiny GPT on one device: the reference every parallel version in the book is compared to.

    from labkit.model import GPT, GPTConfig, tiny_corpus, get_batch
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4), seed=0)
    tokens = tiny_corpus()                                   # (N,) int64, character level
    x, y = get_batch(tokens, batch_size=8, block_size=32, step=0)
    logits, loss = model(x, y)

Plain on purpose (after nanoGPT): pre-norm blocks, causal self-attention with separate q, k, v
projections (so tensor parallelism can split heads, and key-value heads for grouped-query
attention), a GELU MLP, tied input/output embeddings by default. Built deterministically from
`seed` with a private generator, so every rank builds the same weights without touching the
global random state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.costs import models
from labkit.layers import MLP, CausalSelfAttention
from labkit.moe.layer import MoE
from labkit.shard import even_bounds


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96          # printable ASCII + newline, see tiny_corpus()
    block_size: int = 32          # longest context
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None  # None: = n_head (multi-head attention); fewer: grouped-query
    n_embd: int = 32
    ffn_mult: int = 4             # MLP hidden size = ffn_mult * n_embd
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    # mixture of experts (labkit.moe): n_expert > 0 replaces every block's MLP by a routed layer
    n_expert: int = 0             # 0: the dense MLP
    expert_top_k: int = 2         # experts each token visits
    expert_ffn_mult: int | None = None   # an expert's hidden size / n_embd (None: ffn_mult)
    capacity_factor: float | None = None  # None: no token is ever dropped
    gate: str = "softmax"         # "softmax" (Switch, Mixtral) or "sigmoid" (DeepSeek-V3)
    shared_expert: bool = False   # one always-on expert beside the routed ones (DeepSeek)
    aux_loss_coef: float = 0.0    # weight of the Switch load-balancing loss in the loss
    bias_update_rate: float = 0.0  # DeepSeek-V3's loss-free balancing step (0: off)

    def __post_init__(self):
        kv = self.kv_heads
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % kv:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={kv}")
        if self.n_expert and not 1 <= self.expert_top_k <= self.n_expert:
            raise ValueError(f"expert_top_k={self.expert_top_k} must be between 1 and "
                             f"n_expert={self.n_expert}: a token cannot visit more experts "
                             f"than there are")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} would drop every token; "
                             f"use a positive factor (1.0-2.0 is usual) or None for no limit")

    @property
    def kv_heads(self) -> int:
        return models.kv_heads(self.n_head, self.n_kv_head)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoE(cfg) if cfg.n_expert else MLP(cfg)

    def forward(self, x):                                    # (B, T, h)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight  # one tensor, two uses
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 style init from a private generator: same seed, same weights, on any rank."""
        g = torch.Generator().manual_seed(seed)
        std_proj = 0.02 / math.sqrt(2 * self.config.n_layer)  # residual projections scaled down
        for name, p in self.named_parameters():  # shared tensors appear once
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)  # LayerNorm weight
            else:
                residual = name.endswith("o_proj.weight") or (".mlp." in name
                                                               and name.endswith(".proj.weight"))
                std = std_proj if residual else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, idx, targets=None):                    # idx: (B, T) int64
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} is longer than block_size="
                             f"{self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)                    # (B, T, h)
        x = F.dropout(x, self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x)                                     # (B, T, h)
        logits = self.lm_head(self.ln_f(x))                  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            if self.config.n_expert and self.config.aux_loss_coef:
                loss = loss + self.config.aux_loss_coef * sum(b.mlp.aux for b in self.blocks)
        return logits, loss


def num_parameters(model: nn.Module) -> int:
    """Parameters counted once each (a tied embedding is one tensor)."""
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- data
_VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 characters


def tiny_corpus() -> torch.Tensor:
    """The book's own small text, character-tokenised: (N,) int64 in [0, 96)."""
    text = resources.files("labkit").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return encode(text)


def encode(text: str) -> torch.Tensor:
    table = {c: i for i, c in enumerate(_VOCAB)}
    return torch.tensor([table.get(c, table[" "]) for c in text], dtype=torch.long)


def decode(tokens) -> str:
    return "".join(_VOCAB[int(t)] for t in tokens)


def get_batch(tokens: torch.Tensor, batch_size: int, block_size: int, step: int, seed: int = 0):
    """The global batch for `step`: (x, y), each (batch_size, block_size).

    Deterministic in (seed, step), so every rank can build the same global batch and take its
    own rows, and a one-process reference sees exactly the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - block_size - 1, (batch_size,), generator=g)
    x = torch.stack([tokens[s:s + block_size] for s in starts.tolist()])         # (B, T)
    y = torch.stack([tokens[s + 1:s + 1 + block_size] for s in starts.tolist()])  # (B, T)
    return x, y


def shard_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank's contiguous share of dim 0; the first `len % world` ranks get one extra row."""
    lo, hi = even_bounds(t.shape[0], world, rank)
    return t[lo:hi]
