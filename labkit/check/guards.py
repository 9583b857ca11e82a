"""What a checker watches while the reader's code runs: the collectives it really calls, and
the modules it must not use. Shared by every chapter's checkers.

    with CollectiveLog() as log:                    # inside a rank
        fn(x)
    log.calls                  # ["all_reduce", "broadcast", ...]: every c10d collective dispatched
    log.collectives()          # the same without send/recv/barrier
    log.sized()                # [("all_reduce", elements), ...]: each call with its tensor's size

    with CollectiveLog(refuse=True):                # a collective raises at once, with a hint
        ring(x)

    forbidden_used([fn], ("labkit.ddp", "torch.nn.parallel"))   # -> ["labkit.ddp (BucketedDDP)"]

forbidden_used reads the reader's functions and classes (source with ast, and what their code
reaches through globals and closures), following decorated functions, methods, properties,
bases and the reader's own helpers from the same namespace.

Why a dispatch mode: every torch.distributed call reaches the dispatcher as a c10d operator,
whoever makes it (the reader's function, a helper it calls, a library it imports), so the log is
a counter the code under test does not write, and nothing in torch.distributed is replaced.
Reading the source (ast) alone misses a collective hidden in a helper or behind getattr.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types

from torch.utils._python_dispatch import TorchDispatchMode

POINT_TO_POINT = ("send", "recv", "recv_any_source", "barrier", "monitored_barrier")
# c10d operator name -> the torch.distributed name the reader wrote
_PUBLIC = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
           "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
           "allgather_into_tensor_coalesced": "all_gather_into_tensor",
           "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter_tensor",
           "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
           "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
           "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter"}


def public_name(op_name: str) -> str:
    base = op_name.split(".")[0].rstrip("_")
    return _PUBLIC.get(base, base)


class CollectiveLog(TorchDispatchMode):
    """Records every c10d operator dispatched on this thread while active (by its
    torch.distributed name); with refuse=True a collective (anything but send/recv/barrier)
    raises a RuntimeError naming it instead of running."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False    # else defining the mode imports torch._dynamo: seconds on a cold rank

    def __init__(self, refuse: bool = False, why: str = "use point-to-point messages only"):
        super().__init__()
        self.calls: list = []
        self.numels: list = []          # elements in each call's tensors (its first argument)
        self.refuse, self.why = refuse, why

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.__name__.split(".")[0].rstrip("_")
            if name not in ("wait", "work_wait"):
                public = public_name(func.__name__)
                self.calls.append(public)
                self.numels.append(_numel(args[:1]))
                if self.refuse and not public.startswith(POINT_TO_POINT):
                    raise RuntimeError(f"collective dist.{public} called: {self.why}")
        return func(*args, **(kwargs or {}))

    def collectives(self) -> list:
        return [c for c in self.calls if not c.startswith(POINT_TO_POINT)]

    def sized(self) -> list:
        """[(name, elements)] of every call, in order."""
        return list(zip(self.calls, self.numels))


def _numel(args) -> int:
    import torch

    n = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            n += a.numel()
        elif isinstance(a, (list, tuple)):
            n += sum(t.numel() for t in a if isinstance(t, torch.Tensor))
    return n


# ----------------------------------------------------------------------------- forbidden modules
def forbidden_used(fns, modules: tuple, names=()) -> list:
    """What of `modules` the functions or classes (and the helpers they call from the same
    namespace) import, name, or reach through their globals: sorted descriptions, [] if none."""
    found, seen, todo = set(), set(), list(fns)
    while todo:
        obj = todo.pop()
        if isinstance(obj, types.FunctionType):
            obj = inspect.unwrap(obj)               # @torch.no_grad, @contextmanager: the body
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):                   # a class: its methods and its bases
            home = obj.__module__ or ""
            if home.startswith(modules):
                found.add(f"{home} ({obj.__name__})")
            for v in vars(obj).values():
                if isinstance(v, (staticmethod, classmethod)):
                    todo.append(v.__func__)
                elif isinstance(v, property):
                    todo += [f for f in (v.fget, v.fset) if f is not None]
                elif isinstance(v, types.FunctionType):
                    todo.append(v)
            todo += [b for b in obj.__bases__ if b.__module__ == obj.__module__ or
                     (b.__module__ or "").startswith(modules)]      # the reader's, or refused
            continue
        if not isinstance(obj, types.FunctionType):
            continue
        found |= _in_source(obj, modules, set(names))
        free = {n: c.cell_contents for n, c in zip(obj.__code__.co_freevars, obj.__closure__ or ())
                if _filled(c)}                      # a closure's variables, as its globals
        for name in _names_in(obj.__code__) | set(free):
            val = free[name] if name in free else obj.__globals__.get(name)
            home = val.__name__ if isinstance(val, types.ModuleType) else \
                getattr(val, "__module__", None) or ""
            if isinstance(home, str) and home.startswith(modules):
                found.add(f"{home} ({name})")
            elif name in names:
                found.add(name)
            elif isinstance(val, (types.FunctionType, type)) and \
                    getattr(val, "__module__", None) == obj.__module__:
                todo.append(val)                    # the reader's own helper: read it too
    return sorted(found)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:                              # a closure cell not assigned yet
        return False
    return True


def _names_in(code) -> set:
    out = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out |= _names_in(const)
    return out


def _in_source(fn, modules: tuple, names: set) -> set:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    found = set()
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from labkit import costs` names labkit.costs
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            mods = [ast.unparse(node)]
        found |= {m for m in mods if m.startswith(modules)}
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if name in names:
            found.add(name)
    return found
