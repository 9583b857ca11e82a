"""Numbers in a chapter's prose, and whether its saved outputs print them
(tests/test_prose_numbers.py).

A number the prose quotes from a cell's output must equal that output: a re-run that changes the
output then fails the test until the prose follows. Numbers the prose takes from elsewhere (a
paper, a datasheet, arithmetic shown in the sentence) are listed, each with where it comes from,
in tests/prose_numbers.toml. Not counted: math ($...$), inline code, worked answers inside
<details> (arithmetic the reader checks), arXiv identifiers, section numbers (§3.2, a heading's
3.4) and the chapter's own exercise numbers (3.2 in chapter 03).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

# a decimal (1.25, 0.9997) or an integer with thousands separators (1,049,440)
NUMBER = re.compile(r"(?<![\w.$^_{\\/-])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w.]*\d)")
ANY_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
HIDDEN = [re.compile(p, re.S) for p in (r"\$\$.*?\$\$", r"\$[^$\n]*\$", r"`[^`]*`",
                                        r"<details>.*?</details>")]


def output_numbers(nb: dict) -> list[float]:
    """Every number printed by the notebook's code cells (text outputs and plain/markdown/html)."""
    texts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            texts.append("".join(out.get("text", "")))
            data = out.get("data", {})
            texts += ["".join(data[k]) for k in ("text/plain", "text/markdown", "text/html")
                      if k in data]
    values = []
    for m in ANY_NUMBER.finditer("\n".join(texts)):
        try:
            values.append(float(m.group(0).replace(",", "")))
        except ValueError:
            pass
    return values


def prose_numbers(nb: dict, chapter: int):
    """(cell index, number as written) for each number the chapter's markdown states."""
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        for pattern in HIDDEN:
            text = pattern.sub(" ", text)
        for m in NUMBER.finditer(text):
            written = m.group(1)
            if re.fullmatch(r"\d{4}\.\d{4,5}", written):                      # arXiv id
                continue
            if re.fullmatch(rf"0?{chapter}\.\d{{1,2}}", written) and not re.match(
                    r"\s*(?:×|x|%|[kMGT]?B\b|s\b)", text[m.end():]):           # exercise 3.2
                continue
            before = text[max(0, m.start() - 9):m.start()]
            if re.search(r"(§|[Ss]ection |#+ )$", before):                   # a section's number
                continue
            yield i, written


def printed(written: str, outputs: list[float]) -> bool:
    """Whether an output rounds to the written number (as a value, or as a percentage)."""
    value = float(written.replace(",", ""))
    places = len(written.split(".")[1]) if "." in written else 0
    return any(round(o, places) == value or round(100 * o, places) == value for o in outputs)


def unprinted(path: Path) -> list[tuple[int, str]]:
    nb = json.loads(Path(path).read_text())
    chapter = int(Path(path).name[:2])
    outputs = output_numbers(nb)
    return [(i, w) for i, w in prose_numbers(nb, chapter) if not printed(w, outputs)]
