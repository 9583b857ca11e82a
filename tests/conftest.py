"""The suite's lanes and tiers (docs/testing.md).

Two lanes: `./test.sh` (the commit lane, what CI runs) and `./test.sh --full` (everything). A
test marked `full` runs only in the full lane; FULL_ONLY below marks, by name, the runs of a code
path that the commit lane already covers another way (each entry says which test covers it).

Tiers say what a test costs, as markers (`./test.sh -m browser`, `-m "not multiprocess"`):
static (reads files), unit (one process), multiprocess (starts ranks or a lab), grading (runs
the grader), notebook (nbval runs a chapter), browser (Chromium). The tier of a file is in TIERS;
a file not listed there is `unit`.

The order: the longest files first (xdist runs files on two workers; a long file picked up last
leaves one worker running alone), from tests/durations.json, which every passing `./test.sh`
updates from its own run (seconds summed per file, for the files it ran; commit it when it moved).
"""
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests run against this checkout even before `pip install -e .`
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))

DURATIONS = ROOT / "tests" / "durations.json"
# the grader's fixture notebooks are inputs to tests/test_grade*.py (some hang or kill their
# kernel on purpose), never notebooks for nbval to run
collect_ignore = ["fixtures"]
TIERS = {
    "static": ["test_style.py", "test_readme.py", "test_lock.py", "test_architecture.py",
               "test_nbfile.py", "test_notebooks.py", "test_prose_guards.py",
               "test_prose_numbers.py", "test_freshness.py", "test_check_layout.py",
               "test_device_static.py", "test_exercises.py::test_exercises_are_in_sync",
               "test_exercises.py::test_strip_source", "test_exercises.py::test_every_stub"],
    "multiprocess": ["test_labs.py", "test_documented_commands.py", "test_launch.py",
                     "test_launch_source.py", "test_faults.py", "test_collectives.py",
                     "test_ddp.py", "test_zero", "test_tp.py", "test_pipeline", "test_zbv.py",
                     "test_context.py", "test_ch07_context.py", "test_ch08_moe.py",
                     "test_moe.py", "test_parallel.py", "test_checkpoint.py", "test_bench_",
                     "test_overlap_tp_cp.py", "test_collective_matmul.py", "test_netcount.py",
                     "test_parity_", "test_calibrate.py", "test_terminal.py",
                     "test_profiling.py", "test_observe.py"],
    "grading": ["test_grade", "test_exercises.py", "test_exercises_kept.py", "_exercises.py"],
    "browser": ["e2e/"],
}
# The same code path run a second way: full lane only. Each names what covers it per commit.
FULL_ONLY = {
    # every README lab line at full size; per commit, each runs with the tiny options of
    # test_labs.LABS (test_documented_lab_line_runs_small): the same main, the same markers
    "test_documented_commands.py::test_documented_lab_line_runs_as_written": "",
    # every lab under torchrun; per commit the labs whose torchrun path differs
    # (test_labs.TORCHRUN_PER_COMMIT; the rest share labkit.launch.torchrun with them)
    "test_labs.py::test_lab_runs_under_torchrun": "TORCHRUN_PER_COMMIT",
    # a whole untouched exercise notebook graded to prove 0; per commit each exercise's stub is
    # graded 0 by tests/test_chNN_exercises.py and test_exercises.py::test_every_stub_names...
    "test_exercises.py::test_untouched_exercise_scores_zero": "",
    # the reference answer through the checker's Python API; per commit the solution notebooks
    # score full marks under `labkit grade` (test_exercises.py::test_solution_scores_full_marks)
    "test_ch04_exercises.py::test_reference_scores_full_marks": "",
    "test_ch05_exercises.py::test_5_3_reference_scores_full_marks": "",
    "test_ch05_exercises.py::test_5_4_reference_scores_full_marks_on_paper": "",
    "test_ch06_exercises.py::test_resharding_reference_scores_full": "",
    "test_ch07_exercises.py::test_reference_scores_full_marks": "",
    "test_ch08_exercises.py::test_layer_reference_scores_full": "",
    "test_ch09_exercises.py::test_trainer_reference_scores_full": "",
    # every notebook opened in JupyterLab; per commit: the format (test_nbfile.py's
    # test_every_committed_notebook_is_saved_as_jupyterlab_saves_it) and the save hook
    # (test_nbfile.py::test_saving_an_unedited_notebook_keeps_its_bytes)
    "e2e/test_open_is_not_edit.py": "",
    # the website page by page in Chromium; per commit test_site.py builds it and checks every
    # page's HTML, every calculator's module and the assets without a browser
    "e2e/test_site_browser.py": "",
}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the full lane too (tests marked `full`); ./test.sh --full")
    parser.addoption("--record", action="store_true",
                     help="update tests/durations.json, tests/e2e/browser-verified.json and "
                          "tests/e2e/figures-verified.json")


def pytest_configure(config):
    for tier in ("static", "unit", "multiprocess", "grading", "notebook", "browser"):
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/conftest.py TIERS)")
    config.addinivalue_line("markers", "full: runs only in ./test.sh --full")
    config.addinivalue_line("markers", "slow: longer multi-process runs (informational)")
    config._labkit_durations = {}
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerDurations())


def _rel(item) -> str:
    path = Path(str(item.fspath))
    try:
        return path.relative_to(ROOT / "tests").as_posix()
    except ValueError:
        return path.relative_to(ROOT).as_posix()


def tier_of(item) -> str:
    if item.nodeid.endswith(".ipynb") or ".ipynb::" in item.nodeid:
        return "notebook"
    rel, name = _rel(item), item.nodeid.split("::", 1)[-1]
    for tier in ("browser", "static", "grading", "multiprocess"):
        for pattern in TIERS[tier]:
            file, _, test = pattern.partition("::")
            if (rel == file or rel.startswith(file) or rel.endswith(file)
                    or ("/" not in file and file in rel)) and name.startswith(test):
                return tier
    return "unit"


def _full_only(item) -> bool:
    rel, name = _rel(item), item.nodeid.split("::", 1)[-1].split("[")[0]
    for key, keep in FULL_ONLY.items():
        file, _, test = key.partition("::")
        if rel == file and (not test or name == test):
            spec = getattr(item, "callspec", None)
            param = next(iter(spec.params.values()), None) if spec and spec.params else None
            return not (keep and param in getattr(item.module, keep, ()))
    return False


def _order() -> dict:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(session, config, items):
    full = config.getoption("--full")
    skip = pytest.mark.skip(reason="full lane only: ./test.sh --full (tests/conftest.py says "
                                   "which test covers this path per commit)")
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
        if not full and (_full_only(item) or item.get_closest_marker("full")):
            item.add_marker(skip)
    seconds = _order()
    items.sort(key=lambda it: -seconds.get(it.nodeid.split("::", 1)[0], 0.0))  # stable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.monotonic()
    yield
    if item.get_closest_marker("skip"):   # not run in this lane: its file's time is not known
        return
    path = item.nodeid.split("::", 1)[0]
    spent = item.config._labkit_durations
    spent[path] = spent.get(path, 0.0) + time.monotonic() - start


def pytest_sessionfinish(session, exitstatus):
    """With --record (test.sh always passes it): each file's seconds in this run replace its
    entry in tests/durations.json (a file this run did not run keeps its old one)."""
    config = session.config
    if not config.getoption("--record"):
        return
    if hasattr(config, "workerinput"):   # an xdist worker: hand its sums to the controller
        config.workeroutput["labkit_durations"] = json.dumps(config._labkit_durations)
        return
    if exitstatus in (0, 1) and config._labkit_durations:   # passed or failed, not interrupted
        merged = {**_order(), **{k: round(v, 1) for k, v in config._labkit_durations.items()}}
        DURATIONS.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: -kv[1])),
                                        indent=1) + "\n")


class _WorkerDurations:
    """xdist (registered only where it is installed): the controller adds each worker's
    per-file seconds."""

    def pytest_testnodedown(self, node, error):
        got = json.loads(getattr(node, "workeroutput", {}).get("labkit_durations", "{}"))
        spent = node.config._labkit_durations
        for path, s in got.items():
            spent[path] = spent.get(path, 0.0) + s
