"""Exercise 7.3: ring attention forward and backward from point-to-point messages.

    labkit.check.ch07.ring_attention(my_ring_attention)

my_ring_attention(q, k, v, group, T) on cp real processes, each holding its zig-zag chunks
(B, H, T/cp, d) of q and (B, Hk, T/cp, d) of k and v (Hk < H in a hidden grouped-query case),
must give this rank's rows of causal attention and, through autograd, dq, dk and dv equal to the
one-process F.scaled_dot_product_attention's (computed by the checker, under labkit grade the
judge, not on the ranks). Per world size (2 shown; 3 and 4 hidden) three
cases: values and gradients; what forward keeps for backward (saved-tensor hooks, plus the
tensors left on the autograd node) at most the rank's own q, k, v, out and lse + 25%, so keeping
every K/V chunk that passed by fails; the bytes each rank sent (kernel count, observe.netcount) at
most labkit.costs.context.cp_ring_layer_bytes + Gloo's headers. Every c10d collective, in forward
or backward, is refused on the ranks (observe.dispatch): point-to-point only. labkit's own ring
and torch's context parallelism are refused by reading the code.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.check import Checker, Forbidden, Refused, expect_tensor, fail, graded
from labkit.context.layout import positions
from labkit.costs.context import cp_ring_layer_bytes
from labkit.launch import device, note
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog

EXERCISE, TITLE, POINTS = ("7.3", "ring attention forward and backward from point-to-point "
                           "messages", 6)
FORBIDDEN = Forbidden(("labkit.context.ring_attention", "labkit.context.context_parallel",
                       "torch.distributed.tensor"),
                      frozenset({"ring_attention", "all_gather_kv_attention", "_RingAttention",
                                 "_AllGatherKV", "scaled_dot_product_attention",
                                 "context_parallel", "tiled_attention"}),
                      why="build the ring yourself from point-to-point messages and "
                          "labkit.context.tiled's attend / attend_backward per block")
# (cp, T, B, H, Hk, d); the first is shown, the rest hidden (Hk < H: grouped-query)
RING_CASES = [(2, 12, 2, 2, 2, 4), (3, 24, 1, 4, 2, 4), (4, 16, 1, 2, 2, 8)]
SAVED_SLACK = 1.25        # saved for backward: own q, k, v, out, lse (+ small bookkeeping)
HEADER_BYTES = 300        # Gloo's bytes per message besides the payload (tests/test_netcount.py)
LAUNCH_TIMEOUT = 90.0     # seconds: a busy 2-core machine starts 4 ranks slowly
WHY = "ring attention passes K/V (and dK/dV) with point-to-point messages only"


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _node_tensors(node) -> list:
    """Tensors custom autograd Functions left on their nodes (ctx attributes, one level deep), on
    every node of the graph behind `node` (a view or an op after the Function included)."""

    out, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        for v in getattr(n, "__dict__", {}).values():
            items = v.values() if isinstance(v, dict) else \
                v if isinstance(v, (list, tuple)) else [v]
            out += [t for t in items if isinstance(t, torch.Tensor)]
        todo += [nxt for nxt, _ in getattr(n, "next_functions", ())]
    return out


def _inputs(T, B, H, Hk, d, cp):
    """q, k, v and the upstream gradient, whole: the same numbers on every rank and in the
    checker (a seeded CPU generator)."""
    g = torch.Generator().manual_seed(11 * T + cp)
    q = torch.randn(B, H, T, d, generator=g)                           # (B, H, T, d)
    k, v = (torch.randn(B, Hk, T, d, generator=g) for _ in range(2))   # (B, Hk, T, d)
    up = torch.randn(B, H, T, d, generator=g)                          # (B, H, T, d)
    return q, k, v, up


def expected(T, B, H, Hk, d, cp) -> list:
    """[{"out", "grads": {"dq", "dk", "dv"}} per rank]: this rank's rows of one process's causal
    attention and of its gradients, computed where the checker runs (under labkit grade: the
    judge, where no student code runs)."""
    q, k, v, up = _inputs(T, B, H, Hk, d, cp)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=Hk != H)  # (B,H,T,d)
    want.backward(up)
    out = []
    for rank in range(cp):
        pos = positions(T, rank, cp, "zigzag")
        out.append({"out": want.detach()[:, :, pos],
                    "grads": {n: w.grad[:, :, pos] for n, w in zip(("dq", "dk", "dv"), full)}})
    return out


def _ring_job(fn, T, B, H, Hk, d):
    rank, cp, dev = dist.get_rank(), dist.get_world_size(), device()
    q, k, v, up = _inputs(T, B, H, Hk, d, cp)    # cpu: the same numbers on every rank
    pos = positions(T, rank, cp, "zigzag")
    mine = [t[:, :, pos].contiguous().to(dev).requires_grad_()      # (B, *, T/cp, d)
            for t in (q, k, v)]
    packed = []

    def pack(t):
        packed.append(t)
        return t

    dist.barrier()
    with netcount.socket_bytes() as wire, CollectiveLog(allow=(), why=WHY, error=Refused):
        note(f"your ring attention forward, cp={cp}")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*mine, None, T)                                   # (B, H, T/cp, d)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return {"rank": rank, "bad": f"returned {type(out).__name__}" + (
                " that is not part of the autograd graph" if isinstance(out, torch.Tensor)
                else "")}
        kept = packed + _node_tensors(out.grad_fn)
        note(f"your ring attention backward, cp={cp}")
        out.backward(up[:, :, pos].to(dev))
    own = [*mine, out]
    limit = SAVED_SLACK * (_storage_bytes(own) + B * H * len(pos) * 4)   # + lse (fp32)
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    return {"rank": rank, "bad": None, "out": cpu(out),
            "grads": {n: cpu(m.grad) for n, m in zip(("dq", "dk", "dv"), mine)},
            "saved": _storage_bytes(kept), "saved_limit": limit, "own": _storage_bytes(own),
            "sent": wire.sent}


def _assert_values(results, case) -> None:
    wants = expected(*case)
    for rank, r in enumerate(results):
        if r["rank"] != rank:
            fail(f"rank {rank}'s result came back as rank {r['rank']!r}'s")
        if r["bad"]:
            fail(f"rank {r['rank']}: your function {r['bad']}; return this rank's rows as a "
                 "tensor made by your torch.autograd.Function (apply), so backward can run")
        got, want = r["out"], wants[rank]["out"]
        if got.shape != want.shape:
            fail(f"rank {r['rank']}: output shape {tuple(got.shape)}, expected "
                 f"{tuple(want.shape)} (this rank's rows)")
        if torch.isnan(got).any():
            fail(f"rank {r['rank']}: NaN in the output. A block whose keys all lie in the future "
                 "has lse = -inf: does your merge survive it?")
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            fail(f"rank {r['rank']}: wrong output. Are the keys masked by their GLOBAL positions "
                 "(whose chunk is this at step s?), and blocks merged by log-sum-exp?")
        for name, w in wants[rank]["grads"].items():
            g = r["grads"].get(name) if isinstance(r["grads"], dict) else None
            expect_tensor(g, w, f"rank {r['rank']}: {name}",
                          if_none="does backward return a gradient for each of q, k, v (and "
                                  "None for group and T)?",
                          if_shape="k and v may have fewer heads than q")
            if not torch.allclose(g, w, atol=1e-4, rtol=1e-3):
                hint = {"dq": "dq of each block is only that block's share: are all blocks' "
                              "shares summed?",
                        "dk": "chunk j's dK collects a share from every rank whose queries saw "
                              "it: does it travel the whole ring and come home to its owner?",
                        "dv": "as dK: every rank adds its share to chunk j's dV as it passes; "
                              "which rank holds the finished sum after the last hop?"}[name]
                fail(f"rank {r['rank']}: {name} is wrong (max difference "
                     f"{(g - w).abs().max():.3g}). {hint}")


def _assert_saved(results, cp) -> None:
    for r in results:
        if r["bad"]:
            fail(f"rank {r['rank']}: nothing to measure ({r['bad']})")
        if r["saved"] > r["saved_limit"]:
            fail(f"rank {r['rank']}: forward kept {r['saved']:,} bytes for backward (saved "
                 f"tensors and tensors left on ctx, by storage size); its own q, k, v, out and "
                 f"lse are {r['saved_limit'] / SAVED_SLACK:,.0f}. Ring attention keeps only its "
                 "own chunks: how can backward see every K/V chunk again without keeping them?")


def _assert_wire(results, cp, T, B, Hk, d) -> None:
    optimum = cp_ring_layer_bytes(B, T, Hk * d, cp, 4)["total"]
    messages = 2 * (cp - 1) + 2 * (cp - 1) + 2 * cp               # K, V; K, V; dK, dV hops
    slack = messages * HEADER_BYTES
    for r in results:
        if r["bad"] or r["sent"] is None:
            continue
        if r["sent"] > optimum + slack:
            fail(f"rank {r['rank']} sent {r['sent']:,} bytes (counted by the kernel); the ring "
                 f"sends {optimum:,.0f} (+ {slack:,} of headers), {r['sent'] / optimum:.2f}x. "
                 "Forward: cp - 1 hops of K and V; backward: cp - 1 hops of K and V and cp hops "
                 "of dK and dV. What else did yours send?")


@graded("7.3")
def ring_attention(fn):
    """Exercise 7.3: fn(q, k, v, group, T) -> this rank's rows of causal attention, with a
    backward; q (B, H, T/cp, d), k and v (B, Hk, T/cp, d), zig-zag chunks; point-to-point only."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(fn))
    for i, (cp, T, B, H, Hk, d) in enumerate(RING_CASES):
        label = f"cp={cp}, T={T}" if i == 0 else f"hidden case {i}"
        # partial binds this case's sizes now (cases_on_one_launch runs them at once)
        checks = (("output, dq, dk, dv equal one process (point-to-point only)",
                   partial(_assert_values, case=(T, B, H, Hk, d, cp))),
                  ("saved for backward: only this rank's own chunks",
                   partial(_assert_saved, cp=cp)),
                  ("bytes sent: the ring's, counted by the kernel",
                   partial(_assert_wire, cp=cp, T=T, B=B, Hk=Hk, d=d)))
        c.cases_on_one_launch(label, checks, partial(
            c.launch, _ring_job, cp, args=(fn, T, B, H, Hk, d), timeout=LAUNCH_TIMEOUT))
    return c.finish()
