"""Continuous batching benchmark: concurrent greedy streams, batching and speculation on/off.

Two engines share one loaded model: continuous batching off (one sequence per target pass,
round-robin) and on (decoding sequences share a pass, up to the calibrated exact row count).
Each concurrency level runs the same requests on both engines, with speculation off and auto
per request, back to back (order alternating by level, so machine noise hits all alike), after
an unmeasured 4-token warm-up of every configuration at that level (first-use costs such as
MLX-CUDA compiling kernels for a new batch shape stay out of the numbers). Every
output must equal the same request served alone with speculation off: greedy output may not
depend on batching, neighbours or drafting.

Reported per level and configuration: total completion tokens/s over the wall time, per-request
latency (p50, max) and time to first token (p50), and the batched passes' mean size.

    python -m benchmarks.bench_batching --concurrency 1 4 8 --out benchmarks/results/batching_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from benchmarks.bench_speculative import load_workloads, prompt_tokens
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, SpeculativeParams
from engine.loader import load_target
from engine.stats import NullSink


class BatchCounter(NullSink):
    def __init__(self):
        self.passes = self.sequences = 0

    def batch_step(self, num_sequences, num_committed):
        self.passes += 1
        self.sequences += num_sequences


def bench_prompts(tok, names: list[str] | None, n: int) -> list[list[int]]:
    """``n`` prompts taken round-robin from the workload files (sessions use their first turn)."""
    pool = []
    for w in load_workloads(names):
        for p in w["prompts"]:
            if p["kind"] == "session":
                p = {"kind": "chat", "messages": [{"role": "user", "content": p["turns"][0]}]}
            pool.append(prompt_tokens(tok, p))
    return [pool[i % len(pool)] for i in range(n)]


def one(eng: Engine, tokens: list[int], max_tokens: int, method: str) -> dict:
    req = GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                            speculative=SpeculativeParams(method))
    start = time.perf_counter()
    ids, ttft = [], None
    for event in eng.generate(req, timeout=3600):
        if event.error is not None:
            raise RuntimeError(event.error)
        if event.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        ids += event.token_ids
    return {"ids": ids, "latency": time.perf_counter() - start, "ttft": ttft}


def level(eng: Engine, counter: BatchCounter, prompts: list[list[int]], max_tokens: int, method: str) -> dict:
    passes, seqs = counter.passes, counter.sequences
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: one(eng, p, max_tokens, method), prompts))
    wall = time.perf_counter() - start
    tokens = sum(len(r["ids"]) for r in results)
    lat = [r["latency"] for r in results]
    batched = counter.passes - passes
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_p50_s": float(np.median(lat)), "latency_max_s": max(lat),
            "ttft_p50_s": float(np.median([r["ttft"] for r in results])),
            "batched_passes": batched, "mean_batch": (counter.sequences - seqs) / batched if batched else 0.0,
            "outputs": [r["ids"] for r in results]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workloads", nargs="*", default=None)
    ap.add_argument("--weights", default="auto", help="SPECSERVE_WEIGHTS")
    ap.add_argument("--kernels", default="off", choices=["auto", "off"], help="SPECSERVE_KERNELS")
    ap.add_argument("--fused", default="off", choices=["auto", "on", "off"],
                    help="SPECSERVE_FUSED (on: one-launch passes, which never batch sequences)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    loaded = load_target(args.model, weights=args.weights)
    top = max(args.concurrency)
    prompts = bench_prompts(loaded.tokenizer, args.workloads, top)
    counters = {"off": BatchCounter(), "on": BatchCounter()}
    engines = {name: Engine(EngineConfig(speculation="auto", batching=mode, max_active=top,
                                              kernels=args.kernels, fused=args.fused), loaded=loaded,
                            sink=counters[name]).start(wait=True)
               for name, mode in (("off", "off"), ("on", "auto"))}
    levels, mismatches = [], 0
    try:
        reference = [one(engines["off"], p, args.max_tokens, "off")["ids"] for p in prompts]
        for li, conc in enumerate(args.concurrency):
            configs = [(b, m) for b in ("off", "on") for m in ("off", "auto")]
            if li % 2:
                configs.reverse()
            for batching, method in configs:  # warm-up: first-use costs (GPU kernel JIT) stay out
                level(engines[batching], counters[batching], prompts[:conc], 4, method)
            row = {"concurrency": conc}
            for batching, method in configs:
                res = level(engines[batching], counters[batching], prompts[:conc], args.max_tokens, method)
                wrong = sum(o != r for o, r in zip(res.pop("outputs"), reference))
                mismatches += wrong
                row[f"batching_{batching}/spec_{method}"] = {**res, "identical": wrong == 0}
            base = row["batching_off/spec_off"]["tokens_per_s"]
            for key in [k for k in row if k != "concurrency"]:
                row[key]["vs_round_robin_plain"] = row[key]["tokens_per_s"] / base
            levels.append(row)
            print(json.dumps({k: (v if not isinstance(v, dict) else
                                  {x: round(v[x], 3) for x in ("tokens_per_s", "vs_round_robin_plain", "mean_batch")})
                              for k, v in row.items()}), flush=True)
        batch_rows = engines["on"].batch_rows
    finally:
        for eng in engines.values():
            eng.stop()
    report = {"machine": platform.platform(), "python": sys.version.split()[0], "model": loaded.name,
              "weights": loaded.weights, "kernels": args.kernels, "fused": args.fused, "max_tokens": args.max_tokens, "batch_rows": batch_rows, "levels": levels}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if mismatches:
        print(f"{mismatches} outputs differ from the solo reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
