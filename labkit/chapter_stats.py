"""What the README's chapter table says of each chapter, counted from the notebook itself: words
of prose, references listed at its end, and minutes its last full run took (`labkit book run`
stamps the seconds into the notebook). A test holds the README to these numbers, so none of
them is typed by hand.

    python -m labkit.chapter_stats                  # one line per chapter
    python -m labkit.chapter_stats --write-readme   # put them in README.md's chapter table
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from labkit import chapters

_REFS_HEADING = re.compile(r"^#+ .*(?:References|Sources|Further reading).*$", re.M | re.I)
_LIST_ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s", re.M)


def stats(path: Path) -> dict:
    """{"number", "words", "refs", "minutes"} of one chapter notebook."""
    nb = json.loads(Path(path).read_text())
    prose = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    refs = 0
    for text in reversed(prose):          # the last markdown cell with a references heading
        if _REFS_HEADING.search(text):
            refs = len(_LIST_ITEM.findall(_REFS_HEADING.split(text)[-1]))
            break
    seconds = nb["metadata"].get("labkit", {}).get("seconds")
    return {"number": Path(path).name[:2], "words": sum(len(t.split()) for t in prose),
            "refs": refs, "minutes": None if seconds is None else max(1, math.ceil(seconds / 60))}


def all_stats(root: Path = Path(".")) -> list:
    """stats() of every chapter of the manifest (labkit.chapters) whose notebook is under root."""
    paths = (Path(root) / c.notebooks[0] for c in chapters.CHAPTERS)
    return [stats(p) for p in paths if p.exists()]


COLUMNS = ("words", "refs", "run (min)")   # the README table's last three columns


def cells(row: dict) -> list:
    """The README table's words, refs and run cells for one chapter."""
    return [f"{row['words']:,}", str(row["refs"]), str(row["minutes"])]


def write_readme(root: Path = Path(".")) -> None:
    """Rewrite the last three cells of each chapter row of README.md's table."""
    path = Path(root) / "README.md"
    rows = {r["number"]: r for r in all_stats(root)}
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"\|\s*(\d\d)\s*\|", line)
        if m and m[1] in rows:
            kept = [c.strip() for c in line.strip().strip("|").split("|")][:-len(COLUMNS)]
            line = "| " + " | ".join(kept + cells(rows[m[1]])) + " |"
        out.append(line)
    path.write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    if "--write-readme" in sys.argv:
        write_readme()
    for row in all_stats(Path(".")):
        print(f"{row['number']}  words {row['words']:,}  refs {row['refs']}  "
              f"run {row['minutes']} min")
