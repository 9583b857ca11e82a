"""Checkers for chapter 08 (mixture of experts).

    labkit.check.ch08.routing_with_capacity(keep)     # Exercise 8.1
    labkit.check.ch08.dispatch_combine(fn)            # Exercise 8.2

The expected answers are computed here, by plain loops written for the checker (never by
labkit.moe's own router or expert-parallel layer), so a checker cannot agree with a bug in them.
"""
from __future__ import annotations

from labkit.check import Checker, tensors_close

EXERCISES = {
    "8.1": ("top-k routing with capacity (GShard priority)", 2),
    "8.2": ("dispatch and combine with all_to_all_single", 3),
}


# ----------------------------------------------------------------------------- 8.1
def _kept_by_loops(expert, n_expert: int, cap: int) -> list:
    """Assignments kept: first choices of all tokens in token order, then second choices, ..."""
    n, k = len(expert), len(expert[0])
    used, kept = [0] * n_expert, [[False] * k for _ in range(n)]
    for j in range(k):
        for t in range(n):
            e = expert[t][j]
            if used[e] < cap:
                used[e] += 1
                kept[t][j] = True
    return kept


def routing_with_capacity(keep):
    """keep(expert (n, k) int64, n_expert, cap) -> (n, k) bool."""
    import torch

    c = Checker("8.1", EXERCISES["8.1"][0], points=EXERCISES["8.1"][1])
    g = torch.Generator().manual_seed(8)
    cases = [("3 tokens, top-2, capacity 2 (the chapter's example)",
              torch.tensor([[0, 1], [0, 1], [1, 0]]), 2, 2),
             ("top-1, one crowded expert", torch.tensor([[2], [2], [2], [0], [2]]), 3, 2)]
    for n, E, k, cap in [(16, 4, 2, 5), (37, 8, 2, 6), (20, 6, 3, 4), (9, 3, 1, 1)]:
        e = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
        cases.append((f"{n} tokens, {E} experts, top-{k}, capacity {cap}", e, E, cap))
    for name, e, E, cap in cases:
        with c.case(name):
            got = keep(e.clone(), E, cap)
            want = torch.tensor(_kept_by_loops(e.tolist(), E, cap))
            assert isinstance(got, torch.Tensor) and got.shape == e.shape, (
                f"return a bool tensor of shape {tuple(e.shape)}, one entry per assignment")
            got = got.bool()
            per = torch.bincount(e[got], minlength=E)
            assert int(per.max()) <= cap, (
                "an expert kept more assignments than its capacity: does your count of places "
                "taken include earlier tokens' choices?")
            assert torch.equal(got, want), (
                f"kept {got.int().tolist()}, expected {want.int().tolist()}: are all first choices "
                f"served before any second choice, and earlier tokens before later ones?")
    return c.finish()


# ----------------------------------------------------------------------------- 8.2
def _experts(E: int, h: int, seed: int):
    import torch
    import torch.nn as nn

    from labkit.launch import device

    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
                         for _ in range(E)).to(device())


def _routing(n: int, E: int, k: int, h: int, seed: int):
    """A rank's tokens x (n, h) and a routing: experts (n, k), weights (n, k), kept (n, k)."""
    import torch

    from labkit.launch import device

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)  # cpu: the same numbers on any device; moved below
    expert = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)] or  # cpu: idem
                         [torch.zeros(0, k, dtype=torch.long)]).view(n, k)  # cpu: idem
    weight = torch.rand(n, k, generator=g)  # cpu: idem
    kept = torch.rand(n, k, generator=g) > 0.2  # cpu: idem; some assignments dropped
    dev = device()
    return x.to(dev), expert.to(dev), weight.to(dev), kept.to(dev)


def dispatch_job(fn, tokens: list, E: int, k: int, h: int, seed: int = 0) -> dict:
    """On each rank: fn(x, expert, weight, kept, local_experts, first, group) against every
    expert run on every rank's tokens in one process (plain loops): output, input gradient,
    weight gradient and the local experts' parameter gradients."""
    import torch
    import torch.distributed as dist

    rank, ep = dist.get_rank(), dist.get_world_size()
    per = E // ep
    full = _experts(E, h, seed)
    mine = _experts(E, h, seed)[rank * per:(rank + 1) * per]
    ys, xs = [], []
    for r in range(ep):                                               # the reference, all ranks
        x, e, w, kept = _routing(tokens[r], E, k, h, seed + 1 + r)
        x = x.requires_grad_()
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(k):
                if kept[t, j]:
                    y = y.index_add(0, torch.tensor([t], device=x.device),
                                    (w[t, j] * full[int(e[t, j])](x[t:t + 1])))
        xs.append(x)
        ys.append(y)
    up = [torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 50 + r)).to(y.device)
          for r, y in enumerate(ys)]
    sum((y * u).sum() for y, u in zip(ys, up)).backward()
    x, e, w, kept = _routing(tokens[rank], E, k, h, seed + 1 + rank)
    x, w = x.requires_grad_(), w.requires_grad_()
    wr = w.detach().clone().requires_grad_()
    # the reference's weight gradient for this rank
    yr = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            if kept[t, j]:
                yr = yr.index_add(0, torch.tensor([t], device=x.device),
                                  wr[t, j] * full[int(e[t, j])](x[t:t + 1]).detach())
    if yr.requires_grad:                                              # a rank with tokens kept
        (yr * up[rank]).sum().backward()
    y = fn(x, e, w, kept, mine, rank * per, None)
    out = {"output": (y.detach().clone(), ys[rank].detach())}
    (y * up[rank]).sum().backward()
    zero = torch.zeros_like
    out["input gradient"] = (x.grad, zero(x) if xs[rank].grad is None else xs[rank].grad)
    out["gate-weight gradient"] = (w.grad, zero(w) if wr.grad is None else wr.grad)
    for j, m in enumerate(mine):
        ref = full[rank * per + j]
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            out[f"expert {rank * per + j} {name} gradient"] = (p.grad, q.grad)
    return out


def dispatch_combine(fn):
    c = Checker("8.2", EXERCISES["8.2"][0], points=EXERCISES["8.2"][1])
    for ep, tokens, E, k in [(2, [7, 4], 4, 2), (3, [5, 9, 2], 6, 2), (4, [6, 3, 8, 1], 4, 1),
                             (4, [4, 4, 0, 5], 8, 3)]:
        with c.case(f"ep={ep}, tokens per rank {tokens}, {E} experts, top-{k}"):
            per_rank = c.launch(dispatch_job, ep, args=(fn, tokens, E, k, 8))
            for rank, res in enumerate(per_rank):
                for what, (got, want) in res.items():
                    assert got is not None, (
                        f"rank {rank}: no {what}: does the result depend on it through autograd "
                        f"(both all-to-alls need a backward that sends gradients home)?")
                    try:
                        tensors_close(got, want, what=f"rank {rank}'s {what}")
                    except AssertionError as err:
                        raise AssertionError(
                            f"{str(err).splitlines()[0]}\nare rows grouped by destination rank and "
                            f"sent in the order the counts describe; are dropped assignments left "
                            f"out; is each row weighted by its gate?") from None
    return c.finish()
