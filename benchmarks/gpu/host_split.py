"""Where an 8B-shaped 4-bit forward's time goes: graph build on the host vs evaluation.

Issue #4's kernel path (``patch_model``: every projection through the small-batch kernel)
ran the 8B-shaped stack of ``benchmarks/verify_cost.py`` at 8-15 ms per forward, flat in the
row count but noisy from run to run, against 9-10 ms for MLX's own path. This splits one
forward of k tokens (k = 1, 8, 16; KV cache of --context tokens) per path into

- ``build_ms``: the Python forward call that builds the lazy graph (no evaluation);
- ``eval_ms``: ``mx.eval`` of that graph plus ``mx.synchronize`` (host dispatch + device);
- ``pipelined_ms``: per forward over --pipeline forwards issued back to back with
  ``mx.async_eval``, so the host builds forward i+1 while the device runs forward i. The
  steady state is max(host cost, device cost): when it is close to build + eval the forward
  is bound by the host, when it is close to eval alone by the device;
- ``call_build_us``: the build cost of one q_proj call on its own (200 calls; with sibling
  launches each call launches the fused q/k/v kernel, since q's output was already taken).

Paths: ``mlx`` (mlx-lm's modules), ``kernel-unfused`` (``metal_kernels.patch_model(...,
siblings=False)``: one launch per projection) and ``kernel`` (``patch_model``: q/k/v and
gate/up in one launch each, ``metal_kernels.patch.SiblingGroup``; 7 -> 4 launches per layer).
Rounds alternate the path order. JSON to --out.

    python benchmarks/gpu/host_split.py --out host_split.json [--smoke]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx

from benchmarks.verify_cost import _sync, build_model, llama8b_args
from metal_kernels import backend, patch_model, unpatch_model

KS = (1, 8, 16)


def measure(model, cache, k, reps, pipeline):
    toks = mx.random.randint(0, model.args.vocab_size, (1, k))
    mx.eval(toks)
    for _ in range(2):  # warm-up (kernel compiles)
        mx.eval(model(toks, cache=cache))
        for c in cache:
            c.trim(k)
    builds, evals = [], []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        out = model(toks, cache=cache)
        t1 = time.perf_counter()
        mx.eval(out)
        _sync()
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        evals.append(t2 - t1)
        for c in cache:
            c.trim(k)
    _sync()
    t0 = time.perf_counter()
    for _ in range(pipeline):
        out = model(toks, cache=cache)
        mx.async_eval(out)
        for c in cache:
            c.trim(k)
    mx.eval(out)
    _sync()
    piped = (time.perf_counter() - t0) / pipeline
    return {"build_ms": statistics.median(builds) * 1e3, "eval_ms": statistics.median(evals) * 1e3,
            "total_ms": statistics.median([b + e for b, e in zip(builds, evals)]) * 1e3,
            "pipelined_ms": piped * 1e3}


def call_build_us(model, n=200):
    q = model.layers[0].self_attn.q_proj
    x = mx.random.normal((1, 1, model.args.hidden_size)).astype(mx.bfloat16)
    mx.eval(x)
    t0 = time.perf_counter()
    for _ in range(n):
        q(x)
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pipeline", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default="mlx,kernel-unfused,kernel")
    ap.add_argument("--smoke", action="store_true", help="2 layers, small vocabulary (CPU check)")
    args = ap.parse_args(argv)
    from engine import exact_attention
    margs = llama8b_args()
    if args.smoke:  # the 8B widths take minutes to quantize on a CPU
        margs.hidden_size, margs.intermediate_size, margs.head_dim = 512, 1024, 64
        margs.num_attention_heads, margs.num_key_value_heads = 8, 2
    model = build_model(margs, mx.bfloat16, 4, 64, 4, args.smoke)
    exact_attention.install(model)
    cache = exact_attention.make_cache(model)
    mx.random.seed(1)
    mx.eval(model(mx.random.randint(0, model.args.vocab_size, (1, args.context)), cache=cache))
    paths = args.paths.split(",")
    probe = mx.random.randint(0, model.args.vocab_size, (1, 6))
    ref_logits = model(probe).astype(mx.float32)
    result = {"backend": backend(), "mlx": mx.__version__, "platform": platform.platform(),
              "context": args.context, "reps": args.reps, "pipeline": args.pipeline, "rounds": []}
    for r in range(args.rounds):
        order = paths if r % 2 == 0 else paths[::-1]
        rnd = {}
        for path in order:
            if path.startswith("kernel"):
                patch_model(model, "auto", siblings=path == "kernel")
            logits = model(probe).astype(mx.float32)
            rnd[path] = {"call_build_us": call_build_us(model), "logits_max_rel_diff": (
                mx.abs(logits - ref_logits).max() / mx.abs(ref_logits).max()).item()}
            for k in KS:
                rnd[path][str(k)] = measure(model, cache, k, args.reps, args.pipeline)
            if path.startswith("kernel"):
                unpatch_model(model)
            mx.clear_cache()
            line = " ".join(f"k={k}: build {v['build_ms']:.2f} eval {v['eval_ms']:.2f} "
                            f"piped {v['pipelined_ms']:.2f}" for k, v in
                            ((k, rnd[path][str(k)]) for k in KS))
            print(f"round {r} {path:16s} call {rnd[path]['call_build_us']:.1f} us, logits diff "
                  f"{rnd[path]['logits_max_rel_diff']:.1e} | {line}", flush=True)
        result["rounds"].append(rnd)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
