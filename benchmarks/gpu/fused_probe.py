"""Where a fused pass's time goes (metal_kernels/fused.py), on a CUDA machine.

Times, for the default model after a prefill of ``--context`` tokens: one whole pass (host
building, launch, evaluation; ``FusedPass`` evaluates before it returns), for 1, 4 and 16 rows
and a few block counts;
``--ncu`` runs a few passes only (for ``ncu --metrics gpu__time_duration.sum``); ``--profile``
adds, per row count, the kernel's own cycle counts per phase (``FusedPass(profile=True)``): for
each phase summed over layers, the slowest block's work, the mean block's work and the mean
wait at the barrier after it. JSON to ``--out``.

    python benchmarks/gpu/fused_probe.py --model /root/s/files/SmolLM2-135M-Instruct.Q4_1.gguf --out f.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from engine.loader import load_target
from engine.runner import TargetRunner
from metal_kernels.fused import FusedPass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--blocks", default="0,32,8", help="comma-separated block counts (0: one per SM)")
    ap.add_argument("--warps", default="16", help="comma-separated warps per block (8, 16)")
    ap.add_argument("--skip", default="0", help="comma-separated phase masks to leave out (profiling: "
                    "1 A, 2 B attention, 4 C, 8 D, 16 E, 32 LM head; 63 = barriers only)")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-phase cycle counts from inside the kernel")
    args = ap.parse_args(argv)
    loaded = load_target(args.model, "quantized")
    model = loaded.model
    runner = TargetRunner(model)
    ids = mx.random.randint(3, 4000, (args.context + 16,), key=mx.random.key(1)).tolist()
    cache = runner.make_cache()
    mx.eval(runner.prefill(ids[: args.context], cache)[0])
    result = {"context": args.context, "runs": []}
    configs = [(int(b), int(w), int(k)) for b in args.blocks.split(",") for w in args.warps.split(",")
               for k in args.skip.split(",")]
    for blocks, warps, skip in configs:
        fp = FusedPass(model, blocks=blocks or None, warps=warps, skip=skip)
        for rows in (1, 4, 16):
            toks = ids[args.context: args.context + rows]
            total = []
            for i in range(2 if args.ncu else args.reps + 2):
                mx.synchronize()
                t0 = time.perf_counter()
                out = fp(toks, cache)  # builds, launches and evaluates the pass
                mx.synchronize()
                t1 = time.perf_counter()
                fp.check(out)
                runner.trim(cache, rows)
                if i >= 2:
                    total.append(t1 - t0)
            if args.ncu:
                continue
            entry = {"blocks": fp.blocks, "warps": warps, "skip": skip, "rows": rows,
                     "total_ms": round(statistics.median(total) * 1e3, 4)}
            result["runs"].append(entry)
            print(json.dumps(entry), flush=True)
    if args.profile:
        result["profile"] = {w: phase_profile(model, runner, cache, ids, args.context, int(w))
                             for w in args.warps.split(",")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


PHASES = ("A_norm_qkv", "B_attention", "C_o_proj", "D_norm_gate_up", "E_down")


def phase_cycles(samples: list, phases: tuple[str, ...]) -> dict:
    """Medians over launches of ``FusedOutput.profile`` arrays (``[blocks, 5 L + 2, 2]`` SM
    cycles): per layer phase, the slowest block's work and the fastest block's wait at its
    barrier (and the means over blocks), summed over layers; the LM head's and a greedy draft's
    Markov phase's slowest work; block 0's whole launch."""
    import numpy as np

    prof = np.median(np.stack(samples), axis=0)
    layers = (prof.shape[1] - 2) // 5
    body = prof[:, :-2].reshape(prof.shape[0], layers, 5, 2)
    entry = {"total_cycles_block0": float(prof[0].sum()), "lm_head_work_max": float(prof[:, -2, 0].max()),
             "lm_head_wait_min": float(prof[:, -2, 1].min()), "markov_work_max": float(prof[:, -1, 0].max())}
    for p, name in enumerate(phases):
        entry[name] = {"work_max": float(body[:, :, p, 0].max(axis=0).sum()),
                       "wait_min": float(body[:, :, p, 1].min(axis=0).sum()),
                       "work_mean": float(body[:, :, p, 0].mean(axis=0).sum()),
                       "wait_mean": float(body[:, :, p, 1].mean(axis=0).sum())}
    return entry


def phase_profile(model, runner, cache, ids, context, warps):
    """Cycle counts per phase from the kernel's own clock64() marks (medians over 5 passes)."""
    import numpy as np

    fp = FusedPass(model, warps=warps, profile=True)
    out = {}
    for rows in (1, 4, 16):
        toks = ids[context: context + rows]
        samples = []
        for i in range(7):
            res = fp(toks, cache)
            mx.eval(res.logits, res.errors, res.profile)
            fp.check(res)
            runner.trim(cache, rows)
            if i >= 2:
                samples.append(np.array(res.profile).astype(np.float64))  # [blocks, 5 L + 2, 2]
        entry = phase_cycles(samples, PHASES)
        out[str(rows)] = entry
        print(json.dumps({"warps": warps, "rows": rows, **entry}), flush=True)
    return out


if __name__ == "__main__":
    main()
