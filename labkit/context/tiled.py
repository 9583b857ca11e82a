"""FlashAttention's algorithm in plain torch: attention over key/value tiles with an online softmax.

    from labkit.context.tiled import tiled_attention, merge_partials, saved_bytes_table
    y = tiled_attention(q, k, v)            # (B, H, T, d), equal to causal softmax attention
    saved_bytes_table([256, 512, 1024])     # rows (T, naive bytes, tiled bytes, sdpa bytes)

Softmax attention materialises the (T, T) scores and keeps the probabilities for backward: its
saved bytes grow with T^2. FlashAttention (Dao et al., 2022; FlashAttention-2, Dao 2023) never
holds more than one (q tile, k tile) block: for each query row it keeps a running maximum m, a
running sum l (rowsum) of exp(s - m), and an accumulator of exp(s - m) @ V, rescaling both by
exp(m_old - m_new) whenever the maximum grows. At the end out = acc / l, and the log-sum-exp
lse = m + log l is all backward needs to rebuild any block's probabilities: P = exp(S - lse).
Backward recomputes S tile by tile (FlashAttention-2): with D = rowsum(dO * O),

    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ += dS K * scale,   dK += dS^T Q * scale.

Forward saves q, k, v, out and lse (B, H, T): bytes linear in T. The price is a second S = Q K^T
in backward (compute traded for memory, like recomputation). This is the algorithm, not the
kernel: here each tile is a torch op, so it is slower than F.scaled_dot_product_attention;
the speed of the real kernel comes from keeping tiles in on-chip SRAM, which needs a GPU kernel.

`attend` and `attend_backward` work on any set of query and key positions (a causal mask from
positions), so ring attention (labkit.context.ring_attention) reuses them per block and merges
the blocks with `merge_partials`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from labkit.observe.saved import SavedTensors

BLOCK = 64  # tile edge (queries and keys); any size gives the same result up to rounding


def _tiles(n: int, block: int):
    return [(a, min(a + block, n)) for a in range(0, n, block)]


def _mask(q_pos, k_pos, device):
    """(Tq, Tk) True where key position <= query position (causal), on `device`."""
    return (k_pos[None, :] <= q_pos[:, None]).to(device)


def _cpu(pos):
    """Positions decide which tiles to skip: keep them on the CPU (no GPU sync per tile)."""
    return None if pos is None else pos.cpu()


def _visible(q_pos, k_pos) -> str:
    """'none', 'all' or 'some' keys of this tile are visible to its queries (causal)."""
    if q_pos is None:
        return "all"
    if k_pos.min() > q_pos.max():
        return "none"
    return "all" if k_pos.max() <= q_pos.min() else "some"


def _repeat_kv(q, k, v):
    """Grouped-query attention: each of k's Hk heads serves H/Hk query heads (repeated here, in
    a temporary, so that what is saved and sent stays the Hk heads)."""
    H, Hk = q.shape[1], k.shape[1]
    if H % Hk:
        raise ValueError(f"q has {H} heads, k and v {Hk}: {Hk} must divide {H}")
    if H == Hk:
        return k, v
    return k.repeat_interleave(H // Hk, dim=1), v.repeat_interleave(H // Hk, dim=1)


def attend(q, k, v, q_pos=None, k_pos=None, scale=None, block: int = BLOCK):
    """Attention of q over (k, v) with an online softmax over key tiles.

    q (B, H, Tq, d), k and v (B, Hk, Tk, d) with Hk dividing H (grouped-query); q_pos (Tq,),
    k_pos (Tk,) integer positions for a causal mask (None: no mask). Returns out (B, H, Tq, d)
    and lse (B, H, Tq), fp32 statistics; a query that sees no key gets out = 0 and lse = -inf
    (merge_partials treats it as empty)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_pos, k_pos = _cpu(q_pos), _cpu(k_pos)
    k, v = _repeat_kv(q, k, v)                               # (B, H, Tk, d)
    B, H, Tq, d = q.shape
    out = q.new_zeros(B, H, Tq, v.shape[-1])                 # (B, H, Tq, d)
    lse = q.new_full((B, H, Tq), -math.inf)                  # (B, H, Tq)
    for qa, qb in _tiles(Tq, block):
        qp = None if q_pos is None else q_pos[qa:qb]
        m = q.new_full((B, H, qb - qa), -math.inf)           # running max   (B, H, bq)
        rowsum = q.new_zeros(B, H, qb - qa)                  # running sum   (B, H, bq)
        acc = q.new_zeros(B, H, qb - qa, v.shape[-1])        # accumulator   (B, H, bq, d)
        for ka, kb in _tiles(k.shape[2], block):
            kp = None if k_pos is None else k_pos[ka:kb]
            seen = _visible(qp, kp)
            if seen == "none":
                continue  # the tile lies above the diagonal: skipped, never computed
            s = q[:, :, qa:qb] @ k[:, :, ka:kb].transpose(-1, -2) * scale  # (B, H, bq, bk)
            if seen == "some":
                s = s.masked_fill(~_mask(qp, kp, s.device), -math.inf)
            m_new = torch.maximum(m, s.amax(-1))             # (B, H, bq)
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)  # rows with no key yet
            p = torch.exp(s - m_safe[..., None])             # (B, H, bq, bk)
            alpha = torch.exp(m - m_safe)                    # rescales what came before
            rowsum = alpha * rowsum + p.sum(-1)
            acc = alpha[..., None] * acc + p @ v[:, :, ka:kb]
            m = m_new
        seen_any = rowsum > 0
        denom = torch.where(seen_any, rowsum, 1.0)          # (B, H, bq); 1 where nothing seen
        out[:, :, qa:qb] = acc / denom[..., None]
        lse[:, :, qa:qb] = torch.where(seen_any, m + torch.log(denom), -math.inf)
    return out, lse


def attend_backward(q, k, v, out, lse, dout, q_pos=None, k_pos=None, scale=None,
                    block: int = BLOCK):
    """FlashAttention-2 backward of `attend`, recomputing each tile's probabilities from lse.

    out and lse are the FINAL ones (after any merge), so the same call gives one block's share of
    dq and the full dk, dv of that block (ring attention sums the shares). Returns dq, dk, dv."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q_pos, k_pos = _cpu(q_pos), _cpu(k_pos)
    Hk = k.shape[1]
    k, v = _repeat_kv(q, k, v)                               # (B, H, Tk, d)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    D = (dout * out).sum(-1)                                 # (B, H, Tq)
    lse_safe = torch.where(lse == -math.inf, math.inf, lse)  # a row that saw nothing: P = 0
    for qa, qb in _tiles(q.shape[2], block):
        qp = None if q_pos is None else q_pos[qa:qb]
        for ka, kb in _tiles(k.shape[2], block):
            kp = None if k_pos is None else k_pos[ka:kb]
            seen = _visible(qp, kp)
            if seen == "none":
                continue
            qt, kt, vt, dot = q[:, :, qa:qb], k[:, :, ka:kb], v[:, :, ka:kb], dout[:, :, qa:qb]
            s = qt @ kt.transpose(-1, -2) * scale            # (B, H, bq, bk) recomputed
            if seen == "some":
                s = s.masked_fill(~_mask(qp, kp, s.device), -math.inf)
            p = torch.exp(s - lse_safe[:, :, qa:qb, None])   # (B, H, bq, bk)
            dv[:, :, ka:kb] += p.transpose(-1, -2) @ dot     # (B, H, bk, d)
            dp = dot @ vt.transpose(-1, -2)                  # (B, H, bq, bk)
            ds = p * (dp - D[:, :, qa:qb, None])             # (B, H, bq, bk)
            dq[:, :, qa:qb] += ds @ kt * scale
            dk[:, :, ka:kb] += ds.transpose(-1, -2) @ qt * scale
    if Hk != q.shape[1]:                                     # sum each kv head's query group
        B, H, Tk, d = dk.shape
        dk = dk.view(B, Hk, H // Hk, Tk, d).sum(2)           # (B, Hk, Tk, d)
        dv = dv.view(B, Hk, H // Hk, Tk, -1).sum(2)
    return dq, dk, dv


def merge_partials(out1, lse1, out2, lse2):
    """Attention over keys A and over keys B -> attention over A and B (the log-sum-exp merge).

    out_i (B, H, T, d) is softmax-weighted over its keys, lse_i (B, H, T) the log of its softmax
    denominator. The union's denominator is exp(lse1) + exp(lse2), so lse = logaddexp(lse1,
    lse2) and out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2. An empty side (lse = -inf) gets
    weight 0; both empty gives out = 0, lse = -inf."""
    lse = torch.logaddexp(lse1, lse2)                        # (B, H, T)
    safe = torch.where(lse == -math.inf, 0.0, lse)
    w1 = torch.exp(lse1 - safe)[..., None]                   # (B, H, T, 1)
    w2 = torch.exp(lse2 - safe)[..., None]
    return w1 * out1 + w2 * out2, lse


class TiledAttention(torch.autograd.Function):
    """Causal attention whose forward saves q, k, v, out and lse, never the (T, T) probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, block):
        pos = torch.arange(q.shape[2])                      # cpu: positions pick tiles
        out, lse = attend(q, k, v, pos, pos, block=block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        pos = torch.arange(q.shape[2])                      # cpu: positions pick tiles
        dq, dk, dv = attend_backward(q, k, v, out, lse, dout.contiguous(), pos, pos,
                                     block=ctx.block)
        return dq, dk, dv, None


def tiled_attention(q, k, v, block: int = BLOCK):
    """Causal attention by tiles: q (B, H, T, d), k and v (B, Hk, T, d), Hk dividing H; equal
    to F.scaled_dot_product_attention(is_causal=True) on k, v repeated to H heads."""
    _repeat_kv(q, k[:, :, :0], v[:, :, :0])                  # the head check, nothing copied
    return TiledAttention.apply(q, k, v, block)


def naive_attention(q, k, v):
    """Softmax attention written out: the (T, T) scores and probabilities are real tensors."""
    T = q.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])     # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1)  # (B, H, T, T)
    return p @ v                                             # (B, H, T, d)


def saved_bytes(fn, *inputs) -> int:
    """Bytes autograd keeps for backward when running fn(*inputs), counted by a saved-tensor hook
    (each storage once: a tensor saved twice, or q saved as well as passed in, counts once)."""
    with SavedTensors() as saved:
        fn(*inputs)
    return saved.bytes


def saved_bytes_table(lengths=(128, 256, 512, 1024), batch: int = 1, heads: int = 2,
                      head_dim: int = 16, block: int = BLOCK, device=None) -> list:
    """Rows (T, naive softmax attention, tiled attention, torch's F.scaled_dot_product_attention):
    bytes saved for backward, fp32, measured with saved_tensors_hooks."""
    rows = []
    for T in lengths:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(batch, heads, T, head_dim, generator=g).to(device)
                   .requires_grad_() for _ in range(3))
        rows.append((T, saved_bytes(naive_attention, q, k, v),
                     saved_bytes(lambda *a: tiled_attention(*a, block=block), q, k, v),
                     saved_bytes(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True),
                                 q, k, v)))
    return rows


def growth_exponent(lengths, values) -> float:
    """Slope of log(value) against log(T) between the two longest lengths (2: quadratic)."""
    (t1, v1), (t2, v2) = list(zip(lengths, values))[-2:]
    return math.log(v2 / v1) / math.log(t2 / t1)
