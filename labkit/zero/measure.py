"""Measured bytes per rank and bytes sent per step for ZeRO stages 0-3, next to labkit.costs.

    from labkit.launch import run
    from labkit.zero.measure import LAB_MODEL, measure_stages, rows
    per_rank = run(measure_stages, 4, args=(LAB_MODEL,))
    for r in rows(per_rank): print(r)

Used by chapter 03's lab, `labkit run zero` and `labkit bench zero`. Everything is fp32 on
CPU with AdamW: 4 bytes of weights, 4 of gradients and 8 of optimizer state (momentum, variance)
per parameter, the calculator's Precision("fp32 Adam", 4, 4, 8). The bytes are the tensors each
rank keeps after a step (before zero_grad); the traffic is what this rank's ring collectives
send in one step (labkit.zero.shard.CommCounter).
"""
from __future__ import annotations

from labkit.costs import memory
from labkit.costs import zero as costs_zero
from labkit.model import GPTConfig

# untied embeddings: every parameter belongs to exactly one ZeRO-3 unit, so the traffic is the
# textbook 3(N-1)/N Ψ (a tied embedding is gathered by two units: a little more)
LAB_MODEL = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64,
                      tie_weights=False)
FP32_ADAM = memory.Precision("fp32 Adam", 4, 4, 8, "fp32 weights and gradients, Adam m and v")
PARTS = ("params", "grads", "optimizer")


def measure_stages(cfg: GPTConfig = LAB_MODEL, stages=(0, 1, 2, 3), optimizer: str = "adamw",
                   steps: int = 2, batch_size: int = 8) -> dict:
    """Rank side: {stage: {"held": {...}, "sent": {...}, "numel": Ψ}} after `steps` steps."""
    from labkit.zero.train import sharded_train

    out = {}
    for stage in stages:
        res = sharded_train(stage, cfg, optimizer, steps=steps, batch_size=batch_size)
        out[stage] = {"held": res["held"], "sent": res["sent"], "numel": res["numel"]}
    return out


def rows(per_rank, recipe=FP32_ADAM) -> list:
    """One row per stage: measured (largest over ranks) and predicted bytes, sent and formula."""
    world = len(per_rank)
    out = []
    for stage in [k for k in per_rank[0] if k in (0, 1, 2, 3)]:   # other entries: ignored
        numel = per_rank[0][stage]["numel"]
        ms = memory.model_states(numel, recipe=recipe, zero_stage=stage, dp=world)
        pred = {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer}
        held = {k: max(r[stage]["held"][k] for r in per_rank) for k in PARTS}
        sent = max(sum(r[stage]["sent"].values()) for r in per_rank)
        formula = costs_zero.comm_per_rank(numel, stage, world,
                                            bytes_per_value=recipe.weights)["total"]
        out.append({"ranks": world, "stage": stage, "numel": numel,
                    **{f"{k}_measured": held[k] for k in PARTS},
                    **{f"{k}_predicted": pred[k] for k in PARTS},
                    "total_measured": sum(held.values()), "total_predicted": ms.total,
                    "sent_measured": sent, "sent_predicted": formula,
                    "sent_in_psi": sent / (numel * recipe.weights)})
    return out


def table(rs) -> str:
    head = (f"{'ranks':>5} {'stage':>5} {'params KB':>10} {'grads KB':>9} {'optim KB':>9} "
            f"{'total KB':>9} {'predicted':>9} {'sent KB':>8} {'Ψ vals':>6} {'predicted':>9}")
    lines = [head, "-" * len(head)]
    for r in rs:
        lines.append(f"{r['ranks']:>5} {r['stage']:>5} {r['params_measured'] / 1e3:>10.1f} "
                     f"{r['grads_measured'] / 1e3:>9.1f} {r['optimizer_measured'] / 1e3:>9.1f} "
                     f"{r['total_measured'] / 1e3:>9.1f} {r['total_predicted'] / 1e3:>9.1f} "
                     f"{r['sent_measured'] / 1e3:>8.1f} {r['sent_in_psi']:>6.2f} "
                     f"{r['sent_predicted'] / 1e3:>9.1f}")
    return "\n".join(lines)
