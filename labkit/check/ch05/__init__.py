"""Checkers for chapter 05: pipeline schedules as data, a pipeline stage on real processes, and
a prediction of the bubble and the memory measured against a real run. One module per exercise:

    schedule_1f1b  5.1  labkit.check.ch05.one_f_one_b(fn)            the 1F1B order of stage p
    zero_bubble    5.2  labkit.check.ch05.zb_h1(fn)                  ZB-H1: deferred W's
    stage/         5.3  labkit.check.ch05.pipeline_stage(run_stage)  one stage's executor
    prediction     5.4  labkit.check.ch05.predict_then_measure(predict)
    trace          5.5  labkit.check.ch05.exposed_communication(exposed_comm)
    common              the reader's function as a Schedule; a schedule run on real processes
"""
from __future__ import annotations

from labkit.check.ch05 import prediction, schedule_1f1b, stage, trace, zero_bubble
from labkit.check.ch05.common import RUN_CASES, schedule_from
from labkit.check.ch05.prediction import PREDICT_PAPER_CASES, predict_then_measure
from labkit.check.ch05.schedule_1f1b import PAPER_CASES, assert_1f1b_schedule, one_f_one_b
from labkit.check.ch05.stage import pipeline_stage
from labkit.check.ch05.trace import exposed_communication
from labkit.check.ch05.zero_bubble import ZB_PAPER_CASES, assert_zb_h1_schedule, zb_h1

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS)
             for m in (schedule_1f1b, zero_bubble, stage, prediction, trace)}
__all__ = ["EXERCISES", "PAPER_CASES", "PREDICT_PAPER_CASES", "RUN_CASES", "ZB_PAPER_CASES",
           "assert_1f1b_schedule", "assert_zb_h1_schedule", "exposed_communication",
           "one_f_one_b", "pipeline_stage", "predict_then_measure", "schedule_from", "zb_h1"]
