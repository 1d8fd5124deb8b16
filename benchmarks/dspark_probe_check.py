"""Are DSpark's probes judged on sound drafts? Its state and its drafts at every forward.

Under ``auto`` the scheduler runs DSpark rarely (a request's first cycle, then probes after 32+
cycles of other drafters) and judges it by what those forwards' drafts accept; with DSpark
forced every cycle (``dspark@1``) the shipped drafter accepts far more per cycle than auto's
probes saw (docs/benchmarks.md, scheduler section). This runs workload prompts under each method
and records every DSpark forward, then checks two things:

* ``fresh_same`` / ``fresh_diff``: whether the drafts equal those of a fresh drafter given the
  whole sequence's tapped target rows at once (the rows a request passes on after prompt-lookup
  or plain cycles reach the drafter intact: a wrong catch-up would draft from a wrong context),
  and ``cache_max_diff``, the largest difference between the two drafters' context caches (on a
  GPU the two take different paths, the fused verify and launch against ``TargetTaps`` and MLX
  ops, so a near tie may flip a draft without a defect; a wrong catch-up is off by ~1);
* ``first_match`` / ``later_match``: how many of the block's drafts match the request's greedy
  continuation (the acceptance had the whole block been verified), for requests' first forwards
  and later ones apart, with the counts.

``--probe-all`` lets auto's probes run whenever one is due (no probe budget, no "could it win"
test): on a CPU, where DSpark cannot win, auto would otherwise run only first forwards.

    python -m benchmarks.dspark_probe_check --methods auto,dspark@1 --workloads novel_code,novel_chat \\
        --prompts 4 --max-tokens 160 --out probe_check.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from benchmarks.bench_speculative import load_workloads, run_turns
from benchmarks.oracle_schedule import accepted
from drafters.base import DraftContext
from drafters.dspark import DSparkDrafter
from engine import Engine, EngineConfig
from engine.scheduler import DsparkStats


def summarize(rows: list[dict]) -> dict:
    firsts = [r["match"] for r in rows if r["first"]]
    later = [r["match"] for r in rows if not r["first"]]
    mean = (lambda xs: round(statistics.mean(xs), 4) if xs else None)
    return {"forwards": len(rows), "first_n": len(firsts), "first_match": mean(firsts),
            "later_n": len(later), "later_match": mean(later),
            "fresh_same": sum(r["same"] is True for r in rows), "fresh_diff": sum(r["same"] is False for r in rows),
            "cache_max_diff": max((r["cache_max_diff"] for r in rows if r["cache_max_diff"] is not None), default=None)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="auto,dspark@1")
    ap.add_argument("--workloads", default="novel_code,novel_chat")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--probe-all", action="store_true", help="auto probes whenever one is due")
    ap.add_argument("--no-fresh", action="store_true", help="skip the fresh-drafter comparison")
    ap.add_argument("--drafter", default=None, help="a DSpark drafter directory (default: the shipped one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    eng = Engine(EngineConfig(speculation="auto", dspark=True, dspark_drafter=args.drafter)).start(wait=True)
    records: list[dict] = []
    propose = DSparkDrafter.propose
    saved = DsparkStats.best_case_rate, DsparkStats.worth_tapping
    taps = eng.target_taps

    def recorded(self, ctx, max_len):
        out = propose(self, ctx, max_len)
        row = {"tokens": list(ctx.tokens), "drafts": list(out.tokens), "same": None, "cache_max_diff": None}
        if not args.no_fresh:  # (here, before a later forward's launch writes this cache in place)
            hidden = taps.forward(mx.array(row["tokens"][:-1])[None])[1][0].astype(mx.float32)
            fresh = DSparkDrafter(eng.dspark, taps.embed, taps.lm_head, eng._dspark_step)
            row["same"] = propose(fresh, DraftContext(row["tokens"], hidden), max_len).tokens == row["drafts"]
            n = self.context_length
            row["cache_max_diff"] = max(mx.abs(a[:, :, :n] - b[:, :, :n]).max().item() for a, b in
                                        zip((*self._keys, *self._values), (*fresh._keys, *fresh._values)))
        records.append(row)
        return out

    report: dict = {"args": vars(args), "methods": {}}
    try:
        DSparkDrafter.propose = recorded
        if args.probe_all:
            eng.dspark_stats.decode_seconds = 1e9
            DsparkStats.best_case_rate = lambda *a, **k: float("inf")
            DsparkStats.worth_tapping = lambda *a, **k: True
        report["model"] = eng.info()
        tok = eng.loaded.tokenizer
        for method in args.methods.split(","):
            rows = []
            for w in load_workloads(args.workloads.split(",")):
                for p in w["prompts"][: args.prompts]:
                    turns = run_turns(eng, tok, p, method, args.max_tokens)
                    forwards, records[:] = list(records), []
                    for prompt, result in turns:  # (a session's turns, in order, and their forwards)
                        full = prompt + result["ids"]
                        mine = []
                        while forwards and len(prompt) <= len(forwards[0]["tokens"]) <= len(full) \
                                and forwards[0]["tokens"] == full[: len(forwards[0]["tokens"])]:
                            mine.append(forwards.pop(0))
                        for i, r in enumerate(mine):
                            n = len(r["tokens"])
                            rows.append({"workload": w["name"], "first": i == 0, "position": n - len(prompt),
                                         "match": accepted(r["drafts"], full, n), "same": r["same"],
                                         "cache_max_diff": r["cache_max_diff"]})
                    if forwards:
                        raise RuntimeError(f"{len(forwards)} DSpark forwards belong to no turn of {w['name']}")
            report["methods"][method] = {"summary": summarize(rows), "forwards": rows}
            print(method, json.dumps(report["methods"][method]["summary"]), flush=True)
    finally:
        DSparkDrafter.propose = propose
        DsparkStats.best_case_rate, DsparkStats.worth_tapping = saved
        eng.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
