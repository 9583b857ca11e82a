"""The README's chapter table carries the numbers the chapters themselves give
(labkit.chapter_stats): words of prose, references, and the minutes of the last full run; and
the README stays a door."""
import re
from pathlib import Path

from labkit.chapter_stats import all_stats

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _table_rows() -> dict:
    rows = {}
    for line in README.splitlines():
        m = re.match(r"\|\s*(\d\d)\s*\|", line)
        if m:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[m[1]] = cells
    return rows


def test_the_chapter_table_numbers_are_the_chapters_own():
    rows = _table_rows()
    header = next(line for line in README.splitlines() if line.startswith("| # |"))
    names = [c.strip() for c in header.strip().strip("|").split("|")]
    want = {s["number"]: s for s in all_stats(ROOT)}
    assert sorted(rows) == sorted(want)
    wrong = []
    for number, cells in rows.items():
        got = dict(zip(names, cells))
        expected = {"words": f"{want[number]['words']:,}", "refs": str(want[number]['refs']),
                    "run (min)": str(want[number]["minutes"])}
        for column, value in expected.items():
            if got.get(column) != value:
                wrong.append(f"chapter {number} {column}: README {got.get(column)!r}, "
                             f"chapter {value}")
    assert not wrong, ("\n".join(wrong)
                       + "\n(python -m labkit.chapter_stats --write-readme puts them in)")


def test_the_readme_is_a_door():
    assert len(README.splitlines()) <= 200
    for page in re.findall(r"\]\((docs/[^)]+)\)", README):
        assert (ROOT / page).exists(), page
