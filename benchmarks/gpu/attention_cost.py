"""Row-attention kernel vs MLX's attention on the GPU: time per layer call (us) for 1 and k rows.

For each context S and row count L, a graph of --calls independent calls (shape of the default
model: 9 query heads, 3 KV heads, head dim 64, float32) is built and evaluated; the median over
--reps gives microseconds per call. ``mlx`` is ``mx.fast.scaled_dot_product_attention`` (one call,
causal for L > 1), ``mlx_rows`` is the engine's row-by-row path (L calls), ``kernel`` is
metal_kernels.attention.row_attention (one call).

    python benchmarks/gpu/attention_cost.py [--out attention_cost.json]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

from metal_kernels.attention import row_attention


def timed(fn, calls, reps):
    mx.eval([fn() for _ in range(calls)])
    ts = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        mx.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / calls * 1e6


def measure(s: int, n: int, calls: int, reps: int) -> dict:
    """Microseconds per call of each path for ``n`` new rows over a cache of ``s + n`` keys."""
    kbuf = mx.random.normal((1, 3, s + n + 64, 64))
    vbuf = mx.random.normal((1, 3, s + n + 64, 64))
    k, v = kbuf[:, :, :s + n], vbuf[:, :, :s + n]  # cache views, as mlx-lm's KVCache returns them
    q = mx.random.normal((1, 9, n, 64))
    mx.eval(k, v, q)
    sc = 64 ** -0.5

    def mlx():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=sc, mask="causal" if n > 1 else None)

    def mlx_rows():
        return mx.concatenate([mx.fast.scaled_dot_product_attention(
            q[:, :, i:i + 1], k[:, :, :s + i + 1], v[:, :, :s + i + 1], scale=sc) for i in range(n)], axis=2)

    def kernel():
        return row_attention(q, k, v, sc)

    return {name: timed(fn, calls, reps) for name, fn in (("mlx", mlx), ("mlx_rows", mlx_rows), ("kernel", kernel))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_cost.json")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for s in (128, 1024):
        for n in (1, 4, 8):
            r = {"context": s, "rows": n, **measure(s, n, args.calls, args.reps)}
            rows.append(r)
            print(json.dumps({a: round(b, 2) if isinstance(b, float) else b for a, b in r.items()}), flush=True)
    json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
