"""Verify cost T(k)/T(1), k = 1..16, for the small-batch kernels against MLX's own path.

Three parts, kernel vs ``mx.quantized_matmul`` in one run:

- ``matrices``: single 4-bit (group 64) matrices 4096x4096 and 14336x4096 (N x K); each
  timed graph runs the matmul over 32 distinct weight sets so L2 never holds them; time is
  per matmul. Effective bandwidth = packed weight + scale + bias bytes / time.
- ``llama8b``: an 8B-shaped random-weight Llama from mlx-lm's classes (hidden 4096, 32
  layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256), quantized with ``nn.quantize``
  (4-bit, group 64). T(k) = one forward of k tokens on a KV cache holding --context tokens
  (the cache is trimmed back after each pass). Attention is MLX's (batched), and on CUDA
  also the row-attention kernel in every pass (``--attention``), the engine's exact path.
  ``--compiled`` also times both matmul paths through the engine's compiled passes
  (``mx.compile`` over a static KV cache: no Python graph build per pass; batched attention,
  the engine's ``SPECSERVE_EXACT_VERIFY=batched``).
- ``smollm``: random weights with the default model's exact config (SmolLM2-135M: hidden
  576, 30 layers, 9/3 heads, FFN 1536, vocab 49152, tied; 4-bit group 32, 8-bit embedding).

Timing: warm-up, then the median of --reps runs, each ``mx.eval`` + ``perf_counter`` after
``mx.synchronize`` (models: --rounds interleaved rounds over the widths, median over rounds).
``--tune`` first sweeps the mma kernel's split per weight shape of the 8B model and installs
the best (metal_kernels.qmv.set_mma_config); models are then timed with both the default and
the tuned split. JSON goes to --out; tables are printed.

    python benchmarks/verify_cost.py --out verify_cost.json [--parts matrices,llama8b,smollm]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
import traceback

import mlx.core as mx
import mlx.nn as nn

from metal_kernels import backend, patch_model, plan, qmv, quantized_matmul, unpatch_model

H200_BW = 4.8e12  # bytes/s, NVIDIA datasheet
KS = list(range(1, 17))


def _sync():
    getattr(mx, "synchronize", lambda: None)()


def _median_time(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    _sync()
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        mx.eval(fn())
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _nbytes(*arrays) -> int:
    return sum(a.nbytes for a in arrays)


# ------------------------------------------------------------------ single matrices


def _weight_sets(n, k, bits, gs, dtype, count):
    sets = []
    for i in range(count):
        mx.random.seed(1000 + i)
        sets.append(mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=gs, bits=bits))
        mx.eval(sets[-1])
    return sets


def _time_matrix(sets, k_rows, kdim, gs, bits, dtype, kernels, reps):
    x = mx.random.normal((k_rows, kdim)).astype(dtype)
    mx.eval(x)
    fn = lambda: [quantized_matmul(x, w, s, b, gs, bits, kernels=kernels) for w, s, b in sets]  # noqa: E731
    return _median_time(fn, reps) / len(sets)


def bench_matrices(args, bits=4, gs=64):
    dtype = getattr(mx, args.dtype)
    shapes = ((256, 512), (384, 256)) if args.smoke else ((4096, 4096), (14336, 4096))
    rows = []
    for n, k in shapes:
        sets = _weight_sets(n, k, bits, gs, dtype, 32)
        wbytes = _nbytes(*sets[0])
        for path, kernels in (("mlx", "off"), ("kernel", "auto")):
            t = {kk: _time_matrix(sets, kk, k, gs, bits, dtype, kernels, args.reps) for kk in KS}
            rows.append({"shape": f"{n}x{k}", "bits": bits, "group_size": gs, "path": path,
                         "weight_bytes": wbytes, "t_us": {kk: v * 1e6 for kk, v in t.items()},
                         "ratio": {kk: t[kk] / t[1] for kk in KS},
                         "bw_tbs": {kk: wbytes / t[kk] / 1e12 for kk in KS}})
        del sets
        mx.clear_cache()
    return rows


# (tiles per warp, chunks in flight) tried per row bucket.
_SWEEP = {8: ((1, 1), (1, 2), (2, 1), (1, 4)), 16: ((1, 1), (1, 2), (2, 1))}


def tune(args, shapes, bits=4, gs=64):
    """Sweep (WK, NT, U) of the mma kernel per shape; install and return the best."""
    dtype = getattr(mx, args.dtype)
    out = {}
    for n, k in shapes:
        p1 = plan(1, n, k, bits, gs, dtype)
        if p1 is None or p1.kind != "mma":
            continue
        count = max(2, min(32, math.ceil(256e6 / (n * k * bits / 8))))
        sets = _weight_sets(n, k, bits, gs, dtype, count)
        nchunks = k // (4 * p1.const("VW") * 32 // bits)
        results = []
        for wk in [w for w in (4, 8, 16) if w <= nchunks] or [p1.const("WK")]:
            per_mb = {}
            for mb, kk in ((8, 8), (16, 16)):
                best = None
                for nt, u in _SWEEP[mb]:
                    if n % (16 * nt) or not qmv.mma_config_fits(nt, u, mb, wk):
                        continue
                    qmv.set_mma_config(n, k, bits, wk=wk, nt_u={mb: (nt, u)})
                    t = _time_matrix(sets, kk, k, gs, bits, dtype, "auto", args.tune_reps)
                    if mb == 8:  # decode (k = 1) runs the MB = 8 configuration too
                        t = t + _time_matrix(sets, 1, k, gs, bits, dtype, "auto", args.tune_reps)
                    if best is None or t < best[0]:
                        best = (t, nt, u)
                per_mb[mb] = best
            results.append((per_mb[8][0] + per_mb[16][0], wk, per_mb))
        qmv.clear_mma_config()
        _, wk, per_mb = min(results, key=lambda r: r[0])
        out[f"{n}x{k}"] = {"wk": wk, "nt_u": {mb: v[1:] for mb, v in per_mb.items()},
                           "default_wk": p1.const("WK"),
                           "sweep_us": [(r[1], {mb: round(v[0] * 1e6, 2) for mb, v in r[2].items()})
                                        for r in results]}
        del sets
        mx.clear_cache()
    for key, cfg in out.items():
        n, k = map(int, key.split("x"))
        qmv.set_mma_config(n, k, bits, wk=cfg["wk"], nt_u=cfg["nt_u"])
    return out


def install_configs(path):
    """Install the launch configurations of ``mma_sweep.py --pick`` (``{"NxK:GROUP": {"8": cfg,
    "16": cfg}}``, cfg = mma_sweep.CONFIG_FIELDS) for 4-bit weights; 8-row-bucket ones leave
    one-row launches to the defaults. Returns what was installed."""
    from benchmarks.gpu.mma_sweep import apply_config
    with open(path) as fh:
        picks = json.load(fh)
    for shape, buckets in picks.items():
        nk, gs = shape.split(":")
        n, k = (int(v) for v in nk.split("x"))
        for bucket, cfg in buckets.items():
            # WK (the K split) is shared by every row count: another one would change the bits
            # of one-row launches too, which these configurations must leave alone
            wk = plan(1, n, k, 4, int(gs), mx.bfloat16, "cuda").const("WK")
            if cfg[0] != wk:
                raise ValueError(f"{shape} rows {bucket}: WK {cfg[0]} is not the default {wk}")
            apply_config(n, k, int(bucket), tuple(cfg), multi_row_only=True)
    return picks


# ------------------------------------------------------------------ models


def llama8b_args():
    from mlx_lm.models import llama
    return llama.ModelArgs(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)


def smollm_args():
    from mlx_lm.models import llama
    return llama.ModelArgs(
        model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True)


def build_model(margs, dtype, bits, gs, embed_bits, smoke=False):
    """Random-weight mlx-lm Llama, quantized (evaluated layer by layer to bound memory)."""
    from mlx_lm.models import llama
    if smoke:  # CPU check of the harness: same widths, 2 layers, small vocabulary
        margs.num_hidden_layers, margs.vocab_size = 2, 1024
    mx.random.seed(0)
    model = llama.Model(margs)
    model.set_dtype(dtype)
    nn.quantize(model, class_predicate=lambda _, m: (
        {"group_size": gs, "bits": embed_bits} if isinstance(m, nn.Embedding)
        else {"group_size": gs, "bits": bits} if isinstance(m, nn.Linear) else False))
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def matmul_weight_bytes(model) -> int:
    """Bytes a forward reads through quantized matmuls (projections + LM head)."""
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear) or (
                isinstance(m, nn.QuantizedEmbedding) and model.args.tie_word_embeddings):
            total += _nbytes(*(m[k] for k in ("weight", "scales", "biases") if k in m))
    return total


def _interleaved(step, reps, rounds):
    samples = {k: [] for k in KS}
    for r in range(rounds):
        for k in (KS if r % 2 == 0 else KS[::-1]):
            samples[k].append(_median_time(lambda k=k: step(k), reps, warmup=2 if r == 0 else 1))
    return {k: statistics.median(v) for k, v in samples.items()}


def time_compiled_forward(model, context, reps, rounds=1):
    """T(k) as :func:`time_forward`, but each pass is the engine's compiled decode/verify pass
    (``SPECSERVE_COMPILE=on``: ``engine.static_cache.CompiledPasses`` over a ``StaticCache``,
    one ``mx.compile`` trace per width, replayed). The Python forward is traced once per width,
    so a pass costs no graph build in Python, and MLX fuses the elementwise ops. Attention runs
    over the cache's whole capacity (``bucket(context + 16)`` positions) under a position mask,
    batched (MLX's attention, ``row_exact=False``): that is the engine's pass only with
    ``SPECSERVE_EXACT_VERIFY=batched``; its default attends row by row in passes wider than the
    calibrated batched width."""
    from engine.static_cache import CompiledPasses, StaticCache, bucket, kv_layout
    cache = StaticCache(*kv_layout(model), capacity=bucket(context + max(KS)))
    mx.random.seed(1)
    prompt = mx.random.randint(0, model.args.vocab_size, (1, context))
    layers = cache.layers(0)
    mx.eval(model(prompt, cache=layers))
    cache.store(layers, context)
    mx.eval(cache.keys, cache.values)
    passes = CompiledPasses(lambda ids, layers: (model(ids, cache=layers)[0].astype(mx.float32), None))
    toks = {k: [int(t) for t in mx.random.randint(0, model.args.vocab_size, (k,)).tolist()] for k in KS}

    def step(k):
        logits, _ = passes.run(toks[k], cache, row_exact=False)
        cache.trim(k)
        return [logits, *cache.keys, *cache.values]
    return _interleaved(step, reps, rounds)


def time_forward(model, context, reps, row_attention=False, rounds=1):
    """T(k) for k in KS: one forward of k tokens over ``context`` cached tokens (seconds).

    ``rounds`` > 1 interleaves the widths: each round times every k (``reps`` forwards each,
    k ascending in even rounds and descending in odd ones), and T(k) is the median over the
    rounds of each round's median. The H200 host runs in slower and faster phases of seconds,
    which a width-after-width sweep turns into steps in the curve (docs/benchmarks.md,
    eighteenth session); interleaving spreads each phase over every width.
    ``row_attention``: every pass (one-token ones included) attends through
    metal_kernels.attention.row_attention, as the engine does with ``SPECSERVE_EXACT_VERIFY=kernel``
    (the prompt is prefilled with MLX's attention)."""
    from engine import exact_attention
    from metal_kernels.attention import row_attention as kernel
    exact_attention.install(model)  # (every path through the same wrapper; a no-op unless row-exact)
    cache = exact_attention.make_cache(model)
    mx.random.seed(1)
    prompt = mx.random.randint(0, model.args.vocab_size, (1, context))
    mx.eval(model(prompt, cache=cache))
    exact_attention.set_row_exact(cache, row_attention, kernel if row_attention else None)
    toks = {k: mx.random.randint(0, model.args.vocab_size, (1, k)) for k in KS}

    def step(k):
        out = model(toks[k], cache=cache)
        mx.eval(out)
        for c in cache:
            c.trim(k)
        return out
    return _interleaved(step, reps, rounds)


def bench_model(name, model, args, tuned):
    wbytes = matmul_weight_bytes(model)
    rows = []
    mx.random.seed(2)
    probe = mx.random.randint(0, model.args.vocab_size, (1, 6))
    ref_logits = model(probe).astype(mx.float32)
    # (matmul path, mma split, attention, compiled): "row" = the row-attention kernel in every
    # pass; compiled = the engine's compiled passes over a static cache
    paths = [("mlx", None, "mlx", False), ("kernel", "default", "mlx", False)]
    if tuned:
        paths.append(("kernel", "tuned", "mlx", False))
    if backend() == "cuda" and "row" in args.attention.split(","):
        paths += [("mlx", None, "row", False), ("kernel", "tuned" if tuned else "default", "row", False)]
    if args.compiled:
        paths += [("mlx", None, "mlx", True), ("kernel", "default", "mlx", True)]
        if tuned:
            paths.append(("kernel", "tuned", "mlx", True))
    for path, cfg, attention, compiled in paths:
        report = None
        saved = (dict(qmv._WK_OVERRIDE), dict(qmv._NTU_OVERRIDE), dict(qmv._PATH_OVERRIDE))
        if cfg == "default":
            qmv.clear_mma_config()
        if path == "kernel":
            report = patch_model(model, "auto")
        if compiled:
            t = time_compiled_forward(model, args.context, args.reps, rounds=args.rounds)
        else:
            t = time_forward(model, args.context, args.reps, row_attention=attention == "row",
                             rounds=args.rounds)
        label = path if cfg is None else f"{path}-{cfg}"
        label = label if attention == "mlx" else f"{label}+row-attention"
        row = {"model": name, "path": label + ("+compiled" if compiled else ""),
               "attention": attention, "compiled": compiled,
               "weight_bytes": wbytes, "t_ms": {k: v * 1e3 for k, v in t.items()},
               "ratio": {k: t[k] / t[1] for k in KS},
               "bw_tbs": {k: wbytes / t[k] / 1e12 for k in KS}}
        if report is not None:
            logits = model(probe).astype(mx.float32)
            row["patched_layers"] = len(report.patched)
            row["sibling_groups"] = report.sibling_groups
            row["logits_max_rel_diff"] = (mx.abs(logits - ref_logits).max()
                                          / mx.abs(ref_logits).max()).item()
            unpatch_model(model)
        if cfg == "default":
            for (n, k, b), wk in saved[0].items():
                qmv.set_mma_config(n, k, b, wk=wk)
            for (n, k, b, mb), ntu in saved[1].items():
                qmv.set_mma_config(n, k, b, nt_u={mb: ntu})
            for (n, k, b, mb), opts in saved[2].items():
                qmv.set_mma_config(n, k, b, path={mb: opts})
        rows.append(row)
    return rows


# ------------------------------------------------------------------ output


def _table(rows, unit_key, unit, title):
    lines = [title, f"{'case':<52}" + "".join(f"{k:>8}" for k in KS)]
    for r in rows:
        label = f"{r.get('shape', r.get('model'))} {r['path']}"
        lines.append(f"{label + ' ' + unit:<52}" + "".join(f"{r[unit_key][k]:8.2f}" for k in KS))
        lines.append(f"{'  T(k)/T(1)':<52}" + "".join(f"{r['ratio'][k]:8.2f}" for k in KS))
        lines.append(f"{'  TB/s':<52}" + "".join(f"{r['bw_tbs'][k]:8.3f}" for k in KS))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="matrices,llama8b,smollm")
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--smollm-dtypes", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tune-reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1,
                    help="model parts: interleaved rounds over the widths (T(k) = median over rounds "
                         "of each round's median of --reps forwards)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--mma-configs", default=None,
                    help="JSON from benchmarks/gpu/mma_sweep.py --pick: launch configurations per shape "
                         "for 2..8 and 9..16 rows (one-row launches keep their defaults); the models are "
                         "then timed with both the default and these ('kernel-tuned')")
    ap.add_argument("--attention", default="mlx,row",
                    help="comma-separated: 'mlx' (always timed) and 'row' (also the row-attention kernel, CUDA only)")
    ap.add_argument("--compiled", action="store_true",
                    help="model parts: also time both matmul paths through the engine's compiled passes "
                         "(mx.compile over a static KV cache, SPECSERVE_COMPILE=on) with batched attention, "
                         "as the engine runs them with SPECSERVE_EXACT_VERIFY=batched")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the harness)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    result = {"backend": backend(), "mlx": mx.__version__, "platform": platform.platform(),
              "dtype": args.dtype, "peak_bw_tbs": H200_BW / 1e12, "ks": KS, "reps": args.reps,
              "rounds": args.rounds, "compiled": args.compiled,
              "context": args.context}

    def dump():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def guarded(name, fn):
        try:
            return fn()
        except Exception:  # one broken part must not lose the others' numbers
            result.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"== {name} FAILED\n{traceback.format_exc()}", flush=True)
            return None

    if "matrices" in parts:
        result["matrices"] = guarded("matrices", lambda: bench_matrices(args)) or []
        dump()
        print(_table(result["matrices"], "t_us", "us", "== single 4-bit matrices (per matmul)"),
              flush=True)
    tuned = False
    if args.mma_configs and "llama8b" in parts:
        result["mma_configs"] = install_configs(args.mma_configs)
        tuned = bool(result["mma_configs"])
        print("== installed mma configurations:", json.dumps(result["mma_configs"]), flush=True)
    elif args.tune and "llama8b" in parts:
        # the projections' own shapes and, with sibling launches (patch_model's default), the
        # fused q/k/v (4096 + 2 x 1024) and gate/up (2 x 14336) shapes
        shapes = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (28672, 4096)]
        result["tuning"] = guarded("tuning", lambda: tune(args, shapes)) or {}
        tuned = bool(result["tuning"])
        dump()
        print("== tuned mma split:", json.dumps(
            {k: {"wk": v["wk"], "nt_u": v["nt_u"]} for k, v in result["tuning"].items()}),
            flush=True)
    models = result["models"] = []

    def run_model(name, margs, dt, bits, gs, embed_bits, with_tuned):
        model = build_model(margs, dt, bits, gs, embed_bits, args.smoke)
        models.extend(bench_model(name, model, args, with_tuned))
        del model
        mx.clear_cache()

    if "llama8b" in parts:
        guarded("llama8b", lambda: run_model("llama8b-4bit", llama8b_args(),
                                             getattr(mx, args.dtype), 4, 64, 4, tuned))
        dump()
    if "smollm" in parts:
        for dt in args.smollm_dtypes.split(","):
            guarded(f"smollm-{dt}", lambda dt=dt: run_model(
                f"smollm135m-{dt}", smollm_args(), getattr(mx, dt), 4, 32, 8, False))
            dump()
    if models:
        print(_table(models, "t_ms", "ms", "== model forward of k tokens"), flush=True)
        for r in models:
            if "logits_max_rel_diff" in r:
                print(f"{r['model']} {r['path']}: {r['patched_layers']} layers patched, "
                      f"logits max rel diff vs mlx {r['logits_max_rel_diff']:.2e}")
    dump()


if __name__ == "__main__":
    main()
