"""Checkers for chapter 00: predict a model's training-state bytes, a first send/recv, and a
data-parallel training loop by hand. One module per exercise:

    training_state   0.1  labkit.check.ch00.state_bytes(predict_state_bytes)
    ring_shift       0.2  labkit.check.ch00.shift_right(shift_right)
    trainer/         0.3  labkit.check.ch00.data_parallel(DataParallelTrainer)
    roofline         0.4  labkit.check.ch00.roofline_matmul(predict_matmul)
"""
from __future__ import annotations

from labkit.check.ch00 import ring_shift, roofline, trainer, training_state
from labkit.check.ch00.ring_shift import shift_right
from labkit.check.ch00.roofline import roofline_matmul
from labkit.check.ch00.trainer import data_parallel
from labkit.check.ch00.training_state import STATE_CASES, state_bytes

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS)
             for m in (training_state, ring_shift, trainer, roofline)}
__all__ = ["EXERCISES", "STATE_CASES", "data_parallel", "roofline_matmul", "shift_right",
           "state_bytes"]
