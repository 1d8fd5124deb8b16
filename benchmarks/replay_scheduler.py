"""Replay prompt-lookup scheduling offline on recorded greedy outputs (deterministic).

Speed-ups measured in the engine move by +-5% between runs on the shared CPU, more than most
scheduler changes are worth. This replays the engine's prompt-lookup cycle on fixed inputs:
the benchmark workloads' greedy outputs (recorded once with plain decoding, cached as JSON),
the real drafter (drafters.PromptLookupDrafter) and the real scheduler (engine.scheduler:
``RequestAcceptance`` per request over one engine-wide ``AcceptanceModel``, ``choose_length``),
and a verify-cost curve ``T(k)/T(1)`` (default: the H200's and the CPU's from recorded
benchmark runs). Each cycle drafts, cuts the draft to the scheduler's length, accepts the
prefix that equals the recorded output, and costs ``T(L + 1)`` (+ ``--overhead`` per cycle and
``--draft-overhead`` per drafted cycle, both in units of ``T(1)``). Greedy speculation commits
exactly the plain output, so the replay needs no model. Workloads run in the benchmark's order
through one engine-wide acceptance model, as in ``bench_speculative``.

Reported per curve and workload: replayed speed-up over plain decoding (as the benchmark
measures it: tokens after the first, over the time after the first cycle), drafts, drafted and
accepted tokens. What it leaves out: host time that differs between cycles, sampling; the online refresh of
T(k) only with ``--online``. tests/test_replay_scheduler.py checks that the replay drafts exactly what the
engine drafts on the tiny model.

    python -m benchmarks.replay_scheduler --max-tokens 128 --warmup 16 --repeats 3 \
        --curves "cpu;h200;benchmarks/results/step_profile_cpu_s8.json:fused:q8;1,1,1,1,1,1,1,1,1.2,1.4"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CURVES = {"h200": RESULTS / "spec_h200_s9_auto.json", "cpu": RESULTS / "spec_cpu_s8_final.json"}


def record_outputs(path: Path, max_tokens: int | None) -> dict:
    """Greedy (prompt tokens, output tokens) per workload, request by request (session turns
    included), with the default model and speculation off; cached at ``path``."""
    import engine  # noqa: F401  (OpenBLAS before mlx.core)
    from benchmarks.bench_speculative import load_workloads, run_turns
    from engine import Engine, EngineConfig

    eng = Engine(EngineConfig(speculation="off")).start(wait=True)
    out = {}
    try:
        for w in load_workloads(None):
            n = max_tokens or w.get("max_tokens", 128)
            out[w["name"]] = [[tokens, row["ids"]] for prompt in w["prompts"]
                              for tokens, row in run_turns(eng, eng.loaded.tokenizer, prompt, "off", n)]
            print(f"recorded {w['name']}: {len(out[w['name']])} requests", flush=True)
    finally:
        eng.close()
    path.write_text(json.dumps(out))
    return out


def replay(outputs: dict, curve: list[float], overhead: float = 0.0, draft_overhead: float = 0.0,
           max_draft: int = 15, min_n: int = 2, max_n: int = 5, *, max_tokens: int | None = None,
           warmup: int = 0, repeats: int = 1, methods: int = 1, model=None,
           decision_curve: list[float] | None = None, online: str | None = None) -> dict:
    """Replayed speed-up per workload for one cost curve (relative ``T(k)/T(1)``).

    Mirrors ``bench_speculative``: every request is first replayed for ``warmup`` tokens (all
    workloads, before any is measured), then each workload's requests ``repeats`` times, each
    request ``methods`` times in a row (the benchmark's methods that draft with prompt lookup,
    e.g. 2 for ``prompt_lookup`` and ``auto``), all through one engine-wide acceptance model
    (``model``, a fresh ``AcceptanceModel`` by default). The speed-up is the benchmark's: tokens
    after the first over the time after the first cycle, against plain decoding's. A request
    allows ``max_tokens`` tokens (default: its recorded output's length; a recorded output that
    ended early at EOS drafts within the larger budget, as the engine does). ``decision_curve``:
    the scheduler decides with this curve while cycles are charged by ``curve`` (e.g. an
    online-refreshed curve the engine recorded, against the start-up one). ``online``: the
    scheduler decides with one engine-wide cost model that starts from ``decision_curve`` (or
    ``curve``) and observes every pass after a request's first, as the engine's does, each
    costing ``curve[k] + overhead`` (the overhead being host time a start-up pass does not
    see): ``shared`` is the engine's ``CostModel``, ``per-width`` the rule it replaced (each
    width refreshed on its own)."""
    from engine.scheduler import AcceptanceModel, CostModel

    model = model or AcceptanceModel()
    if online:
        decide = {"shared": CostModel, "per-width": PerWidthCost}[online](list(decision_curve or curve))
        decision_curve = decide
    if warmup:
        for requests in outputs.values():
            for prompt, output in requests:
                for _ in range(methods):
                    _replay_request(prompt, output[:warmup], warmup, curve, model, overhead, draft_overhead,
                                    max_draft, min_n, max_n, decision_curve)
    result = {}
    for name, requests in outputs.items():
        plain = spec = 0.0
        totals = {"drafts": 0, "drafted": 0, "accepted": 0}
        for _ in range(repeats):
            for prompt, output in requests:
                for _ in range(methods):
                    out = output[:max_tokens] if max_tokens else output
                    t, counts = _replay_request(prompt, out, max_tokens or len(out), curve, model, overhead,
                                                draft_overhead, max_draft, min_n, max_n, decision_curve)
                    spec += t
                    plain += (len(out) - 1) * (1.0 + overhead)
                    for k in totals:
                        totals[k] += counts[k]
        result[name] = {"speedup": plain / spec if spec else 1.0, **totals}
    return result


def _replay_request(prompt, output, max_tokens, curve, model, overhead, draft_overhead, max_draft, min_n, max_n,
                    decision_curve=None):
    """One request's cycles: (cost after its first cycle in T(1) units, draft counts)."""
    from drafters import PromptLookupDrafter
    from drafters.base import DraftContext
    from engine.scheduler import CostModel, RequestAcceptance, choose_length

    cost = CostModel(list(curve))
    if isinstance(decision_curve, CostModel):  # engine-wide, refreshed online
        decide, online = decision_curve, True
    else:
        decide, online = (CostModel(list(decision_curve)) if decision_curve else cost), False
    acceptance = RequestAcceptance(model)
    drafter = PromptLookupDrafter(min_n, max_n)
    counts = {"drafts": 0, "drafted": 0, "accepted": 0}
    n, spent, first = 0, 0.0, True
    while n < len(output):
        tokens = prompt + output[:n]
        budget = min(max_tokens - n - 1, decide.max_rows - 1, max_draft)  # Sequence.draft_budget
        length = 0
        proposal = drafter.propose(DraftContext(tokens), budget) if budget > 0 else None
        if proposal is not None and proposal.tokens:
            conditional = acceptance.survival(proposal.match_length, len(proposal.tokens))
            length = choose_length(conditional, decide)[0]
        ok = 0
        if length:
            draft = proposal.tokens[:length]
            while ok < length and n + ok < len(output) and draft[ok] == output[n + ok]:
                ok += 1
            acceptance.observe(proposal.match_length, length, ok)
            counts["drafts"] += 1
            counts["drafted"] += length
            counts["accepted"] += ok
        if not first:  # (the benchmark times decoding after the first token event)
            spent += cost.T(length + 1) + overhead + (draft_overhead if length else 0.0)
            if online:  # (the engine does not observe a request's first pass either)
                decide.observe(length + 1, cost.T(length + 1) + overhead)
        first = False
        n += ok + 1
    return spent, counts


def PerWidthCost(curve: list[float]):
    """A cost model refreshed the way the engine's was before the tenth session: each width's
    own EMA, no shift shared between widths (for ``--online per-width``; the old rule's rescale
    after three passes more than 2x off is left out: replayed costs never are)."""
    from engine.scheduler import CostModel

    class PerWidth(CostModel):
        def observe(self, rows: int, seconds: float) -> None:
            if 1 <= rows <= self.max_rows and 0.5 <= seconds / self.T(rows) <= 2.0:
                self.shape[rows - 1] += self.alpha * (seconds - self.shape[rows - 1])
                self._curve = list(self.shape)

    return PerWidth(curve)


def curve_of(spec: str) -> list[float]:
    """A T(k)/T(1) curve: ``h200`` or ``cpu`` (the start-up curves of recorded benchmark runs),
    ``FILE.json`` (a bench_speculative result: its start-up curve), ``FILE.json:MODE`` (a
    step_profile result: that mode's ``step_ms`` ratios, e.g. ``fused:q8``), or numbers
    separated by commas (``1,1,1.1,...``)."""
    if spec in CURVES:
        spec = str(CURVES[spec])
    if spec[0].isdigit():
        return [float(x) for x in spec.split(",")]
    path, _, mode = spec.partition(":")
    run = json.loads(Path(path).read_text())
    if mode:
        steps = run["models"]["default"][mode]["step_ms"]
        return [steps[str(k)]["ratio"] for k in range(1, len(steps) + 1)]
    return run["model"]["verify_cost_relative"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", default=str(RESULTS / "greedy_outputs_cpu.json"),
                    help="recorded greedy outputs (recorded with the default model if absent)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cut every request to this many tokens (and its draft budget to it)")
    ap.add_argument("--curves", default="h200;cpu", help="semicolon-separated curve_of() specs")
    ap.add_argument("--overhead", type=float, default=0.0, help="per cycle, in T(1)")
    ap.add_argument("--draft-overhead", type=float, default=0.0, help="per drafted cycle, in T(1)")
    ap.add_argument("--decision-curve", default=None, help="curve_of() spec the scheduler decides with "
                    "(default: the charged curve)")
    ap.add_argument("--online", choices=("shared", "per-width"), default=None,
                    help="decide with an engine-wide cost model refreshed by every pass (each "
                         "costing the curve + --overhead): the engine's rule, or the one it replaced")
    ap.add_argument("--warmup", type=int, default=0, help="tokens of the benchmark's warm-up pass")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", type=int, default=1, help="prompt-lookup methods sharing the engine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = Path(args.outputs)
    outputs = json.loads(path.read_text()) if path.exists() else record_outputs(path, None)
    report = {}
    for spec in args.curves.split(";"):
        report[spec] = replay(outputs, curve_of(spec), args.overhead, args.draft_overhead,
                              max_tokens=args.max_tokens, warmup=args.warmup, repeats=args.repeats,
                              methods=args.methods,
                              decision_curve=curve_of(args.decision_curve) if args.decision_curve else None,
                              online=args.online)
        print(f"== {spec}: " + "  ".join(f"{w} {r['speedup']:.3f}x" for w, r in report[spec].items()),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
