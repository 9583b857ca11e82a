"""The reference GPT's training step on this machine: time, tokens/s, MFU, and recomputation.

    from labkit.calibrate import compute
    compute.step(cfg, batch, "cpu", steps=3)        # {"step_s", "tokens_per_s", "model_flops", ...}
    compute.mfu(res, peak)                          # model FLOP/s over a peak
    compute.recompute(cfg, batch, "cpu", repeats=3)

The recipe is what a reader would run: on a GPU `torch.autocast(bf16)` around the forward and
fused AdamW (measured on one H200: 52-56% MFU, shared/gpu); on a CPU fp32 and AdamW (CPUs run
bf16 matmuls through slower paths). MFU counts model FLOPs (labkit.costs.flops: 6 N + 12 L h s
per token, N the parameters that multiply), whatever the implementation recomputes; it is given
against the measured matmul roof and, on a known GPU, against the datasheet.

Recomputation: labkit.checkpoint.activation.measure times forward + backward with every block
under torch.utils.checkpoint and without, interleaved, and gives (f + b + f)/(f + b) from its own
measured forward f and backward b: the book's prediction of the factor.
"""
from __future__ import annotations

import statistics
from contextlib import nullcontext

import torch

from labkit.checkpoint import activation as checkpointing
from labkit.costs import flops, models
from labkit.model import GPT, get_batch, tiny_corpus
from labkit.timing import now


def recipe_of(device: str) -> str:
    """The step's recipe on this device: autocast bf16 on a GPU, fp32 on a CPU."""
    return "autocast bf16, fused AdamW" if torch.device(device).type == "cuda" else "fp32, AdamW"


def model_flops_per_token(cfg) -> float:
    """6 N + 12 L h s (costs.flops), N the GPT's parameters that multiply (costs.models)."""
    spec = models.from_gpt_config(cfg)
    return flops.model_flops_per_token(models.matmul_params(spec), cfg.n_layer, cfg.n_embd,
                                       cfg.block_size)


def step(cfg, batch: int, device: str = "cpu", steps: int = 5, warmup: int = 2) -> dict:
    """Median seconds of a full training step (forward, backward, AdamW) of GPT(cfg) on `batch`
    sequences, after `warmup` steps; tokens per second and the model FLOPs of one step."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), batch, cfg.block_size, step=0))
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else nullcontext
    times = []
    for i in range(warmup + steps):
        t0 = now(dev)
        with ctx():
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(now(dev) - t0)
    s = statistics.median(times)
    tokens = batch * cfg.block_size
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"recipe": recipe_of(device), "batch": batch, "seq": cfg.block_size,
            "n_layer": cfg.n_layer, "hidden": cfg.n_embd, "step_s": s, "steps": times,
            "tokens_per_s": tokens / s, "model_flops": model_flops_per_token(cfg) * tokens}


def mfu(res: dict, peak: float | None) -> float | None:
    """Model FLOP/s of the step over `peak` FLOP/s (None without a peak)."""
    return res["model_flops"] / res["step_s"] / peak if peak else None


def recompute(cfg, batch: int, device: str = "cpu", repeats: int = 3) -> dict:
    """The measured recomputation factor (step time with every block recomputed / without) and
    the prediction (f + b + f)/(f + b) from this machine's own f and b (fp32, as measure runs)."""
    m = checkpointing.measure(cfg, batch=batch, repeats=repeats, device=device,
                              threads=None if torch.device(device).type == "cuda" else 1)
    return {"measured_factor": m["time_factor"], "predicted_factor": m["predicted_time_factor"],
            "b_over_f": m["b_over_f"], "plain_step_s": m["plain"]["step_s"],
            "recompute_step_s": m["recompute"]["step_s"], "forward_s": m["plain"]["forward_s"],
            "flops_factor": m["flops_factor"], "batch": batch, "recipe": "fp32"}
