"""Dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018).

fp16 has 5 exponent bits: gradients below 2^-24 (about 6e-8) become 0 and those below 2^-14 lose
mantissa bits. Multiplying the loss by S multiplies every gradient by S (backward is linear), which
lifts them into fp16's range; dividing by S in fp32 before the optimizer step undoes it. Too big an
S overflows to inf, so S is found at run time:

    scale the loss by S, backward, unscale the gradients by 1/S (in fp32)
    any inf/NaN?   skip this step, S <- S * backoff (0.5), reset the count of good steps
    otherwise      step; after `growth_interval` good steps in a row, S <- S * growth (2)

These are torch.amp.GradScaler's rules, with its defaults (2^16, 2, 0.5, 2000); the tests check
that both make the same decisions on the same gradients. bf16 has fp32's 8 exponent bits and
needs no scaling.
"""
from __future__ import annotations

import torch


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0           # finite steps since the last change of scale
        self.history: list[dict] = []  # one record per update(): scale used, skipped or not

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads) -> bool:
        """Divide the gradients in place by the scale (in fp32); True when any is inf or NaN."""
        inv = torch.tensor(1.0 / self.scale, dtype=torch.float32)   # as GradScaler: fp32 1/S
        found_inf = False
        for g in grads:
            if g is None:
                continue
            g.mul_(inv.to(g.dtype))
            found_inf |= not bool(torch.isfinite(g).all())
        return found_inf

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after a step; returns True when the step should be taken."""
        self.history.append({"scale": self.scale, "skipped": bool(found_inf)})
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def step(self, optimizer: torch.optim.Optimizer, params) -> bool:
        """Unscale the params' gradients, step the optimizer unless one is inf/NaN, update S.
        Returns whether the optimizer stepped."""
        found_inf = self.unscale_([p.grad for p in params])
        take = not found_inf
        if take:
            optimizer.step()
        self.update(found_inf)
        return take
