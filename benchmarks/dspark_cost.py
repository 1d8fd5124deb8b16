"""What DSpark must accept to pay for its forward, on this machine (issue #5 / #6).

Runs benchmark workloads with DSpark forced to draft every cycle (``min_draft_tokens = 1``: the
gate is off) and times each draft forward (``DSparkDrafter.propose``), split into the first
forward of a request (it projects the whole prompt's tapped hidden states and sets up the
request's draft cache) and the steady ones (the last cycle's committed rows each). With the engine's start-up curve ``T(k)``, a DSpark cycle of ``L`` drafts
beats plain decoding only if ``1 + accepted > (T(L + 1) + forward) / T(1)``; the report gives that
break-even next to the accepted drafts per forced cycle measured.

It then times the same draft forwards through an eager and a compiled
:class:`~drafters.dspark.DraftStep` side by side (alternating, same context rows, 1-4 new rows
per cycle), which is what ``mx.compile`` of the drafter is worth on this machine, and the
engine's own forward by the number of new context rows it projects first (``rows_sweep``: what a
catch-up after other drafters' cycles costs, in the fused launch and as MLX ops before it).

    python -m benchmarks.dspark_cost --workloads novel_code,novel_chat --out dspark_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import weakref
from pathlib import Path
from unittest import mock

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from benchmarks.bench_speculative import load_workloads, prompt_tokens
from drafters.base import DraftContext
from drafters.dspark import DraftStep
from drafters.dspark import drafter as dspark_drafter
from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, SpeculativeParams


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="novel_code,novel_chat")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--cycles", type=int, default=60, help="cycles of the eager/compiled comparison")
    ap.add_argument("--drafter", default=None, help="a DSpark drafter directory (default: the shipped one)")
    ap.add_argument("--draft-kernel-rows", type=int, default=8, choices=[8, 16], help="SPECSERVE_DRAFT_KERNEL_ROWS")
    ap.add_argument("--draft-vocab", default="on", choices=["on", "off"],
                    help="SPECSERVE_DSPARK_DRAFT_VOCAB: the drafter's draft vocabulary, when it has one")
    ap.add_argument("--sweep-contexts", default="256,2048",
                    help="context lengths of the forward-by-new-rows sweep (comma-separated; empty: none)")
    ap.add_argument("--sweep-rows", default="1,4,8,9,16,17,32,48,64,65,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    eng = Engine(EngineConfig(speculation="dspark", dspark=True, dspark_drafter=args.drafter,
                              draft_kernel_rows=args.draft_kernel_rows,
                              dspark_draft_vocab=args.draft_vocab == "on")).start(wait=True)
    forwards: list[tuple[bool, float]] = []  # (a request's first forward, ms)
    propose = dspark_drafter.DSparkDrafter.propose

    seen = weakref.WeakSet()  # the requests' drafters that have run a forward

    def timed(self, ctx, max_len):
        first = self not in seen  # (not projected_length == 0: a 1-token prompt's first leaves it at 0)
        seen.add(self)
        started = time.perf_counter()
        try:
            return propose(self, ctx, max_len)
        finally:
            forwards.append((first, 1e3 * (time.perf_counter() - started)))

    dspark_drafter.DSparkDrafter.propose = timed
    try:
        tok = eng.loaded.tokenizer
        drafts = drafted = accepted = 0
        for w in load_workloads(args.workloads.split(",")):
            for p in w["prompts"]:
                if p.get("kind") == "session":
                    continue
                req = GenerationRequest(prompt_tokens=prompt_tokens(tok, p), max_tokens=args.max_tokens,
                                        sampling=SamplingParams(temperature=0.0),
                                        speculative=SpeculativeParams("dspark", None, 1))
                last = None
                for event in eng.generate(req):
                    last = event
                counts = last.stats.by_drafter.get("dspark")
                if counts is not None:
                    drafts += counts.num_drafts
                    drafted += counts.num_draft_tokens
                    accepted += counts.num_accepted_tokens
        curve, info = eng.cost.verify_cost, eng.info()
        fused_rows = eng._dspark_step.fused.max_rows if eng._dspark_step.fused is not None else None
        dspark_drafter.DSparkDrafter.propose = propose  # (the comparison's forwards are its own)
        first_prompt = next(p for w in load_workloads(args.workloads.split(",")) for p in w["prompts"]
                            if p.get("kind") != "session")
        steps = compare_steps(eng, prompt_tokens(tok, first_prompt), args.cycles)
        contexts = [int(c) for c in args.sweep_contexts.split(",") if c]
        sweep = rows_sweep(eng, prompt_tokens(tok, first_prompt), contexts,
                           [int(r) for r in args.sweep_rows.split(",")]) if contexts else {}
    finally:
        dspark_drafter.DSparkDrafter.propose = propose
        eng.stop()
    # (forced every cycle, a request's later forwards each project the last cycle's committed
    # rows, at most the block's: steady ones; its first projects the prompt)
    steady = [ms for first, ms in forwards if not first]
    first = [ms for first, ms in forwards if first]
    forward = statistics.median(steady) if steady else float("nan")
    length = round(drafted / drafts) if drafts else 1
    t1, tl = curve[0] * 1e3, curve[min(length, len(curve) - 1)] * 1e3
    report = {
        "model": info, "forwards": len(forwards),
        "steady_forward_ms": round(forward, 3),
        "first_forward_ms": round(statistics.median(first), 3) if first else None,
        "T1_ms": round(t1, 3), "mean_draft_length": round(drafted / drafts, 2) if drafts else 0,
        "accepted_per_cycle": round(accepted / drafts, 3) if drafts else 0,
        "break_even_accepted": round((tl + forward) / t1 - 1, 3),
        "draft_vocab": eng.draft_vocab.size if eng.draft_vocab is not None else None,
        "draft_kernel_rows": fused_rows,
        "eager_vs_compiled": steps,
        "forward_ms_by_new_rows": sweep,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def compare_steps(eng: Engine, prompt: list[int], cycles: int) -> dict:
    """Median ms per steady draft forward (7 drafts, greedy) of an eager and a compiled
    :class:`DraftStep`, alternating on identical inputs: the prompt's tapped states, then 1-4 new
    rows per cycle (the prompt's own tokens stand in for accepted drafts)."""
    taps, net = eng.target_taps, eng.dspark
    tokens = (prompt * (1 + (cycles * 4 + 64) // max(1, len(prompt))))[: len(prompt) + cycles * 4 + 8]
    hidden = taps.forward(mx.array(tokens)[None])[1][0]
    mx.eval(hidden)
    drafters = {name: dspark_drafter.DSparkDrafter(net, taps.embed, taps.lm_head,
                                                   DraftStep(net, taps.embed, taps.lm_head, compiled=name == "compiled",
                                                             vocab=eng.draft_vocab))
                for name in ("eager", "compiled")}
    times: dict[str, list[float]] = {name: [] for name in drafters}
    agree = 0
    seen = {name: 0 for name in drafters}
    pos = len(prompt) - 1
    for cycle in range(cycles + 3):
        outs = {}
        for name, d in drafters.items():
            ctx = DraftContext(tokens[: pos + 1], hidden[seen[name]:pos])
            started = time.perf_counter()
            outs[name] = d.propose(ctx, 7).tokens
            if cycle >= 3:  # the first cycles absorb the prompt and compile
                times[name].append(1e3 * (time.perf_counter() - started))
            seen[name] = pos
        agree += outs["eager"] == outs["compiled"]
        pos += 1 + cycle % 4
    eager, compiled = (statistics.median(times[n]) for n in ("eager", "compiled"))
    return {"eager_ms": round(eager, 3), "compiled_ms": round(compiled, 3),
            "eager_over_compiled": round(eager / compiled, 2), "same_drafts": f"{agree}/{cycles + 3}",
            **split_forward(net, taps, tokens, hidden, len(prompt) - 1, cycles, eng.draft_vocab)}


def rows_sweep(eng: Engine, prompt: list[int], contexts: list[int], sizes: list[int],
               iters: int = 15) -> dict:
    """Median ms of the engine's draft forward (:meth:`DSparkDrafter.propose`, 7 greedy drafts, the
    engine's :class:`DraftStep`) that first projects ``N`` new context rows, for each ``N`` in
    ``sizes``, at each context length in ``contexts``: ``launch`` the way the engine runs it (in
    the fused launch up to ``DraftStep.steady_rows``, else as MLX ops first), ``ops`` with the
    rows always projected as MLX ops before the launch (a compiled padded update up to
    ``MAX_PADDED_ROWS``; without a fused launch the two are the same path). The same rows are
    projected again each time (the drafter's length is set back), so the context stays put.
    Returns ``{context: {N: {"launch": ms, "ops": ms}}}``."""
    taps, net, step = eng.target_taps, eng.dspark, eng._dspark_step
    longest = max(contexts) + 1
    tokens = (prompt * (1 + longest // max(1, len(prompt))))[:longest]
    hidden = taps.forward(mx.array(tokens)[None])[1][0].astype(mx.float32)  # (as requests pass them)
    mx.eval(hidden)
    out: dict = {}
    for context in contexts:
        d = dspark_drafter.DSparkDrafter(net, taps.embed, taps.lm_head, step)
        d.propose(DraftContext(tokens[: context + 1], hidden[:context]), 7)  # the prompt's forward
        row: dict = {}
        for n in (n for n in sizes if n <= context):
            row[n] = {}
            for mode in ("launch", "ops"):
                times = []
                for i in range(iters + 2):
                    d._length, d._pending = context - n, []
                    ops_first = mock.patch.object(step, "absorbs_in_launch", return_value=False)
                    with ops_first if mode == "ops" else contextlib.nullcontext():
                        started = time.perf_counter()
                        d.propose(DraftContext(tokens[: context + 1], hidden[context - n:context]), 7)
                        elapsed = time.perf_counter() - started
                    if i >= 2 and not d.traced:  # (the first ones compile)
                        times.append(1e3 * elapsed)
                row[n][mode] = round(statistics.median(times), 3) if times else None
        out[context] = row
        print(f"forward ms by new rows at context {context}:",
              {n: (v["launch"], v["ops"]) for n, v in row.items()}, flush=True)
    return out


def split_forward(net, taps, tokens: list[int], hidden, pos: int, cycles: int, vocab=None) -> dict:
    """The compiled forward in two synchronised halves (context update, then draft), and the
    cost of one host round trip (a trivial graph evaluated and read back), median ms."""
    d = dspark_drafter.DSparkDrafter(net, taps.embed, taps.lm_head,
                                     DraftStep(net, taps.embed, taps.lm_head, vocab=vocab))
    d._absorb(hidden[:pos])
    d._update_context()
    mx.eval(*d._keys, *d._values)
    update_ms, draft_ms, sync_ms = [], [], []
    for cycle in range(cycles + 3):
        new = 1 + cycle % 4
        started = time.perf_counter()
        d._absorb(hidden[pos : pos + new])
        d._update_context()
        mx.eval(*d._keys, *d._values)
        mid = time.perf_counter()
        out = d.step.draft(int(tokens[pos + new]), pos + new, d._keys, d._values, 7, 0.0, 0)
        mx.eval(*(a for a in out if a is not None))
        out[0].tolist()
        ended = time.perf_counter()
        one = mx.array([cycle]) + 1
        mx.eval(one)
        one.tolist()
        synced = time.perf_counter()
        pos += new
        if cycle >= 3:
            update_ms.append(1e3 * (mid - started))
            draft_ms.append(1e3 * (ended - mid))
            sync_ms.append(1e3 * (synced - ended))
    return {"compiled_update_ms": round(statistics.median(update_ms), 3),
            "compiled_draft_ms": round(statistics.median(draft_ms), 3),
            "round_trip_ms": round(statistics.median(sync_ms), 3)}


if __name__ == "__main__":
    main()
