"""One way to say "these tensors are equal up to rounding", for tests, checkers and labs alike.

    from labkit.testing import tensors_close, compare_dicts
    tensors_close(out, ref, what="the output")              # tolerance from the dtype
    compare_dicts(run["grads"], ref["grads"], what="grad")  # every key, first mismatch named
    worst_difference(run["params"], ref["params"])          # a number for a table, no assert

compare_dicts is the one comparator of runs against labkit.reference (DDP, pipeline, tests);
labkit.labs.parallel.compare prints worst_difference per rank. A checker may keep its own oracle
on purpose, to stay independent of the code it grades.

A parallel run computes the same sums as the one-process reference, in a different order (a
ring, a tree, shards added separately), and floating-point addition is not associative: each
addition rounds by up to half a unit in the last place (ulp), so the two results differ by a few
ulps that grow slowly with the number of terms and steps. "Close" is therefore a multiple of the
format's machine epsilon (eps, the gap between 1 and the next number), not one number for all:

    dtype      eps        rtol     atol    why
    float64    2.2e-16    1e-9     1e-12   references run in float64 so that a parallel run can be
                                           held to near-exactness; ~5e6 eps leaves room for
                                           reordered reductions over a few optimizer steps
    float32    1.2e-7     1e-5     1e-6    ~100 eps: reductions over thousands of terms reordered
    float16    9.8e-4     2e-3     1e-3    ~2 eps: one rounding of the result already costs 0.5 ulp
    bfloat16   7.8e-3     1.6e-2   1e-2    ~2 eps, as float16 (8 bits of mantissa: 1 part in 256)

atol covers results that cancel to near zero, where relative error is meaningless; it assumes
values of order 1 (the tiny GPT's activations, gradients and parameters). Pass rtol/atol to
override. Integer and bool tensors must be equal. Failures raise AssertionError with a message
that says what, where and by how much, so a checker can show it as the learner's hint.
"""
from __future__ import annotations

import torch

# dtype -> (rtol, atol); see the table above
TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing tensors of `dtype`; (0, 0) for integers and bools."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if dtype.is_floating_point:  # float8 and friends: two ulps of their own epsilon
        eps = torch.finfo(dtype).eps
        return 2 * eps, 2 * eps
    return 0.0, 0.0


def tensors_close(actual, expected, *, rtol: float | None = None, atol: float | None = None,
                  what: str = "the result") -> None:
    """Assert `actual` equals `expected` (same shape and dtype) up to the dtype's tolerance.

    rtol, atol: None takes the defaults for the dtype (TOLERANCES). `expected` may be a number
    or a nested list (made a tensor of `actual`'s dtype). Both are compared on the CPU."""
    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what} should be a torch.Tensor, got {type(actual).__name__}")
    if not isinstance(expected, torch.Tensor):
        expected = torch.as_tensor(expected, dtype=actual.dtype)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what} has shape {tuple(actual.shape)}, "
                             f"expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what} has dtype {actual.dtype}, expected {expected.dtype}")
    d_rtol, d_atol = tolerance(actual.dtype)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point() or a.is_complex():
        a, e = a.double(), e.double()  # compare in float64: the tolerance, not the format, decides
        ok = torch.isclose(a, e, rtol=rtol, atol=atol)
    else:
        ok = a == e
    if not bool(ok.all()):
        bad = (~ok).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what} differs at {len(bad)} of {a.numel()} positions; first at index {i}: "
            f"got {a[i].item():.6g}, expected {e[i].item():.6g} "
            f"(|diff| {abs(a[i].item() - e[i].item()):.3g}; rtol={rtol:g}, atol={atol:g})")


def compare_dicts(actual: dict, expected: dict, *, rtol: float | None = None,
                  atol: float | None = None, what: str = "") -> None:
    """Assert two {name: tensor} dicts (parameters, gradients, optimizer state) hold the same
    names and close tensors. Missing and unexpected names are listed first; then the first
    name, in `expected`'s order, whose tensors differ is named with where and by how much."""
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if extra:
            parts.append(f"unexpected {_names(extra)}")
        raise AssertionError(f"{what}{' ' if what else ''}keys differ: " + "; ".join(parts))
    for key, ref in expected.items():
        tensors_close(actual[key], ref, rtol=rtol, atol=atol,
                      what=f"{what}{' ' if what else ''}{key!r}")


def worst_difference(got: dict, want: dict, what: str = "") -> float:
    """The largest |got - want| over every name of `got` (a subset of `want`'s names: one rank's
    shard of the parameters), for tables that show how close a run came rather than assert."""
    extra = set(got) - set(want)
    if extra:
        raise KeyError(f"{what}: names the reference lacks: {sorted(extra)[:3]}")
    return max(((g - want[n]).abs().max().item() for n, g in got.items()), default=0.0)


def _names(keys: list, shown: int = 6) -> str:
    head = ", ".join(repr(k) for k in keys[:shown])
    return f"{len(keys)}: {head}" + (", ..." if len(keys) > shown else "")
