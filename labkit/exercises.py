"""Generate exercises/ from solutions/: every solution region becomes a stub.

In a solution notebook, code between the marker lines

    ### BEGIN SOLUTION            (optionally followed by a hint: ### BEGIN SOLUTION send right)
    ...
    ### END SOLUTION

is replaced, at the marker's indentation, by

    raise NotImplementedError("Exercise N.M: <hint or 'write your code here'>")

where N.M is the exercise the region belongs to: the last "Exercise N.M" that a markdown cell
introduced before it (a heading `## Exercise 6.2 ...` or a bold `**Exercise 6.2.**`), so two
regions of one exercise share its number; with no such markdown, M counts regions.
Outputs and execution counts are dropped. solutions/NN_x.ipynb becomes
exercises/NN_x_exercises.ipynb (exercise_name: JupyterLab names a tab after its file, so a chapter
and its exercises open as two tabs that read differently). `labkit exercises` writes the files;
`labkit exercises --check` (and the tests) fail when exercises/ is out of date.

exercises/ is also where the reader writes their answers, so the reader's work is never
overwritten: each generated notebook carries the hash of its generated cells
(metadata.labkit.generated), and `labkit exercises` replaces a notebook only while its cells still
hash to that (nobody edited it). A notebook with the reader's edits is kept; the freshly generated
one goes to exercises/fresh/ (ignored by git), or, where a fresh copy there has been edited too,
to a dated folder beside it (exercises/fresh/2026-11-27/), and the command says so. Run from a
folder without solutions/ it says where to run it.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import json
import re
from pathlib import Path

import nbformat

from labkit import chapters, nbfile

BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION\b[ :]*(?P<hint>.*)$")
END = re.compile(r"^[ \t]*### END SOLUTION\b")


class ExerciseError(ValueError):
    pass


# JupyterLab names a notebook's tab after its file (the notebook's metadata title does not rename
# it): an exercise notebook's name says "exercises", so that it and its chapter, open side by
# side, are two tabs that read differently (01_collectives.ipynb, 01_collectives_exercises.ipynb)
SUFFIX = chapters.EXERCISE_SUFFIX  # one name rule: labkit.chapters


def exercise_name(solution_name: str) -> str:
    """'01_collectives.ipynb' -> '01_collectives_exercises.ipynb' (the exercise notebook's file)."""
    path = Path(solution_name)
    return f"{path.stem}{SUFFIX}{path.suffix}"


def solution_name(exercise_name: str) -> str:
    """'01_collectives_exercises.ipynb' -> '01_collectives.ipynb' (its chapter's and solution's)."""
    path = Path(exercise_name)
    stem = path.stem[:-len(SUFFIX)] if path.stem.endswith(SUFFIX) else path.stem
    return f"{stem}{path.suffix}"


def chapter_of(path: Path) -> int:
    m = re.match(r"(\d+)_", Path(path).name)
    if not m:
        raise ExerciseError(f"{path}: notebook names start with the chapter number, "
                            f"e.g. 01_collectives.ipynb")
    return int(m.group(1))


EXERCISE_MD = re.compile(r"(?:^#+[^\n]*?|\*\*)Exercise (\d+\.\d+)", re.M)


def strip_source(source: str, chapter: int, counter: list, where: str = "",
                 exercise: str | None = None) -> str:
    out, inside = [], False
    for lineno, line in enumerate(source.splitlines(), 1):
        m = BEGIN.match(line)
        if m:
            if inside:
                raise ExerciseError(f"{where}line {lineno}: BEGIN SOLUTION inside another region")
            inside = True
            counter[0] += 1
            hint = m["hint"].strip() or "write your code here"
            number = exercise or f"{chapter}.{counter[0]}"
            msg = f"Exercise {number}: {hint}".replace('"', "'")
            out.append(f'{m["indent"]}raise NotImplementedError("{msg}")')
            continue
        if END.match(line):
            if not inside:
                raise ExerciseError(f"{where}line {lineno}: END SOLUTION without BEGIN")
            inside = False
            continue
        if not inside:
            out.append(line)
    if inside:
        raise ExerciseError(f"{where}BEGIN SOLUTION without END SOLUTION")
    return "\n".join(out)


def exercise_notebook(solution_path: Path):
    """The exercise notebook generated from one solution notebook (nbformat node)."""
    nb = nbformat.read(str(solution_path), as_version=4)
    chapter = chapter_of(solution_path)
    out = copy.deepcopy(nb)
    counter, exercise = [0], None
    for i, cell in enumerate(out.cells):
        if cell.cell_type == "markdown":
            found = EXERCISE_MD.findall(cell.source)
            exercise = found[-1] if found else exercise
        if cell.cell_type == "code":
            cell.source = strip_source(cell.source, chapter, counter,
                                       where=f"{solution_path.name} cell {i + 1}: ",
                                       exercise=exercise)
            cell.outputs = []
            cell.execution_count = None
        cell.get("metadata", {}).pop("execution", None)
    if counter[0] == 0:
        raise ExerciseError(f"{solution_path}: no ### BEGIN SOLUTION region found")
    where = nbformat.v4.new_markdown_cell(WHERE_YOU_WORK.format(
        name=exercise_name(solution_path.name), solution=solution_path.name))
    where["id"] = "where-you-work"   # fixed: an unchanged solution gives an identical file
    out.cells.insert(1 if out.cells and out.cells[0].cell_type == "markdown" else 0, where)
    out.metadata.pop("widgets", None)
    # the solution run's stamp (labkit.book) goes: exercises carry no outputs. Ours comes instead.
    out.metadata["labkit"] = {"generated": cells_hash(out)}
    return out


FRESH = "fresh"   # exercises/fresh/: freshly generated copies of notebooks the reader has edited

WHERE_YOU_WORK = """\
**This is where you work:** `exercises/{name}`. Replace each `raise NotImplementedError(...)`
with your code and run the checker cell after it. Nothing in the book overwrites this notebook
once you have edited it (an updated version arrives beside it, in `exercises/fresh/`); the worked
answers are in `solutions/{solution}`."""


def cells_hash(nb) -> str:
    """What the reader can change: every cell's type and source (not outputs or metadata, which
    running and saving a notebook rewrite)."""
    cells = [[c.cell_type, c.source] for c in nb.cells]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()[:16]


def edited_by_reader(path: Path) -> bool:
    """Has someone changed this exercise notebook's cells since it was generated?"""
    nb = nbformat.read(str(path), as_version=4)
    stamp = nb.metadata.get("labkit", {}).get("generated")
    return stamp is None or stamp != cells_hash(nb)


def write_notebook(nb, path: Path) -> None:

    nbfile.write(nb, path)  # as JupyterLab saves it, so that opening it is not editing it


def fresh_path(exercises: Path, name: str, nb) -> Path:
    """Where a fresh copy of an edited notebook goes: exercises/fresh/NAME while that is free or
    an untouched copy of the same; else a dated folder, exercises/fresh/YYYY-MM-DD[-N]/NAME, so
    that a fresh copy the reader has started to edit is never overwritten either."""
    first = exercises / FRESH / name
    if not first.exists() or not edited_by_reader(first) and \
            cells_hash(nbformat.read(str(first), as_version=4)) == cells_hash(nb):
        return first
    day = datetime.date.today().isoformat()
    for n in range(1, 1000):
        folder = exercises / FRESH / (day if n == 1 else f"{day}-{n}")
        if not (folder / name).exists():
            return folder / name
    raise SystemExit(f"labkit exercises: {exercises / FRESH} is full of fresh copies of {name}")


def generate(solutions: Path = Path("solutions"), exercises: Path = Path("exercises"),
             echo=print) -> list:
    """Write every exercise notebook that is missing or untouched; never one the reader edited
    (its fresh copy goes to exercises/fresh/). Returns the paths written."""
    exercises = Path(exercises)
    sources = sorted(Path(solutions).glob("*.ipynb"))
    if not sources:
        raise SystemExit(f"labkit exercises: no notebooks in {Path(solutions).resolve()}: run it "
                         f"from the book's folder (the one holding solutions/ and exercises/; "
                         f"from exercises/, that is `cd ..`), or name the folders: labkit "
                         f"exercises --solutions PATH --exercises PATH")
    exercises.mkdir(parents=True, exist_ok=True)
    written = []
    for src in sources:
        dst = exercises / exercise_name(src.name)
        nb = exercise_notebook(src)
        have = nbformat.read(str(dst), as_version=4) if dst.exists() else None
        if have is not None and cells_hash(have) == cells_hash(nb):
            if have.metadata.get("labkit", {}).get("generated") == cells_hash(nb):
                continue   # already what we would write (keep the reader's outputs, if any)
        elif have is not None and edited_by_reader(dst):
            fresh = fresh_path(exercises, dst.name, nb)
            fresh.parent.mkdir(parents=True, exist_ok=True)
            write_notebook(nb, fresh)
            echo(f"kept {dst}: it has your edits, and labkit never overwrites them. A freshly "
                 f"generated copy is at {fresh}")
            written.append(fresh)
            continue
        write_notebook(nb, dst)
        written.append(dst)
    return written


def out_of_sync(solutions: Path = Path("solutions"), exercises: Path = Path("exercises")) -> list:
    """Problems, one line each: a missing, stale or extra exercise notebook."""
    problems = []
    sol = {exercise_name(p.name): p for p in Path(solutions).glob("*.ipynb")}
    ex = {p.name: p for p in Path(exercises).glob("*.ipynb")}
    for name in sorted(set(ex) - set(sol)):
        problems.append(f"exercises/{name} has no solution notebook"
                        + (f" (exercise notebooks are named {exercise_name(name)} now)"
                           if exercise_name(name) in sol else ""))
    for name, src in sorted(sol.items()):
        if name not in ex:
            problems.append(f"exercises/{name} is missing: run `labkit exercises`")
            continue
        want = [c.source for c in exercise_notebook(src).cells]
        have = [c.source for c in nbformat.read(str(ex[name]), as_version=4).cells]
        if want == have:
            continue
        if edited_by_reader(ex[name]):
            problems.append(f"exercises/{name} has edits (a reader's answers?): labkit exercises "
                            f"keeps them and writes a fresh copy to exercises/{FRESH}/{name}")
        else:
            problems.append(f"exercises/{name} is older than solutions/{src.name}: run "
                            f"`labkit exercises` (it replaces only notebooks nobody edited)")
    return problems
