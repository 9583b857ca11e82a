"""The submitted notebook as the grader ran it: its code cells, named as the instructor finds
them ("code cell 7"), and the stops found in their outputs.

The sandbox (labkit.grade.sandbox) runs code cell k as In[k]; the judge writes k as the cell's
execution count and an error output where the cell raised, so that a traceback's "Cell In[k]"
and a recorded answer's cell both lead back to "code cell k".
"""
from __future__ import annotations

OUTPUT_LIMIT = 1 << 20      # characters of one cell's output beyond which it is called a flood
STOPS = {"SystemExit": "sys.exit({}) was called", "KeyboardInterrupt": "KeyboardInterrupt"}


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


def stops_in_cells(nb, printed: dict) -> list:
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
            found.append(f"{describe(nb, cell)} printed {printed[index] / 1e6:.1f} MB (output "
                         f"the grader keeps none of)")
    return found
