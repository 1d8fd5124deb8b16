#!/usr/bin/env bash
# Runs on the lent H200 (MLX-CUDA), from the repository root, after the staged parts were
# copied into /root/s (see docs/benchmarks.md, "Reproducing the GPU numbers"). Each phase fits
# in one bounded device call; state lives in /root (kept while the machine stays warm).
#   h200_session.sh gen   BUDGET_S   # self-distillation data for the DSpark drafter (resumable;
#                                    # the trainer builds and shuffles the prompt set, with
#                                    # self-instruct questions when N_SELF > 0; seeded from staged
#                                    # files/examples.jsonl.gz + prompts.jsonl.gz when present;
#                                    # data comes back gzipped in $OUT)
#   h200_session.sh throughput       # generation and training speed per target weight policy
#                                    # (benchmarks/gpu/dspark_throughput.py; POLICIES, SHAPES)
#   h200_session.sh probe            # 12 training steps on a copy of the data: seconds per step
#   h200_session.sh train STEPS BUDGET_S  # train, export (4-bit) and, when EVAL_N > 0, evaluate on
#                                    # held-out prompts (else: benchmarks/dspark_eval.py --run-prompts)
#   h200_session.sh merge            # add a staged earlier run's data (files/base_examples.jsonl.gz,
#                                    # files/base_prompts.jsonl.gz) to this run's (after `gen` with
#                                    # another SEED): benchmarks/gpu/merge_dspark_data.py
#   h200_session.sh cost             # a DSpark forward's cost: forced cycles, by new context rows
#   h200_session.sh probecheck       # DSpark's state and drafts at auto's probes vs forced cycles
#   h200_session.sh bench            # plain / prompt lookup / DSpark / auto on every workload
# Results go to $OUT (JSON, the exported drafter, logs).
# Staging (forty-first session): PART_MB=36 ../shared/tools/stage-for-gpu.sh --pip mlx-lm==0.32.2
#   SmolLM2-135M-Instruct.Q4_1.gguf llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl gives six
#   parts; with the ~27 MB checkout a part must stay under ~36 MB (a call carries 64 MiB in all).
#   benchmarks/gpu/stage_parts.sh repacks them into four (the drafter staged as a file).
#   Nothing under .dev/ is sure to outlive a session (the forty-second found the forty-first's data and
#   merged it: `merge`); plan each GPU session to regenerate what it trains on.
set -euo pipefail
stage=/root/s
if [ -d "$stage" ] && [ ! -d /tmp/site/mlx ]; then
  (cd "$stage" && cat part_* | tar x && rm -f part_* &&
   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl $(ls files/*.whl 2>/dev/null))
fi
root=${ROOT:-/root}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECSERVE_CACHE_DIR=${SPECSERVE_CACHE_DIR:-$root/cache}
mkdir -p "$SPECSERVE_CACHE_DIR/models" && cp -n "$stage"/files/*.gguf "$SPECSERVE_CACHE_DIR/models/" 2>/dev/null || true
out=${OUT:-/tmp/out}; mkdir -p "$out"
run=$root/dspark-run
# One drafter recipe (dspark.md section 4): 3 layers (LAYERS), 5 taps, block 7, Markov rank
# 128 (RANK). The defaults are v3's run (docs/benchmarks.md): a bfloat16 target for generation and training,
# self-instruct questions, package code from the staged site directory (CODE_ROOTS); HumanEval
# is not staged (HUMANEVAL=1 if it is; evaluate on a CPU with dspark_eval.py --run-prompts).
# INIT=target starts a new drafter from the target's last layers (docs/dspark.md, Initialisation);
# INIT=<drafter dir> trains a saved drafter further (its architecture; a fresh AdamW and cosine
# schedule at LR), e.g. v8 carried as .dev/v8 and copied to /root/v8: INIT=/root/v8 LR=2e-4.
# TAPS: the tapped target layers of a new drafter (comma-separated; default 1,8,14,20,27 for the
# default target's 30 layers; 28 is the deepest allowed, the last is refused as DeepSpec refuses
# it: the "later taps" lever is e.g. TAPS=1,8,14,21,28 LAYERS=7 RANK=64 INIT=target); with
# INIT=<drafter dir>, the saved drafter's taps plus new ones, which start at zero weight
# (widen_taps), e.g. TAPS=1,8,14,20,24,27,28 INIT=/root/v11.
# GEN_TEMP / GEN_TOP_P: sampled training responses instead of greedy ones (the "sampled
# responses" lever; the target's own distribution, as DSpark serves sampled requests too).
# CE / L1: the loss weights of the cross-entropy on the data tokens and of L1(draft, target)
# (train only; default 0.1 / 0.9, dspark.md section 6).
# QAT=N: the last N training steps are quantization-aware (they train through the export's
# rounding; docs/dspark.md, Export); GROUP: the export's weights per 4-bit group (default 64;
# 32 is finer: v11's shape is 20.5 MB at 32 against 18.4 MB at 64). Train only. With INIT=<drafter>,
# QAT=STEPS makes the whole continuation quantization-aware (the last steps of a cosine schedule
# have little learning rate left to adapt the weights to the grid).
# MICRO=2 splits each step's 64 sequences into two passes: the same gradient in about half the
# activation memory (7 layers at 64 x 1,024 tokens ran out of an H100's 80 GB in v8's run).
recipe=(--target default --layers "${LAYERS:-3}" --block-size 7 --markov-rank "${RANK:-128}"
        ${TAPS:+--target-layer-ids "$TAPS"}
        --n-code "${N_CODE:-10000}" --n-instruct "${N_INSTRUCT:-4000}" --max-new-tokens "${MAX_NEW:-256}"
        --n-self-instruct "${N_SELF:-12000}" --code-per-file "${CODE_PER_FILE:-8}"
        --gen-temperature "${GEN_TEMP:-0}" --gen-top-p "${GEN_TOP_P:-1}"
        $(for r in ${CODE_ROOTS-/tmp/site}; do printf -- '--code-root %s ' "$r"; done)
        --target-weights "${TARGET_WEIGHTS:-bfloat16}" $([ "${HUMANEVAL:-0}" = 1 ] || echo --no-humaneval)
        --gen-batch-size "${GEN_BATCH:-1024}" --gen-shard-size "${GEN_SHARD:-1024}"
        --batch-size "${BATCH:-64}" --micro-batches "${MICRO:-1}" --num-anchors "${ANCHORS:-64}" --max-seq-len 1024 --lr "${LR:-6e-4}" --save-every 200
        --eval-per-source "${EVAL_N:-0}" --eval-max-new-tokens 128 --seed "${SEED:-0}" --no-progress
        --init "${INIT:-random}")
train_dspark() {
  python3 -c "import sys; from server.cli import train_dspark; sys.exit(train_dspark(sys.argv[1:]))" "${recipe[@]}" "$@"
}
case "$1" in
  gen)
    start=$(date +%s)
    mkdir -p "$run/data"
    if [ -f "$stage/files/examples.jsonl.gz" ] && [ ! -f "$run/data/examples.jsonl" ]; then
      gunzip -c "$stage/files/examples.jsonl.gz" > "$run/data/examples.jsonl"
      gunzip -c "$stage/files/prompts.jsonl.gz" > "$run/data/prompts.jsonl"
      echo "seeded $run/data from staged data"
    fi
    if [ -f "$stage/files/self_instruct.jsonl.gz" ] && [ ! -f "$run/data/self_instruct.jsonl" ]; then
      gunzip -c "$stage/files/self_instruct.jsonl.gz" > "$run/data/self_instruct.jsonl"
    fi
    rc=0; train_dspark --out "$run" --generate-only --time-budget "$2" --steps 1 || rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 3 ]; then echo "gen failed (rc $rc)"; exit "$rc"; fi  # 3: budget
    if [ ! -f "$run/data/prompts.jsonl" ]; then  # out of time while the target wrote questions
      gzip -c "$run/data/self_instruct.jsonl" > "$out/self_instruct.jsonl.gz" 2>/dev/null || true
      echo "self-instruct questions unfinished (in \$OUT/self_instruct.jsonl.gz; stage it as"
      echo "files/self_instruct.jsonl.gz on a new machine): rerun gen"; exit 3
    fi
    if [ ! -f "$run/data/examples.jsonl" ]; then  # out of time: keep the finished shards only
      python3 - "$run/data" "${GEN_SHARD:-1024}" <<'EOF'
import json, pathlib, sys
data, size = pathlib.Path(sys.argv[1]), int(sys.argv[2])
done = 0
while (data / "shards" / f"shard-{done:05d}.jsonl").exists():
    done += 1
if done == 0:
    sys.exit("no shard finished: rerun gen (the prompt set is kept)")
rows = [json.loads(line) for line in open(data / "prompts.jsonl")]
train = [r for r in rows if r["split"] == "train"][: done * size]
keep = {id(r) for r in train}
with open(data / "prompts.jsonl", "w") as fh:
    fh.writelines(json.dumps(r) + "\n" for r in rows if r["split"] == "eval" or id(r) in keep)
print(f"kept {len(train)} train prompts ({done} shards)")
EOF
      train_dspark --out "$run" --generate-only --steps 1
    fi
    echo "gen wall: $(( $(date +%s) - start )) s"
    gzip -c "$run/data/examples.jsonl" > "$out/examples.jsonl.gz"
    gzip -c "$run/data/prompts.jsonl" > "$out/prompts.jsonl.gz"
    python3 - "$run" "$out/gen_summary.json" <<'EOF'
import json, sys, pathlib
rows = [json.loads(l) for l in open(pathlib.Path(sys.argv[1]) / "data" / "examples.jsonl")]
train = [r for r in rows if r["split"] == "train"]
summary = {"train_rows": len(train), "eval_rows": len(rows) - len(train),
           "response_tokens": sum(len(r["response"]) for r in train),
           "prompt_tokens": sum(len(r["prompt"]) for r in train)}
print(summary); json.dump(summary, open(sys.argv[2], "w"))
EOF
    ;;
  throughput)
    python3 -m benchmarks.gpu.dspark_throughput --policies "${POLICIES:-quantized,bfloat16}" \
      --train-shapes "${SHAPES:-16x256,64x64}" --train-steps 5 --out "$out/dspark_throughput_h200.json"
    ;;
  probe)
    rm -rf $root/dspark-probe && mkdir -p $root/dspark-probe/data
    cp "$run"/data/examples.jsonl "$run"/data/prompts.jsonl $root/dspark-probe/data/
    train_dspark --out $root/dspark-probe --steps 12 --eval-per-source 0 --export-bits 0 || true
    python3 -c "
import json; rows=[json.loads(l) for l in open('$root/dspark-probe/train_log.jsonl')]
a, b = rows[1], rows[-1]
print('seconds per step (after the first):', (b['elapsed_s']-a['elapsed_s'])/(b['step']-a['step']))" | tee "$out/probe.txt"
    ;;
  train)
    train_dspark --out "$run" --steps "$2" --time-budget "$3" ${CE:+--ce-weight "$CE"} ${L1:+--l1-weight "$L1"} \
      ${QAT:+--qat-steps "$QAT"} ${GROUP:+--export-group-size "$GROUP"} || true
    mkdir -p "$out/drafter"
    cp "$run"/drafter-q4/* "$out/drafter/" 2>/dev/null || true
    # (a file over 16 MiB does not come back from the device: join the parts with
    # `cat model.safetensors.part_* > model.safetensors` and check model.safetensors.sha256)
    for f in "$out"/drafter/*.safetensors; do
      if [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt $((15 << 20)) ]; then
        (cd "$out/drafter" && sha256sum "$(basename "$f")" > "$(basename "$f").sha256" &&
         split -b 15M "$(basename "$f")" "$(basename "$f").part_" && rm "$(basename "$f")")
      fi
    done
    cp "$run"/eval.json "$run"/train_log.jsonl "$run"/run_config.json "$out/" 2>/dev/null || true
    ;;
  merge)
    python3 -m benchmarks.gpu.merge_dspark_data --base "$stage/files/base_examples.jsonl.gz" \
      --base-prompts "$stage/files/base_prompts.jsonl.gz" --into "$run/data" --suffix "s${SEED:-0}" \
      --summary "$out/merge_summary.json"
    gzip -c "$run/data/prompts.jsonl" > "$out/prompts.jsonl.gz"
    ;;
  cost)
    # what a DSpark forward costs: forced every cycle (steady and first forwards, break-even
    # acceptance), eager vs compiled, and by new context rows (rows_sweep)
    python3 -m benchmarks.dspark_cost --workloads "${COST_WORKLOADS:-novel_code,novel_chat,agent_session}" \
      --cycles 30 --drafter "${DRAFTER:-$run/drafter-q4}" ${COST_ARGS:-} --out "$out/dspark_cost_h200.json"
    ;;
  probecheck)
    # DSpark's state and drafts at every forward, auto (as it runs, then with every due probe
    # run) against forced every cycle: benchmarks/dspark_probe_check.py
    python3 -m benchmarks.dspark_probe_check --methods auto,dspark@1 --prompts 3 --max-tokens 160 \
      --drafter "${DRAFTER:-$run/drafter-q4}" --out "$out/dspark_probe_check.json"
    python3 -m benchmarks.dspark_probe_check --methods auto --prompts 3 --max-tokens 160 --probe-all \
      --drafter "${DRAFTER:-$run/drafter-q4}" --out "$out/dspark_probe_check_all.json"
    ;;
  bench)
    python3 -m benchmarks.bench_speculative --methods off,prompt_lookup,dspark,auto \
      --dspark-drafter "${DRAFTER:-$run/drafter-q4}" --repeats 1 --max-tokens "${BENCH_TOKENS:-192}" ${BENCH_ARGS:-} \
      --out "$out/spec_h200.json" --plot "$out/spec_h200.png"
    ;;
esac
