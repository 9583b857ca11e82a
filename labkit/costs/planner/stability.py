"""Does the ranking hold? The top plans under a sweep of one cluster input."""
from __future__ import annotations

from dataclasses import replace

from labkit.costs.plan_inputs import Cluster, Job
from labkit.costs.planner.estimate import evaluate
from labkit.costs.planner.search import plan, rank_of


def stability(job: Job, cluster: Cluster, top: int = 5, extra=(), **sweeps) -> dict:
    """How the top plans fare when one input changes: {"plans", "sweeps"}.

    plans: the `top` configurations ranked with the cluster as given, then `extra` ones (Configs
    to follow as well, e.g. a plan that wins under other assumptions). sweeps: for each keyword
    (a Cluster field such as inter_bw=[12.5e9, 25e9, 50e9] or overlap=[0, 0.5, 1]):
    {"values", "step_s": {config: [effective step per value]}, "rank": {config: [rank per value,
    None when it no longer fits]}, "winner": [the best configuration per value]}."""
    base = plan(job, cluster)[:top]
    base += [evaluate(c, job, cluster) for c in extra if c not in {e.config for e in base}]
    out = {"plans": [e.config for e in base], "sweeps": {}}
    for name, values in sweeps.items():
        res = {"values": list(values), "step_s": {e.config: [] for e in base},
               "rank": {e.config: [] for e in base}, "winner": []}
        for v in values:
            cl = replace(cluster, **{name: v})
            ranked = plan(job, cl)
            res["winner"].append(ranked[0].config if ranked else None)
            for e in base:
                res["step_s"][e.config].append(evaluate(e.config, job, cl).effective_step_s)
                res["rank"][e.config].append(rank_of(e.config, ranked))
        out["sweeps"][name] = res
    return out
