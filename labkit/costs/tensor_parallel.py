"""Communication and time of Megatron tensor parallelism, per transformer layer. Pure math.

Units: b = micro-batch size (sequences), s = sequence length (tokens), h = hidden size; elements
vs bytes are kept apart (bytes = elements * bytes_per_element, e.g. 2 for bf16, 4 for fp32).

Per layer, with attention and MLP both split Megatron style (column then row):
    forward:  2 all-reduces (g after o_proj, g after the MLP's proj)
    backward: 2 all-reduces (f before q/k/v, f before the MLP's fc)
each of the activations, b*s*h elements -- not the weights (h*h or 4*h*h). On a ring of tp
ranks each all-reduce of D bytes sends 2(tp-1)/tp * D bytes per rank (labkit.costs.comm).

FLOPs of one layer's forward (Megatron-LM / Narayanan et al. 2021): 24*b*s*h^2 + 4*b*s^2*h;
backward is twice the forward. TP divides these by tp, but not the communication: that is why TP
stops scaling, and why it stays on NVLink inside a node.
"""
from __future__ import annotations

from labkit.costs import comm

ALLREDUCES_PER_LAYER = {"forward": 2, "backward": 2}


def allreduce_elements(b: int, s: int, h: int) -> int:
    """Elements in one TP all-reduce: the activations (b, s, h)."""
    return b * s * h


def allreduce_bytes(b: int, s: int, h: int, bytes_per_element: int = 2) -> int:
    """Bytes of the buffer in one TP all-reduce (the D of the alpha-beta model)."""
    return allreduce_elements(b, s, h) * bytes_per_element


def allreduces_per_layer(passes: str = "both") -> int:
    """2 forward + 2 backward; passes is 'forward', 'backward' or 'both'."""
    if passes == "both":
        return sum(ALLREDUCES_PER_LAYER.values())
    if passes not in ALLREDUCES_PER_LAYER:
        raise ValueError(f"passes must be 'forward', 'backward' or 'both', got {passes!r}")
    return ALLREDUCES_PER_LAYER[passes]


def layer_allreduce_bytes(b: int, s: int, h: int, bytes_per_element: int = 2,
                          passes: str = "both") -> int:
    """Sum of the all-reduced buffer sizes (bytes) for one layer: count * b*s*h*bytes."""
    return allreduces_per_layer(passes) * allreduce_bytes(b, s, h, bytes_per_element)


def layer_bytes_sent_per_rank(b: int, s: int, h: int, tp: int, bytes_per_element: int = 2,
                              passes: str = "both") -> float:
    """Bytes each rank sends for one layer over a ring: count * 2(tp-1)/tp * b*s*h*bytes."""
    one = comm.ring_bytes_sent_per_rank("all_reduce",
                                        allreduce_bytes(b, s, h, bytes_per_element), tp)
    return allreduces_per_layer(passes) * one


def weight_elements_per_layer(h: int, ffn_mult: int = 4) -> int:
    """Weights of one layer's matrices (4h^2 attention + 2*ffn_mult*h^2 MLP): what TP does NOT
    send."""
    return 4 * h * h + 2 * ffn_mult * h * h


def layer_flops(b: int, s: int, h: int, passes: str = "both") -> float:
    """FLOPs of one layer (GEMMs + attention scores): forward 24bsh^2 + 4bs^2h, backward 2x."""
    fwd = 24 * b * s * h * h + 4 * b * s * s * h
    return {"forward": fwd, "backward": 2 * fwd, "both": 3 * fwd}[passes]


def layer_comm_time(b: int, s: int, h: int, tp: int, link: comm.Link,
                    bytes_per_element: int = 2, passes: str = "both") -> float:
    """Seconds of TP all-reduces for one layer on `link` (alpha-beta ring model)."""
    one = comm.ring_allreduce_time(allreduce_bytes(b, s, h, bytes_per_element), tp,
                                   link.alpha, link.bandwidth)
    return allreduces_per_layer(passes) * one


def layer_compute_time(b: int, s: int, h: int, tp: int, flops_per_s: float,
                       passes: str = "both") -> float:
    """Seconds of math for this rank's 1/tp of one layer at a sustained `flops_per_s`."""
    return layer_flops(b, s, h, passes) / tp / flops_per_s


def layer_time(b: int, s: int, h: int, tp: int, link: comm.Link, flops_per_s: float,
               bytes_per_element: int = 2, overlap: bool = False) -> dict:
    """Compute, communication and total seconds for one layer (forward + backward).

    Megatron's TP all-reduces sit on the critical path (the next op needs their result), so
    by default they add to compute; overlap=True gives the unreachable ideal max(compute, comm)."""
    c = layer_compute_time(b, s, h, tp, flops_per_s)
    m = layer_comm_time(b, s, h, tp, link, bytes_per_element)
    return {"compute": c, "comm": m, "total": max(c, m) if overlap else c + m,
            "comm_fraction": m / (c + m) if c + m else 0.0}


def tp_speedup(b: int, s: int, h: int, tps, link: comm.Link, flops_per_s: float,
               bytes_per_element: int = 2) -> list:
    """[(tp, speedup over tp=1)] of one layer's time: where adding TP ranks stops paying."""
    base = layer_time(b, s, h, 1, link, flops_per_s, bytes_per_element)["total"]
    return [(tp, base / layer_time(b, s, h, tp, link, flops_per_s, bytes_per_element)["total"])
            for tp in tps]
