"""Checkers for chapter 07: the log-sum-exp merge, sequence parallelism's operator pair, ring
attention forward and backward, and its bytes on the wire.

    merge(out1, lse1, out2, lse2) -> (out, lse)        7.1, one process
    sp_gather(x, group) [, sp_reduce_scatter(x, group)]  7.2, real processes, tp = 2, 3, 4
    ring_attention(q, k, v, group, T) -> out           7.3, real processes, hidden cp, T, GQA
    predict_ring_bytes(b, s, H, Hk, d, cp, e) -> bytes 7.4, measured by the kernel

7.1 is compared with attention over all keys (labkit.context.tiled.attend, fp64), with one side
empty (every key in the future: lse = -inf) and with log-sum-exps near 100 (exp overflows fp32).
7.2 runs the pair on ranks with a different upstream gradient on every rank, so a backward that
only slices (forgets to sum over ranks) is caught. 7.3 and 7.4 live in labkit.check.ch07_ring
(its docstring says how they are graded).
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded

EXERCISES = {
    "7.1": ("log-sum-exp merge of two partial attention results", 3),
    "7.2": ("sequence parallelism's all-gather / reduce-scatter pair", 3),
    "7.3": ("ring attention forward and backward from point-to-point messages", 6),
    "7.4": ("predict ring attention's bytes per rank, then measure them", 3),
}
HANG_TIMEOUT = 30.0


# ----------------------------------------------------------------------------- 7.1
def _merge_case(fn, seed, B, H, T, d, split, kind):
    import torch

    from labkit.context.tiled import attend

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for _ in range(3))
    if kind == "large":                                      # scores near 100: exp overflows fp32
        q = q * 40.0
    pos = torch.arange(T)
    if kind == "empty":                                      # second block: every key in future
        o1, l1 = attend(q, k, v, pos, pos)
        o2, l2 = attend(q, k, v, pos, pos + 10 * T)
        want_o, want_l = o1, l1
    else:
        o1, l1 = attend(q, k[:, :, :split], v[:, :, :split])
        o2, l2 = attend(q, k[:, :, split:], v[:, :, split:])
        want_o, want_l = attend(q, k, v)
    dt = torch.float32 if kind == "large" else torch.float64
    got = fn(o1.to(dt), l1.to(dt), o2.to(dt), l2.to(dt))
    if not (isinstance(got, tuple) and len(got) == 2):
        fail("return a tuple (out, lse): the merged output and its log-sum-exp")
    out, lse = got
    if out.shape != want_o.shape or lse.shape != want_l.shape:
        fail(f"shapes: out {tuple(out.shape)}, lse {tuple(lse.shape)}; expected "
             f"{tuple(want_o.shape)} and {tuple(want_l.shape)}")
    if torch.isnan(out).any() or torch.isnan(lse).any():
        fail("NaN in the result: with lse = -inf on one side, or with lse near 100 (exp overflows "
             "fp32), is everything you exponentiate at most exp(0)? Which value would you subtract?")
    tol = 1e-4 if dt == torch.float32 else 1e-9
    if not torch.allclose(lse.double(), want_l, atol=tol, rtol=tol):
        fail("the merged log-sum-exp is wrong: the sum of exp over all keys is the sum of the two "
             "blocks' sums; what is log(e^a + e^b) in terms of a, b?")
    if not torch.allclose(out.double(), want_o, atol=tol, rtol=tol):
        fail("the merged output is wrong: each block's output is normalized by its own sum; what "
             "weight does block 1's output get in the whole softmax (use lse1 and the new lse)?")


@graded("7.1")
def merge(fn):
    """Exercise 7.1: fn(out1, lse1, out2, lse2) -> (out, lse)."""
    c = Checker("7.1", *EXERCISES["7.1"])
    cases = [("two halves of the keys", (1, 1, 1, 8, 4, 4, "split")),
             ("uneven split, several heads", (2, 2, 3, 11, 8, 3, "split")),
             ("one block has no visible key (lse = -inf)", (3, 1, 2, 6, 4, 0, "empty")),
             ("fp32, log-sum-exps near 100", (4, 1, 2, 9, 16, 5, "large")),
             ("hidden case", (5, 3, 1, 17, 4, 13, "split"))]
    for name, (seed, B, H, T, d, split, kind) in cases:
        with c.case(name):
            _merge_case(fn, seed, B, H, T, d, split, kind)
    return c.finish()


# ----------------------------------------------------------------------------- 7.2
def _sp_job(gather_fn, scatter_fn, T, B, h):
    import torch
    import torch.distributed as dist

    from labkit.launch import device, note

    rank, tp, dev = dist.get_rank(), dist.get_world_size(), device()
    g = torch.Generator().manual_seed(T)
    full = torch.randn(B, T, h, generator=g)  # cpu: same numbers on any device; (B, T, h)
    n = T // tp
    mine = full[:, rank * n:(rank + 1) * n].clone().to(dev).requires_grad_()  # (B, T/tp, h)
    up = torch.randn(tp, B, T, h, generator=g)  # cpu: moved below; a dy per rank
    note("your sp_gather")
    y = gather_fn(mine, None)
    y.backward(up[rank].to(dev))
    out = {"gather": y.detach().cpu(), "gather_grad": mine.grad.cpu(), "rank": rank}
    parts = torch.randn(tp, B, T, h, generator=g)  # cpu: moved below; rank r's partial sums
    x = parts[rank].clone().to(dev).requires_grad_()          # (B, T, h)
    up2 = torch.randn(tp, B, n, h, generator=g)  # cpu: moved below
    note("your sp_reduce_scatter")
    z = scatter_fn(x, None)
    z.backward(up2[rank].to(dev))
    out.update(scatter=z.detach().cpu(), scatter_grad=x.grad.cpu())
    out["want"] = {"gather": full, "gather_grad": up.sum(0)[:, rank * n:(rank + 1) * n],
                   "scatter": parts.sum(0)[:, rank * n:(rank + 1) * n],
                   "scatter_grad": torch.cat(list(up2), dim=1)}
    return out


SP_HINTS = {
    "gather": "sp_gather's forward: every rank's (B, T/tp, h) piece, concatenated along the "
              "sequence (dim 1) in rank order",
    "gather_grad": "sp_gather's backward: each rank's dy is different, and every rank used your "
                   "piece. Which gradient pieces must be added, and which collective adds and "
                   "splits at once?",
    "scatter": "sp_reduce_scatter's forward: the sum over ranks, this rank keeps its T/tp rows",
    "scatter_grad": "sp_reduce_scatter's backward: every row of x fed one rank's output; where are "
                    "the gradients of the rows you did not keep?",
}


@graded("7.2", answers=("gather_fn", "scatter_fn"))
def sp_pair(gather_fn, scatter_fn=None):
    """Exercise 7.2: gather_fn(x, group) all-gathers the sequence forward and reduce-scatters the
    gradient backward; scatter_fn(x, group) the reverse (None: labkit's own,
    labkit.context.reduce_scatter_sequence). group None: the whole world."""
    import torch

    if scatter_fn is None:
        from labkit.context import reduce_scatter_sequence as scatter_fn

    c = Checker("7.2", *EXERCISES["7.2"])
    for tp, T, B, h in [(2, 8, 2, 4), (3, 9, 1, 5), (4, 8, 2, 3)]:
        with c.case(f"tp={tp}, T={T}"):
            res = c.launch(_sp_job, tp, args=(gather_fn, scatter_fn, T, B, h),
                           timeout=HANG_TIMEOUT)
            for r in res:
                for key, hint in SP_HINTS.items():
                    got, want = r[key], r["want"][key]
                    if got.shape != want.shape:
                        fail(f"rank {r['rank']}: {key} has shape {tuple(got.shape)}, expected "
                             f"{tuple(want.shape)}. {hint}")
                    if not torch.allclose(got, want, atol=1e-5):
                        fail(f"rank {r['rank']}: {key} is wrong. {hint}")
    return c.finish()


# ----------------------------------------------------------------------------- 7.3, 7.4
@graded("7.3")
def ring_attention(fn):
    """Exercise 7.3 (labkit.check.ch07_ring): ring attention forward and backward."""
    from labkit.check.ch07_ring import ring_attention as check

    return check(fn)


@graded("7.4")
def ring_bytes(fn):
    """Exercise 7.4 (labkit.check.ch07_ring): predict ring attention's bytes, then measure."""
    from labkit.check.ch07_ring import ring_bytes as check

    return check(fn)
