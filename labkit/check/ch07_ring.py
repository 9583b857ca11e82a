"""Chapter 07's ring exercises: ring attention forward and backward (7.3), and a prediction of its
bytes on the wire (7.4).

    labkit.check.ch07.ring_attention(my_ring_attention)    # 7.3
    labkit.check.ch07.ring_bytes(predict_ring_bytes)       # 7.4

7.3: my_ring_attention(q, k, v, group, T) on cp real processes, each holding its zig-zag chunks
(B, H, T/cp, d) of q and (B, Hk, T/cp, d) of k and v (Hk < H in a hidden grouped-query case),
must give this rank's rows of causal attention and, through autograd, dq, dk and dv equal to the
one-process F.scaled_dot_product_attention's. Per world size (2 shown; 3 and 4 hidden) three
cases: values and gradients; what forward keeps for backward (saved-tensor hooks, plus the
tensors left on the autograd node) at most the rank's own q, k, v, out and lse + 25%, so keeping
every K/V chunk that passed by fails; the bytes each rank sent (kernel count, labkit.netcount) at
most labkit.costs.context.cp_ring_layer_bytes + Gloo's headers. Every c10d collective, in forward
or backward, is refused on the ranks (labkit.check.guards): point-to-point only. labkit's own ring
and torch's context parallelism are refused by reading the code.

7.4: the reader predicts the bytes one rank sends in one forward + backward of labkit's
ring_attention; the checker measures them with the kernel on cp real Gloo processes (shown: cp=2;
hidden: cp=3 and 4, one grouped-query) and grades within 5%, beside labkit.costs' answer.
"""
from __future__ import annotations

from labkit.check import Checker, fail
from labkit.check.guards import forbidden_used

FORBIDDEN_MODULES = ("labkit.context.ring_attention", "labkit.context.context_parallel",
                     "torch.distributed.tensor")
FORBIDDEN_NAMES = {"ring_attention", "all_gather_kv_attention", "_RingAttention", "_AllGatherKV",
                   "scaled_dot_product_attention", "context_parallel", "tiled_attention"}
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
    import torch

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


def _ring_job(fn, T, B, H, Hk, d):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labkit import netcount
    from labkit.check.guards import CollectiveLog
    from labkit.context.layout import positions
    from labkit.launch import device, note

    rank, cp, dev = dist.get_rank(), dist.get_world_size(), device()
    g = torch.Generator().manual_seed(11 * T + cp)
    q = torch.randn(B, H, T, d, generator=g)  # cpu: the same numbers on every rank, moved below
    k, v = (torch.randn(B, Hk, T, d, generator=g) for _ in range(2))  # cpu: as above
    up = torch.randn(B, H, T, d, generator=g)  # cpu: as above; the upstream gradient
    full = [t.clone().to(dev).requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=Hk != H)
    want.backward(up.to(dev))
    pos = positions(T, rank, cp, "zigzag")
    mine = [t[:, :, pos].contiguous().to(dev).requires_grad_() for t in (q, k, v)]  # (B, *, T/cp, d)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    dist.barrier()
    with netcount.socket_bytes() as wire, CollectiveLog(refuse=True, why=WHY):
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
    return {"rank": rank, "bad": None, "out": cpu(out), "want": want.detach()[:, :, pos].cpu(),
            "grads": {n: (cpu(m.grad), w.grad[:, :, pos].cpu())
                      for n, m, w in zip(("dq", "dk", "dv"), mine, full)},
            "saved": _storage_bytes(kept), "saved_limit": limit, "own": _storage_bytes(own),
            "sent": wire.sent}


def _assert_values(results) -> None:
    import torch

    for r in results:
        if r["bad"]:
            fail(f"rank {r['rank']}: your function {r['bad']}; return this rank's rows as a "
                 "tensor made by your torch.autograd.Function (apply), so backward can run")
        got, want = r["out"], r["want"]
        if got.shape != want.shape:
            fail(f"rank {r['rank']}: output shape {tuple(got.shape)}, expected "
                 f"{tuple(want.shape)} (this rank's rows)")
        if torch.isnan(got).any():
            fail(f"rank {r['rank']}: NaN in the output. A block whose keys all lie in the future "
                 "has lse = -inf: does your merge survive it?")
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            fail(f"rank {r['rank']}: wrong output. Are the keys masked by their GLOBAL positions "
                 "(whose chunk is this at step s?), and blocks merged by log-sum-exp?")
        for name, (g, w) in r["grads"].items():
            if g is None:
                fail(f"rank {r['rank']}: {name} is None: does backward return a gradient for "
                     "each of q, k, v (and None for group and T)?")
            if g.shape != w.shape:
                fail(f"rank {r['rank']}: {name} has shape {tuple(g.shape)}, expected "
                     f"{tuple(w.shape)}: k and v may have fewer heads than q")
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
    from labkit.costs.context import cp_ring_layer_bytes

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


def ring_attention(fn):
    """Exercise 7.3: fn(q, k, v, group, T) -> this rank's rows of causal attention, with a
    backward; q (B, H, T/cp, d), k and v (B, Hk, T/cp, d), zig-zag chunks; point-to-point only."""
    from labkit.check.ch07 import EXERCISES

    c = Checker("7.3", *EXERCISES["7.3"])
    bad = forbidden_used([fn], FORBIDDEN_MODULES, FORBIDDEN_NAMES)
    refuse = (f"your code uses {', '.join(bad)}: build the ring yourself from point-to-point "
              "messages and labkit.context.tiled's attend / attend_backward per block") if bad else ""
    for i, (cp, T, B, H, Hk, d) in enumerate(RING_CASES):
        label = f"cp={cp}, T={T}" if i == 0 else f"hidden case {i}"
        checks = (("output, dq, dk, dv equal one process (point-to-point only)", _assert_values),
                  ("saved for backward: only this rank's own chunks",
                   lambda r: _assert_saved(r, cp)),
                  ("bytes sent: the ring's, counted by the kernel",
                   lambda r: _assert_wire(r, cp, T, B, Hk, d)))
        c.cases_on_one_launch(label, checks, lambda: c.launch(
            _ring_job, cp, args=(fn, T, B, H, Hk, d), timeout=LAUNCH_TIMEOUT), refuse=refuse)
    return c.finish()


# ----------------------------------------------------------------------------- 7.4
# (cp, b, s, H, Hk, d): chunks of 8-32 KB, so Gloo's headers stay near 1%
BYTES_CASES = [(2, 1, 256, 2, 2, 16), (3, 1, 192, 4, 2, 16), (4, 2, 128, 2, 2, 16)]
BYTES_TOLERANCE = 0.05
_MEASURED: dict = {}   # case -> per-rank results: labkit's run does not depend on fn


def _bytes_job(s, b, H, Hk, d):
    import torch
    import torch.distributed as dist

    from labkit import netcount
    from labkit.context.layout import positions
    from labkit.context.ring_attention import ring_attention
    from labkit.launch import device

    rank, cp, dev = dist.get_rank(), dist.get_world_size(), device()
    n = len(positions(s, rank, cp, "zigzag"))
    q = torch.randn(b, H, n, d, device=dev, requires_grad=True)
    k, v = (torch.randn(b, Hk, n, d, device=dev, requires_grad=True) for _ in range(2))
    dist.barrier()
    with netcount.socket_bytes() as wire:
        ring_attention(q, k, v, None, "zigzag", seq_len=s).sum().backward()
    return {"sent": wire.sent, "reason": wire.reason}


def _bytes_hint(ratio, cp, H, Hk) -> str:
    near = lambda x: abs(ratio - x) <= BYTES_TOLERANCE * x  # noqa: E731
    fwd, bwd = cp - 1, (cp - 1) + cp                          # in K/V chunk pairs
    if near(fwd / (fwd + bwd)):
        return "Forward only? Backward sends K and V round the ring again, and dK/dV too."
    if near((2 * (cp - 1)) / (fwd + bwd)) or near((2 * cp - 1) / (fwd + bwd)):
        return ("Backward: K/V travel again (cp - 1 hops), and the dK/dV accumulators travel "
                "with them: how many hops until each is home with its owner?")
    if Hk != H and near(H / Hk):
        return "k and v have Hk heads here, fewer than q's H: which heads travel?"
    if near(0.5) or near(2.0):
        return "Do you count K and V (two tensors), and only what this rank sends?"
    return ("How many bytes is one rank's K and V chunk (b, s/cp tokens, Hk heads of d, 4 bytes), "
            "and how many hops does each pass make in forward and in backward?")


def ring_bytes(fn):
    """Exercise 7.4: fn(b, s, H, Hk, d, cp, bytes_per_element) -> bytes one rank sends in one
    forward + backward of ring attention (zig-zag layout)."""
    from labkit.check.ch07 import EXERCISES
    from labkit.costs.context import cp_ring_layer_bytes
    from labkit.launch import run

    c = Checker("7.4", *EXERCISES["7.4"])
    for i, (cp, b, s, H, Hk, d) in enumerate(BYTES_CASES):
        with c.case(f"cp={cp}, b={b}, s={s}, H={H}, Hk={Hk}, d={d}" if i == 0 else
                    f"hidden case {i}"):
            got = fn(b, s, H, Hk, d, cp, 4)
            if not isinstance(got, (int, float)):
                fail(f"return a number of bytes, got {type(got).__name__}")
            key = (cp, b, s, H, Hk, d)
            res = _MEASURED.get(key) or run(_bytes_job, cp, (s, b, H, Hk, d), echo=False,
                                            timeout=LAUNCH_TIMEOUT, backend="gloo")
            _MEASURED[key] = res
            if any(r["sent"] is None for r in res):
                fail(f"the kernel cannot count this backend's bytes ({res[0]['reason']})")
            measured = max(r["sent"] for r in res)
            want = cp_ring_layer_bytes(b, s, Hk * d, cp, 4)["total"]
            if i == 0:
                c.cases[-1]["name"] += (f"\n      predicted {got / 1e3:.1f} KB, measured "
                                        f"{measured / 1e3:.1f} KB (kernel), labkit.costs "
                                        f"{want / 1e3:.1f} KB")
            if abs(want / measured - 1) > BYTES_TOLERANCE:
                fail(f"labkit.costs says {want:,.0f} B, the kernel counted {measured:,} B: the "
                     "checker disagrees with itself (please report it)")
            if abs(got / measured - 1) > BYTES_TOLERANCE:
                fail(f"predicted {got:,.0f} B, measured {measured:,} B by the kernel "
                     f"({got / measured:.2f}x). " + _bytes_hint(got / measured, cp, H, Hk))
    return c.finish()
