#!/usr/bin/env bash
# Run every test: labkit's unit tests, the chapters (nbval, or the browser test), grading of exercises.
#
# Each notebook runs once. The solutions run under `labkit grade` (tests/test_exercises.py: every
# one must score full marks), so nbval does not run them again. The chapters run in the browser
# test (tests/e2e) when Chromium and Playwright are there: it checks the `# NBVAL_CHECK_OUTPUT`
# cells as nbval does. Without a browser (or with LABKIT_E2E_CHAPTERS naming a subset), nbval
# runs the chapters instead.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
chapters=(chapters)
if [[ -z "${LABKIT_E2E_CHAPTERS:-}" && -x "${LABKIT_CHROMIUM:-/usr/bin/chromium}" ]] \
   && python -c "import playwright" 2>/dev/null; then
  chapters=()
  echo "test.sh: the chapters run in the browser test (tests/e2e), which checks their outputs as nbval would"
fi
# Two test files at a time (pytest-xdist; a file's tests, and a notebook's cells, stay together on
# one worker). Most tests wait on processes they started, so two at once use 2 cores better.
# LABKIT_TEST_WORKERS=0 runs one at a time.
workers=${LABKIT_TEST_WORKERS:-2}
parallel=()
if [[ "$workers" != 0 ]] && python -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile)
  # longest files first (tests/conftest.py) only if xdist keeps that order (3.8 and newer)
  if python -c "import sys, importlib.metadata as m; v = m.version('pytest-xdist').split('.');
sys.exit(0 if (int(v[0]), int(v[1])) >= (3, 8) else 1)" 2>/dev/null; then
    parallel+=(--no-loadscope-reorder)
  fi
fi
exec python -m pytest tests "${chapters[@]}" "${parallel[@]}" --nbval-lax --nbval-cell-timeout=600 -p no:cacheprovider --durations=25 "$@"
