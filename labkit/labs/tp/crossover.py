"""Measure where TP turns communication-bound: the pieces of costs.hiding.tp, on real ranks.

Megatron's g all-reduces the (tokens, h) activation twice per layer forward (after attention's
o projection, after the MLP's down projection; f does the same in backward), while one rank's
matmuls of the layer do 2 * 12 h^2 * tokens / tp FLOPs. This module times those matmuls with the
shapes one rank of a TP group holds (rank side: call inside labkit.launch.run, every rank at
once, as TP runs them); the lab times the all-reduces of the same activation
(labkit.labs.intro.all_reduce_times) on the same processes and fits their alpha and bandwidth.

    shapes = layer_shapes(512, tp=2)        # q, k, v, o, MLP up, MLP down: (in, out) per rank
    rows = sweep([64, 128, 256], tokens=1024, rounds=3)   # {h: [seconds per round]}, slowest rank
"""
from __future__ import annotations

import torch.distributed as dist

from labkit import roofline
from labkit.launch import device


def layer_shapes(h: int, tp: int, ffn_mult: int = 4) -> list:
    """(in, out) of one rank's matmuls in a Megatron layer: q, k, v and the MLP's up projection
    column-parallel (out / tp), o and the MLP's down projection row-parallel (in / tp)."""
    if h % tp or (ffn_mult * h) % tp:
        raise ValueError(f"width {h} does not split over tp={tp}: pick a multiple of {tp}")
    f = ffn_mult * h
    return [(h, h // tp)] * 3 + [(h // tp, h), (h, f // tp), (f // tp, h)]


def matmul_flops(h: int, tp: int, tokens: int, ffn_mult: int = 4) -> int:
    """Forward FLOPs of one rank's matmuls (no attention scores: costs.tensor_parallel.layer_flops
    adds them): 2 * (4 + 2 ffn_mult) h^2 * tokens / tp (24 h^2 for
    the GPT's 4h MLP, the 2 * 12 h^2 of costs.hiding.tp)."""
    return sum(2 * tokens * k * n for k, n in layer_shapes(h, tp, ffn_mult))


def sweep(widths, tokens: int, rounds: int = 3, group=None) -> dict:
    """Seconds of one layer's forward matmuls on this rank at each width, one pass per round,
    widths rotated across rounds so drifting load hits every width alike; every pass starts at a
    barrier, so both ranks multiply at once, as under TP. {h: [seconds per round]}."""
    tp = dist.get_world_size(group)
    operands = {h: roofline.matmul_operands(layer_shapes(h, tp), tokens, device())[:2]
                for h in widths}
    out = {h: [] for h in widths}
    order = list(widths)
    for h in order:                                       # warm-up: allocations, thread pools
        roofline.time_matmuls(*operands[h], repeats=1, warmup=0)
    for r in range(rounds):
        for h in order[r % len(order):] + order[:r % len(order)]:
            dist.barrier(group)
            out[h] += roofline.time_matmuls(*operands[h], repeats=1, warmup=0)
    return out


def slowest(per_rank: list, key) -> list:
    """Per round, the slowest rank's seconds (a TP layer waits for its last rank): per_rank is
    every rank's sweep(), key a width."""
    return [max(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key]))]


def activation_numel(h: int, tokens: int) -> int:
    """Elements of the (tokens, h) activation one g all-reduces (float32 here)."""
    return tokens * h

