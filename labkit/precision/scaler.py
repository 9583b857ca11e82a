"""Dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018).

fp16 has 5 exponent bits: gradients below 2^-24 (about 6e-8) become 0 and those below 2^-14 lose
mantissa bits. Multiplying the loss by S multiplies every gradient by S (backward is linear), which
lifts them into fp16's range; dividing by S in fp32 before the optimizer step undoes it. Too big an
S overflows to inf, so S is found at run time:

    scale the loss by S, backward, unscale the gradients by 1/S (in fp32)
    any inf/NaN?   skip this step, S <- S * backoff (0.5), reset the count of good steps
    otherwise      step; after `growth_interval` good steps in a row, S <- S * growth (2),
                   unless that product is not a finite fp32 number (then S stays)

These are torch.amp.GradScaler's rules, with its defaults (2^16, 2, 0.5, 2000), down to the bits:
S is an fp32 number (GradScaler keeps it in an fp32 tensor; here a Python float that always holds
an fp32 value), each update computes S * factor in float64 and rounds once to fp32 (the C++ of
torch._amp_update_scale_), 1/S is the fp32 rounding of the float64 reciprocal, and the inf/NaN
check looks at the gradients before they are unscaled. The tests compare both step for step.
GradScaler refuses fp16 gradients ("Attempting to unscale FP16 gradients."): the optimizer should
step fp32 master weights. So does this class, unless allow_fp16=True (as torch's
ShardedGradScaler, for FSDP's low-precision gradients): then each value is unscaled in fp32 and
rounded once to fp16, never multiplied by an fp16 copy of 1/S (2^-25 is 0 in fp16). bf16 has
fp32's 8 exponent bits and needs no scaling.
"""
from __future__ import annotations

import torch


def fp32(x: float) -> float:
    """x rounded once to the nearest fp32 value (inf beyond fp32's range), as a Python float."""
    return torch.tensor(float(x), dtype=torch.float64).float().item()


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 allow_fp16: bool = False):
        self.scale = fp32(init_scale)   # GradScaler: torch.full((), init_scale, dtype=float32)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.allow_fp16 = allow_fp16
        self.good_steps = 0           # finite steps since the last change of scale
        self.history: list[dict] = []  # one record per update(): scale used, skipped or not

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads) -> bool:
        """Divide the gradients in place by the scale; True when any is inf or NaN."""
        # GradScaler: inv_scale = scale.double().reciprocal().float()
        inv = torch.tensor(1.0 / self.scale if self.scale else float("inf"),
                           dtype=torch.float64).float()
        found_inf = False
        for g in grads:
            if g is None:
                continue
            if g.dtype == torch.float16 and not self.allow_fp16:
                raise ValueError("Attempting to unscale FP16 gradients (torch.amp.GradScaler "
                                 "refuses them too): keep fp32 master weights and step those, "
                                 "or pass allow_fp16=True")
            # checked before unscaling, as GradScaler's kernel does: 1/S cannot hide an inf
            found_inf |= not bool(torch.isfinite(g).all())
            # the product in fp32, rounded once to g's dtype (fp32 math, as the kernel's opmath)
            g.copy_(g.float() * inv)
        return found_inf

    def update(self, found_inf: bool) -> bool:
        """Adjust the scale after a step; returns True when the step should be taken."""
        self.history.append({"scale": self.scale, "skipped": bool(found_inf)})
        if found_inf:
            self.scale = fp32(self.scale * self.backoff_factor)   # float64 product, one rounding
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = fp32(self.scale * self.growth_factor)
            if grown != float("inf"):   # GradScaler keeps S where S * growth overflows fp32
                self.scale = grown
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
