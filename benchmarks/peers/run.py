"""Peer comparison: specserve against mlx_lm.server and llama.cpp's server on the same model,
the same prompts and the same OpenAI client, in one run.

Only one request is ever in flight, so each server computes alone while it is measured. Two
ways to interleave (``--interleave``):

- ``request`` (default): every server is started and warmed up (with an unrelated prompt) once;
  each workload prompt then goes to every server back to back, in an order that alternates per
  prompt and per round. On a shared machine this cancels load drifts best (seconds apart).
- ``server``: one server process at a time (start, warm up, stream every prompt once, stop),
  the order of servers reversed every other round.

Requests are greedy (``temperature=0``), streamed through the ``openai`` SDK with usage
included (llama-cpp-python's stream has no usage: its tokens are counted by re-tokenizing the
text with the same tokenizer).

Reported per workload and server: decode tokens/s (completion tokens after the first over the
time after the first text chunk), time to first token (request sent to the first non-empty
text chunk, so it includes prefill), the ratio of decode tokens/s to specserve with speculation
off and to mlx_lm.server, and output identity with specserve (speculation off) in the same round.

    python -m benchmarks.peers.run --repeats 3 --max-tokens 128 \\
        --peers specserve_off,specserve_auto,mlx_lm,llama_cpp,llama_cpp_1t \\
        --out benchmarks/results/peers_cpu.json --plot benchmarks/results/peers_cpu.png

Peers and how they are started: benchmarks/peers/servers.py. Rerun notes: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core; sets OPENBLAS_CORETYPE for children too)

from .servers import ROOT, Running, make_peers, python_path

WORKLOADS = ROOT / "benchmarks" / "workloads"
DEFAULT_WORKLOADS = "copy,code_edit,agent_turn,novel_code,prose,adversarial"
DEFAULT_PEERS = "specserve_off,specserve_auto,mlx_lm,llama_cpp"
WARMUP = [{"kind": "completion", "prompt": "Warm-up. Count from one to ten: one, two,"},
          {"kind": "chat", "messages": [{"role": "user", "content": "Say hello to the warm-up."}]}]


def build_items(names: list[str], max_tokens: int | None) -> list[dict]:
    """One request per workload prompt (multi-turn sessions are skipped: their later turns
    would depend on each server's own replies)."""
    items = []
    for name in names:
        w = json.loads((WORKLOADS / f"{name}.json").read_text())
        for i, p in enumerate(w["prompts"]):
            if p["kind"] not in ("chat", "completion"):
                continue
            cap = min(max_tokens, w["max_tokens"]) if max_tokens else w["max_tokens"]
            items.append({"workload": name, "index": i, "max_tokens": cap, **p})
    return items


def stream_one(client, model: str, item: dict, count_tokens) -> dict:
    """Stream one greedy request; returns text, token count and client-side timings (s)."""
    kw = dict(model=model, max_tokens=item["max_tokens"], temperature=0, stream=True,
              stream_options={"include_usage": True})
    chat = item["kind"] == "chat"
    start = time.perf_counter()
    if chat:
        stream = client.chat.completions.create(messages=item["messages"], **kw)
    else:
        stream = client.completions.create(prompt=item["prompt"], **kw)
    first, parts, usage, finish = None, [], None, None
    for chunk in stream:
        if getattr(chunk, "usage", None):
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text = (choice.delta.content if chat else choice.text) or ""
        finish = choice.finish_reason or finish
        if text:
            first = first or time.perf_counter()
            parts.append(text)
    end = time.perf_counter()
    text = "".join(parts)
    tokens = usage.completion_tokens if usage else count_tokens(text)
    return {"workload": item["workload"], "index": item["index"], "text": text, "tokens": tokens,
            "tokens_from": "usage" if usage else "retokenized", "finish_reason": finish,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "ttft_s": (first or end) - start, "decode_s": end - (first or end), "total_s": end - start}


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1800)


def _warm_up(client, peer, count_tokens) -> None:
    for w in WARMUP:
        stream_one(client, peer.model, {"workload": "warmup", "index": 0, "max_tokens": 16, **w}, count_tokens)


def rounds_by_server(peers, items: list[dict], repeats: int, workdir: Path, count_tokens):
    """Yield one round at a time: each peer in turn is started alone, warmed up, streams every
    item once and is stopped; the order of peers is reversed every other round."""
    for rep in range(repeats):
        rnd = {}
        for peer in (peers if rep % 2 == 0 else peers[::-1]):
            load_before = os.getloadavg()[0]
            with Running(peer, workdir) as server:
                client = _client(server)
                _warm_up(client, peer, count_tokens)
                rows = [stream_one(client, peer.model, item, count_tokens) for item in items]
            rnd[peer.name] = {"rows": rows, "ready_s": server.ready_s, "loadavg_before": load_before,
                              "loadavg_after": os.getloadavg()[0]}
        yield rnd


def rounds_by_request(peers, items: list[dict], repeats: int, workdir: Path, count_tokens):
    """Yield one round at a time: all peers are started (one after another) and stay up, but
    only one request is in flight at any time; each item goes to every peer back to back, in
    an order that alternates per item and per round, so load drifts of a shared machine hit
    every peer alike. Idle peers only wait on their sockets."""
    servers = {}
    try:
        for peer in peers:
            servers[peer.name] = Running(peer, workdir)
            _warm_up(_client(servers[peer.name]), peer, count_tokens)
        clients = {name: _client(s) for name, s in servers.items()}
        for rep in range(repeats):
            load_before = os.getloadavg()[0]
            rows = {p.name: [] for p in peers}
            for k, item in enumerate(items):
                for peer in (peers if (rep + k) % 2 == 0 else peers[::-1]):
                    rows[peer.name].append(stream_one(clients[peer.name], peer.model, item, count_tokens))
            yield {p.name: {"rows": rows[p.name], "ready_s": servers[p.name].ready_s,
                            "loadavg_before": load_before, "loadavg_after": os.getloadavg()[0]}
                   for p in peers}
    finally:
        for server in servers.values():
            server.stop()


def summarize(rows: list[dict]) -> dict:
    decode_tokens = sum(max(r["tokens"] - 1, 0) for r in rows)
    decode_s = sum(r["decode_s"] for r in rows)
    return {"requests": len(rows), "completion_tokens": sum(r["tokens"] for r in rows),
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
            "mean_ttft_s": sum(r["ttft_s"] for r in rows) / len(rows) if rows else None,
            "tokens_from": sorted({r["tokens_from"] for r in rows})}


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def report(rounds: list[dict], peers: list[str], workloads: list[str], baseline: str) -> dict:
    """Per workload and peer: summary, ratios, identity with ``baseline`` in the same round."""
    out = {}
    for w in workloads:
        entry = {}
        for p in peers:
            rows = [r for rnd in rounds for r in rnd[p]["rows"] if r["workload"] == w]
            s = summarize(rows)
            same, diverge = 0, []
            for rnd in rounds:
                base = {r["index"]: r["text"] for r in rnd[baseline]["rows"] if r["workload"] == w}
                for r in rnd[p]["rows"]:
                    if r["workload"] != w:
                        continue
                    if r["text"] == base[r["index"]]:
                        same += 1
                    else:
                        diverge.append({"prompt": r["index"], "first_diff_char": common_prefix(r["text"], base[r["index"]])})
            s["identical_to_baseline"] = f"{same}/{len(rows)}"
            s["divergences"] = diverge
            entry[p] = s
        for p in peers:
            for ref in (baseline, "mlx_lm"):
                if ref in entry and entry[ref]["decode_tokens_per_s"] and entry[p]["decode_tokens_per_s"]:
                    entry[p][f"x_vs_{ref}"] = entry[p]["decode_tokens_per_s"] / entry[ref]["decode_tokens_per_s"]
        out[w] = entry
    return out


def versions() -> dict:
    def v(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    def output(cmd: list[str]) -> str | None:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() or None

    llama_info = None
    if v("llama-cpp-python"):
        try:
            probe = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"],
                                   capture_output=True, text=True, timeout=120)
            llama_info = probe.stdout.strip() or probe.stderr.strip()[-500:]
        except subprocess.TimeoutExpired:
            llama_info = "system info probe timed out"
        libs = [f for f in (metadata.files("llama-cpp-python") or []) if "libggml.so." in str(f)]
        if libs:
            llama_info = f"ggml {max(str(f).rsplit('.so.', 1)[1] for f in libs)}; {llama_info}"
    import mlx.core as mx

    return {"specserve_git": output(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]),
            "python": sys.version.split()[0], "mlx": v("mlx"), "mlx_cuda": v("mlx-cuda-13") or v("mlx-cuda"),
            "gpu": output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]),
            "mlx_lm": v("mlx-lm"), "llama_cpp_python": v("llama-cpp-python"), "llama_cpp_system_info": llama_info,
            "openai": v("openai"), "device": str(mx.default_device()), "blas": engine.BLAS.status,
            "blas_path": engine.BLAS.path, "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()}


def prepare_models(weights: str, workdir: Path) -> tuple[str, str, str]:
    """(GGUF path, MLX dir converted by specserve with ``weights``, resolved policy)."""
    from engine.default_model import ensure_default_model
    from engine.loader import resolve_policy

    policy = resolve_policy(weights)
    gguf = str(ensure_default_model())
    mlx_dir = workdir / f"smollm2-135m-instruct-{policy}"
    if not (mlx_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "engine.convert", "--weights", policy, "--out", str(mlx_dir)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": python_path()}, check=True)
    return gguf, str(mlx_dir), policy


def set_up(args, threads: int, n_ctx: int):
    """What every peer run needs: SIGTERM unwinding like Ctrl-C (so the servers it started are
    stopped too), ``args.workdir``, the models, the peers named in ``args.peers`` and a token
    counter (the model's own tokenizer). Returns ``(workdir, gguf, mlx_dir, policy, peers,
    count_tokens)``."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    gguf, mlx_dir, policy = prepare_models(args.weights, workdir)
    peers = make_peers(args.peers.split(","), gguf, mlx_dir, policy, threads, n_ctx)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(mlx_dir)
    return workdir, gguf, mlx_dir, policy, peers, lambda text: len(hf_tok.encode(text, add_special_tokens=False))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=DEFAULT_PEERS, help="comma-separated; first = baseline for identity")
    ap.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--interleave", choices=("request", "server"), default="request",
                    help="request: all servers up, one request in flight, peer order alternating per "
                         "request; server: one server process alive at a time, order alternating per round")
    ap.add_argument("--max-tokens", type=int, default=128, help="cap on each workload's max_tokens (0: none)")
    ap.add_argument("--weights", default="auto", help="weight policy for specserve and the converted MLX dir")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp decode/prefill threads")
    ap.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp context window")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: start no round that would end past it (judged by the last round)")
    ap.add_argument("--workdir", default="/tmp/specserve-peers", help="converted model and server logs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    workdir, gguf, mlx_dir, policy, peers, count_tokens = set_up(args, args.threads, args.n_ctx)
    names = [p.name for p in peers]
    workloads = args.workloads.split(",")
    items = build_items(workloads, args.max_tokens or None)
    results = {"versions": versions(), "weights": policy, "gguf": gguf, "mlx_dir": mlx_dir,
               "peers": {p.name: {"label": p.label, "argv": p.argv, "env": p.env} for p in peers},
               "workloads": workloads, "repeats": args.repeats, "interleave": args.interleave, "max_tokens_cap": args.max_tokens,
               "requests_per_round": len(items), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": []}
    rounds = (rounds_by_request if args.interleave == "request" else rounds_by_server)(
        peers, items, args.repeats, workdir, count_tokens)
    try:
        measure(rounds, results, names, args)
    finally:
        rounds.close()  # stops the servers now, also on Ctrl-C / SIGTERM between rounds
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(results)
    if args.plot:
        plot(results, args.plot)
    return results


def measure(rounds, results: dict, names: list[str], args) -> None:
    """Consume ``rounds`` into ``results`` (rewriting ``args.out`` after every round, so a run cut
    short keeps what it measured); stop early where the next round would end past
    ``args.time_budget`` (judged by the duration of the last one, the first including start-up)."""
    started = last = time.perf_counter()
    for rep, rnd in enumerate(rounds):
        for name, measured in rnd.items():
            s = summarize(measured["rows"])
            tps = s["decode_tokens_per_s"]
            print(f"round {rep} {name:15s} ready {measured['ready_s']:5.1f} s  "
                  f"decode {tps if tps is not None else float('nan'):6.1f} tok/s  ttft {s['mean_ttft_s']:.3f} s  "
                  f"load {measured['loadavg_before']:.1f}-{measured['loadavg_after']:.1f}", flush=True)
        results["rounds"].append(rnd)
        results["results"] = report(results["rounds"], names, results["workloads"], names[0])
        results["overall"] = overall(results["rounds"], names)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
        now = time.perf_counter()
        if args.time_budget and rep + 1 < args.repeats and 2 * now - last > started + args.time_budget:
            print(f"time budget: stopping after {rep + 1} of {args.repeats} rounds", flush=True)
            return
        last = now


def overall(rounds: list[dict], peers: list[str]) -> dict:
    out = {p: summarize([r for rnd in rounds for r in rnd[p]["rows"]]) for p in peers}
    base = out[peers[0]]["decode_tokens_per_s"]
    for p in peers:
        out[p][f"x_vs_{peers[0]}"] = out[p]["decode_tokens_per_s"] / base if base else None
    return out


def print_table(results: dict) -> None:
    peers = list(results["peers"])
    print("workload      " + "".join(f"{p:>28s}" for p in peers))
    for w, entry in results["results"].items():
        cells = []
        for p in peers:
            s = entry[p]
            cells.append(f"{s['decode_tokens_per_s']:6.1f} t/s {s['mean_ttft_s']:5.2f}s "
                         f"x{s.get('x_vs_' + peers[0], 0):4.2f} {s['identical_to_baseline']:>5s}")
        print(f"{w:14s}" + "".join(f"{c:>28s}" for c in cells))


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = list(results["peers"])
    names = list(results["results"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(peers)
    for i, p in enumerate(peers):
        xs = [x + i * width for x in range(len(names))]
        ax1.bar(xs, [results["results"][n][p]["decode_tokens_per_s"] for n in names], width,
                label=results["peers"][p]["label"])
        ax2.bar(xs, [results["results"][n][p]["mean_ttft_s"] for n in names], width)
    for ax, ylabel in ((ax1, "decode tokens/s (higher is better)"), (ax2, "time to first token, s (lower is better)")):
        ax.set_xticks([x + width * (len(peers) - 1) / 2 for x in range(len(names))], names, rotation=20, ha="right")
        ax.set_ylabel(ylabel)
    v = results["versions"]
    llama = " / Q4_1 llama.cpp" if any(p.startswith("llama_cpp") for p in peers) else ""
    where = v.get("gpu") or f"{v['cpus']} CPUs"
    n = len(results["rounds"])
    fig.suptitle(f"SmolLM2-135M-Instruct, greedy, {results['weights']} MLX weights{llama}; "
                 f"{v['device']}, {where}; {n} interleaved round{'s' * (n != 1)}")
    fig.legend(loc="lower center", ncol=len(peers), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
