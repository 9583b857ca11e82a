# Sourced by book.sh and test.sh: make .venv with everything the book needs, once.
# Reinstalls only when requirements.txt or pyproject.toml change.
set -euo pipefail
PY=${PYTHON:-python3}
stamp=$(cat requirements.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.labkit-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "Setting up .venv (first run only: a minute or two) ..."
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  echo "$stamp" > .venv/.labkit-stamp
fi
export PATH="$PWD/.venv/bin:$PATH"
