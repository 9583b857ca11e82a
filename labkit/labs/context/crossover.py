"""Measure where ring attention turns communication-bound: the pieces of costs.hiding.cp, on
real ranks.

Each hop of ring attention (labkit.context.ring_attention) sends this rank's K and V chunk to the
next rank, 2 c kv e bytes for c = s / cp tokens per rank, while the rank computes the block of
attention it already holds: 4 c^2 h FLOPs for a block whose keys all precede its queries (b = 1).
Rank side (call inside labkit.launch.run, every rank at once):

  block_seconds  the block, with the ring's own kernel (labkit.context.tiled.attend), unmasked
  hop_times      one hop alone: K and V sent right and received from the left
                 (labkit.collectives.exchange, as the ring posts them), over sizes
  sweep          both per chunk c, in interleaved rounds, plus ring_attention's forward itself
                 under labkit.observe.commlog: the time its wait for the next K/V blocked (the
                 exposed part of the hop; at cp = 2 the hop runs under the causal diagonal block,
                 half the full block's FLOPs)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.collectives import exchange
from labkit.context.ring_attention import ring_attention
from labkit.context.tiled import attend
from labkit.launch import device
from labkit.observe import commlog
from labkit.timing import now

WHERE = "ring attention k/v"        # ring_attention's label for its forward K/V hops


def block_flops(c: int, heads: int, head_dim: int) -> int:
    """FLOPs of one unmasked (c, c) block: QK^T and PV, 2 c^2 h each, h = heads * head_dim."""
    return 4 * c * c * heads * head_dim


def hop_bytes(c: int, kv_heads: int, head_dim: int, elem: int = 4) -> int:
    """Bytes one rank sends per hop: its K and V chunk, 2 c kv e with kv = kv_heads * head_dim."""
    return 2 * c * kv_heads * head_dim * elem


def _qkv(c: int, heads: int, head_dim: int, kv_heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)      # drawn on the CPU: the same on any device
    q = torch.randn(1, heads, c, head_dim, generator=g)         # cpu: moved below; (1, H, c, d)
    kv = [torch.randn(1, kv_heads, c, head_dim, generator=g)    # cpu: moved below; (1, Hk, c, d)
          for _ in "kv"]
    return [t.to(device()) for t in (q, *kv)]


def block_seconds(q, k, v) -> float:
    """Seconds of one block of attention with every key before every query (nothing masked)."""
    c = q.shape[2]
    q_pos, k_pos = torch.arange(c, 2 * c), torch.arange(c)                  # cpu: they pick tiles
    start = now(q.device)
    attend(q, k, v, q_pos, k_pos)                                   # (1, H, c, d), (1, H, c)
    return now(q.device) - start


def _hop(k, v, group, calls: int = 1) -> float:
    """Seconds of one hop, the mean of `calls` back to back after a barrier (so that one late
    wake-up of a process on a busy machine is diluted, as labkit.labs.intro does)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    nk, nv = torch.empty_like(k), torch.empty_like(v)
    dist.barrier(group)
    start = now(k.device)
    for _ in range(calls):
        works = exchange([(dist.irecv, nk, (rank - 1) % cp, group, 1),
                          (dist.irecv, nv, (rank - 1) % cp, group, 2),
                          (dist.isend, k, (rank + 1) % cp, group, 1),
                          (dist.isend, v, (rank + 1) % cp, group, 2)], where="hop timing")
        for w in works:
            w.wait()
    return (now(k.device) - start) / calls


def _calls(numel: int) -> int:
    return 4 if 8 * numel < 2**20 else 1                                    # K + V under 1 MiB


def hop_times(numels, repeats: int = 5, group=None) -> list:
    """For each numel, `repeats` seconds of one hop moving K and V of `numel` float32 values each
    (after one warm-up hop): [[seconds] per numel]."""
    out = []
    for numel in numels:
        k, v = (torch.ones(numel, device=device()) for _ in "kv")
        _hop(k, v, group)
        out.append([_hop(k, v, group, _calls(numel)) for _ in range(repeats)])
    return out


def _ring_wait(q, k, v, group) -> tuple:
    """ring_attention's forward on this rank's chunks: (seconds, seconds its K/V waits blocked)."""
    dist.barrier(group)
    with commlog.record() as log:
        start = now(q.device)
        ring_attention(q, k, v, group, layout="plain")                        # (1, H, c, d)
        took = now(q.device) - start
    return took, sum(e.blocked for e in log.select(op="recv", where=WHERE))


def sweep(chunks, heads: int, head_dim: int, kv_heads: int, rounds: int = 3,
          group=None) -> dict:
    """Per tokens per rank c: the block alone, one hop alone, and ring_attention's forward (its
    time and its blocked wait), one of each per round, chunks rotated across rounds.
    {c: {"block": [s], "hop": [s], "ring": [s], "wait": [s]}}."""
    rank = dist.get_rank(group)
    data = {c: _qkv(c, heads, head_dim, kv_heads, seed=rank) for c in chunks}
    out = {c: {"block": [], "hop": [], "ring": [], "wait": []} for c in chunks}
    order = list(chunks)
    for c in order:                                                         # warm-up
        block_seconds(*data[c])
        _ring_wait(*data[c], group)
    for r in range(rounds):
        for c in order[r % len(order):] + order[:r % len(order)]:
            q, k, v = data[c]
            dist.barrier(group)
            out[c]["block"].append(block_seconds(q, k, v))
            out[c]["hop"].append(_hop(k, v, group, _calls(k.numel())))
            ring, wait = _ring_wait(q, k, v, group)
            out[c]["ring"].append(ring)
            out[c]["wait"].append(wait)
    return out
