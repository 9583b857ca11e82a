"""Checkers for chapter 01: ring reduce-scatter, ring all-gather, an all-reduce in O(log N)
rounds (recursive halving and doubling), and a prediction of an all-reduce's bytes and time,
measured. One module per exercise (the two rings share one, as they share their rank job):

    rings             1.1  labkit.check.ch01.ring_reduce_scatter(reduce_scatter)
                      1.2  labkit.check.ch01.ring_all_gather(all_gather)
    halving_doubling  1.3  labkit.check.ch01.halving_doubling_all_reduce(my_all_reduce)
    alpha_beta        1.4  labkit.check.ch01.predict_all_reduce(predict)
"""
from __future__ import annotations

from labkit.check.ch01 import alpha_beta, halving_doubling, rings
from labkit.check.ch01.alpha_beta import PREDICT_CASES, predict_all_reduce
from labkit.check.ch01.halving_doubling import halving_doubling_all_reduce
from labkit.check.ch01.rings import ring_all_gather, ring_reduce_scatter
from labkit.check.source import collectives_called

EXERCISES = {**rings.EXERCISES,
             halving_doubling.EXERCISE: (halving_doubling.TITLE, halving_doubling.POINTS),
             alpha_beta.EXERCISE: (alpha_beta.TITLE, alpha_beta.POINTS)}
__all__ = ["EXERCISES", "PREDICT_CASES", "collectives_called", "halving_doubling_all_reduce",
           "predict_all_reduce", "ring_all_gather", "ring_reduce_scatter"]
