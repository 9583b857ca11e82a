"""Utilisation from what a report publishes: GPU-hours, tokens and active parameters.

    from labkit.costs import reported
    reported.deepseek_v3()            # rows: FLOPs counted three ways, against BF16 and FP8 peaks
    reported.from_gpu_hours(37e9, 14.8e12, 2.664e6, "H800 80GB")    # one row, attention aside

A report that gives GPU-hours for a number of tokens fixes the FLOP/s each GPU sustained on
average: model FLOPs / (GPU-hours * 3600). Over a peak that is an MFU, but an end-to-end one: the
hours cover everything the stage spent (every step, and whatever between steps the report counts),
so it is at most the MFU of a steady step. The FLOPs are costs.flops.model_flops_per_token's:
6 N per token for the weights (N the ACTIVE parameters of a mixture), plus, when asked, the
attention products 12 L w s per token, with w the attention width (heads x head dim; for MLA the
mean of the q/k and v head dims times the heads, so that 12 L w s = 6 L s heads (d_qk + d_v)),
not discounted for the causal mask (PaLM's and Megatron's convention) unless causal=True halves it.

DeepSeek-V3 (DeepSeek-AI, arXiv:2412.19437): 671B parameters, 37B activated per token (§4.2);
pre-trained on 14.8T tokens at a maximum sequence length of 4K (§4.2); pre-training cost 2,664K
H800 GPU-hours, 180K per trillion tokens, and 2.788M for the full training with 119K for context
extension and 5K for post-training (§1 and Table 1). MLA: 61 layers, 128 heads, per-head dims
128 (+ 64 decoupled RoPE) for queries and keys, 128 for values (§4.2). Most GEMMs run in FP8
(§3.3). The H800's peaks are ASSUMED equal to the H100 SXM's (costs.chips "H800 80GB").

Llama 3 405B (Llama Team 2024, arXiv:2407.21783 v3, §3.3.2): "an overall BF16 Model FLOPs
Utilization (MFU) of 38-43% for the configurations shown in Table 4", per-step figures on H100s.
"""
from __future__ import annotations

from labkit.costs import chips, flops

HOUR = 3600.0

DEEPSEEK_V3 = {
    "active_params": 37e9, "total_params": 671e9, "tokens": 14.8e12,
    "pretrain_gpu_hours": 2.664e6, "total_gpu_hours": 2.788e6, "gpu": "H800 80GB",
    "seq": 4096, "layers": 61, "heads": 128, "qk_head_dim": 128 + 64, "v_head_dim": 128,
    "source": "DeepSeek-V3 technical report, arXiv:2412.19437: §1 and Table 1 (2,664K GPU-hours "
              "of pre-training, 2.788M in all), §4.2 (37B of 671B active, 14.8T tokens, 4K "
              "sequences, 61 layers, 128 heads of 128 + 64 RoPE q/k dims and 128 v dims)",
}
LLAMA3_405B_MFU = (0.38, 0.43)    # BF16 MFU, arXiv:2407.21783 v3 §3.3.2, Table 4's configurations


def from_gpu_hours(n_active: float, tokens: float, gpu_hours: float, gpu, *, dtype="bf16",
                   n_layer: int = 0, attn_width: float = 0, seq: int = 0,
                   causal: bool = False) -> dict:
    """{flops_per_token, flops, gpu_s, per_gpu (FLOP/s), peak, mfu} of a run that spent
    `gpu_hours` on `tokens` tokens, against `gpu`'s dense `dtype` peak (costs.chips).
    Attention is counted when n_layer, attn_width and seq are given (causal=True halves it)."""
    for name, v in (("n_active", n_active), ("tokens", tokens), ("gpu_hours", gpu_hours)):
        if not v > 0:
            raise ValueError(f"{name}={v!r} must be positive (e.g. gpu_hours=2.664e6)")
    per_token = flops.model_flops_per_token(n_active, n_layer, attn_width, seq)
    if causal:
        per_token -= (per_token - 6.0 * n_active) / 2
    gpu_s = gpu_hours * HOUR
    per_gpu = per_token * tokens / gpu_s
    peak = chips.chip(gpu).peak_flops(dtype)
    return {"flops_per_token": per_token, "flops": per_token * tokens, "gpu_s": gpu_s,
            "per_gpu": per_gpu, "peak": peak, "mfu": per_gpu / peak}


def deepseek_v3(gpu_hours: float | None = None) -> list:
    """DeepSeek-V3's pre-training as utilisation: one row per FLOP count (6N attention aside;
    with MLA's attention at 4K tokens, no causal discount; the same halved for the causal mask)
    with its per-GPU FLOP/s and MFU against the H800's dense BF16 and FP8 peaks (the H100 SXM's,
    assumed). gpu_hours: default the report's 2.664M for pre-training."""
    d = DEEPSEEK_V3
    hours = d["pretrain_gpu_hours"] if gpu_hours is None else gpu_hours
    width = d["heads"] * (d["qk_head_dim"] + d["v_head_dim"]) / 2     # 12 L w s = 6 L s a (dqk+dv)
    attn = dict(n_layer=d["layers"], attn_width=width, seq=d["seq"])
    counts = [("6N (attention aside)", {}, False),
              ("6N + MLA attention at 4K", attn, False),
              ("6N + MLA attention, causal half", attn, True)]
    rows = []
    for label, kw, causal in counts:
        bf16 = from_gpu_hours(d["active_params"], d["tokens"], hours, d["gpu"], causal=causal,
                              **kw)
        fp8 = from_gpu_hours(d["active_params"], d["tokens"], hours, d["gpu"], dtype="fp8",
                             causal=causal, **kw)
        rows.append({"count": label, "flops_per_token": bf16["flops_per_token"],
                     "per_gpu": bf16["per_gpu"], "mfu_bf16": bf16["mfu"], "mfu_fp8": fp8["mfu"]})
    return rows
