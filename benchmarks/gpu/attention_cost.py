"""Row-attention kernel vs MLX's attention on the GPU: microseconds per layer call for L new rows.

For each shape (heads, KV heads, head dim, dtype), context S and row count L, a graph of
--calls independent calls is built and evaluated; the median over --reps gives microseconds per
call. Paths: ``mlx`` is ``mx.fast.scaled_dot_product_attention`` (one call, causal for L > 1:
fast, but its rows are not bit-identical to one-row calls), ``mlx_rows`` the engine's
row-by-row path (L calls of one row), ``kernel_wN`` metal_kernels.attention.row_attention with
N warps per block (one call; N = 8 is the engine's). Shapes: the default model's (9/3 heads of
64, float32) and an 8B Llama's (32/8 heads of 128, bfloat16).

    python benchmarks/gpu/attention_cost.py [--out attention_cost.json]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

from metal_kernels.attention import row_attention

SHAPES = {"smollm-fp32": (9, 3, 64, mx.float32), "llama8b-bf16": (32, 8, 128, mx.bfloat16)}


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


def measure(shape: str, s: int, n: int, calls: int, reps: int, warps: list[int]) -> dict:
    """Microseconds per call of each path for ``n`` new rows over a cache of ``s + n`` keys."""
    h, kv, d, dt = SHAPES[shape]
    kbuf = mx.random.normal((1, kv, s + n + 64, d)).astype(dt)
    vbuf = mx.random.normal((1, kv, s + n + 64, d)).astype(dt)
    k, v = kbuf[:, :, :s + n], vbuf[:, :, :s + n]  # cache views, as mlx-lm's KVCache returns them
    q = mx.random.normal((1, n, h, d)).astype(dt).transpose(0, 2, 1, 3)  # strided, as in mlx-lm
    mx.eval(k, v, q)
    sc = d ** -0.5
    paths = {
        "mlx": lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=sc, mask="causal" if n > 1 else None),
        "mlx_rows": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=sc) if n == 1 else mx.concatenate(
            [mx.fast.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :s + i + 1], v[:, :, :s + i + 1], scale=sc)
             for i in range(n)], axis=2),  # (what engine/exact_attention.py calls)
    }
    for w in warps:
        paths[f"kernel_w{w}"] = lambda w=w: row_attention(q, k, v, sc, warps=w)
    return {name: timed(fn, calls, reps) for name, fn in paths.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_cost.json")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--rows", default="1,2,4,8,9,12,16")
    ap.add_argument("--warps", default="4,8,16")
    args = ap.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    rows = []
    for shape in SHAPES:
        for s in map(int, args.contexts.split(",")):
            for n in map(int, args.rows.split(",")):
                r = {"shape": shape, "context": s, "rows": n, **measure(shape, s, n, args.calls, args.reps, warps)}
                rows.append(r)
                print(json.dumps({a: round(b, 2) if isinstance(b, float) else b for a, b in r.items()}), flush=True)
                json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
