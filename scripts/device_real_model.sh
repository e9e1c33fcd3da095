#!/usr/bin/env bash
# The real model end to end on a lent GPU (issue 34 item 7): SmolLM2-135M-Instruct with its
# trained EAGLE-3 head, rollout tokens per second for k=0, EAGLE-3 k=3 and k="auto" (plus the
# n-gram and suffix drafters, and the head's own trees of 16 and 32 drafts from its
# trees.json) at batch 1, 8, 64 and 256, T=1, CUDA graphs on.
#
# The model does not fit in one command's 64 MiB: the 98 MB GGUF travels in two parts, in two
# commands run back to back (the machine keeps /root while it stays warm, 30 s).
#
#   bash scripts/device_real_model.sh pack HEAD_DIR   # here: .dev1/ and .dev2/ (git-ignored)
#   run(command="bash scripts/device_real_model.sh 1", carry=[".dev1"], timeout_s=240)
#   run(command="bash scripts/device_real_model.sh 2 300", carry=[".dev2"], timeout_s=420)
#
# 1: keeps the first part in /root, installs the carried gguf wheel into /root/site, builds
#    specengine._C for sm_90a (scripts/install_offline.sh).
# 2: joins the parts, checks the GGUF's pinned sha256 (the builder does), builds the
#    checkpoint (`specengine build-model smollm2 --gguf`), then benchmarks/bench_real_model.py
#    within BUDGET_S seconds, rows streamed to $OUT/rows.jsonl as they are measured.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PART_BYTES=56000000  # the first part; .dev1 also carries the project (~8 MB) and the wheel

case "${1:-}" in
  pack)
    head_dir=${2:?usage: device_real_model.sh pack HEAD_DIR}
    src=$("$PY" -c 'from specengine.assets import smollm2; print(smollm2.find_gguf())') || exit 1
    rm -rf .dev1 .dev2 && mkdir -p .dev1 .dev2/head
    split -b "$PART_BYTES" -d "$src" /tmp/gguf.part.
    mv /tmp/gguf.part.00 .dev1/gguf.part00 && mv /tmp/gguf.part.01 .dev2/gguf.part01
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 -d .dev1 gguf==0.19.0 || exit 1
    cp -r "$head_dir"/. .dev2/head/
    "$PY" -c 'from specengine import math_task as m; m.write_heldout_prompts(".dev2/heldout.jsonl", 256)' \
      || exit 1
    du -sh .dev1 .dev2
    ;;
  1)
    : "${OUT:?set OUT}"
    mkdir -p /root/real_model && cp .dev1/gguf.part00 /root/real_model/
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /root/site .dev1/gguf-*.whl
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    SPECENGINE_CUDA_ARCHS=90a PYTHON="$PY" bash scripts/install_offline.sh > "$OUT/build.log" 2>&1 \
      || { tail -40 "$OUT/build.log"; exit 1; }
    tail -3 "$OUT/build.log"
    ;;
  2)
    : "${OUT:?set OUT}"
    budget=${2:-300}
    [ -f /root/real_model/gguf.part00 ] || { echo "part 1 missing: run stage 1 first"; exit 1; }
    cat /root/real_model/gguf.part00 .dev2/gguf.part01 > "/root/real_model/$GGUF_NAME"
    export PYTHONPATH="/root/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    model=$("$PY" -m specengine.cli build-model smollm2 --gguf "/root/real_model/$GGUF_NAME" \
      --cache-dir /root/real_model/cache 2> "$OUT/build_model.log") \
      || { tail -20 "$OUT/build_model.log"; exit 1; }
    "$PY" benchmarks/bench_real_model.py --model "$model" --draft .dev2/head \
      --prompts .dev2/heldout.jsonl --drafters ngram,suffix --batch 1,8,64,256 --k 0,3,auto \
      $( [ -f .dev2/head/trees.json ] && echo --trees 16,32 ) \
      --temperature 1.0 --max-tokens 256 --budget-s "$budget" --out "$OUT" 2>&1 \
      | grep -v 'it/s\]' | tee "$OUT/bench.log"
    ;;
  *)
    echo "usage: device_real_model.sh pack HEAD_DIR | 1 | 2 [BUDGET_S]" >&2
    exit 2
    ;;
esac
