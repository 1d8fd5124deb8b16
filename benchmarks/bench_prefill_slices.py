"""A long prompt beside a running stream: whole prefill chunks vs time-budgeted slices, side by side.

A short chat-style request decodes while a long prompt (thousands of tokens) arrives and is
prefilled. With whole chunks (``prefill_slice_ms = 0``) every engine iteration runs one
``prefill_step``-token chunk of the long prompt before the short stream's next cycle; with
slices (the default ``prefill_slice_ms``) a prefilling sequence that is not alone runs whole
fused passes worth about that many milliseconds instead (engine.Engine._prefill_slice; only
where a chunk splits without changing a bit, i.e. the CPU fused pass), also when it runs
alone.

Two engines share one loaded model (prefix cache off, so every round prefills from scratch) and
run the same scenario in alternating order, ``--rounds`` times each: the long request alone, then
the long request with the short one sent ``--delay`` seconds after it. Greedy; every output
must equal the same engine's output for the request alone, and the two engines' outputs must
be identical. Reported per engine (medians over
rounds): the short request's time to first token, its end-to-end time and its largest gap
between streamed events; the long request's time to first token alone and beside the short one.

    python -m benchmarks.bench_prefill_slices --out benchmarks/results/prefill_slices_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from engine.loader import load_target

ROOT = Path(__file__).resolve().parents[1]


def timed(eng: Engine, request: GenerationRequest) -> tuple[list[int], list[float]]:
    """Run ``request``: its output tokens and the time (s, from submission) of each event with tokens."""
    started, tokens, times = time.perf_counter(), [], []
    for event in eng.generate(request, timeout=3600):
        if event.error is not None:
            raise RuntimeError(f"request failed: {event.error}")
        if event.token_ids:
            tokens += event.token_ids
            times.append(time.perf_counter() - started)
    return tokens, times


def one_round(eng: Engine, long_req: GenerationRequest, short_req: GenerationRequest, delay: float) -> dict:
    alone_tokens, alone_times = timed(eng, long_req)
    short_alone, _ = timed(eng, short_req)
    beside: dict = {}
    thread = threading.Thread(target=lambda: beside.update(long=timed(eng, long_req)))
    thread.start()
    time.sleep(delay)
    short_tokens, short_times = timed(eng, short_req)
    thread.join()
    long_tokens, long_times = beside["long"]
    gaps = [b - a for a, b in zip(short_times, short_times[1:])]
    return {"long_alone_ttft_s": alone_times[0], "long_beside_ttft_s": long_times[0],
            "short_ttft_s": short_times[0], "short_e2e_s": short_times[-1], "short_max_gap_s": max(gaps, default=0.0),
            "identical": long_tokens == alone_tokens and short_tokens == short_alone,
            "tokens": (long_tokens, short_tokens)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--long-tokens", type=int, default=3000, help="prompt tokens of the long request")
    ap.add_argument("--short-tokens", type=int, default=48, help="max_tokens of the short request")
    ap.add_argument("--delay", type=float, default=0.3, help="seconds between the long and the short request")
    ap.add_argument("--slice-ms", type=float, default=EngineConfig.prefill_slice_ms)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    loaded = load_target(args.model)
    configs = {"whole chunks": 0.0, f"slices of {args.slice_ms:g} ms": args.slice_ms}
    engines = {name: Engine(EngineConfig(model=args.model, prefill_slice_ms=ms, prefix_cache_bytes=0),
                            loaded=loaded).start(wait=True, timeout=1800) for name, ms in configs.items()}
    tok = loaded.tokenizer
    source = "".join(p.read_text() for p in sorted((ROOT / "engine").glob("*.py")))
    long_ids = tok.encode(source)[: args.long_tokens]
    if len(long_ids) < args.long_tokens:
        raise SystemExit(f"only {len(long_ids)} tokens of source text for --long-tokens {args.long_tokens}")
    greedy = SamplingParams(temperature=0.0)
    long_req = GenerationRequest(prompt_tokens=long_ids, max_tokens=8, sampling=greedy)
    short_ids = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                        add_generation_prompt=True, tokenize=True)
    short_req = GenerationRequest(prompt_tokens=list(short_ids), max_tokens=args.short_tokens, sampling=greedy)
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                rounds[name].append(one_round(engines[name], long_req, short_req, args.delay))
                shown = {k: v for k, v in rounds[name][-1].items() if k != "tokens"}
                print(f"round {r + 1} {name}: {json.dumps(shown)}", flush=True)
    finally:
        for eng in engines.values():
            eng.stop()
    summary = {name: {key: statistics.median(x[key] for x in runs) for key in runs[0] if key not in ("identical", "tokens")}
               | {"identical": all(x["identical"] for x in runs)} for name, runs in rounds.items()}
    first, second = (rounds[name] for name in configs)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(first, second))
    for runs in rounds.values():
        for run in runs:
            del run["tokens"]
    whole, sliced = (summary[name] for name in configs)
    ratios = {key: sliced[key] / whole[key] for key in whole if key != "identical" and whole[key]}
    result = {"model": loaded.name, "weights": loaded.weights, "long_tokens": args.long_tokens,
              "sliced_equals_whole": same,
              "short_tokens": args.short_tokens, "delay_s": args.delay, "rounds": rounds, "summary": summary,
              "sliced_over_whole": ratios, "platform": platform.platform(), "processor": platform.processor()}
    for name, row in summary.items():
        print(f"{name:>22}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in row.items()))
    print("sliced / whole: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
          + f"; outputs of the two engines identical: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
