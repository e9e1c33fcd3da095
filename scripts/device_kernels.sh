#!/usr/bin/env bash
# ONE lent-GPU command for the kernel measurements of issue 35: the graph-timed sweep, then
# FlashInfer side by side, inside BUDGET_S seconds, every log packed into $OUT/kernels.tgz.
#
#   bash scripts/device_kernels.sh BUDGET_S [bench_kernels_graph.py args, e.g. --only moe,kv]
#
# Run after specengine._C is built (the lead's build step: scripts/install_offline.sh); this
# builds nothing. In order:
#  1. installs the carried wheels (.whl/*.whl, made by scripts/flashinfer_wheel.sh) into
#     /tmp/site, with no index and no dependencies;
#  2. starts FlashInfer's JIT warm-up (peers_flashinfer.py --warmup-only) in the background
#     under setsid, so its 2-3 minutes of nvcc overlap the sweep and, if this command ends
#     first, it carries on while the machine stays warm (the next command finds
#     $FI_WS/warm.done and skips it); one process per module family (decode, prefill with a
#     custom mask, sampling), MAX_JOBS=4 nvcc jobs each: 4 of the 16 cores stay with the sweep;
#  3. runs bench_kernels_graph.py with what is left minus $PEERS_S (default 100 s);
#  4. waits for the warm-up (at most until $PEERS_S/2 is left), then runs peers_flashinfer.py
#     in what is left;
#  5. packs everything into $OUT/kernels.tgz and prints the target rows and the peers table
#     last (also $OUT/summary.txt and $OUT/console.txt).
# PEERS_S=0 skips FlashInfer; NO_SWEEP=1 runs only the peers (a later command); RESUME=1 (a
# later command on the still-warm machine) skips the sweep cases measured before; FI_SITE=DIR
# uses a FlashInfer already installed in DIR instead of installing .whl.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:?set OUT to the folder that comes back}
BUDGET=${1:?usage: device_kernels.sh BUDGET_S [sweep args]}
shift
PY=${PYTHON:-python3}
PEERS_S=${PEERS_S:-100}
NO_SWEEP=${NO_SWEEP:-0}
WORK=/tmp/device_kernels
FI_WS=${FI_WS:-/tmp/fi_ws}
start=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - start) )); }
# RESUME=1 (a later command while the machine is still warm): the cases the last command
# measured are not run again (its JSONL is kept in $WORK/prev and summarised too).
prev=""
if [ "${RESUME:-0}" = 1 ] && [ -f "$WORK/sweep/kernels_graph.jsonl" ]; then
  rm -rf /tmp/device_kernels_prev
  mkdir -p /tmp/device_kernels_prev
  cat "$WORK"/prev/kernels_graph.jsonl "$WORK/sweep/kernels_graph.jsonl" 2>/dev/null \
    > /tmp/device_kernels_prev/kernels_graph.jsonl
fi
rm -rf "$WORK"
mkdir -p "$WORK" "$FI_WS"
if [ -f /tmp/device_kernels_prev/kernels_graph.jsonl ] && [ "${RESUME:-0}" = 1 ]; then
  mkdir -p "$WORK/prev"
  mv /tmp/device_kernels_prev/kernels_graph.jsonl "$WORK/prev/"
  prev="$WORK/prev/kernels_graph.jsonl"
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_WORKSPACE_BASE="$FI_WS" FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_DECODE_AUTO_CUDNN=0 MAX_JOBS=${MAX_JOBS:-4}  # x 3 warm-up processes
# tvm-ffi JIT-builds a small torch DLPack addon on its first import (unless torch has the
# exchange API): cached beside FlashInfer's modules, so later commands find it too.
export TVM_FFI_CACHE_DIR="$FI_WS/tvm-ffi"
command -v nvcc >/dev/null || export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
# FlashInfer's JIT runs `ninja` from PATH: the pip package's binary, next to python or in it.
command -v ninja >/dev/null || export PATH="$(dirname "$(command -v "$PY")"):$PATH"
command -v ninja >/dev/null || export PATH="$("$PY" -c 'import ninja; print(ninja.BIN_DIR)' \
  2>/dev/null):$PATH"

{
  echo "== device_kernels: budget ${BUDGET} s, peers ${PEERS_S} s, $(date -u +%H:%M:%S) UTC"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>&1
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "nvcc: $(command -v nvcc || echo missing), ninja: $(command -v ninja || echo missing)"
  # specengine.kernels comes from kernels/ (an editable install maps it; the git-ignored
  # symlink does not travel): make the link when the import does not work without it.
  "$PY" -c 'import specengine.kernels' 2>/dev/null || ln -sfn ../kernels specengine/kernels
  "$PY" -c 'from specengine import _C; print("_C CUDA kernels:", _C.has_cuda_kernels)' 2>&1

  fi_site=""
  if (( PEERS_S > 0 )) && [ -n "${FI_SITE:-}" ]; then
    fi_site=$FI_SITE  # already installed there (a check of this script off the device)
    echo "== FlashInfer from $fi_site"
  elif (( PEERS_S > 0 )) && ls .whl/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl; then
      fi_site=/tmp/site
      echo "== wheels installed in /tmp/site: $(ls .whl)"
    else
      echo "== wheel install failed: no FlashInfer peers"
    fi
  elif (( PEERS_S > 0 )); then
    echo "== no .whl/*.whl carried (scripts/flashinfer_wheel.sh): no FlashInfer peers"
  fi
  if [ -n "$fi_site" ]; then
    if [ -f "$FI_WS/warm.done" ]; then
      echo "== FlashInfer JIT already warm ($FI_WS/warm.done)"
    elif [ -f "$FI_WS/warm.pid" ] && kill -0 "$(cat "$FI_WS/warm.pid")" 2>/dev/null; then
      echo "== FlashInfer JIT warm-up still running (pid $(cat "$FI_WS/warm.pid"))"
    else
      echo "== FlashInfer JIT warm-up started in the background (decode, tree, sampling)"
      # One process per module family, in parallel (each builds its own module; serially the
      # three take minutes longer); warm.done once all three have ended.
      PYTHONPATH="$fi_site:$PYTHONPATH" setsid nohup bash -c "
        for step in decode tree sampling; do
          '$PY' benchmarks/peers_flashinfer.py --warmup-only --warmup-steps \$step \
            --out '$FI_WS/warmup' > '$FI_WS/warmup_'\$step.log 2>&1 &
        done
        wait; touch '$FI_WS/warm.done'" </dev/null >/dev/null 2>&1 &
      echo $! > "$FI_WS/warm.pid"
    fi
  fi

  if [ "$NO_SWEEP" != 1 ]; then
    reserve=$PEERS_S
    [ -z "$fi_site" ] && reserve=0
    sweep_s=$(( $(left) - reserve - 15 ))
    echo "== sweep: budget ${sweep_s} s"
    skip_args=()
    [ -n "$prev" ] && skip_args=(--skip-from "$prev") && echo "== resuming after $prev"
    timeout -k 5 $(( sweep_s + 30 )) "$PY" benchmarks/bench_kernels_graph.py \
      --budget-s "$sweep_s" --out "$WORK/sweep" "${skip_args[@]}" "$@"
    echo "== sweep: exit $? at $(( $(date +%s) - start )) s"
  fi

  if [ -n "$fi_site" ]; then
    while [ ! -f "$FI_WS/warm.done" ] && (( $(left) > PEERS_S / 2 + 10 )); do sleep 2; done
    if [ -f "$FI_WS/warm.done" ]; then
      echo "== FlashInfer warm-up done: $(cat "$FI_WS"/warmup/flashinfer_warmup_*.json \
        2>/dev/null | tr -d '\n ' | head -c 600)"
    else
      echo "== FlashInfer warm-up not finished; peers compile what is missing in their budget"
    fi
    peers_s=$(( $(left) - 10 ))
    if (( peers_s > 20 )); then
      echo "== peers: budget ${peers_s} s"
      PYTHONPATH="$fi_site:$PYTHONPATH" timeout -k 5 $(( peers_s + 5 )) "$PY" \
        benchmarks/peers_flashinfer.py --budget-s "$peers_s" --out "$WORK/peers"
      echo "== peers: exit $? at $(( $(date +%s) - start )) s"
    else
      echo "== peers: not run (${peers_s} s left)"
    fi
    cp "$FI_WS"/warmup_*.log "$WORK/" 2>/dev/null
  fi
} 2>&1 | tee "$WORK/console.txt"

{
  echo "== summary"
  if [ -n "$prev" ]; then
    echo "(earlier commands)"
    "$PY" benchmarks/bench_kernels_graph.py --summary-of "$WORK/prev"
    echo "(this command)"
  fi
  if [ -f "$WORK/sweep/kernels_graph.jsonl" ]; then
    "$PY" benchmarks/bench_kernels_graph.py --summary-of "$WORK/sweep"
  fi
  if [ -f "$WORK/peers/peers_flashinfer.json" ]; then
    "$PY" -c '
import json, sys
sys.path.insert(0, "benchmarks")
from peers_flashinfer import markdown
print(markdown(json.load(open(sys.argv[1]))))' "$WORK/peers/peers_flashinfer.json" 2>&1
  fi
} > "$WORK/summary.txt" 2>&1
tar czf "$OUT/kernels.tgz" -C /tmp device_kernels
cp "$WORK/console.txt" "$WORK/summary.txt" "$OUT/" 2>/dev/null
cat "$WORK/summary.txt"
