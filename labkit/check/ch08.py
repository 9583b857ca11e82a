"""Checkers for chapter 08 (mixture of experts).

    labkit.check.ch08.routing_with_capacity(keep)             # 8.1, one process
    labkit.check.ch08.expert_parallel_layer(ExpertParallelMoE)   # 8.2, real processes, ep 2-4
    labkit.check.ch08.alltoall_bytes(predict)                 # 8.3, predicted vs the kernel's count

8.1: keep(expert (n, k), n_expert, cap) -> (n, k) bool, against plain loops (GShard's priority).

8.2: the reader's whole expert-parallel layer (router, top-k, capacity, all-to-all dispatch,
experts, combine) runs on ep real processes and is compared, on outputs and on the gradients of
the tokens, the router and every expert, with the one-process reference: plain loops over every
rank's tokens written for the checker (never labkit.moe, so the checker cannot agree with a bug
in it). Hidden case: ep = 4, top-3, heavy dropping and a rank that has no tokens. Enforced on
the ranks: the layer moves rows with all-to-alls only (a TorchDispatchMode sees every c10d op its
forward and backward run, and stops any other collective), a rank runs only the experts it owns,
the bytes each rank sends (labkit.netcount, the kernel's count) stay within SLACK of the optimum
(its kept rows that leave and the rows that arrive for its experts, once each way in both
passes; the leaving rows' expert ids; the counts), labkit.moe is neither imported nor named, and
E not divisible by ep raises a ValueError that names both numbers.

8.3: the reader predicts the bytes each rank sends in one MoE layer's forward and backward
(the four row all-to-alls) for a given routing; the checker runs the all-to-alls on real
processes and counts them with labkit.netcount; the prediction must be within TOLERANCE of the
count. For a balanced routing the count is also shown beside labkit.costs.moe's formula.

Long because: 8.2's reference, its observer of collectives and its traffic bound belong together.
"""
from __future__ import annotations

import math

from labkit.check import Checker, fail, tensors_close, graded

EXERCISES = {
    "8.1": ("top-k routing with capacity (GShard priority)", 2),
    "8.2": ("an expert-parallel MoE layer: route, dispatch, experts, combine", 6),
    "8.3": ("predict the all-to-all bytes per rank, then measure them", 3),
}

SLACK = 0.10          # 8.2: bytes sent may exceed the optimum by 10% (+ HEADER per message)
HEADER = 192          # bytes of Gloo framing allowed per all-to-all and peer (~150 seen)
TOLERANCE = 0.05      # 8.3: prediction within 5% of the kernel's count, + FRAMING per message
FRAMING = 200         # bytes of Gloo framing per all-to-all message (about 150 measured)
FORBIDDEN_MODULES = ("labkit.moe",)
FORBIDDEN_NAMES = {"ExpertParallelMoE_", "apply_ep", "route_group", "_AllToAll"}
ALLOWED_C10D = ("alltoall", "send", "recv", "barrier", "monitored_barrier")


# ----------------------------------------------------------------------------- 8.1
def _kept_by_loops(expert, n_expert: int, cap) -> list:
    """Assignments kept: first choices of all tokens in token order, then second choices, ..."""
    n, k = len(expert), len(expert[0]) if expert else 0
    used, kept = [0] * n_expert, [[False] * k for _ in range(n)]
    for j in range(k):
        for t in range(n):
            e = expert[t][j]
            if cap is None or used[e] < cap:
                used[e] += 1
                kept[t][j] = True
    return kept


@graded("8.1")
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
def _modules(E: int, h: int, seed: int):
    """The router (h -> E) and E experts (h -> 2h -> h MLPs), the same numbers on every rank."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    router = nn.Linear(h, E, bias=False)
    with torch.no_grad():
        router.weight.mul_(4.0)                      # confident enough that capacity bites
    experts = [nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
               for _ in range(E)]
    return router, experts


def _tokens(n: int, h: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=g)            # cpu: the same numbers on every rank


def _reference_layer(router, experts, x, k, factor):
    """y (n, h) by plain loops: softmax gate, top-k (renormalized for k > 1), capacity by
    GShard's priority over these n tokens, gate-weighted sum of the kept experts' outputs."""
    import torch

    n, E = x.shape[0], len(experts)
    probs = torch.softmax(router(x), dim=-1)                       # (n, E)
    w, e = probs.topk(k, dim=-1)                                   # (n, k)
    if k > 1:
        w = w / w.sum(-1, keepdim=True)
    cap = None if factor is None else math.ceil(factor * n * k / E)
    kept = _kept_by_loops(e.tolist(), E, cap)
    rows = []
    for t in range(n):
        acc = torch.zeros_like(x[t])
        for j in range(k):
            if kept[t][j]:
                acc = acc + w[t, j] * experts[int(e[t, j])](x[t:t + 1])[0]
        rows.append(acc)
    return torch.stack(rows) if rows else x * 0, e, kept


def _optimum_sent(routing: list, rank: int, ep: int, per: int, h: int) -> int:
    """Bytes rank must send in one forward and backward: its kept assignments whose expert lives
    elsewhere (dispatch; combine's gradient) and the rows other ranks sent to its experts
    (combine; dispatch's gradient), each a row of h fp32 values; the leaving rows' expert ids
    (int64); and the ep-1 counts."""
    e, kept = routing[rank]
    remote = sum(1 for row, ks in zip(e, kept) for x, k in zip(row, ks) if k and x // per != rank)
    back = sum(1 for r in range(ep) if r != rank
               for row, ks in zip(*routing[r]) for x, k in zip(row, ks) if k and x // per == rank)
    # forward: dispatch (my remote rows) + combine (rows I got back to their owners);
    # backward: the same two the other way
    return 2 * (remote + back) * h * 4 + remote * 8 + (ep - 1) * 8


def _c10d_recorder(seen: list):
    """A TorchDispatchMode that records the c10d ops run under it and stops any collective but
    an all-to-all (or a send/recv) before it runs, with the hint: whoever calls it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = func.__name__.split(".")[0].rstrip("_")
                seen.append(name)
                if not name.startswith(ALLOWED_C10D):
                    raise RuntimeError(f"c10d.{name} called: move tokens with all-to-alls only "
                                       f"(dist.all_to_all_single). Which rows does each peer "
                                       f"actually need?")
            return func(*args, **(kwargs or {}))
    return Record()


def _layer_job(cls, tokens: list, E: int, k: int, h: int, factor, seed: int, bad_E: int = 0):
    """Rank side of 8.2: the reader's layer against the reference, on this rank's tokens."""
    import sys

    import torch
    import torch.distributed as dist

    from labkit import netcount
    from labkit.launch import note

    torch.set_num_threads(1)
    rank, ep = dist.get_rank(), dist.get_world_size()
    per = E // ep
    out = {"rank": rank}
    # the reference: every rank's tokens through one copy of the experts; a router copy per
    # rank, since each rank's router gradient comes from its own tokens only
    _, full = _modules(E, h, seed)
    ups, routing = {}, []
    total = 0.0
    for r in range(ep):
        router_r, _ = _modules(E, h, seed)
        x_r = _tokens(tokens[r], h, seed + 1 + r).requires_grad_()
        y_r, e_r, kept_r = _reference_layer(router_r, full, x_r, k, factor)
        ups[r] = _tokens(tokens[r], h, seed + 100 + r)
        total = total + (y_r * ups[r]).sum()
        routing.append((e_r.tolist(), kept_r))
        if r == rank:
            mine = (x_r, y_r.detach(), router_r)
    total.backward()
    x_ref, y_ref, router_ref = mine
    # the reader's layer, on fresh copies of the same modules
    router, experts = _modules(E, h, seed)
    x = _tokens(tokens[rank], h, seed + 1 + rank).requires_grad_()
    note(f"your ExpertParallelMoE, rank {rank} of {ep}")
    layer = cls(router, experts, k, factor, None)
    seen = []
    with netcount.socket_bytes() as count, _c10d_recorder(seen):
        y = layer(x)
        note(f"your ExpertParallelMoE's backward, rank {rank} of {ep}")
        (y * ups[rank]).sum().backward()
    out["sent"], out["optimum"] = count.sent, _optimum_sent(routing, rank, ep, per, h)
    out["c10d"] = sorted(set(seen))
    out["forbidden"] = sorted(m for m in sys.modules if m.startswith(FORBIDDEN_MODULES))
    zero = lambda t, like: torch.zeros_like(like) if t is None else t  # noqa: E731 (no tokens)
    out["compare"] = {"output": (y.detach(), y_ref),
                      "input gradient": (x.grad, zero(x_ref.grad, x)),
                      "router gradient": (router.weight.grad,
                                          zero(router_ref.weight.grad, router.weight))}
    ran_foreign = []
    for i, (m, ref) in enumerate(zip(experts, full)):
        owned = i // per == rank
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            if owned:
                want = q.grad if q.grad is not None else torch.zeros_like(q)
                out["compare"][f"expert {i} {name} gradient"] = (p.grad, want)
            elif p.grad is not None and p.grad.abs().sum() > 0:
                ran_foreign.append(i)
    out["foreign"] = sorted(set(ran_foreign))
    if bad_E:
        router_b, experts_b = _modules(bad_E, h, seed)
        try:
            cls(router_b, experts_b, k, factor, None)
            out["bad_E"] = None
        except ValueError as err:
            out["bad_E"] = str(err)
        except Exception as err:  # noqa: BLE001 - the wrong kind of error is reported
            out["bad_E"] = f"{type(err).__name__}: {err}"
    dist.barrier()
    return out


LAYER_CASES = [  # (ep, tokens per rank, E, k, capacity factor, hidden)
    (2, [9, 6], 4, 2, 1.0, False),
    (3, [7, 10, 4], 6, 2, None, False),
    (4, [6, 0, 9, 5], 8, 3, 0.75, True),       # a rank with no tokens; top-3; many dropped
]
LAYER_H = 128


def forbidden_used(*objs) -> list:
    """What of labkit.moe the reader's functions or class methods name or import (read, not
    run), following helpers defined beside them."""
    return forbidden_used_in(FORBIDDEN_MODULES + tuple(FORBIDDEN_NAMES), *objs)


def forbidden_used_in(forbidden, *objs) -> list:
    """Which of `forbidden` (dotted module prefixes, or bare names) the reader's functions or
    classes import, name or reach through their globals (labkit.check.guards)."""
    from labkit.check.guards import forbidden_used as _used

    mods = tuple(f for f in forbidden if "." in f)
    return _used(list(objs), mods, {f for f in forbidden if f not in mods})


def _judge_layer(res: list, ep: int) -> None:
    for r in res:
        rank = r["rank"]
        if r["forbidden"]:
            fail(f"rank {rank} imported {', '.join(r['forbidden'][:3])}: write the layer "
                 f"yourself, without labkit.moe")
        other = [op for op in r["c10d"] if not op.startswith(ALLOWED_C10D)]
        if other:
            fail(f"rank {rank} called {', '.join(other)}: move tokens with all-to-alls only "
                 f"(dist.all_to_all_single). Which rows does each peer actually need?")
        if r["foreign"]:
            fail(f"rank {rank} ran expert(s) {r['foreign']}, which other ranks own: with "
                 f"expert parallelism a rank runs only its own E/ep experts. Which rank owns "
                 f"expert e?")
        for what, (got, want) in r["compare"].items():
            if got is None:
                fail(f"rank {rank}: no {what}. Does your output depend on it through autograd? "
                     f"An all-to-all needs a backward that sends the gradients home (a "
                     f"torch.autograd.Function), and a rank whose experts got no rows must "
                     f"still take part in it.")
            try:
                # sums over different orders of rows and ranks: fp32 rounding, not a bug
                tensors_close(got, want, rtol=1e-4, atol=1e-5, what=f"rank {rank}'s {what}")
            except AssertionError as err:
                first = str(err).splitlines()[0]
                if what == "output":
                    fail(f"{first}\nare dropped assignments left out (capacity per rank over "
                         f"its own tokens, first choices before second ones); is each row "
                         f"weighted by its renormalized gate; do rows come back in the order "
                         f"they were sent?")
                fail(f"{first}\nthe output is right, so look at the backward: does autograd see "
                     f"the rows cross (a torch.autograd.Function around each all-to-all), and "
                     f"does its backward send the gradients home with the splits swapped?")
    for r in res:
        if r["sent"] is not None:
            limit = (1 + SLACK) * r["optimum"] + HEADER * 6 * (ep - 1)
            if r["sent"] > limit:
                fail(f"rank {r['rank']} sent {r['sent']} bytes (the kernel's count); the "
                     f"all-to-alls need {r['optimum']} (allowed {limit:.0f}). Does every rank "
                     f"get only the kept rows for its own experts, once?")


@graded("8.2")
def expert_parallel_layer(cls):
    """Exercise 8.2: cls(router, experts, k, capacity_factor, group) -> an nn.Module."""
    c = Checker("8.2", *EXERCISES["8.2"])
    bad = forbidden_used(cls)
    first = True
    for ep, tokens, E, k, factor, hidden in LAYER_CASES:
        name = "hidden case" if hidden else (
            f"ep={ep}, tokens per rank {tokens}, {E} experts, top-{k}, capacity factor {factor}")
        bad_E = E + 1 if first else 0
        res = None
        with c.case(name):
            if bad:
                fail(f"your layer uses {', '.join(bad)}: write it yourself, without labkit.moe")
            res = c.launch(_layer_job, ep, args=(cls, tokens, E, k, LAYER_H, factor, 4, bad_E),
                           timeout=60)
            _judge_layer(res, ep)
        if first:
            with c.case(f"{bad_E} experts on {ep} ranks: a ValueError naming both"):
                if bad or res is None:
                    fail("the layer did not run: see the case above")
                msg = res[0].get("bad_E")
                if msg is None:
                    fail(f"constructing the layer with {bad_E} experts on {ep} ranks did not "
                         f"raise: how many experts would each rank own?")
                if msg.split(":")[0].endswith("Error") and not msg.startswith("ValueError"):
                    fail(f"raised {msg.split(':')[0]}, expected a ValueError: {msg[:120]}")
                if str(bad_E) not in msg or str(ep) not in msg:
                    fail(f"the error says {msg!r}: name the number of experts ({bad_E}) and ep "
                         f"({ep}), and what to change")
            first = False
    return c.finish()


# ----------------------------------------------------------------------------- 8.3
def _bytes_job(routing: list, E: int, h: int, dtype: str):
    """Rank side of 8.3: the four row all-to-alls of one MoE layer for the given routing (the
    checker's own code), counted by the kernel. Counts and ids are exchanged outside the count."""
    import torch
    import torch.distributed as dist

    from labkit import netcount

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
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.ones(E)
    w[: max(1, E // 4)] += skew                                        # a few popular experts
    return torch.stack([torch.multinomial(w, k, generator=g) for _ in range(n)]).tolist()


def _bytes_cases():
    import torch

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
    close = lambda x: abs(got - x) <= TOLERANCE * max(x, 1) + 4 * (ep - 1) * FRAMING  # noqa: E731
    if close(measured / nbytes):
        return said + "Elements or bytes? How many bytes does one value of this dtype take?"
    if close(measured / 2):
        return said + ("Only the forward? The backward sends the gradients of both "
                       "all-to-alls, the same rows the other way.")
    from labkit.costs import moe
    n, k = len(e), len(e[0]) if e else 0
    if close(moe.alltoall_bytes_per_layer(n, k, h, ep, nbytes)):
        return said + ("That is labkit.costs.moe's average for a router that spreads tokens "
                       "evenly over the experts; this routing is given and uneven: count its "
                       "rows.")
    if close(exact_alltoall_bytes(undropped, E, ep, h, nbytes)[rank]):
        return said + "Do dropped assignments (kept False) travel?"
    if every != leave and close(4 * every * row):
        return said + ("Do rows for this rank's own experts cross the wire, or stay in "
                       "memory?")
    if close(4 * leave * row):
        return said + ("You counted this rank's rows leaving, four times. In the combine it "
                       "sends back the rows OTHER ranks dispatched to its experts: is that the "
                       "same number when the routing is uneven?")
    return said + ("Which rows leave this rank in each of the four all-to-alls (dispatch, "
                   "combine, and their gradients)? Which stay, which were dropped?")


@graded("8.3")
def alltoall_bytes(predict):
    """Exercise 8.3: predict(routing, n_expert, ep, h, dtype_bytes) -> [bytes sent, per rank]."""
    import torch

    from labkit.costs import moe

    c = Checker("8.3", *EXERCISES["8.3"])
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
                _MEASURED[name] = c.launch(_bytes_job, ep, args=(routing, E, h, dtype))
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
