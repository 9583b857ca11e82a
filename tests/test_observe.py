"""labkit.observe (the instruments), labkit.shard (the even split) and labkit.reference.train
(the one reference, its options as data). Small and fast: about 10 s on a loaded 2-core machine."""
import pytest
import torch

from labkit.launch import run
from labkit.model import GPTConfig, shard_rows
from labkit.observe.dispatch import POINT_TO_POINT, CollectiveLog
from labkit.observe.measured import Measured, measured_table
from labkit.observe.saved import SavedTensors
from labkit.observe.storage import nbytes, storage_bytes
from labkit.reference import TrainSpec, reference_train, train
from labkit.shard import even_bounds, even_ranges, even_sizes
from labkit.testing import compare_dicts

CFG = GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)


@pytest.mark.parametrize("n,parts", [(10, 3), (3, 5), (0, 2), (7, 7), (64, 8)])
def test_even_split_covers_and_is_balanced(n, parts):
    ranges = even_ranges(n, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert [hi - lo for lo, hi in ranges] == even_sizes(n, parts)
    assert max(even_sizes(n, parts)) - min(even_sizes(n, parts)) <= 1
    assert even_sizes(n, parts) == sorted(even_sizes(n, parts), reverse=True)  # first are longer
    t = torch.arange(n)
    assert torch.cat([shard_rows(t, i, parts) for i in range(parts)]).tolist() == list(range(n))
    with pytest.raises(ValueError):
        even_bounds(n, parts, parts)


def test_storage_counts_each_storage_once():
    x = torch.zeros(10, 4)
    assert nbytes(x) == 160 and nbytes(x[:5]) == 80
    assert storage_bytes([x, x[:5], x.t(), None]) == 160      # views are the same memory
    assert storage_bytes([x, torch.zeros(3, dtype=torch.float64)]) == 184


def test_saved_tensors_storages_booked_and_live():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors(exclude=lin.parameters()) as saved:
        y = torch.relu(lin(x))                                 # saves x, and relu's output
    assert saved.bytes == 2 * 4 * 8 * 4
    meter = SavedTensors(exclude=lin.parameters(), live=True)
    with meter.saving("mb0"):
        out = torch.relu(lin(x)).sum()
    assert meter.bytes_of("mb0") == 2 * 4 * 8 * 4 and meter.bytes_of("mb0") == 0   # forgotten
    assert meter.live_bytes == meter.peak_live > 0
    out.backward()                                             # autograd frees what it saved
    del out
    assert meter.live_bytes == 0 and meter.peak_live > 0
    y.sum().backward()


def test_live_meter_knows_a_storage_by_identity_and_reads_its_size_now():
    """ZeRO-3 frees a saved weight's storage after forward and gathers it back for backward; the
    allocator may meanwhile put another saved tensor at its address. Keyed by address the meter
    drifted (a weight's bytes left over after the step); keyed by storage it cannot."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedTensors(exclude=[x], live=True)
    with meter:
        y = (x @ w).sum()                                      # saves w (x is excluded)
    assert meter.live_bytes == meter.peak_live == 8 * 8 * 4
    keep = w.detach().clone()
    w.untyped_storage().resize_(0)                             # "free after forward"
    assert meter.live_bytes == 0                               # held by autograd, 0 bytes now
    others = [torch.randn(16) for _ in range(8)]               # may land at w's old address
    with meter:
        z = sum((o.requires_grad_() * 2).sin().sum() for o in others)   # sin saves its input
    assert meter.live_bytes == 8 * 16 * 4                      # each `o * 2`, once
    w.untyped_storage().resize_(8 * 8 * 4)                     # "gather before backward"
    with torch.no_grad():
        w.copy_(keep)
    assert meter.live_bytes == 8 * 8 * 4 + 8 * 16 * 4
    y.backward()
    z.backward()
    del y, z
    assert meter.live_bytes == 0 and not meter._live


def test_measured_row_and_table():
    rows = [Measured("bytes sent", 1100, 1000, "kernel TCP", "bytes"),
            Measured("over NVLink", None, 1000, "kernel TCP", "bytes")]
    assert rows[0].ratio == pytest.approx(1.1) and rows[0].close(0.15) and not rows[0].close(0.05)
    assert rows[1].ratio is None and not rows[1].close(1.0)
    text = measured_table(rows, title="rank 0")
    lines = text.splitlines()
    assert lines[0] == "rank 0" and "ratio" in lines[1] and "1.100" in lines[3]
    assert "None" not in text                                  # unmeasured: an empty cell


def _log_job():
    import torch.distributed as dist

    out = {}
    x = torch.ones(6)
    with CollectiveLog() as log:
        dist.all_reduce(x)
        dist.barrier()
    out["names"], out["sized"] = log.names(), log.sized()
    out["collectives"], out["times"] = log.collectives(), len(log.times("all_reduce"))
    try:
        with CollectiveLog(allow=POINT_TO_POINT, why="use send/recv"):
            dist.all_reduce(x)
        out["refused"] = None
    except RuntimeError as err:
        out["refused"] = str(err)
    try:  # a checker's refusal: only point-to-point may run, and its own exception type
        with CollectiveLog(allow=(), why="use send/recv", error=LookupError) as strict:
            dist.broadcast(x, 0)
        out["strict"] = None
    except LookupError as err:
        out["strict"] = (str(err), strict.calls)
    dist.barrier()
    return out


def test_collective_log_sees_and_refuses_by_name():
    out = run(_log_job, 2, echo=False)[0]
    assert out["names"] == ["all_reduce", "barrier"] and out["collectives"] == ["all_reduce"]
    assert out["sized"][0] == ("all_reduce", 6) and out["times"] == 1
    assert out["refused"] == "collective dist.all_reduce called: use send/recv"
    assert out["strict"] == ("collective dist.broadcast called: use send/recv", ["broadcast"])


def test_reference_keywords_and_spec_agree():
    old = reference_train(CFG, 2, 4, "sgd")
    new = train(CFG, TrainSpec(steps=2, batch=4, optimizer="sgd"))
    assert old["losses"] == new.losses and new["losses"] == new.losses
    compare_dicts(old["params"], new.params, rtol=0, atol=0, what="params")
    compare_dicts(old["grads"], new.grads, rtol=0, atol=0, what="grads")


def test_reference_micro_batches_equal_the_whole_batch():
    whole = train(CFG, TrainSpec(steps=2, batch=5, optimizer="sgd"))
    parts = train(CFG, TrainSpec(steps=2, batch=5, micro_batches=2, optimizer="sgd"))
    assert parts.losses == pytest.approx(whole.losses, rel=1e-5)
    compare_dicts(parts.grads, whole.grads, what="micro-batched gradient")
    compare_dicts(parts.params, whole.params, what="micro-batched parameter")


def test_reference_gradients_only_frozen_clipped_and_float64():
    spec = TrainSpec(steps=1, batch=4, optimizer=None, dtype="float64",
                     frozen=("wpe.weight",), max_grad_norm=1e-3)
    ref = train(CFG, spec)
    assert ref.loss.dtype == torch.float64 and "wpe.weight" not in ref.grads
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.grads.values()]))
    assert norm.item() == pytest.approx(1e-3, rel=1e-6)
    start = train(CFG, spec.with_(steps=0))
    compare_dicts(ref.params, start.params, rtol=0, atol=0, what="no optimizer step")
    with pytest.raises(ValueError, match="no parameter named"):
        train(CFG, TrainSpec(frozen=("nope",)))


def test_nested_logs_close_by_identity():
    """Two open logs with the same (no) events are equal; closing the inner one must not close
    the outer (a lab's log inside a test's log)."""
    from labkit.observe import commlog

    with commlog.record() as outer:
        with commlog.record() as inner:
            assert inner == outer and inner is not outer
        assert commlog.recording()
    assert not commlog.recording()
