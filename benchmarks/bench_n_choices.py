"""``n`` choices of one prompt: sharing its whole prefill chunks vs copying one whole prefill.

The ``n`` choices of a request (or the same prompt sent several times at once) arrive together.
With the copy (``Engine._prompt_twin``, the default) the first choice prefills the prompt and the
others wait for it, then copy every position but the last; without it (the baseline, the method
replaced for the run: the behaviour before the copy existed) the others wait only for the
prompt's whole chunks, reuse them through the prefix cache and prefill the rest each. One engine,
prefix cache on, a fresh ``cache_salt`` per round (no earlier round helps), rounds alternating
between the two; greedy, and every choice's output must be the same in both.

    python -m benchmarks.bench_n_choices --out benchmarks/results/n_choices_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def choices_at_once(eng: Engine, prompt: list[int], n: int, max_tokens: int, tag: str) -> tuple[float, list, list]:
    """Submit ``n`` greedy requests for ``prompt`` at once; returns (seconds until all end,
    their outputs, their cached_tokens)."""
    async def go():
        requests = [GenerationRequest(prompt_tokens=list(prompt), max_tokens=max_tokens, request_id=f"{tag}-{i}",
                                      sampling=SamplingParams(temperature=0.0), cache_salt=tag) for i in range(n)]
        started = time.perf_counter()
        streams = [eng.submit(r) for r in requests]

        async def drain(stream):
            return [e async for e in stream]
        results = await asyncio.gather(*(drain(s) for s in streams))
        return time.perf_counter() - started, results

    seconds, results = asyncio.run(go())
    for events in results:
        if events[-1].error is not None:
            raise RuntimeError(f"request failed: {events[-1].error}")
    return (seconds, [[t for e in events for t in e.token_ids] for events in results],
            [events[-1].cached_tokens for events in results])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt-tokens", type=int, default=501)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    eng = Engine(EngineConfig(model=args.model)).start(wait=True, timeout=1800)
    copy = eng._prompt_twin
    source = "".join(p.read_text() for p in sorted((ROOT / "engine").glob("*.py")))
    prompt = eng.loaded.tokenizer.encode(source)[: args.prompt_tokens]
    runs: dict[str, list[dict]] = {"whole chunks shared": [], "one prefill, copied": []}
    outputs: dict[str, list] = {}
    try:
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                eng._prompt_twin = copy if name == "one prefill, copied" else (lambda request, dspark: None)
                seconds, outs, cached = choices_at_once(eng, prompt, args.n, args.max_tokens, f"r{r}-{name}")
                outputs.setdefault(name, outs)
                runs[name].append({"seconds": seconds, "cached_tokens": cached, "same_outputs": outs == outputs[name]})
                print(f"round {r + 1} {name}: {seconds:.2f} s, cached_tokens {cached}", flush=True)
    finally:
        eng._prompt_twin = copy
        eng.stop()
    summary = {name: statistics.median(x["seconds"] for x in rs) for name, rs in runs.items()}
    identical = outputs["whole chunks shared"] == outputs["one prefill, copied"] and \
        all(x["same_outputs"] for rs in runs.values() for x in rs)
    result = {"model": eng.loaded.name, "weights": eng.loaded.weights, "prompt_tokens": len(prompt), "n": args.n,
              "max_tokens": args.max_tokens, "runs": runs, "median_seconds": summary,
              "speedup": summary["whole chunks shared"] / summary["one prefill, copied"], "identical": identical,
              "platform": platform.platform(), "processor": platform.processor()}
    print(f"median: {summary}; speedup {result['speedup']:.2f}x; outputs identical: {identical}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if not identical:
        raise SystemExit("outputs differ between the two ways")
    return result


if __name__ == "__main__":
    main()
