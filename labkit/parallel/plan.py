"""A parallel plan, checked once against the model, the batch and the world, before any process
starts.

    from labkit.parallel import Plan, check_plan
    plan = Plan(dp=2, tp=2, pp=2, zero=1, micro_batches=4)
    check_plan(plan, cfg, world=8, batch_size=8)   # raises PlanError naming every factor

Every problem is collected and reported in one message, with what to change, so a reader fixes
the plan once instead of meeting one error per launch.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.context.layout import check_layout
from labkit.degrees import Degrees
from labkit.shard import even_sizes
from labkit.topology import Topology, TopologyError

SCHEDULES = ("gpipe", "1f1b")


class PlanError(TopologyError):
    """The plan does not fit the model, batch or world (the message lists every problem)."""


@dataclass(frozen=True, kw_only=True)
class Plan(Degrees):
    """The degrees (labkit.degrees: dp, tp, pp, cp, ep, zero, by keyword only; ep shards the
    experts over groups of ep consecutive dp ranks, labkit.moe) and how the run uses them."""
    cp_layout: str = "zigzag"      # which tokens a cp rank holds (labkit.context.layout)
    cp_method: str = "ring"        # "ring" attention or "all_gather" K/V (Llama 3)
    sp: bool = False               # Megatron sequence parallelism inside the tp group
    micro_batches: int | None = None   # per pipeline step (None: = pp)
    schedule: str = "1f1b"         # pipeline schedule when pp > 1

    @property
    def K(self) -> int:
        return self.micro_batches or self.pp

    def capacity_rows(self, batch: int) -> list:
        """Rows of each group a mixture of experts counts capacity over, in the batch's row
        order: each replica's rows (labkit.model.shard_rows), cut into the K micro-batches of a
        pipeline step when pp > 1 (a stage sees one micro-batch per forward)."""
        return [m for r in even_sizes(batch, self.dp)
                for m in (even_sizes(r, self.K) if self.pp > 1 else [r])]

    def topology(self, gpus_per_node=None) -> Topology:
        return Topology(self.world, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp,
                        zero=self.zero, gpus_per_node=gpus_per_node)

    def describe(self) -> str:
        parts = [f"{d.upper()} {getattr(self, d)}" + (" (SP)" if d == "tp" and self.sp else "")
                 for d in ("dp", "tp", "cp", "pp") if getattr(self, d) > 1] or ["one process"]
        extra = [f"ZeRO-{self.zero}"] if self.zero else []
        if self.ep > 1:
            extra.append(f"EP {self.ep} inside DP")
        if self.pp > 1:
            extra.append(f"{self.schedule.upper()}, K={self.K}")
        return " x ".join(parts) + (f" ({', '.join(extra)})" if extra else "")


def check_plan(plan: Plan, cfg, world: int | None = None, batch_size: int | None = None) -> None:
    """Raise PlanError listing every way `plan` does not fit; return None when it fits."""
    problems = plan.degrees.problems(world)       # the degrees' own rules (labkit.degrees)
    if any("positive integer" in p for p in problems):
        raise PlanError("; ".join(problems))          # the rules below multiply and divide them
    if plan.tp > 1:
        sizes = {"n_head": cfg.n_head, "n_kv_head": cfg.kv_heads,
                 "MLP hidden (ffn_mult*n_embd)": cfg.ffn_mult * cfg.n_embd}
        bad = [f"{k}={v}" for k, v in sizes.items() if v % plan.tp]
        if bad:
            problems.append(f"tp={plan.tp} does not divide {', '.join(bad)} (tensor parallelism "
                            f"splits them evenly); use a tp that divides "
                            f"{', '.join(f'{a}={b}' for a, b in sizes.items())}")
        if cfg.dropout:
            problems.append(f"tp={plan.tp} with dropout={cfg.dropout}: the book's TP has no "
                            f"per-rank RNG tracker; use dropout=0.0")
    if plan.pp > cfg.n_layer:
        problems.append(f"pp={plan.pp} stages but the model has n_layer={cfg.n_layer} blocks: "
                        f"every stage needs at least one block; use pp <= {cfg.n_layer}")
    if plan.pp > 1 and plan.schedule not in SCHEDULES:
        problems.append(f"schedule {plan.schedule!r}: choose one of {SCHEDULES}")
    if plan.zero in (2, 3) and plan.pp > 1:
        # DeepSpeed refuses the same: every micro-batch's backward would reduce-scatter its
        # gradients (ZeRO-2) or re-gather the parameters (ZeRO-3): K times the dp traffic.
        again = "reduce-scatter gradients" if plan.zero == 2 else "re-gather parameters"
        problems.append(f"ZeRO-{plan.zero} with pp={plan.pp}: a pipeline runs K backward passes "
                        f"per step, so ZeRO-{plan.zero} would {again}"
                        f" K times per step; use zero=1 (or 0) with pipeline parallelism")
    if plan.ep > 1:
        if not cfg.n_expert:
            problems.append(f"ep={plan.ep} but the model has no experts (n_expert=0): set "
                            f"n_expert in GPTConfig or use ep=1")
        elif cfg.n_expert % plan.ep:
            problems.append(f"ep={plan.ep} does not divide n_expert={cfg.n_expert}: every rank "
                            f"holds the same number of experts")
    if plan.sp:
        if plan.tp == 1:
            problems.append("sp=True with tp=1: sequence parallelism splits the sequence over "
                            "the tensor-parallel group; use tp > 1")
        elif cfg.block_size % plan.tp:
            problems.append(f"sp with tp={plan.tp}: the sequence (block_size={cfg.block_size}) "
                            f"must divide by tp")
        if cfg.n_expert:
            problems.append("sp=True with a mixture of experts: not built; use sp=False")
        if plan.cp > 1:
            problems.append("sp=True with cp > 1: both split the sequence; use one of them")
    if plan.cp > 1:
        try:
            check_layout(cfg.block_size, plan.cp, plan.cp_layout)
        except ValueError as err:
            problems.append(f"cp={plan.cp}: {err}")
        if plan.cp_method not in ("ring", "all_gather"):
            problems.append(f"cp_method {plan.cp_method!r}: choose 'ring' or 'all_gather'")
        if plan.ep > 1:
            problems.append("cp > 1 with ep > 1: not built; use one of them")
    if (plan.cp > 1 or plan.sp) and plan.pp > 1:
        problems.append(f"{'cp' if plan.cp > 1 else 'sp'} with pp={plan.pp}: the pipeline sends "
                        f"whole-sequence activations between stages, and this one is split; "
                        f"not built, use pp=1")
    if plan.ep > 1 and plan.zero == 3:
        problems.append("ZeRO-3 with ep > 1: ZeRO-3 would shard the experts over dp too; use "
                        "zero <= 2 (ZeRO applies to the parameters outside the experts)")
    if cfg.n_expert and plan.pp > 1 and cfg.aux_loss_coef:
        problems.append(f"pp={plan.pp} with aux_loss_coef={cfg.aux_loss_coef}: the pipeline's "
                        f"loss carries no balancing term; use aux_loss_coef=0 (or the "
                        f"loss-free bias, bias_update_rate) with pipeline parallelism")
    if batch_size is not None:
        if batch_size < plan.dp:
            problems.append(f"batch_size={batch_size} < dp={plan.dp}: every replica needs at "
                            f"least one row; use batch_size >= {plan.dp}")
        elif plan.pp > 1 and batch_size // plan.dp < plan.K:
            problems.append(f"each replica gets {batch_size // plan.dp} rows (at least) but the "
                            f"pipeline cuts them into K={plan.K} micro-batches: use batch_size "
                            f">= {plan.dp * plan.K} or fewer micro-batches")
    if problems:
        raise PlanError(f"the plan {plan.describe()} does not fit: " + "; ".join(problems))
