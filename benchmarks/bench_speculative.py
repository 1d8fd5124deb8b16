"""Speculative decoding benchmark: plain decoding vs drafters on workload files, side by side.

Every (workload, prompt, repeat) runs each method back to back in the same process, so machine
noise hits all methods alike; the order of methods rotates by one place from prompt to prompt
(and in a multi-turn session from turn to turn, every method answering a turn before the next:
:func:`run_methods`) and reverses between repeats (:func:`method_order`), so no method keeps a
position. Greedy decoding; outputs are checked token for token across methods (speculation must
not change them).

Reported per workload and method: decode tokens/s (tokens after the first over the time after
the first token), the ratio to plain decoding, acceptance rate (accepted / drafted), mean
acceptance length (1 + accepted / drafts, bonus included) and tokens per verify step. Each
ratio between two methods comes with a 95% paired bootstrap interval over the prompts (``ci95``,
``ci95_vs``): methods at break-even differ by a few percent from run to run on a shared CPU, and
the interval says whether a gap is larger than that.

A scheduler change is best judged the same way: ``--variant NAME:module.Owner.ATTR=VALUE`` and a
method ``auto+NAME`` run ``auto`` with that class-level knob set for each of its requests,
beside plain ``auto`` in the same engine (both variants share the engine-wide state, as two
versions of a request would). A method ``METHOD@N[+NAME]`` runs ``METHOD`` with
``min_draft_tokens=N`` (the request's ``speculative.min_draft_tokens``): the drafter drafts at
least ``N`` tokens every cycle it can, whatever the cost model says, e.g. ``dspark@1`` to measure
what DSpark drafting every cycle delivers beside the scheduler's own ``dspark``. Its forwards
and verified drafts feed the engine-wide DSpark evidence that the other methods' requests read
too, as any request's would.

    python -m benchmarks.bench_speculative --repeats 3 --out benchmarks/results/spec_cpu.json \
        --plot benchmarks/results/spec_cpu.png
    python -m benchmarks.bench_speculative --methods off,auto,auto+greedy \
        --variant greedy:engine.scheduler.RequestAcceptance.OPTIMISM=0
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import numpy as np

from engine import (
    SPECULATION_METHODS,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
    SpeculativeParams,
    json_grammar,
)

WORKLOADS = Path(__file__).parent / "workloads"
USE_SCHEMAS = True  # --schemas off: the same prompts as free text (what the grammar costs)
VARIANTS: dict[str, list[tuple[object, str, object]]] = {}  # --variant: name -> (owner, attr, value)


def parse_variant(spec: str) -> tuple[str, list[tuple[object, str, object]]]:
    """``NAME:pkg.module.Owner.ATTR=VALUE[,...]`` as ``(NAME, [(owner, ATTR, VALUE)])``: VALUE is
    JSON (a number, true, a string in quotes; commas inside it are kept). The knob must be one
    the engine reads each time it uses it (a class attribute such as
    ``RequestAcceptance.OPTIMISM``), not one copied into an object at start-up. Raises
    ValueError on a malformed spec, a path that does not resolve or an attribute the owner does
    not have."""
    name, sep, assigns = spec.partition(":")
    if not sep or not name or not assigns or "+" in name:
        raise ValueError(f"--variant wants NAME:module.Owner.ATTR=VALUE, got {spec!r}")
    out = []
    for assign in re.split(r",(?=\s*[A-Za-z_][\w.]*=)", assigns):  # at commas that start a new path=
        path, eq, raw = assign.partition("=")
        parts = path.strip().split(".")
        if not eq or len(parts) < 2:
            raise ValueError(f"--variant {name}: {assign!r} is not module.Owner.ATTR=VALUE")
        for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
            try:
                owner = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        else:
            raise ValueError(f"--variant {name}: no module in {path!r}")
        try:
            for part in parts[cut:-1]:
                owner = getattr(owner, part)
            getattr(owner, parts[-1])
        except AttributeError:
            raise ValueError(f"--variant {name}: {path!r} does not resolve") from None
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"--variant {name}: {raw!r} is not a JSON value") from None
        out.append((owner, parts[-1], value))
    return name, out


@contextlib.contextmanager
def method_variant(method: str):
    """``method`` as the engine's method name (``auto+NAME`` runs ``auto``), with ``--variant
    NAME``'s attributes set for as long as the block runs (one request at a time: the engine
    reads them while it serves that request), then restored (an inherited attribute is removed
    again): two variants of a class-level knob run side by side in one engine and one run.

    Raises:
        ValueError: an unknown method or variant name.
    """
    base, plus, name = method.partition("+")
    base, _ = forced(base)
    if "@" in name:
        raise ValueError(f"method {method!r}: write @N before the variant (METHOD@N+VARIANT)")
    if base not in SPECULATION_METHODS:
        raise ValueError(f"method {method!r}: not one of {', '.join(SPECULATION_METHODS)}")
    if plus and name not in VARIANTS:
        raise ValueError(f"method {method!r}: no --variant {name!r}")
    assigns = VARIANTS.get(name, []) if plus else []
    saved = [(owner, attr, attr in vars(owner), getattr(owner, attr)) for owner, attr, _ in assigns]
    try:
        for owner, attr, value in assigns:
            setattr(owner, attr, value)
        yield base
    finally:
        for owner, attr, own, value in reversed(saved):
            if own:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)


def forced(method: str) -> tuple[str, int]:
    """``METHOD@N`` -> ``(METHOD, N)`` (drafts of at least ``N`` tokens every cycle); else
    ``(method, 0)``.

    Raises:
        ValueError: ``N`` not a positive integer.
    """
    base, at, count = method.partition("@")
    if not at:
        return method, 0
    if not (count.isascii() and count.isdigit()) or int(count) < 1:
        raise ValueError(f"method {method!r}: @N needs a positive integer N (METHOD@N[+VARIANT])")
    if base == "off":
        raise ValueError(f"method {method!r}: plain decoding drafts nothing to force")
    return base, int(count)


def load_workloads(names: list[str] | None) -> list[dict]:
    files = sorted(WORKLOADS.glob("*.json"))
    loaded = [json.loads(f.read_text()) for f in files]
    if names:
        by_name = {w["name"]: w for w in loaded}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise SystemExit(f"unknown workloads {missing}; have {sorted(by_name)}")
        loaded = [by_name[n] for n in names]
    return loaded


def prompt_tokens(tokenizer, prompt: dict) -> list[int]:
    if prompt["kind"] == "session":
        raise ValueError("sessions run turn by turn (run_turns, run_methods)")
    if prompt["kind"] == "chat":
        return list(tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True))
    return tokenizer.encode(prompt["prompt"])


def run_once(eng: Engine, tokens: list[int], method: str, max_tokens: int, grammar: str | None = None) -> dict:
    with method_variant(method) as base:
        req = GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens,
                                sampling=SamplingParams(temperature=0.0),
                                speculative=SpeculativeParams(method=base,
                                                              min_draft_tokens=forced(method.partition("+")[0])[1]),
                                grammar=grammar)
        start = time.perf_counter()
        first = None
        ids = []
        last = None
        for event in eng.generate(req, timeout=3600):
            if event.error is not None:
                raise RuntimeError(event.error)
            if event.token_ids and first is None:
                first = time.perf_counter()
            ids += event.token_ids
            last = event
        end = time.perf_counter()
    stats = last.stats
    return {
        "ids": ids, "tokens": len(ids), "ttft": (first or end) - start,
        "decode_s": end - (first or end), "total_s": end - start,
        "verify_steps": stats.num_verify_steps if stats else 0,
        "drafts": stats.total.num_drafts if stats else 0,
        "by_drafter": {k: v.as_dict() for k, v in stats.by_drafter.items()} if stats else {},
        "drafted": stats.total.num_draft_tokens if stats else 0,
        "accepted": stats.total.num_accepted_tokens if stats else 0,
    }


def run_turns(eng: Engine, tok, prompt: dict, method: str, max_tokens: int) -> list[tuple[list[int], dict]]:
    """One prompt (or every turn of a session, with the assistant's replies appended to the
    history) under one method: ``(prompt tokens, run_once's row with its "ids")`` per request."""
    if prompt["kind"] != "session":
        tokens = prompt_tokens(tok, prompt)
        # a prompt with a "schema" asks for structured output (response_format json_schema)
        grammar = json_grammar(prompt["schema"]) if "schema" in prompt and USE_SCHEMAS else None
        return [(tokens, run_once(eng, tokens, method, max_tokens, grammar))]
    messages, out = [], []
    for turn in prompt["turns"]:
        messages.append({"role": "user", "content": turn})
        tokens = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        out.append((tokens, run_once(eng, tokens, method, max_tokens)))
        messages.append({"role": "assistant", "content": eng.loaded.token_table.decode(out[-1][1]["ids"])})
    return out


def run_prompt(eng: Engine, tok, prompt: dict, method: str, max_tokens: int) -> tuple[list[int], list[dict]]:
    """:func:`run_turns`, as all generated ids and one measurement row per turn (ids removed)."""
    rows = [r for _, r in run_turns(eng, tok, prompt, method, max_tokens)]
    return [t for r in rows for t in r.pop("ids")], rows


def run_methods(eng: Engine, tok, prompt: dict, methods: list[str], repeat: int, index: int,
                max_tokens: int) -> tuple[dict[str, list[int]], dict[str, list[dict]]]:
    """Every method on one prompt, back to back: ``({method: generated ids}, {method: rows})``,
    one row per request (ids removed).

    A prompt runs each method in :func:`method_order` for (``repeat``, ``index``). A session
    runs turn by turn: every method answers turn ``t`` before turn ``t + 1`` starts, in
    :func:`method_order` for (``repeat``, ``index + t``), and the history grows with the first
    method's reply (every method's, when outputs are identical). So over a session of
    ``len(methods)`` turns each method runs in each position once per repeat; run whole, one
    method after another, a one-session workload only rotated between repeats, and with 3
    repeats of 4 methods the last one (auto) ran last in two of them."""
    if prompt["kind"] != "session":
        outs, rows = {}, {}
        for m in method_order(methods, repeat, index):
            outs[m], rows[m] = run_prompt(eng, tok, prompt, m, max_tokens)
        return outs, rows
    outs: dict[str, list[int]] = {m: [] for m in methods}
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    messages: list[dict] = []
    for t, turn in enumerate(prompt["turns"]):
        messages.append({"role": "user", "content": turn})
        tokens = list(tok.apply_chat_template(messages, add_generation_prompt=True))
        replies = {}
        for m in method_order(methods, repeat, index + t):
            row = run_once(eng, tokens, m, max_tokens)
            replies[m] = row.pop("ids")
            outs[m] += replies[m]
            rows[m].append(row)
        messages.append({"role": "assistant", "content": eng.loaded.token_table.decode(replies[methods[0]])})
    return outs, rows


def method_order(methods: list[str], repeat: int, prompt: int) -> list[str]:
    """The order in which ``methods`` run for one (repeat, prompt): reversed on odd repeats,
    then rotated by ``repeat + prompt`` places. Over ``len(methods)`` consecutive prompts each
    method runs once in each position, whatever the number of repeats. (A fixed order that only
    alternated between repeats left the last method last in two of three repeats. Methods whose
    code was identical measured 1-3% apart under it; whether position caused that is not
    known.)"""
    base = list(methods) if repeat % 2 == 0 else list(methods)[::-1]
    k = (repeat + prompt) % len(base)
    return base[k:] + base[:k]


def summarize(rows: list[dict]) -> dict:
    by_drafter: dict = {}
    for r in rows:
        for name, d in r["by_drafter"].items():
            agg = by_drafter.setdefault(name, {"drafts": 0, "drafted": 0, "accepted": 0, "per_position": []})
            agg["drafts"] += d["num_drafts"]
            agg["drafted"] += d["num_draft_tokens"]
            agg["accepted"] += d["num_accepted_tokens"]
            pos = agg["per_position"]
            for i, v in enumerate(d["accepted_per_position"]):
                pos += [0] * (i + 1 - len(pos))
                pos[i] += v
    for agg in by_drafter.values():
        agg["acceptance_rate"] = agg["accepted"] / agg["drafted"] if agg["drafted"] else None
        agg["mean_acceptance_length"] = 1 + agg["accepted"] / agg["drafts"] if agg["drafts"] else None
        agg["acceptance_per_position"] = [v / agg["drafts"] for v in agg["per_position"]] if agg["drafts"] else []
    tokens = sum(r["tokens"] - 1 for r in rows)
    decode = sum(r["decode_s"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    drafts = sum(r["drafts"] for r in rows)
    steps = sum(r["verify_steps"] for r in rows)
    return {
        "runs": len(rows),
        "tokens": sum(r["tokens"] for r in rows),
        "decode_tokens_per_s": tokens / decode if decode else 0.0,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "tokens_per_verify_step": (tokens / steps) if steps else None,
        "mean_ttft_s": sum(r["ttft"] for r in rows) / len(rows),
        "by_drafter": by_drafter,
    }


def paired_interval(rows: list[dict], base: list[dict], samples: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the ratio of pooled decode rates, ``sum(tokens - 1) /
    sum(decode_s)`` of ``rows`` over that of ``base`` (as :func:`summarize` pools them).

    ``rows[i]`` and ``base[i]`` are the same request (prompt, turn, repeat) under two methods.
    Resampling draws whole prompts (a row's ``"prompt"`` key; each row its own prompt without
    it, or when all rows share one prompt) and keeps the pairs, so noise shared by a pair
    cancels and a prompt's repeats and turns stay together. Returns ``[low, high]``
    (percentiles 2.5 and 97.5), or ``[]`` without runs or when the two lists do not pair up
    (different lengths or prompts).
    """
    if not rows or len(rows) != len(base) or any(r.get("prompt") != b.get("prompt") for r, b in zip(rows, base)):
        return []
    keys = [r.get("prompt", i) for i, r in enumerate(rows)]
    if len(set(keys)) < 2:  # one prompt (a workload of one session): its runs are the units
        keys = list(range(len(rows)))
    _, group = np.unique(keys, return_inverse=True)
    groups = int(group.max()) + 1
    tok = np.zeros((2, groups))
    sec = np.zeros((2, groups))
    for j, runs in enumerate((rows, base)):
        np.add.at(tok[j], group, [r["tokens"] - 1 for r in runs])
        np.add.at(sec[j], group, [r["decode_s"] for r in runs])
    idx = np.random.default_rng(seed).integers(0, groups, (samples, groups))
    rate = tok[:, idx].sum(axis=-1) / np.maximum(sec[:, idx].sum(axis=-1), 1e-12)  # [2, samples]
    ratio = rate[0] / np.maximum(rate[1], 1e-12)
    return [round(float(v), 4) for v in np.percentile(ratio, [2.5, 97.5])]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--kernels", default="off", choices=["auto", "off"], help="SPECSERVE_KERNELS")
    ap.add_argument("--exact-verify", default="auto", choices=["auto", "row", "batched", "kernel"],
                    help="SPECSERVE_EXACT_VERIFY")
    ap.add_argument("--fused", default="auto", choices=["auto", "on", "off"], help="SPECSERVE_FUSED")
    ap.add_argument("--draft-kernel-rows", type=int, default=8, choices=[8, 16], help="SPECSERVE_DRAFT_KERNEL_ROWS")
    ap.add_argument("--draft-vocab", default="on", choices=["on", "off"],
                    help="SPECSERVE_DSPARK_DRAFT_VOCAB: the drafter's draft vocabulary, when it has one")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="SPECSERVE_COMPILE")
    ap.add_argument("--methods", default="off,prompt_lookup",
                    help="comma-separated: off, prompt_lookup, dspark, auto (off first: the baseline); "
                         "METHOD+NAME runs METHOD under --variant NAME")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:module.Owner.ATTR=VALUE",
                    help="a side-by-side variant of a class-level knob the engine reads each time it uses "
                         "it, e.g. greedy:engine.scheduler.RequestAcceptance.OPTIMISM=0 with --methods "
                         "off,auto,auto+greedy")
    ap.add_argument("--dspark-drafter", default=None,
                    help="DSpark drafter directory (loads DSpark; default: the shipped one, if any)")
    ap.add_argument("--dspark", action="store_true", help="load the shipped DSpark drafter")
    ap.add_argument("--workloads", default=None, help="comma-separated names (default: all files)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-lookup-min-ngram", type=int, default=None,
                    help="SPECSERVE_PROMPT_LOOKUP_MIN_NGRAM (default: the engine's)")
    ap.add_argument("--freeze-cost", action="store_true",
                    help="keep the start-up T(k) curve (no online refresh; a diagnostic)")
    ap.add_argument("--max-tokens", type=int, default=None, help="override each workload's max_tokens")
    ap.add_argument("--schemas", default="on", choices=["on", "off"],
                    help="off: prompts with a JSON schema run as free text (the grammar's cost)")
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--plot", default=None, help="PNG chart path")
    args = ap.parse_args(argv)

    methods = args.methods.split(",")
    try:
        VARIANTS.clear()
        for spec in args.variant:
            name, assigns = parse_variant(spec)
            if name in VARIANTS:
                raise ValueError(f"--variant {name} given twice")
            VARIANTS[name] = assigns
        for m in methods:
            with method_variant(m):
                pass
    except ValueError as exc:
        ap.error(str(exc))
    global USE_SCHEMAS
    USE_SCHEMAS = args.schemas == "on"
    workloads = load_workloads(args.workloads.split(",") if args.workloads else None)
    use_dspark = bool(args.dspark or args.dspark_drafter
                      or {"dspark", "auto"} & {forced(m.partition("+")[0])[0] for m in methods})
    extra = {} if args.prompt_lookup_min_ngram is None else {
        "prompt_lookup_min_ngram": args.prompt_lookup_min_ngram,
        "prompt_lookup_max_ngram": max(args.prompt_lookup_min_ngram, EngineConfig.prompt_lookup_max_ngram)}
    eng = Engine(EngineConfig(model=args.model, weights=args.weights, speculation="auto", dspark=use_dspark,
                              dspark_drafter=args.dspark_drafter, kernels=args.kernels,
                              exact_verify=args.exact_verify, fused=args.fused,
                              draft_kernel_rows=args.draft_kernel_rows,
                              dspark_draft_vocab=args.draft_vocab == "on",
                              compile=args.compile, **extra)).start(wait=True)
    tok = eng.loaded.tokenizer
    if args.freeze_cost:
        eng.cost.alpha = 0.0  # T(k) frozen at its start-up values (no refresh, no rescale)
    import mlx.core as mx

    results = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "device": str(mx.default_device()), "python": sys.version.split()[0],
                    "mlx": mx.__version__, "blas": engine.BLAS.status},
        "model": eng.info(), "methods": methods, "variants": args.variant, "repeats": args.repeats, "workloads": {},
        "freeze_cost": args.freeze_cost, "schemas": args.schemas,
        # the DSpark launch's kernel and drafts' vocabulary (the engine's, not the flags': a launch
        # the machine cannot run leaves these None)
        "dspark": {"draft_kernel_rows": (eng._dspark_step.fused.max_rows
                                         if eng.dspark is not None and eng._dspark_step.fused is not None else None),
                   "draft_vocab": eng.draft_vocab.size if eng.draft_vocab is not None else None},
        # the scheduler's T(k) (ms) when the benchmark starts (after the engine's warm-up passes)
        "verify_cost_ms_at_start": [round(t * 1e3, 4) for t in eng.cost.verify_cost],
    }
    print(f"device={mx.default_device()} blas={engine.BLAS.status} calibration={eng.calibration.summary()}",
          flush=True)
    for w in workloads:  # warm-up: every prompt once per method, not measured
        for p in w["prompts"]:
            for m in methods:
                run_prompt(eng, tok, p, m, 16)
    for w in workloads:
        rows = defaultdict(list)
        identical = True
        max_tokens = args.max_tokens or w["max_tokens"]
        for rep in range(args.repeats):
            for i, p in enumerate(w["prompts"]):
                outs, measured = run_methods(eng, tok, p, methods, rep, i, max_tokens)
                for m in methods:
                    rows[m] += [{**r, "prompt": i} for r in measured[m]]  # paired_interval's groups
                identical &= all(o == outs[methods[0]] for o in outs.values())
        summary = {m: summarize(rows[m]) for m in methods}
        base = summary[methods[0]]["decode_tokens_per_s"]
        for m in methods:
            summary[m]["speedup"] = summary[m]["decode_tokens_per_s"] / base if base else None
            summary[m]["ci95"] = paired_interval(rows[m], rows[methods[0]])
            summary[m]["ci95_vs"] = {o: paired_interval(rows[m], rows[o]) for o in methods[1:] if o != m}
        results["workloads"][w["name"]] = {"description": w["description"], "identical": identical,
                                           "methods": summary,
                                           # the scheduler's T(k) (ms) after this workload (online refresh)
                                           "verify_cost_ms_after": [round(t * 1e3, 4) for t in eng.cost.verify_cost]}
        if eng.dspark is not None:  # the engine-wide DSpark evidence after this workload
            ds = eng.dspark_stats
            results["workloads"][w["name"]]["dspark_after"] = {
                "timed_forwards": ds.timed_forwards, "fastest_forward_ms": round(ds.fastest_forward * 1e3, 3),
                "draft_cost_ms": round(ds.draft_cost * 1e3, 3),
                "steady_cost_at_start_ms": round(ds.steady_cost * 1e3, 3),
                # (the counts are of the recent forwards each median is over: at most COST_WINDOW)
                "steady_rows": ds.steady_rows,
                "steady_forwards": len(ds.recent_costs), "catch_up_cost_ms": round(ds.catch_up_cost * 1e3, 3),
                "catch_ups": len(ds.catch_up_costs), "prompt_forwards": len(ds.prompt_costs),
                "prompt_cost_ms": round(statistics.median(ds.prompt_costs) * 1e3, 3) if ds.prompt_costs else None,
                "catch_up_share": round(ds.catch_up_share, 3), "shared_forwards": ds.shared_forwards,
                "accepted_ema": round(ds.accepted_ema, 3), "length_ema": round(ds.length_ema, 2),
                "probe_s": round(ds.probe_seconds, 4),
                "decode_s": round(ds.decode_seconds, 3), "cycles": ds.cycles,
                "can_win": ds.can_win(eng.cost, eng.dspark.config.block_size)}
        line = "  ".join(f"{m}: {s['decode_tokens_per_s']:.1f} tok/s x{s['speedup']:.2f}"
                         + (f" [{s['ci95'][0]:.2f}, {s['ci95'][1]:.2f}]" if m != methods[0] and s["ci95"] else "")
                         + (f" acc={s['acceptance_rate']:.2f} mal={s['mean_acceptance_length']:.2f}"
                            if s["acceptance_rate"] is not None else "")
                         for m, s in summary.items())
        print(f"{w['name']:12s} identical={identical}  {line}", flush=True)
        if "dspark_after" in results["workloads"][w["name"]]:  # (in the log too: a JSON may not come back)
            print(f"{'':12s} dspark_after {results['workloads'][w['name']]['dspark_after']}", flush=True)
        if args.out:  # after every workload, so a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    eng.stop()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return results


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    methods = results["methods"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        values = [results["workloads"][n]["methods"][m]["speedup"] for n in names]
        ax.bar([x + i * width for x in range(len(names))], values, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(names))], names,
                  rotation=20, ha="right")
    ax.set_ylabel("decode tokens/s vs plain")
    ax.set_title(f"{results['model'].get('model')} on {results['machine']['device']}")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
