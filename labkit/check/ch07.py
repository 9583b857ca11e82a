"""Checkers for chapter 07: the log-sum-exp merge, sequence parallelism's operator pair, ring
attention's forward.

    merge(out1, lse1, out2, lse2) -> (out, lse)        7.1, one process
    sp_gather(x, group) [, sp_reduce_scatter(x, group)]  7.2, real processes, tp = 2, 3, 4
    ring_forward(q, k, v, group, T) -> out             7.3, real processes, hidden cp and T

7.1 is compared with attention over all keys (labkit.context.tiled.attend, fp64), with one side
empty (every key in the future: lse = -inf) and with log-sum-exps near 100 (exp overflows fp32).
7.2 runs the pair on ranks with a different upstream gradient on every rank, so a backward that
only slices (forgets to sum over ranks) is caught. 7.3 runs on hidden cp sizes and lengths with
the zig-zag layout; the reader's function may move tensors only with point-to-point messages
(labkit.collectives.exchange, isend/irecv): its source is read for collectives and for labkit's own
ring, and on the ranks every torch.distributed collective is replaced, for the duration of the
call, by one that fails.
"""
from __future__ import annotations

from labkit.check import Checker, fail
from labkit.check.ch01 import collectives_called

EXERCISES = {
    "7.1": ("log-sum-exp merge of two partial attention results", 3),
    "7.2": ("sequence parallelism's all-gather / reduce-scatter pair", 3),
    "7.3": ("ring attention forward from point-to-point messages", 4),
}
HANG_TIMEOUT = 30.0
FORBIDDEN = ("ring_attention", "all_gather_kv_attention", "_RingAttention", "_AllGatherKV",
             "scaled_dot_product_attention")
RING_CASES = [(2, 12, 2, 3, 8), (3, 30, 1, 2, 4), (4, 8, 2, 2, 8), (3, 6, 1, 1, 16)]  # hidden


def _names_used(fn) -> set:
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


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


# ----------------------------------------------------------------------------- 7.3
_C10D_TO_DIST = {"allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
                 "allreduce": "all_reduce", "alltoall": "all_to_all",
                 "alltoall_base": "all_to_all_single", "_reduce_scatter_base":
                 "reduce_scatter_tensor", "reduce_scatter": "reduce_scatter",
                 "allgather_into_tensor_coalesced": "all_gather_into_tensor"}


def _refuse_collectives_mode():
    """A TorchDispatchMode that lets point-to-point ops through and stops any collective (a c10d
    op other than send/recv) with a hint, whoever calls it: the learner's code, a helper, or
    labkit. It observes the dispatcher: torch.distributed itself is not patched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Refuse(TorchDispatchMode):
        def __init__(self, used):
            super().__init__()
            self.used = used

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if func.namespace == "c10d" and not name.startswith(("send", "recv", "barrier",
                                                                 "monitored_barrier")):
                base = name.split(".")[0].rstrip("_")
                public = _C10D_TO_DIST.get(base, base)    # the name the learner wrote
                self.used.append(public)
                raise RuntimeError(f"collective dist.{public} called (c10d.{name}): ring "
                                   "attention passes K/V with point-to-point messages only")
            return func(*args, **(kwargs or {}))
    return Refuse


def _RefuseCollectives(used):
    return _refuse_collectives_mode()(used)


def _ring_job(fn, T, B, H, d):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit.context.layout import positions
    from labkit.launch import device, note

    rank, cp, dev = dist.get_rank(), dist.get_world_size(), device()
    g = torch.Generator().manual_seed(7 * T + cp)
    q, k, v = (torch.randn(B, H, T, d, generator=g) for _ in range(3))  # cpu: moved below
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pos = positions(T, rank, cp, "zigzag")
    mine = [t[:, :, pos].contiguous().to(dev) for t in (q, k, v)]        # (B, H, T/cp, d)
    used = []
    note(f"your ring_forward, cp={cp}")
    with _RefuseCollectives(used):       # observes c10d ops; nothing in torch is replaced
        out = fn(*mine, None, T)
    return {"rank": rank, "out": out.detach().cpu() if isinstance(out, torch.Tensor) else out,
            "want": want[:, :, pos], "used": used}


def ring_forward(fn):
    """Exercise 7.3: fn(q, k, v, group, T) -> this rank's rows of causal attention, q/k/v being
    this rank's zig-zag chunks (B, H, T/cp, d), K/V moved round the ring by point-to-point only."""
    import torch

    c = Checker("7.3", *EXERCISES["7.3"])
    names = _names_used(fn)
    bad = sorted(set(collectives_called(fn)) | (names & set(FORBIDDEN)))
    for i, (cp, T, B, H, d) in enumerate(RING_CASES):
        with c.case(f"hidden case {i + 1}"):
            if bad:
                fail(f"your function uses {', '.join(bad)}: build the ring yourself from "
                     "point-to-point messages (exchange / isend / irecv) and labkit.context."
                     "tiled.attend for each block")
            res = c.launch(_ring_job, cp, args=(fn, T, B, H, d), timeout=HANG_TIMEOUT)
            for r in res:
                if r["used"]:
                    fail(f"rank {r['rank']} called dist.{r['used'][0]}: point-to-point only")
                got, want = r["out"], r["want"]
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    fail(f"rank {r['rank']}: expected a tensor of shape {tuple(want.shape)} (this "
                         f"rank's rows), got {getattr(got, 'shape', type(got).__name__)}")
                if torch.isnan(got).any():
                    fail(f"rank {r['rank']}: NaN in the output. A block whose keys all lie in the "
                         "future has lse = -inf: does your merge survive it?")
                if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
                    fail(f"rank {r['rank']}: wrong values. Are the keys you attend to masked by "
                         "their GLOBAL positions (whose chunk is this at step s?), and are the "
                         "blocks merged by log-sum-exp rather than averaged?")
    return c.finish()
