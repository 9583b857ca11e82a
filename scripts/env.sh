# Sourced by book.sh, test.sh and .ci/run: make .venv with everything the book needs, once.
# Installs the exact versions in requirements.lock (refresh them on purpose with scripts/lock.sh),
# so a fresh machine gets the environment CI tested. Reinstalls only when the lock or
# pyproject.toml change.
set -euo pipefail
PY=${PYTHON:-python3}
stamp=$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.labkit-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "Setting up .venv from requirements.lock (first run only: a minute or two) ..."
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  pins() { grep -i -E "^($1)==" requirements.lock; }
  # pip and setuptools first, at the lock's versions: the editable install below builds with them
  .venv/bin/python -m pip install --quiet $(pins 'pip|setuptools')
  .venv/bin/python -m pip install --quiet -r requirements.lock
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  echo "$stamp" > .venv/.labkit-stamp
fi
export PATH="$PWD/.venv/bin:$PATH"
