#!/usr/bin/env bash
# The verify-kernel measurements on the lent H200 (MLX-CUDA), one bounded device call per phase,
# from the repository root after the staged parts were copied into /root/s (docs/benchmarks.md):
#   kernels_h200.sh cal      # start-up calibration: exact verify width and T(k) per activation
#                            # dtype, metal_kernels off/on (benchmarks/gpu/kernel_calibration.py)
#   kernels_h200.sh spec     # prompt lookup vs plain per SPEC_CONFIGS (weights:kernels:exact_verify),
#                            # by default float32 activations with MLX's matmul against bfloat16
#                            # activations with the matmul kernels
#   kernels_h200.sh verify   # benchmarks/verify_cost.py: matrices, 8B-shaped stack, default model
#   kernels_h200.sh check    # benchmarks/kernel_check.py: the GPU correctness tests
#   kernels_h200.sh checkpar # the same tests in 10 parallel processes (NVRTC compiles dominate:
#                            # 431 s serially in the twenty-seventh session, without the ten
#                            # compile-time-shape cases at ~80 s each), merged into one JSON
#   kernels_h200.sh attn     # the row-attention kernel: its GPU tests, then
#                            # benchmarks/gpu/attention_cost.py against MLX's attention
#   kernels_h200.sh overhead # benchmarks/gpu/kernel_overhead.py (+ ncu device times)
#   kernels_h200.sh probe    # benchmarks/identity_probe.py: first position/row/layer where verify rows
#                            # and decode steps part (WEIGHTS, KERNELS, EXACT, WIDTHS, TOKENS)
#   kernels_h200.sh fused    # tests/test_fused.py (GPU tier included), then benchmarks/step_profile.py
#                            # eager vs fused passes on the default model (MODES, STEP_ARGS)
#   kernels_h200.sh mma      # the mma kernel's launch configurations under Nsight Compute: its GPU
#                            # tests (CHECK_K; SKIP_CHECK=1 skips them), then mma_sweep --ncu over SHAPES/ROWS and CONFIGS
#                            # (WK,NT,U,KC,XL,LB[,MR,FU,LP,XS];...; or the WK/NT/U product),
#                            # LAUNCHES per case (median after the first), parsed into
#                            # $OUT/mma_ncu.json
#   kernels_h200.sh rows     # the 2..16-row launches on the 8B stack's shapes (SHAPES): two mma
#                            # sweeps under Nsight Compute (8 rows: CONFIGS8, 16 rows: CONFIGS16),
#                            # then mma_sweep --pick: the configurations that beat the default by
#                            # more than MARGIN, in $OUT/mma_picks.json and /root/mma_picks.json
#   kernels_h200.sh stack    # verify_cost.py on the 8B stack, compiled and eager, MLX against the
#                            # kernels' defaults and (when /root/mma_picks.json exists) the picks
#                            # of `rows` for 2..16 rows (one-row launches keep their defaults)
#   kernels_h200.sh draft    # the fused DSpark draft's GPU tests (a launch that fails cannot be
#                            # recovered in-process, so in a call before any engine starts; on a
#                            # fresh H100 NVRTC compiles made 14 of its 22 tests take 240 s, the
#                            # 22 took 60 s in the next call)
#   kernels_h200.sh draftcost # benchmarks/gpu/dspark_forward.py, then benchmarks/dspark_cost.py
#                            # (DRAFTER=; ROWS_AB=1: dspark_cost again with the 16-row draft
#                            # kernel; VOCAB_AB=1: again over the whole vocabulary instead of the
#                            # drafter's draft vocabulary; GRAPHS_AB=1: dspark_forward again with
#                            # MLX_USE_CUDA_GRAPHS=1, MLX's default; engine/mlx_env.py turns CUDA
#                            # graphs off). dspark_forward ran past 80-90 s twice on an H100 (forty-
#                            # third session): FORWARD_LIMIT is 150 s; a step past its limit does
#                            # not stop the next one
# Staging: ../shared/tools/stage-for-gpu.sh "$SPECSERVE_CACHE_DIR"/models/SmolLM2-135M-Instruct.Q4_1.gguf \
#   llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl   (`pip download --no-deps llguidance==1.9.1`:
#   the script's platform list would pick an older llguidance; wheels under files/ are installed too)
# Fewer calls: benchmarks/gpu/stage_parts.sh repacks the parts (two for `stack`, four for all).
# Results go to $OUT.
set -euo pipefail
stage=/root/s
if [ -d "$stage" ] && [ ! -d /tmp/site/mlx ]; then
  (cd "$stage" && cat part_* | tar x && rm -f part_* &&
   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl $(ls files/*.whl 2>/dev/null))
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECSERVE_CACHE_DIR=${SPECSERVE_CACHE_DIR:-/root/cache}
mkdir -p "$SPECSERVE_CACHE_DIR/models" && cp -n "$stage"/files/*.gguf "$SPECSERVE_CACHE_DIR/models/" 2>/dev/null || true
out=${OUT:-/tmp/out}; mkdir -p "$out"
spec_workloads=${WORKLOADS:-copy,code_edit,agent_turn,prose,adversarial,novel_code}
case "$1" in
  cal) OUT=$out python3 benchmarks/gpu/kernel_calibration.py ;;
  spec)
    # SPEC_CONFIGS: weights:kernels:exact_verify triples
    for cfg in ${SPEC_CONFIGS:-quantized:off:row quantized-bfloat16:auto:row}; do
      IFS=: read -r w k e <<< "$cfg"
      python3 -m benchmarks.bench_speculative --weights "$w" --kernels "$k" --exact-verify "$e" \
        --methods off,prompt_lookup --workloads "$spec_workloads" --repeats "${REPEATS:-1}" \
        --max-tokens "${MAX_TOKENS:-128}" --out "$out/spec_h200_${w}_kernels_${k}_${e}.json" 2>&1 \
        | grep -v "^INFO" | tail -25
    done ;;
  verify) python3 benchmarks/verify_cost.py --out "$out/verify_cost_h200.json" --parts "${PARTS:-matrices,llama8b,smollm}" \
            --reps "${REPS:-9}" 2>&1 | tail -60 ;;
  checkpar)
    groups=("matches_reference and not mixed" "patched_model_logits_close[float16]"
            "patched_model_logits_close[bfloat16]" "patched_model_logits_close[float32] or mixed"
            "not matches_reference and not patched_model and not const_shape_paths")
    for c in 4-32 4-64 4-128 8-32 8-64; do groups+=("const_shape_paths and $c-"); done
    rm -f /tmp/kc_part*.json /tmp/kc_part*.log
    i=0
    for g in "${groups[@]}"; do
      timeout -k 5 "${CHECK_LIMIT:-400}" python3 benchmarks/kernel_check.py --out "/tmp/kc_part$i.json" -k "$g" \
        > "/tmp/kc_part$i.log" 2>&1 &
      i=$((i + 1))
    done
    wait || true
    python3 - "$out/kernel_check_h200.json" "${#groups[@]}" <<'EOF'
import json, pathlib, sys
rows, wall = [], 0.0
for i in range(int(sys.argv[2])):
    f = pathlib.Path(f"/tmp/kc_part{i}.json")
    if not f.exists():  # (killed by the time limit, or crashed: its log's end says which)
        tail = pathlib.Path(f"/tmp/kc_part{i}.log").read_text().splitlines()[-5:]
        rows.append({"test": f"part {i}", "outcome": "failed", "seconds": 0, "message": " | ".join(tail)[-300:]})
        continue
    d = json.loads(f.read_text())
    if not d["tests"]:  # (a -k group that selected nothing, or a collection error)
        rows.append({"test": f"part {i}", "outcome": "failed", "seconds": 0, "message": "no test ran"})
    rows += d["tests"]
    wall = max(wall, d["wall_s"])
counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "skipped")}
for r in rows:
    if r["outcome"] != "passed":
        print(r["outcome"].upper(), r["test"], r["message"])
print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; slowest part {wall:.0f} s")
json.dump({"counts": counts, "wall_s": wall, "parallel_parts": int(sys.argv[2]), "tests": rows},
          open(sys.argv[1], "w"), indent=1)
sys.exit(0 if counts["passed"] and not counts["failed"] and not counts["skipped"] else 1)
EOF
    ;;
  attn)
    python3 benchmarks/kernel_check.py --out "$out/kernel_check_attention_h200.json" -k row_attention 2>&1 | tail -12
    python3 benchmarks/gpu/attention_cost.py --out "$out/attention_cost_h200.json" 2>&1 | tail -60 ;;
  check) python3 benchmarks/kernel_check.py --out "$out/kernel_check_h200.json" ${CHECK_K:+-k "$CHECK_K"} 2>&1 | tail -70 ;;
  overhead)
    python3 benchmarks/gpu/kernel_overhead.py --out "$out/kernel_overhead.json" 2>&1 | tail -90
    timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file "$out/ncu.csv" \
      python3 benchmarks/gpu/kernel_overhead.py --ncu > "$out/ncu_stdout.txt" 2>&1 || true ;;
  probe) python3 -m benchmarks.identity_probe --prompt-file benchmarks/workloads/agent_turn.json \
           --weights "${WEIGHTS:-quantized-bfloat16}" --kernels "${KERNELS:-auto}" --exact-verify "${EXACT:-row}" \
           --widths "${WIDTHS:-2,4,8,10,16}" --tokens "${TOKENS:-128}" --out "$out/identity_probe.json" 2>&1 \
           | grep -v "^INFO" | tail -8 ;;
  fused)
    timeout -k 5 "${TEST_LIMIT:-240}" python3 -m pytest -q -x -p no:cacheprovider tests/test_fused.py ${CHECK_K:+-k "$CHECK_K"} \
      2>&1 | tail -40 || true
    gguf=$stage/files/SmolLM2-135M-Instruct.Q4_1.gguf
    timeout -k 5 "${STEP_LIMIT:-240}" python3 -m benchmarks.step_profile --model "$gguf" --modes "${MODES:-eager,fused}" \
      --out "$out/step_profile_fused_h200.json" ${STEP_ARGS:---reps 10 --decode-tokens 128 --engine-tokens 128 --context 512 --calibrate 16} \
      2>&1 | grep -v "^INFO" | tail -40 ;;
  draft)  # (-v into a file under $OUT: a test cut by the limit still shows which ones ran)
    timeout -k 5 "${TEST_LIMIT:-560}" python3 -m pytest -v -p no:cacheprovider tests/test_fused.py \
      -k "${CHECK_K:-draft or drafter or probe}" -rfE > "$out/draft_tests.txt" 2>&1 || true
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$out/draft_tests.txt" | tail -30 ;;
  draftcost)
    # (under set -e and pipefail a step cut by its timeout would end the script: each ends in || true)
    timeout -k 5 "${FORWARD_LIMIT:-150}" python3 -m benchmarks.gpu.dspark_forward --no-dense --iters "${ITERS:-100}" \
      --out "$out/dspark_forward_h200.json" 2>&1 | grep -v "^INFO" | tail -4 || true
    if [ "${GRAPHS_AB:-0}" = 1 ]; then  # the same with MLX-CUDA's CUDA graphs (docs/kernels.md)
      MLX_USE_CUDA_GRAPHS=1 timeout -k 5 200 python3 -m benchmarks.gpu.dspark_forward --no-dense \
        --iters "${ITERS:-100}" --out "$out/dspark_forward_h200_graphs.json" 2>&1 | grep -v "^INFO" | tail -4 || true
    fi
    # (the engine's start-up calibration alone took over 85 s on a fresh H100)
    # ROWS_AB=1: the same forced cycles with the 16-row draft kernel after the default 8-row one
    # (SPECSERVE_DRAFT_KERNEL_ROWS; docs/kernels.md, "Fused DSpark draft")
    # VOCAB_AB=1: again with the whole vocabulary (SPECSERVE_DSPARK_DRAFT_VOCAB=0) instead of the
    # drafter's draft vocabulary
    for run in 8:on $([ "${VOCAB_AB:-0}" = 1 ] && echo 8:off) $([ "${ROWS_AB:-0}" = 1 ] && echo 16:on); do
      rows=${run%%:*}; vocab=${run##*:}
      timeout -k 5 "${COST_LIMIT:-250}" python3 -m benchmarks.dspark_cost --workloads novel_code,novel_chat --cycles 30 \
        --draft-kernel-rows "$rows" --draft-vocab "$vocab" ${DRAFTER:+--drafter "$DRAFTER"} \
        --out "$out/dspark_cost_h200$([ "$rows" = 16 ] && echo _rows16)$([ "$vocab" = off ] && echo _whole).json" \
        2>&1 | grep -v "^INFO" | tail -12 || true
    done ;;
  mma)
    [ "${SKIP_CHECK:-0}" = 1 ] ||
      python3 benchmarks/kernel_check.py --out "$out/kernel_check_mma.json" -k "${CHECK_K:-const_shape or tiles_and}" 2>&1 | tail -20
    sweep=(--shapes "${SHAPES:-4096x4096:64,14336x4096:64}" --rows "${ROWS:-1,8,16}")
    if [ -n "${CONFIGS:-}" ]; then sweep+=(--configs="$CONFIGS")
    else sweep+=(--wk "${WK:-8,16}" --nt "${NT:-1,2}" --u "${U:-1,2,4}"); fi
    timeout -k 5 "${NCU_LIMIT:-420}" ncu --clock-control none --kernel-name regex:"qmv|qmm|specserve" \
      --metrics gpu__time_duration.sum --csv --log-file "$out/mma_ncu.csv" \
      python3 benchmarks/gpu/mma_sweep.py --ncu --launches "${LAUNCHES:-6}" "${sweep[@]}" > "$out/mma_order.txt" 2>&1 || true
    python3 benchmarks/gpu/mma_sweep.py --parse "$out/mma_ncu.csv" --order "$out/mma_order.txt" \
      --out "$out/mma_ncu.json" 2>&1 | tail -40 ;;
  rows)
    shapes=${SHAPES:-4096x4096:64,6144x4096:64,28672x4096:64,4096x14336:64,128256x4096:64}
    c8=${CONFIGS8:-"-1,1,1,1,0,0;-1,2,1,1,0,0;-1,1,2,1,1,2;-1,2,2,1,1,2;-1,2,2,1,1,0;-1,1,2,1,1,2,-1,0,256;-1,2,1,1,0,0,-1,0,256;-1,1,1,1,0,0,1;-1,1,1,1,0,0,-1,0,256"}
    c16=${CONFIGS16:-"-1,1,1,1,0,0;-1,2,1,1,0,0;-1,1,2,1,1,2;-1,2,2,1,1,0;-1,1,2,1,1,2,-1,0,256;-1,2,1,1,0,0,-1,0,256;-1,1,1,1,0,0,1"}
    for r in 8 16; do
      [ "$r" = 8 ] && cfgs=$c8 || cfgs=$c16
      timeout -k 5 "${NCU_LIMIT:-240}" ncu --clock-control none --kernel-name regex:"qmv|qmm|specserve" \
        --metrics gpu__time_duration.sum --csv --log-file "$out/mma_ncu_rows$r.csv" \
        python3 benchmarks/gpu/mma_sweep.py --ncu --launches "${LAUNCHES:-7}" --shapes "$shapes" --rows "$r" \
        --configs="$cfgs" > "$out/mma_order_rows$r.txt" 2>&1 || true
      python3 benchmarks/gpu/mma_sweep.py --parse "$out/mma_ncu_rows$r.csv" --order "$out/mma_order_rows$r.txt" \
        --out "$out/mma_ncu_rows$r.json" 2>&1 | tail -30
    done
    python3 benchmarks/gpu/mma_sweep.py --pick "$out/mma_ncu_rows8.json,$out/mma_ncu_rows16.json" \
      --margin "${MARGIN:-0.03}" --out "$out/mma_picks.json" && cp "$out/mma_picks.json" /root/mma_picks.json ;;
  stack)
    picks=(); [ -f /root/mma_picks.json ] && picks=(--mma-configs /root/mma_picks.json)
    python3 benchmarks/verify_cost.py --parts llama8b --compiled --rounds "${ROUNDS:-7}" --reps "${REPS:-5}" \
      --attention mlx "${picks[@]}" --out "$out/verify_cost_stack${TAG:-}.json" 2>&1 | tail -40 ;;
  *) echo "usage: $0 cal|spec|verify|check|checkpar|attn|overhead|probe|fused|draft|draftcost|mma|rows|stack" >&2; exit 2 ;;
esac
