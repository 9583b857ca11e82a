"""What the sandbox imports, made for one submission, and the grader's files, watched.

    root = make(chapter)       # a temp folder holding a read-only copy of labkit, without checkers
    Pristine().changed()       # ["labkit/check/__init__.py"]: grader files edited since the start
    Pristine().restore()       # written back as they were when grading started

The copy holds labkit as the grader found it when grading started (the judge's own imports come
from the same bytes), except labkit.check: in its place a stub (`labkit/check/__init__.py` and one
`chNN` module per chapter) whose checker functions hand their answers to the sandbox
(labkit.grade.child.record), with the data the exercises show the reader (the case tables, the
scenarios) and the few helpers they call (SANDBOX_HELPERS), and the two source readers
(source.py, forbidden.py, and answers.py, the registry they import). No checker, no oracle, no
solution is in it. Files are made read-only
(a student running as the grader's user can make them writable again: the copy is this
submission's only, and thrown away after it).
"""
from __future__ import annotations

import importlib
import shutil
import stat
import sysconfig
import tempfile
from pathlib import Path

import cloudpickle

import labkit
from labkit.check.answers import REGISTRY

LABKIT = Path(labkit.__file__).resolve().parent
# helpers (not checkers, not data) an exercise notebook calls from its chapter's checker module
SANDBOX_HELPERS = {6: ("split_range",), 1: ("collectives_called",)}
STUB_INIT = '''"""labkit.check in the grader's sandbox: checker calls hand in answers;
nothing is checked here (labkit.grade.copy made this stub)."""
from labkit.grade.child import record


def stub(exercise, names, params, title):
    def checker(*args, **kwargs):
        record(exercise, names, params, args, kwargs)
    checker.__name__ = title
    return checker
'''
STUB_CHAPTER = '''"""Chapter {n:02d}'s checkers in the grader's sandbox: each hands its answer
in."""
import pickle as _pickle
from pathlib import Path as _Path

from labkit.check import stub as _stub

globals().update(_pickle.loads((_Path(__file__).parent / "data.pkl").read_bytes()))
{stubs}
'''


def make(chapter: int) -> Path:
    """A fresh folder with labkit (read-only) for one submission of `chapter`."""
    root = Path(tempfile.mkdtemp(prefix="labkit-sandbox-"))
    shutil.copytree(LABKIT, root / "labkit", ignore=_skip)
    check = root / "labkit" / "check"
    check.mkdir()
    (check / "__init__.py").write_text(STUB_INIT)
    for name in ("answers.py", "source.py", "forbidden.py"):
        shutil.copy2(LABKIT / "check" / name, check / name)
    _chapter(check / f"ch{chapter:02d}", chapter)
    for path in sorted(root.rglob("*"), reverse=True):
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    return root


def remove(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            try:
                path.chmod(path.stat().st_mode | stat.S_IWUSR)
            except OSError:
                continue
    shutil.rmtree(root, ignore_errors=True)


def _skip(folder, names):
    out = {n for n in names if n == "__pycache__" or n.endswith(".pyc")}
    if Path(folder).resolve() == LABKIT:
        out.add("check")
    return out


def _chapter(folder: Path, chapter: int) -> None:
    mod = importlib.import_module(f"labkit.check.ch{chapter:02d}")
    folder.mkdir()
    data, stubs = {}, []
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        checker = getattr(obj, "checker", None)
        if checker is not None:
            exercise = next(ex for ex, f in REGISTRY.items() if f is checker)
            stubs.append(f"{name} = _stub({exercise!r}, {tuple(checker.answer_names)!r}, "
                         f"{tuple(checker.params)!r}, {name!r})")
        elif not callable(obj) or name in SANDBOX_HELPERS.get(chapter, ()):
            data[name] = obj
    with _by_value():
        (folder / "data.pkl").write_bytes(cloudpickle.dumps(data))
    (folder / "__init__.py").write_text(STUB_CHAPTER.format(n=chapter, stubs="\n".join(stubs)))


class _by_value:
    """cloudpickle sends labkit.check's functions by value (the sandbox cannot import them)."""

    def __enter__(self):
        import labkit.check as check  # noqa: PLC0415 - the module object cloudpickle asks for
        self.module = check
        cloudpickle.register_pickle_by_value(check)

    def __exit__(self, *exc):
        cloudpickle.unregister_pickle_by_value(self.module)


by_value = _by_value


class Pristine:
    """The grader's own files as they were when grading started: labkit's sources, and the
    files at the top of site-packages that Python runs at start-up (*.pth, sitecustomize)."""

    def __init__(self):
        self.files = {p: p.read_bytes() for p in _watched()}

    def changed(self) -> list:
        now = set(_watched())
        out = [p for p in self.files if p not in now or _read(p) != self.files[p]]
        out += [p for p in now if p not in self.files]
        return sorted(out)

    def restore(self) -> None:
        for path in self.changed():
            if path in self.files:
                if path.exists():
                    path.chmod(path.stat().st_mode | stat.S_IWUSR)
                path.write_bytes(self.files[path])
            else:
                path.unlink(missing_ok=True)

    @staticmethod
    def describe(path: Path) -> str:
        try:
            return str(path.relative_to(LABKIT.parent))
        except ValueError:
            return str(path)


def _watched():
    yield from (p for p in LABKIT.rglob("*.py") if "__pycache__" not in p.parts)
    for key in ("purelib", "platlib"):
        site = Path(sysconfig.get_paths()[key])
        if site.is_dir():
            yield from (p for p in site.iterdir() if p.is_file() and
                        (p.suffix == ".pth" or p.name.startswith(("sitecustomize",
                                                                   "usercustomize"))))


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None

