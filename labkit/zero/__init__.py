"""ZeRO stages 1-3 on real processes (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"), each checked against one process.

    from labkit.zero import DataParallel, ZeRO1, ZeRO2, ZeRO3
    # inside a function run by labkit.launch.run(fn, nprocs):
    zero = ZeRO2(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss = model(x, y)[1]; loss.backward(); zero.step(); zero.zero_grad()
    zero.held_bytes()      # {"params": ..., "grads": ..., "optimizer": ...} on this rank
    # bytes sent: counted by the kernel around the step (labkit.observe.netcount), see
    # labkit.labs.zero.train

    shard       this rank's chunk of every parameter and an optimizer over the chunks (the
                chunks, and the reduce-scatter / all-gather that move them: labkit.flat),
                what a rank holds
    zero1       DataParallel (stage 0); zero1_step (per parameter, the exercise),
                zero1_step_flat (one message each way), naive_zero1_step (all-reduce: 3Ψ); ZeRO1
    zero2       ZeRO2: gradients reduce-scattered in buckets during backward, full ones freed;
                offload= (ZeRO-Offload: masters, gradient shards, optimizer and step on the CPU)
    zero3       ZeRO3: parameters sharded, gathered just in time per unit (FSDP); prefetch=,
                reshard_after_forward=, offload= (optimizer state and step on the CPU)
    unit        one ZeRO-3 unit's hooks, as FSDP2 places them (forward: gather, run, free;
                pre-backward: gather again into the storage the saved activations point at;
                post-backward: free, reduce-scatter); no forward runs twice
    reduce      a unit's gradients: reduce-scatter (sharded), all-reduce (replicated), flags
    prefetch    the next unit's all-gather posted before this one computes (order of step 1)
    scaling     ShardedLossScaler: fp16 dynamic loss scaling, every rank skips the same steps
    precision   MixedPrecisionPolicy for ZeRO3 (FSDP2's fields: bf16 gathers and compute, fp32
                masters; reduce_dtype), and replicate= choices (one_dimensional, smaller_than)
    params      real training code: parameter groups, frozen and unused parameters (has-grad
                flags), clipping by the global norm of sharded gradients, bad-input errors
    param_gather  ZeRO-1/2's parameter all-gather overlapped with the next forward
    hsdp        HSDP: ZeRO-3 inside a group, replicas across groups (FSDP2's 2-D mesh)
    zeropp      ZeRO++ (Wang et al. 2023): ZeRO-3 with quantized and hierarchical collectives

The experiments that run these on real ranks (the same training for every stage and its
references, FSDP2 beside them, bytes held and sent per stage, prefetch's timeline, the backward's
saved bytes, the precision curves, the crossover sweep) are chapter 03's lab's:
labkit/labs/zero/ (train, fsdp, measure, overlap, backward, tracking, crossover).

Process groups are arguments (default: the world).
"""
from labkit.zero.params import param_groups, weight_decay_groups
from labkit.zero.precision import MixedPrecisionPolicy, one_dimensional, smaller_than
from labkit.zero.scaling import ShardedLossScaler
from labkit.zero.shard import shard_optimizer
from labkit.zero.zero1 import DataParallel, ZeRO1, naive_zero1_step, zero1_step, zero1_step_flat
from labkit.zero.zero2 import ZeRO2
from labkit.zero.zero3 import ZeRO3

__all__ = ["DataParallel", "MixedPrecisionPolicy", "ShardedLossScaler", "ZeRO1", "ZeRO2", "ZeRO3",
           "naive_zero1_step", "one_dimensional", "smaller_than", "param_groups", "shard_optimizer",
           "weight_decay_groups", "zero1_step", "zero1_step_flat"]
