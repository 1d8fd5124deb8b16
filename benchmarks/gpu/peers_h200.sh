#!/usr/bin/env bash
# Peer comparison on the lent H200 (MLX-CUDA): specserve (speculation off / auto) against
# mlx_lm.server on the same MLX directory (written by `python -m engine.convert`, 4-bit weights
# as specserve serves them on a GPU), same greedy requests through the openai SDK, request-level
# interleaving (benchmarks/peers/run.py). llama.cpp is not built there, so it is not a peer.
#
# Staging (here, before the GPU window): MLX-CUDA + mlx-lm are always staged; the server and the
# client need these wheels too (the device image has none of them), and the default GGUF:
# (versions as in the CPU venv the script was dry-run with; the rest is in the device image)
#   ../shared/tools/stage-for-gpu.sh --pip fastapi==0.165.0 --pip starlette==1.10.0 \
#     --pip uvicorn==0.54.0 --pip pydantic==2.14.4 --pip pydantic-core==2.50.5 \
#     --pip pydantic-settings==2.16.3 --pip python-dotenv==1.2.4 --pip annotated-types==0.8.0 \
#     --pip typing-inspection==0.4.5 --pip typing-extensions==4.16.0 --pip opentelemetry-api==1.45.2 \
#     --pip openai==3.57.0 --pip jiter==0.19.0 --pip sniffio==1.3.1 --pip httpx2==2.16.2 \
#     --pip httpcore2==2.16.2 --pip truststore==0.10.5 \
#     "$SPECSERVE_CACHE_DIR"/models/SmolLM2-135M-Instruct.Q4_1.gguf
# Run (device, repository root, parts copied into /root/s; about 4 minutes in all):
#   bash benchmarks/gpu/peers_h200.sh [BUDGET_S]     # BUDGET_S: seconds for the rounds (150)
# Writes $OUT/peers_h200.json (+ .png, server logs). Env: PEERS, WORKLOADS, REPEATS (3), MAX_TOKENS (128),
# WEIGHTS (auto = 4-bit on the GPU), PYTHON (python3), SPECSERVE_CACHE_DIR (/root/cache).
# Without /root/s it uses the current Python as is (a CPU dry run:
#   PYTHON=/tmp/venv/bin/python SPECSERVE_CACHE_DIR=/tmp/sscache OUT=/tmp/dry REPEATS=2 \
#   MAX_TOKENS=8 WEIGHTS=quantized bash benchmarks/gpu/peers_h200.sh 60).
set -euo pipefail
stage=/root/s
py=${PYTHON:-python3}
if [ -d "$stage" ] && [ ! -d /tmp/site/mlx ]; then
  (cd "$stage" && cat part_* | tar x && rm -f part_* &&
   "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl $(ls files/*.whl 2>/dev/null))
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SPECSERVE_CACHE_DIR=${SPECSERVE_CACHE_DIR:-/root/cache}
mkdir -p "$SPECSERVE_CACHE_DIR/models" && cp -n "$stage"/files/*.gguf "$SPECSERVE_CACHE_DIR/models/" 2>/dev/null || true
out=${OUT:-/tmp/out}; work=/tmp/specserve-peers-gpu
mkdir -p "$out" "$work" && rm -f "$work"/*.log

# fail in seconds, not minutes, when a wheel was not staged
"$py" - <<'EOF'
import importlib, sys
need = ["mlx.core", "mlx_lm", "fastapi", "uvicorn", "pydantic", "pydantic_settings", "openai",
        "httpx", "prometheus_client", "transformers", "safetensors", "tqdm"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {missing} (stage them: see the header of this script)")
import engine  # noqa: F401  (OpenBLAS before mlx.core, as the entry points do)
import mlx.core as mx
print("device:", mx.default_device(), "| mlx", mx.__version__, flush=True)
EOF

rc=0
timeout -s TERM -k 30 "$(( ${1:-150} + 150 ))" "$py" -m benchmarks.peers.run \
  --peers "${PEERS:-specserve_off,specserve_auto,mlx_lm}" --weights "${WEIGHTS:-auto}" \
  --repeats "${REPEATS:-3}" --max-tokens "${MAX_TOKENS:-128}" --time-budget "${1:-150}" \
  --workloads "${WORKLOADS:-copy,code_edit,agent_turn,novel_code,prose,adversarial}" \
  --workdir "$work" --out "$out/peers_h200.json" --plot "$out/peers_h200.png" || rc=$?
cp "$work"/*.log "$out/" 2>/dev/null || true
if [ "$rc" -ne 0 ] && [ -s "$out/peers_h200.json" ]; then
  # cut short by the timeout: table and chart from the rounds it finished
  "$py" -c "import json, sys; from benchmarks.peers.run import plot, print_table
r = json.load(open(sys.argv[1])); print_table(r); plot(r, sys.argv[2])" "$out/peers_h200.json" "$out/peers_h200.png" || true
fi
exit "$rc"
