"""Chapter 10's shared pieces: the scenarios (clusters and jobs) its exercises plan for, and what
the reader's estimator and search may not use, read in the source and refused at run time.
"""
from __future__ import annotations

from labkit.check import Forbidden
from labkit.check.refusal import calls_refused
from labkit.costs import memory
from labkit.costs import planner as P
from labkit.costs.plan_inputs import Cluster, Job

SCENARIOS = {
    "llama2-70b on 128 A100 80GB": (
        Job("llama2-70b", global_batch=1024, seq_len=4096, recipe="mixed"),
        Cluster(128, gpus_per_node=8, gpu="A100 80GB")),
    "gpt3-175b on 256 A100 80GB": (
        Job("gpt3-175b", global_batch=1536, seq_len=2048, recipe="mixed"),
        Cluster(256, gpus_per_node=8, gpu="A100 80GB")),
    "llama3-8b on 16 H100 80GB": (
        Job("llama3-8b", global_batch=512, seq_len=8192, recipe="mixed"),
        Cluster(16, gpus_per_node=8, gpu="H100 80GB", intra_bw=450e9, inter_bw=50e9)),
    "llama2-13b on 32 A100 40GB": (
        Job("llama2-13b", global_batch=512, seq_len=4096, recipe="mixed"),
        Cluster(32, gpus_per_node=8, gpu="A100 40GB")),
}
HIDDEN_SCENARIO = (Job("llama2-13b", global_batch=64, seq_len=2048, recipe="mixed"),
                   Cluster(64, gpus_per_node=8, gpu="A100 80GB", inter_bw=12.5e9))
FORBIDDEN = Forbidden(("labkit.costs.planner", "labkit.costs.memory", "labkit.costs.pipeline",
                       "labkit.costs.comm", "labkit.costs.zero", "labkit.costs.parallel",
                       "labkit.costs.tensor_parallel", "labkit.parallel"),
                      frozenset({"evaluate", "candidates"}),
                      why="write it from the formulas")


def planner_refused():
    """While the reader's code runs, the functions that ARE the answer raise."""
    return calls_refused([(P, "evaluate"), (P, "plan"), (P, "candidates"), (memory, "plan"),
                          (memory, "model_states")],
                         why="write the estimate from the formulas and search with it yourself "
                             "(costs.models, costs.activations and costs.flops may help)")
