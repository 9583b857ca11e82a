"""Forbidden at run time, in the sandbox and on its ranks: while an exercise is checked, every
function (and every method of every class) of the modules it forbids refuses to run when student
code calls it, however the student reached it: an alias (`from labkit.ddp import
assign_buckets as mine`), functools.partial, a default argument, importlib with a string.

    with refusing(("labkit.ddp", "labkit.costs.planner:evaluate")):   # a prefix, or module:name
        fn(x)          # raises Refused if fn reaches labkit.ddp's code

How: the function objects themselves are changed (their __code__ swapped for one that asks who
is calling), so every reference to them, wherever it was taken, sees the change. Who calls
decides: the first frame up the stack outside Python's own library (threading, functools); a
notebook cell or a file beside it is the student's, labkit and site-packages are the grader's,
so the checker's own rank jobs (and its callbacks that the student's code calls) still use the
reference. Not stopped: a guarded function handed to torch as a hook (torch calls it), code
that rewrites the interpreter's state itself (restores __code__, compiles its code under a
labkit file name) or copies the reference's source; the judge compares results, so such an
answer must still compute right ones.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import os
import sys
import sysconfig
import types

MARK = "[refused]"       # what labkit.check.refusal looks for in a rank's traceback
_PATHS = sysconfig.get_paths()
SITE = tuple({os.path.abspath(_PATHS[k]) + os.sep for k in ("purelib", "platlib")})
STDLIB = tuple({os.path.abspath(_PATHS[k]) + os.sep for k in ("stdlib", "platstdlib")})
LABKIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_active: list = []      # (key, function, its own code) swapped now, nested blocks included
_originals: dict = {}    # key -> the function as it was, called when the grader calls


class Refused(RuntimeError):
    def __init__(self, reason: str):
        super().__init__(f"{MARK} {reason}")
        self.reason = reason


def student_calls() -> bool:
    """Whether the code calling a guarded function is the student's: the first frame up the
    stack that is not Python's own library (threading, functools) decides; labkit's (the
    sandbox's copy, or a checker's job sent by the judge) and site-packages' are the grader's."""
    judge = os.environ.get("LABKIT_JUDGE_LABKIT") or LABKIT
    frame = sys._getframe(3)   # 0: here, 1: _refuse_or_call, 2: the guarded function itself
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(SITE + (LABKIT, judge)):
            return False
        if not (name.startswith(STDLIB) or name.startswith("<frozen")):
            return True
        frame = frame.f_back
    return True


def _refuse_or_call(key, args, kwargs):
    if student_calls():
        raise Refused(f"{key} was called from your code: this exercise forbids it (write it "
                      f"yourself)")
    return _originals[key](*args, **kwargs)


def _swapped(fn: types.FunctionType, key: str) -> types.CodeType:
    """A code object with fn's free variables that calls _refuse_or_call(key, ...)."""
    free = fn.__code__.co_freevars
    touch = f"        ({', '.join(free)},)\n" if free else ""
    source = (f"def _make({', '.join(free)}):\n"
              f"    def {fn.__code__.co_name}(*args, **kwargs):\n{touch}"
              f"        return __labkit_refuse_or_call__({key!r}, args, kwargs)\n"
              f"    return {fn.__code__.co_name}\n")
    namespace: dict = {}
    exec(compile(source, "<labkit guard>", "exec"), namespace)   # noqa: S102 - our own template
    code = namespace["_make"].__code__.co_consts
    inner = next(c for c in code if isinstance(c, types.CodeType))
    return inner.replace(co_filename=fn.__code__.co_filename)


def _targets(spec: str):
    """(key, function) of every function a spec names."""
    if ":" in spec:
        module, name = spec.split(":", 1)
        with contextlib.suppress(ImportError):
            obj = getattr(importlib.import_module(module), name, None)
            yield from _of(obj, f"{module}.{name}")
        return
    # nothing is imported here (a checker may look at what the ranks imported): what is not
    # imported yet is guarded when it is (_Later)
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and (mod_name == spec or mod_name.startswith(spec + ".")):
            yield from _in_module(mod)


def _in_module(mod):
    for name, obj in list(vars(mod).items()):
        if getattr(obj, "__module__", None) == mod.__name__:
            yield from _of(obj, f"{mod.__name__}.{name}")


class _Later(importlib.abc.MetaPathFinder):
    """A forbidden module imported while the block runs is guarded as soon as it has run."""

    def __init__(self, specs, guard_module):
        self.prefixes = tuple(sp.partition(":")[0] for sp in specs if ":" not in sp)
        self.guard_module = guard_module

    def find_spec(self, name, path, target=None):
        if not any(name == p or name.startswith(p + ".") for p in self.prefixes):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            found = finder.find_spec(name, path, target)
            if found is not None and found.loader is not None and \
                    hasattr(found.loader, "exec_module"):
                run = found.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    self.guard_module(module)
                found.loader.exec_module = exec_module
                return found
        return None


def _of(obj, key: str):
    if isinstance(obj, types.FunctionType):
        yield key, obj
    elif isinstance(obj, type):
        for name, v in list(vars(obj).items()):
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            elif isinstance(v, property):
                v = v.fget
            # the class's own methods only: an Enum's __new__ is enum.Enum's, not the module's
            if isinstance(v, types.FunctionType) and v.__module__ == obj.__module__:
                yield f"{key}.{name}", v


@contextlib.contextmanager
def refusing(specs):
    """While the block runs, the functions of `specs` refuse student callers."""
    swapped, done = [], {id(fn) for _, fn, _ in _active}

    def swap(targets):
        for key, fn in targets:
            if key in _originals or id(fn) in done:
                continue
            done.add(id(fn))
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                      fn.__closure__)
            copy.__kwdefaults__ = fn.__kwdefaults__
            _originals[key] = copy
            fn.__globals__["__labkit_refuse_or_call__"] = _refuse_or_call
            old = fn.__code__
            try:
                fn.__code__ = _swapped(fn, key)
            except Exception:  # noqa: BLE001 - a function this cannot swap stays as it is
                _originals.pop(key)
                continue
            swapped.append((key, fn, old))
            _active.append((key, fn, old))

    for spec in specs:
        swap(_targets(spec))
    later = _Later(specs, lambda module: swap(_in_module(module)))
    sys.meta_path.insert(0, later)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(later)
        for key, fn, old in reversed(swapped):
            fn.__code__ = old
            _originals.pop(key, None)
        keep = {id(fn) for _, fn, _ in swapped}
        _active[:] = [entry for entry in _active if id(entry[1]) not in keep]


def _matches(module: str, name: str, specs) -> bool:
    for spec in specs:
        mod, _, one = spec.partition(":")
        if (module == mod or module.startswith(mod + ".")) and (not one or one == name):
            return True
    return False


def refuse_answers(objs, specs) -> None:
    """Raise Refused if an answer handed in IS what the exercise forbids: the reference itself,
    a functools.partial of it, a bound method of it, or a class that inherits from it."""
    for obj in objs:
        while isinstance(obj, functools.partial):
            obj = obj.func
        obj = getattr(obj, "__func__", obj)
        chain = obj.__mro__ if isinstance(obj, type) else (obj,)
        for part in chain:
            module, name = getattr(part, "__module__", None), getattr(part, "__name__", "")
            if isinstance(module, str) and _matches(module, str(name), specs):
                raise Refused(f"your answer is {module}.{name} (or built on it): this exercise "
                              f"forbids it (write it yourself)")


def guarded(specs, job, args, kwargs):
    """A rank's job under the same refusals as the sandbox's (sent by reference: this module is
    in the submission's copy of labkit)."""
    with refusing(specs):
        return job(*args, **kwargs)
