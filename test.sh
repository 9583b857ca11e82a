#!/usr/bin/env bash
# Run every test: labkit's unit tests, the notebooks under nbval, grading of exercises.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
exec python -m pytest tests chapters solutions --nbval-lax --nbval-cell-timeout=600 -p no:cacheprovider --durations=25 "$@"
