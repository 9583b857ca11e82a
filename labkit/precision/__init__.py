"""Mixed precision, loss scaling and FP8, on the book's tiny GPT (chapter 09).

    formats   what fp32, tf32, bf16, fp16, e4m3 and e5m2 can hold: range, precision, spacing
    scaler    DynamicLossScaler (Micikevicius et al. 2018), decision for decision like GradScaler
    fp8       FP8 matmuls emulated on any device: per-tensor delayed scaling and DeepSeek-V3's
              1x128 / 128x128 block scaling, e4m3 forward, e5m2 gradients, fp32 accumulation
    mx        MXFP8: 32-element blocks, E8M0 scales rounded down (OCP spec) or up (TE, torchao)
    nvfp4     NVFP4: E2M1 elements, E4M3 scales per 16, an fp32 scale per tensor, the random
              Hadamard transform and stochastic rounding (Transformer Engine's reference)
    accumulate  limited-precision accumulation inside an FP8 GEMM (fast vs split), emulated

The experiments (fp8 vs bf16 per layer and loss curves, fp16 underflow and loss scaling, bf16
weights that stop learning, bytes per parameter of a real step, the MXFP8 / NVFP4 tables) live
with the lab: labkit.labs.precision.

On a CPU the fp8 code emulates the numerics (values are rounded exactly as an fp8 cast rounds
them); it says nothing about speed, which needs fp8 tensor cores.
"""
