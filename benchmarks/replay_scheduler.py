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

Reported per curve and workload: replayed speed-up over plain decoding (``n T(1)`` per ``n``
tokens), drafts, drafted and accepted tokens. What it leaves out: host time that differs
between cycles, online refresh of T(k), sampling.

    python -m benchmarks.replay_scheduler --outputs benchmarks/results/greedy_outputs_cpu.json
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
    from benchmarks.bench_speculative import load_workloads, prompt_tokens
    from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, SpeculativeParams

    eng = Engine(EngineConfig(speculation="off")).start(wait=True)
    tok = eng.loaded.tokenizer

    def generate(tokens, n):
        req = GenerationRequest(prompt_tokens=tokens, max_tokens=n, sampling=SamplingParams(temperature=0.0),
                                speculative=SpeculativeParams(method="off"))
        return [t for ev in eng.generate(req, timeout=3600) for t in ev.token_ids]

    out = {}
    try:
        for w in load_workloads(None):
            n = max_tokens or w.get("max_tokens", 128)
            requests = []
            for prompt in w["prompts"]:
                if prompt["kind"] != "session":
                    tokens = prompt_tokens(tok, prompt)
                    requests.append([tokens, generate(tokens, n)])
                    continue
                messages = []
                for turn in prompt["turns"]:
                    messages.append({"role": "user", "content": turn})
                    tokens = list(tok.apply_chat_template(messages, add_generation_prompt=True))
                    reply = generate(tokens, n)
                    requests.append([tokens, reply])
                    messages.append({"role": "assistant", "content": eng.loaded.token_table.decode(reply)})
            out[w["name"]] = requests
            print(f"recorded {w['name']}: {len(requests)} requests", flush=True)
    finally:
        eng.close()
    path.write_text(json.dumps(out))
    return out


def replay(outputs: dict, curve: list[float], overhead: float = 0.0, draft_overhead: float = 0.0,
           max_draft: int = 15, min_n: int = 2, max_n: int = 5) -> dict:
    """Replayed speed-up per workload for one cost curve (relative ``T(k)/T(1)``)."""
    from drafters import PromptLookupDrafter
    from drafters.base import DraftContext
    from engine.scheduler import AcceptanceModel, CostModel, RequestAcceptance, choose_length

    model = AcceptanceModel()
    result = {}
    for name, requests in outputs.items():
        plain = spec = 0.0
        drafts = drafted = accepted = 0
        for prompt, output in requests:
            cost = CostModel(list(curve))
            acceptance = RequestAcceptance(model)
            drafter = PromptLookupDrafter(min_n, max_n)
            n = 0
            while n < len(output):
                tokens = prompt + output[:n]
                budget = min(len(output) - n - 1, cost.max_rows - 1, max_draft)
                length = 0
                proposal = drafter.propose(DraftContext(tokens), budget) if budget > 0 else None
                if proposal is not None and proposal.tokens:
                    conditional = acceptance.survival(proposal.match_length, len(proposal.tokens))
                    length = choose_length(conditional, cost)[0]
                ok = 0
                if length:
                    draft = proposal.tokens[:length]
                    while ok < length and draft[ok] == output[n + ok]:
                        ok += 1
                    acceptance.observe(proposal.match_length, length, ok)
                    drafts, drafted, accepted = drafts + 1, drafted + length, accepted + ok
                spec += cost.T(length + 1) + overhead + (draft_overhead if length else 0.0)
                n += ok + 1
            plain += len(output) * (1.0 + overhead)
        result[name] = {"speedup": plain / spec, "drafts": drafts, "drafted": drafted, "accepted": accepted}
    return result


def curve_of(name: str) -> list[float]:
    run = json.loads(CURVES[name].read_text())
    return run["model"]["verify_cost_relative"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", default=str(RESULTS / "greedy_outputs_cpu.json"))
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--curves", default="h200,cpu")
    ap.add_argument("--overhead", type=float, default=0.0)
    ap.add_argument("--draft-overhead", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = Path(args.outputs)
    outputs = json.loads(path.read_text()) if path.exists() else record_outputs(path, args.max_tokens)
    report = {}
    for name in args.curves.split(","):
        report[name] = replay(outputs, curve_of(name), args.overhead, args.draft_overhead)
        print(f"== {name}: " + "  ".join(f"{w} {r['speedup']:.3f}x" for w, r in report[name].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
