"""What the tests guarding a chapter's prose read from its saved notebook: the markdown, and the
text a code cell printed, found by the cell's id or by a piece of its source.

    from saved_notebooks import CHAPTERS, markdown, output, output_after
    markdown(CHAPTERS / "07_sequence_and_context.ipynb")     # every markdown cell, joined
    output(path, "rf00a002")                                  # what cell rf00a002 printed
    output_after(path, "for e in (4, 2):")                    # the one cell with that source
"""
from __future__ import annotations

import json
from pathlib import Path

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"


def cells(path: Path) -> list:
    return json.loads(Path(path).read_text())["cells"]


def markdown(path: Path) -> str:
    return "\n".join("".join(c["source"]) for c in cells(path) if c["cell_type"] == "markdown")


def printed(cell: dict) -> str:
    """The text of a code cell's outputs (stream and text outputs), joined."""
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def output(path: Path, cell_id: str) -> str:
    return printed(next(c for c in cells(path) if c.get("id") == cell_id))


def output_after(path: Path, needle: str) -> str:
    """The text output of the one code cell whose source holds `needle`."""
    hits = [c for c in cells(path) if c["cell_type"] == "code" and needle in "".join(c["source"])]
    assert len(hits) == 1, (needle, len(hits))
    return printed(hits[0])
