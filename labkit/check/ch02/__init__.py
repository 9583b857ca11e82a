"""Checkers for chapter 02: bucket assignment, bucketed DDP with overlap, and a prediction of a
DDP step's all-reduces and bytes, measured. One module per exercise:

    buckets      2.1  labkit.check.ch02.assign_buckets(assign_buckets)
    ddp_wrapper  2.2  labkit.check.ch02.bucketed_ddp(MyBucketedDDP)
    ddp_step     2.3  labkit.check.ch02.predict_ddp_step(predict)
    crossover    2.4  labkit.check.ch02.crossover_batch(predict_crossover)
"""
from __future__ import annotations

from labkit.check.ch02 import buckets, crossover, ddp_step, ddp_wrapper
from labkit.check.ch02.buckets import assign_buckets
from labkit.check.ch02.crossover import crossover_batch
from labkit.check.ch02.ddp_step import PREDICT_CASES, predict_ddp_step
from labkit.check.ch02.ddp_wrapper import bucketed_ddp

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS) for m in (buckets, ddp_wrapper, ddp_step, crossover)}
__all__ = ["EXERCISES", "PREDICT_CASES", "assign_buckets", "bucketed_ddp", "crossover_batch",
           "predict_ddp_step"]
