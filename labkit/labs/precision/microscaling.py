"""MXFP8 and NVFP4 measured on the same tensors: the experiments of chapter 09's block-scaled
section and of `labkit run precision --microscaling`, each a list of rows for labkit.table.

    scale_rules()   MXFP8's E8M0 scale: OCP floor vs round-up (rceil) vs torchao's ceil
    per_tensor()    NVFP4 with and without its fp32 per-tensor scale, tensors of 1e-6 .. 1e4
    hadamard()      NVFP4 with and without the 16x16 random Hadamard transform, wgrad GEMM
    rounding()      NVFP4 round-to-nearest vs stochastic rounding: the error of a mean
    gemm()          y = a w^T through every recipe (fp8 per tensor and 128-blocks, MXFP8,
                    NVFP4) against fp32; products summed in fp32, so the casts' error alone

All are emulations in fp32 on the CPU: the values are the formats', nothing here is a speed.
"""
from __future__ import annotations

import torch

from labkit.precision import mx, nvfp4, scaling
from labkit.precision.formats import cast, relative_error
from labkit.table import table


def scale_rules(rows: int = 256, cols: int = 1024, seed: int = 0) -> list[dict]:
    return mx.rule_table(rows, cols, seed)


def per_tensor(seed: int = 0) -> list[dict]:
    """N(0, sigma^2) tensors (256, 1024) for sigma = 1e-6 (a gradient), 1, 1e4 (an outlier-scale
    activation): relative error with and without S_enc, and the share of block scales that
    rounded to 0 in E4M3 or hit its 448."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(256, 1024, generator=g)                            # (256, 1024)
    rows = []
    for sigma in (1e-6, 1.0, 1e4):
        x = x0 * sigma
        for on in (True, False):
            t = nvfp4.quantize(x, per_tensor=on)
            s = t["s_block"].float()                                    # (256, 64)
            rows.append({"sigma": sigma, "per-tensor scale": "yes" if on else "no",
                         "rel_error": relative_error(nvfp4.dequantize(t), x),
                         "scales 0": float((s == 0).float().mean()),
                         "scales 448": float((s == nvfp4.E4M3_MAX).float().mean())})
    return rows


def _outlier_tensors(n: int, cols: int, g) -> dict:
    """(n, cols) activations: Gaussian, Student-t(3), and two outlier patterns along the token
    dimension n, which is the inner dimension of the weight-gradient GEMM."""
    base = mx.tensors(n, cols, seed=int(torch.randint(1 << 30, (1,), generator=g)))
    tokens = torch.randn(n, cols, generator=g)
    tokens[torch.rand(n, generator=g) < 1 / 64] *= 100.0                # a few massive tokens
    sparse = torch.randn(n, cols, generator=g)
    sparse *= torch.where(torch.rand(n, cols, generator=g) < 0.01, 30.0, 1.0)
    return {"gaussian": base["gaussian"], "student-t(3)": base["student-t(3)"],
            "outlier tokens x100": tokens, "1% entries x30": sparse}


def hadamard(n: int = 1024, cols: int = 256, seed: int = 0) -> list[dict]:
    """Each activation x (n, cols) quantized as the wgrad GEMM reads it (x^T, 16-blocks along
    the tokens), with and without the RHT (error after the inverse rotation), and
    dW = dy^T x with dy ~ N(0, 1) in NVFP4 (stochastic rounding), both with and without RHT."""
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(n, cols, generator=g)                              # (n, out)
    h = nvfp4.hadamard()                                                # (16, 16)
    rows = []
    for name, x in _outlier_tensors(n, cols, g).items():
        xt = x.t().contiguous()                                         # (cols, n)
        back = nvfp4.rht(nvfp4.fake(nvfp4.rht(xt, h)), h.t())           # (cols, n) rotated back
        ref = dy.t() @ x                                                # (out, cols)
        sr = torch.Generator().manual_seed(seed + 1)
        rows.append({"tensor": name, "x^T": relative_error(nvfp4.fake(xt), xt),
                     "x^T with RHT": relative_error(back, xt),
                     "wgrad": relative_error(nvfp4.wgrad(dy, x, use_rht=False, generator=sr), ref),
                     "wgrad with RHT": relative_error(nvfp4.wgrad(dy, x, generator=sr), ref)})
    return rows


def rounding(draws: int = 256, seed: int = 0) -> list[dict]:
    """nvfp4.sr_bias on a N(0, 1) tensor (64, 1024)."""
    g = torch.Generator().manual_seed(seed)
    return nvfp4.sr_bias(torch.randn(64, 1024, generator=g), draws, seed)


def _recipes():
    """name -> (fake for an activation (T, K), fake for a weight (out, K)); blocks along K."""
    return {
        "bf16": (lambda a: cast(a, "bf16"), lambda w: cast(w, "bf16")),
        "fp8 per tensor (current)": (lambda a: scaling.fake(a, "current", "activation"),
                                     lambda w: scaling.fake(w, "current", "weight")),
        "fp8 1x128 / 128x128": (lambda a: scaling.fake(a, "block", "activation"),
                                lambda w: scaling.fake(w, "block", "weight")),
        "MXFP8 floor (OCP)": (lambda a: mx.fake_mx(a, "floor"), lambda w: mx.fake_mx(w, "floor")),
        "MXFP8 rceil (TE)": (lambda a: mx.fake_mx(a, "rceil"), lambda w: mx.fake_mx(w, "rceil")),
        "NVFP4 1x16 / 16x16": (nvfp4.fake, lambda w: nvfp4.fake(w, block2d=True)),
        "NVFP4 1x16 / 1x16": (nvfp4.fake, nvfp4.fake),
    }


def gemm(T: int = 256, K: int = 1024, out: int = 256, seed: int = 0) -> list[dict]:
    """Relative error of y = a w^T (a (T, K), w (out, K) ~ N(0, 0.02^2)) against fp32, for a
    Gaussian a and one with outlier channels (8 of K x 50), under every recipe."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(out, K, generator=g)                         # (out, K)
    acts = mx.tensors(T, K, seed + 1)
    rows = []
    for name, (fa, fw) in _recipes().items():
        row = {"recipe": name}
        for kind in ("gaussian", "outlier channels"):
            a = acts[kind]                                              # (T, K)
            row[kind] = relative_error(fa(a) @ fw(w).t(), a @ w.t())    # (T, out)
        rows.append(row)
    return rows


def _pct(v) -> str:
    return f"{v:.3%}"


COLUMNS = {
    "scale_rules": ("MXFP8 (E4M3, 32-blocks, E8M0 scales): the scale's rounding rule",
                    [("tensor", "tensor"), ("rule", "rule"), ("rel error", "rel_error", ".4f"),
                     ("elements saturated", "saturated", _pct),
                     ("blocks saturated", "blocks_saturated", _pct),
                     ("flushed to 0", "flushed", _pct)]),
    "per_tensor": ("NVFP4: the fp32 per-tensor scale, N(0, sigma^2) tensors",
                   [("sigma", "sigma", "g"), "per-tensor scale",
                    ("rel error", "rel_error", ".4f"), ("block scales 0", "scales 0", _pct),
                    ("block scales 448", "scales 448", _pct)]),
    "hadamard": ("NVFP4: 16x16 random Hadamard transform on the wgrad inputs (relative errors)",
                 [("tensor", "tensor"), ("x^T", "x^T", ".4f"),
                  ("x^T with RHT", "x^T with RHT", ".4f"), ("wgrad", "wgrad", ".4f"),
                  ("wgrad with RHT", "wgrad with RHT", ".4f")]),
    "rounding": ("NVFP4: nearest vs stochastic rounding of one N(0, 1) tensor (relative errors)",
                 [("rounding", "rounding"), ("draws", "draws"), ("one draw", "one", ".4f"),
                  ("mean of draws", "mean", ".4f"), ("noise 1/sqrt(n)", "noise", ".4f"),
                  ("mean, unclamped", "mean unclamped", ".4f"),
                  ("clamped elements", "clamped", _pct),
                  ("their mean shift", "clamped shift", "+.4f")]),
    "gemm": ("GEMM y = a w^T, both inputs through the recipe, fp32 sums: relative error vs fp32",
             [("recipe", "recipe"), ("gaussian a", "gaussian", ".4f"),
              ("outlier-channel a", "outlier channels", ".4f")]),
}
EXPERIMENTS = {"scale_rules": scale_rules, "per_tensor": per_tensor, "hadamard": hadamard,
               "rounding": rounding, "gemm": gemm}


def show(name: str, rows: list[dict]) -> str:
    """One experiment's rows as a titled labkit.table."""
    title, columns = COLUMNS[name]
    return table(rows, columns, title=title)


def tables() -> str:
    """Every experiment, run and printed: what the lab shows as its experiment 7."""
    return "\n\n".join(show(name, run()) for name, run in EXPERIMENTS.items())
