# Sourced by book.sh, test.sh and .ci/run: make .venv with everything the book needs, once.
# Installs the exact versions of one lock (refresh them on purpose with scripts/lock.sh), so a
# fresh machine gets the environment CI tested. Reinstalls only when the lock or pyproject.toml
# change. Which lock (LABKIT_LOCK=cuda|cpu overrides the choice):
#   requirements.lock      what a plain package index gives: torch's CUDA build and its
#                          nvidia-*/cuda-*/triton packages, all pinned (chosen where nvidia-smi
#                          sees a GPU, or where torch's +cpu build cannot be had);
#   requirements-cpu.lock  torch's CPU build (200 MB, not several GB) and no CUDA packages:
#                          chosen without a GPU when pip can find it (PyTorch's CPU wheel index
#                          or a wheel folder in pip's configuration, as on CI's machine).
set -euo pipefail
PY=${PYTHON:-python3}
_labkit_choose_lock() {
  case "${LABKIT_LOCK:-auto}" in
    cuda) echo requirements.lock; return ;;
    cpu) echo requirements-cpu.lock; return ;;
    auto) ;;
    *) echo "env.sh: LABKIT_LOCK=${LABKIT_LOCK} is not cuda, cpu or auto" >&2; return 2 ;;
  esac
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    echo requirements.lock; return
  fi
  local torch
  torch=$(grep -E '^torch==' requirements-cpu.lock | cut -d' ' -f1)
  if "$1" -m pip install --dry-run --no-deps --quiet --ignore-installed "$torch" >/dev/null 2>&1
  then echo requirements-cpu.lock
  else
    echo "env.sh: no GPU, but $torch is not on the indexes pip sees: installing torch's CUDA" \
         "build from requirements.lock (it runs on the CPU too). For the smaller CPU build, add" \
         "PyTorch's CPU wheel index to pip's configuration (PIP_EXTRA_INDEX_URL) and delete .venv." >&2
    echo requirements.lock
  fi
}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [[ "${LABKIT_LOCK:-auto}" == auto && -f .venv/.labkit-lock ]]; then
  lock=$(cat .venv/.labkit-lock)     # chosen when this .venv was made
else
  lock=$(_labkit_choose_lock .venv/bin/python)
fi
stamp=$(cat "$lock" pyproject.toml | sha256sum | cut -c1-16)
# LABKIT_SKIP_INSTALL=1: use .venv as it is (the browser test runs ./book.sh in a copy of the
# book over the repository's .venv, which an install from the copy would repoint at the copy)
if [ "${LABKIT_SKIP_INSTALL:-0}" != 1 ] && [ "$(cat .venv/.labkit-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "Setting up .venv from $lock (first run only: a minute or two) ..."
  pins() { grep -i -E "^($1)==" "$lock" | cut -d' ' -f1; }
  # pip and setuptools first, at the lock's versions: the editable install below builds with them
  .venv/bin/python -m pip install --quiet $(pins 'pip|setuptools')
  .venv/bin/python -m pip install --quiet -r "$lock"
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  echo "$lock" > .venv/.labkit-lock
  echo "$stamp" > .venv/.labkit-stamp
fi
export PATH="$PWD/.venv/bin:$PATH"
