"""Start-up calibration of the default model per activation dtype, metal_kernels off and on (GPU).

Prints, per configuration, the widest exact verify pass and the verify cost curve T(k); writes
$OUT/kernels_model.json. Configurations: ``quantized`` (float32 activations) with MLX's own
matmul; ``quantized-bfloat16`` with MLX's own matmul and with the small-batch kernels. Run on
the H200 after staging (benchmarks/gpu/kernels_h200.sh).
"""

import json
import os
import time

from engine.loader import load_target  # engine first: OpenBLAS before mlx.core
from engine.runner import TargetRunner
from metal_kernels import patch_model

CONFIGS = [c.split(":") for c in os.environ.get(
    "CONFIGS", "quantized:off,quantized-bfloat16:off,quantized-bfloat16:auto").split(",")]
out = {}
for weights, mode in CONFIGS:
    loaded = load_target("default", weights=weights)
    report = patch_model(loaded.model, mode=mode)
    runner = TargetRunner(loaded.model)
    start = time.time()
    cal = runner.calibrate(49152, max_rows=16, contexts=(48, 1100), max_context=8192)
    key = f"{weights}/kernels_{mode}"
    out[key] = {"patch": report.summary(), **cal.summary(), "seconds": time.time() - start}
    print(key, json.dumps(out[key]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "kernels_model.json"), "w") as f:
        json.dump(out, f, indent=1)
