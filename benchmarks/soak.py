"""Soak test (not in CI): a mixed, partly faulty client load against a running server for N
minutes; reports memory growth and errors.

Each of ``--concurrency`` workers loops over a weighted mix until the time is up:

    stream      greedy stream, speculation on, must end with [DONE] and no error event   40%
    complete    sampled non-streaming completion or chat, must be 200                      20%
    drop        stream abandoned after its first chunk (client disconnect)                 15%
    abandon     non-streaming request whose client gives up mid-generation                 10%
    malformed   invalid body (bad JSON, wrong types, huge numbers): must be a 4xx envelope  10%
    long        a long repetitive prompt (prefill + prompt lookup)                           5%

429 (queue full) is counted as ``rejected``, not as an error. The server's resident memory is
sampled every ``--sample-s`` seconds from /metrics (``process_resident_memory_bytes``, Linux) or,
with ``--pid``, from ``ps``. Reported: requests by kind and outcome, 5xx and unexpected results,
RSS first/last/max, growth after the first minute (warm-up: allocator pools, caches), a
least-squares slope (MiB/min) over the samples after warm-up, and whether the engine went back
to zero running and waiting requests at the end.

    specserve &
    python -m benchmarks.soak --url http://127.0.0.1:8000 --minutes 10 --concurrency 8 \\
        --out benchmarks/results/soak_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

KINDS = {"stream": 40, "complete": 20, "drop": 15, "abandon": 10, "malformed": 10, "long": 5}
WORDS = "the quick brown fox jumps over the lazy dog while a cat sleeps on the warm mat".split()
MALFORMED = [
    b"{not json", b'{"prompt": "a", "max_tokens": "many"}', b'{"prompt": "a", "temperature": 1e400}',
    b'{"prompt": [99999999999]}', b'{"prompt": "\\ud800"}', b'{"messages": []}', b"[]",
    b'{"prompt": "a", "n": 1000}', b'{"prompt": "a", "logit_bias": {"x": 1}}', b"\xff\xfe\x00",
]


def _prompt(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _stream(client, path, body, drop: bool) -> str:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return f"http_{r.status_code}"
        async for line in r.aiter_lines():
            if drop and line.startswith("data: "):
                return "ok"  # hang up after the first chunk
            if line.startswith("data: {") and '"error"' in line[:20]:
                return "error_event"
            if line == "data: [DONE]":
                return "ok"
    return "truncated"


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
    """Run one request of ``kind``; returns its outcome label."""
    chat = rng.random() < 0.4
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text = _prompt(rng, rng.randrange(5, 60))
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body |= {"max_tokens": rng.randrange(8, 64), "temperature": 0, "speculative": {"method": "auto"}}
    try:
        if kind in ("stream", "drop"):
            return await _stream(client, path, body, drop=kind == "drop")
        if kind == "long":
            body = {"prompt": (_prompt(rng, 30) + "\n") * 6, "max_tokens": 64, "temperature": 0}
            return await _stream(client, "/v1/completions", body, drop=False)
        if kind == "complete":
            body |= {"temperature": 0.8, "seed": rng.randrange(1 << 30), "n": rng.choice([1, 2])}
            r = await client.post(path, json=body)
            return "ok" if r.status_code == 200 else f"http_{r.status_code}"
        if kind == "abandon":
            try:
                await client.post(path, json={**body, "max_tokens": 512}, timeout=rng.uniform(0.05, 0.5))
            except httpx.TimeoutException:
                pass
            return "ok"
        r = await client.post("/v1/completions", content=rng.choice(MALFORMED),
                              headers={"Content-Type": "application/json"})
        good = 400 <= r.status_code < 500 and "error" in r.json()
        return "ok" if good else f"http_{r.status_code}"
    except httpx.HTTPError as exc:
        return f"transport_{type(exc).__name__}"


def _rss_from_metrics(text: str) -> float | None:
    m = re.search(r"^process_resident_memory_bytes ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def sample_rss(client: httpx.AsyncClient, pid: int | None) -> float | None:
    """Server RSS in MiB: /metrics on Linux, else ``ps -o rss=`` of ``pid``."""
    if pid is not None:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout
        return int(out.strip()) / 1024 if out.strip() else None
    rss = _rss_from_metrics((await client.get("/metrics")).text)
    return rss / 2**20 if rss is not None else None


async def soak(url: str, minutes: float, concurrency: int, sample_s: float, pid: int | None,
               headers: dict | None, seed: int = 0) -> dict:
    deadline = time.monotonic() + minutes * 60
    outcomes: Counter = Counter()
    samples: list[tuple[float, float]] = []
    started = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:
        async def worker(w: int):
            rng = random.Random(seed * 1000 + w)
            while time.monotonic() < deadline:
                kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
                outcomes[(kind, await one(client, kind, rng))] += 1

        async def sampler():
            while time.monotonic() < deadline:
                rss = await sample_rss(client, pid)
                if rss is not None:
                    samples.append((time.monotonic() - started, rss))
                await asyncio.sleep(sample_s)

        await asyncio.gather(sampler(), *(worker(w) for w in range(concurrency)))
        drained = await _wait_idle(client)
        rss = await sample_rss(client, pid)
        if rss is not None:
            samples.append((time.monotonic() - started, rss))
    return report(outcomes, samples, drained, minutes, concurrency)


async def _wait_idle(client: httpx.AsyncClient, timeout: float = 60) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = (await client.get("/metrics")).text
        busy = re.findall(r"^specserve:num_requests_(?:running|waiting) ([0-9.e+]+)$", text, re.M)
        if busy and all(float(v) == 0 for v in busy):
            return True
        await asyncio.sleep(0.5)
    return False


def report(outcomes: Counter, samples: list[tuple[float, float]], drained: bool, minutes: float,
           concurrency: int) -> dict:
    by_kind: dict = {}
    for (kind, outcome), n in outcomes.items():
        by_kind.setdefault(kind, {})[outcome] = n
    bad = {f"{k}:{o}": n for (k, o), n in outcomes.items() if o not in ("ok", "http_429")}
    out = {
        "minutes": minutes, "concurrency": concurrency, "requests": sum(outcomes.values()),
        "rejected_429": sum(n for (_, o), n in outcomes.items() if o == "http_429"),
        "server_errors": sum(n for (_, o), n in outcomes.items() if o.startswith("http_5")),
        "unexpected": bad, "by_kind": by_kind, "engine_idle_at_end": drained,
        "rss_samples_mib": [(round(t, 1), round(r, 1)) for t, r in samples],
    }
    if samples:
        warm = [(t, r) for t, r in samples if t >= 60] or samples
        out |= {"rss_first_mib": round(samples[0][1], 1), "rss_last_mib": round(samples[-1][1], 1),
                "rss_max_mib": round(max(r for _, r in samples), 1),
                "rss_growth_after_warmup_mib": round(samples[-1][1] - warm[0][1], 1)}
        if len(warm) >= 3:
            slope = np.polyfit([t / 60 for t, _ in warm], [r for _, r in warm], 1)[0]
            out["rss_slope_mib_per_min"] = round(float(slope), 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--pid", type=int, default=None, help="server pid (when /metrics has no process_* series)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    result = asyncio.run(soak(args.url, args.minutes, args.concurrency, args.sample_s, args.pid, headers))
    summary = {k: v for k, v in result.items() if k != "rss_samples_mib"}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
