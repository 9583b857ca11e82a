"""Checkers for chapter 10: an estimator of a 3D-parallel run written from the formulas, a search
over plans with it, and a DP x TP run's bytes predicted, then counted by the kernel.

    labkit.check.ch10.estimator(estimate)            # 10.1, pure arithmetic, hidden configs
    labkit.check.ch10.search_plans(search, estimate) # 10.2, four clusters and a hidden one
    labkit.check.ch10.hybrid_bytes(predict)          # 10.3, real processes, labkit.netcount

10.1: estimate(config, job, cluster) -> {"memory": bytes per GPU, "step_s": seconds} for a dense
model in mixed precision (no recomputation, flash attention, no CP/EP/offload) is compared with
labkit.costs.planner.evaluate on configurations the notebook shows and on hidden ones (TP across
nodes, a pipeline deeper than its micro-batches, layers that do not divide into stages, every
ZeRO stage): within TOLERANCE. The planner, costs.memory, costs.pipeline, costs.comm and
costs.parallel may not be used (read in the source and globals; at run time the planner's
evaluate/plan and costs.memory's plan/model_states raise while the reader's code runs);
costs.models, costs.activations and costs.flops may.
10.2: search(job, cluster, estimate) -> a plan; a plan passes when its degrees use every GPU,
TP stays inside a node, it fits (costs.planner's estimate, leaving the memory margin free) and
its estimated time per step is within MARGIN of the planner's best (`judge`).
10.3: predict(cfg, dp, tp, zero, rows, local_params) -> bytes one rank sends in one training
step of labkit.parallel's DP x TP GPT; measured by the kernel's TCP counters (labkit.netcount)
on real processes, within BYTES_TOLERANCE, shown beside labkit.costs.parallel.wire_bytes.

Long because: the notebook imports one checker module per chapter; 10.1's per-term hints
name every term of the planner's model.
"""
from __future__ import annotations

import contextlib

from labkit.check import Checker, fail, graded
from labkit.costs import planner as P
from labkit.costs.plan_inputs import Cluster, Config, Job

EXERCISES = {
    "10.1": ("a memory-and-time estimator for a 3D-parallel run, from the formulas", 6),
    "10.2": ("search the plans with your estimator", 3),
    "10.3": ("predict a DP x TP run's bytes per rank per step, then measure them", 3),
}

MARGIN = 0.10            # 10.2: at most 10% slower per step than the planner's best
TOLERANCE = 0.005        # 10.1: memory and step time within 0.5% of labkit.costs.planner
BYTES_TOLERANCE = 0.05   # 10.3: within 5% of the kernel's count (Gloo adds its framing)

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

_70B, _175B = SCENARIOS["llama2-70b on 128 A100 80GB"], SCENARIOS["gpt3-175b on 256 A100 80GB"]
_8B, _13B = SCENARIOS["llama3-8b on 16 H100 80GB"], SCENARIOS["llama2-13b on 32 A100 40GB"]
ESTIMATE_CASES = [  # (name, config, job, cluster, hidden)
    ("llama2-70b, TP8 x PP4 x DP4, ZeRO-1, micro-batch 1", Config(8, 4, 4, 1, 1), *_70B, False),
    ("gpt3-175b, TP8 x PP8 x DP4, ZeRO-2, micro-batch 2", Config(8, 8, 4, 2, 2), *_175B, False),
    ("hidden: ZeRO-3, no TP or PP", Config(1, 1, 16, 3, 2), *_8B, True),
    ("hidden: TP across nodes", Config(16, 2, 4, 0, 1), *_70B, True),
    ("hidden: ZeRO-3, short sequences", Config(8, 1, 16, 3, 1),
     Job("llama2-70b", global_batch=64, seq_len=512, recipe="mixed"), _70B[1], True),
    ("hidden: fewer micro-batches than stages", Config(1, 8, 4, 1, 1),
     Job("llama2-13b", global_batch=16, seq_len=4096, recipe="mixed"), _13B[1], True),
    ("hidden: 40 layers on 3 stages", Config(8, 3, 1, 0, 4),
     Job("llama2-13b", global_batch=96, seq_len=4096, recipe="mixed"),
     Cluster(24, gpus_per_node=8, gpu="A100 80GB"), True),
]
FORBIDDEN = ("labkit.costs.planner", "labkit.costs.memory", "labkit.costs.pipeline",
             "labkit.costs.comm", "labkit.costs.zero", "labkit.costs.parallel",
             "labkit.costs.tensor_parallel", "labkit.parallel")


@contextlib.contextmanager
def _refuse_planner():
    """While the reader's code runs, the functions that ARE the answer raise."""
    from labkit.costs import memory

    def refuse(name):
        def f(*args, **kwargs):
            raise RuntimeError(f"{name} was called: write the estimate from the formulas and "
                               f"search with it yourself (costs.models, costs.activations and "
                               f"costs.flops may help)")
        return f
    saved = [(P, n, getattr(P, n)) for n in ("evaluate", "plan", "candidates")]
    saved += [(memory, n, getattr(memory, n)) for n in ("plan", "model_states")]
    for mod, n, _ in saved:
        setattr(mod, n, refuse(f"{mod.__name__}.{n}"))
    try:
        yield
    finally:
        for mod, n, f in saved:
            setattr(mod, n, f)


def _forbidden(*fns) -> list:
    """labkit.check.guards' reading, plus `from labkit.costs import planner`-style imports."""
    import ast
    import inspect
    import textwrap

    from labkit.check.guards import forbidden_used

    found = set(forbidden_used(list(fns), FORBIDDEN, {"evaluate", "candidates"}))
    for fn in fns:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            continue
        found |= {f"{n.module}.{a.name}" for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.module for a in n.names
                  if f"{n.module}.{a.name}".startswith(FORBIDDEN)}
    return sorted(found)


# ----------------------------------------------------------------------------- 10.1
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
    c = Checker("10.1", *EXERCISES["10.1"])
    bad = _forbidden(estimate)
    for name, config, job, cluster, hidden in ESTIMATE_CASES:
        with c.case("hidden case" if hidden else name):
            if bad:
                fail(f"your estimator uses {', '.join(bad)}: write it from the formulas")
            want = P.evaluate(config, job, cluster)
            with _refuse_planner():
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


# ----------------------------------------------------------------------------- 10.2
def judge(config, job: Job, cluster: Cluster, margin: float = MARGIN) -> P.Estimate:
    """Assert `config` is a sound plan for (job, cluster); the hint says what to change.

    Shared by the checkers and the tests."""
    if not isinstance(config, Config):
        fail(f"return a labkit.costs.plan_inputs.Config(tp=..., pp=..., dp=..., zero=..., "
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
    c = Checker("10.2", *EXERCISES["10.2"])
    bad = _forbidden(search)
    cases = list(SCENARIOS.items()) + [("hidden case", HIDDEN_SCENARIO)]
    for name, (job, cluster) in cases:
        with c.case(name):
            if bad:
                fail(f"your search uses {', '.join(bad)}: search with your own estimator")
            with _refuse_planner():
                config = search(job, cluster, estimate)
            judge(config, job, cluster)
            if name != "hidden case":
                c.cases[-1]["name"] += f": {config}"
    return c.finish()


# ----------------------------------------------------------------------------- 10.3
HYBRID_CFG = dict(n_layer=2, n_embd=64, n_head=4, block_size=16)
HYBRID_CASES = [  # (dp, tp, zero, global batch, hidden)
    (2, 2, 0, 8, False),
    (4, 1, 1, 8, False),
    (2, 2, 1, 7, True),          # 7 rows: replicas of 4 and 3, so their TP traffic differs
]


_MEASURED: dict = {}     # (dp, tp, zero, batch) -> the ranks' results: one run per process


def _measured(c, dp, tp, zero, batch) -> list:
    """labkit.parallel's step on real processes, run once per case and process: the bytes do
    not depend on the reader's code, so a re-run of the check (or a test) reuses the count."""
    from labkit.parallel import Plan

    key = (dp, tp, zero, batch)
    if key not in _MEASURED:
        _MEASURED[key] = c.launch(_hybrid_job, dp * tp, args=(Plan(dp=dp, tp=tp, zero=zero),
                                                               HYBRID_CFG, batch), timeout=90)
    return _MEASURED[key]


def _hybrid_job(plan, cfg_kwargs, batch):
    from labkit.parallel.job import train

    return train(plan, cfg_kwargs, steps=1, batch=batch, capture_grads=False)


def _bytes_hint(got, measured, wire: dict, rows, batch, tp, dp, zero) -> str:
    """Name the likely mistake by the prediction it would give (ring wire bytes per term)."""
    said = f"predicted {got:,.0f} B, measured {measured:,} B. "
    close = lambda x: abs(got - x) <= BYTES_TOLERANCE * max(x, 1)  # noqa: E731
    t, d = wire["tp"], wire["dp"]
    t_pay = t * tp / (2 * (tp - 1)) if tp > 1 else 0.0        # what the all-reduces were handed
    d_pay = d * dp / ((1 if zero else 2) * (dp - 1)) if dp > 1 else 0.0
    variants = [
        (tp > 1 and close(t / 2 + d), "Tensor parallelism: how many all-reduces per block in the "
         "forward (Megatron's g), and how many in the backward (f)?"),
        (tp > 1 and rows != batch and close(t * batch / rows + d), "Whose rows does a TP group "
         "all-reduce: the global batch's, or its data-parallel replica's?"),
        (close(t_pay + d_pay), "That is what the collectives were handed (the payload). How many "
         "bytes does each rank of a ring put on the wire for an all-reduce of D bytes, and for "
         "a reduce-scatter or an all-gather?"),
        (dp > 1 and zero and close(t + 1.5 * d), "ZeRO-1 reduce-scatters the gradients and "
         "all-gathers the updated weights: is that more traffic than plain DP's all-reduce? "
         "(1.5x is ZeRO-3's.)"),
        (dp > 1 and close(t + d / 2), "Data parallelism: a ring all-reduce runs two phases; "
         "what does each send?"),
    ]
    for hit, hint in variants:
        if hit:
            return said + hint
    return said + (f"Count per step: the TP all-reduces of this replica's {rows} rows of "
                   f"activations in every block, both passes; the DP reduction of the "
                   f"parameters this rank holds; what a ring sends of each.")


@graded("10.3")
def hybrid_bytes(predict):
    """Exercise 10.3: predict(cfg, dp, tp, zero, rows, local_params) -> bytes one rank sends in
    one training step (ring collectives; the loss's own tiny reduction left out)."""
    from labkit.costs import parallel as pc
    from labkit.model import GPTConfig

    c = Checker("10.3", *EXERCISES["10.3"])
    bad = _forbidden(predict)
    cfg = GPTConfig(**HYBRID_CFG)
    for dp, tp, zero, batch, hidden in HYBRID_CASES:
        name = "hidden case" if hidden else (
            f"DP {dp} x TP {tp}, ZeRO-{zero}, global batch {batch}, GPT {HYBRID_CFG}")
        with c.case(name):
            if bad:
                fail(f"your prediction uses {', '.join(bad)}: derive the bytes yourself")
            local = sum(pc.stage_param_numels(cfg, tp, 1, 0))
            got = {}                                   # replica -> YOUR bytes, before any run
            for replica in range(dp):
                rows = pc.rows_of(batch, dp, replica)
                got[replica] = predict(cfg, dp, tp, zero, rows, local)
                if not isinstance(got[replica], (int, float)):
                    fail("return one number: the bytes this rank sends in one step")
            res = _measured(c, dp, tp, zero, batch)
            if res[0]["kernel_sent"] is None:
                fail("the kernel's counter cannot count here (not Gloo over TCP)")
            lines = []
            for rank, r in enumerate(res):
                replica = r["coords"]["dp"]
                rows = pc.rows_of(batch, dp, replica)
                wire = pc.wire_bytes(cfg, dp, tp, 1, zero, batch, 0, replica)
                measured = r["kernel_sent"]
                if abs(sum(wire.values()) / measured - 1) > BYTES_TOLERANCE:
                    fail(f"labkit.costs.parallel says {sum(wire.values()):,.0f} B, the kernel "
                         f"{measured:,} B: the checker disagrees with itself (please report it)")
                lines.append(f"\n      rank {rank} (replica {replica}, {rows} rows): predicted "
                             f"{got[replica]:,.0f} B, measured {measured:,} B, "
                             f"labkit.costs.parallel {sum(wire.values()):,.0f} B")
                if abs(got[replica] / measured - 1) > BYTES_TOLERANCE:
                    fail(f"rank {rank}: " + _bytes_hint(got[replica], measured, wire, rows, batch,
                                                        tp, dp, zero))
            if not hidden:
                c.cases[-1]["name"] += "".join(lines[:2])
    return c.finish()
