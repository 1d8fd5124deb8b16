"""Load test: many concurrent greedy streams against a running server, each checked against the
same request served alone.

For every request body the reference output is first taken with the body served alone
(sequentially). Then, for each concurrency level c, c streams start at once (bodies reused round
robin) and every output must equal its reference token for token (greedy decoding with
speculation is deterministic and must not depend on batching or neighbours). Reported per level:
errors by HTTP status (5xx counted apart), end-to-end latency and time to first token (p50, p99,
seconds), completion tokens, aggregate tokens/s (completion tokens / wall time) and the mean
acceptance length of the speculative decoder.

    specserve &                                   # any model; SPECSERVE_API_KEY if set
    python -m benchmarks.load --url http://127.0.0.1:8000 --concurrency 16 64 \\
        --out benchmarks/results/load_cpu.json

Bodies come from benchmarks/workloads/*.json (``--workloads``), capped at ``--max-tokens``.
tests/test_load.py runs the same code against the tiny model in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

WORKLOADS = Path(__file__).parent / "workloads"


@dataclass
class Result:
    index: int
    status: int = 0
    text: str = ""
    completion_tokens: int = 0
    latency: float = 0.0  # seconds, request sent to [DONE]
    ttft: float | None = None  # seconds to the first non-empty text chunk
    error: str | None = None
    spec: dict = field(default_factory=dict)


def _chunk_text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def stream_one(client: httpx.AsyncClient, index: int, path: str, body: dict) -> Result:
    """POST one streaming request (usage included) and collect its text, usage and timings."""
    res = Result(index)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:300]
                return res
            parts = []
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                elif chunk.get("choices"):
                    text = _chunk_text(chunk)
                    if text and res.ttft is None:
                        res.ttft = time.perf_counter() - started
                    parts.append(text)
                elif chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                    res.spec = chunk.get("speculative_decoding") or {}
            res.text = "".join(parts)
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - started
    return res


async def run_batch(url: str, items: list[tuple[str, dict]], concurrency: int,
                    headers: dict | None = None, timeout: float = 600) -> tuple[list[Result], float]:
    """Serve ``items`` with at most ``concurrency`` in flight; returns (results, wall seconds)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        async def one(i, path, body):
            async with gate:
                return await stream_one(client, i, path, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i, p, b) for i, (p, b) in enumerate(items)))
        return list(results), time.perf_counter() - started


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def summarize(results: list[Result], wall: float) -> dict:
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200 or r.error:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
    ok = [r for r in results if r.status == 200 and not r.error]
    tokens = sum(r.completion_tokens for r in ok)
    drafts = sum(r.spec.get("num_drafts", 0) for r in ok)
    accepted = sum(r.spec.get("num_accepted_tokens", 0) for r in ok)
    return {
        "requests": len(results), "errors": errors,
        "server_errors": sum(1 for r in results if r.status >= 500),
        "latency_p50_s": _pct([r.latency for r in ok], 50), "latency_p99_s": _pct([r.latency for r in ok], 99),
        "ttft_p50_s": _pct([r.ttft for r in ok if r.ttft is not None], 50),
        "ttft_p99_s": _pct([r.ttft for r in ok if r.ttft is not None], 99),
        "completion_tokens": tokens, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "num_drafts": drafts,
    }


async def load_test(url: str, items: list[tuple[str, dict]], levels: list[int],
                    headers: dict | None = None) -> dict:
    """Reference outputs served alone, then each concurrency level; see the module docstring."""
    solo, solo_wall = await run_batch(url, items, 1, headers)
    report = {"solo": summarize(solo, solo_wall), "levels": []}
    for c in levels:
        batch = [items[i % len(items)] for i in range(c)]
        results, wall = await run_batch(url, batch, c, headers)
        level = {"concurrency": c, **summarize(results, wall)}
        level["mismatches"] = [r.index for r in results
                               if r.status == 200 and not r.error and r.text != solo[r.index % len(items)].text]
        report["levels"].append(level)
    return report


def workload_items(names: list[str] | None, max_tokens: int) -> list[tuple[str, dict]]:
    """Greedy, speculation-on request bodies from benchmarks/workloads/*.json."""
    items = []
    for f in sorted(WORKLOADS.glob("*.json")):
        w = json.loads(f.read_text())
        if names and w["name"] not in names:
            continue
        for p in w["prompts"]:
            if p["kind"] not in ("chat", "completion"):  # multi-turn sessions: bench_speculative
                continue
            body = {"max_tokens": min(max_tokens, w.get("max_tokens", max_tokens)), "temperature": 0,
                    "speculative": {"method": "auto"}}
            if p["kind"] == "chat":
                items.append(("/v1/chat/completions", {**body, "messages": p["messages"]}))
            else:
                items.append(("/v1/completions", {**body, "prompt": p["prompt"]}))
    return items


def print_report(report: dict) -> None:
    cols = ["concurrency", "requests", "server_errors", "latency_p50_s", "latency_p99_s", "ttft_p50_s",
            "ttft_p99_s", "tokens_per_s", "mean_acceptance_length"]
    print(" | ".join(cols) + " | identical")
    for level in [{"concurrency": 1, **report["solo"], "mismatches": []}, *report["levels"]]:
        print(" | ".join(str(level.get(c)) for c in cols) + f" | {not level['mismatches']}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--workloads", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
    items = workload_items(args.workloads.split(",") if args.workloads else None, args.max_tokens)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    report = asyncio.run(load_test(args.url, items, args.concurrency, headers))
    models = httpx.get(args.url + "/v1/models", headers=headers).json()["data"]
    report["meta"] = {"url": args.url, "model": models[0]["id"] if models else None, "max_tokens": args.max_tokens,
                      "bodies": len(items), "machine": platform.platform(), "python": sys.version.split()[0],
                      "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    print_report(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
