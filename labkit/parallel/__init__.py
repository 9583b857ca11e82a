"""Parallelisms as transforms of the one model, over a named mesh.

    from labkit.parallel import Plan, check_plan, build_mesh, parallelize
    plan = Plan(dp=2, tp=2, pp=2, zero=1)        # checked before launch: check_plan(plan, cfg, 8)
    # inside each of the 8 ranks:
    mesh = build_mesh(plan)
    par = parallelize(GPT(cfg, seed=0), mesh, plan)
    loss = par.train_step(x, y)

    labkit run hybrid --dp 2 --tp 2 --pp 2      # the 3D lab (8 processes)

Modules: plan (the plan and its one up-front check), mesh (init_device_mesh over pp, dp, tp;
groups named in observe.commlog), parallelize (tp, then pp, then dp: the transforms in order).
The rank-side training run that the lab, the tests and the benchmark share, and its comparison
with one process, are chapter 10's experiments: labkit/labs/parallel/ (job, compare).
"""
from labkit.parallel.mesh import Mesh, build_mesh
from labkit.parallel.parallelize import ParallelGPT, parallelize
from labkit.parallel.plan import Plan, PlanError, check_plan

__all__ = ["Mesh", "build_mesh", "ParallelGPT", "parallelize", "Plan", "PlanError", "check_plan"]
