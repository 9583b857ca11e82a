"""Chapter 09: formats, the bf16 stall, the loss scaler against GradScaler, fp8 quantizers,
bytes per parameter measured, and the checkers (full marks for a solution, wrong answers caught)."""
import math

import pytest
import torch

from labkit.check import ch09
from labkit.costs import memory
from labkit.costs import precision as cp
from labkit.labs.precision import master
from labkit.labs.precision import memory as pmem
from labkit.precision import formats, fp8
from labkit.precision.scaler import DynamicLossScaler


def test_formats_match_finfo_and_real_casts():
    assert formats.info("e4m3").max == 448 and formats.info("e5m2").max == 57344
    assert formats.info("fp16").max == 65504 and formats.info("bf16").eps == 2**-7
    one = torch.tensor([1.0 + 2**-11, 1.0 + 3 * 2**-11])      # ties: to even
    assert formats.round_tf32(one).tolist() == [1.0, 1.0 + 2**-9]
    assert torch.equal(formats.round_tf32(one), formats.cast(one, "fp16"))  # both 10 bits
    assert formats.spacing(0.02, "bf16").item() == 2**-13
    assert len(formats.representable("e4m3", 0, 1e9)) == 126   # 127 positive patterns minus NaN


def test_bf16_stall_is_deterministic_and_master_weights_move_further():
    a, b = master.run_sgd(False, steps=6), master.run_sgd(False, steps=6)
    assert a == b                                                  # bit for bit, run to run
    m = master.run_sgd(True, steps=6)
    # bf16 weights: a lost update is one below half the spacing (the formula; it differs only at
    # exact ties and at powers of two, where the spacing below is half the spacing above)
    for lost, theory in zip(a["frac_lost"], a["frac_lost_theory"]):
        assert abs(lost - theory) < 0.005 and lost > 0.3
    assert m["moved"] > 1.2 * a["moved"]


def _grads_run(cls_or_none, pattern):
    return ch09.scaler_decisions(cls_or_none, pattern)


@pytest.mark.parametrize("name", list(ch09.PATTERNS))
def test_scaler_makes_gradscalers_decisions(name):
    pat = ch09.PATTERNS[name]
    assert ch09.scaler_decisions(DynamicLossScaler, pat) == ch09.gradscaler_decisions(pat)


def test_scaler_skips_on_overflow_grows_and_backs_off():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    g = [torch.tensor([8.0, float("inf")])]
    assert s.unscale_(g) is True and s.update(True) is False and s.scale == 4.0
    assert s.update(False) and s.scale == 4.0 and s.update(False) and s.scale == 8.0
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([16.0, float("nan")])
    assert s.step(opt, [p]) is False and torch.equal(p.detach(), torch.zeros(2))
    p.grad = torch.tensor([4.0, 4.0])                                # scale 4 now
    assert s.step(opt, [p]) is True and p.detach().tolist() == [-1.0, -1.0]


def test_fp8_saturates_and_round_trips_within_half_ulp():
    big = torch.tensor([1e6, -1e6])
    assert fp8.quantize(big, "e4m3", 1.0).float().tolist() == [448.0, -448.0]
    assert fp8.quantize(big, "e5m2", 1.0).float().tolist() == [57344.0, -57344.0]
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    for fmt, half_ulp in (("e4m3", 2**-4), ("e5m2", 2**-3)):
        for y in (fp8.fake_tensor(x, fmt), fp8.fake_blocks(x, fmt)):
            normal = x.abs() > x.abs().max() * 2.0**-6               # far from subnormals
            rel = ((y - x).abs() / x.abs())[normal]
            assert rel.max() <= half_ulp + 1e-7 and rel.mean() > 0


def test_block_scaling_contains_an_outlier():
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    x[0, 3] = 1e5        # 1e5 / 448 per unit: values near 1 fall to e4m3's subnormals
    e_t = ((fp8.fake_tensor(x, "e4m3") - x).norm() / x.norm()).item()
    rest = x.clone()
    rest[0, :128] = 0
    bt, bb = fp8.fake_tensor(x, "e4m3"), fp8.fake_blocks(x, "e4m3")
    err = lambda y: ((y - x) * (rest != 0)).norm() / rest.norm()  # noqa: E731
    assert err(bb) < err(bt) / 4 and math.isfinite(e_t)


def test_fp8_linear_gradients_close_to_fp32():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128)
    for recipe in ("tensor", "block"):
        f = fp8.Fp8Linear(lin, recipe)
        x = torch.randn(8, 256, requires_grad=True)
        f(x).square().sum().backward()
        gx, gw = x.grad.clone(), lin.weight.grad.clone()
        x.grad = None
        lin.weight.grad = None
        lin(x).square().sum().backward()
        for a, b in ((gx, x.grad), (gw, lin.weight.grad)):
            assert ((a - b).norm() / b.norm()) < 0.15
        lin.zero_grad()


def test_amax_history_is_delayed():
    h = fp8.AmaxHistory(2)
    assert h.amax(torch.tensor([1.0])) == 1.0
    assert h.amax(torch.tensor([5.0])) == 1.0     # this step's amax is not used yet
    assert h.amax(torch.tensor([2.0])) == 5.0


def test_bytes_per_param_measured_and_from_memory():
    r = pmem.measure_step()
    assert r["per_param"]["weights"] == 2 and r["per_param"]["grads"] == 2
    assert r["per_param"]["master"] == 4 and 8 <= r["per_param"]["optimizer_state"] < 8.1
    assert round(r["resident_per_param"]) == cp.bytes_per_param("mixed") == 16
    assert cp.bytes_per_param("no_master") == 12 and cp.bytes_per_param("fp32_grads") == 18
    assert cp.recipe(grads="fp32").total == 18 and cp.recipe(master=False).total == 12
    assert cp.model_bytes(7e9, "mixed") == memory.model_states(7e9, recipe="mixed").total
    assert cp.bytes_per_param("fp8_weights") == 15


def _sol():
    ns = {}
    exec(_SOLUTION, ns)
    return ns


_SOLUTION = '''
import torch
class Good:
    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        self.scale, self.g, self.b, self.n, self.good = (init_scale, growth_factor,
                                                         backoff_factor, growth_interval, 0)
    def update(self, found_inf):
        if found_inf:
            self.scale *= self.b; self.good = 0; return False
        self.good += 1
        if self.good == self.n:
            self.scale *= self.g; self.good = 0
        return True
class NoReset(Good):
    def update(self, found_inf):
        if found_inf:
            self.scale *= self.b; return False
        return super().update(False)
class AlwaysStep(Good):
    def update(self, found_inf):
        super().update(found_inf); return True
def dq(q, s, block):
    return q.float() / s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[
        :q.shape[0], :q.shape[1]]
def dq_wrong(q, s, block):
    return q.float() * s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[
        :q.shape[0], :q.shape[1]]
def per_tensor(x, block):
    s = 448.0 / x.abs().max()
    return (x * s).to(torch.float8_e4m3fn), torch.full((1, 1), float(s))
def amax_over_448(x, block):
    from labkit.precision import fp8
    q, s = fp8.quantize_blocks(x, "e4m3", block)
    return q, 1.0 / s
'''


def test_checkers_pass_solutions_and_catch_wrong_answers():
    ns = _sol()
    assert ch09.loss_scaler(ns["Good"]).score == 2
    assert ch09.loss_scaler(ns["NoReset"]).score < 2
    assert ch09.loss_scaler(ns["AlwaysStep"]).score < 2
    q = lambda x, b: fp8.quantize_blocks(x, "e4m3", b)  # noqa: E731
    assert ch09.block_quantizer(q, ns["dq"]).score == 2
    assert ch09.block_quantizer(q, ns["dq_wrong"]).score == 0
    assert ch09.block_quantizer(ns["per_tensor"], ns["dq"]).score == 0
    assert ch09.block_quantizer(ns["amax_over_448"], ns["dq"]).score == 0
