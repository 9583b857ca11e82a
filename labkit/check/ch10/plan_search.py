"""Exercise 10.2: search the plans with your estimator.

    labkit.check.ch10.search_plans(search, estimate)   # search(job, cluster, estimate) -> Config

Four clusters and a hidden one; a plan passes when its degrees use every GPU, TP stays inside a
node, it fits (costs.planner's estimate, leaving the memory margin free) and its estimated time
per step is within MARGIN of the planner's best (`judge`, shared with the tests).
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded
from labkit.check.ch10.common import FORBIDDEN, HIDDEN_SCENARIO, SCENARIOS, planner_refused
from labkit.costs import planner as P
from labkit.costs.plan_inputs import Cluster, Config, Job

EXERCISE, TITLE, POINTS = "10.2", "search the plans with your estimator", 3
MARGIN = 0.10            # at most 10% slower per step than the planner's best


def judge(config, job: Job, cluster: Cluster, margin: float = MARGIN) -> P.Estimate:
    """Assert `config` is a sound plan for (job, cluster); the hint says what to change.

    Shared by the checkers and the tests."""
    if not isinstance(config, Config):
        fail(f"return a labkit.costs.plan_inputs.Config(dp=..., tp=..., pp=..., zero=..., "
             f"micro_batch=...), got {type(config).__name__}")
    c, n, g = config, cluster.n_gpus, cluster.gpus_per_node
    if c.tp * c.pp * c.dp != n:
        fail(f"TP x PP x DP = {c.tp} x {c.pp} x {c.dp} = {c.tp * c.pp * c.dp}, but there are {n} "
             f"GPUs: choose degrees whose product is {n}")
    if c.tp > g:
        fail(f"TP={c.tp} spans nodes of {g} GPUs: its 4 all-reduces per layer would cross the "
             f"slow inter-node links. Keep TP <= {g} and use PP across nodes.")
    if job.global_batch % (c.dp * c.micro_batch):
        fail(f"global batch {job.global_batch} does not split into micro-batches of "
             f"{c.micro_batch} on DP={c.dp} replicas: pick DP x micro-batch dividing it")
    est = P.evaluate(c, job, cluster)
    usable = cluster.usable
    if not est.fits:
        parts = ", ".join(f"{label} {v:.1f}" for label, v in est.memory.rows()[:5])
        fail(f"{c} needs {est.memory.total / 1e9:.1f} GB per GPU ({parts} GB) but only "
             f"{usable / 1e9:.1f} GB are usable ({100 * cluster.memory_margin:.0f}% of the GPU "
             f"kept free): more TP/PP, a higher ZeRO stage, or a smaller micro-batch")
    best = P.plan(job, cluster)[0]
    if est.effective_step_s > (1 + margin) * best.effective_step_s:
        ours, theirs = est.row(), best.row()
        mine, top = est.effective_step_s, best.effective_step_s
        fail(f"{c} fits but its estimated step is {mine:.1f} s, "
             f"{100 * (mine / top - 1):.0f}% slower than the best found, {best.config} "
             f"at {top:.1f} s (allowed: {100 * margin:.0f}%). Where the time goes: bubble "
             f"{ours['bubble %']}% vs {theirs['bubble %']}%, TP comm {ours['TP comm s']} s vs "
             f"{theirs['TP comm s']} s, DP not hidden {ours['DP exposed s']} s vs "
             f"{theirs['DP exposed s']} s. Which candidates does your search try?")
    return est


@graded("10.2")
def search_plans(search, estimate):
    """Exercise 10.2: search(job, cluster, estimate) -> Config, judged on every scenario and a
    hidden one, with YOUR estimate passed in."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.because("search with your own estimator").refusal(search, who="your search"))
    cases = list(SCENARIOS.items()) + [("hidden case", HIDDEN_SCENARIO)]
    for name, (job, cluster) in cases:
        with c.case(name):
            with planner_refused():
                config = search(job, cluster, estimate)
            judge(config, job, cluster)
            if name != "hidden case":
                c.cases[-1]["name"] += f": {config}"
    return c.finish()

