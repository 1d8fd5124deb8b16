"""Are MLX's non-matmul ops row-independent? RoPE, RMSNorm and an elementwise chain, GPU or CPU.

Greedy speculative decoding needs row ``i`` of a k-row verify pass to equal a one-row decode
step bit for bit. The matmuls (metal_kernels/) and attention (engine/exact_attention.py,
metal_kernels/attention.py) are made so; this checks the other per-row ops of a Llama layer
the same way: each op on ``L`` rows against ``L`` one-row calls, ``L`` = 2..16, float32 and
bfloat16, RoPE at offsets 0..63, 1000..1099, 2047 and 4095 (the default model's shapes: 9
heads of 64, hidden 576). Prints and writes the number of mismatching cases per op.

    python benchmarks/gpu/row_invariance.py [--out row_invariance.json]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

OFFSETS = list(range(64)) + list(range(1000, 1100)) + [2047, 4095]
WIDTHS = (2, 3, 5, 8, 9, 10, 16)


def _rope(x, offset):
    return mx.fast.rope(x, 64, traditional=False, base=100000.0, scale=1.0, offset=offset)


def check(dtype) -> dict:
    mx.random.seed(0)
    bad = {"rope": 0, "rms_norm": 0, "elementwise": 0}
    x = mx.random.normal((1, 9, 16, 64)).astype(dtype)
    for off in OFFSETS:
        for n in WIDTHS:
            full = _rope(x[:, :, :n], off)
            rows = mx.concatenate([_rope(x[:, :, i:i + 1], off + i) for i in range(n)], axis=2)
            bad["rope"] += not mx.array_equal(full, rows).item()
    h = mx.random.normal((16, 576)).astype(dtype)
    w = mx.random.normal((576,)).astype(dtype)
    for n in range(2, 17):
        full = mx.fast.rms_norm(h[:n], w, 1e-5)
        rows = mx.concatenate([mx.fast.rms_norm(h[i:i + 1], w, 1e-5) for i in range(n)])
        bad["rms_norm"] += not mx.array_equal(full, rows).item()
        full = h[:n] * mx.sigmoid(h[:n]) * h[:n]
        rows = mx.concatenate([h[i:i + 1] * mx.sigmoid(h[i:i + 1]) * h[i:i + 1] for i in range(n)])
        bad["elementwise"] += not mx.array_equal(full, rows).item()
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="row_invariance.json")
    args = ap.parse_args()
    res = {"device": str(mx.default_device()), "mlx": mx.__version__}
    for name in ("bfloat16", "float32"):
        res[name] = check(getattr(mx, name))
        print(name, res[name], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
