"""Chapters' markdown that names an exercise notebook by its old file name, rewritten to the new
one (labkit.exercises.exercise_name: exercises/NN_x.ipynb -> exercises/NN_x_exercises.ipynb, so
that JupyterLab's tab for the exercises reads differently from the chapter's).

    python scripts/exercise-links.py [chapters/NN_*.ipynb ...]     (all chapters by default)

Markdown cells only (a chapter's freshness stamp hashes its code cells: no re-run needed);
written with labkit.nbfile as JupyterLab saves; idempotent.
"""
import re
import sys
from pathlib import Path

import nbformat

from labkit import nbfile
from labkit.exercises import SUFFIX, exercise_name

ROOT = Path(__file__).resolve().parents[1]
OLD = re.compile(r"exercises/(\d\d_\w+?)\.ipynb")


def rewrite(text: str) -> str:
    return OLD.sub(lambda m: m.group(0) if m.group(1).endswith(SUFFIX)
                   else f"exercises/{exercise_name(m.group(1) + '.ipynb')}", text)


def main(paths) -> None:
    for path in paths or sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        changed = 0
        for cell in nb.cells:
            if cell.cell_type == "markdown" and rewrite(cell.source) != cell.source:
                cell.source = rewrite(cell.source)
                changed += 1
        if changed:
            nbfile.write(nb, path)
        print(f"{path}: {changed} markdown cell(s) rewritten")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
