"""A tiny training run that draws from every generator: the subject of the exact-resume lab.

Dropout uses torch's generator (different per rank), the data order is reshuffled every epoch by
NumPy's global generator and each window's start is jittered by Python's `random` (the same on
every rank, so the ranks agree on the global batch). Gradients are averaged over the ranks with
an all-reduce (plain data parallelism), so the replicas stay identical.

    params = run(resume_job, 2, args=(RunConfig(), 12, None, root, "straight"))
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from labkit.checkpoint.full import load_full, rank_world, save_full
from labkit.checkpoint.rng import rng_state, seed_everything, set_rng_state
from labkit.model import GPT, GPTConfig, tiny_corpus


@dataclass(frozen=True)
class RunConfig:
    n_embd: int = 16
    n_layer: int = 1
    n_head: int = 2
    block_size: int = 16
    dropout: float = 0.1
    batch_size: int = 4      # global batch (rows), split over the ranks
    n_windows: int = 24      # windows of the corpus per epoch (small: epochs turn over quickly)
    lr: float = 3e-3
    seed: int = 0

    def model_config(self) -> GPTConfig:
        return GPTConfig(n_embd=self.n_embd, n_layer=self.n_layer, n_head=self.n_head,
                         block_size=self.block_size, dropout=self.dropout)


class ShuffledData:
    """Corpus windows in an order NumPy reshuffles each epoch; its position is checkpointable."""

    def __init__(self, tokens: torch.Tensor, n_windows: int, block_size: int):
        self.tokens, self.n, self.block_size = tokens, n_windows, block_size
        self.stride = (len(tokens) - block_size - 8) // n_windows
        self.epoch, self.cursor, self.perm = -1, n_windows, torch.arange(n_windows)

    def next_batch(self, batch_size: int, rank: int = 0, world: int = 1):
        idx = []
        for _ in range(batch_size):
            if self.cursor >= self.n:  # a new epoch: a fresh order from NumPy's generator
                self.epoch, self.cursor = self.epoch + 1, 0
                self.perm = torch.from_numpy(np.random.permutation(self.n))
            idx.append(int(self.perm[self.cursor]))
            self.cursor += 1
        jitter = [random.randrange(8) for _ in idx]  # augmentation from Python's generator
        starts = [i * self.stride + j for i, j in zip(idx, jitter)]
        mine = starts[rank::world]  # this rank's rows of the global batch
        x = torch.stack([self.tokens[s:s + self.block_size] for s in mine])           # (b, T)
        y = torch.stack([self.tokens[s + 1:s + 1 + self.block_size] for s in mine])   # (b, T)
        return x, y

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "perm": self.perm.clone()}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.cursor, self.perm = s["epoch"], s["cursor"], s["perm"].clone()


def build(cfg: RunConfig, group=None):
    """A fresh run as step 0 sees it: seeded generators, model, AdamW, data."""
    rank, _ = rank_world(group)
    seed_everything(cfg.seed)
    torch.manual_seed(cfg.seed + 1000 * rank)  # dropout masks differ per rank, as in real DP
    model = GPT(cfg.model_config(), seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    data = ShuffledData(tiny_corpus(), cfg.n_windows, cfg.block_size)
    return model, opt, data


def train(model, opt, data, cfg: RunConfig, steps: int, group=None) -> list:
    """`steps` data-parallel steps; returns the losses (averaged over ranks)."""
    rank, world = rank_world(group)
    losses = []
    model.train()
    for _ in range(steps):
        x, y = data.next_batch(cfg.batch_size, rank, world)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad /= world
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=group)
            loss /= world
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])  # (P,)


def resume_job(cfg: RunConfig, total: int, stop_at, root, mode: str,
               capture=rng_state, restore=set_rng_state):
    """One rank's part of the exact-resume experiment; returns (flat params, losses).

    mode "straight": train `total` steps without stopping.
    mode "first":    train `stop_at` steps, save a full checkpoint under `root`, stop.
    mode "resume":   a fresh process: seed as at step 0, load the newest checkpoint (with its
                     random state), train to `total`.
    mode "resume-no-rng": the same, but keep the freshly seeded generators (the common bug)."""
    model, opt, data = build(cfg)
    if mode == "straight":
        losses = train(model, opt, data, cfg, total)
        return flat_params(model), losses
    if mode == "first":
        losses = train(model, opt, data, cfg, stop_at)
        save_full(root, stop_at, model, opt, data_state=data.state_dict(), capture=capture)
        return flat_params(model), losses
    if mode in ("resume", "resume-no-rng"):
        info = load_full(root, model, opt, restore_rng=(mode == "resume"), restore=restore)
        data.load_state_dict(info["data"])
        losses = train(model, opt, data, cfg, total - info["step"])
        return flat_params(model), losses
    raise ValueError(f"mode={mode!r}: use 'straight', 'first', 'resume' or 'resume-no-rng'")


def resume_jobs(cfg: RunConfig, total: int, stop_at, root, modes, capture=rng_state,
                restore=set_rng_state) -> list:
    """Several modes one after another in the same processes (each rebuilds and reseeds):
    saves process start-ups, e.g. ("straight", "first") then ("resume", "resume-no-rng")."""
    return [resume_job(cfg, total, stop_at, root, m, capture, restore) for m in modes]
