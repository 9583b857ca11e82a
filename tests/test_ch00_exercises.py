"""Chapter 00's exercises: known-wrong answers lose points for the reason they are wrong (the hint
says which). Full marks for the solutions and zero for the stubs: tests/test_exercises.py."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.check import ch00

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
    (dict(grads_dtype=torch.bfloat16), [ch00.STATE_CASES[2]], "Gradients are kept in torch.float32"),
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
    monkeypatch.setattr(ch00, "SHIFT_TIMEOUT", 8.0)
    result = ch00.shift_right(_blocking_send_first, worlds=(2, 3))
    msg = result.cases[0]["message"]
    assert msg.startswith("HANG") and "dist.send(x" in msg and "rank 1 stuck" in msg, msg
    assert "skipped after a hang" in result.cases[1]["message"]


# ----------------------------------------------------------------------------- 0.3
def _dp(model, optimizer, x, y, steps, *, broadcast=True, rows="uneven", scale="share",
        per_param=False, mse_mean=False):
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    params = list(model.parameters())
    if broadcast:
        with torch.no_grad():
            for p in params:
                dist.broadcast(p, src=0)
    B = x.shape[0]
    if rows == "even":                                 # B // N rows: drops the remainder
        start, end = rank * (B // world), (rank + 1) * (B // world)
    else:
        base, extra = divmod(B, world)
        start = rank * base + min(rank, extra)
        end = start + base + (1 if rank < extra else 0)
    xs, ys = x[start:end], y[start:end]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        out = model(xs)                                # (b, 4)
        if mse_mean:                                   # right weights, but NaN on an empty shard
            part = F.mse_loss(out, ys) * (end - start) / B
        elif scale == "rank_mean":                     # each rank's own mean, averaged
            part = F.mse_loss(out, ys) / world
        else:
            part = ((out - ys) ** 2).sum() / y.numel()
        if scale == "sum":                             # gradients summed, never averaged
            part = part * world
        part.backward()
        if per_param:
            for p in params:
                dist.all_reduce(p.grad)
            loss = part.detach().reshape(1)
            dist.all_reduce(loss)
            losses.append(loss.item())
        else:
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [part.detach().reshape(1)])
            dist.all_reduce(flat)
            for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))
            losses.append(flat[-1].item())
        optimizer.step()
    return losses


def _uses_labkit_ddp(model, optimizer, x, y, steps):
    from labkit.ddp import BucketedDDP
    return BucketedDDP(model)


UNEVEN = [(3, [(7, "momentum", 2)])]                   # shards of 3, 2 and 2 rows
EMPTY = [(3, [(2, "momentum", 2)])]                    # shards of 1, 1 and 0 rows


@pytest.mark.parametrize("wrong, cases, hint", [
    (dict(scale="sum"), UNEVEN, "SUMMED over ranks"),
    (dict(scale="rank_mean"), UNEVEN, "each rank's mean over its own rows"),
    (dict(rows="even"), UNEVEN, "its forwards saw"),
    (dict(broadcast=False), UNEVEN, "differ from rank 0's"),
    (dict(per_param=True), UNEVEN, "exactly one per step"),
    (dict(mse_mean=True), EMPTY, "a number on a rank with no rows"),
], ids=["sum, not mean", "mean of per-rank means", "even split drops rows", "no broadcast",
        "an all-reduce per parameter", "NaN on an empty shard"])
def test_data_parallel_wrong_answers_fail_with_the_reason(wrong, cases, hint):
    result = ch00.data_parallel(lambda *a: _dp(*a, **wrong), cases=cases)
    assert result.score < result.points and hint in _messages(result), _messages(result)


def test_data_parallel_right_answer_passes_an_uneven_world():
    result = ch00.data_parallel(_dp, cases=[(3, UNEVEN[0][1] + EMPTY[0][1])])   # one launch
    assert result.passed, _messages(result)


def test_data_parallel_refuses_labkit_ddp_without_running_it():
    result = ch00.data_parallel(_uses_labkit_ddp, cases=UNEVEN)
    assert result.score == 0 and "labkit.ddp" in _messages(result)
