#!/usr/bin/env bash
# Run the tests. Two lanes (docs/testing.md says what each holds and how long it takes):
#
#   ./test.sh          the commit lane, what CI runs: every code path once (10 minutes on 2 cores)
#   ./test.sh --full   everything: every chapter in the browser, every documented lab line at full
#                      size, every lab under torchrun, every notebook opened, the website in the
#                      browser
# A passing run updates tests/durations.json (the order files run in: longest first) and
# tests/e2e/browser-verified.json (the chapters whose code passed in the browser); commit both.
#
# Other arguments go to pytest (./test.sh tests/test_zero.py -x; ./test.sh -m "not browser").
# Each notebook runs once: the solutions under `labkit grade` (tests/test_exercises.py), the
# chapters in the browser test (tests/e2e) when Chromium and Playwright are there, else under nbval
# (and under nbval when LABKIT_E2E_CHAPTERS names a subset). In the commit lane the browser runs
# chapter 00 and every chapter whose code changed since its last browser pass (its `labkit book`
# stamp differs from tests/e2e/browser-verified.json, which a passing run updates: commit it).
# Interrupted (Ctrl-C) or not, nothing it started outlives it: no rank, kernel or JupyterLab.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
lane=()
args=()
for a in "$@"; do
  if [[ "$a" == "--full" ]]; then lane=(--full); else args+=("$a"); fi
done
chapters=(chapters)
if [[ -z "${LABKIT_E2E_CHAPTERS:-}" && -x "${LABKIT_CHROMIUM:-/usr/bin/chromium}" ]] \
   && python -c "import playwright" 2>/dev/null; then
  chapters=()
  echo "test.sh: the chapters run in the browser test (tests/e2e), which checks their outputs as nbval would"
fi
# Two test files at a time (pytest-xdist; a file's tests, and a notebook's cells, stay together on
# one worker). Most tests wait on processes they started, so two at once use 2 cores better; runs of
# 4 ranks or more take turns (labkit.launch.serial, LABKIT_RUN_LOCK). LABKIT_TEST_WORKERS=0: one
# at a time.
workers=${LABKIT_TEST_WORKERS:-2}
parallel=()
if [[ "$workers" != 0 ]] && python -c "import xdist" 2>/dev/null; then
  # --no-loadscope-reorder: keep the longest-first order of tests/conftest.py (xdist 3.8+)
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
# Every process this run starts carries LABKIT_TEST_RUN; on exit, whatever still carries it (a
# JupyterLab, a kernel, a rank that double-forked into its own session) is ended.
export LABKIT_TEST_RUN="test.sh-$$-$RANDOM"
export LABKIT_RUN_LOCK="${TMPDIR:-/tmp}/labkit-run-lock-$LABKIT_TEST_RUN"
cleanup() {
  python scripts/reap.py "$LABKIT_TEST_RUN" "$$" || true
  rm -f "$LABKIT_RUN_LOCK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
set +e
python -m pytest tests "${chapters[@]}" "${parallel[@]}" "${lane[@]}" --record --nbval-lax \
  --nbval-cell-timeout=600 -p no:cacheprovider --durations=25 "${args[@]}"
code=$?
set -e
exit "$code"
