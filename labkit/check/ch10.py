"""Checkers for chapter 07: plan a 70B and a 175B run, then write the rules of thumb as code.

The reader gives
    10.1  a labkit.costs.planner.Config for Llama-2-70B on 128 A100 80GB (16 nodes of 8)
    10.2  a Config for GPT-3 175B on 256 A100 80GB (32 nodes of 8)
    10.3  rules_of_thumb(job, cluster) -> Config, a search-free recipe (TP inside a node, then PP,
         DP for the rest; ZeRO only as far as memory needs) checked on four clusters
A choice passes when its degrees use every GPU, TP stays inside a node, it fits in memory
(costs.planner's estimate, leaving the cluster's memory margin free) and its estimated time per
step (failures included, the planner's ranking key) is within MARGIN of the planner's best
configuration for the same job. Pure arithmetic: no processes.
"""
from __future__ import annotations

from labkit.check import Checker, fail
from labkit.costs import planner as P

EXERCISES = {
    "10.1": ("plan Llama-2-70B on 128 GPUs", 2),
    "10.2": ("plan GPT-3 175B on 256 GPUs", 2),
    "10.3": ("the rules of thumb as code", 3),
}

MARGIN = 0.10  # a choice may be at most 10% slower per step than the planner's best

SCENARIOS = {
    "llama2-70b on 128 A100 80GB": (
        P.Job("llama2-70b", global_batch=1024, seq_len=4096, recipe="mixed"),
        P.Cluster(128, gpus_per_node=8, gpu="A100 80GB")),
    "gpt3-175b on 256 A100 80GB": (
        P.Job("gpt3-175b", global_batch=1536, seq_len=2048, recipe="mixed"),
        P.Cluster(256, gpus_per_node=8, gpu="A100 80GB")),
    "llama3-8b on 16 H100 80GB": (
        P.Job("llama3-8b", global_batch=512, seq_len=8192, recipe="mixed"),
        P.Cluster(16, gpus_per_node=8, gpu="H100 80GB", intra_bw=450e9, inter_bw=50e9)),
    "llama2-13b on 32 A100 40GB": (
        P.Job("llama2-13b", global_batch=512, seq_len=4096, recipe="mixed"),
        P.Cluster(32, gpus_per_node=8, gpu="A100 40GB")),
}


def judge(config, job: P.Job, cluster: P.Cluster, margin: float = MARGIN) -> P.Estimate:
    """Assert `config` is a sound plan for (job, cluster); the hint says what to change.

    Shared by the checkers and the tests."""
    if not isinstance(config, P.Config):
        fail(f"return a labkit.costs.planner.Config(tp=..., pp=..., dp=..., zero=..., "
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
             f"{usable / 1e9:.1f} GB are usable ({100 * cluster.memory_margin:.0f}% of the GPU kept "
             f"free): more TP/PP, a higher ZeRO stage, or a smaller micro-batch")
    best = P.plan(job, cluster)[0]
    if est.effective_step_s > (1 + margin) * best.effective_step_s:
        ours, theirs = est.row(), best.row()
        mine, top = est.effective_step_s, best.effective_step_s
        fail(f"{c} fits but its estimated step is {mine:.1f} s, "
             f"{100 * (mine / top - 1):.0f}% slower than the best found, {best.config} "
             f"at {top:.1f} s (allowed: {100 * margin:.0f}%). Where the time goes: bubble "
             f"{ours['bubble %']}% vs {theirs['bubble %']}%, TP comm {ours['TP comm s']} s vs "
             f"{theirs['TP comm s']} s, DP not hidden {ours['DP exposed s']} s vs "
             f"{theirs['DP exposed s']} s.")
    return est


def _one(exercise: str, scenario: str, config):
    c = Checker(exercise, *EXERCISES[exercise])
    job, cluster = SCENARIOS[scenario]
    with c.case(scenario):
        if callable(config):
            config = config()
        judge(config, job, cluster)
    return c.finish()


def plan_70b(config):
    """10.1: `config` is a Config (or a function of no arguments returning one)."""
    return _one("10.1", "llama2-70b on 128 A100 80GB", config)


def plan_175b(config):
    """10.2: the same for GPT-3 175B on 256 GPUs."""
    return _one("10.2", "gpt3-175b on 256 A100 80GB", config)


def rules_of_thumb(fn):
    """10.3: fn(job, cluster) -> Config, judged on every scenario."""
    c = Checker("10.3", *EXERCISES["10.3"])
    for name, (job, cluster) in SCENARIOS.items():
        with c.case(name):
            judge(fn(job, cluster), job, cluster)
    return c.finish()
