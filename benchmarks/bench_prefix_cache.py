"""Prefix cache benchmark: a multi-turn agent session with the cache on vs off, side by side.

The session is what agent clients send: a long system prompt (tool definitions and a file the
agent works on), then turns that resend the whole conversation plus a new user message. Each
turn's prompt runs on two engines sharing one loaded model, the prefix cache off and on, back to
back (order alternating by turn, so machine noise hits both alike). Greedy; the two outputs
must be identical token for token. The assistant's reply is appended to the conversation before
the next turn.

Reported per turn: prompt tokens, cached tokens, time to first token (TTFT) off and on and
their ratio, and the same for the whole request.

``--shared N`` then sends N copies of the first turn's prompt at once (an ``n = N`` request, or
N agents starting with one system prompt) to each engine, under a fresh ``cache_salt`` so no
earlier entry helps: with the cache on, the copies that arrive during the first one's prefill
wait for it and reuse its chunks. Reported: wall time until all N finish, TTFT median and
maximum, cached tokens, and whether every copy equals the single-request output.

``--first-method dspark`` first sends each turn's prompt as a one-token request that runs DSpark
(forced to draft, so its prefill taps the prompt's hidden rows) to both engines, under a cache salt
of that turn's own, and the measured request (``--method``) follows under the same salt: the
cache-on engine can then reuse only what the DSpark request stored (a plain request reads entries
stored with DSpark taps; ``engine/prefix_cache.py``).

    python -m benchmarks.bench_prefix_cache --out benchmarks/results/prefix_cache_cpu.json
    python -m benchmarks.bench_prefix_cache --first-method dspark --method prompt_lookup \
        --out benchmarks/results/prefix_cache_tapped_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, SpeculativeParams
from engine.loader import load_target

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [
    {"name": "read_file", "description": "Read a text file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "write_file", "description": "Replace a file's content.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}},
    {"name": "run_tests", "description": "Run the test suite, or one test file, and return its output.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
    {"name": "search", "description": "Search the repository for a string; returns matching lines.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
]
TURNS = [
    "Explain briefly what `StopMatcher.feed` returns.",
    "Write a unit test for a stop string that arrives split over two calls.",
    "What happens when two stop strings overlap? Answer in two sentences.",
    "Call the tool that runs the tests for this file.",
    "Suggest one rename that would make the code clearer, as a tool call that writes the file.",
]


def system_prompt(file: Path) -> str:
    source = file.read_text()
    return ("You are a coding agent. You may call these tools by answering with one JSON object "
            '{"tool": name, "arguments": {...}}:\n' + json.dumps(TOOLS, indent=2) +
            f"\n\nThe user is working on `{file.relative_to(ROOT)}`:\n```python\n{source}\n```")


def run_turn(eng: Engine, tokens: list[int], max_tokens: int, method: str, salt: str | None = None,
             min_draft: int = 0) -> dict:
    speculative = SpeculativeParams(method=method, min_draft_tokens=min_draft)
    req = GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0),
                            speculative=speculative, cache_salt=salt)
    start = time.perf_counter()
    ids, ttft, last = [], None, None
    for event in eng.generate(req, timeout=3600):
        if event.error is not None:
            raise RuntimeError(event.error)
        if event.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        ids += event.token_ids
        last = event
    return {"ids": ids, "ttft": ttft, "total_s": time.perf_counter() - start, "cached": last.cached_tokens}


def shared_prompt(eng: Engine, tokens: list[int], copies: int, max_tokens: int, method: str) -> dict:
    """``copies`` identical requests at once (fresh cache salt); wall time, TTFTs, cached tokens."""
    from concurrent.futures import ThreadPoolExecutor

    salt = f"shared-{time.time_ns()}"
    start = time.perf_counter()
    with ThreadPoolExecutor(copies) as pool:
        res = list(pool.map(lambda _: run_turn(eng, tokens, max_tokens, method, salt), range(copies)))
    ttfts = sorted(r["ttft"] for r in res)
    return {"wall_s": time.perf_counter() - start, "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1],
            "cached_tokens": sorted(r["cached"] for r in res), "ids": [r["ids"] for r in res]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--file", default=str(ROOT / "engine" / "stops.py"), help="the file in the system prompt")
    ap.add_argument("--turns", type=int, default=len(TURNS))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--method", default="auto", help="speculation method of every request")
    ap.add_argument("--prefill-step", type=int, default=EngineConfig.prefill_step)
    ap.add_argument("--weights", default="auto", help="SPECSERVE_WEIGHTS")
    ap.add_argument("--kernels", default="off", choices=["auto", "off"], help="SPECSERVE_KERNELS")
    ap.add_argument("--shared", type=int, default=0, help="then N copies of turn 1's prompt at once")
    ap.add_argument("--first-method", default=None,
                    help="send each turn's prompt first as a 1-token request of this method, under the turn's own "
                         "salt (dspark: loads the drafter and forces its drafts)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    loaded = load_target(args.model, weights=args.weights)
    tok = loaded.tokenizer
    cfg = dict(speculation="auto", prefill_step=args.prefill_step, kernels=args.kernels,
               dspark="dspark" in (args.method, args.first_method))
    engines = {"off": Engine(EngineConfig(prefix_cache_bytes=0, **cfg), loaded=loaded).start(wait=True),
               "on": Engine(EngineConfig(**cfg), loaded=loaded).start(wait=True)}
    messages = [{"role": "system", "content": system_prompt(Path(args.file))}]
    turns = []
    try:
        for i, question in enumerate(TURNS[: args.turns]):
            messages.append({"role": "user", "content": question})
            tokens = list(tok.apply_chat_template(messages, add_generation_prompt=True))
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            salt = None
            if args.first_method:
                salt = f"turn-{i}-{time.time_ns()}"
                for name in order:
                    run_turn(engines[name], tokens, 1, args.first_method, salt, min_draft=1)
            res = {name: run_turn(engines[name], tokens, args.max_tokens, args.method, salt) for name in order}
            identical = res["off"]["ids"] == res["on"]["ids"]
            turns.append({
                "turn": i + 1, "prompt_tokens": len(tokens), "cached_tokens": res["on"]["cached"],
                "ttft_off_s": res["off"]["ttft"], "ttft_on_s": res["on"]["ttft"],
                "ttft_ratio": res["off"]["ttft"] / res["on"]["ttft"],
                "total_off_s": res["off"]["total_s"], "total_on_s": res["on"]["total_s"],
                "completion_tokens": len(res["on"]["ids"]), "identical": identical,
            })
            print(json.dumps(turns[-1]), flush=True)
            messages.append({"role": "assistant", "content": tok.decode(res["on"]["ids"])})
        shared = None
        if args.shared:
            first = list(tok.apply_chat_template(messages[:2], add_generation_prompt=True))
            solo = run_turn(engines["off"], first, args.max_tokens, args.method)["ids"]
            shared = {name: shared_prompt(engines[name], first, args.shared, args.max_tokens, args.method)
                      for name in ("off", "on")}
            for r in shared.values():
                r["identical"] = all(ids == solo for ids in r.pop("ids"))
            shared["wall_ratio"] = shared["off"]["wall_s"] / shared["on"]["wall_s"]
            print(json.dumps({"shared": shared}), flush=True)
    finally:
        for eng in engines.values():
            eng.stop()
    report = {"machine": platform.platform(), "python": sys.version.split()[0], "model": loaded.name,
              "weights": loaded.weights, "prefill_step": args.prefill_step, "method": args.method,
              "first_method": args.first_method,
              "max_tokens": args.max_tokens, "prefix_cache": engines["on"].prefix_cache_info(), "turns": turns,
              "shared": shared}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    bad = [t["turn"] for t in turns if not t["identical"]]
    if shared and not (shared["off"]["identical"] and shared["on"]["identical"]):
        bad.append("shared")
    if bad:
        print(f"outputs differ with the prefix cache on turns {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
