"""Pipeline schedules as data: for each stage, the ordered list of actions it runs.

    from labkit.pipeline import schedules
    s = schedules.one_f_one_b(P=4, K=8)               # or schedules.make("1f1b", 4, 8)
    s.stages[0]        # [F0, F1, F2, F3, B0, F4, B1, F5, B2, F6, B3, F7, B4, B5, B6, B7]

An action is the forward (F) or backward (B) of one micro-batch on one model chunk. A stage
holds v chunks (v = 1 unless interleaved); by default local chunk j of stage p is global chunk
j*P + p, so a micro-batch's forward visits stages 0, 1, ..., P-1, then 0, 1, ... again for the
next chunk (Megatron's round-robin placement). A schedule may carry another placement as data
(`Schedule.placement[g]` = the stage holding global chunk g; local chunks numbered in the order
of their global index): ZB-V's "V" (`v_placement`, labkit.pipeline.zero_bubble). Three schedules:

- GPipe (Huang et al., 2019, arXiv:1811.06965): all K forwards, then all K backwards. A stage
  holds the activations of all K micro-batches at once.
- 1F1B (PipeDream-Flush; Narayanan et al., 2021, arXiv:2006.09503): stage p runs P-p-1 warm-up
  forwards, then alternates one forward and one backward, then drains the backwards. Same work,
  same bubble; a stage never holds more than P-p micro-batches.
- Interleaved 1F1B (Narayanan et al., SC'21, arXiv:2104.04473): v chunks per stage, 1F1B over
  (micro-batch, chunk) units in groups of P micro-batches; bubble divided by v.

A schedule is only data: `labkit.pipeline.validate` checks it, `simulate` times it, and
`executor` runs it on real processes. This module is the door: the types and the three
schedules above live in labkit.pipeline.base, the split-backward ones (ZB-H1, ZB-H2, ZB-V) in
labkit.pipeline.zero_bubble, and `make` picks one by name.
"""
from __future__ import annotations

from labkit.pipeline import zero_bubble
from labkit.pipeline.base import (  # noqa: F401
    Action,
    B,
    F,
    Schedule,
    W,
    from_stage_fn,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    one_f_one_b_stage,
    v_placement,
)


def make(name: str, P: int, K: int, v: int = 1) -> Schedule:
    """A schedule by name: 'gpipe', '1f1b', 'interleaved' (v chunks per stage), 'zb-h1', 'zb-h2'
    or 'zb-v' (labkit.pipeline.zero_bubble; ZB-V always has 2 chunks per stage: v = 1, the
    default, or 2 both mean that)."""
    if name in ("zb-h1", "zb-h2", "zb-v"):
        if name == "zb-v":
            return zero_bubble.make(name, P, K, v)
        return zero_bubble.make(name, P, K)
    if name == "gpipe":
        return gpipe(P, K)
    if name == "1f1b":
        return one_f_one_b(P, K)
    if name == "interleaved":
        return interleaved_1f1b(P, K, v)
    raise ValueError(f"schedule {name!r}: choose 'gpipe', '1f1b', 'interleaved', "
                     f"'zb-h1', 'zb-h2' or 'zb-v'")
