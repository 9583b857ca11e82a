"""Context parallelism: causal attention with the sequence split over a `cp` group.

    from labkit.context.ring_attention import ring_attention, all_gather_kv_attention
    from labkit.context.layout import split_sequence
    q_r = split_sequence(q, rank, cp, "zigzag")          # (B, H, T/cp, d), likewise k_r, v_r
    y_r = ring_attention(q_r, k_r, v_r, group)           # this rank's rows of causal attention

Every other part of a transformer layer works token by token, so splitting the sequence over cp
ranks splits its work and its activations cp ways; attention is the exception: a query needs
every earlier key. Two ways to bring them:

  all_gather_kv_attention (the naive one, as Llama 3 does it): all-gather K and V, attend, and
      reduce-scatter dK and dV in backward. Simple; each rank holds the whole K and V for the
      layer (saved for backward here), cp times its share.
  ring_attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023): each rank keeps
      its queries, and K/V chunks travel one hop round the ring per step, cp - 1 hops in all; the
      next chunk is posted (labkit.collectives.exchange) before the current one is computed, so
      the transfer hides behind the block's compute. Each block gives a partial output and
      log-sum-exp, merged as they come (labkit.context.tiled.merge_partials). Backward is a ring
      too: K/V travel again, and each chunk's dK/dV accumulators travel with them, collecting
      every rank's contribution, with one last hop home (cp hops of dK/dV). A rank never holds
      more than two K/V chunks (and, in backward, two dK/dV accumulators).

Causal masking is per block, by global positions: a block entirely in the future is skipped,
which is what makes the plain split unbalanced and the zig-zag one balanced
(labkit.context.layout). k and v may have fewer heads than q (grouped-query attention: Hk
dividing H); they travel and are saved unrepeated, so the bytes are those of the Hk heads
(labkit.costs.context counts kv = Hk * d). Both functions use
labkit.context.tiled's online softmax inside each block, so the (T, T) scores never exist either.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.collectives import exchange
from labkit.context.layout import check_layout, positions, sizes
from labkit.context.tiled import BLOCK, attend, attend_backward, merge_partials, tiled_attention
from labkit.flat import all_gather_flat, reduce_scatter_sum

TAG_K, TAG_V, TAG_DK, TAG_DV = 1, 2, 3, 4


def _wait(works):
    for w in works:
        w.wait()


def _pass_on(send: list, recv: list, rank: int, cp: int, group, tags, where: str):
    """Post: send each of `send` to the right neighbour, receive each of `recv` from the left."""
    right, left = (rank + 1) % cp, (rank - 1) % cp
    ops = [(dist.irecv, t, left, group, tag) for t, tag in zip(recv, tags)]
    ops += [(dist.isend, t, right, group, tag) for t, tag in zip(send, tags)]
    return exchange(ops, where=where)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, T, layout, block):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        pos = [positions(T, r, cp, layout) for r in range(cp)]  # cpu: they pick tiles
        B, H, _, d = k.shape
        out = lse = None
        cur_k, cur_v = k, v                                  # (B, H, T_src, d)
        for s in range(cp):
            src = (rank - s) % cp                            # whose chunk this rank holds now
            if s < cp - 1:                                   # post the next hop first: overlap
                n = len(pos[(src - 1) % cp])
                nk, nv = k.new_empty(B, H, n, d), v.new_empty(B, H, n, v.shape[-1])
                works = _pass_on([cur_k, cur_v], [nk, nv], rank, cp, group, (TAG_K, TAG_V),
                                 "ring attention k/v")
            o, o_lse = attend(q, cur_k, cur_v, pos[rank], pos[src], block=block)
            # o (B, H, Tq, d), o_lse (B, H, Tq): this hop's partial, merged by its log-sum-exp
            out, lse = (o, o_lse) if out is None else merge_partials(out, lse, o, o_lse)
            if s < cp - 1:
                _wait(works)
                cur_k, cur_v = nk, nv
        ctx.save_for_backward(q, k, v, out, lse)             # own chunks only
        ctx.group, ctx.T, ctx.layout, ctx.block = group, T, layout, block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, dout = ctx.group, dout.contiguous()
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        pos = [positions(ctx.T, r, cp, ctx.layout) for r in range(cp)]
        B, H, _, d = k.shape
        dq = torch.zeros_like(q)
        cur_k, cur_v = k, v
        pending = None                                       # dK/dV accumulators in flight
        for s in range(cp):
            src = (rank - s) % cp
            if s < cp - 1:
                n = len(pos[(src - 1) % cp])
                nk, nv = k.new_empty(B, H, n, d), v.new_empty(B, H, n, v.shape[-1])
                kv_works = _pass_on([cur_k, cur_v], [nk, nv], rank, cp, group, (TAG_K, TAG_V),
                                    "ring attention backward k/v")
            dq_s, dk_s, dv_s = attend_backward(q, cur_k, cur_v, out, lse, dout, pos[rank],
                                               pos[src], block=ctx.block)
            dq += dq_s
            if pending is not None:                          # chunk src's sums from ranks before
                works, (rdk, rdv) = pending
                _wait(works)
                dk_s, dv_s = dk_s + rdk, dv_s + rdv
            n = len(pos[(src - 1) % cp])
            rdk, rdv = k.new_empty(B, H, n, d), v.new_empty(B, H, n, v.shape[-1])
            pending = (_pass_on([dk_s, dv_s], [rdk, rdv], rank, cp, group, (TAG_DK, TAG_DV),
                                "ring attention dk/dv"), (rdk, rdv))
            if s < cp - 1:
                _wait(kv_works)
                cur_k, cur_v = nk, nv
        works, (dk, dv) = pending                            # the last hop brings our own home
        _wait(works)
        return dq, dk, dv, None, None, None, None


def _pad_to(t, n):                                           # (B, H, m, d) -> (B, H, n, d)
    return torch.nn.functional.pad(t, (0, 0, 0, n - t.shape[2]))


def _pack(k, v, m):
    """k (B, H, n, dk) and v (B, H, n, dv), each padded to m tokens, flat in one buffer: one
    all-gather for both, whatever their head sizes (stacking them would need dk == dv)."""
    return torch.cat([_pad_to(k, m).reshape(-1), _pad_to(v, m).reshape(-1)])


def _unpack(flat, B, H, m, dk, dv, n):
    """_pack's inverse, cut back to the n real tokens: (B, H, n, dk), (B, H, n, dv)."""
    cut = B * H * m * dk
    return (flat[:cut].view(B, H, m, dk)[:, :, :n], flat[cut:].view(B, H, m, dv)[:, :, :n])


class _AllGatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, T, layout, block):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        n = sizes(T, cp, layout)
        m = max(n)                                           # pad: equal pieces for all-gather
        B, H, _, dk = k.shape
        dv = v.shape[-1]
        mine = _pack(k, v, m)                                # (B*H*m*(dk+dv),)
        flat = all_gather_flat(mine, group, "all-gather k/v").view(cp, -1)  # (cp, B*H*m*(dk+dv))
        pieces = [_unpack(flat[r], B, H, m, dk, dv, n[r]) for r in range(cp)]
        K = torch.cat([kr for kr, _ in pieces], dim=2)       # (B, H, T, dk) rank order
        V = torch.cat([vr for _, vr in pieces], dim=2)       # (B, H, T, dv)
        k_pos = torch.cat([positions(T, r, cp, layout) for r in range(cp)])  # cpu
        q_pos = positions(T, rank, cp, layout)
        out, lse = attend(q, K, V, q_pos, k_pos, block=block)
        ctx.save_for_backward(q, K, V, out, lse)             # the whole K and V: cp x the ring's
        ctx.group, ctx.n, ctx.m, ctx.block = group, n, m, block
        ctx.pos = (q_pos, k_pos)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, K, V, out, lse = ctx.saved_tensors
        group, n, m = ctx.group, ctx.n, ctx.m
        rank = dist.get_rank(group)
        dq, dK, dV = attend_backward(q, K, V, out, lse, dout.contiguous(), *ctx.pos,
                                     block=ctx.block)
        # every owner's piece of dK and dV, padded and packed as forward packed them
        both = torch.stack([_pack(a, b, m) for a, b in zip(dK.split(n, dim=2),
                                                           dV.split(n, dim=2))])  # (cp, L)
        mine = reduce_scatter_sum(both.reshape(-1), group, "reduce-scatter dk/dv")  # (L,) summed
        B, H, _, dk = K.shape
        dk_mine, dv_mine = _unpack(mine, B, H, m, dk, V.shape[-1], n[rank])
        return dq, dk_mine, dv_mine, None, None, None, None


def _prepare(q, k, v, group, layout, seq_len):
    if not (q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1:3] == v.shape[1:3]
            and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need the "
                         "same batch, k and v the same heads and length, k's heads dividing q's")
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    T = seq_len if seq_len is not None else q.shape[2] * cp
    check_layout(T, cp, layout)
    want = len(positions(T, rank, cp, layout))
    if q.shape[2] != want or k.shape[2] != want:
        raise ValueError(f"rank {rank} of cp={cp} should hold {want} of T={T} tokens "
                         f"({layout} layout) but q has {q.shape[2]}, k {k.shape[2]}; for a plain "
                         "split T does not divide, pass seq_len")
    return T, [t.contiguous() for t in (q, k, v)]


def ring_attention(q, k, v, group=None, layout: str = "zigzag", seq_len: int | None = None,
                   block: int = BLOCK):
    """Causal attention of this rank's queries (B, H, T_local, d) over the whole sequence, with
    K/V passed round the ring. layout: how the sequence was split (labkit.context.layout);
    seq_len: the whole T (default T_local * cp)."""
    T, (q, k, v) = _prepare(q, k, v, group, layout, seq_len)
    if dist.get_world_size(group) == 1:
        return tiled_attention(q, k, v, block=block)
    return _RingAttention.apply(q, k, v, group, T, layout, block)


def all_gather_kv_attention(q, k, v, group=None, layout: str = "zigzag",
                            seq_len: int | None = None, block: int = BLOCK):
    """The same result with K and V all-gathered first (the naive version, Llama 3 style)."""
    T, (q, k, v) = _prepare(q, k, v, group, layout, seq_len)
    return _AllGatherKV.apply(q, k, v, group, T, layout, block)
