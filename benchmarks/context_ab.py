"""Is the cost model's context term worth it? A paired A/B on long prompts, one engine.

The scheduler prices a ``k``-row verify pass over ``n`` context tokens at
``T(k) + (a + b (k - 1)) (n - n_ref)`` (engine/scheduler.py ``CostModel``; ``a``, ``b`` fitted at
start-up). This runs long prompts (standard-library modules quoted in a chat turn: copy the
module's last function with a rename, which prompt lookup drafts well, and summarise the module,
which it drafts badly) through prompt lookup with two cost models side by side in one engine:
``context`` (the engine's, fitted slopes) and ``no_context`` (the same start-up curve with both
slopes 0, the model before the thirteenth session). Each keeps its own online state (it is
swapped into the engine between requests); the order alternates between repeats. Outputs must be
identical (greedy); the report gives decode tokens/s per variant and their ratio.

    python -m benchmarks.context_ab --lengths 1500,3000 --repeats 2 --out context_ab.json
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from benchmarks.bench_speculative import run_once
from engine import Engine, EngineConfig

MODULES = ("textwrap", "shlex", "difflib", "argparse")


def long_prompts(tok, length: int) -> list[dict]:
    """Two chat prompts quoting about ``length`` tokens of a standard-library module."""
    out = []
    for name in MODULES:
        source = inspect.getsource(__import__(name))
        ids = tok.encode(source)
        if len(ids) < length:
            continue
        code = tok.decode(ids[:length]).rsplit("\ndef ", 1)[0]  # end on a whole function
        body = f"Here is part of Python's `{name}` module:\n\n```python\n{code}\n```\n\n"
        out.append({"name": f"{name}_copy_{length}",
                    "messages": [{"role": "user", "content": body + "Repeat the last function above exactly, "
                                  "but rename it to `renamed_function`."}]})
        out.append({"name": f"{name}_summary_{length}",
                    "messages": [{"role": "user", "content": body + "Explain in a few paragraphs what this "
                                  "code does."}]})
        return out
    raise SystemExit(f"no module in {MODULES} has {length} tokens")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1500,3000", help="prompt lengths (tokens, roughly)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    eng = Engine(EngineConfig(speculation="prompt_lookup")).start(wait=True)
    try:
        tok = eng.loaded.tokenizer
        models = {"context": eng.cost, "no_context": copy.deepcopy(eng.cost)}
        models["no_context"].context_slope = models["no_context"].context_row_slope = 0.0
        report = {"model": eng.info(), "slopes_s_per_token": [eng.cost.context_slope, eng.cost.context_row_slope],
                  "prompts": {}}
        for length in (int(x) for x in args.lengths.split(",")):
            for p in long_prompts(tok, length):
                tokens = list(tok.apply_chat_template(p["messages"], add_generation_prompt=True))
                for name in models:  # warm-up (and each variant's first look at this length)
                    eng.cost = models[name]
                    run_once(eng, tokens, "prompt_lookup", 16)
                rows: dict[str, list[dict]] = {name: [] for name in models}
                for rep in range(args.repeats):
                    for name in (list(models) if rep % 2 == 0 else list(models)[::-1]):
                        eng.cost = models[name]
                        rows[name].append(run_once(eng, tokens, "prompt_lookup", args.max_tokens))
                ids = {name: [r["ids"] for r in rs] for name, rs in rows.items()}
                rate = {name: statistics.median(r["tokens"] / r["decode_s"] for r in rs if r["decode_s"] > 0)
                        for name, rs in rows.items()}
                entry = {"prompt_tokens": len(tokens), "identical": ids["context"] == ids["no_context"],
                         "tok_s": {k: round(v, 2) for k, v in rate.items()},
                         "context_over_no_context": round(rate["context"] / rate["no_context"], 3),
                         "drafted": {k: sum(r["drafted"] for r in rs) for k, rs in rows.items()},
                         "accepted": {k: sum(r["accepted"] for r in rs) for k, rs in rows.items()},
                         "verify_steps": {k: sum(r["verify_steps"] for r in rs) for k, rs in rows.items()}}
                report["prompts"][p["name"]] = entry
                print(p["name"], json.dumps(entry))
        eng.cost = models["context"]
    finally:
        eng.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
