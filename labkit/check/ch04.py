"""Checkers for chapter 04 (tensor parallelism). The tests in tests/test_tp.py use the same jobs
and assertions, so an exercise passes exactly when the book's own layers would.

    labkit.check.ch04.f_operator(f)                      # Exercise 4.1
    labkit.check.ch04.g_operator(g)                      # Exercise 4.2
    labkit.check.ch04.tp_block(MyMLP, MyAttention)       # Exercise 4.3 (labkit.check.ch04_block)
    labkit.check.ch04.tp_bytes(predict_tp_bytes)         # Exercise 4.4

Every job runs on real processes (Gloo), builds the same full module on every rank from a fixed
seed, and returns (actual, expected) pairs; the assertions run here, in the notebook. 4.4 grades
a prediction of the bytes one rank sends in a forward + backward of labkit's TP GPT against
labkit.costs.tensor_parallel and against the kernel's count (labkit.netcount) on real processes,
always on Gloo: the kernel counts TCP, never NCCL's NVLink or InfiniBand.
"""
from __future__ import annotations

from labkit.check import Checker, fail, tensors_close, graded

EXERCISES = {
    "4.1": ("Megatron's f operator (identity forward, all-reduce backward)", 1),
    "4.2": ("Megatron's g operator (all-reduce forward, identity backward)", 1),
    "4.3": ("a tensor-parallel MLP and attention from your f and g", 6),
    "4.4": ("predict the bytes a TP rank sends per step, then measure them", 3),
}


# ----------------------------------------------------------------------------- rank jobs
def _reference_linear(in_f: int, out_f: int, bias: bool, seed: int):
    import torch.nn as nn

    from labkit.tp.layers import _full_init

    from labkit.launch import device

    w, b = _full_init(out_f, in_f, bias, seed)
    lin = nn.Linear(in_f, out_f, bias=bias).to(device())      # this rank's GPU under NCCL
    lin.weight.data.copy_(w)
    if bias:
        lin.bias.data.copy_(b)
    return lin


def _data(shape, seed):
    """The same numbers on every rank and device: drawn by a seeded CPU generator, then moved."""
    import torch

    from labkit.launch import device

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device())


def linear_job(make, kind: str, in_f: int, out_f: int, bias: bool = True, seed: int = 0,
               parallel_input: bool = True, gather_output: bool = False):
    """On each rank: a TP linear (kind 'column' or 'row', built by make(linear, group)) against the
    full nn.Linear, forward and backward. Returns {name: (actual, expected)}."""
    import torch.distributed as dist

    rank, tp = dist.get_rank(), dist.get_world_size()
    ref = _reference_linear(in_f, out_f, bias, seed)
    layer = make(_reference_linear(in_f, out_f, bias, seed), None)
    x = _data((2, 3, in_f), seed + 1).requires_grad_()       # (B, T, in) same on every rank
    w_out = _data((2, 3, out_f), seed + 2)                   # a fixed upstream gradient
    (ref(x) * w_out).sum().backward()
    y_ref = ref(x).detach()
    lo_i, n_i = rank * (in_f // tp), in_f // tp
    lo_o, n_o = rank * (out_f // tp), out_f // tp
    whole_out = kind == "row" or gather_output
    if kind == "row" and parallel_input:
        x_in = x.detach()[..., lo_i:lo_i + n_i].clone().requires_grad_()
        x_grad_ref = x.grad[..., lo_i:lo_i + n_i]
    else:
        x_in = x.detach().clone().requires_grad_()
        x_grad_ref = x.grad
    y = layer(x_in)
    up = w_out if whole_out else w_out[..., lo_o:lo_o + n_o]
    (y * up).sum().backward()
    out = {"output": (y.detach(), y_ref if whole_out else y_ref[..., lo_o:lo_o + n_o]),
           "input gradient": (x_in.grad, x_grad_ref)}
    if kind == "row":
        out["weight gradient"] = (layer.weight.grad, ref.weight.grad[:, lo_i:lo_i + n_i])
        if bias:
            out["bias gradient"] = (layer.bias.grad, ref.bias.grad)
    else:
        out["weight gradient"] = (layer.weight.grad, ref.weight.grad[lo_o:lo_o + n_o])
        if bias:
            out["bias gradient"] = (layer.bias.grad, ref.bias.grad[lo_o:lo_o + n_o])
    return out


def mlp_job(make_row, make_col=None, h: int = 12, seed: int = 0):
    """On each rank: column (f inside) -> GELU -> row (g inside) vs the full two-layer MLP."""
    import torch.nn.functional as F

    from labkit.tp.layers import ColumnParallelLinear

    make_col = make_col or (lambda lin, group: ColumnParallelLinear.from_linear(lin, group))
    fc, proj = _reference_linear(h, 4 * h, True, seed), _reference_linear(4 * h, h, True, seed + 7)
    tfc = make_col(_reference_linear(h, 4 * h, True, seed), None)
    tproj = make_row(_reference_linear(4 * h, h, True, seed + 7), None)
    x = _data((2, 3, h), seed + 1).requires_grad_()
    w_out = _data((2, 3, h), seed + 2)
    y_ref = proj(F.gelu(fc(x)))
    (y_ref * w_out).sum().backward()
    xt = x.detach().clone().requires_grad_()
    y = tproj(F.gelu(tfc(xt)))
    (y * w_out).sum().backward()
    return {"MLP output": (y.detach(), y_ref.detach()), "MLP input gradient": (xt.grad, x.grad),
            "proj bias gradient": (tproj.bias.grad, proj.bias.grad)}


def _graph_check(y, name):
    import torch

    from labkit.launch import device

    if not isinstance(y, torch.Tensor) or not y.requires_grad:
        return {f"{name}'s output is part of the autograd graph (requires_grad)":
                (torch.tensor(0.0, device=device()), torch.tensor(1.0, device=device()))}
    return None


def g_job(g):
    """On each rank: g sums the ranks' inputs forward and passes the gradient through."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    xs = [_data((3, 5), 10 + r) for r in range(n)]           # every rank's input, known to all
    ws = [_data((3, 5), 20 + r) for r in range(n)]           # every rank's upstream gradient
    x = xs[rank].clone().requires_grad_()
    y = g(x, None)
    bad = _graph_check(y, "g")
    if bad:
        return bad
    out = {"g forward (sum over ranks)": (y.detach().clone(), sum(xs))}
    (y * ws[rank]).sum().backward()
    out["g backward (identity)"] = (x.grad, ws[rank])
    out["g's input x (must not be changed in place)"] = (x.detach(), xs[rank])
    return out


def f_job(f):
    """On each rank: f passes x through forward and sums the ranks' gradients backward."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    x0 = _data((3, 5), 10)                                   # f's input is the same on all ranks
    ws = [_data((3, 5), 20 + r) for r in range(n)]
    x = x0.clone().requires_grad_()
    y = f(x, None)
    bad = _graph_check(y, "f")
    if bad:
        return bad
    out = {"f forward (identity)": (y.detach().clone(), x0)}
    (y * ws[rank]).sum().backward()
    out["f backward (sum of the ranks' gradients)"] = (x.grad, sum(ws))
    return out


# ----------------------------------------------------------------------------- assertions
def assert_pairs(results, what: str = "", rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Every rank's (actual, expected) pairs match; the hint names the rank and the quantity."""
    for rank, pairs in enumerate(results):
        for name, (actual, expected) in pairs.items():
            if actual is None:
                fail(f"rank {rank}: {name} is None (was the tensor cut out of the autograd graph, "
                     "e.g. by .detach(), .data or torch.no_grad()?)")
            tensors_close(actual, expected, rtol=rtol, atol=atol,
                          what=f"rank {rank}: {what}{name}")


# ----------------------------------------------------------------------------- checkers
@graded("4.1")
def f_operator(f):
    """Exercise 4.1: f(x, group) against its definition at 2 and 3 ranks."""
    c = Checker("4.1", *EXERCISES["4.1"])
    for n in (2, 3):
        with c.case(f"{n} ranks: f forward is the identity, backward sums the gradients"):
            assert_pairs(c.launch(f_job, n, args=(f,)))
    return c.finish()


@graded("4.2")
def g_operator(g):
    """Exercise 4.2: g(x, group) against its definition at 2 and 3 ranks."""
    c = Checker("4.2", *EXERCISES["4.2"])
    for n in (2, 3):
        with c.case(f"{n} ranks: g forward sums over ranks, backward is the identity"):
            assert_pairs(c.launch(g_job, n, args=(g,)))
    return c.finish()


def _hint_bias(res, tp):
    """A bias added before the all-reduce is summed tp times: the output is then off by the same
    vector at every position. Say so, instead of only 'differs at index ...'."""
    import torch

    y, y_ref = res[0]["output"]
    if y.shape != y_ref.shape:
        return
    diff = y.double() - y_ref.double()                       # (B, T, out)
    if diff.abs().max() > 1e-4 and torch.allclose(diff, diff[:1, :1].expand_as(diff), atol=1e-5):
        fail(f"the output is off by the same vector at every position (about {tp - 1} extra "
             "copies of the bias): add the bias once, after the all-reduce (g), not on every rank "
             "before it")


# ----------------------------------------------------------------------------- 4.3
@graded("4.3")
def tp_block(mlp_cls, attn_cls):
    """Exercise 4.3 (labkit.check.ch04_block): the reader's TP MLP and attention at tp = 2, 3, 4."""
    from labkit.check.ch04_block import tp_block as check

    return check(mlp_cls, attn_cls)


# ----------------------------------------------------------------------------- 4.4
# (tp, b, s, h, n_layer, n_head): activations large enough that Gloo's headers stay under 2%
WIRE_CASES = [(2, 4, 32, 64, 2, 4), (4, 8, 32, 64, 1, 4), (3, 4, 32, 96, 2, 6)]  # 2-3 hidden
WIRE_TOLERANCE = 0.05
_MEASURED: dict = {}   # case -> per-rank results: labkit's run does not depend on fn


def costs_tp_bytes(b, s, h, n_layer, tp, bytes_per_element=4) -> float:
    """labkit.costs' answer: n_layer x 4 ring all-reduces of (b, s, h) per forward + backward."""
    from labkit.costs import tensor_parallel as tpc

    return n_layer * tpc.layer_bytes_sent_per_rank(b, s, h, tp, bytes_per_element)


def _wire_hint(ratio, tp) -> str:
    near = lambda x: abs(ratio - x) <= WIRE_TOLERANCE * x  # noqa: E731
    if near(0.5):
        return ("About half: how many all-reduces does one layer run in forward, and how many "
                "in backward (attention and MLP each have a g and an f)?")
    if near(tp / (2 * (tp - 1))) or near(tp / (4 * (tp - 1))):
        return ("That is the all-reduced buffer's size; on a ring of tp ranks, how much of a "
                "buffer does each rank SEND in one all-reduce (two phases)?")
    if near(2.0):
        return "Twice the count: only what this rank sends, not sent + received."
    return ("How many all-reduces per layer, of how many bytes each (activations or weights?), "
            "and what share of each does a ring rank send?")


@graded("4.4")
def tp_bytes(fn):
    """Exercise 4.4: fn(b, s, h, n_layer, tp, bytes_per_element) -> bytes one rank sends in one
    forward + backward of labkit's TP GPT (fp32 on the CPU, so bytes_per_element = 4)."""
    from labkit.launch import run
    from labkit.tp.measure import wire_job

    c = Checker("4.4", *EXERCISES["4.4"])
    for i, (tp, b, s, h, n_layer, n_head) in enumerate(WIRE_CASES):
        name = (f"tp={tp}, b={b}, s={s}, h={h}, {n_layer} layers" if i == 0 else
                f"hidden case {i}")
        with c.case(name):
            got = fn(b, s, h, n_layer, tp, 4)
            if not isinstance(got, (int, float)):
                fail(f"return a number of bytes, got {type(got).__name__}")
            cfg = dict(n_layer=n_layer, n_embd=h, n_head=n_head, block_size=s, vocab_size=96)
            key = (tp, b, s, h, n_layer, n_head)
            res = _MEASURED.get(key) or run(wire_job, tp, (cfg, b, 1), timeout=120, echo=False,
                                            backend="gloo")
            _MEASURED[key] = res
            if any(r["sent"] is None for r in res):
                fail(f"the kernel cannot count this backend's bytes ({res[0]['reason']})")
            measured = max(r["sent"] for r in res)
            want = costs_tp_bytes(b, s, h, n_layer, tp)
            c.cases[-1]["name"] += (f"\n      predicted {got / 1e3:.1f} KB, measured "
                                    f"{measured / 1e3:.1f} KB (kernel), labkit.costs "
                                    f"{want / 1e3:.1f} KB") if i == 0 else ""
            if abs(want / measured - 1) > WIRE_TOLERANCE:
                fail(f"labkit.costs says {want:,.0f} B, the kernel counted {measured:,} B: the "
                     "checker disagrees with itself (please report it)")
            if abs(got / measured - 1) > WIRE_TOLERANCE:
                fail(f"predicted {got:,.0f} B, measured {measured:,} B by the kernel "
                     f"({got / measured:.2f}x). " + _wire_hint(got / measured, tp))
    return c.finish()
