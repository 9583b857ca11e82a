"""Exercise 0.4: predict whether a matmul is compute- or memory-bound on this machine, then
measure it.

    labkit.check.ch00.roofline_matmul(predict_matmul)

The checker measures this machine's roofline in its own process (labkit.roofline: the best of a
few fp32 matmuls for the peak, of a large read, copy and add for the bandwidth) and hands those two
numbers to YOUR predict_matmul(m, k, n, itemsize, peak, bandwidth), which returns the FLOPs, the
bytes (each input read once, the output written once), the intensity, the bound and the
roofline's lower bound on the time. These are compared with labkit.costs.roofline; then each
matmul is timed and shown beside the prediction (shown, not graded: the timing of a loaded
machine moves by a factor of two from run to run, the formula does not). Two hidden cases use an
H100's datasheet roofs in bf16.
"""
from __future__ import annotations

import functools

from labkit import roofline as here
from labkit.check import Checker, Forbidden, fail, graded
from labkit.costs import chips
from labkit.costs import roofline as costs

EXERCISE, TITLE, POINTS = ("0.4", "compute- or memory-bound? predict from the measured roofline, "
                           "then measure", 2)
SHAPES = [(1, 8192, 4096), (1024, 1024, 1024), (8, 4096, 1024), (2048, 64, 2048)]
# (1, 8192) @ (8192, 4096): 128 MiB of weights, four times this machine's L3 (a smaller matrix
# would be timed out of cache and beat the memory roof)
HIDDEN = [((1, 8192, 8192), 2, "H100 80GB"), ((4096, 4096, 4096), 2, "H100 80GB")]
KEYS = ("flops", "bytes", "intensity", "bound", "seconds")
RTOL = 1e-6
# the checker's own answer: a prediction that calls it predicts nothing (refused when read, and
# at run time under the grader: labkit.grade.guard)
ORACLE = Forbidden(("labkit.costs",), why="predict it yourself: labkit.costs is the checker's "
                   "own answer")

# (ratio got / want of one key, hint) for the mistakes readers make
MISTAKES = {
    "flops": [(0.5, "Half: a multiply-add is two FLOPs, so (m, k) @ (k, n) does 2*m*k*n.")],
    "bytes": [(None, "Bytes: itemsize * (m*k + k*n + m*n): both inputs read once and the output "
                     "written once.")],
}


@functools.lru_cache(maxsize=1)
def measure_here():
    """This machine's roofs, quickly, once per process (timings from labkit.roofline)."""
    r = here.measure(sizes=(512, 1024), nbytes=64 * 2**20, min_run_time=0.05)
    return r.peak["fp32"], r.bandwidth


def want(m, k, n, itemsize, peak, bandwidth) -> dict:
    op = costs.matmul_mkn(m, k, n, itemsize)
    return {"flops": op.flops, "bytes": op.bytes, "intensity": op.intensity,
            "bound": costs.bound(op.intensity, peak, bandwidth),
            "seconds": costs.seconds(op, peak, bandwidth)}


def _hint(key, got, expected) -> str:
    said = f"{key}: predicted {got!r}, want {expected!r}. "
    if key == "bound":
        return said + ("Compare the intensity with the ridge point peak / bandwidth: below it "
                       "the matmul waits for memory.")
    if key == "seconds":
        return said + "The roofline's bound is max(flops / peak, bytes / bandwidth)."
    if key == "intensity":
        return said + "Intensity is FLOPs per byte moved: flops / bytes."
    for ratio, hint in MISTAKES.get(key, []):
        if ratio is None or abs(got / expected - ratio) < 1e-9:
            return said + hint
    return said + ("Count a multiply and an add per term." if key == "flops" else "")


def _compare(got, expected) -> None:
    if not isinstance(got, dict) or any(k not in got for k in KEYS):
        fail(f"return a dict with keys {list(KEYS)}, got {got!r:.80}")
    if got["bound"] not in ("compute", "memory"):
        fail(f"bound: 'compute' or 'memory', got {got['bound']!r}")
    for key in ("flops", "bytes", "intensity", "seconds", "bound"):
        g, e = got[key], expected[key]
        same = g == e if key == "bound" else (isinstance(g, (int, float)) and
                                              abs(g - e) <= RTOL * abs(e))
        if not same:
            fail(_hint(key, g, e))


@graded("0.4")
def roofline_matmul(fn, cases=None):
    """Exercise 0.4: fn(m, k, n, itemsize, peak, bandwidth) -> {"flops", "bytes", "intensity",
    "bound", "seconds"} for (m, k) @ (k, n)."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(ORACLE.refusal(fn))
    peak, bandwidth = measure_here()
    for m, k, n in (SHAPES if cases is None else cases):
        with c.case(f"({m}, {k}) @ ({k}, {n}) fp32 here (peak {peak / 1e9:.1f} GFLOP/s, "
                    f"{bandwidth / 1e9:.1f} GB/s)"):
            got = fn(m, k, n, 4, peak, bandwidth)          # a stub stops here
            expected = want(m, k, n, 4, peak, bandwidth)
            _compare(got, expected)
            t = here.time_matmul(m, k, n, "fp32", min_run_time=0.05)
            c.cases[-1]["name"] += (
                f"\n      predicted {got['bound']}-bound, >= {got['seconds'] * 1e3:.3f} ms; "
                f"measured {t * 1e3:.3f} ms, {expected['flops'] / t / 1e9:.1f} GFLOP/s "
                f"({expected['seconds'] / t:.0%} of the roof)")
    if cases is None:
        for i, ((m, k, n), itemsize, gpu) in enumerate(HIDDEN):
            with c.case(f"hidden case {i + 1}"):
                chip = chips.chip(gpu)
                args = (m, k, n, itemsize, chip.peak_flops("bf16"), chip.bandwidth)
                _compare(fn(*args), want(*args))
    return c.finish()
