"""Load (tiny model, loopback, sized for 2 CPU cores): 16 and 64 concurrent greedy streams with
speculation on; every output equals the same request served alone; no 5xx. Prints p50/p99
latency and tokens/s (``pytest -s``); benchmarks/load.py runs the same against any server."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
from helpers import assert_no_leaks

from benchmarks.load import load_test


def _bodies() -> list[tuple[str, dict]]:
    rng = random.Random(7)
    prompts = ["abcabcabcabc abc", "the cat sat on the mat. the cat sat on", "0 1 2 3 4 0 1 2 3 4 0 1",
               "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "xyzxyzxyz", "hello hello hello"]
    prompts += ["".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(5, 40))) for _ in range(8)]
    # (min_draft_tokens: drafting whatever the start-up cost curve says, which on a loaded machine
    # can be that no draft pays)
    body = {"max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "speculative": {"method": "auto", "min_draft_tokens": 2}}
    items = [("/v1/completions", {**body, "prompt": p}) for p in prompts]
    items += [("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": p}]})
              for p in ("abc abc abc", "repeat: one two one two")]
    return items


def test_16_and_64_concurrent_streams_equal_solo_outputs(tiny_server):
    items = _bodies()
    assert len(items) == 16
    report = asyncio.run(load_test(tiny_server.url, items, [16, 64]))
    print("\nload (tiny model):", json.dumps(report, indent=1))
    assert report["solo"]["errors"] == {} and report["solo"]["completion_tokens"] == 16 * 32
    for level in report["levels"]:
        assert level["errors"] == {} and level["server_errors"] == 0, level
        assert level["mismatches"] == [], level
        assert level["completion_tokens"] == level["concurrency"] * 32
        assert level["num_drafts"] > 0  # speculation was on and drafting
        assert 0 < level["latency_p50_s"] <= level["latency_p99_s"] and level["tokens_per_s"] > 0
    assert_no_leaks(tiny_server.engine)
    assert httpx.get(tiny_server.url + "/health").json()["status"] == "ok"
