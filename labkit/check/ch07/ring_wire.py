"""Exercise 7.4: predict ring attention's bytes per rank, then measure them.

    labkit.check.ch07.ring_bytes(predict_ring_bytes)   # (b, s, H, Hk, d, cp, e) -> bytes

The reader predicts the bytes one rank sends in one forward + backward of labkit's
ring_attention; the checker measures them with the kernel on cp real Gloo processes (shown: cp=2;
hidden: cp=3 and 4, one grouped-query) and grades within 5%, beside labkit.costs' answer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.check import Checker, fail, graded
from labkit.check.mistakes import diagnose
from labkit.context.layout import positions
from labkit.context.ring_attention import ring_attention
from labkit.costs.context import cp_ring_layer_bytes
from labkit.launch import device, run
from labkit.observe import netcount

EXERCISE, TITLE, POINTS = "7.4", "predict ring attention's bytes per rank, then measure them", 3
LAUNCH_TIMEOUT = 90.0     # seconds: a busy 2-core machine starts 4 ranks slowly
# (cp, b, s, H, Hk, d): chunks of 8-32 KB, so Gloo's headers stay near 1%
BYTES_CASES = [(2, 1, 256, 2, 2, 16), (3, 1, 192, 4, 2, 16), (4, 2, 128, 2, 2, 16)]
BYTES_TOLERANCE = 0.05
_MEASURED: dict = {}   # case -> per-rank results: labkit's run does not depend on fn


def _bytes_job(s, b, H, Hk, d):
    rank, cp, dev = dist.get_rank(), dist.get_world_size(), device()
    n = len(positions(s, rank, cp, "zigzag"))
    q = torch.randn(b, H, n, d, device=dev, requires_grad=True)
    k, v = (torch.randn(b, Hk, n, d, device=dev, requires_grad=True) for _ in range(2))
    dist.barrier()
    with netcount.socket_bytes() as wire:
        ring_attention(q, k, v, None, "zigzag", seq_len=s).sum().backward()
    return {"sent": wire.sent, "reason": wire.reason}


def bytes_mistakes(cp: int, H: int, Hk: int) -> list:
    """(predicted / measured, hint) of the known wrong answers."""
    fwd, bwd = cp - 1, (cp - 1) + cp                          # in K/V chunk pairs
    hops = ("Backward: K/V travel again (cp - 1 hops), and the dK/dV accumulators travel with "
            "them: how many hops until each is home with its owner?")
    both = "Do you count K and V (two tensors), and only what this rank sends?"
    return ([(fwd / (fwd + bwd), "Forward only? Backward sends K and V round the ring again, and "
                                 "dK/dV too."),
             (2 * (cp - 1) / (fwd + bwd), hops), ((2 * cp - 1) / (fwd + bwd), hops)]
            + ([(H / Hk, "k and v have Hk heads here, fewer than q's H: which heads travel?")]
               if Hk != H else [])
            + [(0.5, both), (2.0, both)])


BYTES_DEFAULT = ("How many bytes is one rank's K and V chunk (b, s/cp tokens, Hk heads of d, 4 "
                 "bytes), and how many hops does each pass make in forward and in backward?")


@graded("7.4")
def ring_bytes(fn):
    """Exercise 7.4: fn(b, s, H, Hk, d, cp, bytes_per_element) -> bytes one rank sends in one
    forward + backward of ring attention (zig-zag layout)."""

    c = Checker(EXERCISE, TITLE, POINTS)
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
                     f"({got / measured:.2f}x). " + diagnose(
                         got / measured, bytes_mistakes(cp, H, Hk), BYTES_DEFAULT, BYTES_TOLERANCE))
    return c.finish()
