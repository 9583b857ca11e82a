"""Checkers for chapter 07: the log-sum-exp merge, sequence parallelism's operator pair, ring
attention forward and backward, and its bytes on the wire. One module per exercise:

    lse_merge          7.1  labkit.check.ch07.merge(merge)                     one process
    sequence_parallel  7.2  labkit.check.ch07.sp_pair(sp_gather[, sp_reduce_scatter])
    ring               7.3  labkit.check.ch07.ring_attention(my_ring_attention)
    ring_wire          7.4  labkit.check.ch07.ring_bytes(predict_ring_bytes)   kernel-counted
"""
from __future__ import annotations

from labkit.check.ch07 import lse_merge, ring, ring_wire, sequence_parallel
from labkit.check.ch07.lse_merge import merge
from labkit.check.ch07.ring import ring_attention
from labkit.check.ch07.ring_wire import ring_bytes
from labkit.check.ch07.sequence_parallel import sp_pair

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS)
             for m in (lse_merge, sequence_parallel, ring, ring_wire)}
__all__ = ["EXERCISES", "merge", "ring_attention", "ring_bytes", "sp_pair"]
