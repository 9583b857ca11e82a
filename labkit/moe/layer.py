"""A mixture-of-experts layer in place of a block's MLP (GShard, Switch Transformer, Mixtral,
DeepSeek-V3), on one process: the reference expert parallelism is compared to.

    cfg = GPTConfig(n_expert=8, expert_top_k=2, capacity_factor=1.25)
    model = GPT(cfg)                      # every block's MLP is an MoE
    logits, loss = model(x, y)            # loss includes aux_loss_coef * Switch loss
    model.blocks[0].mlp.stats             # tokens per expert, dropped assignments (last forward)

Each token's hidden state (h,) goes to the router (a linear map h -> E), which picks k experts
(labkit.moe.router); each chosen expert (an MLP, like the dense block's but usually narrower)
transforms it, and the outputs are added, weighted by the gate: y = sum_j w_j * expert_j(x) (plus
a shared expert's output, if there is one). Parameters grow with E; compute per token grows with
k only: that is the point of a mixture.

Capacity is counted per group of tokens (GShard's groups): by default the whole batch is one
group; expert parallelism makes each rank's tokens a group, and the reference is told the same
groups (`token_groups`) so that both drop exactly the same assignments.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn as nn

from labkit.layers import MLP
from labkit.moe.router import bias_update, capacity, route, switch_loss


@dataclass(frozen=True)
class MoEConfig:
    """What an MoE layer is built from (labkit.model.GPTConfig has the same fields; MoE takes
    either): widths, experts, routing and balancing."""
    n_embd: int
    n_expert: int
    expert_top_k: int = 2
    ffn_mult: int = 4                    # the dense MLP's; experts use expert_ffn_mult if set
    expert_ffn_mult: int | None = None
    capacity_factor: float | None = None
    gate: str = "softmax"
    shared_expert: bool = False
    bias_update_rate: float = 0.0
    bias: bool = True
    dropout: float = 0.0

    @classmethod
    def of(cls, cfg) -> MoEConfig:
        """The MoE fields of a GPTConfig (or an MoEConfig, as it is)."""
        if isinstance(cfg, cls):
            return cfg
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        cfg = MoEConfig.of(cfg)
        h, E = cfg.n_embd, cfg.n_expert
        self.n_expert, self.k, self.gate = E, cfg.expert_top_k, cfg.gate
        self.capacity_factor, self.bias_rate = cfg.capacity_factor, cfg.bias_update_rate
        self.router = nn.Linear(h, E, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.expert_ffn_mult) for _ in range(E))
        self.shared = MLP(cfg, cfg.expert_ffn_mult) if cfg.shared_expert else None
        self.register_buffer("balance_bias", torch.zeros(E))   # DeepSeek-V3's, never trained
        self.token_groups = None     # sizes of the capacity groups (None: one group)
        self.aux = self.router.weight.new_zeros(())
        self.stats: dict = {}
        self.step_load = None        # (E,) assignments since the last bias step (all forwards)

    def groups_of(self, n: int) -> list:
        sizes = self.token_groups or [n]
        if sum(sizes) != n:
            raise ValueError(f"token_groups {sizes} add up to {sum(sizes)}, not the {n} tokens "
                             f"of this batch")
        return sizes

    def routing(self, x: torch.Tensor):
        return route_group(self, x)

    def forward(self, x):                                            # (B, T, h)
        B, T, h = x.shape
        flat = x.reshape(-1, h)                                      # (n, h)
        out, aux, load, dropped = [], 0.0, 0, 0
        for xg in flat.split(self.groups_of(flat.shape[0])):         # (n_g, h) each group
            r, _ = self.routing(xg)
            yg = torch.zeros_like(xg)                                # (n_g, h)
            for e, expert in enumerate(self.experts):
                tok, slot = torch.nonzero((r.expert == e) & r.kept, as_tuple=True)
                if tok.numel():
                    y = expert(xg[tok]) * r.weight[tok, slot].unsqueeze(-1)   # (m, h)
                    yg = yg.index_add(0, tok, y)
            out.append(yg)
            aux = aux + switch_loss(r, self.n_expert) * (xg.shape[0] / max(flat.shape[0], 1))
            load = load + r.load
            dropped += int((~r.kept).sum())
        y = torch.cat(out)                                           # (n, h)
        if self.shared is not None:
            y = y + self.shared(flat)
        self.aux = aux
        self.stats = {"load": load.detach(), "dropped": dropped,
                      "assignments": flat.shape[0] * self.k}
        add_load(self, load)
        return y.view(B, T, h)

    def update_bias(self, load=None) -> None:
        """After an optimizer step: DeepSeek-V3's bias step from the step's load (every forward
        since the last step: a pipeline runs one per micro-batch); the count starts again."""
        load = self.step_load if load is None else load
        if self.bias_rate and load is not None:
            bias_update(self.balance_bias, load, self.bias_rate)
        self.step_load = None


def route_group(layer, x: torch.Tensor):
    """Route one group x (n, h) with `layer`'s router and settings: (Routing, capacity). Shared
    by the one-process layer and its expert-parallel version, so both choose alike."""
    cap = capacity(x.shape[0], layer.k, layer.n_expert, layer.capacity_factor)
    bias = layer.balance_bias if layer.bias_rate else None
    return route(layer.router(x), layer.k, layer.gate, cap, bias), cap


def add_load(layer, load) -> None:
    load = load.detach()
    layer.step_load = load.clone() if layer.step_load is None else layer.step_load + load


def moe_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, MoE) or hasattr(m, "local_experts")]


def set_token_groups(model, sizes) -> None:
    """Tell every MoE layer of `model` how the batch's tokens are grouped for capacity."""
    for m in moe_layers(model):
        m.token_groups = list(sizes)


def update_biases(model) -> None:
    for m in moe_layers(model):
        m.update_bias()
