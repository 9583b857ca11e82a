"""Exercise 5.5: read a profiler trace and find the exposed communication.

The reader writes exposed_comm(events) -> seconds: the time some collective was running (an
event named gloo:*) while nothing computed (no forward, backward or optimizer label running,
less the c10d::* calls and "all_reduce ..." labels inside them: queueing or waiting for a
collective is not compute). Events are the trace's complete events as labkit.profiling.read
loads them: dicts with name, cat, ts and dur (microseconds), tid.

Graded against labkit.profiling.read.breakdown's "exposed_s" (the oracle here on purpose: the
book's one reading of a trace), on hand-made traces with known answers and on the two ranks'
traces of a real DDP step recorded in the checker's own processes.
"""
from __future__ import annotations

import tempfile

from labkit.check import Checker, Forbidden, fail, graded
from labkit.profiling import read
from labkit.profiling.jobs import ddp_job
from labkit.profiling.read import Trace, breakdown

EXERCISE, TITLE, POINTS = "5.5", "read a trace: the exposed communication", 4
TOLERANCE_S = 1e-9           # interval arithmetic on the same numbers: exact up to rounding
FORBIDDEN = Forbidden(("labkit.profiling",), why="read the events yourself")


def _x(name, ts, dur, tid=1, cat="user_annotation"):
    return dict(name=name, cat=cat, ts=float(ts), dur=float(dur), tid=tid, pid=1)


# (what the case teaches, events, exposed seconds worked out by hand)
HAND_CASES = [
    ("every collective under compute: nothing exposed",
     [_x("forward", 0, 100), _x("backward", 100, 100), _x("gloo:all_reduce", 120, 50, tid=2)],
     0.0),
    ("two collectives at once on Gloo's two threads count once; the tail after backward is exposed",
     [_x("backward", 0, 100), _x("gloo:all_reduce", 50, 100, tid=2),
      _x("gloo:all_reduce", 80, 100, tid=3), _x("optimizer", 200, 10)],
     80e-6),
    ("a c10d call inside backward queues or waits: not compute",
     [_x("backward", 0, 200), _x("c10d::allreduce_", 50, 30, cat="cpu_op"),
      _x("all_reduce bucket 0", 50, 30), _x("gloo:all_reduce", 60, 40, tid=2)],
     20e-6),
    ("operators and other labels are not the compute labels' business; gaps between labels count",
     [_x("forward", 0, 50), _x("aten::mm", 60, 20, cat="cpu_op"), _x("backward", 100, 50),
      _x("gloo:all_reduce", 40, 80, tid=2), _x("Optimizer.step#SGD.step", 150, 20)],
     50e-6),
]


def _oracle(events) -> float:
    return breakdown(Trace("given", 0, [dict(e) for e in events], {}))["exposed_s"]


def _diagnose(got: float, events, want: float) -> str:
    comm = sum(e["dur"] for e in events if e["name"].startswith("gloo:")) / 1e6
    if want and abs(got / want - 1e6) < 1e-3:
        return "The trace's ts and dur are microseconds; return seconds."
    if abs(got - comm) < TOLERANCE_S:
        return ("That is all the communication: subtract the time a compute label (forward, "
                "backward, optimizer) was running.")
    if got > want:
        return ("Too much: collectives that run at the same time count once (a union of "
                "intervals), and so do nested labels.")
    return ("Too little: a c10d::* call or an 'all_reduce ...' label inside backward is the "
            "caller queueing or waiting for a collective, not compute; take it out of compute.")


def _ddp_job(folder):
    return ddp_job(folder, kind="bucketed", steps=2, bucket_mb=0.05)


@graded("5.5")
def exposed_communication(fn, run: bool = True):
    """Exercise 5.5: the reader's exposed_comm(events) against labkit.profiling's reading."""
    c = Checker(EXERCISE, TITLE, POINTS)
    c.refuse(FORBIDDEN.refusal(fn, who="exposed_comm"))

    def check(events, want):
        got = fn([dict(e) for e in events])       # a copy: the answer cannot edit the events
        if not isinstance(got, (int, float)):
            fail(f"exposed_comm returned {type(got).__name__}; return seconds as a float")
        if abs(float(got) - want) > TOLERANCE_S:
            fail(f"exposed communication {want * 1e6:.1f} us, you found {float(got) * 1e6:.1f} "
                 f"us. " + _diagnose(float(got), events, want))
        return float(got)

    for what, events, want in HAND_CASES:
        with c.case(f"hand-made trace: {what}"):
            assert abs(_oracle(events) - want) < TOLERANCE_S     # the oracle agrees with the hand
            check(events, want)
    if not run:
        return c.finish()
    with tempfile.TemporaryDirectory(prefix="labkit-5.5-") as folder:
        with c.case("a real DDP step (bucketed, 2 ranks, Gloo), each rank's trace file"):
            c.measure(_ddp_job, 2, args=(folder,), timeout=120)
            for tr in read.load_folder(folder):
                want = read.breakdown(tr)["exposed_s"]
                got = check(tr.events, want)
                print(f"   rank {tr.rank}: exposed {got * 1e3:.2f} ms of "
                      f"{read.breakdown(tr)['comm_s'] * 1e3:.2f} ms of communication")
    return c.finish()
