"""MLX's attention over a static KV cache: microseconds per layer call by mask form and row count.

A compiled pass over ``engine.static_cache.StaticCache`` attends over the whole buffer
(``capacity`` keys) under a mask built from the write position, where an eager pass attends over
exactly the filled keys with no mask. This times ``mx.fast.scaled_dot_product_attention`` for
``L`` query rows (8B Llama shapes: 32 query heads, 8 KV heads of 128, bfloat16) five ways:

- ``bool_cap``: bool mask ``[L, capacity]`` over the whole buffer (the static cache before the
  twentieth session);
- ``float_cap``: the same mask as 0 / -inf in the activation dtype (the static cache now);
- ``bool_sliced``: bool mask over exactly the filled keys;
- ``causal_sliced``: the eager pass's call (filled keys, ``"causal"`` for L > 1, no mask for 1);
- ``manual``: unfused matmul / softmax / matmul, what a fallback computes.

Each figure is the median over --reps of a graph of --calls independent calls, per call.

    python benchmarks/gpu/attention_mask_cost.py [--out attention_mask_cost.json]
"""

import argparse
import json

import mlx.core as mx

from benchmarks.gpu.attention_cost import timed


def measure(rows: int, context: int, capacity: int, heads=32, kv_heads=8, dim=128, dtype=mx.bfloat16,
            calls=32, reps=9) -> dict:
    """Microseconds per call of each mask form for ``rows`` query rows at ``context`` filled keys."""
    k = mx.random.normal((1, kv_heads, capacity, dim)).astype(dtype)
    v = mx.random.normal((1, kv_heads, capacity, dim)).astype(dtype)
    q = mx.random.normal((1, heads, rows, dim)).astype(dtype)
    positions = context + mx.arange(rows, dtype=mx.int32)
    visible = mx.arange(capacity, dtype=mx.int32)[None] <= positions[:, None]
    additive = mx.where(visible, mx.array(0, dtype), mx.array(-mx.inf, dtype))
    ks, vs = k[:, :, : context + rows], v[:, :, : context + rows]
    mx.eval(k, v, q, visible, additive, ks, vs)
    scale = dim**-0.5
    rep = heads // kv_heads
    sdpa = mx.fast.scaled_dot_product_attention

    def manual():
        grouped = q.reshape(1, kv_heads, rep * rows, dim)
        scores = (grouped * scale) @ k.swapaxes(-1, -2)
        mask = mx.broadcast_to(visible[None], (rep, rows, capacity)).reshape(rep * rows, capacity)
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
        probs = mx.softmax(scores.astype(mx.float32), axis=-1).astype(dtype)
        return (probs @ v).reshape(1, heads, rows, dim)

    return {
        "bool_cap": timed(lambda: sdpa(q, k, v, scale=scale, mask=visible), calls, reps),
        "float_cap": timed(lambda: sdpa(q, k, v, scale=scale, mask=additive), calls, reps),
        "bool_sliced": timed(lambda: sdpa(q, ks, vs, scale=scale, mask=visible[:, : context + rows]),
                             calls, reps),
        "causal_sliced": timed(lambda: sdpa(q, ks, vs, scale=scale, mask="causal" if rows > 1 else None),
                               calls, reps),
        "manual": timed(manual, calls, reps),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = {"mlx": mx.__version__, "device": str(mx.default_device()), "context": args.context,
              "capacity": args.capacity, "us_per_call": {}}
    for n in (int(r) for r in args.rows.split(",")):
        row = measure(n, args.context, args.capacity, calls=args.calls, reps=args.reps)
        result["us_per_call"][n] = row
        print(n, {name: round(us, 1) for name, us in row.items()}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
