"""The one way a checker says "your code used X, which this exercise forbids".

Before anything runs, by reading the code (labkit.check.forbidden):

    FORBIDDEN = Forbidden(("labkit.ddp", "torch.nn.parallel"), {"BucketedDDP"},
                          why="that is the exercise done for you")
    c.refuse(FORBIDDEN.refusal(cls))      # every case of the checker fails with it, unlaunched
    FORBIDDEN.used(cls)                   # ["labkit.ddp (BucketedDDP)"]
    c.refuse(collectives_refusal(fn, "build the ring from send/recv only"))   # source read

While it runs (on a rank or in the checker's process), by raising Refused: the checker's table
shows its message (labkit.check.Checker), whichever rank raised it.

    raise Refused("collective dist.all_gather called: pass the tensor with send/recv")
    with FORBIDDEN.imports_watched("your load"):   # a forbidden module imported in the block
        load(folder)
    with calls_refused([(planner, "evaluate")], why="write the estimate yourself"):
        got = estimate(config)                     # planner.evaluate raises Refused meanwhile
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from dataclasses import dataclass, field

from labkit.check.answers import active
from labkit.check.forbidden import forbidden_used
from labkit.check.source import collectives_called

MARK = "[refused]"      # finds a Refused's message in a rank's traceback text
_IN_TRACEBACK = re.compile(re.escape(MARK) + r" (.*)")


class Refused(RuntimeError):
    """The reader's code, while it ran, used what the exercise forbids."""

    def __init__(self, message: str):
        super().__init__(f"{MARK} {message}")
        self.reason = message


def reason_in(text: str) -> str | None:
    """The message of the last Refused in a traceback's text, or None."""
    found = _IN_TRACEBACK.findall(text or "")
    return found[-1].strip() if found else None


@dataclass(frozen=True)
class Forbidden:
    """What an exercise's answer may not use: modules (a prefix each), names, and why not."""
    modules: tuple
    names: frozenset = field(default_factory=frozenset)
    why: str = "write it yourself"

    def because(self, why: str) -> "Forbidden":
        """The same modules and names, refused with another reason."""
        return dataclasses.replace(self, why=why)

    def used(self, *objs) -> list:
        """Sorted descriptions of what the functions or classes (and the helpers they reach) use
        of the forbidden modules and names; [] if nothing."""
        return forbidden_used(list(objs), tuple(self.modules), set(self.names))

    def refusal(self, *objs, who: str = "your code") -> str:
        """'' if nothing forbidden is used, else the one message every case fails with."""
        used = self.used(*objs)
        return f"{who} uses {', '.join(used)}: {self.why}" if used else ""

    @contextlib.contextmanager
    def imports_watched(self, who: str = "your code"):
        """Raise Refused after the block if it imported a forbidden module (what reading the
        source cannot see: an import by name, inside a library, behind importlib)."""
        before = set(sys.modules)
        yield
        new = sorted(m for m in set(sys.modules) - before if m.startswith(tuple(self.modules)))
        if new:
            raise Refused(f"{who} imported {', '.join(new[:3])}: {self.why}")


def collectives_refusal(fn, why: str, who: str = "your function") -> str:
    """'' if fn's own source calls no torch.distributed collective, else the message (the
    source is read before anything runs; labkit.observe.dispatch.CollectiveLog catches the rest)."""
    used = collectives_called(fn)
    return f"{who} calls {', '.join('dist.' + u for u in used)}: {why}" if used else ""


@contextlib.contextmanager
def calls_refused(targets, why: str):
    """While the block runs (in this process), each (module, name) in `targets` raises Refused
    when called: the functions that ARE the answer, reached however the reader's code reaches
    them. Restored afterwards."""
    def refuse(qualified):
        def refused(*args, **kwargs):
            raise Refused(f"{qualified} was called: {why}")
        return refused

    link = active()
    if link is not None:   # under the grader the student's code runs in the sandbox: there
        link.guard.update(f"{mod.__name__}:{name}" for mod, name in targets)
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    for mod, name, _ in saved:
        setattr(mod, name, refuse(f"{mod.__name__}.{name}"))
    try:
        yield
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)
