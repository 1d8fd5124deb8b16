"""Held-out greedy acceptance of DSpark drafters on the default target, side by side.

Prompt sets (none used in training): raw HumanEval completions HumanEval/0..9 (96 new tokens);
the first 10 held-out instructions of the held-out families (``drafters.dspark.data.
HELDOUT_FAMILIES``; 96 tokens); the first 4 held-out instructions of training families (64
tokens); instructions come from ``instruction_prompts(3000, seed 0)``. The loop is
``drafters.dspark.train.evaluate_acceptance``: a full block every cycle, greedy; it reports the
mean acceptance length (bonus included) and acceptance per position.

    python -m benchmarks.dspark_eval --out benchmarks/results/dspark_eval_cpu_v2.json \\
        v1=path/to/old-drafter v2=models/dspark-smollm2-135m-instruct

``--run-prompts`` adds a training run's own held-out prompts (its ``data/prompts.jsonl``, or the
gzipped copy ``h200_session.sh gen`` returns): the first ``--per-source`` eval-split prompts of
each source, 96 new tokens, as sets ``run_<source>`` (``--run-split train``: its first training
prompts instead, as ``train_<source>``).

The result's ``_setup.run_records`` keeps the run sets' prompts themselves (ids, sources,
texts), so a later evaluation can repeat them without the run's prompt file (``.dev/`` does not
outlive a session): ``--run-sets-from RESULT.json``.

``--workloads a,b`` adds the benchmark workloads' prompts (benchmarks/workloads; sessions
left out) as sets ``wl_<name>`` with the workload's ``max_tokens``, chat prompts through the
chat template, as ``bench_speculative`` sends them. Every set reports
``first_cycle_accepted`` apart from ``later_cycle_accepted``: a request's first DSpark
forward drafts from the prompt's last token, where the drafter was trained on few anchors.

``--max-new-tokens N`` gives every set N new tokens instead (generation still stops at EOS).
The training data's responses run to 256 tokens, and DeepSpec's evaluator decodes to EOS; the
default 96 measures only the openings of responses, where the text is least repetitive.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from drafters.dspark.data import (
    HELDOUT_FAMILIES,
    PromptRecord,
    encode_prompt,
    humaneval_prompts,
    instruction_prompts,
)
from drafters.dspark.loader import load_dspark
from drafters.dspark.target import TargetTaps
from drafters.dspark.train import evaluate_acceptance
from engine.loader import load_target

RUN_NEW_TOKENS = 96  # new tokens of a run set (--run-prompts, --run-sets-from)


def prompt_sets() -> dict:
    """``name -> (prompt records, new tokens)``."""
    he = [r for r in humaneval_prompts() if r.id.endswith(":raw")][:10]
    ins = [r for r in instruction_prompts(3000, 0) if r.split == "eval"]
    held = [r for r in ins if r.id.split(":")[1] in HELDOUT_FAMILIES][:10]
    fam = [r for r in ins if r.id.split(":")[1] not in HELDOUT_FAMILIES][:4]
    return {"humaneval_raw": (he, 96), "instruct_heldout": (held, 96), "instruct_trainfamily_heldout": (fam, 64)}


def _body(row: dict) -> str:
    """A prompt's content (the code block of a wrapped code task), whitespace-normalised."""
    text = row.get("text") or row["messages"][-1]["content"]
    block = re.search(r"```python\n(.*)\n```", text, re.S)
    return " ".join((block.group(1) if block else text).split())


def run_prompt_sets(path: str, per_source: int, split: str = "eval") -> dict:
    """``run_<source> -> (held-out records, 96)`` from a run's prompt file (JSONL, maybe gzipped):
    the first ``per_source`` eval-split prompts of each source whose content does not occur
    inside a training prompt's (copied code crossed the file split of runs before the
    fourteenth session's fix; raw prefixes shorter than 80 characters are not checked); for
    template instructions, one per training family in turn (since the forty-first session;
    the held-out families have their own set).
    Sources without such prompts are left out. ``split="train"`` gives the first training
    prompts instead, as ``train_<source>`` (how the drafter does on what it was trained on)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    by_source: dict[str, list[PromptRecord]] = {}
    if split == "train":
        for row in rows:
            if row["split"] == "train" and len(by_source.setdefault(row["source"], [])) < per_source:
                by_source[row["source"]].append(PromptRecord(**row))
        return {f"train_{src}": (recs, RUN_NEW_TOKENS) for src, recs in sorted(by_source.items()) if recs}
    trained = [_body(r) for r in rows if r["split"] == "train"]
    families: dict[str, list[PromptRecord]] = {}  # template instructions, by family

    def copied(row) -> bool:  # (a raw completion's first line or two, e.g. "def forward(", is no copy)
        body = _body(row)
        return (row.get("text") is None or len(body) >= 80) and any(body in t for t in trained)

    for row in rows:
        if row["split"] != "eval":
            continue
        if row["source"] == "instruct":
            family = row["id"].split(":")[1]
            queue = families.setdefault(family, [])
            # (held-out families have their own fixed set, instruct_heldout)
            if family not in HELDOUT_FAMILIES and len(queue) < per_source and not copied(row):
                queue.append(PromptRecord(**row))
        elif len(by_source.setdefault(row["source"], [])) < per_source and not copied(row):
            by_source[row["source"]].append(PromptRecord(**row))
    # one per family in turn (families in order of first appearance): arithmetic questions are
    # 80% of the held-out template instructions and nearly copied (mean acceptance ~5.5), so the
    # first ten alone measure one family
    picked = [r for turn in itertools.zip_longest(*families.values()) for r in turn if r is not None][:per_source]
    if picked:
        by_source["instruct"] = picked
    return {f"run_{src}": (recs, RUN_NEW_TOKENS) for src, recs in sorted(by_source.items()) if recs}


def workload_prompt_sets(tokenizer, names: list[str]) -> dict:
    """``wl_<name> -> (prompt token lists, the workload's max_tokens)`` for the benchmark
    workloads ``names`` (their non-session prompts, encoded as ``bench_speculative`` sends
    them)."""
    from benchmarks.bench_speculative import load_workloads, prompt_tokens

    out = {}
    for w in load_workloads(names):
        prompts = [prompt_tokens(tokenizer, p) for p in w["prompts"] if p["kind"] != "session"]
        if prompts:  # (a workload of sessions only has none)
            out[f"wl_{w['name']}"] = (prompts, w.get("max_tokens", 128))
    return out


def setup_record(target: str, sets: dict, run_names) -> dict:
    """The result's ``_setup``: the target, the loop, every set's prompt ids and new tokens, and
    the prompts of the sets named in ``run_names`` (read back by :func:`saved_run_sets`)."""
    return {"target": target,
            "loop": "drafters.dspark.train.evaluate_acceptance (full block every cycle, greedy)",
            "prompts": {k: [r.id for r in v[0]] for k, v in sets.items()},
            "max_new_tokens": {k: v[1] for k, v in sets.items()},
            "run_records": {k: [asdict(r) for r in sets[k][0]] for k in run_names}}


def saved_run_sets(path: str) -> dict:
    """``name -> (records, 96)``: the run sets an earlier result of this script kept in
    ``_setup.run_records`` (its ``run_<source>`` / ``train_<source>`` sets), with the run sets'
    own new tokens whatever that result's ``--max-new-tokens`` was (give it again to repeat it).

    Raises:
        ValueError: the result kept no run sets (written before they were kept, or without
            ``--run-prompts``).
    """
    saved = (json.loads(Path(path).read_text()).get("_setup") or {}).get("run_records") or {}
    if not saved:
        raise ValueError(f"{path} keeps no run sets (_setup.run_records)")
    return {name: ([PromptRecord(**r) for r in rows], RUN_NEW_TOKENS) for name, rows in saved.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="NAME=DRAFTER_DIR")
    ap.add_argument("--target", default="default")
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-prompts", default=None, help="a training run's prompts.jsonl[.gz]: add its held-out sets")
    ap.add_argument("--run-sets-from", default=None,
                    help="an earlier result of this script: repeat the run sets it kept (instead of --run-prompts; "
                         "--per-source and --run-split do not apply)")
    ap.add_argument("--per-source", type=int, default=10)
    ap.add_argument("--only-run-prompts", action="store_true", help="skip the fixed sets")
    ap.add_argument("--run-split", choices=("eval", "train"), default="eval",
                    help="which prompts of --run-prompts: held out (default) or trained on")
    ap.add_argument("--workloads", default=None, help="benchmark workloads to add as sets wl_<name> (a,b,...)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="new tokens for every set (default: 96, 64 for instruct_trainfamily_heldout)")
    args = ap.parse_args(argv)
    if args.run_prompts and args.run_sets_from:
        ap.error("--run-prompts and --run-sets-from exclude each other")
    if args.only_run_prompts and not (args.run_prompts or args.run_sets_from):
        ap.error("--only-run-prompts needs --run-prompts or --run-sets-from")
    if args.per_source < 1:
        ap.error("--per-source must be at least 1")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be at least 1")
    target = load_target(args.target)
    sets = {} if args.only_run_prompts else prompt_sets()
    run_sets = {}
    if args.run_prompts:
        run_sets = run_prompt_sets(args.run_prompts, args.per_source, args.run_split)
    elif args.run_sets_from:
        run_sets = saved_run_sets(args.run_sets_from)
    sets.update(run_sets)
    workload_sets = workload_prompt_sets(target.tokenizer, args.workloads.split(",")) if args.workloads else {}
    if args.max_new_tokens is not None:
        sets = {k: (records, args.max_new_tokens) for k, (records, _) in sets.items()}
        workload_sets = {k: (prompts, args.max_new_tokens) for k, (prompts, _) in workload_sets.items()}
    out = {"_setup": setup_record(f"{target.name} ({target.weights})", sets, run_sets)}
    out["_setup"]["workloads"] = {k: n for k, (_, n) in workload_sets.items()}
    encoded = {k: ([encode_prompt(target.tokenizer, r) for r in records], n) for k, (records, n) in sets.items()}
    encoded.update(workload_sets)
    for spec in args.drafters:
        name, path = spec.split("=", 1)
        net = load_dspark(path)
        taps = TargetTaps(target.model, net.config.target_layer_ids)
        res = {"drafter": path}
        for key, (prompts, n) in encoded.items():
            start = time.perf_counter()
            r = evaluate_acceptance(taps, net, prompts, target.eos_token_ids, n)
            r["seconds"] = round(time.perf_counter() - start, 1)
            res[key] = r
            print(name, key, r["mean_acceptance_length"], r["acceptance_per_position"],
                  f"first/later cycle accepted {r['first_cycle_accepted']}/{r['later_cycle_accepted']}",
                  r["seconds"], flush=True)
        out[name] = res
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
