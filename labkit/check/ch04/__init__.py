"""Checkers for chapter 04 (tensor parallelism). One module per exercise (f and g share one):

    operators  4.1  labkit.check.ch04.f_operator(f)
               4.2  labkit.check.ch04.g_operator(g)
    block      4.3  labkit.check.ch04.tp_block(MyMLP, MyAttention)
    wire       4.4  labkit.check.ch04.tp_bytes(predict_tp_bytes)
    common          the rank jobs and the assertion tests/test_tp.py shares
"""
from __future__ import annotations

from labkit.check.ch04 import block, operators, wire
from labkit.check.ch04.block import tp_block
from labkit.check.ch04.common import assert_pairs, hint_bias, linear_job, mlp_job
from labkit.check.ch04.operators import f_job, f_operator, g_job, g_operator
from labkit.check.ch04.wire import WIRE_CASES, tp_bytes

EXERCISES = {**operators.EXERCISES, block.EXERCISE: (block.TITLE, block.POINTS),
             wire.EXERCISE: (wire.TITLE, wire.POINTS)}
_hint_bias = hint_bias          # the name tests/test_tp.py calls it by
__all__ = ["EXERCISES", "WIRE_CASES", "assert_pairs", "f_job", "f_operator", "g_job",
           "g_operator", "hint_bias", "linear_job", "mlp_job", "tp_block", "tp_bytes"]
