"""What a checker may refuse: labkit's own answer, and collectives the exercise did not ask for.

    bad = forbidden_used([MyClass, my_fn], modules=("labkit.tp",), names={"TensorParallelMLP"})
    with observe_collectives() as seen:     # inside a rank: every c10d op, whoever calls it
        ...
    seen.calls                                # [("all_reduce", numel of its tensor), ...]
    seen.collectives()                        # the same, point-to-point ops left out

forbidden_used reads the reader's functions and classes (their source, with ast, and the names
their code reaches through its globals, following the reader's own helpers): it finds an import
of a forbidden module, an attribute path through one, or a forbidden name. observe_collectives is a
TorchDispatchMode: it sees every c10d op the dispatcher runs in this thread, forward and backward
alike (autograd runs CPU backward on the calling thread), without patching torch.distributed.
"""
from __future__ import annotations

import contextlib
import types

# c10d op names (the dispatcher's) -> the torch.distributed function a reader wrote
C10D_TO_DIST = {"allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
                "allreduce": "all_reduce", "alltoall": "all_to_all",
                "alltoall_base": "all_to_all_single", "_reduce_scatter_base":
                "reduce_scatter_tensor", "reduce_scatter": "reduce_scatter",
                "allgather_into_tensor_coalesced": "all_gather_into_tensor",
                "allreduce_coalesced": "all_reduce_coalesced", "broadcast": "broadcast",
                "reduce": "reduce", "gather": "gather", "scatter": "scatter"}
POINT_TO_POINT = ("send", "recv", "barrier", "monitored_barrier")


def forbidden_used(objs, modules: tuple, names: frozenset | set = frozenset()) -> list:
    """What of `modules` (prefixes) and `names` the functions / classes in `objs` (and the
    reader's helpers they call from the same namespace) import, name or reach."""
    found, seen, todo = set(), set(), list(objs)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):                     # a class: read its source and methods
            found |= _in_source(obj, modules, names)
            todo += [v for v in vars(obj).values()
                     if isinstance(v, (types.FunctionType, staticmethod, classmethod, property))]
            continue
        if isinstance(obj, (staticmethod, classmethod)):
            todo.append(obj.__func__)
            continue
        if isinstance(obj, property):
            todo += [f for f in (obj.fget, obj.fset) if f is not None]
            continue
        if not isinstance(obj, types.FunctionType):
            continue
        found |= _in_source(obj, modules, names)
        free = {n: c.cell_contents for n, c in zip(obj.__code__.co_freevars, obj.__closure__ or ())
                if _filled(c)}
        for name in _names_in(obj.__code__) | set(free):
            val = free[name] if name in free else obj.__globals__.get(name)
            home = val.__name__ if isinstance(val, types.ModuleType) else \
                getattr(val, "__module__", None) or ""
            if home.startswith(modules):
                found.add(f"{home} ({name})")
            elif name in names:
                found.add(name)
            elif isinstance(val, (types.FunctionType, type)) and \
                    getattr(val, "__module__", None) == obj.__module__:
                todo.append(val)                      # the reader's own helper: read it too
    return sorted(found)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:                                # an empty cell (not assigned yet)
        return False
    return True


def _names_in(code) -> set:
    out = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out |= _names_in(const)
    return out


def _in_source(obj, modules, names) -> set:
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return set()
    found = set()
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            mods = [ast.unparse(node)]
        found |= {m for m in mods if any(m.startswith(p) or f" {p}" in m or f".{p}" in m
                                          for p in modules)}
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if name in names:
            found.add(name)
    return found


def public_name(op_name: str) -> str:
    """'allreduce_.default' -> 'all_reduce' (what the reader wrote)."""
    base = op_name.split(".")[0].rstrip("_")
    return C10D_TO_DIST.get(base, base)


class _Seen:
    def __init__(self):
        self.calls: list = []                     # [(public name, numel of its tensors)]

    def collectives(self) -> list:
        return [c for c in self.calls if not c[0].startswith(POINT_TO_POINT)]


def _numel(args) -> int:
    import torch

    n = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            n += a.numel()
        elif isinstance(a, (list, tuple)):
            n += sum(t.numel() for t in a if isinstance(t, torch.Tensor))
    return n


@contextlib.contextmanager
def observe_collectives(refuse: bool = False, why: str = ""):
    """Record every c10d op run in this block; with `refuse`, a collective (anything but
    send/recv/barrier) raises RuntimeError(why) instead of running."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = _Seen()

    class Observe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            if func.namespace == "c10d":
                name = public_name(func.__name__)
                seen.calls.append((name, _numel(args[:1])))
                if refuse and not name.startswith(POINT_TO_POINT):
                    raise RuntimeError(f"collective dist.{name} called (c10d.{func.__name__}): "
                                       f"{why}")
            return func(*args, **(kwargs or {}))

    with Observe():
        yield seen
