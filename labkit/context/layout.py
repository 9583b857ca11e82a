"""Which tokens each context-parallel rank holds, and how much causal attention work that gives it.

    from labkit.context.layout import positions, split_sequence, causal_work
    positions(T=16, rank=1, cp=4, layout="zigzag")   # tensor([2, 3, 12, 13])
    causal_work(T=4096, cp=4, layout="plain")        # score entries per rank: rank 3 has 7x rank 0

Causal attention makes the sequence's tail expensive: the query at position i sees i + 1 keys.
Cut the sequence into cp contiguous pieces ("plain") and the last rank does about 2cp - 1 times
the first rank's work, while every rank waits for the slowest at each ring step. The zig-zag
layout (used by Megatron-LM's context parallelism and by zig-zag ring attention) cuts it into
2cp chunks and gives rank r chunks r and 2cp - 1 - r: a cheap chunk from the front and an
expensive one from the back, the same total on every rank.

"plain" allows any T (the first T % cp ranks hold one token more); "zigzag" needs T % (2 cp) == 0.
"""
from __future__ import annotations

import torch

from labkit.context.tiled import _tiles, _visible  # the same rule the tiles use
from labkit.shard import even_bounds

LAYOUTS = ("plain", "zigzag")


def check_layout(T: int, cp: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if cp < 1:
        raise ValueError(f"cp={cp} must be at least 1")
    if layout == "zigzag" and T % (2 * cp):
        n = 2 * cp
        lo, hi = (T // n) * n, (T // n + 1) * n
        raise ValueError(f"the zig-zag layout cuts the sequence into 2*cp = {n} chunks: sequence "
                         f"length T={T} is not divisible by 2*cp={n} (cp={cp}); use T a multiple "
                         f"of {n} (e.g. {lo or hi} or {hi}) or layout='plain'")
    if layout == "plain" and T < cp:
        raise ValueError(f"sequence length T={T} is shorter than cp={cp}: a rank would hold no "
                         "tokens")


def positions(T: int, rank: int, cp: int, layout: str = "zigzag", device=None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` holds, in the order it holds them. (T_r,)"""
    check_layout(T, cp, layout)
    if layout == "plain":
        return torch.arange(*even_bounds(T, cp, rank), device=device)
    c = T // (2 * cp)
    front, back = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(front, front + c, device=device),
                      torch.arange(back, back + c, device=device)])


def sizes(T: int, cp: int, layout: str = "zigzag") -> list:
    """Tokens per rank."""
    return [len(positions(T, r, cp, layout)) for r in range(cp)]


def split_sequence(x: torch.Tensor, rank: int, cp: int, layout: str = "zigzag",
                   dim: int = 2) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (dim: the sequence dimension)."""
    pos = positions(x.shape[dim], rank, cp, layout, device=x.device)
    return x.index_select(dim, pos)


def causal_work(T: int, cp: int, layout: str = "zigzag") -> list:
    """Per rank: (query, key) pairs causal attention must score, i.e. sum over its queries of
    (position + 1). Multiply by 4 * batch * heads * head_dim for forward FLOPs (two matmuls,
    QK^T and PV, 2 FLOPs per multiply-add)."""
    return [int((positions(T, r, cp, layout) + 1).sum()) for r in range(cp)]


def computed_work(T: int, cp: int, layout: str = "zigzag", block: int = 64) -> list:
    """Per rank: score entries ring attention actually computes with (block x block) tiles: a
    tile with any visible pair is computed whole (masked after), a tile entirely in the future
    is skipped. Approaches causal_work as block shrinks; the zig-zag balance holds for both."""
    pos = [positions(T, r, cp, layout) for r in range(cp)]
    work = []
    for r in range(cp):
        n = 0
        for src in range(cp):
            for qa, qb in _tiles(len(pos[r]), block):
                for ka, kb in _tiles(len(pos[src]), block):
                    if _visible(pos[r][qa:qb], pos[src][ka:kb]) != "none":
                        n += (qb - qa) * (kb - ka)
        work.append(n)
    return work


def attention_flops(T: int, cp: int, layout: str = "zigzag", batch: int = 1, heads: int = 1,
                    head_dim: int = 64) -> list:
    """Forward attention-core FLOPs per rank (unmasked score entries only)."""
    return [4 * batch * heads * head_dim * w for w in causal_work(T, cp, layout)]


def imbalance(work: list) -> float:
    """max / mean: 1.0 is perfectly balanced; the step waits for the max."""
    return max(work) / (sum(work) / len(work))
