"""Exercise 8.2: an expert-parallel MoE layer: route, dispatch, experts, combine.

    labkit.check.ch08.expert_parallel_layer(ExpertParallelMoE)   # real processes, ep 2-4

The reader's whole layer (router, top-k, capacity, all-to-all dispatch, experts, combine) runs on
ep real processes and is compared, on outputs and on the gradients of the tokens, the router and
every expert, with the one-process reference (computed by the checker, under labkit grade the
judge, not on the ranks): plain loops over every rank's tokens written for
the checker (never labkit.moe, so the checker cannot agree with a bug in it). Hidden case:
ep = 4, top-3, heavy dropping and a rank that has no tokens. Enforced on the ranks: the layer
moves rows with all-to-alls only (labkit.observe.dispatch.CollectiveLog sees every c10d op its
forward and backward run, and refuses any other collective), a rank runs only the experts it
owns, the bytes each rank sends (observe.netcount, the kernel's count) stay within SLACK of the
optimum (its kept rows that leave and the rows that arrive for its experts, once each way in both
passes; the leaving rows' expert ids; the counts), labkit.moe is neither imported nor named (no
module of this package imports it, so the ranks' sys.modules shows the reader's), and E not
divisible by ep raises a ValueError that names both numbers.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.check import Checker, Forbidden, Refused, fail, graded, tensors_close
from labkit.check.ch08.common import kept_by_loops
from labkit.launch import note
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog

EXERCISE, TITLE, POINTS = ("8.2", "an expert-parallel MoE layer: route, dispatch, experts, "
                           "combine", 6)
SLACK = 0.10          # bytes sent may exceed the optimum by 10% (+ HEADER per message)
HEADER = 192          # bytes of Gloo framing allowed per all-to-all and peer (~150 seen)
FORBIDDEN = Forbidden(("labkit.moe",),
                      frozenset({"ExpertParallelMoE_", "apply_ep", "route_group", "_AllToAll"}),
                      why="write it yourself, without labkit.moe")
ALLOWED = ("all_to_all", "send", "recv", "barrier", "monitored_barrier")
WHY = ("move tokens with all-to-alls only (dist.all_to_all_single). Which rows does each peer "
       "actually need?")


def _modules(E: int, h: int, seed: int):
    """The router (h -> E) and E experts (h -> 2h -> h MLPs), the same numbers on every rank."""
    torch.manual_seed(seed)
    router = nn.Linear(h, E, bias=False)
    with torch.no_grad():
        router.weight.mul_(4.0)                      # confident enough that capacity bites
    experts = [nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))
               for _ in range(E)]
    return router, experts


def _tokens(n: int, h: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=g)            # cpu: the same numbers on every rank


def _reference_layer(router, experts, x, k, factor):
    """y (n, h) by plain loops: softmax gate, top-k (renormalized for k > 1), capacity by
    GShard's priority over these n tokens, gate-weighted sum of the kept experts' outputs."""
    n, E = x.shape[0], len(experts)
    probs = torch.softmax(router(x), dim=-1)                       # (n, E)
    w, e = probs.topk(k, dim=-1)                                   # (n, k)
    if k > 1:
        w = w / w.sum(-1, keepdim=True)
    cap = None if factor is None else math.ceil(factor * n * k / E)
    kept = kept_by_loops(e.tolist(), E, cap)
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


def expected_layer(tokens: list, E: int, k: int, h: int, factor, seed: int) -> list:
    """[{"want": {quantity: tensor}, "optimum": bytes} per rank]: every rank's tokens through one
    copy of the experts by plain loops (a router copy per rank, since each rank's router gradient
    comes from its own tokens only), computed where the checker runs (under labkit grade: the
    judge, where no student code runs), never on the ranks."""
    ep = len(tokens)
    per = E // ep
    with torch.random.fork_rng(devices=[]):   # _modules seeds torch: the caller's state kept
        _, full = _modules(E, h, seed)
        routers = [_modules(E, h, seed)[0] for _ in range(ep)]
    ups, routing, runs = {}, [], []
    total = 0.0
    for r in range(ep):
        x_r = _tokens(tokens[r], h, seed + 1 + r).requires_grad_()         # (n_r, h)
        y_r, e_r, kept_r = _reference_layer(routers[r], full, x_r, k, factor)
        ups[r] = _tokens(tokens[r], h, seed + 100 + r)                     # (n_r, h)
        total = total + (y_r * ups[r]).sum()
        routing.append((e_r.tolist(), kept_r))
        runs.append((x_r, y_r.detach()))
    total.backward()
    zero = lambda t, like: torch.zeros_like(like) if t is None else t  # noqa: E731 (no tokens)
    out = []
    for rank, (x_r, y_r) in enumerate(runs):
        want = {"output": y_r, "input gradient": zero(x_r.grad, x_r),
                "router gradient": zero(routers[rank].weight.grad, routers[rank].weight)}
        for i in range(rank * per, (rank + 1) * per):
            for name, q in full[i].named_parameters():
                want[f"expert {i} {name} gradient"] = zero(q.grad, q)
        out.append({"want": {n: t.detach() for n, t in want.items()},
                    "optimum": _optimum_sent(routing, rank, ep, per, h)})
    return out


def _layer_job(cls, tokens: list, E: int, k: int, h: int, factor, seed: int, bad_E: int = 0):
    """Rank side of 8.2: the reader's layer on this rank's tokens; its output and gradients go
    back (what they should be: expected_layer, in the checker)."""
    torch.set_num_threads(1)
    rank, ep = dist.get_rank(), dist.get_world_size()
    per = E // ep
    out = {"rank": rank}
    router, experts = _modules(E, h, seed)
    x = _tokens(tokens[rank], h, seed + 1 + rank).requires_grad_()           # (n, h)
    up = _tokens(tokens[rank], h, seed + 100 + rank)                          # (n, h)
    note(f"your ExpertParallelMoE, rank {rank} of {ep}")
    layer = cls(router, experts, k, factor, None)
    log = CollectiveLog(allow=ALLOWED, why=WHY, error=Refused)
    with netcount.socket_bytes() as count, log:
        y = layer(x)
        note(f"your ExpertParallelMoE's backward, rank {rank} of {ep}")
        (y * up).sum().backward()
    out["sent"] = count.sent
    out["c10d"] = sorted(set(log.calls))
    out["forbidden"] = sorted(m for m in sys.modules if m.startswith(FORBIDDEN.modules))
    got = {"output": y.detach(), "input gradient": x.grad,
           "router gradient": router.weight.grad}
    ran_foreign = []
    for i, m in enumerate(experts):
        owned = i // per == rank
        for name, p in m.named_parameters():
            if owned:
                got[f"expert {i} {name} gradient"] = p.grad
            elif p.grad is not None and p.grad.abs().sum() > 0:
                ran_foreign.append(i)
    out["got"] = got
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


def _judge_layer(res: list, ep: int, wants: list) -> None:
    for rank, r in enumerate(res):
        if r["rank"] != rank:
            fail(f"rank {rank}'s result came back as rank {r['rank']!r}'s")
        got = r["got"] if isinstance(r.get("got"), dict) else {}
        r["compare"] = {what: (got.get(what), want) for what, want in wants[rank]["want"].items()}
        r["optimum"] = wants[rank]["optimum"]
    for r in res:
        rank = r["rank"]
        if r["forbidden"]:
            fail(f"rank {rank} imported {', '.join(r['forbidden'][:3])}: write the layer "
                 f"yourself, without labkit.moe")
        other = [op for op in r["c10d"] if not op.startswith(ALLOWED)]
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
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(cls, who="your layer"))
    first = True
    for ep, tokens, E, k, factor, hidden in LAYER_CASES:
        name = "hidden case" if hidden else (
            f"ep={ep}, tokens per rank {tokens}, {E} experts, top-{k}, capacity factor {factor}")
        bad_E = E + 1 if first else 0
        res = None
        with c.case(name):
            res = c.launch(_layer_job, ep, args=(cls, tokens, E, k, LAYER_H, factor, 4, bad_E),
                           timeout=60)
            _judge_layer(res, ep, expected_layer(tokens, E, k, LAYER_H, factor, 4))
        if first:
            with c.case(f"{bad_E} experts on {ep} ranks: a ValueError naming both"):
                if res is None:
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
