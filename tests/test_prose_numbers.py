"""Every number a chapter's prose quotes from an output equals that output (referee guard, #28).

A number in a chapter's markdown must be printed by one of the chapter's saved outputs (rounded to
the digits the prose writes, or as a percentage), or be listed with its source in
tests/prose_numbers.toml. So a re-run that changes an output the prose quotes fails here until the
prose follows, and a number taken from a paper has to say which one.
"""
import json
from pathlib import Path

import pytest
import tomllib
from prose_numbers import prose_numbers, unprinted

ROOT = Path(__file__).resolve().parent.parent
SOURCES = tomllib.loads((Path(__file__).parent / "prose_numbers.toml").read_text())
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_prose_numbers_are_printed_or_sourced(path):
    listed = SOURCES.get(path.stem, {})
    missing = [(cell, number) for cell, number in unprinted(path) if number not in listed]
    assert not missing, (
        f"{path.name}: numbers in the prose that no output prints and tests/prose_numbers.toml "
        f"does not source (markdown cell index, number): {missing}")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_listed_number_is_still_in_the_prose(path):
    stated = {n for _, n in prose_numbers(json.loads(path.read_text()), int(path.name[:2]))}
    stale = sorted(set(SOURCES.get(path.stem, {})) - stated)
    assert not stale, \
        f"{path.name}: tests/prose_numbers.toml lists numbers the prose dropped: {stale}"


def test_sources_name_only_chapters_that_exist():
    assert set(SOURCES) <= {p.stem for p in CHAPTERS}
    assert all(why.strip() for table in SOURCES.values() for why in table.values())


def test_a_changed_output_is_caught(tmp_path):
    """The guard itself: prose quoting 0.9997 passes while the output prints 0.9997, fails after
    a re-run prints 0.9990."""
    def nb(printed):
        return {"cells": [
            {"cell_type": "code", "source": "", "outputs": [
                {"output_type": "stream", "name": "stdout", "text": f"ratio {printed}\n"}]},
            {"cell_type": "markdown", "source": "The ratio is 0.9997, and 1,049,440 B went.",
             "metadata": {}}]}
    path = tmp_path / "07_x.ipynb"
    path.write_text(json.dumps(nb("0.9997 of 1,049,440")))
    assert unprinted(path) == []
    path.write_text(json.dumps(nb("0.9990 of 1,049,440")))
    assert unprinted(path) == [(1, "0.9997")]
