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
# 3: train-draft on the GPU (issue 34 item 3: "say how long on a GPU"), after stage 2 on the
#    same warm machine, or in a session of its own after stages 1 and 2's build:
#      run(command="bash scripts/device_real_model.sh 3 540", timeout_s=590)
#    the RESULTS command (200k rollout tokens, 500 steps), then 4x the tokens and steps
#    within the budget; logs and the larger run's head (config, weights, trees.json,
#    eval.json) come back in $OUT for an evaluation here (benchmarks/eval_draft_head.py).
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
  3)
    # Item 3 on the GPU: how long the RESULTS train-draft command takes there (run A), then
    # the same with DATA_X times the rollout tokens and steps (run B): whether the data a GPU
    # affords in the hour lifts the 3-draft chain to the targets the CPU's hour does not.
    # Needs the checkpoint of stage 2 (this warm machine) or MODEL=DIR; DEVICE, TOKENS and
    # STEPS override the sizes (a CPU dry run: DEVICE=cpu TOKENS=3000 STEPS=4 DATA_X=1).
    : "${OUT:?set OUT}"
    budget=${2:-480}
    t0=$(date +%s)
    export PYTHONPATH="/root/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    model=${MODEL:-$(ls -d /root/real_model/cache/smollm2-135m-instruct 2>/dev/null)}
    [ -n "$model" ] || { echo "no checkpoint: run stages 1 and 2 first (or set MODEL)"; exit 1; }
    work=${WORK:-/root/real_model/train}
    mkdir -p "$work"
    "$PY" -c "from specengine import math_task as m; m.write_training_prompts('$work/train.jsonl', 4000); m.write_heldout_prompts('$work/held.jsonl', 16)" \
      || exit 1
    tokens=${TOKENS:-200000} steps=${STEPS:-500} x=${DATA_X:-4}
    train() {  # NAME TOKENS STEPS TIMEOUT_S: one train-draft run, its log and head into $OUT
      local name=$1 start; start=$(date +%s)
      timeout "$4" "$PY" -m specengine.cli train-draft --model "$model" \
        --prompts "$work/train.jsonl" --eval-prompts "$work/held.jsonl" --holdout 16 \
        --eval-max-tokens 80 --temperature 1 --max-tokens 96 --rollout-tokens "$2" \
        --draft-vocab-size 4096 --steps "$3" --batch-tokens 4096 --save-every 0 \
        --curve-points 5 --head-dtype bfloat16 --device "${DEVICE:-cuda}" --no-progress \
        --overwrite --out "$work/$name" > "$OUT/train_$name.log" 2>&1
      local rc=$?
      echo "$name: rc=$rc, $(( $(date +%s) - start )) s wall" | tee -a "$OUT/train_$name.log"
      mkdir -p "$OUT/$name"
      for f in config.json model.safetensors trees.json eval.json; do
        [ -f "$work/$name/$f" ] && cp "$work/$name/$f" "$OUT/$name/"
      done
      return $rc
    }
    train default "$tokens" "$steps" "$budget"
    left=$(( budget - ($(date +%s) - t0) ))
    if [ "$left" -gt 60 ]; then
      # (at most 8 files come back: the default run keeps its eval.json, the larger its head)
      rm -f "$OUT/default/model.safetensors" "$OUT/default/config.json" "$OUT/default/trees.json"
      train "x$x" $(( tokens * x )) $(( steps * x )) "$left"
    else
      echo "no time left for the ${x}x run (${left} s)"
    fi
    ;;
  *)
    echo "usage: device_real_model.sh pack HEAD_DIR | 1 | 2 [BUDGET_S] | 3 [BUDGET_S]" >&2
    exit 2
    ;;
esac
