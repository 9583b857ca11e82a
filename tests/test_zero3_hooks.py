"""ZeRO-3 as FSDP2 does it (labkit.zero.unit): backward gathers the parameters again through
hooks and runs no module's forward a second time; the storage a module computed with is freed
after its forward, filled again before its backward, and freed after it.

Read by probes the code under test does not write: forward pre-hooks count each module's calls
(in forward and in backward apart), and the bytes are the allocator's own storage sizes
(untyped_storage().nbytes()) of the weight each module computed with, captured when it ran.
2 and 3 ranks (3: shards that do not divide evenly), with and without prefetch; ~40 s."""
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from labkit.labs.zero.train import TINY
from labkit.launch import run


class _Weights(TorchFunctionMode):
    """Every linear / layer_norm / embedding call: the storage behind the weight it computed
    with, and that storage's bytes just before the call's own backward node runs."""
    OPS = {F.linear: 1, F.layer_norm: 2, F.embedding: 1}      # where the weight is

    def __init__(self):
        super().__init__()
        self.storages, self.during = {}, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.OPS:
            w = kwargs.get("weight", args[self.OPS[func]] if len(args) > self.OPS[func] else None)
            if isinstance(w, torch.Tensor):
                name, st = f"{func.__name__} {len(self.storages)}", w.untyped_storage()
                self.storages[name] = st
                if out.grad_fn is not None:     # runs after every hook on out's gradient
                    out.grad_fn.register_prehook(
                        lambda grads: self.during.append((name, st.nbytes())))
        return out


def _probe(prefetch: bool):
    import torch.distributed as dist

    from labkit.model import GPT, get_batch, shard_rows, tiny_corpus
    from labkit.zero import ZeRO3

    rank, world = dist.get_rank(), dist.get_world_size()
    plain, model = GPT(TINY), GPT(TINY)          # TINY ties the embedding and the head
    calls = {"plain": 0, "forward": 0, "backward": 0}
    phase = ["plain"]

    def count(module, args):
        calls[phase[0]] += 1
    for m in list(plain.modules()) + list(model.modules()):
        m.register_forward_pre_hook(count)
    x, y = get_batch(tiny_corpus(), 6, TINY.block_size, 0)                   # (B, T)
    x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)            # (B/N, T)
    plain(x, y)[1].backward()
    zero = ZeRO3(model, torch.optim.SGD, prefetch=prefetch, lr=0.1)
    out = []
    for _ in range(2):               # the second step runs with the prefetch order known
        calls.update(forward=0, backward=0)
        phase[0] = "forward"
        with _Weights() as seen:
            loss = model(x, y)[1]
        after_forward = {n: st.nbytes() for n, st in seen.storages.items()}
        phase[0] = "backward"
        loss.backward()
        after_backward = {n: st.nbytes() for n, st in seen.storages.items()}
        phase[0] = "plain"
        zero.step()
        zero.zero_grad()
        out.append({"calls": dict(calls), "after_forward": after_forward,
                    "during": list(seen.during), "after_backward": after_backward,
                    "grads_kept": [n for n, p in model.named_parameters() if p.grad is not None]})
    return out


@pytest.fixture(scope="module", params=[2, 3])
def probes(request):
    world = request.param
    return world, run(_everything, world, timeout=200, echo=False)


def _everything():
    return {prefetch: _probe(prefetch) for prefetch in (False, True)}


@pytest.mark.parametrize("prefetch", [False, True])
def test_backward_runs_no_forward_again(probes, prefetch):
    world, per_rank = probes
    for r in per_rank:
        for step in r[prefetch]:
            c = step["calls"]
            assert c["backward"] == 0, (world, prefetch, c)       # no recomputation
            assert c["forward"] == c["plain"] > 0, (world, prefetch, c)   # each module once


@pytest.mark.parametrize("prefetch", [False, True])
def test_whole_parameters_are_freed_after_forward_and_after_backward(probes, prefetch):
    world, per_rank = probes
    for r in per_rank:
        for step in r[prefetch]:
            assert step["after_forward"] and set(step["after_forward"].values()) == {0}, step
            assert set(step["after_backward"].values()) == {0}, step
            # backward reached every weighted module with its weight's storage whole again
            # (the same storage its saved views point at), not freed
            reached = {n for n, _ in step["during"]}
            assert reached == set(step["after_forward"]), (reached, step["after_forward"])
            assert all(nbytes > 0 for _, nbytes in step["during"]), step["during"]
            assert step["grads_kept"] == []           # no unsharded gradient stays behind
