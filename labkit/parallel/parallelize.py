"""parallelize(model, mesh, plan): the one GPT turned into this rank's part of a DP x TP x PP run.

    from labkit.parallel import Plan, build_mesh, parallelize
    plan = Plan(dp=2, tp=2, pp=2, zero=1, micro_batches=4)
    mesh = build_mesh(plan)                                    # every rank, together
    par = parallelize(GPT(cfg, seed=0).to(dev), mesh, plan, optimizer="adamw")
    loss = par.train_step(x, y)        # x, y: the whole global batch (B, T), the same on every rank

The transforms, in a fixed order (labkit's choice; torchtitan splits into pipeline stages first
and then applies TP and FSDP to each stage, which gives the same shards), each over its mesh
dimension:

  1. tp  labkit.tp.apply_tp: every block's attention (by heads) and MLP (column then row, with
         Megatron's f and g) keep this rank's slice; embeddings, norms and the head stay whole.
  2. pp  labkit.pipeline: this rank keeps the blocks of its stage (pp coordinate) and runs one
         schedule (GPipe or 1F1B) per step over its replica's rows, with K micro-batches.
  3. dp  the stage's parameters are replicated over dp. zero=0: chapter 02's DDP
         (labkit.ddp.BucketedDDP over this rank's own parameters: buckets by the book's one rule,
         `bucket_mb` MiB, all-reduced during backward); zero=1, 2, 3: labkit.zero, ZeRO-1 shards
         optimizer states, ZeRO-2 also gradients, ZeRO-3 also parameters. With pp > 1 the DDP
         buckets are all-reduced after the schedule, not during it (no overlap): the executor
         runs K backward passes and then sums the tied embedding's two halves over pp, which a
         bucket packed during backward would overwrite (BucketedDDP.synchronize_accumulated).

With a mixture of experts (GPTConfig.n_expert) and ep > 1, expert parallelism comes between tp
and pp: labkit.moe.apply_ep shards each MoE layer's experts over groups of ep consecutive dp
ranks. The experts then leave the dp transform: each expert lives on one rank of its ep group,
its gradient already holds that group's tokens, and the ranks that hold the same expert in other
ep groups ("edp") sum those gradients (then divide by dp, as the dp stage does). ZeRO applies to
the other parameters. Every MoE layer's load is summed over dp for DeepSeek-V3's bias step.

Sequence parallelism (plan.sp) replaces step 1 by labkit.context.apply_sp (TP with the norm and
residual regions split along the sequence); context parallelism (plan.cp > 1) follows it, by
labkit.context.apply_cp (the sequence split over cp ranks, ring attention); each cp rank's
gradients are partial and average to the whole, so the dp stage averages over dp x cp ranks
together ("dp_cp"), as Megatron-LM does.

TP goes first because the pipeline cuts the (already sharded) blocks into stages, and DP last
because it needs the final list of parameters this rank updates. ZeRO-2 and ZeRO-3 refuse
pp > 1 (labkit.parallel.plan says why).

The global batch's rows are split over dp replicas (labkit.model.shard_rows: uneven when dp does
not divide the batch). Replica d's loss is the mean over its rows; the global loss is the mean
over all rows, so replica d's gradient is weighted by its share of rows, rows_d / B. The DP
stages average over replicas (divide by dp), so each replica scales its gradient by
dp * rows_d / B first; the average is then exactly the whole batch's gradient.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from labkit.context import apply_cp, apply_sp
from labkit.ddp import BucketedDDP
from labkit.model import shard_rows
from labkit.moe.expert_parallel import apply_ep, expert_parameters
from labkit.moe.layer import moe_layers
from labkit.observe import commlog
from labkit.pipeline import executor, schedules
from labkit.reference import optimizer_spec
from labkit.tp import apply_tp
from labkit.tp.gpt import gather_tp_tensors
from labkit.zero import ZeRO1, ZeRO2, ZeRO3


def parallelize(model, mesh, plan, optimizer: str = "adamw", bucket_mb: float | None = 25.0,
                **optimizer_overrides):
    """Apply tp, then pp, then dp to `model` (in place; the same seed on every rank).
    bucket_mb: the DDP bucket cap of zero=0 (PyTorch's bucket_cap_mb, default 25 MiB)."""
    return ParallelGPT(model, mesh, plan, optimizer, bucket_mb=bucket_mb, **optimizer_overrides)


class ParallelGPT:
    def __init__(self, model, mesh, plan, optimizer="adamw", bucket_mb: float | None = 25.0,
                 **optimizer_overrides):
        self.model, self.mesh, self.plan, self.bucket_mb = model, mesh, plan, bucket_mb
        self.dp, self.d = mesh.size("dp"), mesh.coords["dp"]
        # the group gradients are averaged over: dp, or dp x cp under context parallelism
        self.avg_group = mesh.group("dp_cp" if plan.cp > 1 else "dp")
        self.avg = self.dp * plan.cp
        # 1. tp (with sequence parallelism: sp), then cp
        if plan.sp:
            apply_sp(model, mesh.group("tp"))
        elif plan.tp > 1:
            apply_tp(model, mesh.group("tp"))
        if plan.cp > 1:
            apply_cp(model, mesh.group("cp"), layout=plan.cp_layout, method=plan.cp_method)
        # 1b. ep: experts over groups of ep dp ranks
        if getattr(plan, "ep", 1) > 1:
            apply_ep(model, mesh.group("ep"))
        self.expert_ids = expert_parameters(model)   # empty for a dense model
        # 2. pp
        self.schedule = None
        if plan.pp > 1:
            self.schedule = schedules.make(plan.schedule, plan.pp, plan.K)
            chunks = executor.build_chunks(model, self.schedule, mesh.coords["pp"])
            self.owned = executor.owned_parameters(model, chunks)     # {name: parameter}
        else:
            self.owned = dict(model.named_parameters())
        # 3. dp (capture hooks first: they must run before ZeRO-2's take the gradient away)
        self._captured, self._capturing = None, False
        self._hooks = self._capture_hooks() if self.schedule is None else []
        cls, kw = optimizer_spec(optimizer, **optimizer_overrides)
        self.dp_stage = self._dp_stage(cls, kw)
        experts = [p for p in self.owned.values() if id(p) in self.expert_ids]
        edp = mesh.group("edp" if mesh.ep > 1 else "dp")
        self.expert_stage = _ExpertDP(experts, cls, kw, edp, self.dp) if experts else None

    def _dp_stage(self, cls, kw):
        params = [p for p in self.owned.values() if id(p) not in self.expert_ids]
        group = self.avg_group
        if self.avg == 1:
            return _Local(params, cls, kw)
        if self.plan.zero == 0:
            return _DDP(self.model, params, cls, kw, group, self.bucket_mb,
                        pipelined=self.schedule is not None)
        if self.plan.zero == 1:
            return ZeRO1(params, cls, group, **kw)
        if self.plan.zero == 2:
            return ZeRO2(params, cls, group, **kw)
        return ZeRO3(self.model, cls, group, **kw)

    # ------------------------------------------------------------------------- one step
    def train_step(self, x: torch.Tensor, y: torch.Tensor, capture_grads: bool = False) -> float:
        """One optimizer step on the global batch x, y (B, T), the same on every rank. Returns
        the global batch's mean loss, on every rank. capture_grads: keep the whole batch's
        gradient of every owned parameter (summed over dp by an extra, unlogged all-reduce when
        captured_grads() reads it, outside the step) for comparison with a reference; ZeRO-3 keeps
        gradients only in its shards, so not there."""
        B, dev = x.shape[0], next(iter(self.owned.values())).device
        xs = shard_rows(x, self.d, self.dp).to(dev)                    # (B_d, T) my replica's
        ys = shard_rows(y, self.d, self.dp).to(dev)
        weight = self.dp * xs.shape[0] / B   # DP averages (over cp too: the same rows, partial)
        self.dp_stage.zero_grad()
        if self.expert_stage:
            self.expert_stage.zero_grad()
        self._capturing, self._captured = capture_grads, {} if capture_grads else None
        if self.schedule is None:
            _, loss = self.model(xs, ys)                               # mean over my rows
            (loss * weight).backward()
            loss = loss.detach()
        else:
            # the weight enters as the loss's own gradient: an expert's gradient mixes the
            # tokens of several replicas (all-to-all), each of which must carry its weight
            quiet = self.dp_stage.no_sync() if isinstance(self.dp_stage, _DDP) \
                else contextlib.nullcontext()
            with quiet:   # DDP: the K backward passes only accumulate (see the docstring)
                out = executor.run_schedule(self.schedule, self.model, xs, ys,
                                            group=self.mesh.group("pp"), check=False,
                                            loss_scale=weight)
            loss = out["loss"]                                         # last stage only
            if capture_grads:
                self._captured = {n: p.grad.clone() for n, p in self.owned.items()
                                  if p.grad is not None}
        self._capturing = False
        self._summed = False   # summed over dp when read: the step's own traffic stays the step's
        self.dp_stage.step()
        if self.expert_stage:
            self.expert_stage.step()
        self._balance_step()
        return self._global_loss(loss, weight / self.dp, dev)

    def _balance_step(self) -> None:
        """DeepSeek-V3's bias step of every MoE layer, from the load summed over all of dp."""
        for m in moe_layers(self.model):
            if not (m.bias_rate and m.step_load is not None):
                continue
            load = m.step_load.clone()
            if self.dp > 1:
                commlog.all_reduce(load, group=self.mesh.group("dp"), where="MoE load")
            m.update_bias(load)

    def _capture_hooks(self):
        """Clone each gradient as autograd finishes it, before ZeRO-2's hooks take it away."""
        names = {id(p): n for n, p in self.owned.items()}

        def keep(p):
            if self._capturing:
                self._captured[names[id(p)]] = p.grad.detach().clone()
        return [p.register_post_accumulate_grad_hook(keep) for p in self.owned.values()
                if p.requires_grad]

    def _sum_over_dp(self, grads):
        if grads is None or self.avg == 1:
            return grads
        out = {}
        for n in sorted(grads):   # same order on every replica
            expert = id(self.owned[n]) in self.expert_ids and self.mesh.ep > 1
            g = grads[n] / (self.dp if expert else self.avg)
            if not expert or self.mesh.size("edp") > 1:                 # check only: not logged
                dist.all_reduce(g, group=self.mesh.group("edp") if expert else self.avg_group)
            out[n] = g
        return out

    def _global_loss(self, loss, share, dev) -> float:
        """Sum of share-weighted replica losses, then from the last stage to every stage."""
        t = torch.zeros((), device=dev) if loss is None else loss.detach().reshape(()) * share
        if self.dp > 1:
            commlog.all_reduce(t, group=self.mesh.group("dp"), where="loss")
        if self.plan.pp > 1:
            pp = self.mesh.group("pp")
            commlog.broadcast(t, src=dist.get_global_rank(pp, self.plan.pp - 1), group=pp,
                              where="loss")
        return t.item()

    # ------------------------------------------------------------------------- read back
    def captured_grads(self) -> dict:
        """The last capture_grads step's whole-batch gradients, full (gathered over tp), by the
        one-process GPT's names; only the parameters this pipeline stage owns."""
        if self._captured is None:
            raise RuntimeError("call train_step(..., capture_grads=True) first")
        if not self._summed:       # a collective: every rank reads its capture
            self._captured, self._summed = self._sum_over_dp(self._captured), True
        return self._full(lambda name, p: self._captured.get(name))

    def full_params(self) -> dict:
        """This stage's parameters, full (gathered over tp, and over dp for ZeRO-3)."""
        if self.plan.zero == 3 and self.avg > 1:
            gathered = self.dp_stage.full_parameters()                  # {name: tp shard}
            return self._full(lambda name, p: gathered[name])
        return self._full(lambda name, p: p.detach())

    def _full(self, pick) -> dict:
        local = {n: pick(n, p) for n, p in self.model.named_parameters() if n in self.owned}
        if self.plan.tp > 1:
            local = gather_tp_tensors(self.model, local)
        return {self._reference_name(n): t.detach().clone() for n, t in local.items()
                if t is not None}

    def _reference_name(self, name: str) -> str:
        """local_experts.j of an expert-parallel layer is experts.(first + j) of the reference."""
        if ".local_experts." not in name:
            return name
        head, rest = name.split(".local_experts.")
        j, tail = rest.split(".", 1)
        first = self.model.get_submodule(head).first
        return f"{head}.experts.{first + int(j)}.{tail}"


class _ExpertDP:
    """The experts' own data parallelism: sum each expert's gradient over the ranks that hold
    the same expert (edp), divide by dp (see the module docstring), step locally."""

    def __init__(self, params, cls, kw, group, dp):
        self.params, self.group, self.dp = params, group, dp
        self.optimizer = cls(params, **kw)

    def step(self):
        # an expert no token reached has no gradient; if no rank has one, it stays None, so the
        # optimizer skips it as the one-process run does (not a zero step that momentum moves)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        had = torch.tensor([p.grad is not None for p in self.params], dtype=grads[0].dtype,
                           device=grads[0].device)                       # (n_params,)
        flat = torch.cat([g.reshape(-1) for g in grads] + [had])         # one message
        if dist.get_world_size(self.group) > 1:
            commlog.all_reduce(flat, group=self.group, where="expert gradients")
        sizes = [g.numel() for g in grads]
        parts = flat[:-len(grads)].div_(self.dp).split(sizes)
        for p, g, used in zip(self.params, parts, flat[-len(grads):].tolist()):
            p.grad = g.view_as(p) if used else None
        self.optimizer.step()

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class _DDP:
    """dp with zero=0: chapter 02's BucketedDDP over this rank's own parameters, the optimizer
    on them. Without a pipeline its hooks all-reduce each bucket during backward; with one the
    K backward passes run under no_sync() and step() sends every bucket afterwards. Measured
    with the hooks left on (dp 2 x pp 2, 2 SGD steps): K=1 ends 0.047 away from one process (the
    unpacked bucket overwrites the tied embedding's sum over pp), K=2 stops at the second
    micro-batch ("gradient of 'wte.weight' became ready twice")."""

    def __init__(self, model, params, cls, kw, group, bucket_mb, pipelined: bool):
        self.params, self.pipelined = params, pipelined
        self.ddp = BucketedDDP(model, group, params=params, bucket_mb=bucket_mb)
        self.optimizer = cls(params, **kw)

    def no_sync(self):
        return self.ddp.no_sync()

    def step(self):
        if self.pipelined:
            self.ddp.synchronize_accumulated()
        else:
            self.ddp.finish_gradient_synchronization()
        self.optimizer.step()

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class _Local:
    """dp = 1: the optimizer on this rank's parameters, no communication."""

    def __init__(self, params, cls, kw):
        self.params, self.optimizer = params, cls(params, **kw)

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
