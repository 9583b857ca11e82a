#!/usr/bin/env bash
# On a machine with at least one GPU: run the GPU-ready labs (ring, tp, hybrid, ddp, zero,
# precision; pipeline too with NPROC >= 2, as it needs two stages) on NPROC ranks (default 1:
# NCCL works with a single rank) and print the backend and device each one used; then
# `labkit calibrate --quick` (this GPU's roofs, memory and MFU beside the book's formulas,
# written to CALIBRATE_JSON, default calibrate-quick.json). One command to check that the labs put
# their tensors on the GPU and that NCCL is chosen (one GPU per rank; fewer GPUs than ranks
# means Gloo):
#
#     bash scripts/gpu-smoke.sh            # from the repository root
#     NPROC=2 bash scripts/gpu-smoke.sh    # two ranks, where there are two GPUs or more
#
# Expected: every lab says "backend nccl, device cuda:0" (rank 0's), and the last line
# "all N labs ran on NCCL". With NPROC=1 the labs' own messages (ring steps, TP all-reduces)
# are not exercised: one rank has no peer; NPROC >= 2 exercises them.
# intro chooses NCCL the same way (BACKEND = "auto"); checkpoint and train_ft stay on Gloo on
# purpose (CPU lessons). Exit code: 0 all on NCCL and calibrate ran, 1 some not, 2 no GPU (the
# test suite runs this script on the CPU and expects 2: tests/test_calibrate.py).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}  # the active venv's python first
NPROC=${NPROC:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NPROC

$PY - <<'PY' || exit 2
import torch
import os
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
want = int(os.environ.get("NPROC", "1"))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} GPU(s)"
      + (f": {torch.cuda.get_device_name(0)}" if n else ""))
print(f"NCCL available: {torch.distributed.is_nccl_available()}"
      + (f", version {'.'.join(map(str, torch.cuda.nccl.version()))}" if n else ""))
if n and n < want:
    print(f"NPROC={want} ranks but {n} GPU(s): the labs will choose Gloo (one GPU per rank)")
raise SystemExit(0 if n else "no GPU visible: nothing to smoke-test (the labs run on Gloo here)")
PY

# lab -> small options (the pipeline needs at least 2 stages: NPROC >= 2 only)
declare -A OPTS=(
  [ring]="--sizes-mib 1 16 --repeats 3"
  [tp]="--steps 2"
  [hybrid]="--steps 2 --batch 4"
  [pipeline]="--K 4 --batch 8 --pad-ms 0 0"
  [ddp]="--steps 2 --versions bucketed torch"
  [zero]="--steps 2 --stages 0 3"
  [precision]="--steps 4"
)
LABS="ring tp hybrid ddp zero precision"
if [ "$NPROC" -ge 2 ]; then LABS="$LABS pipeline"; fi

ok=0; total=0; failed=""
for lab in $LABS; do
  total=$((total + 1))
  echo "== labkit run $lab --nproc $NPROC ${OPTS[$lab]}"
  # shellcheck disable=SC2086
  out=$($PY -m labkit run "$lab" --nproc "$NPROC" ${OPTS[$lab]} 2>&1); code=$?
  echo "$out" | tail -n 25
  where=$(echo "$out" | grep -oE "backend [a-z]+, device [a-z]+(:[0-9]+)?" | head -n 1)
  echo "-> $lab: exit $code; ${where:-backend/device not printed}"
  if [ "$code" -eq 0 ] && echo "$where" | grep -q "nccl" && echo "$where" | grep -q "cuda"; then
    ok=$((ok + 1))
  else
    failed="$failed $lab"
  fi
done

echo
echo "== labkit calibrate --quick --device cuda --json ${CALIBRATE_JSON:-calibrate-quick.json}"
$PY -m labkit calibrate --quick --device cuda --json "${CALIBRATE_JSON:-calibrate-quick.json}"
cal=$?
echo "-> calibrate: exit $cal"

echo
if [ "$ok" -eq "$total" ] && [ "$cal" -eq 0 ]; then
  echo "all $total labs ran on NCCL; calibrate ran"
else
  echo "$ok of $total labs ran on NCCL; not:$failed; calibrate exit $cal"
  exit 1
fi
