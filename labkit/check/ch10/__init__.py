"""Checkers for chapter 10: an estimator of a 3D-parallel run written from the formulas, a search
over plans with it, and a DP x TP run's bytes predicted, then counted by the kernel. One module
per exercise:

    estimator    10.1  labkit.check.ch10.estimator(estimate)            pure arithmetic
    plan_search  10.2  labkit.check.ch10.search_plans(search, estimate) four clusters, one hidden
    hybrid_wire  10.3  labkit.check.ch10.hybrid_bytes(predict)          labkit.observe.netcount
    common             the scenarios, and what the reader's code may not use
"""
from __future__ import annotations

from labkit.check.ch10 import estimator as _estimator
from labkit.check.ch10 import hybrid_wire, plan_search
from labkit.check.ch10.common import FORBIDDEN, HIDDEN_SCENARIO, SCENARIOS
from labkit.check.ch10.estimator import ESTIMATE_CASES, estimator
from labkit.check.ch10.hybrid_wire import HYBRID_CASES, hybrid_bytes
from labkit.check.ch10.plan_search import judge, search_plans

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS) for m in (_estimator, plan_search, hybrid_wire)}
__all__ = ["ESTIMATE_CASES", "EXERCISES", "FORBIDDEN", "HIDDEN_SCENARIO", "HYBRID_CASES",
           "SCENARIOS", "estimator", "hybrid_bytes", "judge", "search_plans"]
