#!/usr/bin/env bash
# Compile every CUDA source (csrc/*.cu) for Hopper (sm_90a) and Blackwell (sm_100a) with nvcc.
# Nothing runs here and no GPU is needed: this only proves that the kernels build for both
# architectures. Fails on the first compiler error (or when nvcc or the sources are missing).
#
#   bash .ci/compile_cuda.sh            # NVCC=/path/to/nvcc to pick a compiler
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "compile_cuda.sh: nvcc not found (set NVCC or put it on PATH)" >&2
  exit 1
fi

shopt -s nullglob
sources=(csrc/*.cu)
if [ "${#sources[@]}" -eq 0 ]; then
  echo "compile_cuda.sh: no csrc/*.cu files found" >&2
  exit 1
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "compile_cuda.sh: $("$NVCC" --version | tail -n 1)"
for src in "${sources[@]}"; do
  obj="$out/$(basename "$src" .cu).o"
  start=$SECONDS
  "$NVCC" -std=c++17 -O3 -c \
    -gencode arch=compute_90a,code=sm_90a \
    -gencode arch=compute_100a,code=sm_100a \
    -Xcompiler=-Wall,-Wextra \
    -Icsrc -o "$obj" "$src"
  echo "compiled $src for sm_90a, sm_100a ($(( SECONDS - start )) s, $(stat -c %s "$obj") bytes)"
done
echo "compile_cuda.sh: ${#sources[@]} CUDA file(s) OK"
