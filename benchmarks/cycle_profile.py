"""Where a speculative cycle's time goes, by verify width, in the running engine.

The scheduler prices a cycle of ``k`` rows at ``T(k)`` from its cost curve (measured at
start-up, each width timed alone, then refreshed online from the verify window of every cycle).
This runs benchmark workloads through the engine, as ``bench_speculative`` does, and records
every cycle of every request:

* ``rows``: the verify pass's width (anchor + drafts); ``committed``: tokens it committed;
* ``verify_ms``: the window the cost model observes (the pass, the accept decision, the sync);
* ``step_ms``: all of ``speculative_step`` (drafting, verify, accept, rollback, commit);
* ``wall_ms``: from this cycle's start to the request's next (what the request really pays:
  the worker loop and the event hand-off to the client included);

and reports per method and width the count and the median of each, next to the start-up curve,
the curve the engine ends with, and ``T(k)`` timed again start-up style at the contexts the
requests ran at. A width whose in-engine ``verify_ms`` sits above its re-timed ``T(k)`` by more
than the one-row gap is dearer in the engine than the curve says; a ``wall_ms - verify_ms``
that is the same for every width is a per-cycle overhead plain decoding pays too. The
``cost_model_check`` replays the recorded passes through cost-model variants and reports how
far each one's ``T(k)`` was from what the passes took.

    python -m benchmarks.cycle_profile --workloads novel_chat,prose,copy --out cycles.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)
from benchmarks.bench_speculative import load_workloads, run_prompt
from drafters.dspark.drafter import DraftStep, DSparkDrafter
from engine import Engine, EngineConfig, generation
from engine import engine as engine_module


def instrument(eng: Engine) -> list[dict]:
    """Wrap the engine's cycle functions; returns the list each cycle's record is appended to."""
    records: list[dict] = []
    runner_cls = type(eng.runner)
    verify, accept, step = runner_cls.verify, generation._accept, engine_module.speculative_step
    propose_dspark = generation.Sequence._propose_dspark
    marks: dict = {}

    def add(key: str, started: float) -> None:
        marks[key] = marks.get(key, 0.0) + 1e3 * (time.perf_counter() - started)

    def timed(key: str, fn):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                add(key, started)
        return wrapper

    timed_propose_dspark = timed("dspark_ms", propose_dspark)
    # a DSpark forward's parts: the drafter's propose (the forward, its host sync and the
    # drafts' transfer), within it the host's graph building (the context update and the draft
    # step return lazy arrays), and the rest of _propose_dspark (the engine's bookkeeping)
    originals = [(DSparkDrafter, "propose", "dspark_propose_ms"),
                 (DSparkDrafter, "_update_context", "dspark_build_ms"),
                 (DraftStep, "draft", "dspark_build_ms")]
    for owner, name, key in originals:
        setattr(owner, name, timed(key, getattr(owner, name)))

    def timed_verify(self, *args, **kwargs):
        marks.setdefault("verify", time.perf_counter())
        return verify(self, *args, **kwargs)

    def timed_accept(*args, **kwargs):
        marks.setdefault("accept", time.perf_counter())
        return accept(*args, **kwargs)

    def timed_step(seq, cost):
        marks.clear()
        context = len(seq.tokens)
        started = time.perf_counter()
        result = step(seq, cost)
        ended = time.perf_counter()
        drafter, drafted, accepted, _ = getattr(result, "verify_step", None) or (None, 0, 0, 0.0)
        records.append({"seq": seq.request.request_id, "method": seq.request.speculative.method, "drafter": drafter,
                        "rows": drafted + 1, "accepted": accepted, "committed": len(result.token_ids),
                        "context": context, "position": seq.num_generated - len(result.token_ids),
                        "start": started, "end": ended,
                        "verify_ms": 1e3 * (marks.get("accept", ended) - marks.get("verify", started)),
                        **{k: marks.get(k, 0.0) for k in ("dspark_ms", "dspark_propose_ms", "dspark_build_ms")}})
        return result

    runner_cls.verify = timed_verify
    generation.Sequence._propose_dspark = timed_propose_dspark
    generation._accept = timed_accept
    engine_module.speculative_step = timed_step
    return records


def summarize(records: list[dict]) -> dict:
    """Per method and width: cycles, and medians of verify/step/wall time (ms); the first cycle
    of each request (after its prefill) is kept apart. Under ``"total"``, per method: the sums
    (ms) of step and wall time over all cycles, the DSpark forwards (count and ms; medians hide
    them, as they hide any rare cost), and the time in steps dearer than twice their width's
    median step."""
    by_seq = defaultdict(list)
    for r in records:
        by_seq[r["seq"]].append(r)
    for cycles in by_seq.values():
        for a, b in zip(cycles, cycles[1:]):
            a["wall_ms"] = 1e3 * (b["start"] - a["start"])
    groups = defaultdict(list)
    for r in records:
        groups[(r["method"], "first" if r["position"] == 0 else r["rows"])].append(r)
    out: dict = {}
    for (method, rows), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]).zfill(5))):
        def med(key, rs=rs):
            values = [r[key] for r in rs if key in r]
            return round(statistics.median(values), 4) if values else None
        out.setdefault(method, {})[str(rows)] = {
            "cycles": len(rs), "verify_ms": med("verify_ms"),
            "step_ms": round(statistics.median(r["end"] - r["start"] for r in rs) * 1e3, 4),
            "wall_ms": med("wall_ms"), "committed": round(statistics.mean(r["committed"] for r in rs), 3),
            "context": round(statistics.median(r["context"] for r in rs))}
    for method in out:
        mine = [r for r in records if r["method"] == method]
        median_step = {k: statistics.median(r["end"] - r["start"] for r in rs) for (m, k), rs in groups.items()
                       if m == method}
        slow = [r for r in mine
                if r["end"] - r["start"] > 2 * median_step["first" if r["position"] == 0 else r["rows"]]]
        out[method]["total"] = {
            "cycles": len(mine), "committed": sum(r["committed"] for r in mine),
            "step_ms": round(sum(1e3 * (r["end"] - r["start"]) for r in mine), 2),
            "wall_ms": round(sum(r.get("wall_ms", 0.0) for r in mine), 2),
            "dspark_forwards": sum(r["dspark_ms"] > 0 for r in mine),
            "dspark_ms": round(sum(r["dspark_ms"] for r in mine), 2),
            # of which the drafter's propose, and within that the host's graph building
            "dspark_propose_ms": round(sum(r["dspark_propose_ms"] for r in mine), 2),
            "dspark_build_ms": round(sum(r["dspark_build_ms"] for r in mine), 2),
            "slow_steps": len(slow), "slow_step_ms": round(sum(1e3 * (r["end"] - r["start"]) for r in slow), 2)}
    return out


def cost_model_check(records: list[dict], cal) -> dict:
    """How well cost models predict the passes the engine ran: each cycle's ``verify_ms`` (all
    but each request's first), in order, is predicted by ``T(rows, context)`` and then observed,
    as the engine does. Models: the start-up curve frozen; the online refresh without the
    context term (the engine's before the thirteenth session); the same with residuals of widths
    unseen for 64 passes decaying by 0.25% per pass (tried and dropped in that session); and the
    engine's (the start-up context slopes). Per model: the median
    ``|log(predicted / measured)|`` for one-row and wider passes, and the mean signed
    log-ratio of wider passes (< 0: it thinks them cheaper than they are)."""
    import math

    from engine.scheduler import CostModel

    class Decay(CostModel):
        def observe(self, rows: int, seconds: float, context: int | None = None) -> None:
            self.passes = getattr(self, "passes", 0) + 1
            seen = getattr(self, "last_seen", [0] * self.max_rows)
            if 1 <= rows <= self.max_rows:
                seen[rows - 1] = self.passes
            self.last_seen = seen
            self.residual = [r * (1 - 0.0025) if s < self.passes - 64 else r for r, s in zip(self.residual, seen)]
            super().observe(rows, seconds, context)

    curve = list(cal.verify_cost)
    models = {
        "frozen": CostModel(curve, alpha=0.0),
        "online_no_context": CostModel(curve),
        "online_decay": Decay(curve),
        "engine": CostModel(curve, context_slope=cal.context_slope, context_row_slope=cal.context_row_slope,
                            reference_context=cal.reference_context),
    }
    errors: dict = {name: ([], []) for name in models}
    for r in records:
        if r["position"] == 0 or r["rows"] > len(curve):
            continue
        seconds = r["verify_ms"] * 1e-3
        for name, model in models.items():
            context = r["context"] if name == "engine" else None
            errors[name][r["rows"] > 1].append(math.log(model.T(r["rows"], context) / seconds))
            model.observe(r["rows"], seconds, context)
    out = {}
    for name, (one, wide) in errors.items():
        out[name] = {"one_row_abs_log_err": round(statistics.median(abs(e) for e in one), 4) if one else None,
                     "wide_abs_log_err": round(statistics.median(abs(e) for e in wide), 4) if wide else None,
                     "wide_bias": round(statistics.mean(wide), 4) if wide else None,
                     "passes": [len(one), len(wide)]}
    return out


def retime(eng: Engine, contexts: list[int], repeats: int = 5) -> dict:
    """``T(k)`` (ms) for every width of the curve, timed start-up style at these contexts."""
    import mlx.core as mx

    vocab = eng.loaded.vocab_size if hasattr(eng.loaded, "vocab_size") else 32000
    width = eng.cost.max_rows
    out = {}
    for context in contexts:
        ids = mx.random.randint(3, min(vocab, 32000), (context + width,), key=mx.random.key(7)).tolist()
        costs = eng.runner._measure_cost(ids[:context], ids[context:], width, repeats)
        out[str(context)] = [round(t * 1e3, 4) for t in costs]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="off,prompt_lookup")
    ap.add_argument("--workloads", default="novel_chat,prose,copy,agent_turn")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--fused", default="auto", choices=["auto", "on", "off"], help="SPECSERVE_FUSED")
    ap.add_argument("--dspark", action="store_true", help="load the shipped DSpark drafter")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    eng = Engine(EngineConfig(speculation="auto", fused=args.fused,
                              dspark=args.dspark or bool({"dspark", "auto"} & set(methods)))).start(wait=True)
    try:
        tok = eng.loaded.tokenizer
        start_curve = eng.cost.verify_cost
        workloads = load_workloads(args.workloads.split(","))
        for w in workloads:  # warm-up, as the benchmark does
            for p in w["prompts"]:
                for m in methods:
                    run_prompt(eng, tok, p, m, 16)
        records = instrument(eng)
        report = {"model": eng.info(), "start_curve_ms": [round(t * 1e3, 4) for t in start_curve],
                  "workloads": {}}
        for w in workloads:
            first = len(records)
            for _ in range(args.repeats):
                for p in w["prompts"]:
                    for m in methods:
                        run_prompt(eng, tok, p, m, args.max_tokens)
            report["workloads"][w["name"]] = summarize(records[first:])
        report["end_curve_ms"] = [round(t * 1e3, 4) for t in eng.cost.verify_cost]
        contexts = sorted(r["context"] for r in records)  # (the cycles' median context, and the longest)
        report["retimed_ms"] = retime(eng, [contexts[len(contexts) // 2], contexts[-1]] if contexts else [256])
        report["all"] = summarize(records)
        report["cost_model_check"] = cost_model_check(records, eng.calibration)
    finally:
        eng.stop()
    for method, widths in report["all"].items():
        print(method, " ".join(f"{k}:{v['cycles']}x v{v['verify_ms']} w{v['wall_ms']}" for k, v in widths.items()
                               if k != "total"))
    for name, methods_ in report["workloads"].items():
        for method, widths in methods_.items():
            print(name, method, widths["total"])
    print("start", report["start_curve_ms"][:8], "\nend  ", report["end_curve_ms"][:8])
    for c, curve in report["retimed_ms"].items():
        print(f"ctx {c}", curve[:8])
    for name, errs in report["cost_model_check"].items():
        print("cost model", name, errs)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
