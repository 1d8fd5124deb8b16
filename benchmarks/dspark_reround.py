"""What exporting a quantized drafter again does to its weights (MLX affine rounding is not idempotent).

A drafter trained further from a shipped export (``train-dspark --init``) starts from the
export's dequantized weights and is exported again at the end. This rounds the dequantized
weights of ``DRAFTER`` again exactly as the trainer's export does (``load_dspark(dequantize=True)``
then ``save_dspark(bits, group_size, dtype="float16")``) and reports, per kind of matrix and over
all of them, the share of quantized values that moved (by more than 1% of a step), the RMS and the
largest move, in units of each value's own group step (its original ``scale``).

    python -m benchmarks.dspark_reround models/dspark-smollm2-135m-instruct \\
        --out benchmarks/results/dspark_reround_v11.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from drafters.dspark.loader import load_dspark, save_dspark


def kind(name: str) -> str:
    """A matrix's kind: its name without layer indices (``layers.3.mlp.up_proj`` -> ``mlp.up_proj``)."""
    return re.sub(r"^layers\.\d+\.", "", name)


def reround_moves(path: str | Path, bits: int = 4, group_size: int = 64) -> dict[str, np.ndarray]:
    """Per quantized matrix of the export at ``path``: ``|exported again - original| / step``,
    float64 ``[out, in]``, the step being each value's group ``scale`` in the original file.

    Raises:
        ValueError: ``path`` holds no quantized matrix.
    """
    stored = mx.load(str(Path(path) / "model.safetensors"))
    names = sorted(k[: -len(".scales")] for k in stored if k.endswith(".scales"))
    if not names:
        raise ValueError(f"{path}: no quantized matrix")
    original = load_dspark(path, dequantize=True)
    with tempfile.TemporaryDirectory() as tmp:
        save_dspark(original, tmp, bits=bits, group_size=group_size, dtype="float16")
        again = dict(tree_flatten(load_dspark(tmp, dequantize=True).parameters()))
    first = dict(tree_flatten(original.parameters()))
    moves = {}
    for name in names:
        scales = np.array(stored[name + ".scales"].astype(mx.float32), dtype=np.float64)
        w0 = np.array(first[name + ".weight"], dtype=np.float64)
        w1 = np.array(again[name + ".weight"], dtype=np.float64)
        step = np.repeat(scales, w0.shape[-1] // scales.shape[-1], axis=-1)
        moves[name] = np.abs(w1 - w0) / np.where(step > 0, step, 1.0)
    return moves


def summary(moves: list[np.ndarray]) -> dict:
    flat = np.concatenate([m.ravel() for m in moves])
    return {"values": int(flat.size), "moved_share": round(float((flat > 0.01).mean()), 4),
            "rms_steps": round(float(np.sqrt((flat ** 2).mean())), 4), "max_steps": round(float(flat.max()), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args(argv)
    moves = reround_moves(args.drafter, args.bits, args.group_size)
    kinds: dict[str, list[np.ndarray]] = {}
    for name, m in moves.items():
        kinds.setdefault(kind(name), []).append(m)
    out = {"drafter": args.drafter, "bits": args.bits, "group_size": args.group_size,
           "all": summary(list(moves.values())),
           "layers": summary([m for n, m in moves.items() if n.startswith("layers.")]),
           "by_kind": {k: summary(v) for k, v in sorted(kinds.items())}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("all", "layers")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
