"""Where do verify rows and one-token decode steps part? A per-layer exactness probe.

Greedy speculative output equals plain greedy output only if row ``i`` of a ``w``-row verify
pass computes exactly what the one-token decode step at that position computes (DESIGN.md,
exactness rules). The engine's start-up calibration checks a few widths at two contexts; when a
real run still diverges (the bf16 run in docs/benchmarks.md), this finds where:

1. prefill the prompt, then decode ``--tokens`` greedy tokens one at a time, keeping each step's
   logits and every transformer layer's output;
2. for each width ``w``, verify ``w`` of those same tokens in one pass from successive start
   positions (cache rolled back to the start each time) and compare every row's layer outputs
   and logits with the decode step at the same position, bit for bit;
3. report, per width, the first mismatching position and row, the first layer whose K/V rows
   or output differ there (or the logits only) and by how much. Every pass starts from
   decode's own KV cache; the prompt is prefilled in the engine's chunks.

The passes run as the engine runs them: ``--exact-verify`` ``row`` (one attention call per row,
the default), ``kernel`` (metal_kernels' row-attention kernel, CUDA) or ``batched`` (MLX's
batched attention); ``--weights`` and ``--kernels`` as the server's settings.

    python -m benchmarks.identity_probe --prompt-file benchmarks/workloads/agent_turn.json \\
        --weights quantized-bfloat16 --kernels auto --widths 2,4,8,10,16 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from engine.runner import TargetRunner


class _Recorder(nn.Module):
    """A transformer layer that appends its output to ``sink`` (nothing else changes)."""

    def __init__(self, inner: nn.Module, sink: list, index: int):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_sink", sink)  # a plain attribute, not a child module
        object.__setattr__(self, "_index", index)

    def __getattr__(self, key):  # model code reads layer attributes (e.g. use_sliding)
        if key in self:
            return self[key]
        if "inner" not in self:
            raise AttributeError(key)
        return getattr(self["inner"], key)

    def __call__(self, x, *args, **kwargs):
        out = self.inner(x, *args, **kwargs)
        self._sink.append((self._index, out))
        return out


def record_layers(model: nn.Module) -> list:
    """Wrap every layer of an mlx-lm model (``model.layers``); returns the shared sink of
    ``(layer index, output [1, L, d])`` pairs, in call order."""
    sink: list = []
    layers = model.layers
    for i in range(len(layers)):
        layers[i] = _Recorder(layers[i], sink, i)
    return sink


def configure(runner: TargetRunner, mode: str) -> None:
    """Make every decode/verify pass attend as the engine's ``exact_verify`` mode does."""
    runner.row_exact_attention = mode != "batched"
    runner.batched_rows = 1 << 30 if mode == "batched" else 0
    runner.row_kernel = None
    if mode == "kernel":
        from metal_kernels import attention

        if attention.backend() != "cuda":
            raise SystemExit("--exact-verify kernel needs the CUDA backend")
        runner.row_kernel = attention.row_attention


def _pass(runner, tokens, cache, sink):
    sink.clear()
    logits = runner.verify(tokens, cache)[0]
    outs = [o for _, o in sorted(sink, key=lambda p: p[0])]
    if len(outs) != len(runner.model.layers):
        raise RuntimeError(f"recorded {len(outs)} layer outputs for {len(runner.model.layers)} layers")
    mx.eval(logits, *outs)
    return logits, outs


def _restore(cache, snapshot) -> None:
    """Put decode's own KV back (copies: a pass writes into the cache's buffers in place)."""
    for c, (k, v, off) in zip(cache, snapshot):
        c.keys, c.values, c.offset = mx.array(k), mx.array(v), off


def _differs(a: mx.array, b: mx.array) -> float | None:
    """None when bit-identical, else the largest absolute difference."""
    if mx.array_equal(a, b).item():
        return None
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def probe(runner: TargetRunner, sink: list, prompt: list[int], n_tokens: int, widths: list[int],
          stride: int = 1, prefill_step: int = 256, forced: list[int] | None = None) -> dict:
    """Decode ``n_tokens`` greedily after ``prompt`` (or feed ``forced``, e.g. a failing run's
    output tokens), then verify them ``w`` at a time.

    The prompt is prefilled in the engine's chunks (``prefill_step``, all but its last token).
    Every verify pass starts from decode's own KV cache, rolled back to the pass's start. Per
    row and layer, in order, it compares the K/V rows the pass writes and the layer's output
    with the decode step's, then the logits.

    Returns ``{"tokens": [...], "widths": {w: {"probes": n, "first_mismatch": None | {...}}}}``;
    a mismatch gives ``position`` (decode step index), ``row`` (in the pass), ``layer``,
    ``what`` (``"kv"``, ``"output"`` or ``"logits"``) and ``max_abs_diff``.
    """
    cache = runner.make_cache()
    for i in range(0, len(prompt) - 1, prefill_step):
        runner.prefill(prompt[i:min(i + prefill_step, len(prompt) - 1)], cache)
        mx.eval(runner.cache_arrays(cache))
    base = len(prompt) - 1
    inputs, steps = [prompt[-1]], []
    for _ in range(n_tokens):
        logits, outs = _pass(runner, [inputs[-1]], cache, sink)
        steps.append((logits[0], [o[0, 0] for o in outs]))
        inputs.append(forced[len(steps) - 1] if forced else int(mx.argmax(logits[0]).item()))
    snapshot = [(mx.array(c.keys), mx.array(c.values), c.offset) for c in cache]
    mx.eval([a for k, v, _ in snapshot for a in (k, v)])
    report = {"tokens": inputs[1:], "widths": {}}
    for w in widths:
        first, probes = None, 0
        for start in range(0, n_tokens - w + 1, stride):
            _restore(cache, snapshot)
            runner.trim(cache, cache[0].offset - (base + start))
            logits, outs = _pass(runner, inputs[start:start + w], cache, sink)
            probes += 1
            for i in range(w):
                pos = base + start + i
                ref_logits, ref_outs = steps[start + i]
                for j, (c, (k, v, _)) in enumerate(zip(cache, snapshot)):
                    for what, diff in (("kv", _differs(c.keys[..., pos, :], k[..., pos, :])),
                                       ("kv", _differs(c.values[..., pos, :], v[..., pos, :])),
                                       ("output", _differs(outs[j][0, i], ref_outs[j]))):
                        if diff is not None:
                            first = {"position": start + i, "row": i, "layer": j, "what": what,
                                     "max_abs_diff": diff}
                            break
                    if first is not None:
                        break
                if first is None and (diff := _differs(logits[i], ref_logits)) is not None:
                    first = {"position": start + i, "row": i, "layer": None, "what": "logits",
                             "max_abs_diff": diff}
                if first is not None:
                    break
            if first is not None:
                break
        report["widths"][w] = {"probes": probes, "first_mismatch": first}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--kernels", default="off", choices=["auto", "off"])
    ap.add_argument("--exact-verify", default="row", choices=["row", "kernel", "batched"])
    ap.add_argument("--prompt-file", default=None, help="a workload JSON (its first prompt) or a text file")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--widths", default="2,4,8")
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--prefill-step", type=int, default=256, help="the engine's SPECSERVE_PREFILL_STEP")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from engine.loader import load_target
    from metal_kernels import patch_model

    loaded = load_target(args.model, weights=args.weights)
    patch = patch_model(loaded.model, mode=args.kernels)
    sink = record_layers(loaded.model)
    runner = TargetRunner(loaded.model)
    configure(runner, args.exact_verify)
    if args.prompt_file and args.prompt_file.endswith(".json"):  # a workload: its first prompt
        from benchmarks.bench_speculative import prompt_tokens

        prompt = prompt_tokens(loaded.tokenizer, json.loads(Path(args.prompt_file).read_text())["prompts"][0])
    else:
        text = Path(args.prompt_file).read_text() if args.prompt_file else \
            "Write a Python function that reverses a linked list."
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True)
    widths = [int(w) for w in args.widths.split(",")]
    report = probe(runner, sink, list(prompt), args.tokens, widths, args.stride, args.prefill_step)
    report.update({"model": loaded.name, "weights": loaded.weights, "kernels": patch.summary(),
                   "exact_verify": args.exact_verify, "device": str(mx.default_device()),
                   "prompt_tokens": len(prompt)})
    for w, r in report["widths"].items():
        print(f"width {w:2d}: {r['probes']} passes, first mismatch: {r['first_mismatch']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(r["first_mismatch"] for r in report["widths"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
