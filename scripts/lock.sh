#!/usr/bin/env bash
# Refresh the locks, the exact versions every install of the book uses (scripts/env.sh: ./book.sh,
# ./test.sh and CI). Run it on purpose, e.g. at the start of a term, then run the whole suite
# (./test.sh --full) before committing the new locks: nothing else ever changes a version.
#
#   bash scripts/lock.sh             # add what is new, keep every version already locked
#   bash scripts/lock.sh --upgrade   # resolve requirements.txt afresh
#
# It writes requirements.lock (what a plain package index resolves: torch's CUDA build on Linux
# x86-64 and every nvidia-*/cuda-*/triton package it pulls in) and requirements-cpu.lock (the same
# with torch's +cpu build and no CUDA packages). pip resolves without installing anything
# (scripts/lock.py). The +cpu wheel must be visible to pip for the second: PyTorch's CPU wheel
# index in pip's configuration, a wheel folder there, or --cpu-wheels DIR_OR_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
exec "$PY" scripts/lock.py "$@"
