"""Communication and activation memory per transformer layer under TP, TP + SP and CP. Pure math.

Units: b = micro-batch (sequences), s = sequence length (tokens), h = hidden size, a = attention
heads, kv = key-value hidden size (n_kv_head * head_dim; = h without grouped-query attention),
e = bytes per element (2 for bf16/fp16, 4 for fp32). Every result is in BYTES (not elements),
per layer, per rank; "sent" means what one rank puts on its links (it receives the same).

Communication, ring algorithms (labkit.costs.comm: an all-reduce of D bytes sends 2(N-1)/N D per
rank, a reduce-scatter or an all-gather (N-1)/N D):

  TP      forward 2 all-reduces (g), backward 2 (f), each of the activations b*s*h*e
  TP + SP forward 2 all-gathers + 2 reduce-scatters, backward the same: an all-reduce IS a
          reduce-scatter then an all-gather, so the bytes equal TP's. (Plus, once per step, the
          gradients of the norm weights and row-parallel biases, 6h elements a layer: tiny.)
          That holds if each column-parallel layer keeps its gathered input (regather=False,
          the default here): activations s*b*h*(4 + 30/t + 5*a*s/(h*t)). Megatron-LM keeps only
          the sequence chunk of each column-parallel input and all-gathers it again in backward
          (regather=True: 2 more all-gathers a layer, 1.25x TP's bytes, each overlapped with the
          dX = dY W product); that is what makes its activations exactly / t.
  CP ring forward cp - 1 hops, each sending this rank's K and V chunk, 2 * b*(s/cp)*kv*e;
          backward cp - 1 hops of K/V again plus cp hops of dK/dV (the accumulators go one hop
          further, home): (2cp - 1) chunk pairs. About twice the forward.
  CP all-gather  forward all-gather of K and V (2*b*s*kv*e gathered); backward reduce-scatter of
          dK, dV (same size), plus another all-gather if K, V are not kept for backward.
CP's weights are replicated over cp, so their gradients are also summed over cp (Megatron folds
cp into the data-parallel gradient all-reduce); that is per step, not per layer, and not here.

Activations saved for backward per layer, 16-bit, GPT block with a 4h GELU MLP and dropout
(Korthikanti et al., 2022, table 2):
  none            s*b*h*(34 + 5*a*s/h)
  TP t            s*b*h*(10 + 24/t + 5*a*s/(h*t))     (norms, dropouts, residuals not split)
  TP t + SP       s*b*h*(34 + 5*a*s/h) / t             (Megatron's re-gather; keeping the
                                                       gathered inputs: 4 + 30/t + 5as/(ht))
  selective       drops the 5*a*s/h term (recompute softmax/dropout of the scores)
  full recompute  2*s*b*h (the layer input; / t with SP)
  CP cp           every term / cp: each rank holds s/cp tokens, and its scores are (s/cp) x s
  flash attention the 5*a*s/h term is gone without recomputing anything visible (the kernel
                  recomputes scores in backward, as labkit.context.tiled does)
The book's model differs (no dropout by default, GQA, bias): measure with saved-tensor hooks.
"""
from __future__ import annotations

from labkit.costs import activations, comm, tensor_parallel
from labkit.costs._check import positive_ints

RECOMPUTE = activations.RECOMPUTE


def _passes(fwd: float, bwd: float) -> dict:
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd}


def tp_layer_bytes(b: int, s: int, h: int, tp: int, bytes_per_element: int = 2) -> dict:
    """Bytes one rank sends per layer under Megatron TP: 2 all-reduces each way."""
    positive_ints(b=b, s=s, h=h, tp=tp)
    per = {p: tensor_parallel.layer_bytes_sent_per_rank(b, s, h, tp, bytes_per_element, p)
           for p in ("forward", "backward")}
    return _passes(per["forward"], per["backward"])


def sp_layer_bytes(b: int, s: int, h: int, tp: int, bytes_per_element: int = 2,
                   regather: bool = False) -> dict:
    """TP + SP: 2 all-gathers and 2 reduce-scatters of b*s*h each way (= tp_layer_bytes);
    regather=True adds the 2 backward all-gathers of the column-parallel inputs."""
    positive_ints(b=b, s=s, h=h, tp=tp)
    D = b * s * h * bytes_per_element
    gather = comm.ring_bytes_sent_per_rank("all_gather", D, tp)
    one = gather + comm.ring_bytes_sent_per_rank("reduce_scatter", D, tp)
    return _passes(2 * one, 2 * one + (2 * gather if regather else 0))


def kv_chunk_bytes(b: int, s: int, kv: int, cp: int, bytes_per_element: int = 2) -> float:
    """One rank's K and V chunk together: 2 * b * (s/cp) * kv * e."""
    return 2 * b * s / cp * kv * bytes_per_element


def cp_ring_layer_bytes(b: int, s: int, kv: int, cp: int, bytes_per_element: int = 2) -> dict:
    """Ring attention: forward cp-1 K/V hops; backward cp-1 K/V hops + cp dK/dV hops."""
    positive_ints(b=b, s=s, kv=kv, cp=cp)
    if cp == 1:
        return _passes(0.0, 0.0)
    chunk = kv_chunk_bytes(b, s, kv, cp, bytes_per_element)
    return _passes((cp - 1) * chunk, (cp - 1) * chunk + cp * chunk)


def cp_all_gather_layer_bytes(b: int, s: int, kv: int, cp: int, bytes_per_element: int = 2,
                              keep_kv: bool = True) -> dict:
    """All-gather K/V: forward all-gather, backward reduce-scatter of dK/dV (and a second
    all-gather if the gathered K, V are dropped after forward: keep_kv=False)."""
    positive_ints(b=b, s=s, kv=kv, cp=cp)
    D = 2 * b * s * kv * bytes_per_element                  # the whole K and V
    gather = comm.ring_bytes_sent_per_rank("all_gather", D, cp)
    scatter = comm.ring_bytes_sent_per_rank("reduce_scatter", D, cp)
    return _passes(gather, scatter + (0 if keep_kv else gather))


def comm_table(b: int, s: int, h: int, kv: int, degree: int, bytes_per_element: int = 2) -> list:
    """Rows (method, forward, backward, total) in bytes per layer per rank, all at one degree."""
    rows = [("TP", tp_layer_bytes(b, s, h, degree, bytes_per_element)),
            ("TP + SP", sp_layer_bytes(b, s, h, degree, bytes_per_element)),
            ("CP ring", cp_ring_layer_bytes(b, s, kv, degree, bytes_per_element)),
            ("CP all-gather", cp_all_gather_layer_bytes(b, s, kv, degree, bytes_per_element))]
    return [(name, d["forward"], d["backward"], d["total"]) for name, d in rows]


def activation_bytes(s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False, cp: int = 1,
                     recompute: str = "none", attention: str = "eager") -> float:
    """Bytes of activations one layer saves for backward on one rank (16-bit): Korthikanti's closed
    form (costs.activations.korthikanti) divided by cp, each rank holding s/cp of the tokens."""
    positive_ints(cp=cp)
    if attention not in ("eager", "flash"):
        raise ValueError(f"attention must be 'eager' or 'flash', got {attention!r}")
    if sp and tp == 1:
        raise ValueError("sequence parallelism splits over the TP group: sp=True needs tp > 1")
    return activations.korthikanti(s, b, h, a, tp=tp, sequence_parallel=sp, recompute=recompute,
                                   attention=attention) / cp


def activation_terms(s: int, b: int, h: int, a: int, tp: int = 1, sp: bool = False,
                     cp: int = 1) -> dict:
    """The stacked bar's parts, bytes: 'replicated' (norms, dropouts, residuals: 10 sbh, split
    only by SP), 'tensor-parallel' (24 sbh, split by TP), 'scores' (5 a s^2 b, split by TP);
    all divided by cp."""
    positive_ints(s=s, b=b, h=h, a=a, tp=tp, cp=cp)
    sbh = s * b * h
    return {"replicated": 10 * sbh / (tp if sp else 1) / cp,
            "tensor-parallel": 24 * sbh / tp / cp,
            "scores": 5 * a * s * s * b / tp / cp}
