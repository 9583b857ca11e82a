"""Bytes one training step hands to collectives, per mesh dimension, for a DP x TP x PP plan of
the book's GPT (labkit.model): the prediction labkit.parallel's logged calls are checked against.

    from labkit.costs import parallel as pc
    pc.step_payload(cfg, dp=2, tp=2, pp=2, zero=1, batch=8, stage=0, replica=0)
    # {'tp': ..., 'pp': ..., 'dp': ...}   payload bytes (see observe.commlog) this rank hands over
    pc.wire_bytes(cfg, ...)             # what a ring algorithm then sends per rank

Pure arithmetic on the config; no torch.distributed. Every term, per rank and per step, fp32
(4 bytes per element), rows = this replica's rows of the global batch, T = block_size:
  tp   each block on this stage: g after attention and g after the MLP (forward), f before each
       (backward): 4 all-reduces of rows*T*h elements (ZeRO-3 recomputes each block's forward in
       backward: 2 more)
  pp   stage s sends its output forward (s < P-1) and its input's gradient backward (s > 0):
       rows*T*h each way over the K micro-batches; the first and last stage swap the tied
       embedding's gradient (V*h)
  dp   over the stage's own parameter elements Psi (TP shards counted as this rank holds them),
       each padded to a multiple of dp: ZeRO-0 all-reduces Psi; ZeRO-1 and -2 reduce-scatter Psi
       and all-gather Psi; ZeRO-3 all-gathers Psi twice (forward, backward) and reduce-scatters
       it once
"""
from __future__ import annotations

import math

from labkit.shard import even_sizes

BYTES = 4  # fp32


def split_blocks(n_layer: int, pp: int) -> list:
    """Blocks per stage: contiguous, earlier stages get the extra (labkit.pipeline's rule, the
    one even split of labkit.shard)."""
    return even_sizes(n_layer, pp)


def rows_of(batch: int, dp: int, replica: int) -> int:
    """Rows of replica `replica` (labkit.model.shard_rows: the first batch % dp get one more)."""
    return even_sizes(batch, dp)[replica]


def stage_param_numels(cfg, tp: int = 1, pp: int = 1, stage: int = 0) -> list:
    """Element counts of the parameters this (tp shard, pp stage) rank holds, one per tensor."""
    h, kv, d, f = cfg.n_embd, cfg.kv_heads, cfg.head_dim, cfg.ffn_mult * cfg.n_embd
    b = 1 if cfg.bias else 0
    ln = [h, h] if cfg.bias else [h]
    block = (ln + [h * h // tp, b * h // tp] + [h * kv * d // tp, b * kv * d // tp] * 2
             + [h * h // tp, b * h] + ln + [h * f // tp, b * f // tp, f * h // tp, b * h])
    out = []
    first, last = stage == 0, stage == pp - 1
    if first:
        out += [cfg.vocab_size * h, cfg.block_size * h]          # wte, wpe
    out += block * split_blocks(cfg.n_layer, pp)[stage]
    if last:
        out += ln                                                # ln_f
        if not (cfg.tie_weights and first):
            out += [cfg.vocab_size * h]                          # lm_head (or the tied wte copy)
    return [n for n in out if n]


def padded(numel: int, dp: int) -> int:
    return math.ceil(numel / dp) * dp


def step_payload(cfg, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0,
                 sp: bool = False, batch: int = 8, stage: int = 0, replica: int = 0,
                 cp_rank: int = 0, cp_sizes: list | None = None) -> dict:
    """{'tp', 'pp', 'dp', 'cp'}: payload bytes this rank hands to collectives in one step (pp,
    cp: what it sends). Under cp > 1 the gradient averaging runs over dp x cp ("dp" here, logged
    as "dp_cp"). The loss's own tiny all-reduce/broadcast is left out.

    sp (Megatron sequence parallelism, labkit.context.apply_sp) per block: forward 2 all-gathers
    and 2 reduce-scatters of the whole activation, backward the same plus 2 all-gathers again
    (the column inputs are re-gathered, not kept); once per step the sequence is gathered before
    the final norm and (backward) after the embedding; and the parameters used on sequence
    chunks (norm weights and biases, row-parallel biases) all-reduce their gradients (f).
    cp ring (labkit.context.ring_attention) per block: the K and V chunks (2*rows*n*kv/tp
    elements for n tokens) travel cp-1 hops forward and again backward, and the dK, dV
    accumulators cp hops (every chunk once: T tokens); once per step the hidden states are
    all-gathered before the final norm (each rank's piece padded to the longest: cp*max(n)).
    cp_sizes: the tokens each cp rank holds (labkit.context.layout.sizes; equal by default)."""
    rows, T, h = rows_of(batch, dp, replica), cfg.block_size, cfg.n_embd
    act = rows * T * h * BYTES                                   # one (rows, T, h) activation
    blocks = split_blocks(cfg.n_layer, pp)[stage]
    out = {"tp": 0, "pp": 0, "dp": 0, "cp": 0}
    if tp > 1 and sp:
        chunked = (6 if cfg.bias else 2) * h                    # ln_1, ln_2, o_proj/proj biases
        out["tp"] = (10 * blocks + 2) * act + blocks * chunked * BYTES
    elif tp > 1:                                                 # on this rank's T/cp tokens
        out["tp"] = (4 + (2 if zero == 3 and dp > 1 else 0)) * blocks * act // cp
    if cp > 1:
        n = cp_sizes or [T // cp] * cp
        kv = cfg.kv_heads * cfg.head_dim // tp
        per_token = 2 * rows * kv * BYTES                         # K and V of one position
        passed = sum(n[(cp_rank - i) % cp] for i in range(cp - 1))
        out["cp"] = blocks * (2 * passed + T) * per_token + cp * max(n) * rows * h * BYTES
    if pp > 1:
        out["pp"] = ((stage < pp - 1) + (stage > 0)) * act
        if cfg.tie_weights and stage in (0, pp - 1):
            out["pp"] += cfg.vocab_size * h * BYTES
    n = dp * cp                                                  # ranks gradients average over
    if n > 1:
        numels = stage_param_numels(cfg, tp, pp, stage)
        if zero == 0:
            psi = sum(numels)                                    # one flat all-reduce
            out["dp"] = psi * BYTES
        else:
            psi = sum(padded(k, n) for k in numels)
            out["dp"] = (2 if zero in (1, 2) else 3) * psi * BYTES
    return out


def wire_bytes(cfg, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0,
               sp: bool = False, batch: int = 8, stage: int = 0, replica: int = 0,
               cp_rank: int = 0, cp_sizes: list | None = None) -> dict:
    """{'tp', 'pp', 'dp', 'cp'}: bytes this rank sends on the wire with ring collectives: an
    all-reduce sends 2(n-1)/n of its payload, a reduce-scatter or all-gather (n-1)/n, a send all
    of it. (Under sp the tp payload is all-gathers and reduce-scatters: (n-1)/n of it.)"""
    pay = step_payload(cfg, dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, sp=sp, batch=batch,
                       stage=stage, replica=replica, cp_rank=cp_rank, cp_sizes=cp_sizes)
    n = dp * cp
    gathered = cp * max(cp_sizes or [cfg.block_size // cp]) * rows_of(batch, dp, replica) \
        * cfg.n_embd * BYTES                                     # the all-gather's payload
    return {"tp": pay["tp"] * (1 if sp else 2) * (tp - 1) / tp if tp > 1 else 0.0,
            "pp": float(pay["pp"]),
            "dp": pay["dp"] * (2 if zero == 0 else 1) * (n - 1) / n if n > 1 else 0.0,
            "cp": pay["cp"] - gathered / cp if cp > 1 else 0.0}
