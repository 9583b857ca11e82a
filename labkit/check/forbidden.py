"""What of a set of modules and names the reader's functions or classes use, found by reading
them: the source (labkit.check.source) and what their code reaches through globals and closures,
following decorated functions, methods, properties, bases and the reader's own helpers from the
same namespace. A checker states what it forbids once (labkit.check.refusal.Forbidden).

    forbidden_used([fn], ("labkit.ddp", "torch.nn.parallel"))   # -> ["labkit.ddp (BucketedDDP)"]
"""
from __future__ import annotations

import ast
import inspect
import types

from labkit.check.answers import active, is_remote
from labkit.check.source import tree_of


def forbidden_used(fns, modules: tuple, names=()) -> list:
    """What of `modules` the functions or classes (and the helpers they call from the same
    namespace) import, name, or reach through their globals: sorted descriptions, [] if none."""
    if any(is_remote(f) for f in fns):   # under the grader: read in the sandbox, where the same
        return active().forbidden(list(fns), modules, set(names))   # modules refuse to run
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
        _ = cell.cell_contents                      # read only to see if it raises
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
    tree = tree_of(fn)
    if tree is None:
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
