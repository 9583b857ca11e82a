"""Chapter 02's exercises: known-wrong answers lose points for the reason they are wrong (the hint
says which). Full marks for the solutions and zero for the stubs: tests/test_exercises.py."""
import contextlib
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch02

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # ranks get these classes by value


def _messages(result) -> str:
    return "\n".join(c["message"] for c in result.cases if not c["passed"])


# ----------------------------------------------------------------------------- 2.1
def _buckets(params, bucket_mb, *, reverse=True, close_before=False, count="bytes"):
    """The book's rule (labkit.buckets): a bucket closes once it holds the cap."""
    cap = float("inf") if bucket_mb is None else int(bucket_mb * 2**20)
    buckets, current, size = [], [], 0
    for p in (reversed(list(params)) if reverse else list(params)):
        nbytes = p.numel() * (p.element_size() if count == "bytes" else 1)
        if close_before and current and size + nbytes > cap:   # before the one that would pass
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
        if not close_before and size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _labkit_buckets(params, bucket_mb):
    from labkit.ddp import assign_buckets
    return assign_buckets(params, bucket_mb)


@pytest.mark.parametrize("fn, hint", [
    (lambda ps, mb: _buckets(ps, mb, reverse=False), "In which order does backward produce"),
    (lambda ps, mb: _buckets(ps, mb, close_before=True), "When exactly does a bucket close"),
    (lambda ps, mb: _buckets(ps, mb, count="elements"), "elements or bytes"),
    (_labkit_buckets, "labkit.ddp"),
], ids=["registration order", "closes before the cap is reached", "counts elements",
        "labkit's assign_buckets"])
def test_assign_buckets_wrong_answers_fail_with_the_reason(fn, hint):
    result = ch02.assign_buckets(fn)
    assert result.score < result.points and hint in _messages(result), _messages(result)


# ----------------------------------------------------------------------------- 2.2
class _DDP(torch.nn.Module):
    """The reference solution, with switches for known mistakes."""
    broadcast, overlap, honour_no_sync, send_params = True, True, True, False

    def __init__(self, module, group=None, bucket_mb=25.0):
        super().__init__()
        self.module, self.group = module, group or dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        if self.broadcast:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t, src=0, group=self.group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = _buckets(params, bucket_mb)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._sync = True
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _reset(self):
        self.ready, self.next, self.pending = [0] * len(self.buckets), 0, []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        was, self._sync = self._sync, False    # nested no_sync() blocks restore what they found
        try:
            yield
        finally:
            self._sync = was

    def _grad_ready(self, p):
        if not self._sync and self.honour_no_sync:
            return
        self.ready[self.bucket_of[id(p)]] += 1
        while self.next < len(self.buckets) and \
                self.ready[self.next] == len(self.buckets[self.next]):
            if self.overlap:
                self._launch(self.next)
            self.next += 1

    def _launch(self, i):
        bucket = self.buckets[i]
        parts = [q.grad.reshape(-1) for q in bucket]
        if self.send_params:                           # the weights ride along: twice the bytes
            parts += [q.detach().reshape(-1) for q in bucket]
        flat = torch.cat(parts)
        self.pending.append((i, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    @torch.no_grad()
    def finish_gradient_synchronization(self):
        if not self._sync:
            return
        if not self.overlap:                           # naive: everything after backward
            for i in range(len(self.buckets)):
                self._launch(i)
        for i, flat, work in self.pending:
            work.wait()
            flat.div_(self.world)
            bucket = self.buckets[i]
            sizes = [q.numel() for q in bucket]
            for q, piece in zip(bucket, flat[:sum(sizes)].split(sizes)):
                q.grad.copy_(piece.view_as(q))
        self._reset()

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)


class _NoBroadcast(_DDP):
    broadcast = False


class _AfterBackward(_DDP):
    overlap = False


class _IgnoresNoSync(_DDP):
    honour_no_sync = False

    def finish_gradient_synchronization(self):
        if self._sync:
            super().finish_gradient_synchronization()
        else:                                          # waits, but the launches already ran
            for _, _, work in self.pending:
                work.wait()
            self._reset()


class _SendsParams(_DDP):
    send_params = True


class _UsesLabkit(_DDP):
    def forward(self, *args, **kwargs):
        from labkit.ddp import BucketedDDP  # noqa: F401
        return self.module(*args, **kwargs)


def _several():
    params = ch02.buckets.trainable_params()
    return sum(p.numel() * p.element_size() for p in params) / 2**20 * 0.3


@pytest.mark.parametrize("cls, accum, hint", [
    (_NoBroadcast, 1, "rank 0's weights"),
    (_AfterBackward, 1, "no all-reduce started before backward finished"),
    (_IgnoresNoSync, 3, "inside no_sync()"),
    (_SendsParams, 1, "Is anything sent twice"),
], ids=["no initial broadcast", "all-reduces only after backward", "communicates in no_sync",
        "twice the bytes"])
def test_bucketed_ddp_wrong_answers_fail_with_the_reason(cls, accum, hint):
    result = ch02.bucketed_ddp(cls, cases=[(3, 10)], configs=[("sgd", _several(), accum)])
    assert result.score < result.points and hint in _messages(result), _messages(result)


def test_bucketed_ddp_refuses_labkit_without_running_it():
    result = ch02.bucketed_ddp(_UsesLabkit, cases=[(3, 10)])
    assert result.score == 0 and "labkit.ddp" in _messages(result)


# ----------------------------------------------------------------------------- 2.3
def _predict(param_bytes, bucket_mb, world, accum, no_sync, *, ring=True, honour=True):
    cap = float("inf") if bucket_mb is None else int(bucket_mb * 2**20)
    buckets, size = 0, 0
    for b in reversed(param_bytes):
        size += b
        if size >= cap:                                # the book's rule: closes at the cap
            buckets, size = buckets + 1, 0
    buckets += 1 if size else 0
    syncs = 1 if (no_sync and honour) else accum
    per = 2 * (world - 1) / world if ring else 1.0
    return {"all_reduces": syncs * buckets, "bytes_sent": syncs * per * sum(param_bytes)}


SHOWN = ch02.PREDICT_CASES[:1]


@pytest.mark.parametrize("wrong, hint", [
    (dict(ring=False), "What fraction of each bucket's bytes"),
    (dict(honour=False), "with no_sync"),
], ids=["the whole buffer, not the ring's share", "no_sync ignored"])
def test_predict_ddp_step_wrong_answers_fail_with_the_reason(wrong, hint):
    result = ch02.predict_ddp_step(lambda *a: _predict(*a, **wrong), cases=SHOWN)
    assert result.score < result.points and hint in _messages(result), _messages(result)
    assert "measured" in result.cases[0]["name"]           # predicted beside measured
