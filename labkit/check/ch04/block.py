"""Exercise 4.3: the reader's tensor-parallel MLP and attention against one process.

    labkit.check.ch04.tp_block(MyTensorParallelMLP, MyTensorParallelAttention)

One launch per world size (2 shown; 3 and 4 hidden, with grouped-query attention at 3) runs, on
every rank, the reader's split of the one-process labkit.model.MLP / CausalSelfAttention; the
output, dL/dx and the gradient of every kept weight are compared with the full module's on the
same input and upstream gradient (the matching rows or columns), computed by the checker (under
labkit grade: the judge), not on the ranks. Every c10d op in forward and in
backward is observed (labkit.observe.dispatch, a TorchDispatchMode): Megatron's layout needs exactly
one all-reduce of (B, T, h) each way per module and nothing else; the bytes each rank sent are
counted by the kernel (observe.netcount) against 2 all-reduces' ring optimum plus Gloo's headers.
A size tp does not divide must be refused with a ValueError that names it. labkit.tp (the book's
answer) and torch's DTensor tensor parallelism are refused.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from labkit.check import Checker, Forbidden, expect_tensor, fail, graded, tensors_close
from labkit.check.ch04.common import off_by_one_vector
from labkit.launch import device, note
from labkit.model import MLP, CausalSelfAttention, GPTConfig
from labkit.observe import netcount
from labkit.observe.dispatch import CollectiveLog

EXERCISE, TITLE, POINTS = "4.3", "a tensor-parallel MLP and attention from your f and g", 6
FORBIDDEN = Forbidden(("labkit.tp", "torch.distributed.tensor"),
                      frozenset({"TensorParallelMLP", "TensorParallelAttention",
                                 "ColumnParallelLinear", "RowParallelLinear", "apply_tp",
                                 "parallelize_module"}),
                      why="that is the book's answer (or torch's). Build the split from your f "
                          "and g and F.linear.")
LAUNCH_TIMEOUT = 90.0      # seconds: a busy 2-core machine imports torch slowly in 4 ranks
HEADER_BYTES = 300         # Gloo's bytes per ring step besides the payload (test_netcount.py)
# world -> (MLP (h, B, T), attention (h, n_head, n_kv_head, B, T), refused (kind, h, n_head, n_kv))
BLOCK_CASES = {2: ((12, 2, 5), (16, 4, 4, 2, 5), ("attention", 12, 3, 3)),
               3: ((9, 1, 7), (18, 6, 3, 1, 6), ("mlp", 10, 2, 2)),         # hidden
               4: ((10, 2, 3), (16, 8, 4, 2, 4), ("attention", 16, 8, 2))}  # hidden
MLP_PARAMS = ("fc_weight", "fc_bias", "proj_weight", "proj_bias")
ATTN_PARAMS = ("q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias", "o_weight",
               "o_bias")


def _expected_grads(kind, ref, rank, tp) -> dict:
    """name -> the slice of the full module's weight gradient this rank's parameter must get."""
    if kind == "mlp":
        n = ref.fc.out_features // tp
        rows = slice(rank * n, (rank + 1) * n)
        return {"fc_weight": ref.fc.weight.grad[rows], "fc_bias": ref.fc.bias.grad[rows],
                "proj_weight": ref.proj.weight.grad[:, rows], "proj_bias": ref.proj.bias.grad}
    d = ref.head_dim
    q = slice(rank * ref.n_head // tp * d, (rank + 1) * ref.n_head // tp * d)
    kv = slice(rank * ref.n_kv_head // tp * d, (rank + 1) * ref.n_kv_head // tp * d)
    out = {"o_weight": ref.o_proj.weight.grad[:, q], "o_bias": ref.o_proj.bias.grad}
    for name, lin, cut in (("q", ref.q_proj, q), ("k", ref.k_proj, kv), ("v", ref.v_proj, kv)):
        out[f"{name}_weight"], out[f"{name}_bias"] = lin.weight.grad[cut], lin.bias.grad[cut]
    return out


def _inputs(kind, cfg_kwargs, B, T, seed):
    """The full module, the input and the upstream gradient, the same on the ranks and in the
    checker (drawn on the CPU; the module from its own seed, the caller's random state kept)."""
    cfg = GPTConfig(**cfg_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref = MLP(cfg) if kind == "mlp" else CausalSelfAttention(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, T, cfg.n_embd, generator=g)                            # (B, T, h)
    up = torch.randn(B, T, cfg.n_embd, generator=g)                           # (B, T, h)
    return ref, x, up


def expected_run(kind, cfg_kwargs, B, T, seed, rank, tp) -> dict:
    """{quantity: what rank `rank` must get}: one forward and backward of the full module, computed
    where the checker runs (under labkit grade: the judge, where no student code runs)."""
    ref, x, up = _inputs(kind, cfg_kwargs, B, T, seed)
    x.requires_grad_()
    y = ref(x)                                                                 # (B, T, h)
    (y * up).sum().backward()
    want = {"output": y.detach(), "dL/dx": x.grad}
    for name, grad in _expected_grads(kind, ref, rank, tp).items():
        want[f"{name} gradient"] = grad
    return {k: v.detach().cpu() for k, v in want.items()}


def _module_run(cls, kind, cfg_kwargs, B, T, seed):
    """Rank side: one forward + backward of the reader's split; its output and gradients go back
    (what they should be: expected_run, in the checker)."""
    tp, dev = dist.get_world_size(), device()
    ref, x, up = _inputs(kind, cfg_kwargs, B, T, seed)
    ref, up = ref.to(dev), up.to(dev)
    note(f"your {kind} constructor, tp={tp}")
    mine = cls(ref, None)
    xt = x.to(dev).requires_grad_()                                            # (B, T, h) all ranks
    dist.barrier()
    with netcount.socket_bytes() as wire:
        with CollectiveLog() as fwd:
            note(f"your {kind} forward, tp={tp}")
            y = mine(xt)                                                       # (B, T, h)
        with CollectiveLog() as bwd:
            note(f"your {kind} backward, tp={tp}")
            (y * up).sum().backward()
    names = MLP_PARAMS if kind == "mlp" else ATTN_PARAMS
    params = dict(mine.named_parameters())
    got = {"output": y, "dL/dx": xt.grad}
    for name in names:
        p = params.get(name)
        got[f"{name} gradient"] = None if p is None else p.grad
    return {"got": {k: None if v is None else v.detach().cpu() for k, v in got.items()},
            "missing": [n for n in names if n not in params], "fwd": fwd.sized(),
            "bwd": bwd.sized(), "sent": wire.sent, "elements": xt.numel()}


def _judged_launch(c, mlp_cls, attn_cls, tp, cases):
    """One world's launch; each rank's results paired with what it should have got, computed
    here (expected_run), never on the ranks."""
    results = c.launch(block_job, tp, args=(mlp_cls, attn_cls, cases), timeout=LAUNCH_TIMEOUT)
    (h, B, T), (ha, nh, nkv, Ba, Ta), _ = cases
    specs = {"mlp": (dict(n_embd=h, n_head=1), B, T, 3),
             "attention": (dict(n_embd=ha, n_head=nh, n_kv_head=nkv), Ba, Ta, 5)}
    for rank, res in enumerate(results):
        for kind, (cfg_kwargs, b, t, seed) in specs.items():
            got = res[kind]["got"] if isinstance(res[kind].get("got"), dict) else {}
            want = expected_run(kind, cfg_kwargs, b, t, seed, rank, tp)
            res[kind]["pairs"] = {k: (got.get(k), w) for k, w in want.items()}
    return results


def _refused(cls, kind, cfg_kwargs):
    cfg = GPTConfig(**cfg_kwargs)
    try:
        cls(MLP(cfg) if kind == "mlp" else CausalSelfAttention(cfg), None)
    except ValueError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - another failure is a wrong answer, said as such
        return f"{type(err).__name__} (not ValueError): {err}"
    return None


def block_job(mlp_cls, attn_cls, world_cases):
    """Rank side: every sub-case of one world size. The refusal is local, so an exception there
    is kept as its text; an exception in a module's forward or backward ends the launch (the
    other ranks would wait in a collective forever), failing this world's cases with its trace."""
    (h, B, T), (ha, nh, nkv, Ba, Ta), (bad_kind, hb, nhb, nkvb) = world_cases
    try:
        refused = _refused(mlp_cls if bad_kind == "mlp" else attn_cls, bad_kind,
                           dict(n_embd=hb, n_head=nhb, n_kv_head=nkvb))
    except NotImplementedError:
        raise
    return {"refused": refused,
            "mlp": _module_run(mlp_cls, "mlp", dict(n_embd=h, n_head=1), B, T, 3),
            "attention": _module_run(attn_cls, "attention",
                                     dict(n_embd=ha, n_head=nh, n_kv_head=nkv), Ba, Ta, 5)}


# ----------------------------------------------------------------------------- assertions
def assert_module(results, kind) -> None:
    for rank, res in enumerate(results):
        r = res[kind]
        if r["missing"]:
            fail(f"rank {rank}: your {kind} has no parameter named {', '.join(r['missing'])}: "
                 "keep this rank's weights under the names the docstring gives")
        split = "which rows (or columns) of the full weight does this rank keep?"
        for name, (got, want) in r["pairs"].items():
            expect_tensor(got, want, f"rank {rank}: {name}", if_shape=split)
            if name == "output" and off_by_one_vector(got, want):     # same shape by now
                fail(f"rank {rank}: the {kind} output is off by the same vector at every "
                     "position: is a bias added on every rank before the sum (so it is "
                     "counted tp times) instead of once after it?")
            tensors_close(got, want, rtol=1e-4, atol=1e-5, what=f"rank {rank}: {kind} {name}")


def assert_communication(results, tp) -> None:
    for rank, res in enumerate(results):
        for kind in ("mlp", "attention"):
            r = res[kind]
            n = r["elements"]
            for when, calls in (("forward", r["fwd"]), ("backward", r["bwd"])):
                other = sorted({c for c, _ in calls if c != "all_reduce"})
                if other:
                    fail(f"{kind} {when} called dist.{', dist.'.join(other)}: a column-parallel "
                         "layer followed by a row-parallel one needs no communication between "
                         "them. Which single collective does each side need?")
                sizes = [k for _, k in calls]
                if len(sizes) != 1:
                    fail(f"{kind} {when} ran {len(sizes)} all-reduces, Megatron needs one. "
                         + ("Where is the partial sum of the row-parallel layer added up?"
                            if when == "forward" and not sizes else
                            "Does every projection get its own f? One f on x serves q, k and "
                            "v (and fc), so dL/dx is summed once." if when == "backward" and
                            sizes else "Where does the gradient of x get summed?"))
                if sizes[0] != n:
                    fail(f"{kind} {when} all-reduced {sizes[0]} elements; the activations are "
                         f"(B, T, h) = {n}. What should cross the ranks: activations or weights?")
            optimum = 2 * 2 * (tp - 1) / tp * n * 4
            slack = 2 * 2 * (tp - 1) * HEADER_BYTES
            if r["sent"] is not None and r["sent"] > optimum + slack:
                fail(f"rank {rank}'s {kind} sent {r['sent']:,} bytes (counted by the kernel); "
                     f"two ring all-reduces of (B, T, h) fp32 send {optimum:,.0f} (+ {slack} of "
                     "headers). What else crosses the wire?")


def assert_refused(results, world_cases, tp) -> None:
    kind, h, nh, nkv = world_cases[2]
    what = (f"an MLP with hidden size {4 * h}" if kind == "mlp" else
            f"attention with n_head={nh}, n_kv_head={nkv}")
    for rank, res in enumerate(results):
        msg = res["refused"]
        if msg is None:
            fail(f"rank {rank}: {what} at tp={tp} was accepted; a size tp does not divide must "
                 "raise ValueError (it would silently drop heads or columns)")
        if msg.startswith(("ValueError", "TypeError", "RuntimeError")) or "(not ValueError)" in msg:
            fail(f"rank {rank}: {what} at tp={tp} raised {msg.splitlines()[0][:160]}; raise a "
                 "ValueError yourself, before slicing")
        if str(tp) not in msg:
            fail(f"rank {rank}: the error says {msg!r}; say which size tp={tp} must divide, "
                 "and what to change")


@graded("4.3")
def tp_block(mlp_cls, attn_cls):
    """Exercise 4.3: mlp_cls(mlp, group) and attn_cls(attention, group) at tp = 2, 3, 4."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(mlp_cls, attn_cls))
    for tp, cases in BLOCK_CASES.items():
        label = f"TP={tp}" if tp == 2 else f"hidden case, TP={tp}"
        # partial binds this world's tp and cases now (cases_on_one_launch runs them at once)
        checks = (("MLP: output and every gradient equal one process",
                   partial(assert_module, kind="mlp")),
                  ("attention (whole heads per rank): output and gradients equal one process",
                   partial(assert_module, kind="attention")),
                  ("communication: one all-reduce of (B, T, h) forward and one backward per "
                   "module; bytes counted by the kernel", partial(assert_communication, tp=tp)),
                  ("a size tp does not divide is refused with a ValueError",
                   partial(assert_refused, world_cases=cases, tp=tp)))
        c.cases_on_one_launch(label, checks, partial(_judged_launch, c, mlp_cls, attn_cls, tp,
                                                     cases))
    return c.finish()
