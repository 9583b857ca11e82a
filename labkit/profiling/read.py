"""Read a torch.profiler trace (Chrome/Perfetto JSON) back, and measure it on its own timestamps.

    from labkit.profiling import read
    tr = read.load("traces/rank0.pt.trace.json")
    read.breakdown(tr)  # {"compute_s", "comm_s", "overlapped_s", "exposed_s", "overlapped_share"}
    read.labels(tr)         # the record_function spans: forward, backward, optimizer, bucket ...

What a CPU (Gloo) trace holds, found by reading one: the caller's thread has the operators
(`cpu_op`: aten::mm, autograd::engine::evaluate_function ..., c10d::allreduce_, the call that
*queues* a collective), and the record_function labels (`user_annotation`). An asynchronous
collective runs on one of Gloo's own threads ("pt_gloo_runloop"), where ProcessGroupGloo wraps
the algorithm in an event named `gloo:all_reduce` (gloo:all_gather, gloo:broadcast ...): from
the moment that thread starts the collective to its end, so it includes waiting for the slowest
peer to arrive, not only moving bytes. A point-to-point send or receive (gloo:send, gloo:recv)
is an asynchronous span on the caller's thread from posting to completion. On a GPU the NCCL
kernels (`kernel` events with "nccl" in the name) are the communication and the other kernels
the compute. No `record_param_comms` events appear in CPU traces of torch 2.13 (checked).

Compute, on a CPU trace: the union of the compute labels (forward, backward, optimizer, the
pipeline's F/B/W actions: labkit's record_function spans, which include stand-in compute such as
the pipeline's sleeps) on the caller's threads, less the calls inside them that queue or wait for
a collective (c10d::* operators, which for a blocking collective last until it is done, and
labkit's "all_gather ZeRO-3 gather"-style labels); with no labels, the union of the operators.
Overlapped = the time communication ran while compute ran (interval intersection); exposed =
communication while nothing computed. All sums are interval unions, so nested or concurrent events
count once.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from labkit.table import table

COMPUTE_LABEL = re.compile(r"^(forward|backward|optimizer|[FBW]\d+)\b")
COMM_NAME = re.compile(r"^(gloo:|nccl|record_param_comms)|nccl", re.IGNORECASE)
CALL_NAME = re.compile(r"^c10d::")     # the caller's side of a collective: queue it, or wait
CALL_LABEL = re.compile(r"^(all_reduce|all_gather|reduce_scatter|broadcast|all_to_all|send|recv)\b")


@dataclass
class Trace:
    """One rank's trace: complete events ("X") with ts and dur in microseconds."""
    path: str
    rank: int | None
    events: list = field(default_factory=list)      # dicts: name, cat, ts, dur, tid, pid
    threads: dict = field(default_factory=dict)     # tid -> thread name

    def select(self, name=None, cat=None, tid=None) -> list:
        """Events whose name matches the regular expression `name` (and cat, tid if given)."""
        pat = re.compile(name) if isinstance(name, str) else name
        return [e for e in self.events if (pat is None or pat.search(e["name"]))
                and (cat is None or e.get("cat") == cat) and (tid is None or e["tid"] == tid)]

    @property
    def start(self) -> float:
        return min(e["ts"] for e in self.events)


def load(path) -> Trace:
    """Parse one exported trace (torch.profiler's export_chrome_trace; .json or .json.gz)."""
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        raw = json.load(f)
    events = raw["traceEvents"] if isinstance(raw, dict) else raw
    threads = {e["tid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    done = [dict(name=e["name"], cat=e.get("cat", ""), ts=float(e["ts"]), dur=float(e["dur"]),
                 tid=e.get("tid"), pid=e.get("pid"))
            for e in events if e.get("ph") == "X" and "dur" in e and e.get("cat") != "Trace"]
    info = raw.get("distributedInfo", {}) if isinstance(raw, dict) else {}
    return Trace(str(path), info.get("rank"), done, threads)


def load_folder(folder) -> list:
    """Every rank's trace in `folder`, ordered by rank (labkit.profiling.record's file names)."""
    paths = sorted(Path(folder).glob("*.json*"))
    if not paths:
        raise FileNotFoundError(f"no trace files (*.json) in {folder}")
    traces = [load(p) for p in paths]
    return sorted(traces, key=lambda t: (t.rank is None, t.rank, t.path))


# ----------------------------------------------------------------------------- intervals
def union(intervals) -> list:
    """Sorted, disjoint intervals covering the same time as `intervals` [(start, end)]."""
    out = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(intervals) -> float:
    return sum(b - a for a, b in union(intervals))


def intersect(xs, ys) -> list:
    """The time covered by both xs and ys (each a list of intervals)."""
    xs, ys, out, i, j = union(xs), union(ys), [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs, ys) -> list:
    """The time covered by xs and not by ys."""
    out = []
    ys = union(ys)
    for a, b in union(xs):
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if b > a:
            out.append((a, b))
    return out


def span(e) -> tuple:
    return (e["ts"], e["ts"] + e["dur"])


# ----------------------------------------------------------------------------- what ran
def comm_events(tr: Trace) -> list:
    """The events that are communication running: Gloo's gloo:* spans, NCCL kernels."""
    return [e for e in tr.events if COMM_NAME.search(e["name"])
            and (e["cat"] in ("kernel", "gpu_user_annotation") or e["name"].startswith("gloo:")
                 or e["name"] == "record_param_comms")]


def labels(tr: Trace, name=None) -> list:
    """record_function spans (user annotations; not Gloo's own gloo:* spans), optionally those
    whose name matches `name`."""
    return [e for e in tr.select(name=name, cat="user_annotation")
            if not COMM_NAME.search(e["name"])]


def compute_intervals(tr: Trace) -> list:
    """Compute as defined in the module docstring: GPU kernels other than NCCL's where the trace
    has kernels; else the compute labels (else the operators) less the c10d calls."""
    kernels = [e for e in tr.events if e["cat"] == "kernel"]
    if kernels:
        return union(span(e) for e in kernels if not COMM_NAME.search(e["name"]))
    comm_threads = {e["tid"] for e in tr.events if e["name"].startswith("gloo:")
                    and "runloop" in tr.threads.get(e["tid"], "")}
    own = [e for e in tr.events if e["tid"] not in comm_threads]
    marked = [span(e) for e in own
              if e["cat"] == "user_annotation" and COMPUTE_LABEL.match(e["name"])]
    if not marked:
        marked = [span(e) for e in own if e["cat"] == "cpu_op" and not CALL_NAME.match(e["name"])]
    calls = [span(e) for e in own if (e["cat"] == "cpu_op" and CALL_NAME.match(e["name"]))
             or (e["cat"] == "user_annotation" and CALL_LABEL.match(e["name"]))]
    return subtract(marked, calls)


def breakdown(tr: Trace, window: tuple | None = None) -> dict:
    """Seconds of compute, of communication, of communication overlapped with compute and
    exposed (communication while nothing computed), and the overlapped share of communication,
    all from the trace's own timestamps; `window` (start, end) in the trace's microseconds."""
    comp = compute_intervals(tr)
    comm = union(span(e) for e in comm_events(tr))
    if window is not None:
        comp, comm = intersect(comp, [window]), intersect(comm, [window])
    both = total(intersect(comp, comm))
    c = total(comm)
    return {"compute_s": total(comp) / 1e6, "comm_s": c / 1e6, "overlapped_s": both / 1e6,
            "exposed_s": (c - both) / 1e6, "overlapped_share": both / c if c else 0.0}


def bubble(traces: list) -> dict:
    """A pipeline step read from every stage's trace: the step is the span from the first
    compute label on any stage to the last; a stage's idle time is the step less its compute.
    bubble = idle / (P x step), as labkit.pipeline.causality defines it on labkit's clocks."""
    comp = [compute_intervals(t) for t in traces]
    start = min(c[0][0] for c in comp if c)
    end = max(c[-1][1] for c in comp if c)
    step = end - start
    busy = [total(c) for c in comp]
    return {"step_s": step / 1e6, "busy_s": [b / 1e6 for b in busy],
            "bubble": 1 - sum(busy) / (len(traces) * step)}


def summary(traces: list, title: str = "") -> str:
    """One row per rank: compute, communication, overlapped and exposed ms, overlapped share."""
    rows = [dict(rank=t.rank, **breakdown(t)) for t in traces]
    return table(rows, [("rank", "rank"), ("compute ms", lambda r: 1e3 * r["compute_s"], ".1f"),
                        ("comm ms", lambda r: 1e3 * r["comm_s"], ".1f"),
                        ("overlapped ms", lambda r: 1e3 * r["overlapped_s"], ".1f"),
                        ("exposed ms", lambda r: 1e3 * r["exposed_s"], ".1f"),
                        ("overlapped share", "overlapped_share", ".0%")], title=title or None)
