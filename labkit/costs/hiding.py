"""When does communication hide behind compute? One closed-form crossover per parallel axis.

Each axis moves some bytes while some matmuls run. Communication hides when the matmuls take at
least as long as the bytes: FLOPs / C >= bytes / bandwidth, i.e. when the computation's FLOPs per
byte moved beat the link's C / bandwidth (the link's "arithmetic intensity"). Each function
solves that inequality for the quantity the reader controls and returns a `Crossover`: the value
(tokens per rank, width, or sequence per rank) at which compute and communication take equally
long, and which term binds there. The derivations follow the JAX scaling book (Austin et al.,
"How to Scale Your Model", 2025, part 5 "Training": data parallelism, FSDP and tensor
parallelism are communication-bound below a per-chip batch of C/W = 2,550 tokens, resp. above a
TP degree of F * W / C, on TPU v5p), redone for a ring over per-direction bandwidth (labkit's
and nccl-tests' convention, costs.comm): an all-reduce of D bytes costs 2(N-1)alpha +
2(N-1)/N D/bw, where the book's bidirectional W counts the two directions (W = 2 bw).

Units: C = FLOP/s one device sustains on these matmuls (peak * efficiency, or measured);
bandwidth in bytes/s per direction; alpha in seconds per message; P = parameters (that
multiply); tokens = tokens one rank processes (batch rows * sequence length).

  DP      the gradient all-reduce (2(N-1)/N * P * e_g bytes) hides under the backward (4 P
          FLOPs a token) once the tokens per rank in that backward >= (N-1)/N * e_g/2 * C/bw
          (+ alpha's share) = about C/bw for 16-bit gradients: the scaling book's condition.
          Under accumulation with no_sync only the last micro-batch's backward is left to hide it.
  ZeRO-3  per MICRO-batch: the weights' all-gather under the forward (2P FLOPs a token) and the
          second all-gather + the gradients' reduce-scatter under the backward (4P): the same
          C/bw, but paid per micro-batch, so gradient accumulation does not help it as it helps DP.
  TP      Megatron's f/g: 2 all-reduces of the b*s*h activations per layer forward, under the
          layer's 2 * 12 h^2 FLOPs a token / tp: hides (if overlapped at all: f and g block, only a
          collective matmul hides them) once h >= (tp-1) * e/6 * C/bw. Width, not batch.
  PP      one b*s*h activation per stage boundary under the stage's forward: h * layers per
          stage >= e * C / (24 bw), almost always true; PP's price is the bubble, not the link.
  PP vs ZeRO-3  PP moves activations (2 e h per token per rank), ZeRO-3 moves weights (3 (N-1)/N
          e P per micro-batch): PP moves fewer bytes below 1.5 (N-1)/N P/h tokens per micro-batch.
  CP      ring attention: each hop sends this rank's K/V chunk (2 (s/cp) kv e) while the block
          of attention it can already compute runs (4 (s/cp)^2 h FLOPs): hides once
          s/cp >= kv/h * e/2 * C/bw. The causal mask is not discounted (as costs.flops).

Gradient-reduction dtype (dp, dp_step_time, zero3: `reduce_dtype`, or the bytes `grad_bytes`):
the bytes a gradient element occupies on the wire. The default is fp32, as the common stacks
reduce: Megatron-LM's validate_args (megatron/training/arguments.py) sets
accumulate_allreduce_grads_in_fp32 under --bf16 ("bfloat16 requires gradient accumulation and
all-reduce to be done in fp32") unless --grad-reduce-in-bf16; torchtitan's
`training.mixed_precision_reduce` defaults to "float32" (passed to FSDP2's MixedPrecisionPolicy
as reduce_dtype; left unset, FSDP2 reduces in param_dtype); Llama 3 "reduce-scatter[s] gradients
in FP32 across data parallel workers in FSDP" ("The Llama 3 Herd of Models", 2024, section 3.3.2);
DDP all-reduces .grad in the parameters' dtype, fp32 under torch.autocast. bf16 reduction
(--grad-reduce-in-bf16, reduce_dtype=torch.bfloat16, DDP's bf16_compress_hook) is the opt-in
that halves the bytes, and so every DP/ZeRO crossover, at the price of summing N ranks'
gradients with bf16's 8-bit significand.

Overlap is not free: the compute that a collective overlaps runs slower (costs.scaling's
`slowdown`, OVERLAP_SLOWDOWN on a GPU; Gloo's threads take CPU cores on this machine). The
crossovers here are where the communication stops fitting; `dp_step_time` gives the step on
either side of it with that slowdown included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.costs import comm, scaling
from labkit.costs._check import positive

# FLOPs per parameter per token: 2 forward, 4 backward (Kaplan et al. 2020; costs.flops)
FORWARD_FLOPS, BACKWARD_FLOPS = 2, 4
# bytes per gradient element on the wire, by reduce dtype (fp32: the stacks' default, see above)
REDUCE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# matmul parameters of one GPT layer in units of h^2: 4h^2 attention + 8h^2 MLP (4h GELU)
LAYER_H2 = 12


@dataclass(frozen=True)
class Crossover:
    """Where compute and communication of one axis take equally long.

    value: the crossover in `unit`; above it (`hides(x)`) the communication fits under the
    compute (for "PP vs ZeRO-3": below it PP moves fewer bytes). binds: the term that sets the
    value. terms: the pieces, in seconds or bytes, for a table."""
    axis: str
    unit: str
    value: float
    binds: str
    terms: dict = field(default_factory=dict)

    def hides(self, x: float) -> bool:
        return x >= self.value

    def margin(self, x: float) -> float:
        """x / value: above 1 the communication hides, below 1 it is exposed."""
        return x / self.value if self.value > 0 else math.inf


def intensity(flops_per_s: float, bandwidth: float) -> float:
    """The link's arithmetic intensity C / bw, FLOPs per byte: how many FLOPs must run per byte
    moved for the transfer to hide (H100 at 50% of 989.5 TFLOP/s over NVLink 4's 450 GB/s:
    1,099)."""
    positive(flops_per_s=flops_per_s, bandwidth=bandwidth)
    return flops_per_s / bandwidth


def grad_wire_bytes(grad_bytes: float | None = None, reduce_dtype: str = "fp32") -> float:
    """Bytes per gradient element reduced: grad_bytes when given (it must then agree with a
    reduce_dtype other than the default), else REDUCE_BYTES[reduce_dtype]."""
    if reduce_dtype not in REDUCE_BYTES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r}: one of {sorted(REDUCE_BYTES)}, e.g. "
                         f"reduce_dtype='fp32' (the default) or 'bf16'")
    if grad_bytes is None:
        return REDUCE_BYTES[reduce_dtype]
    positive(grad_bytes=grad_bytes)
    if reduce_dtype != "fp32" and grad_bytes != REDUCE_BYTES[reduce_dtype]:
        raise ValueError(f"grad_bytes={grad_bytes} disagrees with reduce_dtype={reduce_dtype!r} "
                         f"({REDUCE_BYTES[reduce_dtype]} bytes); give one of them")
    return grad_bytes


# ----------------------------------------------------------------------------- DP
def dp(n_params: float, n: int, flops_per_s: float, bandwidth: float, alpha: float = 0.0,
       grad_bytes: float | None = None, n_buckets: int = 1, *, reduce_dtype: str = "fp32",
       tail_bytes: float = 0.0) -> Crossover:
    """Tokens per rank in the backward above which DDP's all-reduce hides under it (a step's
    tokens; under accumulation with no_sync, the last micro-batch's). Only the backward counts:
    no gradient exists during the forward.

    4 P t / C = comm  =>  t* = comm * C / (4 P), comm = n_buckets * 2(N-1) alpha + 2(N-1)/N * P
    e_g / bw (costs.scaling.comm_time). With alpha = 0: t* = (N-1)/N * e_g/2 * C/bw.
    e_g: grad_bytes, or reduce_dtype's (default fp32: 4 bytes; "bf16": 2, the opt-in).
    tail_bytes: the last bucket (the first layers and the embedding, ready when backward ends),
    whose all-reduce runs after it at any t; its time is terms["tail_s"], exposed in every step
    (dp_step_time), and not part of the crossover."""
    e = grad_wire_bytes(grad_bytes, reduce_dtype)
    positive(n_params=n_params, n=n, flops_per_s=flops_per_s, bandwidth=bandwidth)
    if n == 1:
        return Crossover("DP", "tokens per rank in the backward", 0.0,
                         "nothing to all-reduce (N = 1)", {"grad_bytes": e, "tail_s": 0.0})
    grad_bytes = e
    tail = comm.ring_allreduce_time(tail_bytes, n, alpha, bandwidth) if tail_bytes else 0.0
    latency = scaling.comm_time(0.0, n, alpha, bandwidth, n_buckets)
    total = scaling.comm_time(n_params * grad_bytes, n, alpha, bandwidth, n_buckets)
    per_token = BACKWARD_FLOPS * n_params / flops_per_s                 # backward s per token
    binds = ("bandwidth: the gradients' bytes" if total - latency >= latency
             else f"latency: {n_buckets} bucket(s) x 2(N-1) alpha")
    return Crossover("DP", "tokens per rank in the backward", total / per_token, binds,
                     {"comm_s": total, "latency_s": latency, "backward_s_per_token": per_token,
                      "grad_bytes": e, "tail_s": tail})


def dp_step_time(tokens: float, n_params: float, n: int, flops_per_s: float, bandwidth: float,
                 alpha: float = 0.0, grad_bytes: float | None = None, n_buckets: int = 1,
                 slowdown: float = 0.0, *, reduce_dtype: str = "fp32",
                 tail_bytes: float = 0.0) -> dict:
    """The predicted DDP step at `tokens` per rank: forward (2P/C a token), then the backward
    with the all-reduce under it; what does not fit is exposed, and the overlapped compute runs
    `slowdown` slower (costs.scaling.step_time). tail_bytes: the last bucket, all-reduced after
    the backward, exposed whatever `tokens` (dp's tail). Gradient bytes as dp.
    {forward, backward, comm, exposed, tail, step} s."""
    grad_bytes = grad_wire_bytes(grad_bytes, reduce_dtype)
    fwd = FORWARD_FLOPS * n_params * tokens / flops_per_s
    bwd = BACKWARD_FLOPS * n_params * tokens / flops_per_s
    c = scaling.comm_time(n_params * grad_bytes, n, alpha, bandwidth, n_buckets) if n > 1 else 0.0
    tail = comm.ring_allreduce_time(tail_bytes, n, alpha, bandwidth) if n > 1 and tail_bytes \
        else 0.0
    tail = min(tail, c)                       # the tail is part of the all-reduce's bytes
    body = c - tail                           # what can run under the backward
    overlap = min(1.0, bwd / body) if body > 0 else 0.0
    step = fwd + scaling.step_time(bwd, body, n, overlap=overlap, slowdown=slowdown) + tail
    return {"forward": fwd, "backward": bwd, "comm": c, "exposed": max(0.0, body - bwd) + tail,
            "tail": tail, "step": step}


# ----------------------------------------------------------------------------- ZeRO-3
def zero3(n_params: float, n: int, flops_per_s: float, bandwidth: float, alpha: float = 0.0,
          weight_bytes: float = 2, grad_bytes: float | None = None, n_units: int = 1, *,
          reduce_dtype: str = "fp32") -> Crossover:
    """Tokens per rank per MICRO-batch above which ZeRO-3 / FSDP's traffic hides.

    Forward: all-gather of the weights under 2P t/C. Backward: all-gather again + reduce-scatter
    of the gradients under 4P t/C. The larger of the two crossovers binds (with equal 16-bit
    weights and gradients they are equal: (N-1)/N * C/bw). n_units: one gather (and one
    reduce-scatter) per unit, each paying the ring's (N-1) alpha (as dp's n_buckets).
    Gradient bytes e_g as dp (default fp32 reduce, FSDP2's reduce_dtype=torch.float32); with
    bf16 gathers (p = 2) and alpha = 0 the backward binds at (N-1)/N * (2 + e_g)/4 * C/bw: 1.5
    (N-1)/N C/bw for fp32 reduction, (N-1)/N C/bw for bf16."""
    grad_bytes = grad_wire_bytes(grad_bytes, reduce_dtype)
    positive(n_params=n_params, n=n, flops_per_s=flops_per_s, bandwidth=bandwidth, n_units=n_units)
    if n == 1:
        return Crossover("ZeRO-3", "tokens per rank per micro-batch", 0.0, "nothing to gather")
    latency = (n_units - 1) * comm.ring_steps("all_gather", n) * alpha   # the other units' alpha
    ag = comm.ring_time("all_gather", n_params * weight_bytes, n, alpha, bandwidth) + latency
    rs = comm.ring_time("reduce_scatter", n_params * grad_bytes, n, alpha, bandwidth) + latency
    fwd = ag * flops_per_s / (FORWARD_FLOPS * n_params)
    bwd = (ag + rs) * flops_per_s / (BACKWARD_FLOPS * n_params)
    binds = ("forward: the weights' all-gather" if fwd > bwd
             else "backward: all-gather + the gradients' reduce-scatter")
    return Crossover("ZeRO-3", "tokens per rank per micro-batch", max(fwd, bwd), binds,
                     {"all_gather_s": ag, "reduce_scatter_s": rs, "forward_tokens": fwd,
                      "backward_tokens": bwd, "grad_bytes": grad_bytes})


# ----------------------------------------------------------------------------- TP
def tp(tp: int, flops_per_s: float, bandwidth: float, alpha: float = 0.0, tokens: float = 4096,
       act_bytes: float = 2, layer_h2: float = LAYER_H2) -> Crossover:
    """Hidden width h above which one layer's forward matmuls (2 * layer_h2 * h^2 * tokens / tp
    FLOPs) outlast its two Megatron all-reduces of tokens * h * e bytes.

    2 k t h^2 / (tp C) = 2 [2(tp-1) alpha + 2(tp-1)/tp t h e / bw]: a quadratic in h; with
    alpha = 0, h* = 2 (tp-1) e C / (k bw) = (tp-1) e/6 * C/bw for a GPT layer (k = 12). The
    forward binds: the backward has twice the FLOPs for the same two all-reduces. Megatron's
    f and g block, so this says when the traffic COULD hide (collective matmul, async TP)."""
    positive(tp=tp, flops_per_s=flops_per_s, bandwidth=bandwidth, tokens=tokens)
    if tp == 1:
        return Crossover("TP", "hidden width", 0.0, "no TP traffic (tp = 1)")
    a = 2 * layer_h2 * tokens / (tp * flops_per_s)
    b = 4 * (tp - 1) * tokens * act_bytes / (tp * bandwidth)
    c = 4 * (tp - 1) * alpha
    h = (b + math.sqrt(b * b + 4 * a * c)) / (2 * a)
    binds = ("forward: 2 all-reduces of b*s*h under 24 h^2 FLOPs a token / tp"
             if b * h >= c else "latency: 4(tp-1) alpha per layer")
    return Crossover("TP", "hidden width", h, binds,
                     {"allreduce_s_at_h": 2 * comm.ring_allreduce_time(tokens * h * act_bytes, tp,
                                                                        alpha, bandwidth)})


def tp_max_degree(hidden: int, flops_per_s: float, bandwidth: float, act_bytes: float = 2,
                  layer_h2: float = LAYER_H2) -> int:
    """The largest TP degree whose traffic still fits under the compute at this width (alpha = 0):
    tp - 1 <= k h bw / (2 e C)."""
    positive(hidden=hidden, flops_per_s=flops_per_s, bandwidth=bandwidth)
    return 1 + int(layer_h2 * hidden * bandwidth / (2 * act_bytes * flops_per_s))


# ----------------------------------------------------------------------------- PP
def pp(layers_per_stage: int, flops_per_s: float, bandwidth: float, act_bytes: float = 2,
       layer_h2: float = LAYER_H2) -> Crossover:
    """Hidden width above which a stage's forward (2 k h^2 * layers FLOPs a token) outlasts the
    one activation it sends on (h * e bytes a token): h* = e C / (2 k L_s bw) (alpha = 0)."""
    positive(layers_per_stage=layers_per_stage, flops_per_s=flops_per_s, bandwidth=bandwidth)
    h = act_bytes * flops_per_s / (2 * layer_h2 * layers_per_stage * bandwidth)
    return Crossover("PP", "hidden width", h, "the activation send per boundary (cheap: the "
                     "bubble, not the link, is PP's price)")


def pp_vs_zero3(hidden: int, n_params: float, n: int, weight_bytes: float = 2,
                act_bytes: float = 2) -> Crossover:
    """Tokens per micro-batch below which PP over n stages moves fewer bytes per rank than
    ZeRO-3 over n ranks: PP sends each micro-batch's activation forward and its gradient back
    (2 t h e), ZeRO-3 gathers the weights twice and reduce-scatters the gradients
    (3 (n-1)/n P e)."""
    positive(hidden=hidden, n_params=n_params, n=n)
    weights = 3 * comm.ring_bytes_sent_per_rank("all_gather", n_params * weight_bytes, n)
    t = weights / (2 * hidden * act_bytes)
    return Crossover("PP vs ZeRO-3", "tokens per micro-batch", t,
                     "ZeRO-3 moves weights (fixed per micro-batch), PP moves activations (grow "
                     "with tokens): below the value PP moves fewer bytes",
                     {"zero3_bytes": weights, "pp_bytes_per_token": 2 * hidden * act_bytes})


# ----------------------------------------------------------------------------- CP
def cp(cp: int, hidden: int, kv: int, flops_per_s: float, bandwidth: float, alpha: float = 0.0,
       act_bytes: float = 2, batch: int = 1) -> Crossover:
    """Tokens per rank (s/cp) above which each ring hop's K/V transfer hides under the block of
    attention computed meanwhile: 4 b c^2 h / C = alpha + 2 b c kv e / bw, c = s/cp.

    With alpha = 0: c* = kv/h * e/2 * C/bw (C/bw for multi-head 16-bit attention, a GQA model
    with kv = h/8 needs 8x fewer). The backward doubles both the FLOPs and the bytes (K/V again,
    then dK/dV): the same ratio, so forward and backward bind alike."""
    positive(cp=cp, hidden=hidden, kv=kv, flops_per_s=flops_per_s, bandwidth=bandwidth, batch=batch)
    if cp == 1:
        return Crossover("CP", "tokens per rank (s/cp)", 0.0, "no ring (cp = 1)")
    a = 4 * batch * hidden / flops_per_s
    b = 2 * batch * kv * act_bytes / bandwidth          # K and V of one token of the chunk, s
    c = (b + math.sqrt(b * b + 4 * a * alpha)) / (2 * a)
    binds = ("each hop's K/V chunk against its block of attention" if b * c >= alpha
             else "latency: alpha per hop")
    return Crossover("CP", "tokens per rank (s/cp)", c, binds)
