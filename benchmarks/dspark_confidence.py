"""Where DSpark's greedy drafts miss: acceptance by how sure the target is of its own choice.

For each held-out set of ``benchmarks/dspark_eval.py`` (the fixed sets, and with
``--run-prompts`` a training run's held-out sets), the greedy loop
``drafters.dspark.train.evaluate_acceptance`` runs as there; at every draft slot the loop
reaches, it records the target's probability of its own argmax (``p_top1``, softmax of the
verify pass's logits at that slot) and whether the draft matched. It reports, for the first slot
and for all reached slots, the share of slots and the acceptance in ``p_top1`` bins. Where
the target itself is unsure (a near tie), a greedy match is close to a coin flip for any
drafter; where it is sure, a miss is the drafter's.

    python -m benchmarks.dspark_confidence models/dspark-smollm2-135m-instruct \\
        --run-prompts run/data/prompts.jsonl.gz --out dspark_confidence_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from benchmarks.dspark_eval import prompt_sets, run_prompt_sets
from drafters.dspark.data import encode_prompt
from drafters.dspark.loader import load_dspark
from drafters.dspark.target import TargetTaps
from drafters.dspark.train import evaluate_acceptance
from engine.loader import load_target

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def by_confidence(slots: np.ndarray) -> dict:
    """``slots`` ``[n, 3]`` rows ``(slot index, p_top1, matched)`` -> share and acceptance per
    ``p_top1`` bin, for the first slot and for all."""
    out = {}
    for name, rows in (("first_slot", slots[slots[:, 0] == 0]), ("all_slots", slots)):
        bins = []
        for i, (lo, hi) in enumerate(zip(BINS, BINS[1:])):
            inside = (rows[:, 1] >= lo) & ((rows[:, 1] < hi) if i < len(BINS) - 2 else (rows[:, 1] <= hi))
            bins.append({"p_top1": [lo, hi], "share": round(float(inside.mean()), 3) if len(rows) else None,
                         "acceptance": round(float(rows[inside, 2].mean()), 3) if inside.any() else None})
        out[name] = {"slots": int(len(rows)), "acceptance": round(float(rows[:, 2].mean()), 3) if len(rows) else None,
                     "bins": bins}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter")
    ap.add_argument("--target", default="default")
    ap.add_argument("--run-prompts", default=None, help="a training run's prompts.jsonl[.gz]: add its held-out sets")
    ap.add_argument("--per-source", type=int, default=10)
    ap.add_argument("--sets", default=None, help="comma-separated set names to run (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = load_target(args.target)
    sets = prompt_sets()
    if args.run_prompts:
        sets.update(run_prompt_sets(args.run_prompts, args.per_source))
    if args.sets:
        unknown = set(args.sets.split(",")) - set(sets)
        if unknown:
            ap.error(f"unknown sets {sorted(unknown)}; known: {sorted(sets)}")
        sets = {k: v for k, v in sets.items() if k in args.sets.split(",")}
    net = load_dspark(args.drafter)
    taps = TargetTaps(target.model, net.config.target_layer_ids)
    out = {"_setup": {"drafter": args.drafter, "target": f"{target.name} ({target.weights})",
                      "prompts": {k: [r.id for r in v[0]] for k, v in sets.items()}}}
    for name, (records, n) in sets.items():
        slots = []

        def record(logits, drafts, accepted, slots=slots):
            reached = min(accepted + 1, len(drafts))
            p_top1 = mx.softmax(logits[:reached].astype(mx.float32), axis=-1).max(axis=-1).tolist()
            slots.extend((k, p_top1[k], float(k < accepted)) for k in range(reached))

        prompts = [encode_prompt(target.tokenizer, r) for r in records]
        res = evaluate_acceptance(taps, net, prompts, target.eos_token_ids, n, on_cycle=record)
        out[name] = {"mean_acceptance_length": res["mean_acceptance_length"], **by_confidence(np.array(slots))}
        first = out[name]["first_slot"]
        print(name, res["mean_acceptance_length"], first["acceptance"],
              [(b["p_top1"][0], b["share"], b["acceptance"]) for b in first["bins"]], flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
