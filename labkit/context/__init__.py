"""Sequence and context parallelism, and attention without the T^2 term (chapter 07).

    from labkit.context import tiled_attention, apply_sp, ring_attention, split_sequence
    y = tiled_attention(q, k, v)                     # FlashAttention's algorithm, plain torch
    model = apply_sp(GPT(cfg, seed=0), tp_group)     # Megatron TP + sequence parallelism
    y_r = ring_attention(q_r, k_r, v_r, cp_group)    # this rank's rows; K/V round the ring

Modules, one idea each:
    tiled              online-softmax attention over tiles (forward and FlashAttention-2 backward),
                       the log-sum-exp merge, saved-bytes measurement
    sequence_parallel  Korthikanti et al.'s all-gather / reduce-scatter pair, apply_sp
    layout             which tokens each cp rank holds (plain, zig-zag) and the causal work
    ring_attention     ring attention and the all-gather-K/V version beside it
    context_parallel   apply_cp: the GPT's sequence split over a cp group (folds into DP's
                       averaging)

The crossover sweep (a ring hop against its block of attention, per tokens per rank) lives with
the labs: labkit.labs.context.crossover.
"""
from labkit.context.context_parallel import apply_cp, average_cp_grads
from labkit.context.layout import causal_work, positions, split_sequence
from labkit.context.ring_attention import all_gather_kv_attention, ring_attention
from labkit.context.sequence_parallel import (
                                              apply_sp,
                                              gather_linear,
                                              gather_sequence,
                                              reduce_scatter_sequence,
                                              scatter_sequence,
)
from labkit.context.tiled import merge_partials, saved_bytes_table, tiled_attention

__all__ = ["tiled_attention", "merge_partials", "saved_bytes_table", "apply_sp",
           "gather_linear", "gather_sequence", "reduce_scatter_sequence", "scatter_sequence",
           "ring_attention", "all_gather_kv_attention", "split_sequence", "positions",
           "causal_work", "apply_cp", "average_cp_grads"]
