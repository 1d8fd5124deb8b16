"""A/B of two builds of the CPU fused pass (metal_kernels/sources/fused_cpu.c) in one process.

This machine's speed swings by 10-40% from minute to minute (a shared 2-vCPU VM), so two runs of
a benchmark cannot tell a 5% change. Here both libraries serve the same default model in one
process, over the same KV cache, and every width is timed A then B (B then A on odd rounds), so
each pair of timings is a few milliseconds apart. Reports per width the two minima, medians and
the median of the per-pair ratios B/A; checks that both builds give the same logits (bit for bit),
which holds for any change that keeps the arithmetic.

    python -m benchmarks.cpu_pass_ab --base HEAD            # git HEAD's source (A) vs the tree's (B)
    python -m benchmarks.cpu_pass_ab --a old.c --b new.c --rounds 40 --out ab.json

The twenty-third-session finding that motivated it: a perf profile put ~18% of the AVX2 projections
at one helper (lanes8's partial-group path); rewritten, it was no faster (B/A 0.985-1.056 over 1-16
rows, 30 rounds, against 0.984-1.002 for two builds of the same code): the samples were skid
behind other stalls, not time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from engine.loader import load_target
from engine.runner import TargetRunner
from metal_kernels import fused_cpu

SOURCE = Path(fused_cpu.__file__).parent / "sources" / "fused_cpu.c"


def build(source: Path, loaded, activations: str) -> fused_cpu.CpuFusedPass:
    """A pass over ``loaded`` built from ``source`` (the library is cached by its hash)."""
    saved = fused_cpu._SOURCE
    fused_cpu._SOURCE = source
    fused_cpu.library.cache_clear()  # (library() is cached once per process)
    try:
        return fused_cpu.CpuFusedPass(loaded.model, loaded.quantized, activations=activations)
    finally:
        fused_cpu._SOURCE = saved
        fused_cpu.library.cache_clear()


def run(a: Path, b: Path, activations: str, rounds: int, widths: tuple[int, ...], context: int) -> dict:
    loaded = load_target("default")
    passes = [build(a, loaded, activations), build(b, loaded, activations)]
    if a.read_bytes() != b.read_bytes() and passes[0].lib._name == passes[1].lib._name:
        raise RuntimeError("A and B differ but run one library")
    runner = TargetRunner(loaded.model)
    cache = runner.make_cache()
    vocab = loaded.model.args.vocab_size
    mx.eval(runner.prefill([3 + (7 * i) % (vocab - 3) for i in range(context)], cache)[0])
    times = {(i, k): [] for i in range(2) for k in widths}
    logits = {}
    for r in range(rounds):
        for k in widths:
            tokens = [5 + i for i in range(k)]
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                out = passes[i](tokens, cache)
                mx.eval(out.logits)
                times[(i, k)].append((time.perf_counter() - t0) * 1e3)
                logits[(i, k)] = out.logits
                for c in cache:
                    c.trim(k)
    rows = []
    for k in widths:
        ta, tb = times[(0, k)], times[(1, k)]
        rows.append({"rows": k, "a_min_ms": min(ta), "a_median_ms": statistics.median(ta),
                     "b_min_ms": min(tb), "b_median_ms": statistics.median(tb),
                     "b_over_a_median_of_pairs": statistics.median(y / x for x, y in zip(ta, tb)),
                     "identical": mx.array_equal(logits[(0, k)], logits[(1, k)]).item()})
    return {"activations": activations, "rounds": rounds, "context": context, "threads": passes[0].threads,
            "a": str(a), "b": str(b), "widths": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git revision whose fused_cpu.c is A (B: --b, else the working tree's)")
    ap.add_argument("--a", type=Path, help="A's C source")
    ap.add_argument("--b", type=Path, default=SOURCE, help="B's C source (default: the working tree's)")
    ap.add_argument("--activations", default="q16", choices=sorted(fused_cpu.ACTIVATIONS))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--widths", default="1,2,4,8,16", help="rows per pass, comma-separated (1..16)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before the timed rows")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    if not all(1 <= w <= fused_cpu.MAX_ROWS for w in widths) or args.rounds < 1 or args.context < 1:
        ap.error("widths must be in 1..16, rounds and context positive")
    if (args.base is None) == (args.a is None):
        ap.error("give exactly one of --base and --a")
    for path in (args.a, args.b):
        if path is not None and not path.is_file():
            ap.error(f"{path}: no such file")
    with tempfile.TemporaryDirectory() as tmp:
        a = args.a
        if args.base is not None:
            a = Path(tmp) / "a.c"
            rel = SOURCE.relative_to(SOURCE.parents[2]).as_posix()
            a.write_bytes(subprocess.run(["git", "show", f"{args.base}:{rel}"], cwd=SOURCE.parents[2],
                                         check=True, capture_output=True).stdout)
        result = run(a, args.b, args.activations, args.rounds, widths, args.context)
    for row in result["widths"]:
        print(f"T({row['rows']}): A min {row['a_min_ms']:.2f} median {row['a_median_ms']:.2f} ms | "
              f"B min {row['b_min_ms']:.2f} median {row['b_median_ms']:.2f} ms | "
              f"B/A {row['b_over_a_median_of_pairs']:.3f} | identical {row['identical']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
