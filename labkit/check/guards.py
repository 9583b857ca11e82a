"""What a checker watches while the reader's code runs: the collectives it really calls.
Shared by every chapter's checkers.

    with CollectiveLog() as log:                    # inside a rank
        fn(x)
    log.calls                  # ["all_reduce", "broadcast", ...]: every c10d collective dispatched
    log.collectives()          # the same without send/recv/barrier
    log.sized()                # [("all_reduce", elements), ...]: each call with its tensor's size

    with CollectiveLog(refuse=True):                # a collective raises at once, with a hint
        ring(x)

What the reader's code must not import or name is read, not watched: labkit.check.forbidden.

Why a dispatch mode: every torch.distributed call reaches the dispatcher as a c10d operator,
whoever makes it (the reader's function, a helper it calls, a library it imports), so the log is
a counter the code under test does not write, and nothing in torch.distributed is replaced.
Reading the source (ast) alone misses a collective hidden in a helper or behind getattr.
c10d operator names become torch.distributed's by labkit.observe.dispatch's map (the one map).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.check.refusal import Refused
from labkit.observe.dispatch import POINT_TO_POINT, public_name


class CollectiveLog(TorchDispatchMode):
    """Records every c10d operator dispatched on this thread while active (by its
    torch.distributed name); with refuse=True a collective (anything but send/recv/barrier and
    the names in `allow`) raises Refused (labkit.check.refusal) naming it instead of running."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False    # else defining the mode imports torch._dynamo: seconds on a cold rank

    def __init__(self, refuse: bool = False, why: str = "use point-to-point messages only",
                 allow: tuple = ()):
        super().__init__()
        self.calls: list = []
        self.numels: list = []          # elements in each call's tensors (its first argument)
        self.refuse, self.why = refuse, why
        self.allowed = POINT_TO_POINT + tuple(allow)     # never refused (by name prefix)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0].rstrip("_")
            if name not in ("wait", "work_wait"):
                public = public_name(func.__name__)
                self.calls.append(public)
                self.numels.append(_numel(args[:1]))
                if self.refuse and not public.startswith(self.allowed):
                    raise Refused(f"collective dist.{public} called: {self.why}")
        return func(*args, **(kwargs or {}))

    def collectives(self) -> list:
        return [c for c in self.calls if not c.startswith(POINT_TO_POINT)]

    def sized(self) -> list:
        """[(name, elements)] of every call, in order."""
        return list(zip(self.calls, self.numels))


def _numel(args) -> int:
    n = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            n += a.numel()
        elif isinstance(a, (list, tuple)):
            n += sum(t.numel() for t in a if isinstance(t, torch.Tensor))
    return n
