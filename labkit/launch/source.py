"""The reader's source, carried to the ranks, so that a rank's traceback and a hang report point
at the reader's own code: `Cell In[5], line 6, in my_step` (IPython's name for a notebook cell)
or `File ".../mine.py", line 6`, each with its source line, and without the launcher's frames.

A function defined in a notebook cell travels by value (cloudpickle). Since cloudpickle 3.1 every
code object it sends is renamed `<dynamic-code>` (cloudpipe/cloudpickle#560, for deterministic
payloads), so a rank could no longer say where its code came from. Our pickler keeps each code
object's real file name (whatever cloudpickle's version does), and the run carries the text of
files a rank cannot read itself: a cell lives only in the kernel's linecache.
"""
from __future__ import annotations

import io
import linecache
import os
import re
import sys
import traceback
import types

import cloudpickle

DYNAMIC = "<dynamic-code>"
# The launcher's own frames (rank.py calls the reader's function) and torch's c10d logging
# wrapper add nothing the reader can act on.
_HIDDEN = re.compile(r"labkit[/\\]launch[/\\]|c10d_logger\.py$")
_FILE_LINE = re.compile(r'^(?P<indent>\s*)File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>.*)$')

_names: dict[str, str] = {}   # in a rank: file name -> the reader's name for it ("Cell In[5]")


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """Unpickling side: the code object under its real file name again."""
    return code.replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, but every code object sent by value keeps its file name (and we note it)."""

    def __init__(self, file):
        super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)
        self.files: set[str] = set()

    def reducer_override(self, obj):
        if type(obj) is types.CodeType and obj.co_filename != DYNAMIC:
            self.files.add(obj.co_filename)
            # the inner code object has DYNAMIC as its name, so it falls through to cloudpickle
            return _with_filename, (obj.replace(co_filename=DYNAMIC), obj.co_filename)
        return super().reducer_override(obj)


def dumps(obj) -> tuple[bytes, dict]:
    """Pickle `obj` for the ranks; also return the sources they need: {file: (name, lines)},
    where name is IPython's "Cell In[N]" for a notebook cell (else None) and lines is the text
    of a file that exists only in this process's linecache (else None: the rank reads the file)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    sources = {}
    for file in sorted(pickler.files):
        name = cell_name(file)
        lines = None if os.path.exists(file) else linecache.getlines(file) or None
        if name or lines:
            sources[file] = (name, lines)
    return buf.getvalue(), sources


def cell_name(file: str) -> str | None:
    """IPython's name for the cell compiled under this file name, 'Cell In[5]', or None."""
    ipython = sys.modules.get("IPython")   # never import IPython just to ask
    shell = ipython.get_ipython() if ipython is not None else None
    count = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(file)
    return f"Cell In[{count}]" if count is not None else None


def install(sources: dict) -> None:
    """In a rank: make the carried sources readable to linecache and remember the cells' names."""
    for file, (name, lines) in sources.items():
        if name:
            _names[file] = name
        if lines:   # mtime None: linecache.checkcache never drops an entry with no file behind it
            linecache.cache[file] = (sum(map(len, lines)), None, list(lines), file)


def frame_line(file: str, lineno: int, func: str, names: dict | None = None) -> str:
    """One frame as the reader would name it: `Cell In[5], line 6, in f` or `File "x", line 6, in
    f`."""
    name = (names if names is not None else _names).get(file)
    where = f"{name}, line {lineno}" if name else f'File "{file}", line {lineno}'
    return f"  {where}, in {func}"


def hidden(file: str) -> bool:
    """A frame of the launcher's own (or of Python's frozen import machinery)."""
    return bool(_HIDDEN.search(file)) or file.startswith("<frozen")


def format_exception(err: BaseException) -> str:
    """A rank's traceback: the reader's frames only, cells named as IPython names them."""
    te = traceback.TracebackException.from_exception(err)
    seen = set()
    stack = [te]
    # every exception of the chain (__cause__, __context__) loses the launcher's frames
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if not hidden(f.filename)])
        stack += [c for c in (t.__cause__, t.__context__) if c is not None]
        stack += list(getattr(t, "exceptions", None) or [])
    out = []
    for line in "".join(te.format()).splitlines():
        m = _FILE_LINE.match(line)
        if m and m["file"] in _names:
            line = f'{m["indent"]}{_names[m["file"]]}, line {m["line"]}{m["rest"]}'
        out.append(line)
    return "\n".join(out) + "\n"
