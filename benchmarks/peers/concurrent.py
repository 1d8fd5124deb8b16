"""Concurrent streams against specserve and mlx_lm.server's batched mode, same model and client.

Each server runs alone (one process at a time, so they do not compete for the machine), is
warmed up, then serves each concurrency level ``c``: ``c`` greedy streamed requests started at
once through the ``openai`` SDK (workload prompts, round-robin). The order of servers is
reversed on every other repeat. mlx_lm.server batches concurrent requests itself (its
``BatchGenerator``: ``--decode-concurrency``, default 32); specserve batches decoding sequences
in exact passes (``SPECSERVE_BATCHING=auto``).

Reported per server and level: aggregate completion tokens/s (all tokens over the level's wall
time), latency and time to first token (p50), the ratio to mlx_lm.server, and how many outputs
equal specserve's (speculation off) output for the same prompt.

    python -m benchmarks.peers.concurrent --concurrency 1 4 8 16 --max-tokens 64 \\
        --out benchmarks/results/peers_concurrent_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import engine  # noqa: F401  (OpenBLAS before mlx.core; sets OPENBLAS_CORETYPE for children too)

from .run import (
    DEFAULT_WORKLOADS,
    _client,
    _warm_up,
    build_items,
    set_up,
    stream_one,
    versions,
)
from .servers import Running


def serve_levels(peer, workdir: Path, items: list[dict], levels: list[int], count_tokens) -> dict:
    """Start ``peer``, warm it up, run every level; returns per-level results."""
    out = {}
    with Running(peer, workdir) as server:
        client = _client(server)
        _warm_up(client, peer, count_tokens)
        for c in levels:
            batch = [items[i % len(items)] for i in range(c)]
            start = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                rows = list(pool.map(lambda it: stream_one(client, peer.model, it, count_tokens), batch))
            wall = time.perf_counter() - start
            tokens = sum(r["tokens"] for r in rows)
            out[str(c)] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                           "latency_p50_s": float(np.median([r["total_s"] for r in rows])),
                           "ttft_p50_s": float(np.median([r["ttft_s"] for r in rows])),
                           "texts": [r["text"] for r in rows], "loadavg": os.getloadavg()[0]}
            print(f"{peer.name:16s} c={c:3d} {tokens / wall:8.1f} tok/s", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default="specserve_off,specserve_auto,mlx_lm")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--workdir", default="/tmp/specserve-peers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    workdir, _, _, policy, peers, count_tokens = set_up(args, os.cpu_count(), 4096)
    names = [p.name for p in peers]
    for p in peers:  # let each server admit every stream of the largest level at once
        if p.name.startswith("specserve"):
            p.argv = p.argv + ["--max-active", str(max(args.concurrency))]
    items = build_items(args.workloads.split(","), args.max_tokens)
    runs = []
    for rep in range(args.repeats):
        runs.append({p.name: serve_levels(p, workdir, items, args.concurrency, count_tokens)
                     for p in (peers if rep % 2 == 0 else peers[::-1])})
    results = {"versions": versions(), "weights": policy, "workloads": args.workloads, "max_tokens": args.max_tokens,
               "concurrency": args.concurrency, "peers": {p.name: p.argv for p in peers}, "summary": {}}
    for name in names:
        for c in map(str, args.concurrency):
            levels = [r[name][c] for r in runs]
            tps = float(np.median([lv["tokens_per_s"] for lv in levels]))
            texts = levels[0]["texts"]
            # specserve's greedy outputs do not depend on concurrency (tests/test_batching.py)
            ref = runs[0]["specserve_off"][c]["texts"] if "specserve_off" in names else None
            results["summary"].setdefault(name, {})[c] = {
                "tokens_per_s": tps, "latency_p50_s": float(np.median([lv["latency_p50_s"] for lv in levels])),
                "ttft_p50_s": float(np.median([lv["ttft_p50_s"] for lv in levels])),
                "identical_to_specserve_off": sum(t == r for t, r in zip(texts, ref)) if ref else None,
                "requests": len(texts)}
    if "mlx_lm" in names:
        for by_level in results["summary"].values():
            for c, row in by_level.items():
                row["vs_mlx_lm"] = row["tokens_per_s"] / results["summary"]["mlx_lm"][c]["tokens_per_s"]
    results["runs"] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results["summary"], indent=1))
    return results


if __name__ == "__main__":
    main()
