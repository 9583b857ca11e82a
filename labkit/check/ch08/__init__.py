"""Checkers for chapter 08 (mixture of experts). One module per exercise:

    routing          8.1  labkit.check.ch08.routing_with_capacity(keep)     one process
    expert_parallel  8.2  labkit.check.ch08.expert_parallel_layer(ExpertParallelMoE)   ep 2-4
    wire             8.3  labkit.check.ch08.alltoall_bytes(predict)         vs the kernel's count
    common                GShard's routing priority as plain loops (8.1's answer, 8.2's reference)

No module here imports labkit.moe: 8.2's ranks look for it among their loaded modules.
"""
from __future__ import annotations

from labkit.check.ch08 import expert_parallel, routing, wire
from labkit.check.ch08.expert_parallel import FORBIDDEN, LAYER_CASES, expert_parallel_layer
from labkit.check.ch08.routing import routing_with_capacity
from labkit.check.ch08.wire import alltoall_bytes

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS) for m in (routing, expert_parallel, wire)}
__all__ = ["EXERCISES", "FORBIDDEN", "LAYER_CASES", "alltoall_bytes", "expert_parallel_layer",
           "routing_with_capacity"]
