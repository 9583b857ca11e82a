import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests run against this checkout even before `pip install -e .`
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))


# The longest files first (seconds summed over their tests on the 2-core machine, 2026-11-23):
# test.sh runs files on two workers (xdist loadfile, without its reorder by test count), and a
# long file picked up last would leave one worker running alone at the end.
LONGEST_FIRST = ("tests/e2e/test_jupyterlab_browser.py",   # 614 s
                 "tests/test_labs.py",                     # 398 s
                 "tests/test_exercises.py",                # 347 s
                 "tests/test_grade.py",                    # 82 s
                 "tests/e2e/test_site_browser.py")         # 62 s


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)   # stable: the rest keep their order
