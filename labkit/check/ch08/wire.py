"""Exercise 8.3: predict the all-to-all bytes per rank, then measure them.

    labkit.check.ch08.alltoall_bytes(predict)   # predict(routing, n_expert, ep, h, dtype_bytes)
                                                #   -> [bytes sent, per rank]

The reader predicts the bytes each rank sends in one MoE layer's forward and backward (the four
row all-to-alls) for a given routing; the checker runs the all-to-alls on real processes and
counts them with observe.netcount; the prediction must be within TOLERANCE of the count. For a
balanced routing the count is also shown beside labkit.costs.moe's formula.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.check import Checker, fail, graded
from labkit.costs import moe
from labkit.observe import netcount

EXERCISE, TITLE, POINTS = "8.3", "predict the all-to-all bytes per rank, then measure them", 3
TOLERANCE = 0.05      # prediction within 5% of the kernel's count, + FRAMING per message
FRAMING = 200         # bytes of Gloo framing per all-to-all message (about 150 measured)


def _bytes_job(routing: list, E: int, h: int, dtype: str):
    """Rank side of 8.3: the four row all-to-alls of one MoE layer for the given routing (the
    checker's own code), counted by the kernel. Counts and ids are exchanged outside the count."""
    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, out_splits, in_splits):
            ctx.splits = (out_splits, in_splits)
            out = x.new_empty((sum(out_splits), x.shape[1]))          # (sum out_splits, h)
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
            return out

        @staticmethod
        def backward(ctx, grad):
            out_splits, in_splits = ctx.splits
            back = grad.new_empty((sum(in_splits), grad.shape[1]))
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
            return back, None, None

    torch.set_num_threads(1)
    rank, ep = dist.get_rank(), dist.get_world_size()
    per = E // ep
    expert, kept = (torch.tensor(t) for t in routing[rank])  # cpu: 8.3 counts bytes on Gloo (TCP)
    n = expert.shape[0]
    x = torch.randn(n, h).to(getattr(torch, dtype)).requires_grad_()     # (n, h)
    tok, slot = torch.nonzero(kept, as_tuple=True)
    e = expert[tok, slot]
    order = torch.argsort(e, stable=True)
    tok, e = tok[order], e[order]
    send = torch.bincount(e // per, minlength=ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    s, r = send.tolist(), recv.tolist()
    dist.barrier()
    with netcount.socket_bytes() as count:
        rows = AllToAll.apply(x[tok], r, s)                           # dispatch (A_in, h)
        back = AllToAll.apply(rows * 2, s, r)                         # expert, then combine
        back.sum().backward()
    return {"sent": count.sent, "reason": count.reason, "received": count.received}


_MEASURED: dict = {}     # 8.3 case name -> the ranks' counts (they do not depend on the reader)


def _balanced(n: int, E: int, k: int, ep: int, rank: int) -> list:
    """Routing whose k*n assignments land on the E experts round-robin (every expert, and so
    every rank, equally often): what labkit.costs.moe assumes."""
    return [[(t * k + j + rank) % E for j in range(k)] for t in range(n)]


def _random(n: int, E: int, k: int, seed: int, skew: float = 0.0) -> list:
    g = torch.Generator().manual_seed(seed)
    w = torch.ones(E)
    w[: max(1, E // 4)] += skew                                        # a few popular experts
    return torch.stack([torch.multinomial(w, k, generator=g) for _ in range(n)]).tolist()


def _bytes_cases():
    g = torch.Generator().manual_seed(83)
    cases = []
    # (name, ep, E, h, dtype, routing [(expert, kept) per rank], balanced)
    ep, E, k, n, h = 2, 4, 2, 64, 256
    r = [(_balanced(n, E, k, ep, q), [[True] * k] * n) for q in range(ep)]
    cases.append(("ep=2, 4 experts, top-2, 64 tokens per rank, h=256, fp32, balanced routing",
                  ep, E, h, "float32", r, True))
    ep, E, k, h = 3, 6, 2, 192
    r = []
    for q, n in enumerate([40, 56, 24]):
        e = _random(n, E, k, 10 + q, skew=2.0)
        kept = (torch.rand(n, k, generator=g) > 0.25).tolist()
        r.append((e, kept))
    cases.append(("ep=3, 6 experts, top-2, tokens 40/56/24, h=192, fp32, 25% dropped, skewed",
                  ep, E, h, "float32", r, False))
    ep, E, k, h = 4, 8, 1, 128                                         # hidden: all to rank 0
    r = []
    for q, n in enumerate([30, 50, 10, 40]):
        e = [[(t + q) % 2] for t in range(n)]                           # experts 0, 1: rank 0
        kept = (torch.rand(n, k, generator=g) > 0.1).tolist()
        r.append((e, kept))
    cases.append(("hidden case", ep, E, h, "bfloat16", r, False))
    return cases


def exact_alltoall_bytes(routing, E: int, ep: int, h: int, dtype_bytes: int) -> list:
    """The checker's own count: rows of kept assignments that leave each rank (dispatch and the
    gradient of combine) plus rows that come back to their owners (combine and the gradient of
    dispatch) - per rank, two all-to-alls each way."""
    per = E // ep
    out = []
    for rank in range(ep):
        e, kept = routing[rank]
        leave = sum(1 for row, ks in zip(e, kept) for x, k in zip(row, ks)
                    if k and x // per != rank)
        arrive = sum(1 for q in range(ep) if q != rank for row, ks in zip(*routing[q])
                     for x, k in zip(row, ks) if k and x // per == rank)
        out.append(2 * (leave + arrive) * h * dtype_bytes)
    return out


def _bytes_hint(got: float, measured: float, routing, E, ep, h, nbytes, rank) -> str:
    """Name the likely mistake by the prediction it would give."""
    per = E // ep
    e, kept = routing[rank]
    row = h * nbytes
    every = sum(1 for ks in kept for k in ks if k)
    leave = sum(1 for r, ks in zip(e, kept) for x, k in zip(r, ks) if k and x // per != rank)
    undropped = [(ex, [[True] * len(ks) for ks in kp]) for ex, kp in routing]
    said = f"rank {rank}: predicted {got:,.0f} B, measured {measured:,} B. "
    n, k = len(e), len(e[0]) if e else 0
    mistakes = [      # (the prediction a mistake gives, its hint); None: not a mistake here
        (measured / nbytes, "Elements or bytes? How many bytes does one value of this dtype "
                            "take?"),
        (measured / 2, "Only the forward? The backward sends the gradients of both all-to-alls, "
                       "the same rows the other way."),
        (moe.alltoall_bytes_per_layer(n, k, h, ep, nbytes),
         "That is labkit.costs.moe's average for a router that spreads tokens evenly over the "
         "experts; this routing is given and uneven: count its rows."),
        (exact_alltoall_bytes(undropped, E, ep, h, nbytes)[rank],
         "Do dropped assignments (kept False) travel?"),
        (4 * every * row if every != leave else None,
         "Do rows for this rank's own experts cross the wire, or stay in memory?"),
        (4 * leave * row, "You counted this rank's rows leaving, four times. In the combine it "
                          "sends back the rows OTHER ranks dispatched to its experts: is that "
                          "the same number when the routing is uneven?")]
    close = lambda x: abs(got - x) <= TOLERANCE * max(x, 1) + 4 * (ep - 1) * FRAMING  # noqa: E731
    return said + next((hint for x, hint in mistakes if x is not None and close(x)),
                       "Which rows leave this rank in each of the four all-to-alls (dispatch, "
                       "combine, and their gradients)? Which stay, which were dropped?")


@graded("8.3")
def alltoall_bytes(predict):
    """Exercise 8.3: predict(routing, n_expert, ep, h, dtype_bytes) -> [bytes sent, per rank]."""

    c = Checker(EXERCISE, TITLE, POINTS)
    for name, ep, E, h, dtype, routing, balanced in _bytes_cases():
        hidden = name == "hidden case"
        with c.case(name):
            nbytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            got = predict([(torch.tensor(e), torch.tensor(kp)) for e, kp in routing], E, ep, h,
                          nbytes)
            if not (isinstance(got, (list, tuple)) and len(got) == ep
                    and all(isinstance(v, (int, float)) for v in got)):
                fail(f"return a list of {ep} numbers: the bytes each rank sends")
            if name not in _MEASURED:      # the checker's own all-to-alls: once per process
                _MEASURED[name] = c.measure(_bytes_job, ep, args=(routing, E, h, dtype))
            res = _MEASURED[name]
            if res[0]["sent"] is None:
                fail(f"the kernel's counter cannot count here: {res[0]['reason']}")
            measured = [r["sent"] for r in res]
            exact = exact_alltoall_bytes(routing, E, ep, h, nbytes)
            slack = [TOLERANCE * max(m, 1) + 4 * (ep - 1) * FRAMING for m in measured]
            for q in range(ep):
                if abs(exact[q] - measured[q]) > slack[q]:
                    fail(f"the checker's count {exact[q]} B and the kernel's {measured[q]} B "
                         f"disagree for rank {q} (please report it)")
            if not hidden:
                c.cases[-1]["name"] += "".join(
                    f"\n      rank {q}: predicted {got[q]:,.0f} B, measured {measured[q]:,} B"
                    for q in range(ep))
                if balanced:
                    n = len(routing[0][0])
                    k = len(routing[0][0][0])
                    formula = moe.alltoall_bytes_per_layer(n, k, h, ep, nbytes)
                    c.cases[-1]["name"] += (f"\n      labkit.costs.moe.alltoall_bytes_per_layer: "
                                            f"{formula:,.0f} B per rank")
            for q in range(ep):
                if abs(got[q] - measured[q]) > slack[q]:
                    fail(_bytes_hint(got[q], measured[q], routing, E, ep, h, nbytes, q))
    return c.finish()
