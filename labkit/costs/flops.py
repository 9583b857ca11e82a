"""Training FLOPs and the compute time of a step: pure math.

    from labkit import costs
    costs.flops.training_flops(n_params=175e9, tokens=1536 * 2048)      # 6 N D: 3.3e21 FLOPs
    costs.flops.compute_seconds(3.3e21, n_gpus=256, gpu="A100 80GB", mfu=0.5)

The rule of thumb (Kaplan et al. 2020, "Scaling Laws for Neural Language Models"): a training
step costs about 6 FLOPs per parameter per token, 2 in the forward pass (one multiply and one add
per weight) and 4 in the backward (gradients with respect to activations and to weights).
Attention's score and value products add 12 * n_layer * hidden * seq per token (the same 2 + 4
split over the 2 * n_layer * seq * hidden FLOPs of QK^T and AV in the forward). Full activation
recomputation repeats the forward: 8 N instead of 6 N, about 33% more.

MFU (model FLOPs utilisation) is the share of the GPU's peak that real training reaches: 0.35-0.55
on well-tuned large runs. Time = FLOPs / (GPUs * peak * MFU).
"""
from __future__ import annotations

TFLOPS = 1e12


# Dense bf16/fp16 tensor-core peak, FLOP/s (capacities in bytes are costs.memory.GPUS).
PEAK_FLOPS = {
    "A100 40GB": 312 * TFLOPS,
    "A100 80GB": 312 * TFLOPS,
    "H100 80GB": 989 * TFLOPS,
    "H200 141GB": 989 * TFLOPS,
}


def peak_flops(gpu) -> float:
    """FLOP/s of a GPU by name in PEAK_FLOPS, or a number of FLOP/s as given."""
    if isinstance(gpu, (int, float)):
        return float(gpu)
    if gpu not in PEAK_FLOPS:
        raise KeyError(f"unknown GPU {gpu!r}; choose one of {', '.join(PEAK_FLOPS)} or give FLOP/s")
    return PEAK_FLOPS[gpu]


def flops_per_token(n_params: float, n_layer: int = 0, hidden: int = 0, seq: int = 0,
                    recompute: str = "none") -> float:
    """Training FLOPs per token: 6N (+ attention 12 L h s), with the forward repeated under
    recomputation ('none', 'selective': attention scores only, 'full': the whole forward)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: choose 'none', 'selective' or 'full'")
    dense, attn = 6.0 * n_params, 12.0 * n_layer * hidden * seq
    if recompute == "full":
        dense, attn = dense * 8 / 6, attn * 8 / 6
    elif recompute == "selective":
        attn = attn * 8 / 6
    return dense + attn


def training_flops(n_params: float, tokens: float, **kw) -> float:
    """FLOPs of training on `tokens` tokens (one step: global batch * sequence length)."""
    return flops_per_token(n_params, **kw) * tokens


def compute_seconds(flops: float, n_gpus: int = 1, gpu="A100 80GB", mfu: float = 0.5) -> float:
    """Seconds for `flops` spread evenly over n_gpus at a fraction `mfu` of peak."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu}: a fraction of peak between 0 and 1 (50% is 0.5)")
    return flops / (n_gpus * peak_flops(gpu) * mfu)
