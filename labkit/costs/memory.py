"""Bytes per GPU of training: model states under ZeRO, activations, and whether it fits.

    from labkit.costs import memory, models
    memory.model_states(7e9, recipe="mixed").total / 1e9                      # 112.0 GB
    memory.plan("llama3-8b", recipe="autocast", attention="flash", seq_len=8192).activations
    memory.model_states(13e9, recipe="no_master", zero=2, dp=8).total         # 42.25e9
    p = memory.plan("llama2-7b", recipe="mixed", zero=3, dp=8, seq_len=4096, micro_batch=1,
                    recompute="selective")
    p.total, p.fits("H100 80GB")

Units: bytes everywhere. GB = 1e9 bytes, GiB = 2**30 bytes (GPU "80GB" is in fact 80 GiB).
Psi (Ψ) is the number of parameters.

Model states (ZeRO, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models"). A precision recipe says how many bytes each parameter costs in weights,
gradients and optimizer states; it is always an explicit argument, because write-ups that quote
12, 16 or 18 bytes/param disagree only in this choice (see RECIPES). With p, g, o bytes/param and
N data-parallel ranks:

    stage 0 (DDP)      (p + g + o) Ψ                 every rank holds everything
    stage 1            (p + g) Ψ + o Ψ / N           optimizer states sharded
    stage 2            p Ψ + (g + o) Ψ / N           ... and gradients
    stage 3            (p + g + o) Ψ / N             ... and parameters (FSDP's FULL_SHARD)

For the ZeRO paper's mixed precision (2 + 2 + 12): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.

One vocabulary of recipes (RECIPES) says both what the states cost and what the activations
keep (Precision.activation_recipe, costs.activations.RECIPES):
    "fp32"       4 + 4 + 8, fp32 activations
    "autocast"   4 + 4 + 8, torch.autocast(bf16) over the fp32 model (PyTorch's usual recipe):
                 fp32 residual stream, bf16 matmul inputs and weight copies
    "mixed"      2 + 2 + 12, bf16 parameters (the ZeRO paper; FSDP2 param_dtype=bf16 activations)
    "fp32_grads" 2 + 4 + 12, bf16 parameters with fp32 gradients (Megatron --bf16)
The gradient *reduction*'s dtype (fp32 in Megatron, torchtitan and Llama 3) is a separate choice:
the planner's Job.grad_reduce.
Tensor (tp) and pipeline (pp) parallelism first divide Ψ by tp*pp (an approximation: it ignores
the small replicated norms and an embedding that sits on one stage).

Activations: labkit.costs.activations derives one layer's bytes term by term for the model's
real architecture (GELU or SwiGLU MLP, multi-head or grouped-query attention, dropout or not,
eager or fused attention, 16- or 32-bit), with Korthikanti et al.'s s b h (34 + 5 a s / h) as
the special case of a GPT layer; labkit.activation_memory checks it against saved-tensor hooks.
A pipeline stage holds L/pp layers for every micro-batch still waiting for its backward: pp of
them at the first stage under 1F1B, K under GPipe (microbatches_alive).

Whether a plan fits: its total must leave MARGIN (10%) of the GPU free, for the CUDA context,
communication buffers, the allocator's fragmentation and kernels' workspace. A plan that fills a
GPU to the last gigabyte is a plan that runs out of memory.

ZeRO's communication, offload's PCIe bytes and DeepSpeed's estimates: labkit.costs.zero.

Long because: the recipes, the model states, the activations and the plan that sums them are one
calculator, and a recipe names both what the states cost and what the activations keep.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.costs import activations as _act
from labkit.costs import chips
from labkit.costs import models as _models
from labkit.costs._check import positive_ints
from labkit.costs.lookup import lookup
from labkit.degrees import check_zero

GB = 1e9
GiB = 2**30


# ----------------------------------------------------------------------------- precision recipes
@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of weights, gradients and optimizer states (Adam) under one recipe."""
    name: str
    weights: float
    grads: float
    optimizer: float   # everything the optimizer keeps: master weights, momentum, variance, ...
    detail: str = ""
    activations: str | None = None   # what autograd keeps: "fp32", "autocast" or "bf16"
                                     # (costs.activations.RECIPES); None: from the weights' bytes

    @property
    def activation_recipe(self) -> str:
        if self.activations is not None:
            return self.activations
        return "fp32" if self.weights >= 4 else "bf16"

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def __str__(self):
        return (f"{self.name}: {self.weights:g} + {self.grads:g} + {self.optimizer:g} = "
                f"{self.total:g} bytes/param ({self.detail})")


RECIPES = {
    "fp32": Precision("fp32", 4, 4, 8,
                      "fp32 weights and gradients; Adam momentum and variance in fp32",
                      activations="fp32"),
    "autocast": Precision("autocast", 4, 4, 8,
                          "torch.autocast(bf16) over an fp32 model: fp32 weights (they are the "
                          "master copy), fp32 gradients, fp32 Adam momentum and variance; "
                          "activations as autocast keeps them", activations="autocast"),
    "mixed": Precision("mixed", 2, 2, 12,
                       "bf16/fp16 weights and gradients; fp32 master weights, momentum and "
                       "variance: the ZeRO paper's 16 bytes, K = 12", activations="bf16"),
    "no_master": Precision("no_master", 2, 2, 8,
                           "bf16 weights and gradients, fp32 momentum and variance, no fp32 "
                           "master copy of the weights"),
    "fp32_grads": Precision("fp32_grads", 2, 4, 12,
                            "bf16 weights, gradients accumulated in fp32, fp32 master weights, "
                            "momentum and variance (Megatron's --bf16 default)",
                            activations="bf16"),
    "fp16_fp32_grad_copy": Precision("fp16_fp32_grad_copy", 2, 2, 16,
                                     "fp16 weights and gradients, plus fp32 master weights, an "
                                     "fp32 copy of the gradients, momentum and variance "
                                     "(Megatron's fp16)"),
}


def get_recipe(r) -> Precision:
    """A Precision from a name in RECIPES (or a Precision, returned as is)."""
    return lookup(RECIPES, r, "precision recipe",
                  "pass Precision(name, weights, grads, optimizer) in bytes/param", given=Precision)


# ----------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer states on one GPU (and in CPU memory)."""
    params: float
    grads: float
    optimizer: float
    cpu_params: float = 0.0
    cpu_grads: float = 0.0
    cpu_optimizer: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def cpu_total(self) -> float:
        return self.cpu_params + self.cpu_grads + self.cpu_optimizer


def zero_bytes_per_param(recipe, zero: int, dp: int) -> float:
    """Bytes per parameter per GPU: (p+g+o), (p+g)+o/N, p+(g+o)/N, (p+g+o)/N for stages 0..3."""
    r = get_recipe(recipe)
    positive_ints(dp=dp)
    p, g, o = r.weights, r.grads, r.optimizer
    forms = {0: p + g + o, 1: p + g + o / dp, 2: p + (g + o) / dp, 3: (p + g + o) / dp}
    check_zero(zero)
    return forms[zero]


def model_states(n_params: float, *, recipe, zero: int = 0, dp: int = 1, tp: int = 1,
                 pp: int = 1, offload_optimizer: bool = False,
                 offload_params: bool = False, replicated: float = 0) -> ModelStates:
    """Bytes of model states per GPU for Ψ = n_params under a ZeRO stage over `dp` ranks.

    `recipe` is required (a name in RECIPES or a Precision): 12, 16 and 18 bytes/param are
    different assumptions, and the caller must say which one. tp and pp divide Ψ first.
    offload_optimizer (ZeRO-Offload, stage >= 1): optimizer states live in CPU memory, and from
    stage 2 the gradient shards too, since the CPU runs the update. offload_params (ZeRO-Infinity
    style, stage 3 only): the parameter shards live in CPU memory as well.
    replicated (stage 3): that many of the Ψ parameters (e.g. norm weights and biases,
    labkit.zero.one_dimensional) stay whole on every rank, with their gradients and optimizer
    state: they cost (p + g + o) bytes each on every rank instead of (p + g + o)/N.
    """
    r = get_recipe(recipe)
    positive_ints(dp=dp, tp=tp, pp=pp)
    check_zero(zero)
    if offload_optimizer and zero == 0:
        raise ValueError("offload_optimizer needs zero >= 1 (ZeRO-Offload partitions the "
                         "optimizer first); set zero=1, 2 or 3")
    if offload_params and not (zero == 3 and offload_optimizer):
        raise ValueError("offload_params needs zero=3 and offload_optimizer=True "
                         f"(got zero={zero}, offload_optimizer={offload_optimizer})")
    if replicated and zero != 3:
        raise ValueError(f"replicated={replicated} applies to zero=3 (stages 0-2 keep "
                         f"every parameter whole already); got zero={zero}")
    if not 0 <= replicated <= n_params:
        raise ValueError(f"replicated={replicated} must be between 0 and n_params={n_params}")
    psi = n_params / (tp * pp)
    rep = replicated / (tp * pp)              # whole on every rank: not divided by dp
    params = r.weights * ((psi - rep) / (dp if zero >= 3 else 1) + rep)
    grads = r.grads * ((psi - rep) / (dp if zero >= 2 else 1) + rep)
    optim = r.optimizer * ((psi - rep) / (dp if zero >= 1 else 1) + rep)
    cpu = dict(cpu_params=0.0, cpu_grads=0.0, cpu_optimizer=0.0)
    if offload_optimizer:
        cpu["cpu_optimizer"], optim = optim, 0.0
        if zero >= 2:
            cpu["cpu_grads"], grads = grads, 0.0
    if offload_params:
        cpu["cpu_params"], params = params, 0.0
    return ModelStates(params, grads, optim, **cpu)


# ----------------------------------------------------------------------------- activations
RECOMPUTE = _act.RECOMPUTE
MARGIN = 0.10     # share of the GPU a plan must leave free to count as fitting


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, n_heads: int, *,
                               tp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """Korthikanti et al.'s closed form for a GPT layer (costs.activations.korthikanti)."""
    return _act.korthikanti(seq_len, micro_batch, hidden, n_heads, tp=tp,
                            sequence_parallel=sequence_parallel, recompute=recompute)


def activation_bytes(spec, *, seq_len: int, micro_batch: int, tp: int = 1, pp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none",
                     microbatches_alive: int | None = None, logits: bool = True,
                     attention: str = "eager", dtype_bytes: int = 2,
                     mask_bytes: int = 1, recipe: str | None = None, head: bool = False) -> dict:
    """Peak activation bytes on one GPU: {"per_layer", "layers", "recompute_work", "logits",
    "head", "total"}, each layer counted for the model's architecture (costs.activations).

    layers: ceil(L/pp) layers x micro-batches alive (default pp, the first stage under 1F1B).
    recompute_work: under full recomputation, one layer's activations rebuilt during backward.
    logits: 4 s b V / t bytes (fp32 logits kept for the cross-entropy). With pp > 1 the layers
    peak at the first stage and the logits at the last, so their sum is an upper bound.
    attention: "eager" keeps the s x s scores (Korthikanti's count: this function's default, the
    chapters' derivations use it), "flash" a fused kernel (PyTorch's SDPA; plan's default).
    recipe: an activation recipe ("fp32", "bf16", "autocast"); None: every value dtype_bytes.
    head: add what follows the last layer besides the logits (final norm input, the output
    projection's input and, under autocast, its bf16 weight copy): costs.activations.head_terms."""
    spec = _spec(spec)
    alive = pp if microbatches_alive is None else microbatches_alive
    positive_ints(pp=pp, microbatches_alive=alive)
    kw = dict(seq_len=seq_len, micro_batch=micro_batch, tp=tp,
              sequence_parallel=sequence_parallel, attention=attention,
              dtype_bytes=dtype_bytes, mask_bytes=mask_bytes, recipe=recipe)
    per_layer = _act.layer_bytes(spec, recompute=recompute, **kw)
    layers = math.ceil(spec.n_layers / pp) * alive * per_layer
    work = _act.layer_bytes(spec, recompute="none", **kw) if recompute == "full" else 0.0
    out = 4.0 * seq_len * micro_batch * spec.vocab_size / tp if logits else 0.0
    rest = 0.0
    if head and logits:
        r = recipe or ("fp32" if dtype_bytes == 4 else "bf16")
        terms = _act.head_terms(spec, seq_len=seq_len, micro_batch=micro_batch, tp=tp,
                                sequence_parallel=sequence_parallel, recipe=r)
        rest = sum(v for k, v in terms.items() if not k.startswith("logits"))
    return {"per_layer": per_layer, "layers": layers, "recompute_work": work, "logits": out,
            "head": rest, "total": layers + work + out + rest}


# ----------------------------------------------------------------------------- one GPU's plan
GPUS = {name: c.capacity for name, c in chips.CHIPS.items()}   # bytes; sources in costs.chips


def gpu_capacity(gpu) -> float:
    """Bytes of a GPU by name in GPUS, or a number of bytes as given."""
    if isinstance(gpu, (int, float)):
        return float(gpu)
    return chips.chip(gpu, or_else="give bytes").capacity


@dataclass
class MemoryPlan:
    """Peak bytes on one GPU, by component, with the inputs that produced them."""
    params: float
    grads: float
    optimizer: float
    activations: float
    gathered: float          # ZeRO-3: one layer's full parameters, all-gathered just in time
    cpu: float
    settings: dict = field(default_factory=dict)

    COMPONENTS = ("params", "grads", "optimizer", "activations", "gathered")
    LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
              "activations": "activations", "gathered": "ZeRO-3 gathered layer"}

    @property
    def total(self) -> float:
        return sum(getattr(self, c) for c in self.COMPONENTS)

    def fits(self, gpu, margin: float = MARGIN) -> bool:
        """The total leaves `margin` (a share, default 10%) of the GPU's capacity free."""
        if not 0 <= margin < 1:
            raise ValueError(f"margin={margin}: a share of the GPU between 0 and 1 (10% is 0.1)")
        return self.total <= (1 - margin) * gpu_capacity(gpu)

    def headroom(self, gpu) -> float:
        """Bytes left on the GPU (negative: over capacity)."""
        return gpu_capacity(gpu) - self.total

    def derivation(self, unit: str = "GB") -> str:
        """Where the activation figure comes from, term by term (the settings that produced it)."""
        scale = {"GB": GB, "GiB": GiB}[unit]
        a, st = self.settings["activation_parts"], self.settings
        alive = st["microbatches_alive"] or st["pp"]
        lines = [f"one layer, one micro-batch ({st['recompute']} recomputation, "
                 f"{st['attention']} attention, {st.get('activation_recipe', 'bf16')} "
                 f"activations): {a['per_layer'] / scale:.3f} {unit}",
                 f"x {st['layers_per_stage']} layers x {alive} micro-batch(es) alive = "
                 f"{a['layers'] / scale:.2f} {unit}"]
        if a["recompute_work"]:
            lines.append(f"+ one layer rebuilt in the backward (full recomputation): "
                         f"{a['recompute_work'] / scale:.2f} {unit}")
        if a["logits"]:
            lines.append(f"+ fp32 logits 4 s b V / t: {a['logits'] / scale:.2f} {unit}")
        if a.get("head"):
            lines.append(f"+ final norm and output projection inputs: {a['head'] / scale:.2f} "
                         f"{unit}")
        lines.append(f"= activations {self.activations / scale:.2f} {unit}")
        return "\n".join(lines)

    def rows(self, unit: str = "GB") -> list:
        """[(label, value in unit)] for each component and the total."""
        scale = {"GB": GB, "GiB": GiB}[unit]
        rows = [(self.LABELS[c], getattr(self, c) / scale) for c in self.COMPONENTS]
        return rows + [("total per GPU", self.total / scale),
                       ("CPU memory per GPU", self.cpu / scale)]


def plan(model, *, recipe, zero: int = 0, dp: int = 1, tp: int = 1, pp: int = 1,
         seq_len: int | None = None, micro_batch: int = 1, recompute: str = "none",
         sequence_parallel: bool = False, offload_optimizer: bool = False,
         offload_params: bool = False, microbatches_alive: int | None = None,
         attention: str = "flash", activations: str | None = None) -> MemoryPlan:
    """Peak memory on one GPU for a model (a ModelSpec or a preset name) under a configuration.

    recipe (RECIPES or a Precision) prices the states and says what the activations keep:
    "fp32", "autocast" (torch.autocast(bf16) over fp32 weights: 16 B/param, fp32 residual stream,
    bf16 casts and weight copies) or "mixed"/"fp32_grads" (bf16 parameters: 16-bit activations).
    activations: override the recipe's activation recipe ("fp32", "autocast", "bf16").
    attention: "flash" or "sdpa" (default: PyTorch's scaled_dot_product_attention, a fused kernel
    that keeps no s x s scores) or "eager" (the scores kept, Korthikanti's count). Activations are
    counted for the model's architecture, plus the final norm, the head's input, the fp32 logits.
    Checked on an H200 (GPT h 2048, 8 layers, seq 2048, batch 4): fp32 8.733 GB measured against
    8.733 GB here, autocast 6.287 GB against 6.284 GB (tests/test_autocast_memory.py)."""
    spec = _spec(model)
    r = get_recipe(recipe)
    attention = _act.canonical_attention(attention)
    n = _models.num_params(spec)
    states = model_states(n, recipe=r, zero=zero, dp=dp, tp=tp, pp=pp,
                          offload_optimizer=offload_optimizer, offload_params=offload_params)
    seq = spec.seq_len if seq_len is None else seq_len
    act_recipe = r.activation_recipe if activations is None else activations
    parts = activation_bytes(spec, seq_len=seq, micro_batch=micro_batch, tp=tp, pp=pp,
                             sequence_parallel=sequence_parallel, recompute=recompute,
                             microbatches_alive=microbatches_alive, attention=attention,
                             recipe=act_recipe, head=True)
    act = parts["total"]
    gathered = r.weights * _models.layer_params(spec) / tp if zero == 3 else 0.0
    settings = dict(model=spec.name, n_params=n, recipe=str(r), zero=zero, dp=dp,
                    tp=tp, pp=pp, seq_len=seq, micro_batch=micro_batch, recompute=recompute,
                    sequence_parallel=sequence_parallel, offload_optimizer=offload_optimizer,
                    offload_params=offload_params, attention=attention, activation_parts=parts,
                    activation_recipe=act_recipe,
                    microbatches_alive=microbatches_alive, layers_per_stage=-(-spec.n_layers // pp))
    return MemoryPlan(states.params, states.grads, states.optimizer, act, gathered,
                      states.cpu_total, settings)


def _spec(model):
    if isinstance(model, _models.ModelSpec):
        return model
    if isinstance(model, str):
        return _models.preset(model)
    raise TypeError(f"expected a ModelSpec or a preset name ({', '.join(_models.PRESETS)}), "
                    f"got {type(model).__name__}")
