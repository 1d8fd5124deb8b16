"""Step profile: where one target step's time goes, eager vs compiled vs fused (issue 11, scope 1 and 4).

For each model and each mode of ``--modes`` (``eager``: mlx-lm's modules on mlx-lm KV caches,
the engine's ``SPECSERVE_COMPILE=off SPECSERVE_FUSED=off`` path; ``compiled``: ``mx.compile``d
passes over the static KV cache, :mod:`engine.static_cache`; ``fused``: one kernel launch per
pass, :mod:`metal_kernels.fused`, or the C pass of :mod:`metal_kernels.fused_cpu` on the CPU;
``fused:q8`` etc. picks the CPU pass's activations, default ``q16``), after a prefill of
``--context`` tokens:

- ``step_ms[k]`` for k = 1..16 rows (T(k)): the median of ``build`` (host: building the graph,
  or for compiled passes calling the recorded graph), ``eval`` (``mx.eval``: kernel launches and
  device work until the result is ready) and ``total``; ``ratio`` = T(k) / T(1). Batched
  attention for every width (the engine may attend row by row beyond its calibrated width).
- ``decode``: greedy decoding with the runner, one host sync per token (``argmax().item()``):
  tokens/s and the per-token build / eval split.
- ``engine_decode_tps`` (models with a tokenizer): the engine end to end with speculation off
  (sampling pipeline, detokenizer, stop checks included), tokens/s over ``--engine-tokens``.
- ``same_tokens``: per mode, whether its greedy decode produced the eager decode's tokens
  (different arithmetic may flip a near-tie; each mode is exact against itself, which the
  engine's calibration and tests check), and ``decode_speedup`` against eager.

Models: ``default`` (engine.loader.load_target, or ``--model`` a .gguf path) and, with
``--llama8b``, the 8B-shaped random-weight 4-bit Llama of benchmarks/verify_cost.py
(``--smoke`` shrinks it to 2 layers for a CPU check of the harness). JSON goes to ``--out``
(rewritten after every part, so a timeout keeps what finished); a table is printed.

    python -m benchmarks.step_profile --out step_profile.json [--modes eager,fused] [--llama8b] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from engine.runner import TargetRunner

KS = list(range(1, 17))


def _sync():
    getattr(mx, "synchronize", lambda: None)()


def _prefill(runner: TargetRunner, ids: list[int]):
    cache = runner.make_cache()
    for i in range(0, len(ids), 512):
        mx.eval(runner.prefill(ids[i : i + 512], cache)[0])
    return cache


def time_widths(runner: TargetRunner, cache, vocab: int, reps: int, ks=KS) -> dict:
    """Median build / eval / total milliseconds of a k-row verify pass, k in ``ks``."""
    out = {}
    for k in ks:
        toks = mx.random.randint(3, vocab, (k,), key=mx.random.key(k)).tolist()
        build, ev, total = [], [], []
        for i in range(reps + 2):  # two warm-up passes (the first traces a compiled shape)
            _sync()
            t0 = time.perf_counter()
            logits = runner.verify(toks, cache)[0]
            t1 = time.perf_counter()
            mx.eval(logits)
            t2 = time.perf_counter()
            runner.trim(cache, k)
            if i >= 2:
                build.append(t1 - t0)
                ev.append(t2 - t1)
                total.append(t2 - t0)
        out[k] = {name: round(statistics.median(v) * 1e3, 4)
                  for name, v in (("build", build), ("eval", ev), ("total", total))}
    base = out[ks[0]]["total"]
    for k in ks:
        out[k]["ratio"] = round(out[k]["total"] / base, 3)
    return out


def time_decode(runner: TargetRunner, cache, first: int, steps: int) -> dict:
    """Greedy decode ``steps`` tokens, one host sync per token; the tokens and the timings."""
    tok, tokens, build, ev = first, [], [], []
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = mx.argmax(runner.verify([tok], cache)[0][0])
        t1 = time.perf_counter()
        tok = nxt.item()
        build.append(t1 - t0)
        ev.append(time.perf_counter() - t1)
        tokens.append(tok)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": round(steps / elapsed, 2),
            "build_ms": round(statistics.median(build) * 1e3, 4),
            "eval_ms": round(statistics.median(ev) * 1e3, 4), "tokens": tokens}


def engine_decode(loaded, mode: str, prompt: list[int], max_tokens: int) -> float:
    """Tokens/s of the engine in ``mode`` with speculation off (greedy, EOS ignored), after warm-up."""
    from engine import Engine, EngineConfig
    from engine.request import GenerationRequest, SamplingParams

    cfg = EngineConfig(speculation="off", compile="on" if mode == "compiled" else "off",
                       fused="on" if mode.startswith("fused") else "off", max_verify_rows=1,
                       cpu_activations=_activations(mode))
    eng = Engine(cfg, loaded=loaded).start(wait=True, timeout=600)
    try:
        def run(n):  # tokens/s between the first and the last event (prefill excluded)
            req = GenerationRequest(prompt_tokens=list(prompt), max_tokens=n, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0.0))
            stamps = [(len(e.token_ids), time.perf_counter()) for e in eng.generate(req, timeout=600)]
            count = sum(c for c, _ in stamps[1:])
            return round(count / max(stamps[-1][1] - stamps[0][1], 1e-9), 2)
        run(8)
        return run(max_tokens)
    finally:
        eng.stop()


def _activations(mode: str) -> str:
    """The CPU fused pass's activations of ``mode`` (``fused:q8`` -> ``q8``; default ``q16``)."""
    return mode.split(":", 1)[1] if ":" in mode else "q16"


def make_runner(model, mode: str, context_limit=None, quantized=None) -> TargetRunner:
    """A runner for ``mode`` (eager, compiled or fused[:activations]: the CUDA kernel, or the C
    pass on the CPU over ``quantized``, the loader's quantized layers); ValueError if fused is
    unsupported."""
    fused = None
    if mode.startswith("fused"):
        from metal_kernels import make_fused_pass

        fused = make_fused_pass(model, quantized, cpu_activations=_activations(mode))
    return TargetRunner(model, compile=mode == "compiled", max_context=context_limit, fused=fused)


def profile_mode(model, mode: str, ids: list[int], vocab: int, args, context_limit, quantized=None) -> dict:
    """One model in one mode: T(k) split and greedy decode (fresh runner and caches)."""
    compiled = mode == "compiled"
    runner = make_runner(model, mode, context_limit, quantized)
    started = time.perf_counter()
    cache = _prefill(runner, ids[:-1])
    widths = time_widths(runner, cache, vocab, args.reps, KS[: args.max_k])
    decode = time_decode(runner, cache, ids[-1], args.decode_tokens)
    out = {"step_ms": widths, "decode": decode, "seconds": round(time.perf_counter() - started, 2)}
    if compiled:
        out["traces"] = runner.passes().traces()
        out["capacity"] = cache.capacity
    return out


def profile_model(name: str, model, vocab: int, args, result: dict, loaded=None, context_limit=None):
    """Each of ``args.modes`` in turn; fills ``result["models"][name]`` as it goes."""
    ids = mx.random.randint(3, vocab, (args.context,), key=mx.random.key(7)).tolist()
    entry = result["models"][name] = {"context": args.context}
    modes = args.modes.split(",")
    for mode in modes:
        try:
            entry[mode] = profile_mode(model, mode, ids, vocab, args, context_limit,
                                       loaded.quantized if loaded is not None else None)
        except ValueError as e:  # fused pass unsupported for this model or backend
            entry[mode] = {"skipped": str(e)}
            yield
            continue
        if loaded is not None and args.engine_tokens:
            entry[mode]["engine_decode_tps"] = engine_decode(loaded, mode, ids[:64], args.engine_tokens)
        yield
    ran = [m for m in modes if "decode" in entry[m]]
    if "eager" in ran:
        base = entry["eager"]["decode"]
        entry["same_tokens"] = {m: entry[m]["decode"]["tokens"] == base["tokens"] for m in ran if m != "eager"}
        entry["decode_speedup"] = {m: round(entry[m]["decode"]["tokens_per_s"] / base["tokens_per_s"], 3)
                                   for m in ran if m != "eager"}
    for mode in ran:
        entry[mode]["decode"]["tokens"] = entry[mode]["decode"]["tokens"][:16]


def _table(result: dict) -> str:
    lines = []
    for name, entry in result["models"].items():
        for mode in [k for k in entry if k.startswith(("eager", "compiled", "fused"))]:
            m = entry.get(mode)
            if not m or "skipped" in m:
                if m:
                    lines.append(f"== {name} {mode}: skipped ({m['skipped']})")
                continue
            ks = sorted(m["step_ms"], key=int)
            d = m["decode"]
            lines.append(f"== {name} {mode}: decode {d['tokens_per_s']} tok/s (build {d['build_ms']} ms, "
                         f"eval {d['eval_ms']} ms per token)"
                         + (f", engine {m['engine_decode_tps']} tok/s" if "engine_decode_tps" in m else ""))
            for key in ("build", "eval", "total", "ratio"):
                lines.append(f"  {key:<6}" + "".join(f"{m['step_ms'][k][key]:8.2f}" for k in ks))
        if "same_tokens" in entry:
            lines.append(f"  same tokens as eager: {entry['same_tokens']}, decode speed-up vs eager: "
                         f"{entry['decode_speedup']}")
    return "\n".join(lines)


def calibrations(model, vocab: int, context_limit, max_rows: int, result: dict, modes: list[str], quantized=None):
    """The engine's start-up calibration (exact verify width, T(k)) on each path."""
    entry = result["calibration"] = {}
    for mode in modes:
        try:
            runner = make_runner(model, mode, context_limit, quantized)
        except ValueError as e:
            entry[mode] = {"skipped": str(e)}
            continue
        started = time.perf_counter()
        cal = runner.calibrate(vocab, max_rows=max_rows, contexts=(48, 1100), max_context=context_limit)
        entry[mode] = {**cal.summary(), "seconds": round(time.perf_counter() - started, 2)}
        yield


def _default_model(args):
    from engine.loader import load_target

    loaded = load_target(args.model, args.weights)
    vocab = loaded.config.get("vocab_size") or len(loaded.tokenizer._tokenizer)
    return loaded, vocab


def _llama8b(args):
    from benchmarks.verify_cost import build_model, llama8b_args

    margs = llama8b_args()
    if args.smoke:  # harness check on a CPU: small widths too (4-bit matmuls are slow there)
        margs.hidden_size, margs.intermediate_size, margs.head_dim = 256, 512, 64
        margs.num_attention_heads, margs.num_key_value_heads = 4, 2
    model = build_model(margs, getattr(mx, args.dtype), 4, 64, 4, smoke=args.smoke)
    return model, model.args.vocab_size


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="default", help="default, or a .gguf path / MLX dir")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--llama8b", action="store_true", help="also the 8B-shaped random 4-bit Llama")
    ap.add_argument("--dtype", default="bfloat16", help="activation dtype of the 8B-shaped model")
    ap.add_argument("--smoke", action="store_true", help="2-layer 8B-shaped model (CPU harness check)")
    ap.add_argument("--modes", default="eager,compiled,fused",
                    help="comma-separated: eager, compiled, fused, fused:ACTIVATIONS (CPU: q16, q8, float32)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-k", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--engine-tokens", type=int, default=128, help="0 skips the engine-level decode")
    ap.add_argument("--calibrate", type=int, default=0, metavar="ROWS",
                    help="last: the start-up calibration of the default model up to ROWS, both paths")
    args = ap.parse_args(argv)
    result = {"device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
              "args": vars(args), "models": {}}

    def dump():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def guarded(name, parts):
        try:
            for _ in parts:
                dump()
        except Exception:  # one failing model must not lose the other's numbers
            result.setdefault("errors", {})[name] = traceback.format_exc()
            print(f"== {name} FAILED\n{traceback.format_exc()}", flush=True)
        dump()

    loaded, vocab = _default_model(args)
    guarded("default", profile_model("default", loaded.model, vocab, args, result, loaded,
                                     loaded.context_length))
    if args.llama8b:
        def parts():
            model, vocab8 = _llama8b(args)
            yield from profile_model("llama8b-4bit", model, vocab8, args, result)
        guarded("llama8b-4bit", parts())
    if args.calibrate:
        guarded("calibration", calibrations(loaded.model, vocab, loaded.context_length, args.calibrate, result,
                                            args.modes.split(","), loaded.quantized))
    print(_table(result), flush=True)
    for mode, cal in result.get("calibration", {}).items():
        print(f"== calibration {mode}: {json.dumps(cal)}", flush=True)


if __name__ == "__main__":
    main()
