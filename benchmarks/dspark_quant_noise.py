"""What a drafter's quantized export costs in acceptance, estimated without its float weights.

Only the 4-bit exports of the trained drafters survive a GPU session (their float checkpoints
stay on the lent machine), so the float-vs-export comparison cannot be made directly. This
writes perturbed float copies of an export instead: every quantized matrix ``W`` (already on its
affine grid) gets independent uniform noise of one rounding step, ``U(-s/2, s/2)`` with ``s``
the step of ``W``'s own group at ``--bits`` (``(max - min) / (2^bits - 1)`` over each group of
``--group-size`` inputs, MLX's affine scheme). Rounding a float matrix to that grid adds an error
of the same size and distribution; near a trained optimum the loss grows with the squared size
of a perturbation whatever its direction, so the acceptance lost from ``W`` to ``W + noise``
estimates the acceptance lost from the float drafter to its export. ``--scale`` multiplies the
noise (e.g. 0.5 for the finer grid of one more bit). The step is read off the dequantized
range, a close lower bound: MLX 0.32 widens a group's scale a little so that its larger end
falls on the grid (the range spans 0.93-1.0 of ``15 * scale``), so the noise is ~2% low in
variance. Each seed's noise keys follow the list of perturbed matrices, so an ``--only`` run
draws other noise than a full run with the same seed.

    python -m benchmarks.dspark_quant_noise models/dspark-smollm2-135m-instruct /tmp/noise --seeds 1,2
    python -m benchmarks.dspark_eval v11=models/dspark-smollm2-135m-instruct \\
        float=/tmp/noise/float n1=/tmp/noise/noise-1 n2=/tmp/noise/noise-2 --out ...

Writes ``OUT/float`` (the export dequantized, no noise: the control for the dense float path)
and ``OUT/noise-<seed>`` for each seed, all plain float32 in the DeepSpec layout, and
``OUT/noise.json`` (the settings, the matrices, and per seed each matrix's noise RMS relative
to its own RMS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

from drafters.dspark.loader import load_dspark, save_dspark


def quantized_names(path: str | Path) -> list[str]:
    """Names of the matrices stored quantized in ``path/model.safetensors`` (``<name>.scales``)."""
    keys = mx.load(str(Path(path) / "model.safetensors")).keys()
    return sorted(k[: -len(".scales")] for k in keys if k.endswith(".scales"))


def rounding_noise(w: mx.array, bits: int, group_size: int, scale: float, key: mx.array) -> tuple[mx.array, float]:
    """``U(-s/2, s/2) * scale`` per entry of ``w`` ``[out, in]`` float32, ``s`` its group's affine
    step at ``bits``; returns the noise and its RMS relative to ``w``'s RMS.

    Raises:
        ValueError: ``in`` is not a multiple of ``group_size``.
    """
    rows, cols = w.shape
    if cols % group_size:
        raise ValueError(f"{cols} inputs are not a multiple of the group size {group_size}")
    g = w.reshape(rows, cols // group_size, group_size)
    step = (g.max(axis=-1, keepdims=True) - g.min(axis=-1, keepdims=True)) / (2**bits - 1)
    noise = (mx.random.uniform(-0.5, 0.5, g.shape, key=key) * step * scale).reshape(rows, cols)
    rel = (mx.sqrt(mx.mean(noise * noise)) / mx.sqrt(mx.mean(w * w))).item()
    return noise, rel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", help="a quantized drafter directory (DeepSpec layout, MLX affine)")
    ap.add_argument("out")
    ap.add_argument("--seeds", default="1,2", help="comma-separated noise seeds, one copy each")
    ap.add_argument("--bits", type=int, default=None, help="grid of the noise (default: the export's)")
    ap.add_argument("--group-size", type=int, default=None, help="(default: the export's)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--only", default="", help="perturb only matrices whose name starts with one of these "
                                               "comma-separated prefixes (e.g. layers,fc or markov_head)")
    args = ap.parse_args(argv)
    cfg = json.loads((Path(args.drafter) / "config.json").read_text())
    quant = cfg.get("quantization")
    if not quant:
        ap.error(f"{args.drafter} is not quantized: nothing to estimate")
    bits = args.bits or quant["bits"]
    group = args.group_size or quant["group_size"]
    names = quantized_names(args.drafter)
    if args.only:
        names = [n for n in names if n.startswith(tuple(p for p in args.only.split(",") if p))]
        if not names:
            ap.error(f"--only {args.only!r} matches none of the quantized matrices")
    out = Path(args.out)
    base = load_dspark(args.drafter, dtype="float32", dequantize=True)
    save_dspark(base, out / "float")
    report = {"drafter": str(args.drafter), "bits": bits, "group_size": group, "scale": args.scale,
              "matrices": names, "seeds": {}}
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        model = load_dspark(args.drafter, dtype="float32", dequantize=True)
        params = dict(tree_flatten(model.parameters()))
        keys = mx.random.split(mx.random.key(seed), len(names))
        updates, rels = [], {}
        for name, key in zip(names, keys):
            w = params[f"{name}.weight"]
            noise, rels[name] = rounding_noise(w, bits, group, args.scale, key)
            updates.append((f"{name}.weight", w + noise))
        model.load_weights(updates, strict=False)
        save_dspark(model, out / f"noise-{seed}")
        report["seeds"][seed] = {"relative_rms": rels}
        print(f"seed {seed}: {len(names)} matrices, relative noise RMS "
              f"{min(rels.values()):.4f}..{max(rels.values()):.4f}", flush=True)
    (out / "noise.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
