"""Where DSpark's greedy drafts miss: acceptance by how sure the target is of its own choice.

For each held-out set of ``benchmarks/dspark_eval.py`` (the fixed sets, and with
``--run-prompts`` a training run's held-out sets), the greedy loop
``drafters.dspark.train.evaluate_acceptance`` runs as there; at every draft slot the loop
reaches, it records the target's probability of its own argmax (``p_top1``, softmax of the
verify pass's logits at that slot) and whether the draft matched. It reports, for the first slot
and for all reached slots, the share of slots and the acceptance in ``p_top1`` bins. Where
the target itself is unsure (a near tie), a greedy match is close to a coin flip for any
drafter; where it is sure, a miss is the drafter's.

It also checks the drafter's own confidence head, which sets the engine's draft lengths: the
mean predicted prefix survival ``prod_{i<=k} c_i`` of each cycle's full block against the
share of cycles whose first ``k`` drafts were all accepted (``confidence_head``).
``--workloads`` adds benchmark workloads (``benchmarks/workloads``, e.g. novel_code,novel_chat:
the texts the engine benchmarks draft on) as sets of their own, at 128 tokens.

    python -m benchmarks.dspark_confidence models/dspark-smollm2-135m-instruct \\
        --run-prompts run/data/prompts.jsonl.gz --workloads novel_code,novel_chat --out dspark_confidence_cpu.json
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

from benchmarks.bench_speculative import load_workloads, prompt_tokens
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


def confidence_head(cycles: list[tuple[list[float], int]]) -> dict:
    """``cycles`` of ``(confidence [c_1..c_B], accepted)`` -> mean predicted prefix survival
    (``prod_{i<=k} c_i``) and the realised share of cycles with the first ``k`` accepted, per
    slot ``k`` (``None`` when the drafter has no confidence head)."""
    if not cycles or cycles[0][0] is None:
        return {"predicted_prefix_survival": None, "realised_prefix_survival": None}
    b = min(len(c) for c, _ in cycles)
    conf = np.array([c[:b] for c, _ in cycles], dtype=np.float64)
    accepted = np.array([a for _, a in cycles])
    return {"predicted_prefix_survival": np.cumprod(conf, axis=1).mean(axis=0).round(3).tolist(),
            "realised_prefix_survival": [round(float((accepted >= k + 1).mean()), 3) for k in range(b)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter")
    ap.add_argument("--target", default="default")
    ap.add_argument("--run-prompts", default=None, help="a training run's prompts.jsonl[.gz]: add its held-out sets")
    ap.add_argument("--per-source", type=int, default=10)
    ap.add_argument("--sets", default=None, help="comma-separated set names to run (default: all; empty: none)")
    ap.add_argument("--workloads", default=None, help="comma-separated benchmark workloads to add as sets")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = load_target(args.target)
    sets = prompt_sets()
    if args.run_prompts:
        sets.update(run_prompt_sets(args.run_prompts, args.per_source))
    if args.sets is not None:  # (`--sets=`: none of them, e.g. with --workloads)
        chosen = [x for x in args.sets.split(",") if x]
        unknown = set(chosen) - set(sets)
        if unknown:
            ap.error(f"unknown sets {sorted(unknown)}; known: {sorted(sets)}")
        sets = {k: v for k, v in sets.items() if k in chosen}
    net = load_dspark(args.drafter)
    taps = TargetTaps(target.model, net.config.target_layer_ids)
    out = {"_setup": {"drafter": args.drafter, "target": f"{target.name} ({target.weights})",
                      "prompts": {k: [r.id for r in v[0]] for k, v in sets.items()}}}
    runs = {name: ([encode_prompt(target.tokenizer, r) for r in records], n) for name, (records, n) in sets.items()}
    for w in load_workloads(args.workloads.split(",")) if args.workloads else []:
        runs[w["name"]] = ([prompt_tokens(target.tokenizer, p) for p in w["prompts"]], 128)
    for name, (prompts, n) in runs.items():
        slots, cycles = [], []

        def record(logits, drafts, accepted, confidence, slots=slots, cycles=cycles):
            reached = min(accepted + 1, len(drafts))
            p_top1 = mx.softmax(logits[:reached].astype(mx.float32), axis=-1).max(axis=-1).tolist()
            slots.extend((k, p_top1[k], float(k < accepted)) for k in range(reached))
            cycles.append((confidence, accepted))

        res = evaluate_acceptance(taps, net, prompts, target.eos_token_ids, n, on_cycle=record)
        out[name] = {"mean_acceptance_length": res["mean_acceptance_length"], **by_confidence(np.array(slots)),
                     "confidence_head": confidence_head(cycles)}
        first = out[name]["first_slot"]
        print(name, res["mean_acceptance_length"], first["acceptance"],
              [(b["p_top1"][0], b["share"], b["acceptance"]) for b in first["bins"]], flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
