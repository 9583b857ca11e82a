"""labkit.profiling: real torch.profiler traces of labkit runs, read back from the files.

About 10-20 s on an idle 2-core machine (two 2-rank Gloo launches); the rest is arithmetic."""
import json

import pytest

from labkit.profiling import read
from labkit.profiling.folder import check_folder, trace_file


def _event(name, ts, dur, tid, cat="user_annotation"):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _synthetic(tmp_path):
    """Compute labels on thread 1, Gloo's runloop thread 2 with three collectives, a c10d call
    inside backward (queueing: not compute). Intervals in microseconds, chosen by hand."""
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1,
         "args": {"name": "thread 1 (python)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2,
         "args": {"name": "thread 2 (pt_gloo_runloop)"}},
        _event("forward", 0, 100, 1),
        _event("backward", 100, 200, 1),                     # 100..300
        _event("c10d::allreduce_", 150, 10, 1, cat="cpu_op"),  # 150..160 not compute
        _event("all_reduce bucket 0", 150, 10, 1),
        _event("optimizer", 400, 50, 1),                     # 400..450
        _event("gloo:all_reduce", 160, 100, 2),              # 160..260: all under compute
        _event("gloo:all_reduce", 280, 100, 2),              # 280..380: 20 under compute
        _event("gloo:all_reduce", 370, 20, 2),               # 370..390: merges, none under
    ]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0}}))
    return read.load(path)


def test_overlap_of_a_synthetic_trace_is_exact(tmp_path):
    tr = _synthetic(tmp_path)
    b = read.breakdown(tr)
    # compute: 0..150 and 160..300 and 400..450 = 150 + 140 + 50; comm: 160..260, 280..390
    assert b["compute_s"] == pytest.approx(340e-6, abs=1e-12)
    assert b["comm_s"] == pytest.approx(210e-6, abs=1e-12)
    assert b["overlapped_s"] == pytest.approx(120e-6, abs=1e-12)
    assert b["exposed_s"] == pytest.approx(90e-6, abs=1e-12)
    assert b["overlapped_share"] == pytest.approx(120 / 210)


def test_interval_arithmetic():
    assert read.union([(3, 4), (0, 2), (1, 3)]) == [(0, 4)]
    assert read.intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert read.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert read.total([(0, 2), (1, 3), (5, 6)]) == 4


def test_bad_trace_folder_refused(tmp_path):
    import argparse

    f = tmp_path / "a_file"
    f.write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a file"):
        check_folder(str(f))
    assert check_folder(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"


def test_real_ddp_run_writes_one_trace_per_rank(tmp_path):
    from labkit.launch import run
    from labkit.profiling import jobs, plot

    out = run(jobs.ddp_job, 2, args=(str(tmp_path),), kwargs=dict(steps=1, bucket_mb=0.05))
    traces = read.load_folder(tmp_path)
    assert [t.rank for t in traces] == [0, 1]
    assert all((tmp_path / trace_file("", r).name).exists() for r in (0, 1))
    for tr, res in zip(traces, out):
        names = [e["name"] for e in read.labels(tr)]
        for want in ("forward", "backward", "optimizer"):
            assert names.count(want) == 1, (want, names)
        buckets = sorted(n for n in names if n.startswith("all_reduce bucket"))
        assert len(buckets) == res["buckets"] > 1
        # each bucket's all-reduce ran on Gloo's threads: one gloo:all_reduce per bucket
        assert len(tr.select("^gloo:all_reduce$")) == res["buckets"]
        b = read.breakdown(tr)
        assert b["comm_s"] > 0 and b["compute_s"] > 0
        assert b["overlapped_s"] + b["exposed_s"] == pytest.approx(b["comm_s"])
    fig = plot.side_by_side(traces, [r["timeline"] for r in out])
    lanes = {y for d in fig.data for y in d.y}
    assert {"rank 0 compute", "rank 1 compute", "rank 0 calls"} <= lanes


def test_zero3_memory_timeline_on_the_cpu():
    from labkit.launch import run
    from labkit.model import GPT, GPTConfig
    from labkit.profiling import memory

    cfg = GPTConfig(vocab_size=96, block_size=8, n_layer=2, n_head=2, n_embd=16)
    out = run(memory.zero3_memory_job, 2, kwargs=dict(steps=1, batch=2, cfg=cfg))
    s = out[0]["samples"]
    assert out[0]["kind"] == "cpu" and {r["phase"] for r in s} == {"forward", "backward",
                                                                   "optimizer"}
    # a block's parameters are whole only while it works: one block's bytes at most, 0 between
    block = sum(p.numel() for n, p in GPT(cfg).named_parameters() if n.startswith("blocks.0.")) * 4
    for phase in ("forward", "backward"):           # gathered again for backward
        assert max(r["full_params"] for r in s
                   if r["unit"].startswith("blocks") and r["phase"] == phase) == block
    assert s[-1]["full_params"] == 0 and s[-1]["saved"] == 0
    assert max(r["saved"] for r in s) > 0
    # the three counters are disjoint storages: the shards and the optimizer's state alone
    # between steps, whatever the sample
    assert min(r["model_states"] for r in s) > 0
