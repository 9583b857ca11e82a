"""ZeRO stages 1-3 on real processes (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"), each checked against one process.

    from labkit.zero import DataParallel, ZeRO1, ZeRO2, ZeRO3
    # inside a function run by labkit.launch.run(fn, nprocs):
    zero = ZeRO2(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss = model(x, y)[1]; loss.backward(); zero.step(); zero.zero_grad()
    zero.held_bytes()      # {"params": ..., "grads": ..., "optimizer": ...} on this rank
    zero.counter.sent      # bytes this rank sent through each ring collective

    shard       per-parameter padded chunks, reduce-scatter / all-gather, byte counting
    zero1       DataParallel (stage 0), zero1_step, ZeRO1: sharded optimizer states
    zero2       ZeRO2: gradients reduce-scattered during backward, full gradients freed
    zero3       ZeRO3: parameters sharded, gathered just in time per unit (FSDP)
    train       the same few training steps for any stage, and the one-process reference

Process groups are arguments (default: the world).
"""
from labkit.zero.shard import (CommCounter, all_gather_full, chunk_size, padded_flat,
                               reduce_scatter_mean, shard_of, shard_optimizer)
from labkit.zero.zero1 import DataParallel, ZeRO1, naive_zero1_step, zero1_step, zero1_step_flat
from labkit.zero.zero2 import ZeRO2
from labkit.zero.zero3 import ZeRO3

__all__ = ["CommCounter", "DataParallel", "ZeRO1", "ZeRO2", "ZeRO3", "all_gather_full",
           "chunk_size", "naive_zero1_step", "padded_flat", "reduce_scatter_mean", "shard_of",
           "shard_optimizer", "zero1_step", "zero1_step_flat"]
