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

Two utilisations, and which FLOPs each counts (Chowdhery et al. 2022, PaLM, appendix B):

  MFU, model FLOPs utilisation = model FLOPs per second / peak. Model FLOPs are what the model
      needs, whatever the implementation does: 6 N + 12 L h s per token (model_flops_per_token).
  HFU, hardware FLOPs utilisation = FLOPs the hardware ran per second / peak: model FLOPs plus
      every recomputation (a repeated forward under full recomputation, the attention scores
      under selective recomputation or in a fused attention kernel's backward).
HFU >= MFU; a run that recomputes more raises its HFU without training any faster, which is why
a speed claim should quote MFU. Llama 3 405B reports 38-43% MFU on 8K-16K H100s (Dubey et al.
2024, table 4); well-tuned large runs sit around 0.35-0.55. Time = FLOPs / (GPUs * peak * MFU).
"""
from __future__ import annotations

from labkit.costs import chips

TFLOPS = 1e12


# Dense bf16 tensor-core peak, FLOP/s (sources in costs.chips)
PEAK_FLOPS = {name: c.peak_flops("bf16") for name, c in chips.CHIPS.items()}


def peak_flops(gpu) -> float:
    """FLOP/s of a GPU by name in PEAK_FLOPS, or a number of FLOP/s as given."""
    if isinstance(gpu, (int, float)):
        return float(gpu)
    return chips.chip(gpu, or_else="give FLOP/s").peak_flops("bf16")


def model_flops_per_token(n_params: float, n_layer: int = 0, hidden: int = 0,
                          seq: int = 0) -> float:
    """Model FLOPs per token (the numerator of MFU): 6 N for the matrix multiplies (2 forward,
    4 backward) + 12 L h s for attention's Q K^T and (probabilities) V, 4 L h s forward and twice
    that backward. N: the parameters that multiply (costs.models.matmul_params; a lookup table
    costs nothing). The causal mask is not discounted, as in PaLM's and Megatron's counts."""
    return 6.0 * n_params + 12.0 * n_layer * hidden * seq


def recompute_flops_per_token(n_params: float, n_layer: int = 0, hidden: int = 0, seq: int = 0,
                              recompute: str = "none", attention: str = "eager") -> float:
    """FLOPs per token the hardware runs again: full recomputation repeats the forward (2 N +
    4 L h s); selective recomputation repeats the attention scores and their product with V
    (4 L h s); a fused (flash) attention kernel recomputes Q K^T in its backward (2 L h s)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}: choose 'none', 'selective' or 'full'")
    if attention not in ("eager", "flash"):
        raise ValueError(f"attention={attention!r}: choose 'eager' or 'flash'")
    attn_fwd = 4.0 * n_layer * hidden * seq
    extra = {"none": 0.0, "selective": attn_fwd, "full": 2.0 * n_params + attn_fwd}[recompute]
    if attention == "flash":
        extra = extra if recompute == "full" else 0.0          # selective is what flash does
        extra += attn_fwd / 2                                  # Q K^T again in its backward
    return extra


def hardware_flops_per_token(n_params: float, n_layer: int = 0, hidden: int = 0, seq: int = 0,
                             recompute: str = "none", attention: str = "eager") -> float:
    """FLOPs per token the hardware runs (the numerator of HFU): model + recomputed FLOPs."""
    return (model_flops_per_token(n_params, n_layer, hidden, seq)
            + recompute_flops_per_token(n_params, n_layer, hidden, seq, recompute, attention))


def flops_per_token(n_params: float, n_layer: int = 0, hidden: int = 0, seq: int = 0,
                    recompute: str = "none") -> float:
    """Hardware FLOPs per token with eager attention (see hardware_flops_per_token)."""
    return hardware_flops_per_token(n_params, n_layer, hidden, seq, recompute, "eager")


def utilization(flops_per_step: float, step_s: float, n_gpus: int, gpu="A100 80GB") -> float:
    """Achieved FLOP/s over peak. Pass model FLOPs for MFU, hardware FLOPs for HFU."""
    return flops_per_step / (step_s * n_gpus * peak_flops(gpu))


def training_flops(n_params: float, tokens: float, **kw) -> float:
    """FLOPs of training on `tokens` tokens (one step: global batch * sequence length)."""
    return flops_per_token(n_params, **kw) * tokens


def compute_seconds(flops: float, n_gpus: int = 1, gpu="A100 80GB", mfu: float = 0.5) -> float:
    """Seconds for `flops` spread evenly over n_gpus at a fraction `mfu` of peak (with model
    FLOPs, `mfu` is the MFU; with hardware FLOPs it is the HFU)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu}: a fraction of peak between 0 and 1 (50% is 0.5)")
    return flops / (n_gpus * peak_flops(gpu) * mfu)


# bytes the CPU reads and writes per parameter in one Adam step: fp32 master, momentum and
# variance read and written (24), the 16-bit gradient read (2), the 16-bit weight written (2)
ADAM_BYTES_PER_PARAM = 28


def cpu_adam_s(n_params: float, cpu_bw: float, bytes_per_param: float = ADAM_BYTES_PER_PARAM):
    """Seconds of an Adam step on the CPU (ZeRO-Offload): memory-bound, so bytes touched over
    the CPU's memory bandwidth, not FLOPs (about 12 per parameter) over its FLOP/s."""
    return n_params * bytes_per_param / cpu_bw
