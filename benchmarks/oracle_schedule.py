"""How much a per-cycle choice between prompt lookup and DSpark could win at best (issue #6).

The scheduler picks, each cycle, prompt lookup, DSpark or plain decoding, and a draft length,
from estimates. This computes what a scheduler that *knew* which drafts the target accepts
would deliver, on fixed inputs: recorded greedy outputs (``replay_scheduler.record_outputs``
at 192 tokens, ``greedy_outputs_cpu_192.json``: each request's prompt tokens, session turns
included, and plain greedy output), the real
prompt-lookup drafter's proposal and the real DSpark drafter's block (drafted on this machine
from the target's tapped states of the recorded tokens, with its confidence) at every position,
and a cost profile: the verify-cost curve ``T(k)`` (default: the H200's start-up curve of the
fifty-second session's benchmark, plus ``--cycle-ms`` of host time per cycle) and DSpark's forward, which costs ``--steady-ms`` when it
projects at most one cycle's rows (``block_size + 1``), ``--catch-up-ms`` when more, and
``--prompt-ms`` for a request's first (over its prompt). Greedy speculation commits exactly the
recorded output whatever is drafted, so no verify pass runs here.

Per workload, decode time over plain decoding's (``n T(1)`` for ``n`` tokens) for:

* ``oracle_pl`` / ``oracle_dspark`` / ``oracle_both``: the fastest schedule using prompt lookup
  only, DSpark only, or both (dynamic programming over positions and DSpark's pending rows; a
  cycle verifies only drafts that will be accepted, all of them or fewer, and the bonus token
  follows). Bounds: no
  scheduler can beat them with these drafters and costs; ``oracle_both / oracle_pl`` is the
  most that adding DSpark to prompt lookup can give under these costs, what issue #6's
  mixed-session clause needs. ``*_launch``: the same with forwards of up to ``--launch-rows``
  new rows at the steady price (the 8-row launch projects up to 64 itself).
* ``pl_whole`` / ``pl_whole_dspark_gaps``: rules that guess: prompt lookup's whole proposal
  whenever it has one, else plain decoding, or else a DSpark forward paid before its block is
  seen (cut by raw confidence): ``gaps_over_pl_whole`` is what filling prompt lookup's gaps with
  DSpark is worth without foresight; ``streak_over_pl_whole`` the same while DSpark's last
  cycle accepted a draft, with a probe after 32 plain gaps.
* ``dspark_accepted_by_position``: the drafts DSpark's block would have accepted, averaged over
  every position (``all``) and over the positions where prompt lookup proposes nothing
  (``pl_gaps``), against ``forced_accepted_per_cycle`` (the forced cycles' anchors).
* ``dspark_forced``: DSpark every cycle, each block cut to the length its raw confidence makes
  best (``engine.scheduler.choose_length``), as the engine's ``min_draft_tokens=1`` runs it
  without calibration: a check of the cost profile against ``bench_speculative``'s ``dspark@1``.

What it leaves out: host time between cycles, the online refresh of ``T(k)``, context-dependent
costs, sampling; DSpark's drafts here come from one batched pass of the target over the
recorded tokens (the engine taps them cycle by cycle; rows agree to rounding).

    python -m benchmarks.oracle_schedule --workloads agent_session,novel_code,novel_chat \\
        --tables drafts.json --out benchmarks/results/oracle_schedule.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
NEVER = -1  # DSpark has not run in this request: its next forward projects the prompt


def accepted(draft: list[int], output: list[int], start: int) -> int:
    """How many of ``draft`` equal ``output[start:]``, in order."""
    n = 0
    while n < len(draft) and start + n < len(output) and draft[n] == output[start + n]:
        n += 1
    return n


def forward_seconds(rows: int | None, steady: float, catch_up: float, prompt: float, steady_rows: int) -> float:
    """A DSpark forward's price after ``rows`` committed rows since its last one (None: it has
    not run in this request, so it projects the prompt)."""
    return prompt if rows is None else steady if rows <= steady_rows else catch_up


def best_times(pl: list[int], ds: list[int], n: int, T: list[float], steady: float, catch_up: float,
               prompt: float, steady_rows: int, use_pl: bool = True, use_ds: bool = True) -> tuple[float, dict]:
    """The fastest schedule for ``n`` output tokens.

    Args:
        pl, ds: accepted drafts of prompt lookup's proposal and DSpark's block at each output
            index ``i`` (the cycle whose first new token is ``output[i]``), each at most
            ``n - i - 1`` (a draft never runs past the output).
        T: seconds of a verify pass of ``k`` rows, ``T[k - 1]``.
        steady, catch_up, prompt: seconds of a DSpark forward projecting at most
            ``steady_rows`` new context rows, more, or the prompt (the request's first).

    Returns:
        ``(seconds, cycles)``: the least decode time, and how many cycles of each kind
        (``plain``, ``prompt_lookup``, ``dspark``) one fastest schedule runs.
    """
    stale = steady_rows + 1
    states = [NEVER, *range(1, stale + 1)]

    def after(r: int, committed: int) -> int:  # DSpark's pending rows after another cycle
        return NEVER if r == NEVER else min(r + committed, stale)

    def forward(r: int) -> float:
        return forward_seconds(None if r == NEVER else r, steady, catch_up, prompt, steady_rows)

    best = {(n, r): (0.0, None) for r in states}
    for i in range(n - 1, -1, -1):
        for r in states:
            # (a cycle may verify fewer drafts than would be accepted: the next cycle then starts
            # elsewhere, maybe on a better proposal)
            options = [(T[0] + best[i + 1, after(r, 1)][0], ("plain", 1, after(r, 1)))]
            for a in range(1, pl[i] + 1) if use_pl else ():
                options.append((T[a] + best[i + a + 1, after(r, a + 1)][0], ("prompt_lookup", a + 1, after(r, a + 1))))
            for a in range(ds[i] + 1) if use_ds else ():
                rows = min(a + 1, stale)
                options.append((forward(r) + T[a] + best[i + a + 1, rows][0], ("dspark", a + 1, rows)))
            best[i, r] = min(options, key=lambda o: o[0])
    cycles = {"plain": 0, "prompt_lookup": 0, "dspark": 0}
    i, r = 0, NEVER
    while i < n:
        kind, step, r = best[i, r][1]
        cycles[kind] += 1
        i += step
    return best[0, NEVER][0], cycles


def forced_time(ds_blocks: list[tuple[list[int], list[float]]], output: list[int], T: list[float], steady: float,
                catch_up: float, prompt: float, steady_rows: int) -> tuple[float, float]:
    """Decode seconds and mean accepted drafts per cycle of DSpark drafting every cycle, each
    block cut to the length its raw confidence makes best (at least 1, as the engine's
    ``min_draft_tokens=1``; the engine rescales the confidence by its online calibration
    first, ``DsparkStats.calibrated``, which this leaves out). A cycle with no room to draft
    (the output's last token) runs no forward."""
    from engine.scheduler import CostModel, choose_length

    cost, n = CostModel(list(T)), len(output)
    i, spent, rows, cycles, accepted_total = 0, 0.0, None, 0, 0
    while i < n:
        tokens, confidence = ds_blocks[i]
        room = min(len(tokens), n - i - 1)
        if not room:  # (Sequence.draft_budget 0: plain decoding)
            spent += T[0]
            i += 1
            continue
        length = max(1, choose_length(confidence[:room], cost)[0])
        a = accepted(tokens[:length], output, i)
        # (the forward projects the rows the previous cycle committed; the first, the prompt)
        spent += forward_seconds(rows, steady, catch_up, prompt, steady_rows) + T[length]
        rows, cycles, accepted_total = a + 1, cycles + 1, accepted_total + a
        i += a + 1
    return spent, accepted_total / max(1, cycles)


def gap_fill_time(pl_blocks: list[list[int]], ds_blocks: list[tuple[list[int], list[float]]], output: list[int],
                  T: list[float], steady: float, catch_up: float, prompt: float, steady_rows: int,
                  use_ds: bool = True, keep_if: int = 0, probe_every: int = 0) -> float:
    """Decode seconds of a rule that guesses: prompt lookup's whole proposal whenever it has one,
    else (``use_ds``) a DSpark forward whose block is cut by its raw confidence
    (``choose_length``, possibly to nothing), else plain decoding. With and without DSpark,
    the ratio is what filling prompt lookup's gaps with DSpark is worth when every DSpark
    forward is paid before its block is seen. ``keep_if > 0``: DSpark runs in a gap only while
    its last cycle accepted at least that many drafts, else after ``probe_every`` gaps of plain
    decoding (a streak rule)."""
    from engine.scheduler import CostModel, choose_length

    cost, n = CostModel(list(T)), len(output)
    i, spent, rows = 0, 0.0, None  # rows: committed since DSpark's last forward (None: never ran)
    winning, idle = True, 0  # (the streak rule: the last DSpark cycle's verdict, plain gaps since)
    while i < n:
        room = n - i - 1
        proposal = pl_blocks[i][:room]
        if proposal:
            a = accepted(proposal, output, i)
            spent += T[len(proposal)]
        elif use_ds and room and (not keep_if or winning or idle >= probe_every):
            tokens, confidence = ds_blocks[i]
            length = choose_length(confidence[:room], cost)[0]
            a = accepted(tokens[:length], output, i)
            spent += forward_seconds(rows, steady, catch_up, prompt, steady_rows) + T[length]
            rows, winning, idle = 0, a >= keep_if, 0
        else:
            a = 0
            spent += T[0]
            idle += 1
        rows = None if rows is None else rows + a + 1
        i += a + 1
    return spent


def draft_tables(eng, prompt: list[int], output: list[int], max_draft: int):
    """Per output index ``i``: prompt lookup's proposal and DSpark's block ``(tokens,
    confidence)`` for the cycle whose first new token is ``output[i]``."""
    import mlx.core as mx

    from drafters import PromptLookupDrafter
    from drafters.base import DraftContext
    from drafters.dspark.drafter import DSparkDrafter

    cfg = eng.config
    lookup = PromptLookupDrafter(cfg.prompt_lookup_min_ngram, cfg.prompt_lookup_max_ngram)
    taps, net = eng.target_taps, eng.dspark
    full = prompt + output
    hidden = taps.forward(mx.array(full)[None])[1][0].astype(mx.float32)
    mx.eval(hidden)
    drafter = DSparkDrafter(net, taps.embed, taps.lm_head, eng._dspark_step)
    pl, ds = [], []
    for i in range(len(output)):
        tokens = full[: len(prompt) + i]
        room = min(max_draft, len(output) - i - 1)
        proposal = lookup.propose(DraftContext(tokens), room) if room > 0 else None
        pl.append(list(proposal.tokens) if proposal is not None else [])
        anchor = len(tokens) - 1
        block = drafter.propose(DraftContext(tokens, hidden[drafter.projected_length:anchor]), net.config.block_size)
        ds.append((list(block.tokens), list(block.confidence or [0.5] * len(block.tokens))))
    return pl, ds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", default=str(RESULTS / "greedy_outputs_cpu_192.json"),
                    help="recorded greedy outputs (benchmarks/replay_scheduler.record_outputs)")
    ap.add_argument("--workloads", default="agent_session,agent_turn,code_edit,novel_code,novel_chat")
    ap.add_argument("--max-tokens", type=int, default=192, help="each output's first tokens only")
    ap.add_argument("--curve", default=str(RESULTS / "spec_h200_s52_auto_a.json"),
                    help="a bench_speculative result whose verify_cost_ms_at_start is T(k)")
    # DSpark's forward as the H200's engine timed it in the fifty-second session (steady 1.3-1.4
    # ms, catch-ups 2.4-2.7 ms, prompts ~3.0 ms) plus 0.7 ms a DSpark cycle costs beyond that
    # (host time of its path, the taps): with it, dspark_forced comes out near bench_speculative's
    # dspark@1 on the H200 (docs/benchmarks.md)
    ap.add_argument("--steady-ms", type=float, default=2.0)
    ap.add_argument("--catch-up-ms", type=float, default=3.2)
    ap.add_argument("--prompt-ms", type=float, default=3.7)
    ap.add_argument("--cycle-ms", type=float, default=0.1,
                    help="host time every cycle adds to its verify pass (H200, plain decoding in the "
                         "fifty-second session's benchmark: 1.94 ms per token against T(1) 1.85 ms)")
    ap.add_argument("--launch-rows", type=int, default=64,
                    help="a second profile, *_launch: forwards of up to this many new rows at the steady "
                         "price (the 8-row launch projects up to 64 itself; what they really cost is "
                         "between the two profiles until dspark_cost's sweep runs on the GPU)")
    ap.add_argument("--drafter", default=None, help="DSpark drafter directory (default: the shipped one)")
    ap.add_argument("--tables", default=None,
                    help="JSON cache of the drafts at every position (written when absent, read when "
                         "present: other costs then need no model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import engine  # noqa: F401  (OpenBLAS before mlx.core)
    from engine import Engine, EngineConfig

    T = [(ms + args.cycle_ms) / 1e3 for ms in json.loads(Path(args.curve).read_text())["verify_cost_ms_at_start"]]
    costs = dict(steady=args.steady_ms / 1e3, catch_up=args.catch_up_ms / 1e3, prompt=args.prompt_ms / 1e3)
    outputs = json.loads(Path(args.outputs).read_text())
    names = args.workloads.split(",")
    cache = Path(args.tables) if args.tables else None
    if cache is not None and cache.exists():
        tables = json.loads(cache.read_text())
    else:
        eng = Engine(EngineConfig(speculation="auto", dspark=True, dspark_drafter=args.drafter, warmup=False))
        eng.start(wait=True)
        try:
            tables = {"steady_rows": eng.dspark_stats.steady_rows, "workloads": {
                name: [draft_tables(eng, prompt, output[: args.max_tokens], len(T) - 1) for prompt, output in outputs[name]]
                for name in names}}
        finally:
            eng.stop()
        if cache is not None:
            cache.write_text(json.dumps(tables))
    report = {"curve_ms": [round(t * 1e3, 4) for t in T], "cycle_ms": args.cycle_ms,
              "forward_ms": {k: v * 1e3 for k, v in costs.items()}, "launch_rows": args.launch_rows,
              "workloads": {}}
    steady_rows = tables["steady_rows"]
    for name in names:
        totals = {"tokens": 0, "plain": 0.0, "oracle_pl": 0.0, "oracle_dspark": 0.0, "oracle_both": 0.0,
                  "oracle_dspark_launch": 0.0, "oracle_both_launch": 0.0, "dspark_forced": 0.0,
                  "pl_whole": 0.0, "pl_whole_dspark_gaps": 0.0, "pl_whole_dspark_streak": 0.0}
        mix = {"plain": 0, "prompt_lookup": 0, "dspark": 0}
        forced_acc = []
        matches: dict[str, list[int]] = {"all": [], "pl_gaps": []}  # DSpark's block, position by position
        for (_prompt, output), (pl_blocks, ds_blocks) in zip(outputs[name], tables["workloads"][name]):
            output = output[: args.max_tokens]
            n = len(output)
            pl = [min(accepted(d, output, i), n - i - 1) for i, d in enumerate(pl_blocks)]
            ds = [min(accepted(t, output, i), n - i - 1) for i, (t, _) in enumerate(ds_blocks)]
            totals["tokens"] += n
            totals["plain"] += n * T[0]
            matches["all"] += ds
            matches["pl_gaps"] += [a for a, d in zip(ds, pl_blocks) if not d]
            for key, use_pl, use_ds, rows in (
                    ("oracle_pl", True, False, steady_rows), ("oracle_dspark", False, True, steady_rows),
                    ("oracle_both", True, True, steady_rows),
                    ("oracle_dspark_launch", False, True, max(steady_rows, args.launch_rows)),
                    ("oracle_both_launch", True, True, max(steady_rows, args.launch_rows))):
                seconds, cycles = best_times(pl, ds, n, T, steady_rows=rows, use_pl=use_pl, use_ds=use_ds, **costs)
                totals[key] += seconds
                if key == "oracle_both":
                    for k, v in cycles.items():
                        mix[k] += v
            seconds, acc = forced_time(ds_blocks, output, T, steady_rows=steady_rows, **costs)
            totals["dspark_forced"] += seconds
            forced_acc.append(acc)
            for key, use_ds, keep_if in (("pl_whole", False, 0), ("pl_whole_dspark_gaps", True, 0),
                                         ("pl_whole_dspark_streak", True, 1)):
                totals[key] += gap_fill_time(pl_blocks, ds_blocks, output, T, steady_rows=steady_rows,
                                             use_ds=use_ds, keep_if=keep_if, probe_every=32, **costs)
        row = {k: round(totals["plain"] / v, 3) for k, v in totals.items() if k not in ("tokens", "plain")}
        row["both_over_pl"] = round(totals["oracle_pl"] / totals["oracle_both"], 3)
        row["both_launch_over_pl"] = round(totals["oracle_pl"] / totals["oracle_both_launch"], 3)
        row["gaps_over_pl_whole"] = round(totals["pl_whole"] / totals["pl_whole_dspark_gaps"], 3)
        row["streak_over_pl_whole"] = round(totals["pl_whole"] / totals["pl_whole_dspark_streak"], 3)
        row["oracle_both_cycles"] = mix
        row["forced_accepted_per_cycle"] = round(sum(forced_acc) / len(forced_acc), 3)
        # what DSpark's block would accept at every position, and where prompt lookup has nothing
        # (where auto's probes and gap-filling rules run it): are those positions harder?
        row["dspark_accepted_by_position"] = {k: round(sum(v) / len(v), 3) if v else None for k, v in matches.items()}
        row["requests"], row["tokens"] = len(outputs[name]), totals["tokens"]
        report["workloads"][name] = row
        print(name, row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
