"""Variants of a DSpark drafter's Markov head, to measure what the head and its rank are worth.

Writes, next to each other under ``--out``:

* ``nomarkov/``: the Markov bias switched off (``markov_w1`` zero, so ``W1[prev] W2 = 0``);
* ``rank{k}/`` for each ``--ranks`` k: the head's bias matrix ``W1 W2^T`` (V x V, never formed)
  cut to its best rank-k approximation (Eckart-Young), still stored at rank r: ``W2`` is kept
  and ``W1`` projected, so the config and shapes stay as they are.

Each variant keeps every other tensor byte for byte, ``W2`` included (only ``W1`` is stored
again). Run ``benchmarks/dspark_eval.py`` on them
side by side (acceptance is a full block every cycle, so the confidence head, whose input the
rotation changes, plays no part):

    python -m benchmarks.markov_variants models/dspark-smollm2-135m-instruct --out /tmp/mv \
        --ranks 128,64,32
    python -m benchmarks.dspark_eval --out benchmarks/results/dspark_eval_cpu_markov.json \
        v7=models/dspark-smollm2-135m-instruct none=/tmp/mv/nomarkov r64=/tmp/mv/rank64

``rank{r}`` with r the head's own rank is the requantization control: ``W1`` dequantized and
quantized again (4-bit heads), so it shows the noise a round trip adds.

The low-rank product: with ``W1 = Q1 R1`` and ``W2 = Q2 R2`` (thin QR, [V, r] each), ``W1 W2^T =
Q1 (R1 R2^T) Q2^T``; the SVD ``R1 R2^T = U S V^T`` (r x r) gives the whole product's singular
values S. ``W1' = Q1 U_k U_k^T R1`` (``W1`` projected on the top k left singular directions)
gives ``W1' W2^T = Q1 U_k S_k V_k^T Q2^T``, the best rank-k approximation, with ``W2`` as it
was. (The confidence head reads ``W1[prev]``, which the projection changes for k < r.)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np


def _load(path: pathlib.Path):
    """``(tensors, metadata)`` of a drafter directory as ``drafters.dspark.save_dspark`` writes it
    (one ``model.safetensors``, unprefixed names)."""
    import mlx.core as mx

    return mx.load(str(path / "model.safetensors"), return_metadata=True)


def _dense(weights, name: str, quant: dict | None) -> np.ndarray:
    """``name``'s weight as float32 [rows, cols], dequantized when stored quantized."""
    import mlx.core as mx

    if f"{name}.scales" in weights:
        w = mx.dequantize(weights[f"{name}.weight"], weights[f"{name}.scales"], weights.get(f"{name}.biases"),
                          group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"))
    else:
        w = weights[f"{name}.weight"]
    return np.array(w.astype(mx.float32))


def _store(weights: dict, name: str, dense: np.ndarray, quant: dict | None) -> None:
    """Put ``dense`` back as ``name``'s weight, in the layout and dtype it had."""
    import mlx.core as mx

    like = weights[f"{name}.weight"]
    if f"{name}.scales" in weights:
        dtype = weights[f"{name}.scales"].dtype
        q, scales, biases = mx.quantize(mx.array(dense), group_size=quant["group_size"], bits=quant["bits"],
                                        mode=quant.get("mode", "affine"))
        weights[f"{name}.weight"], weights[f"{name}.scales"] = q, scales.astype(dtype)
        if f"{name}.biases" in weights:
            weights[f"{name}.biases"] = biases.astype(dtype)
    else:
        weights[f"{name}.weight"] = mx.array(dense).astype(like.dtype)


def _qr_svd(w1: np.ndarray, w2: np.ndarray):
    """``(q1, r1, u, s)``: ``w1 = q1 r1`` (thin QR) and ``r1 r2^T = u diag(s) v^T`` with ``w2 =
    q2 r2``, so ``w1 @ w2.T = q1 u diag(s) v^T q2^T`` and s are its singular values."""
    q1, r1 = np.linalg.qr(w1.astype(np.float64))
    r2 = np.linalg.qr(w2.astype(np.float64))[1]
    u, s, _ = np.linalg.svd(r1 @ r2.T)
    return q1, r1, u, s


def markov_spectrum(w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """The singular values ([r], descending) of ``w1 @ w2.T`` (V x V, never formed)."""
    return _qr_svd(w1, w2)[3]


def truncated(w1: np.ndarray, w2: np.ndarray, k: int) -> np.ndarray:
    """``w1`` projected ([V, r] float32) so that ``truncated(w1, w2, k) @ w2.T`` is the best
    rank-``k`` approximation of ``w1 @ w2.T``."""
    q1, r1, u, _ = _qr_svd(w1, w2)
    u = u[:, :k]
    return (q1 @ (u @ (u.T @ r1))).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", type=pathlib.Path, help="a DSpark drafter directory (config.json + model.safetensors)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--ranks", default="", help="comma-separated ranks k to cut the head to")
    args = parser.parse_args(argv)
    import mlx.core as mx

    config = json.loads((args.drafter / "config.json").read_text())
    rank = int(config.get("markov_rank", 0))
    if rank <= 0:
        parser.error(f"{args.drafter} has no Markov head (markov_rank {rank})")
    quant = config.get("quantization")
    base, metadata = _load(args.drafter)
    w1 = _dense(base, "markov_head.markov_w1", quant)
    w2 = _dense(base, "markov_head.markov_w2", quant)
    s = markov_spectrum(w1, w2)
    energy = np.cumsum(s**2) / np.sum(s**2)
    print(f"rank {rank}; singular values (every 8th): {np.round(s[::8], 2).tolist()}")
    print("energy in the top k: " + ", ".join(f"{k}: {energy[k - 1]:.4f}" for k in (8, 16, 32, 64) if k <= rank))

    variants = {"nomarkov": np.zeros_like(w1)}
    for k in (int(x) for x in args.ranks.split(",") if x.strip()):
        if not 1 <= k <= rank:
            parser.error(f"rank {k} is outside 1..{rank}")
        variants[f"rank{k}"] = truncated(w1, w2, k)
    for name, a in variants.items():
        weights = dict(base)
        _store(weights, "markov_head.markov_w1", a, quant)
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(args.drafter / "config.json", out / "config.json")
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata=metadata)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
