#!/usr/bin/env bash
# Step profile on the lent H200 (MLX-CUDA): eager vs compiled target passes, default model and
# the 8B-shaped random 4-bit Llama; JSON + log under $OUT. Run from the repository root after
# staging (benchmarks/gpu/h200_session.sh conventions: wheels unpacked to /tmp/site, the default
# GGUF in /root/s/files). About 2-4 minutes; every part is time-boxed and the JSON is rewritten
# after each model, so a timeout keeps what finished.
#   bash benchmarks/gpu/step_profile_h200.sh            # full run
#   SMOKE=1 OUT=/tmp/o bash benchmarks/gpu/step_profile_h200.sh   # CPU dry run of the harness
set -uo pipefail
stage=/root/s
if [ ! -d /tmp/site/mlx ] && [ -d "$stage" ]; then
  (cd "$stage" && { ! ls part_* >/dev/null 2>&1 || { cat part_* | tar x && rm -f part_*; }; } &&
   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl $(ls files/*.whl 2>/dev/null))
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECSERVE_CACHE_DIR=${SPECSERVE_CACHE_DIR:-/root/cache}
out=${OUT:-/tmp/out}; mkdir -p "$out"
gguf=$stage/files/SmolLM2-135M-Instruct.Q4_1.gguf
model=default; [ -f "$gguf" ] && model=$gguf
py=python3; command -v python3 >/dev/null || py=python
if [ -n "${SMOKE:-}" ]; then  # small sizes: checks the harness end to end in well under a minute
  args=(--llama8b --smoke --dtype float32 --max-k 3 --reps 2 --decode-tokens 8 --engine-tokens 16 --context 64 --calibrate 3)
  limit=600
else
  args=(--llama8b --reps 10 --decode-tokens 128 --engine-tokens 128 --context 512 --calibrate 16)
  limit=225
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/gpu.txt" 2>&1 || true
timeout -k 10 "$limit" "$py" -m benchmarks.step_profile --model "$model" --out "$out/step_profile_h200.json" \
  "${args[@]}" 2>&1 | tee "$out/step_profile_h200.log"
rc=${PIPESTATUS[0]}
echo "step_profile exit code $rc (124: time limit; partial JSON kept)" | tee -a "$out/step_profile_h200.log"
exit 0
