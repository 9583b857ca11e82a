"""Exercise 10.1: a memory-and-time estimator for a 3D-parallel run, from the formulas.

    labkit.check.ch10.estimator(estimate)   # estimate(config, job, cluster)
                                            #   -> {"memory": bytes per GPU, "step_s": seconds}

For a dense model in mixed precision (no recomputation, flash attention, no CP/EP/offload),
compared with labkit.costs.planner.evaluate on configurations the notebook shows and on hidden
ones (TP across nodes, a pipeline deeper than its micro-batches, layers that do not divide into
stages, every ZeRO stage): within TOLERANCE. The planner, costs.memory, costs.pipeline,
costs.comm and costs.parallel may not be used (read in the source and globals; at run time the
planner's evaluate/plan and costs.memory's plan/model_states raise while the reader's code runs);
costs.models, costs.activations and costs.flops may.
"""
from __future__ import annotations

from labkit.check import Checker, fail, graded
from labkit.check.ch10.common import FORBIDDEN, SCENARIOS, planner_refused
from labkit.costs import planner as P
from labkit.costs.plan_inputs import Cluster, Config, Job

EXERCISE, TITLE, POINTS = ("10.1", "a memory-and-time estimator for a 3D-parallel run, from the "
                           "formulas", 6)
TOLERANCE = 0.005        # memory and step time within 0.5% of labkit.costs.planner

_70B, _175B = SCENARIOS["llama2-70b on 128 A100 80GB"], SCENARIOS["gpt3-175b on 256 A100 80GB"]
_8B, _13B = SCENARIOS["llama3-8b on 16 H100 80GB"], SCENARIOS["llama2-13b on 32 A100 40GB"]
ESTIMATE_CASES = [  # (name, config, job, cluster, hidden)
    ("llama2-70b, TP8 x PP4 x DP4, ZeRO-1, micro-batch 1",
     Config(dp=4, tp=8, pp=4, zero=1, micro_batch=1), *_70B, False),
    ("gpt3-175b, TP8 x PP8 x DP4, ZeRO-2, micro-batch 2",
     Config(dp=4, tp=8, pp=8, zero=2, micro_batch=2), *_175B, False),
    ("hidden: ZeRO-3, no TP or PP", Config(dp=16, tp=1, pp=1, zero=3, micro_batch=2), *_8B, True),
    ("hidden: TP across nodes", Config(dp=4, tp=16, pp=2, zero=0, micro_batch=1), *_70B, True),
    ("hidden: ZeRO-3, short sequences", Config(dp=16, tp=8, pp=1, zero=3, micro_batch=1),
     Job("llama2-70b", global_batch=64, seq_len=512, recipe="mixed"), _70B[1], True),
    ("hidden: fewer micro-batches than stages", Config(dp=4, tp=1, pp=8, zero=1, micro_batch=1),
     Job("llama2-13b", global_batch=16, seq_len=4096, recipe="mixed"), _13B[1], True),
    ("hidden: 40 layers on 3 stages", Config(dp=1, tp=8, pp=3, zero=0, micro_batch=4),
     Job("llama2-13b", global_batch=96, seq_len=4096, recipe="mixed"),
     Cluster(24, gpus_per_node=8, gpu="A100 80GB"), True),
]


def _parts(est) -> dict:
    """The planner's terms, in the units the hints speak: GB and seconds per step."""
    m = est.memory
    logits = m.settings["activation_parts"]["logits"]
    return {"memory": {"model states": m.params + m.grads + m.optimizer,
                       "layers' activations": m.activations - logits, "logits": logits,
                       "ZeRO-3's gathered layer": m.gathered},
            "step": {"compute (K micro-batches)": est.K * est.compute_s,
                     "TP all-reduces": est.tp_comm_s, "bubble": est.bubble_s,
                     "PP sends on the ramp": est.pp_comm_s,
                     "DP not hidden": est.dp_exposed_s}}


def _estimate_hint(key: str, got: float, want: float, est) -> str:
    unit, scale = ("GB", 1e9) if key == "memory" else ("s", 1.0)
    parts = _parts(est)["memory" if key == "memory" else "step"]
    said = (f"{key}: yours {got / scale:.4g} {unit}, the formulas give {want / scale:.4g} "
            f"{unit}. Their parts: " + ", ".join(f"{k} {v / scale:.4g}" for k, v in parts.items())
            + ".")
    diff = got - want
    for name, v in parts.items():
        if v and abs(abs(diff) - v) <= 0.03 * v:
            how = "count it twice" if diff > 0 else "leave it out"
            if name == "DP not hidden":
                how += (", or hide " + ("none" if diff > 0 else "all") + " of it (a share "
                        "cluster.overlap of what fits under the compute hides)")
            return said + f" The difference is about the {name} term: did you {how}?"
    return said + " Which of your parts differs?"


@graded("10.1")
def estimator(estimate):
    """Exercise 10.1: estimate(config, job, cluster) -> {"memory": bytes, "step_s": seconds}."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(estimate, who="your estimator"))
    for name, config, job, cluster, hidden in ESTIMATE_CASES:
        with c.case("hidden case" if hidden else name):
            want = P.evaluate(config, job, cluster)
            with planner_refused():
                got = estimate(config, job, cluster)
            if not (isinstance(got, dict) and all(isinstance(got.get(k), (int, float))
                                                  for k in ("memory", "step_s"))):
                fail('return {"memory": bytes per GPU, "step_s": seconds per step}, numbers')
            if not hidden:
                c.cases[-1]["name"] += (
                    f"\n      memory: yours {got['memory'] / 1e9:.2f} GB, formulas "
                    f"{want.memory.total / 1e9:.2f} GB; step: yours {got['step_s']:.3f} s, "
                    f"formulas {want.step_s:.3f} s")
            for key, w in (("memory", want.memory.total), ("step_s", want.step_s)):
                if not abs(got[key] / w - 1) <= TOLERANCE:
                    fail(_estimate_hint(key, got[key], w, want))
    return c.finish()

