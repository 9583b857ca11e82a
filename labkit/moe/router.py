"""Routing tokens to experts: gate, top-k, capacity, and the two ways to balance the load.

    r = route(scores_logits, k=2, gate="softmax", capacity=C, bias=b)   # a Routing
    r.expert, r.weight, r.kept       # (n, k) each: chosen experts, their weights, not dropped

Gates (the score each expert gets for a token, from the router's logits (n, E)):
  softmax  probabilities over the E experts (Switch Transformer, GShard, Mixtral); the k chosen
           weights are renormalized to sum to 1 when k > 1 (Mixtral's choice)
  sigmoid  an independent sigmoid per expert, the chosen k renormalized (DeepSeek-V3)

Capacity (Switch, GShard): an expert takes at most C = ceil(factor * n * k / E) assignments of the
n tokens in its group; beyond that an assignment is dropped (the token skips that expert: its
residual connection carries it). Priority: every token's first choice before any second choice,
and within a choice, earlier tokens first.

Balancing:
  Switch loss      E * sum_i f_i * P_i, f_i the fraction of assignments expert i received and P_i
                   the mean gate probability it got; minimized (= 1) by a uniform load
  loss-free bias   DeepSeek-V3: a per-expert bias b_i added to the scores for *choosing* only
                   (never to the weights); after each step b_i += rate * sign(mean load - load_i)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.costs import moe as moe_costs

GATES = ("softmax", "sigmoid")
# Assignments one expert may take, ceil(factor * n * k / E): the cost model's one definition,
# here too because chapter 08 and the MoE layer route with it.
capacity = moe_costs.capacity


@dataclass
class Routing:
    expert: torch.Tensor       # (n, k) int64: chosen experts, best first
    weight: torch.Tensor       # (n, k) gate weights (differentiable), 0 where dropped
    kept: torch.Tensor         # (n, k) bool: assignment within its expert's capacity
    probs: torch.Tensor        # (n, E) gate probabilities (for the Switch loss)
    load: torch.Tensor         # (E,) assignments each expert received, before dropping


def route(logits: torch.Tensor, k: int, gate: str = "softmax", capacity: int | None = None,
          bias: torch.Tensor | None = None) -> Routing:
    """logits: (n, E) for one group of n tokens."""
    n, E = logits.shape
    if gate == "softmax":
        probs = F.softmax(logits, dim=-1)                               # (n, E)
    elif gate == "sigmoid":
        probs = torch.sigmoid(logits)                                   # (n, E)
    else:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    choose = probs if bias is None else probs + bias                    # bias picks, never weighs
    expert = choose.topk(k, dim=-1).indices                             # (n, k)
    weight = probs.gather(1, expert)                                    # (n, k)
    if k > 1 or gate == "sigmoid":
        weight = weight / weight.sum(-1, keepdim=True)
    load = torch.bincount(expert.reshape(-1), minlength=E)              # (E,)
    kept = keep_within_capacity(expert, E, capacity)
    if gate == "sigmoid":
        probs = probs / probs.sum(-1, keepdim=True)                     # P_i for the Switch loss
    return Routing(expert, weight * kept, kept, probs, load)


def keep_within_capacity(expert: torch.Tensor, n_expert: int, cap: int | None) -> torch.Tensor:
    """(n, k) bool: which assignments fit. First choices of all tokens, then second choices, ...;
    within a choice, token order (GShard's priority)."""
    if cap is None:
        return torch.ones_like(expert, dtype=torch.bool)
    order = expert.t().reshape(-1)                                      # (k*n,) choice-major
    onehot = F.one_hot(order, n_expert)                                 # (k*n, E)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1       # place in its expert's queue
    return (position < cap).view(expert.shape[1], -1).t()               # (n, k)


def switch_loss(r: Routing, n_expert: int) -> torch.Tensor:
    """E * sum_i f_i * P_i (Fedus et al. 2021, eq. 4), f over all k choices, before dropping.
    An empty token group (a rank or capacity group with no tokens) has nothing to balance: 0,
    still attached to the router's graph (0/0 would make the whole step's loss NaN)."""
    if r.expert.numel() == 0:
        return r.probs.sum() * 0.0
    f = r.load.to(r.probs.dtype) / r.expert.numel()                     # (E,) fraction routed
    P = r.probs.mean(0)                                                 # (E,) mean probability
    return n_expert * (f * P).sum()


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free step: raise the bias of underloaded experts."""
    with torch.no_grad():
        bias += rate * torch.sign(load.float().mean() - load.float())
