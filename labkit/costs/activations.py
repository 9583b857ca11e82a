"""Activation bytes of one transformer layer, derived for the model's real architecture.

    from labkit.costs import activations, models
    spec = models.preset("llama3-8b")
    activations.layer_terms(spec, seq_len=8192, micro_batch=1)     # {term: bytes}, one layer
    activations.layer_bytes(spec, seq_len=8192, micro_batch=1)     # their sum
    activations.korthikanti(2048, 1, 12288, 96)                     # the paper's closed form

What autograd keeps for the backward of one layer, tensor by tensor (s sequence, b micro-batch,
h hidden, a query heads, kv = n_kv_heads * head_dim, f the MLP's hidden size; D bytes per
activation value, M bytes per dropout-mask value, t the tensor-parallel degree):

  norm inputs             2 D sbh      each norm's backward needs its input (one before attention,
                                       one before the MLP; the first is the layer's input)
  norm statistics         2 n 4 sb     fp32 per token: LayerNorm keeps mean and 1/std (n = 2),
                                       RMSNorm only 1/rms (n = 1); negligible at real h
  normalized values       2 D sbh      only for a norm that is not one fused kernel (PyTorch's
                                       nn.RMSNorm on CPU): x / rms is kept for the weight's grad
  attention input         D sbh        the normed input, shared by the q, k and v projections
  q and k                 D sb(h + kv) kept for Q K^T; with GQA the keys are kv wide, unless the
                                       implementation repeats them to h first (kv_expanded)
  v                       D sb kv      kept for (probabilities) V
  attention scores (eager attention only, the s^2 terms)
    softmax output        D a s^2 b    softmax's backward needs its output
    dropout mask          M a s^2 b    with dropout
    dropped probabilities D a s^2 b    with dropout: the input of the product with V
  log-sum-exp (fused / flash attention instead of the scores)
                          4 a s b      fp32 per query row; the scores are recomputed in backward
  attention output        D sbh        input of the output projection (the fused kernel's own
                                       output is the same storage)
  MLP input               D sbh        the normed input of the first MLP matrix
  MLP, GELU (2 matrices)  2 D sbf      GELU's input and its output (the second matrix's input)
  MLP, SwiGLU (3 matrices) 4 D sbf     gate output (SiLU's input), SiLU's output, up output, and
                                       their product (the down projection's input)
  dropout masks           2 M sbh      after the attention and MLP projections, with dropout

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") is the
special case GPT with a 4h GELU MLP, multi-head attention, eager attention and dropout, in 16-bit
with 1-byte masks (D = 2, M = 1), without the norm statistics:
  4 + 2 + 4 + 2 + 2 + 2 + 16 + 2 = 34 (times sbh) and 2 + 1 + 2 = 5 (times a s^2 b):
  s b h (34 + 5 a s / h). Llama-style models (SwiGLU with f near 8h/3, GQA, no dropout, fused
attention) keep a different count; on CPU PyTorch's dropout keeps a mask as wide as the values
(M = D). labkit.activation_memory checks every term against what autograd really saves.

Three recipes (`recipe=`): "fp32" (D = 4), "bf16", a model whose parameters are bf16 (FSDP2
param_dtype=bf16, Megatron --bf16: D = 2, the count above), and "autocast", torch.autocast(bf16)
over fp32 parameters, which keeps more than either half of fp32 suggests: an fp32 residual
stream, a bf16 cast of the input of every projection, and a bf16 copy of every weight
(autocast_terms). head_terms counts what follows the last layer (final norm, head, logits).

Tensor parallelism (Megatron) splits everything between the column- and row-parallel matrices by
t; the norm inputs and statistics, the attention and MLP inputs and the dropout masks stay whole
(Korthikanti's 10 + 24/t). Sequence parallelism splits those too (all of it / t). Selective
recomputation drops the s^2 terms; full recomputation keeps only the layer's input, D sbh.
"""
from __future__ import annotations

from labkit.costs._check import positive_ints

ATTENTION = ("flash", "sdpa", "eager")   # "sdpa": PyTorch's scaled_dot_product_attention = "flash"
RECOMPUTE = ("none", "selective", "full")
# What a recipe keeps, in bytes per value: (residual stream and norm inputs, matmul inputs and
# every other activation). "bf16": the model's parameters are bf16 (FSDP2 param_dtype=bf16,
# Megatron --bf16), so everything autograd keeps is 16-bit. "autocast": torch.autocast(bf16) over
# an fp32 model: an fp32 residual stream, bf16 matmul inputs (autocast_terms has the rest).
RECIPES = {"fp32": (4, 4), "bf16": (2, 2), "autocast": (4, 2)}


def _check(seq_len, micro_batch, tp, recompute, attention, recipe=None):
    positive_ints(seq_len=seq_len, micro_batch=micro_batch, tp=tp)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: the activation recipes are {tuple(RECIPES)} "
                         f"(fp32 model, a bf16-parameter model, torch.autocast over fp32); "
                         f"e.g. recipe='autocast'")


def canonical_attention(attention: str) -> str:
    """ "sdpa" (PyTorch's default fused kernel) counts as "flash"; "flash", "eager" as given."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    return "flash" if attention == "sdpa" else attention


def matmul_weights(spec) -> int:
    """Weights of one layer's matrix products (q, k, v, o and the MLP): what autocast casts."""
    h, kv, f = spec.hidden, spec.kv_dim, spec.ffn
    return 2 * h * h + 2 * h * kv + (3 if spec.gated_mlp else 2) * h * f


def layer_terms(spec, *, seq_len: int, micro_batch: int = 1, tp: int = 1,
                sequence_parallel: bool = False, recompute: str = "none",
                attention: str = "flash", dtype_bytes: int = 2, mask_bytes: int = 1,
                dropout: bool | None = None, kv_expanded: bool = False,
                norm_stats: bool = True, fused_norm: bool = True, recipe: str | None = None,
                fused_qkv: bool = False) -> dict:
    """Bytes autograd keeps for one layer's backward, term by term (see the module docstring).

    spec: a costs.models.ModelSpec (its gated_mlp, ffn, kv_heads, norm and dropout are used).
    attention: "flash" (a fused kernel: PyTorch's scaled_dot_product_attention, its default)
    keeps a log-sum-exp per query row; "eager" keeps the s x s scores (Korthikanti's count).
    fused_norm: the norms run as one kernel (LayerNorm always; RMSNorm in training frameworks);
    False adds the normalized values an unfused norm keeps.
    recipe: "fp32", "bf16" (bf16 parameters: every value 16-bit) or "autocast" (autocast_terms);
    None: every value is dtype_bytes wide (2 for bf16/fp16, 4 for fp32). mask_bytes: 1 for a
    fused GPU dropout (a bool mask), = dtype_bytes for PyTorch's CPU dropout. dropout: None takes
    spec.dropout. fused_qkv (autocast only): one q/k/v matrix, so one bf16 cast of its input."""
    _check(seq_len, micro_batch, tp, recompute, attention, recipe)
    attention = canonical_attention(attention)
    if recipe == "autocast":
        return autocast_terms(spec, seq_len=seq_len, micro_batch=micro_batch, tp=tp,
                              sequence_parallel=sequence_parallel, recompute=recompute,
                              attention=attention, mask_bytes=mask_bytes, dropout=dropout,
                              kv_expanded=kv_expanded, norm_stats=norm_stats,
                              fused_norm=fused_norm, fused_qkv=fused_qkv)
    D = RECIPES[recipe][1] if recipe else dtype_bytes
    s, b, h, a, f = seq_len, micro_batch, spec.hidden, spec.n_heads, spec.ffn
    kv = h if kv_expanded else spec.kv_dim
    M, t = mask_bytes, tp
    drop = spec.dropout if dropout is None else dropout
    sb = s * b
    split = t                                   # inside the column/row-parallel region
    whole = t if sequence_parallel else 1       # outside it: split only by sequence parallelism
    if recompute == "full":                     # only the layer's input survives the forward
        return {"layer input (full recomputation)": D * sb * h / whole}
    stats = 2 if spec.norm == "layernorm" else 1
    terms = {
        "norm inputs": 2 * D * sb * h / whole,
        "norm statistics": (2 * stats * 4 * sb / whole) if norm_stats else 0.0,
        "normalized values": 0.0 if fused_norm else 2 * D * sb * h / whole,
        "attention input": D * sb * h / whole,
        "q and k": D * sb * (h + kv) / split,
        "v": D * sb * kv / split,
    }
    if attention == "eager":
        if recompute == "none":
            terms["softmax output"] = D * a * s * s * b / split
            if drop:
                terms["attention dropout mask"] = M * a * s * s * b / split
                terms["dropped probabilities"] = D * a * s * s * b / split
    else:
        terms["log-sum-exp"] = 4 * a * sb / split
    terms["attention output"] = D * sb * h / split
    terms["MLP input"] = D * sb * h / whole
    if spec.gated_mlp:
        terms["SwiGLU: gate, SiLU(gate), up, product"] = 4 * D * sb * f / split
    else:
        terms["GELU input and output"] = 2 * D * sb * f / split
    if drop:
        terms["dropout masks"] = 2 * M * sb * h / whole
    return terms


def autocast_terms(spec, *, seq_len: int, micro_batch: int = 1, tp: int = 1,
                   sequence_parallel: bool = False, recompute: str = "none",
                   attention: str = "flash", mask_bytes: int = 1, dropout: bool | None = None,
                   kv_expanded: bool = False, norm_stats: bool = True, fused_norm: bool = True,
                   fused_qkv: bool = False) -> dict:
    """One layer under torch.autocast(bfloat16) over fp32 parameters, term by term.

    What autocast keeps (PyTorch's "Autocast Op Reference", docs/source/amp.md): linear and matmul
    run in bf16, so each saves a bf16 cast of its input and of its weight (the weight's cast is
    cached inside one autocast region: one copy per weight per forward); layer_norm, softmax and
    the loss are on CUDA's fp32 list, and a residual add of fp32 x and a bf16 branch promotes to
    fp32, so the residual stream, the norm inputs and the statistics stay fp32:

      norm inputs (fp32 residual stream)  2 * 4 sbh
      attention input, one bf16 cast per projection that reads it: 3 * 2 sbh for separate q, k, v
        (labkit.model, Llama in Hugging Face and torchtitan), 2 sbh for a fused qkv matrix
      q, k, v, attention output           bf16, as in the 16-bit count
      log-sum-exp (flash)                 fp32, 4 a s b
      eager scores: softmax output in fp32 (4 a s^2 b) and its bf16 cast for the product with V
        (2 a s^2 b); with dropout the mask and the dropped probabilities' bf16 cast instead
      MLP input, one bf16 cast per matrix reading it: 2 sbh (GELU), 2 * 2 sbh (SwiGLU's gate, up)
      MLP intermediates                   bf16
      bf16 weight copies                  2 bytes x the layer's matmul weights / t

    Checked against saved-tensor hooks under torch.autocast("cpu", torch.bfloat16) to the byte
    (tests/test_autocast_memory.py) and against CUDA autocast on an H200 (772.4 MB per block,
    shared/gpu). Where CPU and CUDA differ: CPU autocast does not put softmax on its fp32 list
    (an eager softmax stays bf16 there: 2 a s^2 b, no extra cast), and it puts
    scaled_dot_product_attention on its bf16 list (the same result here: its inputs are bf16
    already). For fused attention and the norms the two save the same storages."""
    s, b, h, a, f = seq_len, micro_batch, spec.hidden, spec.n_heads, spec.ffn
    kv = h if kv_expanded else spec.kv_dim
    M, t = mask_bytes, tp
    drop = spec.dropout if dropout is None else dropout
    sb = s * b
    split = t
    whole = t if sequence_parallel else 1
    if recompute == "full":                      # the block's input: the fp32 residual stream
        return {"layer input (full recomputation, fp32)": 4 * sb * h / whole}
    stats = 2 if spec.norm == "layernorm" else 1
    terms = {
        "norm inputs (fp32 residual stream)": 2 * 4 * sb * h / whole,
        "norm statistics": (2 * stats * 4 * sb / whole) if norm_stats else 0.0,
        "normalized values": 0.0 if fused_norm else 2 * 4 * sb * h / whole,
        "attention input (bf16 casts)": (1 if fused_qkv else 3) * 2 * sb * h / whole,
        "q and k": 2 * sb * (h + kv) / split,
        "v": 2 * sb * kv / split,
    }
    if attention == "eager":
        if recompute == "none":
            terms["softmax output (fp32)"] = 4 * a * s * s * b / split
            if drop:
                terms["attention dropout mask"] = M * a * s * s * b / split
            terms["probabilities (bf16 cast)"] = 2 * a * s * s * b / split
    else:
        terms["log-sum-exp"] = 4 * a * sb / split
    terms["attention output"] = 2 * sb * h / split
    mlp_reads = 2 if spec.gated_mlp else 1
    terms["MLP input (bf16 casts)"] = mlp_reads * 2 * sb * h / whole
    if spec.gated_mlp:
        terms["SwiGLU: gate, SiLU(gate), up, product"] = 4 * 2 * sb * f / split
    else:
        terms["GELU input and output"] = 2 * 2 * sb * f / split
    if drop:
        terms["dropout masks"] = 2 * M * sb * h / whole
    terms["bf16 weight copies"] = 2 * matmul_weights(spec) / t
    return terms


def head_terms(spec, *, seq_len: int, micro_batch: int = 1, tp: int = 1,
               sequence_parallel: bool = False, recipe: str = "bf16") -> dict:
    """What the model keeps after its last layer: the final norm's input and statistics, the
    output projection's input (under autocast a bf16 cast, and a bf16 copy of the V x h weight),
    and the logits the loss keeps, fp32 for every recipe (the loss is on autocast's fp32 list;
    a bf16 model's F.cross_entropy would keep them in bf16, half this)."""
    _check(seq_len, micro_batch, tp, "none", "flash", recipe)
    res, mm = RECIPES[recipe]
    sb, h, V = seq_len * micro_batch, spec.hidden, spec.vocab_size
    whole = tp if sequence_parallel else 1
    stats = 2 if spec.norm == "layernorm" else 1
    terms = {"final norm input": res * sb * h / whole, "final norm statistics": stats * 4 * sb,
             "output projection input": mm * sb * h,
             "logits (fp32, kept by the loss)": 4.0 * sb * V / tp}
    if recipe == "autocast":
        terms["output projection bf16 weight copy"] = 2.0 * V * h / tp
    return terms


def layer_bytes(spec, **kw) -> float:
    """The sum of layer_terms: bytes one layer keeps for one micro-batch."""
    return sum(layer_terms(spec, **kw).values())


def korthikanti(seq_len: int, micro_batch: int, hidden: int, n_heads: int, *, tp: int = 1,
                sequence_parallel: bool = False, recompute: str = "none",
                attention: str = "eager") -> float:
    """The paper's closed forms for a GPT layer (4h GELU MLP, dropout, 16-bit, eager attention):

        no parallelism          s b h (34 + 5 a s / h)
        tensor parallel         s b h (10 + 24/t + 5 a s / (h t))
        tensor + sequence par.  s b h (34 + 5 a s / h) / t
        selective recompute     drops the 5 a s / h term
        full recompute          2 s b h (/ t with sequence parallelism)

    attention="flash" (or "sdpa"): a fused kernel keeps no s x s scores, as selective recompute."""
    _check(seq_len, micro_batch, tp, recompute, attention)
    positive_ints(hidden=hidden, n_heads=n_heads)
    s, b, h, a, t = seq_len, micro_batch, hidden, n_heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    fused = canonical_attention(attention) == "flash"
    scores = 0.0 if recompute == "selective" or fused else 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 + scores) / t
    return sbh * (10 + 24 / t + scores / t)


def derivation(spec, **kw) -> str:
    """layer_terms as text: one line per term, in GB, with the sum (for notebooks and widgets)."""
    terms = layer_terms(spec, **kw)
    width = max(len(k) for k in terms)
    lines = [f"  {k:<{width}}  {v / 1e9:9.3f} GB" for k, v in terms.items() if v]
    lines.append(f"  {'one layer':<{width}}  {sum(terms.values()) / 1e9:9.3f} GB")
    return "\n".join(lines)
