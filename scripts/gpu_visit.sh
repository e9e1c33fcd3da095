#!/usr/bin/env bash
# One lent-GPU command for a short lease: runs gpu_check.py phases in order, each under its own
# budget, inside one overall deadline, and packs every log and row into ONE archive under $OUT
# (a lent machine returns at most 8 files). Usage:
#
#   bash scripts/gpu_visit.sh DEADLINE_S PHASE:BUDGET_S [PHASE:BUDGET_S ...]
#   e.g. SPECENGINE_CUDA_ARCHS=90a bash scripts/gpu_visit.sh 540 build:240 parity:150 tests:150
#
# The archive is $OUT/gpu_visit.tgz (gpu_check's --out folders, one per phase, plus
# nvidia-smi and the console); the console is also $OUT/console.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:?set OUT to the folder that comes back}
DEADLINE=$1; shift
PY=${PYTHON:-python3}
WORK=/tmp/gpu_visit
rm -rf "$WORK"; mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
start=$(date +%s)
{
  nvidia-smi 2>&1 | head -20
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  for spec in "$@"; do
    phase=${spec%%:*}; budget=${spec##*:}
    left=$(( DEADLINE - ($(date +%s) - start) ))
    (( left < 20 )) && { echo "== $phase: not run (${left} s left)"; continue; }
    (( budget > left )) && budget=$left
    echo "== $phase: budget ${budget} s"
    timeout -k 5 $(( budget + 10 )) "$PY" benchmarks/gpu_check.py --only "$phase" \
      --budget-s "$budget" --out "$WORK/$phase" --no-append
    echo "== $phase: exit $?"
  done
} 2>&1 | tee "$WORK/console.txt"
cp "$WORK/console.txt" "$OUT/console.txt"
tar czf "$OUT/gpu_visit.tgz" -C /tmp gpu_visit
