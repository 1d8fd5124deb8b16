#!/usr/bin/env bash
# Runs on the lent H200 (MLX-CUDA), from the repository root, after the staged parts were
# copied into /root/s (see docs/benchmarks.md, "Reproducing the GPU numbers").
#   h200_session.sh train  BUDGET_S   # self-distil the DSpark drafter (resumable; stops at budget)
#   h200_session.sh finish BUDGET_S   # finish training, export + evaluate, then benchmark
set -euo pipefail
stage=/root/s
if [ ! -d /tmp/site/mlx ]; then
  (cd "$stage" && cat part_* | tar x && rm -f part_* &&
   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl)
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECSERVE_CACHE_DIR=/root/cache
mkdir -p /root/cache/models && cp -n "$stage"/files/*.gguf /root/cache/models/ 2>/dev/null || true
run=/root/dspark-run
train() {
  python3 -c "import sys; from server.cli import train_dspark; sys.exit(train_dspark(sys.argv[1:]))" \
    --target default --out "$run" --layers 3 --block-size 7 --markov-rank 128 \
    --n-code 3000 --n-instruct 5000 --max-new-tokens 256 --gen-batch-size 256 \
    --steps "${STEPS:-900}" --batch-size 8 --num-anchors 256 --max-seq-len 1024 --lr 6e-4 \
    --eval-per-source 8 --eval-max-new-tokens 96 --time-budget "$1" --no-progress || true
}
case "$1" in
  train) train "$2" ;;
  finish)
    # anneal: end the cosine schedule 20 steps after the newest checkpoint, then export
    latest=$(ls -d "$run"/checkpoints/step-* 2>/dev/null | sed 's/.*step-//' | sort -n | tail -1)
    STEPS=$(( ${latest:-0} + 20 )) train "$2"
    out=${OUT:-/tmp/out}; mkdir -p "$out/drafter"
    cp "$run"/drafter-q4/* "$out/drafter/" 2>/dev/null || true
    cp "$run"/eval.json "$run"/train_log.jsonl "$out/" 2>/dev/null || true
    python3 -m benchmarks.bench_speculative --methods off,prompt_lookup,dspark,auto \
      --dspark-drafter "$run/drafter-q4" --repeats 1 --max-tokens 128 \
      --workloads copy,code_edit,agent_turn,prose,adversarial,novel_code,novel_chat \
      --out "$out/spec_h200.json" ;;
esac
