"""Chapter 00's exercises: known-wrong answers lose points for the reason they are wrong (the hint
says which). Full marks for the solutions and zero for the stubs: tests/test_exercises.py."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch00
from labkit.check.ch00 import trainer as ch00_trainer
from labkit.check.ch00.trainer import runs as ch00_runs

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these functions by value


def _messages(result) -> str:
    return "\n".join(c["message"] for c in result.cases if not c["passed"])


# ----------------------------------------------------------------------------- 0.1
def _predict(n, weights, grads, master, optimizer, *, master_counts=True, grads_dtype=None,
             adam_states=2):
    states = {"sgd": 0, "momentum": 1, "adam": adam_states}[optimizer]
    g = (grads_dtype or grads).itemsize
    out = {"weights": n * weights.itemsize, "grads": n * g,
           "optimizer": n * 4 * (states + (master and master_counts))}
    out["total"] = sum(out.values())
    return out


MIXED = [ch00.STATE_CASES[0]]          # bf16 weights and grads, fp32 master, Adam


@pytest.mark.parametrize("wrong, cases, hint", [
    (dict(master_counts=False), MIXED, "master copy"),                       # 4 bytes/param short
    (dict(adam_states=1), MIXED, "momentum? variance?"),
    (dict(grads_dtype=torch.bfloat16), [ch00.STATE_CASES[2]],
     "Gradients are kept in torch.float32"),
], ids=["no master copy", "Adam with one state", "fp32 gradients counted as bf16"])
def test_state_bytes_wrong_answers_fail_with_the_reason(wrong, cases, hint):
    result = ch00.state_bytes(lambda *a: _predict(*a, **wrong), cases=cases)
    assert result.score == 0 and hint in _messages(result), _messages(result)
    assert "predicted" in result.cases[0]["name"]            # predicted beside measured


# ----------------------------------------------------------------------------- 0.2
def _shift_with_all_gather(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts[(dist.get_rank() - 1) % dist.get_world_size()].clone()


def _shift_left(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    reqs = [dist.isend(x, dst=(rank - 1) % n), dist.irecv(out, src=(rank + 1) % n)]
    for r in reqs:
        r.wait()
    return out


def _blocking_send_first(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty_like(x)
    dist.send(x, dst=(rank + 1) % n)            # every rank sends first: nobody receives
    dist.recv(out, src=(rank - 1) % n)
    return out


def _receive_into_x(x):
    rank, n = dist.get_rank(), dist.get_world_size()
    send = x.clone()
    reqs = [dist.isend(send, dst=(rank + 1) % n), dist.irecv(x, src=(rank - 1) % n)]
    for r in reqs:
        r.wait()
    return x


@pytest.mark.parametrize("fn, hint", [
    (_shift_with_all_gather, "collective dist.all_gather called"),
    (_shift_left, "RIGHT neighbour's tensor"),
    (_receive_into_x, "the input x was overwritten"),
], ids=["a collective", "wrong direction", "overwrites x"])
def test_shift_right_wrong_answers_fail_with_the_reason(fn, hint):
    result = ch00.shift_right(fn, worlds=(3,))
    assert result.score == 0 and hint in _messages(result), _messages(result)


def test_shift_right_blocking_sends_are_reported_as_a_hang(monkeypatch):
    monkeypatch.setattr(ch00.ring_shift, "SHIFT_TIMEOUT", 8.0)
    result = ch00.shift_right(_blocking_send_first, worlds=(2, 3))
    msg = result.cases[0]["message"]
    assert msg.startswith("HANG") and "dist.send(x" in msg and "rank 1 stuck" in msg, msg
    assert "skipped after a hang" in result.cases[1]["message"]


# ----------------------------------------------------------------------------- 0.3
class _Trainer:
    """A right DataParallelTrainer; each keyword makes one known mistake."""

    def __init__(self, model, optimizer, loss_fn, group=None, accumulation=1, max_norm=None, *,
                 broadcast="flat", rows="uneven", scale="share", reduce="flat", clip="global",
                 micro=True, empty="skip", buffers=True, frozen="skip"):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.group, self.k, self.max_norm = group, accumulation, max_norm
        self.rows_rule, self.scale, self.reduce, self.clip = rows, scale, reduce, clip
        self.micro, self.empty = micro, empty
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for p in model.parameters() if p.requires_grad or frozen == "send"]
        replica = list(model.parameters()) + (list(model.buffers()) if buffers else [])
        src = dist.get_global_rank(group or dist.group.WORLD, 0)
        if broadcast == "flat":
            flat = torch.cat([t.detach().reshape(-1) for t in replica])
            dist.broadcast(flat, src=src, group=group)
            with torch.no_grad():
                for t, v in zip(replica, flat.split([t.numel() for t in replica])):
                    t.copy_(v.view_as(t))
        elif broadcast == "per_param":
            with torch.no_grad():
                for t in replica:
                    dist.broadcast(t, src=src, group=group)

    @staticmethod
    def _piece(n, parts, i):
        base, extra = divmod(n, parts)
        start = i * base + min(i, extra)
        return start, start + base + (1 if i < extra else 0)

    def step(self, x, y):
        B = x.shape[0]
        if self.rows_rule == "even":                   # B // N rows each: drops the remainder
            lo, hi = self.rank * (B // self.world), (self.rank + 1) * (B // self.world)
        else:
            lo, hi = self._piece(B, self.world, self.rank)
        self.optimizer.zero_grad()
        loss = torch.zeros((), dtype=x.dtype)
        k = self.k if self.micro else 1
        for j in range(k):
            a, b = self._piece(hi - lo, k, j)
            if a == b and self.empty == "skip":
                continue
            out = self.model(x[lo + a:lo + b])         # (m, 4)
            weight = (b - a) / B if self.scale == "share" else (b - a) / (hi - lo)
            part = self.loss_fn(out, y[lo + a:lo + b]) * weight
            part.backward()
            loss += part.detach()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.clip == "per_rank" and self.max_norm is not None:      # wrong: a rank's part
            norm = torch.cat([g.reshape(-1) for g in grads]).norm().item()
            grads = [g * min(1.0, self.max_norm / (norm + 1e-6)) for g in grads]
        if self.reduce == "per_param":
            for t in grads + [loss]:
                dist.all_reduce(t, group=self.group)
            flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1)])
        else:
            flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1)])
            dist.all_reduce(flat, group=self.group)
        if self.scale == "mean_of_means":
            flat /= self.world
        for p, g in zip(self.params, flat[:-1].split([p.numel() for p in self.params])):
            p.grad = g.view_as(p).clone()
        if self.clip == "global" and self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)   # a frozen grad is 0
        self.optimizer.step()
        return flat[-1].item()


def _wrong(**mistake):
    class Wrong(_Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, **mistake)
    return Wrong


class _UsesLabkitDDP(_Trainer):
    def __init__(self, model, *args, **kwargs):
        from labkit.ddp import BucketedDDP
        super().__init__(BucketedDDP(model), *args, **kwargs)


WORLD3 = [ch00_trainer.DP_WORLDS[1]]   # uneven shards, accumulation 2, an empty shard, a frozen
                                       # parameter, clipping
CASES = [name for name, _ in ch00_trainer.CHECKS]
REPLICAS, ROWS, COMM, MEAN, CLIP = CASES


@pytest.mark.parametrize("mistake, failing, hint", [
    (dict(scale="mean_of_means"), [MEAN, CLIP], "averaging each rank's mean over its own rows"),
    (dict(scale="sum_of_means"), [MEAN, CLIP], "each rank's mean SUMMED over ranks"),
    (dict(rows="even"), [ROWS, MEAN, CLIP], "were seen by no rank"),
    (dict(micro=False), [ROWS], "in 2 micro-batches are [2, 1]"),
    (dict(broadcast="none"), [REPLICAS, MEAN, CLIP], "still holds its OWN initial weights"),
    (dict(broadcast="per_param"), [REPLICAS], "exactly one broadcast"),
    (dict(buffers=False), [REPLICAS, MEAN, CLIP], "its buffers are not"),
    (dict(frozen="send"), [COMM], "does a frozen parameter need one"),
    (dict(reduce="per_param"), [COMM], "exactly one all-reduce"),
    (dict(clip="per_rank"), [CLIP], "clipping each rank's part of the gradient before"),
    (dict(clip="none"), [CLIP], "WITHOUT clipping"),
    (dict(empty="run"), [CLIP], "a number on a rank with no rows"),     # B = 2 at 3 ranks
], ids=["mean of per-rank means", "per-rank means summed", "even split drops rows",
        "no micro-batches", "no broadcast", "a broadcast per parameter", "buffers not sent",
        "a frozen parameter's gradient sent",
        "an all-reduce per parameter", "clipped per rank", "not clipped", "NaN on an empty shard"])
def test_data_parallel_wrong_answers_fail_with_the_reason(mistake, failing, hint):
    result = ch00.data_parallel(_wrong(**mistake), worlds=WORLD3)
    failed = [c["name"].split(": ", 1)[1] for c in result.cases if not c["passed"]]
    assert failed == failing and hint in _messages(result), _messages(result)


def test_data_parallel_refuses_labkit_ddp_without_running_it():
    result = ch00.data_parallel(_UsesLabkitDDP, worlds=WORLD3)
    assert result.score == 0 and "labkit.ddp" in _messages(result)


def test_data_parallel_traffic_over_a_broadcast_and_the_rings_fails():
    """The kernel's byte count is graded on its own (no launch: the results are made up): one
    all-reduce per step of the right size, but twice the bytes a ring sends."""
    world, label, configs = WORLD3[0]
    numel = ch00_runs.trainable_numel(configs[0])
    ring = 2 * (world - 1) / world * 8 * numel
    row = {"steps": [{"calls": [("all_reduce", numel + 1)]}] * 3, "sent": None}
    res = [[dict(row, sent=int(2 * 3 * ring) + 200_000), None] for _ in range(world)]
    with pytest.raises(AssertionError, match="sent .* bytes in __init__ and 3 steps"):
        ch00_trainer.check_communication(res, configs[:1], world)
    res = [[dict(row, sent=int(3 * ring) + 60_000), None] for _ in range(world)]
    ch00_trainer.check_communication(res, configs[:1], world)       # a broadcast and 3 rings
