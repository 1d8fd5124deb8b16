"""Where a quantized matmul's time goes on MLX-CUDA: host graph building vs evaluation.

For each case, builds a graph of --calls independent matmuls (Python + MLX op construction,
no evaluation: ``build``), then evaluates it (``eval``: encoding, launches and device work).
Cases: ``mx.quantized_matmul`` and ``metal_kernels.quantized_matmul`` on the default model's
projection shapes and on 4096x4096 / 14336x4096, at M = 1, 8, 16 rows and float32 / bfloat16
activations; plus three trivial kernels that isolate the custom-kernel call itself (short
source, the qmv kernel's 15 KB of source, and ``mx.fast.precompiled_cuda_kernel`` on the cubin
MLX cached for the short one). ``--ncu`` runs only the matmuls, once each after warm-up, for
``ncu --metrics gpu__time_duration.sum`` (device time per kernel, launch order = case order).

    python benchmarks/gpu/kernel_overhead.py --out kernel_overhead.json [--calls 256]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

import mlx.core as mx

from metal_kernels import qmv

SMOLLM = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))
BIG = ((4096, 4096), (14336, 4096))


def _timed(build, reps):
    """Median (build seconds, eval seconds) of ``reps`` runs of build() then mx.eval."""
    mx.eval(build())
    mx.synchronize()
    b, e = [], []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = build()
        t1 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t2 = time.perf_counter()
        b.append(t1 - t0)
        e.append(t2 - t1)
    return statistics.median(b), statistics.median(e)


def _weights(n, k, gs, count, dtype):
    sets = []
    for i in range(count):
        mx.random.seed(i)
        sets.append(mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=gs, bits=4))
    mx.eval(sets)
    return sets


def _shapes(args):
    """(dtype name, dtype, N, K, group size) per case: group 32 on the default model's shapes."""
    for dtname in args.dtypes.split(","):
        for n, k in SMOLLM + BIG:
            yield dtname, getattr(mx, dtname), n, k, 32 if (n, k) in SMOLLM else 64


def matmul_cases(args):
    rows = []
    for dtname, dt, n, k, gs in _shapes(args):
        count = 1 if (n, k) in SMOLLM else 16  # big shapes: 16 weight sets, not in L2
        sets = _weights(n, k, gs, count, dt)
        for m in (1, 8, 16):
            x = mx.random.normal((m, k)).astype(dt)
            mx.eval(x)
            for path in ("mlx", "kernel"):
                kern = "off" if path == "mlx" else "auto"
                calls = args.calls if count == 1 else count

                def build(x=x, kern=kern, calls=calls, sets=sets, gs=gs):
                    return [qmv.quantized_matmul(x, *sets[i % len(sets)], gs, 4, kernels=kern)
                            for i in range(calls)]
                b, e = _timed(build, args.reps)
                p = qmv.plan(m, n, k, 4, gs, dt) if path == "kernel" else None
                rows.append({"dtype": dtname, "shape": f"{n}x{k}", "m": m, "path": path,
                             "kind": p.kind if p else "mlx", "calls": calls,
                             "build_us": b / calls * 1e6, "eval_us": e / calls * 1e6})
                r = rows[-1]
                print(f"{dtname:9} {r['shape']:>11} m={m:<2} {path:6} {r['kind']:4} "
                      f"build {r['build_us']:7.2f} us  eval {r['eval_us']:7.2f} us", flush=True)
        del sets
        mx.clear_cache()
    return rows


_TRIVIAL = "if (threadIdx.x == 0 && blockIdx.x == 0) { y[0] = x[0]; }"


def trivial_cases(args):
    """The custom-kernel call itself: short source, 15 KB source, precompiled cubin."""
    x = mx.ones((4,), dtype=mx.float32)
    mx.eval(x)
    out = []
    short = mx.fast.cuda_kernel(name="ss_trivial_short", input_names=["x"], output_names=["y"],
                                source=_TRIVIAL)
    pad = "// " + "x" * 76 + "\n"
    long_ = mx.fast.cuda_kernel(name="ss_trivial_long", input_names=["x"], output_names=["y"],
                                source=_TRIVIAL, header=pad * 200)

    def call(kern):
        return kern(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(4,)],
                    output_dtypes=[mx.float32])[0]
    for name, kern in (("cuda_kernel_short", short), ("cuda_kernel_15kb", long_)):
        b, e = _timed(lambda kern=kern: [call(kern) for _ in range(args.calls)], args.reps)
        out.append({"case": name, "build_us": b / args.calls * 1e6, "eval_us": e / args.calls * 1e6})
        print(out[-1], flush=True)
    # MLX cached the short kernel's compiled module on disk: reuse it as a precompiled kernel.
    cache = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join("/tmp", "mlx", mx.__version__, "ptx")
    txts = glob.glob(os.path.join(cache, "custom_kernel_ss_trivial_short*.txt"))
    if not txts:
        out.append({"case": "precompiled", "error": f"no cached module in {cache}"})
        return out
    base = txts[0][:-4]
    mangled = open(txts[0]).read().split("\t")[1].strip()
    cubin = open(base + ".ptx", "rb").read()
    first = [True]

    def pre():
        src = cubin if first[0] else b""
        first[0] = False
        return mx.fast.precompiled_cuda_kernel(
            name=mangled, compiled_source=src, inputs=[x], output_shapes=[(4,)],
            output_dtypes=[mx.float32], scalars=[], grid=(32, 1, 1), threadgroup=(32, 1, 1))[0]
    try:
        b, e = _timed(lambda: [pre() for _ in range(args.calls)], args.reps)
        out.append({"case": "precompiled_empty_source_after_first", "build_us": b / args.calls * 1e6,
                    "eval_us": e / args.calls * 1e6, "cubin_bytes": len(cubin)})
    except Exception as exc:  # noqa: BLE001 - report, keep the other numbers
        out.append({"case": "precompiled", "error": repr(exc)})
    print(out[-1], flush=True)
    # A plain MLX op for scale: y = x + 1.
    b, e = _timed(lambda: [x + 1 for _ in range(args.calls)], args.reps)
    out.append({"case": "mlx_add", "build_us": b / args.calls * 1e6, "eval_us": e / args.calls * 1e6})
    print(out[-1], flush=True)
    return out


def ncu_run(args):
    """One launch per case after warm-up (device times come from ncu's CSV)."""
    order = []
    for dtname, dt, n, k, gs in _shapes(args):
        w = _weights(n, k, gs, 1, dt)[0]
        for m in (1, 2, 4, 8, 16):
            x = mx.random.normal((m, k)).astype(dt)
            mx.eval(x)
            for path in ("mlx", "kernel"):
                kern = "off" if path == "mlx" else "auto"
                for _ in range(2):
                    mx.eval(qmv.quantized_matmul(x, *w, gs, 4, kernels=kern))
                mx.synchronize()
                order.append(f"{dtname},{n}x{k},{m},{path}")
    print("NCU_ORDER " + json.dumps(order), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="kernel_overhead.json")
    ap.add_argument("--calls", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    if args.ncu:
        ncu_run(args)
        return
    res = {"mlx": mx.__version__, "calls": args.calls}
    res["trivial"] = trivial_cases(args)
    res["matmul"] = matmul_cases(args)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
