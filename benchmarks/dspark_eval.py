"""Held-out greedy acceptance of DSpark drafters on the default target, side by side.

Prompt sets (none used in training): raw HumanEval completions HumanEval/0..9 (96 new tokens);
the first 10 held-out instructions of the held-out families (``drafters.dspark.data.
HELDOUT_FAMILIES``; 96 tokens); the first 4 held-out instructions of training families (64
tokens); instructions come from ``instruction_prompts(3000, seed 0)``. The loop is
``drafters.dspark.train.evaluate_acceptance``: a full block every cycle, greedy; it reports the
mean acceptance length (bonus included) and acceptance per position.

    python -m benchmarks.dspark_eval --out benchmarks/results/dspark_eval_cpu_v2.json \\
        v1=path/to/old-drafter v2=models/dspark-smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from drafters.dspark.data import (
    HELDOUT_FAMILIES,
    encode_prompt,
    humaneval_prompts,
    instruction_prompts,
)
from drafters.dspark.loader import load_dspark
from drafters.dspark.target import TargetTaps
from drafters.dspark.train import evaluate_acceptance
from engine.loader import load_target


def prompt_sets() -> dict:
    """``name -> (prompt records, new tokens)``."""
    he = [r for r in humaneval_prompts() if r.id.endswith(":raw")][:10]
    ins = [r for r in instruction_prompts(3000, 0) if r.split == "eval"]
    held = [r for r in ins if r.id.split(":")[1] in HELDOUT_FAMILIES][:10]
    fam = [r for r in ins if r.id.split(":")[1] not in HELDOUT_FAMILIES][:4]
    return {"humaneval_raw": (he, 96), "instruct_heldout": (held, 96), "instruct_trainfamily_heldout": (fam, 64)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="NAME=DRAFTER_DIR")
    ap.add_argument("--target", default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = load_target(args.target)
    sets = prompt_sets()
    out = {"_setup": {"target": f"{target.name} ({target.weights})",
                      "loop": "drafters.dspark.train.evaluate_acceptance (full block every cycle, greedy)",
                      "prompts": {k: [r.id for r in v[0]] for k, v in sets.items()},
                      "max_new_tokens": {k: v[1] for k, v in sets.items()}}}
    for spec in args.drafters:
        name, path = spec.split("=", 1)
        net = load_dspark(path)
        taps = TargetTaps(target.model, net.config.target_layer_ids)
        res = {"drafter": path}
        for key, (records, n) in sets.items():
            start = time.perf_counter()
            prompts = [encode_prompt(target.tokenizer, r) for r in records]
            r = evaluate_acceptance(taps, net, prompts, target.eos_token_ids, n)
            r["seconds"] = round(time.perf_counter() - start, 1)
            res[key] = r
            print(name, key, r["mean_acceptance_length"], r["acceptance_per_position"], r["seconds"], flush=True)
        out[name] = res
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
