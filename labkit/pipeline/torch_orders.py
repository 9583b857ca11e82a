"""labkit's schedules beside PyTorch's own (torch.distributed.pipelining.schedules).

    from labkit.pipeline import schedules, torch_orders
    s = schedules.make("zb-h1", 4, 8)
    torch_orders.torch_validate(s)                     # PyTorch's private validator accepts it
    t = torch_orders.torch_schedule("ScheduleInterleavedZeroBubble", P=4, K=8, v=1)
    torch_orders.same_order(s, t)                      # True: the same order, action for action

PyTorch names an action by (global stage index, type, micro-batch) with types F, I (backward
for the input: labkit's B in a split schedule), W and B (a full backward). Its global stage s
lives on rank s % P as local chunk s // P for the looped schedules: labkit's placement, so
orders convert one to one. ScheduleZBVZeroBubble places its 2P stages in a V (rank r holds
stages r and 2P-1-r, PyTorch's style="v"): labkit's `schedules.v_placement`, the placement its
"zb-v" schedule carries as data. PyTorch builds its orders inside the schedule's constructor, which
wants real pipeline stages; `torch_schedule` calls the same (private) order-building methods on
a bare object instead, so it may break when PyTorch renames them: it raises naming the method.
"""
from __future__ import annotations

from labkit.pipeline.base import Action, Schedule, v_placement


def _types():
    # imported on use: torch.distributed.pipelining takes seconds to import (7 s measured on a
    # loaded 2-core machine), and only the comparison with PyTorch's orders needs it
    from torch.distributed.pipelining import schedules as T
    return T


def to_torch(s: Schedule) -> dict:
    """{rank: [torch _Action]} for schedule `s` (B becomes I where the backward is split)."""
    T = _types()
    kind = {"F": T.F, "B": T.I if s.split else T.B, "W": T.W}
    return {p: [T._Action(s.global_chunk(p, a.chunk), kind[a.kind], a.mb) for a in actions]
            for p, actions in enumerate(s.stages)}


def from_torch(order: dict, P: int, K: int, v: int, name: str, placement=None) -> Schedule:
    """A labkit Schedule from PyTorch's pipeline_order (idle slots, None, dropped). `placement`
    (labkit's: stage of each global chunk; None: round robin) must be the one PyTorch used."""
    kind = {"F": "F", "I": "B", "B": "B", "W": "W"}
    shape = Schedule(name, P, K, v, [], placement)  # only for its placement lookups
    stages = []
    for p in range(P):
        acts = []
        for a in order[p]:
            if a is None:
                continue
            if shape.stage_of(a.stage_index) != p:
                where = "round robin" if placement is None else placement
                raise ValueError(f"PyTorch's order puts stage {a.stage_index} on rank {p}: not the "
                                 f"placement given ({where})")
            acts.append(Action(kind[a.computation_type.value], a.microbatch_index,
                               shape.local_chunk(a.stage_index)))
        stages.append(acts)
    return Schedule(name, P, K, v, stages, placement)


def torch_validate(s: Schedule) -> None:
    """Run PyTorch's private validator (_validate_schedule) on `s`; it raises AssertionError."""
    T = _types()
    T._validate_schedule(to_torch(s), s.P, s.n_chunks, s.K)


def torch_schedule(cls_name: str, P: int, K: int, v: int = 1) -> Schedule:
    """PyTorch's own order for `cls_name` ('ScheduleInterleavedZeroBubble',
    'ScheduleInterleaved1F1B') at P ranks, K micro-batches, v local stages, as a labkit Schedule."""
    T = _types()
    cls = getattr(T, cls_name)
    o = object.__new__(cls)  # no stages, no process group: only the order-building methods
    o.pp_group_size, o.n_local_stages, o._n_microbatches, o.num_stages = P, v, K, P * v
    if cls_name == "ScheduleZBVZeroBubble":
        return _zbv_order(o, P, K, v)
    o.number_of_rounds = max(1, K // P)
    o.microbatches_per_round = K // o.number_of_rounds
    if K % o.number_of_rounds:
        raise ValueError(f"PyTorch's {cls_name} refuses K={K} with P={P}, v={v}: K must be a "
                         f"multiple of its number of rounds ({o.number_of_rounds})")
    try:
        o.pipeline_order = {r: o._calculate_single_rank_operations(r) for r in range(P)}
        if hasattr(o, "_add_bubbles_to_actions"):
            o.pipeline_order = o._add_bubbles_to_actions(P * v)
    except AttributeError as e:
        raise RuntimeError(f"PyTorch's {cls_name} order-building changed ({e}); "
                           f"this bridge needs updating") from e
    return from_torch(o.pipeline_order, P, K, v, f"torch:{cls_name}")


def _zbv_order(o, P: int, K: int, v: int) -> Schedule:
    """ScheduleZBVZeroBubble's order (two stages per rank in a V; no rounds)."""
    if v != 2:
        raise ValueError(f"PyTorch's ScheduleZBVZeroBubble needs exactly 2 stages per rank, "
                         f"got v={v}")
    try:
        order = {r: o._calculate_single_rank_operations(r) for r in range(P)}
    except AttributeError as e:
        raise RuntimeError(f"PyTorch's ScheduleZBVZeroBubble order-building changed ({e}); "
                           f"this bridge needs updating") from e
    return from_torch(order, P, K, v, "torch:ScheduleZBVZeroBubble", v_placement(P))


def same_order(a: Schedule, b: Schedule) -> bool:
    """True when both schedules give every stage the same actions in the same order."""
    return ((a.P, a.K, a.v) == (b.P, b.K, b.v) and a.stages == b.stages
            and a.placement == b.placement)


def first_difference(a: Schedule, b: Schedule):
    """(stage, index, a's action, b's action) of the first place the orders differ, or None."""
    for p, (x, y) in enumerate(zip(a.stages, b.stages)):
        for i in range(max(len(x), len(y))):
            u, w = (x[i] if i < len(x) else None), (y[i] if i < len(y) else None)
            if u != w:
                return p, i, u, w
    return None
