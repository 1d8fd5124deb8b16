"""Merge an earlier run's self-distillation data into a new run's, for a drafter trained on both.

    python -m benchmarks.gpu.merge_dspark_data --base old/examples.jsonl.gz --base-prompts \\
        old/prompts.jsonl.gz --into run/data

``--into`` holds ``examples.jsonl`` and ``prompts.jsonl`` as ``train-dspark --generate-only``
writes them (a run with another ``--seed``, so other prompts); both files are rewritten with the
base rows first (so ``benchmarks/dspark_eval.py --run-prompts`` on the merged prompt file
evaluates the base run's held-out prompts first, and can compare the old drafter with the new
one on them). Splits are hashed from file paths and texts (``drafters.dspark.data``), so they
agree between seeds; on top of that:

* ids the two runs share for different prompts get a ``#<suffix>`` on the new run's side;
* a training example whose prompt tokens equal a held-out prompt's, or a self-instruct
  question that looks like a held-out family (``looks_like_heldout_family``; runs before the
  fourteenth session did not screen for them), is dropped;
* training examples with the same prompt tokens are kept once (the base run's).

Prints and returns a summary (rows kept and dropped per reason).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from drafters.dspark.data import looks_like_heldout_family


def _read(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def _question(prompt: dict) -> str:
    return prompt.get("text") or prompt["messages"][-1]["content"]


def merge(base_examples: list[dict], base_prompts: list[dict], new_examples: list[dict],
          new_prompts: list[dict], suffix: str = "s1") -> tuple[list[dict], list[dict], dict]:
    """Returns ``(examples, prompts, summary)``; see the module docstring for the rules."""
    base_ids = {r["id"] for r in base_prompts} | {r["id"] for r in base_examples}
    new_text = {r["id"]: _question(r) for r in new_prompts}
    base_text = {r["id"]: _question(r) for r in base_prompts}
    renamed: dict[str, str] = {}
    for rid in {r["id"] for r in new_prompts} | {r["id"] for r in new_examples}:
        if rid in base_ids and new_text.get(rid) != base_text.get(rid):
            renamed[rid] = f"{rid}#{suffix}"
    for rows in (new_examples, new_prompts):
        for r in rows:
            r["id"] = renamed.get(r["id"], r["id"])
    text = {**base_text, **{renamed.get(k, k): v for k, v in new_text.items()}}

    held = {tuple(r["prompt"]) for r in base_examples + new_examples if r["split"] == "eval"}
    summary = {"base_train": 0, "new_train": 0, "renamed_ids": len(renamed), "dropped_heldout_prompt": 0,
               "dropped_heldout_family": 0, "dropped_duplicate": 0}
    seen: set[tuple] = set()
    examples, eval_ids = [], set()
    for origin, rows in (("base", base_examples), ("new", new_examples)):
        for r in rows:
            key = tuple(r["prompt"])
            if r["split"] == "eval":
                if r["id"] not in eval_ids:
                    eval_ids.add(r["id"])
                    examples.append(r)
                continue
            if key in held:
                summary["dropped_heldout_prompt"] += 1
            elif r["source"] == "self_instruct" and looks_like_heldout_family(text.get(r["id"], "")):
                summary["dropped_heldout_family"] += 1
            elif key in seen:
                summary["dropped_duplicate"] += 1
            else:
                seen.add(key)
                examples.append(r)
                summary[f"{origin}_train"] += 1
    kept = {r["id"] for r in examples}
    prompts, seen_ids = [], set()
    for r in base_prompts + new_prompts:
        if r["id"] in seen_ids or (r["split"] == "train" and r["id"] not in kept):
            continue
        seen_ids.add(r["id"])
        prompts.append(r)
    train = [r for r in examples if r["split"] == "train"]
    summary.update(train_rows=len(train), eval_rows=len(examples) - len(train),
                   response_tokens=sum(len(r["response"]) for r in train),
                   prompt_tokens=sum(len(r["prompt"]) for r in train), prompts=len(prompts))
    return examples, prompts, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the earlier run's examples.jsonl[.gz]")
    ap.add_argument("--base-prompts", required=True, help="the earlier run's prompts.jsonl[.gz]")
    ap.add_argument("--into", required=True, help="the new run's data directory (rewritten)")
    ap.add_argument("--suffix", default="s1", help="appended to the new run's clashing ids")
    ap.add_argument("--summary", default=None, help="also write the summary here (JSON)")
    args = ap.parse_args(argv)
    into = Path(args.into)
    examples, prompts, summary = merge(_read(args.base), _read(args.base_prompts),
                                       _read(into / "examples.jsonl"), _read(into / "prompts.jsonl"),
                                       args.suffix)
    _write(into / "examples.jsonl", examples)
    _write(into / "prompts.jsonl", prompts)
    print(json.dumps(summary))
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
