"""START_HERE.ipynb: the book's front door, written from the chapters that exist.

    python -m labkit.landing [ROOT]      (re)write ROOT/START_HERE.ipynb (./book.sh does this)

The table of contents is generated, never typed: every chapter of the manifest (labkit.chapters)
whose notebook exists becomes a row with its title and links to its exercise and solution
notebooks where they exist, so a chapter added to the manifest appears the next time the book is
opened. The file is only rewritten when its content changes (a launch leaves git clean when
nothing was added). Under the table, a line links GLOSSARY.md when the book has one. Each
chapter's closing cell of links (nav_markdown) is written from the manifest too (write_nav,
`labkit book nav`). The website (labkit.site) has a front
page of its own, written for the web (labkit/site_assets/index.md).
"""
from __future__ import annotations

import json
import platform
import re
import sys
from pathlib import Path

import nbformat

from labkit import chapters, nbfile

NAME = "START_HERE.ipynb"
FOLDERS = chapters.FOLDERS

INTRO = """\
# Distributed LLM training, by running it

This is the book's front door. Every chapter is a Jupyter notebook you read *and run*: the
labs start real processes on this machine (Gloo on CPU, NCCL when there is a GPU per rank),
and every number in the prose is printed by a cell beneath it.

**Each chapter comes in three notebooks**, all openable from the file browser on the left:

* `chapters/` — the chapter: prose, labs, figures and calculators, saved with its outputs;
* `exercises/` — the same chapter with parts of the code removed: **this is where you work**.
  Write your answers there; nothing in the book ever overwrites them (an updated exercise
  you have edited arrives beside it, in `exercises/fresh/`);
* `solutions/` — the worked answers (the exercises are generated from them).
"""

HOW = """\
## How to run the labs

* In a notebook, run cells top to bottom (**Run ▸ Run All Cells**, or Shift+Enter cell by
  cell). A lab cell starts N processes and prints what each rank did.
* From a terminal (**File ▸ New ▸ Terminal**): `labkit list` shows the labs by chapter;
  `labkit run ring --nproc 4` runs one; `labkit bench` runs the benchmarks. (In a terminal
  outside JupyterLab, first `source .venv/bin/activate` in the book's folder.)
* Nothing needs a GPU; on a machine with GPUs the same cells pick NCCL when N is at most the
  number of GPUs.

## How grading works

Each exercise in `exercises/NN_*_exercises.ipynb` is a `raise NotImplementedError(...)`
for you to replace, followed by a **checker cell** (`labkit.check.chNN...`): it runs your code
on real processes, compares it with a one-process reference, and prints a score for that
exercise. Grade a whole notebook (it runs every cell headless) from a terminal:

```
labkit grade exercises/01_collectives_exercises.ipynb # one notebook: a score table
labkit grade submissions/ --csv scores.csv            # a folder of students' notebooks
```

Under `labkit grade` the notebook runs again in a sandbox and only hands in its answers: the
checkers run in the grader's own process, which calls your functions in the sandbox and gets
plain data back, so nothing a notebook writes, patches or prints can raise a score. Every stop
(an exception, `sys.exit`, a dead sandbox, a hang) is named with its cell, and the other
exercises are graded all the same. The sandbox runs as your user: an instructor withholds
`solutions/` and grades each submission in its own copy (docs/grading.md).
"""


def chapter_title(path: Path) -> str:
    """The first markdown heading of a notebook, without '#' and the 'Chapter NN —' prefix."""
    try:
        nb = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return Path(path).stem
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        for line in "".join(cell.get("source", "")).splitlines():
            if line.startswith("#"):
                title = line.lstrip("#").strip()
                return re.sub(r"^Chapter\s+\d+\s*[—:-]+\s*", "", title) or Path(path).stem
    return Path(path).stem


def rows(root: Path) -> list:
    """[{"number", "stem", "title", "chapters": rel path, "exercises": rel or None, ...}]: one per
    chapter of the manifest whose chapter notebook is under root, in the manifest's order."""
    root = Path(root)
    out = []
    for c in chapters.CHAPTERS:
        row = {"number": c.nn, "stem": c.stem, "title": c.title}
        for folder, rel in zip(FOLDERS, c.notebooks):
            row[folder] = rel if (root / rel).exists() else None
        if row["chapters"]:
            out.append(row)
    return out


def table_markdown(rows: list, link_ext: str = ".ipynb") -> str:
    """The table of contents as a markdown table; links end in link_ext (.html for the site)."""
    def link(rel, text):
        return f"[{text}]({rel[:-len('.ipynb')]}{link_ext})" if rel else "—"

    lines = ["## Contents", "", "| # | chapter | exercises | solutions |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['number']} | {link(r['chapters'], r['title'])} | "
                     f"{link(r['exercises'], 'exercises')} | {link(r['solutions'], 'solutions')} |")
    return "\n".join(lines)


NAV_MARK = "<!-- book-nav -->"  # the first line of a chapter's closing links cell


def nav_markdown(rows: list, i: int) -> str:
    """The closing cell of chapter rows[i]: its exercises, its solutions, the next chapter (links
    relative to chapters/, as .ipynb; the site turns them into .html)."""
    r = rows[i]
    parts = [f"[{f}](../{r[f]})" for f in ("exercises", "solutions") if r[f]]
    if i + 1 < len(rows):
        parts.append(f"next: [Chapter {rows[i + 1]['number']} — {rows[i + 1]['title']}]"
                     f"({rows[i + 1]['stem']}.ipynb)")
    parts.append("[all chapters](../START_HERE.ipynb)")
    return f"{NAV_MARK}\n---\n**Where next.** " + " · ".join(parts)


def write_nav(root: Path, check: bool = False) -> list:
    """Make each chapter's last cell its closing links (nav_markdown, from the manifest): replace
    a closing cell that differs, or append one. Returns the notebooks that changed (with check,
    that would change, and writes nothing). Markdown only: the saved outputs stay current."""
    rows_ = rows(root)
    changed = []
    for i, row in enumerate(rows_):
        path = Path(root) / row["chapters"]
        nb = nbformat.read(path, as_version=4)
        want = nav_markdown(rows_, i)
        last = nb.cells[-1] if nb.cells else None
        if last is not None and last.cell_type == "markdown" and last.source == want:
            continue
        changed.append(path)
        if check:
            continue
        if last is not None and last.cell_type == "markdown" and last.source.startswith(NAV_MARK):
            last.source = want
        else:
            cell = nbformat.v4.new_markdown_cell(want)
            cell["id"] = f"book-nav-{row['number']}"
            nb.cells.append(cell)
        nbfile.write(nb, path)
    return changed


def nav_command(root: Path, check: bool = False) -> int:
    """`labkit book nav [--check]`: write_nav, one line per notebook; --check exits 1 if any
    chapter's closing links are not the manifest's."""
    if not rows(root):
        print(f"labkit book nav: no chapter of labkit.chapters under {root}/chapters",
              file=sys.stderr)
        return 2
    changed = write_nav(root, check=check)
    verb = "would change" if check else "wrote"
    print("\n".join(f"{verb} the closing links of {p.relative_to(root)}" for p in changed)
          or "every chapter ends with its closing links")
    return 1 if changed and check else 0


GLOSSARY = "GLOSSARY.md"


def glossary_line(root: Path) -> str:
    """The line under the table of contents that links the glossary ('' if the book has none)."""
    if not (Path(root) / GLOSSARY).exists():
        return ""
    return (f"\n\n**Glossary.** [{GLOSSARY}]({GLOSSARY}): every term the book uses (all-reduce, "
            "ZeRO-3, 1F1B, capacity factor, e4m3, MFU, …) in a sentence or three, "
            "with the chapters "
            "that teach it.")


def landing_notebook(root: Path, link_ext: str = ".ipynb"):
    """The landing notebook (nbformat node) for the book at root. Cell ids are fixed, so an
    unchanged book gives a byte-identical file."""
    contents = table_markdown(rows(root), link_ext) + glossary_line(root)
    cells = [nbformat.v4.new_markdown_cell(text) for text in (INTRO, contents, HOW)]
    for i, cell in enumerate(cells):
        cell["id"] = f"start-here-{i}"
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["title"] = "Start here"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    # what ipykernel reports when JupyterLab opens the notebook: written now, so that opening it
    # changes nothing and closing it asks nothing (as the chapters, stamped by a run)
    nb.metadata["language_info"] = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
        "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
        "pygments_lexer": "ipython3", "version": platform.python_version()}
    return nb


def write(root: Path) -> Path:
    """Write ROOT/START_HERE.ipynb if its content changed; return its path."""
    path = Path(root) / NAME
    text = nbfile.dumps(landing_notebook(root))  # as JupyterLab saves it: opening changes nothing
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
