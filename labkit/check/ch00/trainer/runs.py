"""Exercise 0.3's runs: the model every rank builds from its own seed, the one-process
reference (which also replays known mistakes, to name them), and the rank job that runs the
reader's trainer watched from outside (the collectives by a dispatch mode, the bytes by the
kernel). The checker keeps this reference of its own on purpose, to stay independent of the
labkit code it would otherwise grade against.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.launch import device, note
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog

DP_IN, DP_HIDDEN, DP_OUT = 8, 512, 4   # an MLP of 6,660 parameters (53 kB in float64)
# one launch per world: (world, label, [config, ...]); a config is one trainer's run
DP_WORLDS = [
    (2, "2 ranks, B = 6 then 5, accumulation 1 then 2", [
        dict(batches=(6, 6, 6), accumulation=1, max_norm=None, optimizer="momentum"),
        dict(batches=(5, 5, 5), accumulation=2, max_norm=20.0, optimizer="momentum")]),
    (3, "3 ranks, B = 7, accumulation 2 (and hidden batches)", [
        dict(batches=(7, 7, 7), accumulation=2, max_norm=None, optimizer="momentum"),
        dict(batches=(8, 2, 8), accumulation=1, max_norm=40.0, optimizer="momentum",
             frozen=("fc1.bias",))]),
    (4, "hidden case: 4 ranks", [
        dict(batches=(10, 3, 10), accumulation=3, max_norm=None, optimizer="adam",
             frozen=("fc2.weight",)),
        dict(batches=(5, 4, 5), accumulation=2, max_norm=30.0, optimizer="momentum",
             group=(1, 2, 3))]),
]
BYTES_SLACK = 0.10          # over the ring's 2(N-1)/N per step: Gloo's headers, a float or two
BYTES_HEADROOM = 8 * 2**10  # absolute: a few hundred bytes of header per message
EXTRA_ELEMENTS = 8          # a flat buffer may carry the loss (and a count or two) with the grads
DP_TIMEOUT = 60.0           # seconds: 4 ranks on 2 busy cores start slowly; a real hang waits this
NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "center")


class MLP(torch.nn.Module):
    """fc2(tanh(fc1(x - center))): `center` is a buffer (state that is not trained)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DP_IN, DP_HIDDEN)
        self.fc2 = torch.nn.Linear(DP_HIDDEN, DP_OUT)
        self.register_buffer("center", torch.zeros(DP_IN))

    def forward(self, x):                                 # (B, d_in) -> (B, d_out)
        return self.fc2(torch.tanh(self.fc1(x - self.center)))


def mlp(seed: int, frozen=()) -> torch.nn.Module:
    """The model every rank builds, from its own seed (so ranks start different); the
    parameters named in `frozen` do not train (requires_grad False)."""
    g = torch.Generator().manual_seed(seed)
    model = MLP().double()
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.3)  # cpu: seeded
            t.requires_grad_(t.requires_grad and name not in frozen)
    return model


def state(model) -> list:
    """Parameters, then buffers: what every replica must agree on."""
    return [t.detach().cpu().clone() for t in list(model.parameters()) + list(model.buffers())]


def trainable_numel(cfg: dict) -> int:
    return sum(p.numel() for p in mlp(0, cfg.get("frozen", ())).parameters() if p.requires_grad)


def seed_of(rank: int, config: int) -> int:
    return 1000 + 10 * config + rank          # every rank, every trainer: its own weights


def dp_batch(batch: int, step: int):
    g = torch.Generator().manual_seed(100 * step + batch)
    x = torch.randn(batch, DP_IN, generator=g, dtype=torch.float64)   # cpu: seeded; (B, d_in)
    y = torch.randn(batch, DP_OUT, generator=g, dtype=torch.float64)  # cpu: seeded; (B, d_out)
    return x, y


def make_optimizer(name: str, params):
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def rows(n: int, parts: int, i: int) -> tuple:
    """The i-th of `parts` contiguous pieces of n rows, the first n % parts one row longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


def members(cfg: dict, world: int) -> tuple:
    return tuple(cfg.get("group") or range(world))


# ----------------------------------------------------------------------------- one process
def reference(cfg: dict, index: int, world: int, rule: str = "mean"):
    """One process from group rank 0's initial model: (state, losses); see _reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # a tiny model: a thread pool on a busy machine only waits
    try:
        return _reference(cfg, index, world, rule)
    finally:
        torch.set_num_threads(threads)


def _reference(cfg: dict, index: int, world: int, rule: str = "mean"):
    """One process from group rank 0's initial model: (params, losses). `rule` other than
    "mean" gives the answer of a known mistake, to name it in a hint: "mean_of_means" (each
    rank's mean over its own rows, averaged over ranks), "sum_of_means" (the same, summed),
    "clip_per_rank" (each rank's part clipped before the sum), "no_clip"."""

    group = members(cfg, world)
    model = mlp(seed_of(group[0], index), cfg.get("frozen", ()))
    params = [p for p in model.parameters() if p.requires_grad]
    opt, losses = make_optimizer(cfg["optimizer"], params), []
    for step, batch in enumerate(cfg["batches"]):
        x, y = dp_batch(batch, step)
        opt.zero_grad()
        with torch.no_grad():
            losses.append(F.mse_loss(model(x), y).item())
        if rule in ("mean", "no_clip"):
            F.mse_loss(model(x), y).backward()            # the whole batch, as one process
        else:
            total = [torch.zeros_like(p) for p in params]
            for r in range(len(group)):
                lo, hi = rows(batch, len(group), r)
                if hi == lo:
                    continue
                part = torch.autograd.grad(F.mse_loss(model(x[lo:hi]), y[lo:hi]), params)
                share = {"mean_of_means": 1 / len(group), "sum_of_means": 1.0,
                         "clip_per_rank": (hi - lo) / batch}[rule]
                part = [g * share for g in part]
                if rule == "clip_per_rank":
                    _clip(part, cfg["max_norm"])
                total = [t + g for t, g in zip(total, part)]
            for p, g in zip(params, total):
                p.grad = g
        if cfg["max_norm"] is not None and rule not in ("no_clip", "clip_per_rank"):
            torch.nn.utils.clip_grad_norm_(params, cfg["max_norm"])
        opt.step()
    return state(model), losses


def _clip(grads, max_norm):
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(min(1.0, max_norm / (norm.item() + 1e-6)))


# ----------------------------------------------------------------------------- rank side
def dp_job(cls, configs):
    """Rank side: the reader's trainer on this rank's own model, watched from outside."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    groups = [dist.new_group(list(cfg["group"])) if cfg.get("group") else None
              for cfg in configs]                      # every rank creates every group, in order
    out = []
    for index, (cfg, group) in enumerate(zip(configs, groups)):
        if rank not in members(cfg, world):
            out.append(None)
            continue
        model = mlp(seed_of(rank, index), cfg.get("frozen", ())).to(dev)   # ranks differ
        seen = [[]]                                    # rows of each forward, per step
        model.register_forward_pre_hook(               # bound: this config's model and list
            lambda m, args, seen=seen: seen[-1].append(args[0].detach().cpu()))
        opt = make_optimizer(cfg["optimizer"], model.parameters())
        kwargs = dict(accumulation=cfg["accumulation"], max_norm=cfg["max_norm"])
        if group is not None:
            kwargs["group"] = group                    # else the default: the whole world
        note(f"your DataParallelTrainer.__init__ ({len(members(cfg, world))} ranks)")
        batches = [[t.to(dev) for t in dp_batch(batch, step)]
                   for step, batch in enumerate(cfg["batches"])]
        # one byte count over __init__ and all steps: each count reads the kernel's tables
        with netcount.socket_bytes() as net:
            with CollectiveLog() as log:
                trainer = cls(model, opt, F.mse_loss, **kwargs)
            row = {"start": state(model), "init_calls": log.sized(), "steps": []}
            for step, (x, y) in enumerate(batches):
                seen.append([])
                note(f"your step() {step} of {len(batches)}, batch {x.shape[0]}")
                with CollectiveLog() as log:
                    loss = trainer.step(x.clone(), y.clone())
                if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                    loss = loss.item()
                row["steps"].append({"calls": log.sized(), "loss": loss if isinstance(
                    loss, (int, float)) else repr(loss)})
        row["sent"] = net.sent
        row["seen"] = seen[1:]
        row["params"] = state(model)
        out.append(row)
    dist.barrier()
    return out
