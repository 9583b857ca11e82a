"""A submitted notebook, run headless in a fresh kernel: the answers it handed in, and every stop.

`run(path, cell_timeout, exercises)` executes every code cell top to bottom (outputs cleared
first: a student's saved run is not evidence) with $LABKIT_GRADE_ANSWERS naming a fresh folder,
so that its checker cells hand in answers instead of grading (labkit.check.answers). What comes
back, once the kernel and every process in its group are gone:

- the answers recorded for the grader's own exercise ids, read as bytes and never unpickled here
  (only a checker process of the grader's loads them: labkit.check.worker);
- every stop, each with its reason and its cell: a cell timeout, a dead kernel (with its exit
  status), a cell that raised SystemExit or KeyboardInterrupt, and a cell's output flood (the
  grader keeps OUTPUT_LIMIT bytes of a cell's output, and says how much more there was);
- the executed cells, to name the cell a call came from ("code cell 7").
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from labkit.check.answers import ANSWERS_ENV

OUTPUT_LIMIT = 1 << 20      # bytes of one cell's output the grader keeps
ANSWER_LIMIT = 256 << 20    # bytes of one recorded answer read back at most
STOPS = {"SystemExit": "sys.exit({}) was called", "KeyboardInterrupt": "KeyboardInterrupt"}


@dataclass
class Run:
    nb: object = None                 # the executed notebook (None: not a readable one)
    answers: dict = field(default_factory=dict)    # exercise id -> the recorded call (bytes)
    stops: list = field(default_factory=list)      # one line each, with its cell
    stopped: bool = False             # the run ended before the last cell


class _Client(NotebookClient):
    """nbclient, keeping at most OUTPUT_LIMIT bytes of a cell's output, and leaving no process
    of the kernel's group behind (a kernel shut down politely may leave its children)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.printed = defaultdict(int)   # cell index -> bytes of output, kept or not
        self.exit_status = None           # the kernel's, when it died

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        size = len(str(content.get("text", ""))) + sum(
            len(str(v)) for v in (content.get("data") or {}).values())
        self.printed[cell_index] += size
        if self.printed[cell_index] > OUTPUT_LIMIT:
            return None
        return super().output(outs, msg, display_id, cell_index)

    async def _async_cleanup_kernel(self) -> None:
        if self.km is None:   # cleaned up already (nbclient's own SIGTERM handler does)
            return
        provisioner = getattr(self.km, "provisioner", None)
        process = getattr(provisioner, "process", None)
        if process is not None and process.poll() is not None:
            self.exit_status = process.returncode
        pgid = getattr(provisioner, "pgid", None)
        try:
            await super()._async_cleanup_kernel()
        finally:
            if pgid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)


def run(path: Path, cell_timeout: int, exercises) -> Run:
    """Execute the notebook at `path`; return its answers for `exercises` and its stops."""
    out = Run()
    folder = tempfile.mkdtemp(prefix="labkit-answers-")
    running, client = {}, None
    old = os.environ.get(ANSWERS_ENV)
    os.environ[ANSWERS_ENV] = folder   # the kernel inherits it
    try:
        out.nb = nbformat.read(str(path), as_version=4)
        for cell in out.nb.cells:
            if cell.cell_type == "code":
                cell.execution_count, cell.outputs = None, []
        client = _Client(out.nb, timeout=cell_timeout, allow_errors=True, kernel_name="python3",
                         resources={"metadata": {"path": str(Path(path).parent.resolve())}},
                         on_cell_execute=lambda cell, cell_index: running.update(cell=cell))
        # The kernel's own stderr (ipykernel's warnings, a dying kernel's ZMQ traceback) goes to
        # a file, not the grader's terminal: the student's output reaches us as messages anyway.
        with tempfile.TemporaryFile() as kernel_err:
            client.execute(stdout=kernel_err, stderr=kernel_err)
    except Exception as err:  # noqa: BLE001 - a hung or dead notebook still gets a row
        status = client.exit_status if client is not None else None
        out.stops.append(_explain(err, out.nb, cell_timeout, running.get("cell"), status))
        out.stopped = True
    finally:
        if old is None:
            os.environ.pop(ANSWERS_ENV, None)
        else:
            os.environ[ANSWERS_ENV] = old
        out.answers = _read_answers(Path(folder), exercises)
        shutil.rmtree(folder, ignore_errors=True)
    if out.nb is not None:
        out.stops[:0] = _stops_in_cells(out.nb, client.printed if client is not None else {})
    return out


def _read_answers(folder: Path, exercises) -> dict:
    """{id: bytes} of `<id>.json` for the grader's ids only: never a link, never a huge file."""
    found = {}
    for ex in exercises:
        with contextlib.suppress(OSError):
            fd = os.open(folder / f"{ex}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if stat.S_ISREG(st.st_mode) and st.st_size <= ANSWER_LIMIT:
                    found[ex] = f.read(ANSWER_LIMIT + 1)[:ANSWER_LIMIT]
    return found


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def describe(nb, cell) -> str:
    """'code cell 4 ('import os')': the cell as the instructor finds it in the file."""
    number = next(i for i, c in enumerate(code_cells(nb), 1) if c is cell)
    first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
    return f"code cell {number} ({first.strip()[:60]!r})"


def cell_of_count(nb, count) -> str:
    """The code cell that ran as In[count] in the grader's run, described; '' if none did."""
    cell = next((c for c in code_cells(nb) if isinstance(count, int)
                 and c.get("execution_count") == count), None)
    return describe(nb, cell) if cell is not None else ""


def _stops_in_cells(nb, printed: dict) -> list:
    """sys.exit, KeyboardInterrupt (each ends only its own cell) and output floods, in order."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error" and o.get("ename") in STOPS:
                what = STOPS[o["ename"]].format(o.get("evalue", ""))
                found.append(f"{what} in {describe(nb, cell)}; the cells after it still ran")
        if printed.get(index, 0) > OUTPUT_LIMIT:
            found.append(f"{describe(nb, cell)} printed {printed[index] / 1e6:.1f} MB (the "
                         f"grader kept the first {OUTPUT_LIMIT / 1e6:.0f} MB)")
    return found


def _explain(err: Exception, nb, cell_timeout: int, cell=None, status=None) -> str:
    """One line for the table: what stopped the notebook, and in which cell."""
    kind = type(err).__name__
    if kind == "CellTimeoutError":
        what = f"a cell ran longer than {cell_timeout} s (a hang? raise --cell-timeout if not)"
    elif kind == "DeadKernelError":
        what = "the kernel died (a crash, os._exit, or out of memory)"
        if status is not None:
            what = (f"the kernel died (killed by {_signal_name(-status)}: out of memory? a crash?)"
                    if status < 0 else f"the kernel died (exit status {status}: os._exit?)")
    elif nb is None:
        return f"not a readable notebook: {kind}: {str(err).strip()[:200]}"
    else:
        text = str(err).strip()
        what = f"{kind}: {text.splitlines()[0] if text else ''}"
    if cell is not None:
        what += f", in {describe(nb, cell)}"
    return what


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
