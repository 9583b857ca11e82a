"""Data parallelism (DDP) three ways, so that the difference between them is the lesson.

    from labkit.ddp import NaiveDDP, OverlapDDP, BucketedDDP
    ddp = BucketedDDP(model, bucket_mb=25.0)       # group=None: the default (world) group
    loss = ddp(x_local, y_local)[1]; loss.backward()
    ddp.finish_gradient_synchronization()          # after backward, before optimizer.step()

1. `NaiveDDP`    after backward, all-reduce every gradient one at a time (nothing overlaps).
2. `OverlapDDP`  a hook per parameter launches an async all-reduce as soon as that gradient is
                 accumulated, while backward goes on (one message per parameter).
3. `BucketedDDP` gradients grouped, in reverse registration order, into buckets that close
                 once they hold `bucket_mb` MiB (PyTorch's `bucket_cap_mb`; the rule, in bytes,
                 is labkit.buckets, the reducer's); a bucket's all-reduce starts when all of its
                 gradients are ready (Li et al. 2020, "PyTorch Distributed", VLDB; the design of
                 `torch.nn.parallel.DistributedDataParallel`).

All three broadcast rank 0's parameters and buffers when they wrap, skip frozen parameters,
synchronise a tied (shared) parameter once, support `no_sync()` for gradient accumulation, and
take a process group (Gloo on CPU, NCCL on GPU). Every launch is recorded in `.launches`
(start, end, bytes), so a timeline and the count of all-reduces per step can be drawn.
Their spans go on a labkit.observe.timeline.Timeline (`timeline=`); `no_sync()` is
labkit.accumulate.sync_paused. Measuring them is chapter 02's lab's (labkit/labs/ddp/): `verify`
(train on real ranks, compare with one process), `timing` (step times, one step's timeline),
`stepmodel` (the step-time model's pieces, measured, against the measured step), `crossover`
(FLOP/s and a per-rank batch sweep: where the step turns communication-bound).

    bucketed    BucketedDDP, assign_buckets (the reducer's rule: labkit.buckets)
    common      DDPBase (the wrapper, broadcast, launch records), broadcast_module
    naive       NaiveDDP
    overlap     OverlapDDP
"""
from labkit.ddp.bucketed import BucketedDDP, assign_buckets
from labkit.ddp.common import broadcast_module
from labkit.ddp.naive import NaiveDDP
from labkit.ddp.overlap import OverlapDDP

__all__ = ["NaiveDDP", "OverlapDDP", "BucketedDDP", "assign_buckets", "broadcast_module"]
