"""Guards against the referee's kinds of error coming back (issue #28):

- a "chapter NN" reference names the chapter that now holds the topic it points to;
- a chapter map row "NN Title" carries chapter NN's real title;
- no printed `held: False` stands without prose (the markdown right after it) that addresses it.

Written against the errors two referee reads found (stale "chapter 07 Putting it together",
"selective recomputation, chapter 06", "3D layout (chapter 07)", an unexplained `held: False`).
"""
import json
import re
from pathlib import Path

import pytest

from labkit import landing

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for d in ("chapters", "solutions") for p in (ROOT / d).glob("*.ipynb"))
TEXTS = [ROOT / "GLOSSARY.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A topic, and the chapters a "chapter NN" right after it may name (the chapter that teaches it,
# and chapter 10, which composes everything). Keys are regexes matched case-insensitively.
TOPICS = {
    r"putting it together|3d layout|three axes": {10},
    r"selective recomputation|sequence parallelism|context parallelism|ring attention|ulysses":
        {7, 10},
    r"activation checkpointing|full recomputation|fault tolerance|resharding|checkpoint":
        {6, 7, 10},
    r"mixture of experts|expert parallel|all-to-all|\bmoe\b|router": {8, 10},
    r"mixed precision|\bfp8\b|\bfp16\b|loss scal": {9, 10},
    r"pipeline|1f1b|gpipe|zero bubble|zb-": {5, 10},
    r"tensor parallel|megatron's f and g": {4, 7, 10},
    r"\bzero-[123]\b|\bfsdp\b|sharded optimizer": {3, 10},
    r"\bddp\b|bucket": {2, 3, 10},
    r"ring all-reduce|collectives|reduce-scatter": {1, 2, 3, 4, 7},
}
MENTION = re.compile(r"\bchapters? (\d\d)(?:\s*[–-]\s*(\d\d))?\b", re.I)   # or a range
WINDOW = 60   # characters before a mention in which the topic it points to is named


def _markdown(path: Path) -> list:
    """[(where, text)] of every markdown cell (notebooks) or the whole file (Markdown)."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        # the closing "Where next" links (landing.NAV_MARK) name chapters by their titles only
        return [(f"{path.parent.name}/{path.name} cell {i}", "".join(c["source"]))
                for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                and not "".join(c["source"]).startswith("<!-- book-nav -->")]
    return [(path.name, path.read_text())]


def _chapters() -> dict:
    return {int(p.name[:2]): landing.chapter_title(p) for p in (ROOT / "chapters").glob("*.ipynb")}


def stale_references(where: str, text: str, chapters: dict) -> list:
    problems = []
    for m in MENTION.finditer(text):
        number = int(m[1])
        named = set(range(number, int(m[2] or number) + 1))
        if not named <= set(chapters):
            problems.append(f"{where}: '{m[0]}' names a chapter that does not exist")
            continue
        before = text[max(0, m.start() - WINDOW):m.start()]
        before = re.split(r"[.;!?]\s|\n\n|\|", before)[-1].lower()   # this sentence/cell only
        hits = [(hit.end(), allowed) for pattern, allowed in TOPICS.items()
                for hit in re.finditer(pattern, before)]
        if hits:
            _, allowed = max(hits, key=lambda h: h[0])               # the topic named last
            if not named & allowed:
                problems.append(f"{where}: '...{before[-50:]}{m[0]}': that topic is in "
                                f"chapter {' or '.join(f'{a:02d}' for a in sorted(allowed))}")
    for m in re.finditer(r"\|\s*(\d\d) ([A-Z][^|\n]*?)\s*\|", text):   # a map row: | 07 Title |
        number, title = int(m[1]), m[2].strip()
        real = chapters.get(number, "")
        if not real.lower().startswith(title.lower()[:12]):
            problems.append(f"{where}: map row '{m[1]} {title}' but chapter {m[1]} is '{real}'")
    return problems


def test_the_guard_finds_the_referees_stale_references():
    chapters = _chapters()
    assert stale_references("x", "| 1,000 GPUs: which mix? | 07 Putting it together |", chapters)
    assert stale_references("x", 'recomputing them ("selective recomputation", chapter 06)',
                            chapters)
    assert stale_references("x", "TP is the innermost dimension of a 3D layout (chapter 07)",
                            chapters)
    assert not stale_references("x", "sequence parallelism, the next step (chapter 07)", chapters)
    assert not stale_references("x", "| 10 Putting it together |", chapters)


@pytest.mark.parametrize("path", NOTEBOOKS + TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_chapter_references_name_the_chapter_that_holds_the_topic(path):
    chapters = _chapters()
    problems = [p for where, text in _markdown(path)
                for p in stale_references(where, text, chapters)]
    assert not problems, "\n".join(problems)


# Prose that addresses a `held: False`: it says the claim failed here and why, or the claim is a
# common claim (a myth) that the cell exists to refute.
ADDRESSED = re.compile(r"held: False|did not hold|does not hold|failed|fails|common claim|myth",
                       re.I)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_printed_held_false_stands_unaddressed(path):
    cells = json.loads(path.read_text())["cells"]
    problems = []
    for i, cell in enumerate(cells):
        printed = "".join("".join(o.get("text", ""))
                          + "".join(o.get("data", {}).get("text/plain", ""))
                          for o in cell.get("outputs", []) if o["output_type"] != "error")
        if "held: False" not in printed:
            continue
        before = next((c for c in cells[i - 1::-1] if c["cell_type"] == "markdown"), None)
        after = next((c for c in cells[i + 1:] if c["cell_type"] == "markdown"), None)
        prose = "".join("".join(c["source"]) for c in (before, after) if c is not None)
        if not ADDRESSED.search(prose):
            problems.append(f"cell {i} prints 'held: False' and neither markdown cell around it "
                            f"says why (a common claim refuted, or 'did not hold' and why)")
    assert not problems, "\n".join(problems)
