"""Start-up calibration of the default model with metal_kernels off and on (GPU).

Prints, per mode, the widest exact verify pass and the verify cost curve T(k); writes
$OUT/kernels_model.json. Run on the H200 after staging (benchmarks/gpu/h200_session.sh).
"""

import json
import os
import time

from engine.loader import load_target  # engine first: OpenBLAS before mlx.core
from engine.runner import TargetRunner
from metal_kernels import patch_model

out = {}
for mode in ("off", "auto"):
    loaded = load_target("default")
    report = patch_model(loaded.model, mode=mode)
    runner = TargetRunner(loaded.model)
    start = time.time()
    cal = runner.calibrate(49152, max_rows=16, contexts=(48, 1100), max_context=8192)
    out[mode] = {"patch": report.summary(), **cal.summary(), "seconds": time.time() - start}
    print(mode, json.dumps(out[mode]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "kernels_model.json"), "w") as f:
        json.dump(out, f, indent=1)
