"""Chapter 09's exercises 9.3 and 9.4: the reference solutions score full marks, the stubs score
zero, and known-wrong answers lose points for the reason they are wrong (the hint says which)."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from grading_helpers import assert_case_fails, assert_reference_full_stub_zero

from labkit.check import ch09
from labkit.check.ch09 import trainer as ch09_trainer

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these classes by value


# ----------------------------------------------------------------------------- 9.3 reference
class Scaler:                               # exercise 9.1's answer
    def __init__(self, init_scale, growth_interval):
        self.scale, self.growth_interval, self.good = float(init_scale), growth_interval, 0

    def update(self, found_inf):
        if found_inf:
            self.scale, self.good = self.scale * 0.5, 0
            return False
        self.good += 1
        if self.good == self.growth_interval:
            self.scale, self.good = self.scale * 2.0, 0
        return True


class Trainer:                              # the notebook's solution, in overridable pieces
    def __init__(self, model, lr, group=None, dtype=torch.float16, reduce_dtype=None,
                 max_norm=None, init_scale=2.0**16, growth_interval=2000):
        self.validate(dtype)
        self.model, self.lr, self.group, self.max_norm = model, lr, group, max_norm
        self.dtype, self.reduce_dtype = dtype, reduce_dtype or dtype
        self.world = dist.get_world_size(group)
        self.masters = [p.detach().clone().float() for p in model.parameters()]
        self.to_compute_dtype(model)
        self.params = list(model.parameters())
        self.trained = [(p, m) for p, m in zip(self.params, self.masters) if p.requires_grad]
        self.scaler = self.make_scaler(init_scale, growth_interval)

    def validate(self, dtype):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype}: torch.float16 or torch.bfloat16")

    def to_compute_dtype(self, model):
        model.to(self.dtype)

    def make_scaler(self, init_scale, growth_interval):
        return Scaler(init_scale, growth_interval) if self.dtype == torch.float16 else None

    def master_params(self):
        return self.masters

    def state_dict(self):
        return {"masters": [m.clone() for m in self.masters],
                "scale": self.scaler.scale if self.scaler else None,
                "good": self.scaler.good if self.scaler else None}

    def load_state_dict(self, state):
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                self.refresh(p, m)
        if self.scaler:
            self.scaler.scale, self.scaler.good = state["scale"], state["good"]

    def refresh(self, p, m):
        p.copy_(m)

    def scale(self):
        return self.scaler.scale if self.scaler else 1.0

    def backward(self, loss):
        (loss * self.scale()).backward()

    def average(self, grads):                         # -> (numel,) fp32, still scaled
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.reduce_dtype)
        flat /= self.world
        dist.all_reduce(flat, group=self.group)
        return flat.float()

    def unscale(self, grad):
        return grad / self.scale()

    def found_inf(self, grad, local):
        return not bool(torch.isfinite(grad).all())

    def clip(self, grad):
        norm = float(grad.norm())
        return grad * (self.max_norm / norm) if norm > self.max_norm else grad

    def apply(self, grad):
        offset = 0
        with torch.no_grad():
            for p, m in self.trained:
                m -= self.lr * grad[offset:offset + m.numel()].view_as(m)
                p.copy_(m)
                offset += m.numel()

    def step(self, x, y, loss_fn):
        for p in self.params:
            p.grad = None
        loss = loss_fn(self.model(x.to(self.params[0].dtype)).float(), y)
        self.backward(loss)
        local = [p.grad for p, _ in self.trained]
        grad = self.unscale(self.average(local))
        if self.scaler and not self.scaler.update(self.found_inf(grad, local)):
            return False
        self.apply(self.clip(grad))
        return True


# ----------------------------------------------------------------------------- 9.3 wrong answers
class LocalOverflowCheck(Trainer):          # found_inf from this rank's gradients only
    def found_inf(self, grad, local):
        return not all(bool(torch.isfinite(g).all()) for g in local)


class ClipBeforeUnscale(Trainer):           # the clip sees the scaled gradient
    def step(self, x, y, loss_fn):
        for p in self.params:
            p.grad = None
        self.backward(loss_fn(self.model(x.to(self.params[0].dtype)).float(), y))
        grad = self.clip(self.average([p.grad for p, _ in self.trained]))
        grad = self.unscale(grad)
        if self.scaler and not self.scaler.update(self.found_inf(grad, None)):
            return False
        self.apply(grad)
        return True


class UnscaleAfterUpdate(Trainer):          # divides by the scale update() has just grown
    def step(self, x, y, loss_fn):
        for p in self.params:
            p.grad = None
        self.backward(loss_fn(self.model(x.to(self.dtype)).float(), y))
        grad = self.average([p.grad for p, _ in self.trained])
        if self.scaler and not self.scaler.update(self.found_inf(grad, None)):
            return False
        self.apply(self.clip(self.unscale(grad)))
        return True


class NoMasterWeights(Trainer):             # the update lands on the half weights
    def apply(self, grad):
        offset = 0
        with torch.no_grad():
            for p, m in self.trained:
                p -= (self.lr * grad[offset:offset + m.numel()].view_as(m)).to(p.dtype)
                m.copy_(p.float())
                offset += m.numel()


class ScalerOnBf16(Trainer):                # bf16 scaled (and skipping on inf) like fp16
    def make_scaler(self, init_scale, growth_interval):
        return Scaler(init_scale, growth_interval)


class HalfOnTheWire(Trainer):               # "half" on the wire taken as fp16, bf16 too
    def average(self, grads):
        wire = torch.float32 if self.reduce_dtype == torch.float32 else torch.float16
        flat = torch.cat([g.reshape(-1) for g in grads]).to(wire) / self.world
        dist.all_reduce(flat, group=self.group)
        return flat.float()

    def step(self, x, y, loss_fn):              # and skips any non-finite step, bf16 too
        if self.scaler:
            return super().step(x, y, loss_fn)
        for p in self.params:
            p.grad = None
        self.backward(loss_fn(self.model(x.to(self.dtype)).float(), y))
        grad = self.average([p.grad for p, _ in self.trained])
        if not bool(torch.isfinite(grad).all()):
            return False
        self.apply(self.clip(grad))
        return True


class Fp32OnTheWire(Trainer):               # reduce_dtype ignored: always fp32
    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads]).float() / self.world
        dist.all_reduce(flat, group=self.group)
        return flat


class NeverGrows(Trainer):                  # backs off, never grows
    def make_scaler(self, init_scale, growth_interval):
        return super().make_scaler(init_scale, 10**9)


class NoLossScaling(Trainer):               # fp16 gradients of a 1e-9 loss underflow
    def scale(self):
        return 1.0


class UnscaleInHalf(Trainer):               # divide by the scale in fp16: underflow again
    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads]) / (self.scale() * self.world)
        flat = flat.to(self.reduce_dtype)
        dist.all_reduce(flat, group=self.group)
        return flat.float() * self.scale()   # "unscale" sees the underflowed values


class SumNotMean(Trainer):                  # the wrong reduction: a sum over ranks
    def average(self, grads):
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.reduce_dtype)
        dist.all_reduce(flat, group=self.group)
        return flat.float()


class ClipGradNormEps(Trainer):             # torch's clip_grad_norm_: + 1e-6 on a 1e-8 norm
    def clip(self, grad):
        g = grad.clone().requires_grad_()
        g.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_([g], self.max_norm)
        return g.grad


class NeverSkips(Trainer):                  # the overflowed step is applied anyway
    def step(self, x, y, loss_fn):
        for p in self.params:
            p.grad = None
        self.backward(loss_fn(self.model(x.to(self.dtype)).float(), y))
        grad = self.unscale(self.average([p.grad for p, _ in self.trained]))
        if self.scaler:
            self.scaler.update(self.found_inf(grad, None))
        self.apply(self.clip(grad))
        return True


class KeepsFp32(Trainer):                   # computes in fp32: no half copy
    def to_compute_dtype(self, model):
        pass


class AcceptsFp32(Trainer):                 # no error for a dtype that makes no sense here
    def validate(self, dtype):
        pass


class ResumeForgetsScale(Trainer):          # the checkpoint holds the masters only
    def load_state_dict(self, state):
        super().load_state_dict({**state, "scale": 2.0**16, "good": 0})


class ResumeForgetsGoodSteps(Trainer):      # the scale, but not its count of good steps
    def load_state_dict(self, state):
        super().load_state_dict({**state, "good": 0})


class ResumeKeepsStaleCopy(Trainer):        # masters loaded, the model left as it was built
    def refresh(self, p, m):
        pass


class NoStateDict(Trainer):
    state_dict = None


class UsesGradScaler(Trainer):
    def backward(self, loss):
        torch.amp.GradScaler("cpu").scale(loss).backward()


# (class, the case that must fail: index in ch09_trainer.CHECKS, a phrase of its hint)
WRONG = [
    (LocalOverflowCheck, 1, "every rank must skip"),
    (ClipBeforeUnscale, 3, "before the clip"),
    (UnscaleAfterUpdate, 3, "one update() has just changed"),
    (NoMasterWeights, 3, "exactly torch.float16 values"),
    (ScalerOnBf16, 5, "needs no loss scale"),
    (HalfOnTheWire, 5, "passed fp16's max"),
    (Fp32OnTheWire, 4, "About twice"),
    (NeverGrows, 1, "should have grown"),
    (NoLossScaling, 1, "The loss was not scaled"),
    (UnscaleInHalf, 3, "in fp32"),
    (SumNotMean, 3, "summed"),
    (ClipGradNormEps, 3, "clip_grad_norm_"),
    (NeverSkips, 3, "NaN"),
    (KeepsFp32, 0, "copy"),
    (AcceptsFp32, 0, "ValueError"),
    (ResumeForgetsScale, 6, "Is the loss scale part of the state"),
    (ResumeForgetsGoodSteps, 6, "count of good steps"),
    (ResumeKeepsStaleCopy, 6, "refresh the model"),
    (NoStateDict, 6, "TypeError"),
]


# ----------------------------------------------------------------------------- 9.3 tests
def test_trainer_stub_scores_zero():
    class Stub:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError("Exercise 9.3: write your code here")
    assert ch09.mixed_precision_trainer(Stub).score == 0


@pytest.fixture(scope="module")
def results():
    """The reference and every known-wrong trainer on 2 ranks, in one launch (the notebook's
    solution is graded on every case, the hidden ones too, by tests/test_exercises.py)."""
    classes = [Trainer] + [w[0] for w in WRONG]
    return dict(zip(classes, ch09_trainer.train_many(classes, 2)))


def test_trainer_reference_scores_full(results):
    res = ch09_trainer.mixed_precision_trainer(Trainer, launched={2: results[Trainer]})
    assert res.score == res.points and len(res.cases) == len(ch09_trainer.CHECKS), res.table()


@pytest.mark.parametrize("cls,case,needle", WRONG, ids=[w[0].__name__ for w in WRONG])
def test_trainer_wrong_answers_fail_with_their_hint(results, cls, case, needle):
    res = ch09_trainer.mixed_precision_trainer(cls, launched={2: results[cls]})
    assert not res.cases[case]["passed"], res.table()
    assert needle in res.cases[case]["message"], res.table()
    assert res.score < res.points


def test_trainer_refuses_torch_amp():
    res = ch09_trainer.mixed_precision_trainer(UsesGradScaler, launched={2: None})
    assert res.score == 0 and "yourself" in res.cases[0]["message"], res.table()


# ----------------------------------------------------------------------------- 9.4
PER = {"fp32": (4, 4, 8), "mixed": (2, 2, 12), "fp32_grads": (2, 4, 12),
       "fp16_fp32_grad_copy": (2, 2, 16)}


def predict(n, recipe):
    return dict(zip(("weights", "grads", "optimizer"), (b * n for b in PER[recipe])))


def predict_without_master(n, recipe):      # Adam's m and v only
    got = predict(n, recipe)
    if recipe != "fp32":
        got["optimizer"] -= 4 * n
    return got


def predict_grads_in_weight_dtype(n, recipe):
    got = predict(n, recipe)
    got["grads"] = got["weights"]
    return got


def predict_bits(n, recipe):
    return {k: 8 * v for k, v in predict(n, recipe).items()}


def predict_with_labkit(n, recipe):
    from labkit.costs.memory import get_recipe
    r = get_recipe(recipe)
    return {"weights": r.weights * n, "grads": r.grads * n, "optimizer": r.optimizer * n}


def test_state_bytes_reference_full_stub_zero():
    assert_reference_full_stub_zero(ch09.state_bytes, predict, 3, "9.4")


@pytest.mark.parametrize("fn,case,needle", [
    (predict_without_master, 1, "fp32 copy of the weights"),
    (predict_grads_in_weight_dtype, 2, "In which dtype"),
    (predict_bits, 0, "Bits or bytes"),
    (predict_with_labkit, 0, "derive the bytes yourself"),
])
def test_state_bytes_wrong_answers(fn, case, needle):
    assert_case_fails(ch09.state_bytes(fn), case, needle)
