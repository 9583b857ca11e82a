#!/usr/bin/env bash
# What the browser test (tests/e2e) needs: Debian's Chromium and PyPI's Playwright, in .venv.
# Playwright drives the system's /usr/bin/chromium; it never downloads a browser of its own.
# The website's calculators need the pinned Pyodide runtime (scripts/pyodide-fetch.sh, npm registry).
# Exit status 0 when all three are there afterwards.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
  sudo=""
  [ "$(id -u)" = "0" ] || sudo="sudo -n"
  echo "Installing Debian's chromium for the browser test ..."
  if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium >/dev/null; }; then
    echo "e2e-setup: could not install chromium (apt-get needs root); the browser test will skip"
    exit 1
  fi
fi
[ -x .venv/bin/python ] || { echo "e2e-setup: run ./test.sh or ./book.sh once first (.venv)"; exit 1; }
if ! .venv/bin/python -c "import playwright" 2>/dev/null; then
  .venv/bin/python -m pip install --quiet $(grep -i -E '^(playwright|greenlet|pyee)==' "$(cat .venv/.labkit-lock 2>/dev/null || echo requirements.lock)" | cut -d' ' -f1) || {
    echo "e2e-setup: could not install playwright; the browser test will skip"; exit 1; }
fi
scripts/pyodide-fetch.sh >/dev/null || { echo "e2e-setup: could not fetch Pyodide; the browser test will skip"; exit 1; }
echo "e2e-setup: $(/usr/bin/chromium --version 2>/dev/null | head -1), playwright installed, Pyodide in $(scripts/pyodide-fetch.sh)"
