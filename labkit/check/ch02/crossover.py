"""Exercise 2.4: predict the per-rank batch at which DDP's all-reduce stops hiding.

    labkit.check.ch02.crossover_batch(predict_crossover)

The reader writes predict_crossover(n_params, world, flops_per_s, bandwidth, alpha, grad_bytes,
n_buckets) -> tokens per rank: the batch at which the backward (4 FLOPs per parameter per token
at flops_per_s) lasts as long as the ring all-reduce of the gradients in n_buckets buckets.
Graded to 1% on cases shown (a 7B model over NVLink and over InfiniBand, this chapter's lab
model on Gloo-like constants) and hidden ones (latency-bound, fp32 gradients, an odd world
size); a miss names the likely slip from the ratio. The oracle is labkit.costs.hiding.dp, the
function the chapter derives (kept on purpose: it is what the text and the lab use); the reader's
code may not call it, nor costs.scaling or costs.comm, which would be the answer.
The measuring half of the exercise runs in the notebook (labkit.labs.overlap.measure): a noisy
timing is shown next to the prediction, never graded.
"""
from __future__ import annotations

from labkit.check import Checker, Forbidden, fail, graded
from labkit.costs import hiding
from labkit.costs.flops import peak_flops

EXERCISE, TITLE, POINTS = "2.4", "predict the batch where DDP turns communication-bound", 2
TOLERANCE = 0.01
FORBIDDEN = Forbidden(("labkit.costs.hiding", "labkit.costs.scaling", "labkit.costs.comm",
                       "labkit.labs"),
                      why="write the crossover from the formulas")

# (name, n_params, world, FLOP/s, bandwidth B/s, alpha s, grad bytes, buckets, shown)
H100 = peak_flops("H100 80GB")     # dense bf16, labkit.costs.chips
CASES = [
    ("7B, 8 H100 over NVLink (bf16 grads, 50% of peak)", 7e9, 8, 0.5 * H100, 450e9, 0.0, 2, 1,
     True),
    ("7B, 64 ranks over InfiniBand NDR (bf16 grads)", 7e9, 64, 0.5 * H100, 50e9, 5e-6, 2, 25,
     True),
    ("the lab's model on Gloo (fp32 grads, 11 buckets)", 6.36e6, 2, 1e10, 0.4e9, 1e-3, 4, 11,
     True),
    ("hidden: latency-bound", 1e6, 16, 1e14, 100e9, 20e-6, 2, 40, False),
    ("hidden: fp32 gradients, 3 ranks", 1.3e9, 3, 2e14, 25e9, 5e-6, 4, 8, False),
]
# ratio predicted / right -> the slip it usually is
MISTAKES = [
    (2 / 3, "Two thirds: the all-reduce hides under the BACKWARD only (4 FLOPs per parameter per "
            "token), not the whole step (6): the forward runs before any gradient exists."),
    (1.5, "One and a half: the backward is 4 FLOPs per parameter per token, not 6."),
    (0.5, "Half: count both phases of the ring (reduce-scatter and all-gather), 2(N-1)/N of the "
          "gradient bytes per rank."),
    (2.0, "Twice: a ring all-reduce sends 2(N-1)/N of the bytes per rank, not 2(N-1)/N x 2."),
]


def _hint(ratio: float, world: int) -> str:
    for want, why in MISTAKES:
        if abs(ratio / want - 1) < 0.02:
            return why
    if abs(ratio * (world - 1) / world - 1) < 0.02 or abs(ratio * world / (world - 1) - 1) < 0.02:
        return f"Off by (N-1)/N: each rank sends 2(N-1)/N of the bytes, N = {world}."
    return ("Write the backward's time for t tokens, the all-reduce's (alpha per message of each "
            "bucket, 2(N-1) messages in a ring, and the bytes), and solve for t.")


@graded("2.4")
def crossover_batch(fn, cases=CASES):
    """Exercise 2.4: fn(n_params, world, flops_per_s, bandwidth, alpha, grad_bytes, n_buckets)
    -> tokens per rank at which the backward takes as long as the gradients' all-reduce."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(fn))
    for name, P, n, C, bw, alpha, e, k, shown in cases:
        with c.case(name if shown else "hidden case"):
            got = fn(P, n, C, bw, alpha, e, k)
            want = hiding.dp(P, n, C, bw, alpha, grad_bytes=e, n_buckets=k).value
            if not isinstance(got, (int, float)) or isinstance(got, bool) or got != got:
                fail(f"return a number of tokens (got {got!r})")
            if shown:
                c.cases[-1]["name"] += f"\n      predicted {got:,.0f} tokens, right {want:,.0f}"
            if abs(got / want - 1) > TOLERANCE:
                fail(f"{got:,.0f} tokens, {got / want:.3f}x the crossover. " + _hint(got / want, n))
    return c.finish()
