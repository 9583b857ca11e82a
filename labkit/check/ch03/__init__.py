"""Checkers for chapter 03 (ZeRO and FSDP), and the assertions tests/test_zero.py shares.
One module per exercise:

    state_bytes  3.1  labkit.check.ch03.model_state_bytes(my_fn)   bytes per GPU under a stage
    zero2/       3.2  labkit.check.ch03.zero2_optimizer(MyZeRO2)   a whole ZeRO-2 optimizer
    held         3.3  labkit.check.ch03.held_and_sent(my_fn)       predict held and sent, measure
    common            the shared assertions (values, sharding, bytes held and sent)
"""
from __future__ import annotations

from labkit.check.ch03 import held, state_bytes, zero2
from labkit.check.ch03.common import (
                                      ATOL,
                                      HEADER_BYTES,
                                      RTOL,
                                      assert_held_bytes,
                                      assert_matches_reference,
                                      assert_optimal_traffic,
                                      assert_ranks_agree,
                                      assert_state_sharded,
                                      predicted_held,
)
from labkit.check.ch03.held import HELD_CASES, held_and_sent
from labkit.check.ch03.state_bytes import model_state_bytes
from labkit.check.ch03.zero2 import zero2_optimizer

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS) for m in (state_bytes, zero2, held)}
__all__ = ["ATOL", "EXERCISES", "HEADER_BYTES", "HELD_CASES", "RTOL", "assert_held_bytes",
           "assert_matches_reference", "assert_optimal_traffic", "assert_ranks_agree",
           "assert_state_sharded", "held_and_sent", "model_state_bytes", "predicted_held",
           "zero2_optimizer"]
