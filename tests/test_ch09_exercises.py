"""Chapter 09's exercises 9.3 and 9.4: the reference solutions score full marks, the stubs score
zero, and known-wrong answers lose points for the reason they are wrong (the hint says which)."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch09

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these classes by value


# ----------------------------------------------------------------------------- 9.3 reference
class Trainer:
    def __init__(self, model, lr, scaler, group=None):
        self.model, self.lr, self.scaler, self.group = model, lr, scaler, group
        self.world = dist.get_world_size(group)
        self.masters = [p.detach().clone().float() for p in model.parameters()]
        model.half()

    def master_params(self):
        return self.masters

    def scaled_backward(self, loss):
        (loss * self.scaler.scale).backward()

    def reduce(self, flat):
        flat /= self.scaler.scale * self.world
        dist.all_reduce(flat, group=self.group)
        return flat

    def found_inf(self, flat, local):
        return not bool(torch.isfinite(flat).all())

    def apply(self, params, flat):
        offset = 0
        with torch.no_grad():
            for p, m in zip(params, self.masters):
                m -= self.lr * flat[offset:offset + m.numel()].view_as(m)
                p.copy_(m)
                offset += m.numel()

    def step(self, x, y, loss_fn):
        params = list(self.model.parameters())
        for p in params:
            p.grad = None
        loss = loss_fn(self.model(x.to(params[0].dtype)).float(), y)
        self.scaled_backward(loss)
        local = torch.cat([p.grad.float().reshape(-1) for p in params])
        flat = self.reduce(local.clone())
        if self.scaler.update(self.found_inf(flat, local)):
            self.apply(params, flat)
        return float(loss)


# ----------------------------------------------------------------------------- 9.3 wrong answers
class NoMasterWeights(Trainer):             # the update lands on the fp16 weights
    def apply(self, params, flat):
        offset = 0
        with torch.no_grad():
            for p, m in zip(params, self.masters):
                p -= (self.lr * flat[offset:offset + m.numel()].view_as(m)).half()
                m.copy_(p.float())
                offset += m.numel()


class NoLossScaling(Trainer):               # backward of the plain loss: fp16 gradients underflow
    def scaled_backward(self, loss):
        loss.backward()

    def reduce(self, flat):
        flat /= self.world
        dist.all_reduce(flat, group=self.group)
        return flat


class SumNotMean(Trainer):                  # the wrong reduction: a sum over ranks
    def reduce(self, flat):
        flat /= self.scaler.scale
        dist.all_reduce(flat, group=self.group)
        return flat


class NeverSkips(Trainer):                  # the overflowed step is applied anyway
    def step(self, x, y, loss_fn):
        params = list(self.model.parameters())
        for p in params:
            p.grad = None
        loss = loss_fn(self.model(x.half()).float(), y)
        self.scaled_backward(loss)
        flat = self.reduce(torch.cat([p.grad.float().reshape(-1) for p in params]))
        self.scaler.update(self.found_inf(flat, None))
        self.apply(params, flat)
        return float(loss)


class LocalOverflowCheck(Trainer):          # found_inf from this rank's gradients only
    def found_inf(self, flat, local):
        return not bool(torch.isfinite(local).all())


class KeepsFp32(Trainer):                   # computes in fp32: no fp16 copy
    def __init__(self, model, lr, scaler, group=None):
        super().__init__(model, lr, scaler, group)
        model.float()


class UsesGradScaler(Trainer):
    def scaled_backward(self, loss):
        torch.amp.GradScaler("cpu").scale(loss).backward()


# ----------------------------------------------------------------------------- 9.3 tests
def _messages(res):
    return "\n".join(c["message"] for c in res.cases if not c["passed"])


def test_trainer_reference_scores_full():
    res = ch09.mixed_precision_trainer(Trainer)
    assert res.score == res.points == 6, res.table()


def test_trainer_stub_scores_zero():
    class Stub:
        def __init__(self, *args):
            raise NotImplementedError("Exercise 9.3: write your code here")
    assert ch09.mixed_precision_trainer(Stub).score == 0


@pytest.mark.parametrize("cls,needle,one_rank_passes", [
    (NoMasterWeights, "fp32 masters", False),
    (NoLossScaling, "multiplied by the scale", False),
    (SumNotMean, "averaged over the ranks", True),
    (NeverSkips, "NaN", False),
    (LocalOverflowCheck, "every rank must skip", True),
    (KeepsFp32, "fp16 copy", False),
    (UsesGradScaler, "yourself", False),
])
def test_trainer_wrong_answers_fail_with_their_hint(monkeypatch, cls, needle, one_rank_passes):
    monkeypatch.setattr(ch09, "TRAIN_CASES", ch09.TRAIN_CASES[:2])
    res = ch09.mixed_precision_trainer(cls)
    assert res.cases[0]["passed"] == one_rank_passes and not res.cases[1]["passed"], res.table()
    assert needle in res.cases[1]["message"], res.table()


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
    res = ch09.state_bytes(predict)
    assert res.score == res.points == 3, res.table()

    def stub(*args):
        raise NotImplementedError("Exercise 9.4: write your code here")
    assert ch09.state_bytes(stub).score == 0


@pytest.mark.parametrize("fn,case,needle", [
    (predict_without_master, 1, "fp32 copy of the weights"),
    (predict_grads_in_weight_dtype, 2, "In which dtype"),
    (predict_bits, 0, "Bits or bytes"),
    (predict_with_labkit, 0, "derive the bytes yourself"),
])
def test_state_bytes_wrong_answers(fn, case, needle):
    res = ch09.state_bytes(fn)
    assert not res.cases[case]["passed"] and needle in res.cases[case]["message"], res.table()
