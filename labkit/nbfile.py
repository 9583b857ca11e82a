"""Notebook files written byte for byte as JupyterLab 4 saves them.

A notebook that JupyterLab opens lives in the browser as JavaScript objects; saving sends it back
as JSON, and the server writes it with nbformat. What comes out differs from what nbformat alone
writes (as nbclient and `labkit book run` used to), so that merely opening a chapter and letting
autosave run rewrote it. The differences, each found by saving a notebook from a real JupyterLab
(4.6, ipykernel 7) and diffing, and each undone here:

1. Numbers: JavaScript keeps every number as a double and JSON.stringify writes one with no
   fraction as an integer, so 0.0, 1.0, 5.0 in outputs and widget state come back as 0, 1, 5
   (-0.0 as 0; an int beyond 2**53 rounded to a double; NaN and infinities as null).
2. The kernelspec: JupyterLab replaces it by {name, display_name, language} of the kernel it
   started, and ipykernel's display name is "Python 3 (ipykernel)", not "Python 3".
3. Cell metadata: `collapsed` and `jupyter.outputs_hidden` are kept equal, `collapsed` winning
   (one without the other gets its twin).
4. Multi-line strings (sources, stream text, text/* outputs) are joined in the browser and
   split at line ends by the server, whatever splitting the file had.
5. Consecutive stream outputs of one name (two prints around a subprocess's output): JupyterLab's
   output area shows them as one, so its views and its model no longer count outputs alike, and
   the plotly extension writing its PNG back by view index overwrote the output after them with
   a second copy of the figure (chapter 02's trace cell, found by tests/e2e/test_open_is_not_edit).
   They are written as one stream, as nbconvert's coalesce_streams does.

Everything else (key order, one-space indent, ensure_ascii off, trailing newline) is nbformat's,
which the server uses too. What JupyterLab does that no writer can (a PNG that the plotly
extension draws into figure outputs, the kernel's language_info on another Python) is the job of
labkit.labsave, which the book's server runs before it writes a notebook.
"""
from __future__ import annotations

import copy
import decimal
import json
import math
import os
import tempfile
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbformat.v4.rwbase import rejoin_lines

# Past this, a JavaScript number is no longer an exact integer.
JS_EXACT_INT = 2 ** 53
# From here on JSON.stringify writes an integral double with an exponent ("1e+21"), which the
# server reads back as a float.
JS_EXPONENT_FROM = 1e21


def js_number(x):
    """The number `x` after a JSON round trip through JavaScript and back into Python."""
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        if abs(x) <= JS_EXACT_INT:
            return x
        try:
            x = float(x)
        except OverflowError:  # Infinity in JavaScript, written as null
            return None
    if math.isnan(x) or math.isinf(x):
        return None
    if x.is_integer() and abs(x) < JS_EXPONENT_FROM:
        # JavaScript prints the shortest digits that identify the double, then zeros
        # (1.2345678901234567e19 -> 12345678901234567000); Python's repr has the same digits.
        return int(decimal.Decimal(repr(x)))
    return x


def _js(value):
    if isinstance(value, dict):
        return {k: _js(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_js(v) for v in value]
    if isinstance(value, (int, float)):
        return js_number(value)
    return value


def _sync_collapsed(metadata: dict) -> None:
    """JupyterLab's YCell.setMetadata (@jupyter/ydoc), which every cell goes through on load."""
    if metadata.get("collapsed") is not None:
        jupyter = metadata.get("jupyter") or {}
        metadata["jupyter"] = {**jupyter, "outputs_hidden": metadata["collapsed"]}
    elif isinstance(metadata.get("jupyter"), dict) and \
            metadata["jupyter"].get("outputs_hidden") is not None:
        metadata["collapsed"] = metadata["jupyter"]["outputs_hidden"]


_SPECS: dict = {}


def kernelspec(name: str):
    """{name, display_name, language} as JupyterLab writes it for the kernel `name`, or None when
    no such kernel is installed here (then the notebook's own kernelspec stays)."""
    if name not in _SPECS:
        try:
            spec = KernelSpecManager().get_kernel_spec(name)
            _SPECS[name] = {"name": name, "display_name": spec.display_name,
                            "language": spec.language}
        except NoSuchKernel:
            _SPECS[name] = None
    return _SPECS[name]


def coalesce_streams(cell) -> None:
    """Join consecutive stream outputs of one name in `cell` (texts already joined)."""
    outputs = []
    for out in cell.get("outputs", []):
        last = outputs[-1] if outputs else None
        if (out.get("output_type") == "stream" and last is not None
                and last.get("output_type") == "stream" and last.get("name") == out.get("name")):
            last["text"] += out["text"]
        else:
            outputs.append(out)
    if "outputs" in cell:
        cell["outputs"] = outputs


def as_jupyterlab(nb) -> nbformat.NotebookNode:
    """A copy of `nb` (a NotebookNode or a plain dict) holding what JupyterLab would save."""
    nb = nbformat.from_dict(copy.deepcopy(dict(nb)))
    rejoin_lines(nb)  # the server splits lines again when it writes
    nb = nbformat.from_dict(_js(json.loads(json.dumps(nb))))
    for cell in nb.cells:
        _sync_collapsed(cell.setdefault("metadata", nbformat.NotebookNode()))
        coalesce_streams(cell)
    spec = nb.metadata.get("kernelspec")
    if isinstance(spec, dict) and spec.get("name"):
        nb.metadata["kernelspec"] = nbformat.from_dict(kernelspec(spec["name"]) or spec)
    return nb


def dumps(nb) -> str:
    """The text of the file JupyterLab would save for `nb`."""
    text = nbformat.writes(as_jupyterlab(nb), version=nbformat.NO_CONVERT)
    return text if text.endswith("\n") else text + "\n"  # as nbformat.write (and the server)


def write(nb, path) -> None:
    """Save `nb` at `path` as JupyterLab would, atomically (a reader's JupyterLab may be watching
    the file), with Unix line ends whatever the platform (as git stores them)."""
    path = Path(path)
    data = dumps(nb).encode("utf-8")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_canonical(path) -> bool:
    """True when the file at `path` is already what JupyterLab would save for it."""
    data = Path(path).read_bytes()
    nb = nbformat.reads(data.decode("utf-8"), as_version=nbformat.NO_CONVERT)
    return dumps(nb).encode("utf-8") == data
