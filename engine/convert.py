"""``python -m engine.convert``: write a target as an MLX model directory.

The directory (``config.json``, ``model.safetensors``, tokenizer files with the chat template)
holds the weights exactly as specserve serves them under the chosen weight policy, so another
MLX server (``mlx_lm.server --model DIR``) runs the same weights, dtype and tokenizer. Used by
the peer comparison (benchmarks/peers) and to give tools such as lm-evaluation-harness a local
tokenizer instead of a hub download.

    python -m engine.convert --model default --weights float32 --out /tmp/smollm2-f32
    python -m engine.convert --tokenizer-only --out /tmp/smollm2-tok

Note that ``auto`` resolves per backend (float32 on CPU, the file's quantization on a GPU), so
convert with the policy the server runs with.
"""

from __future__ import annotations

import argparse
import json
import logging

from . import BLAS  # noqa: F401  (OpenBLAS before mlx.core)
from .loader import WEIGHT_POLICIES, load_target, save_mlx_dir, save_tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a target (default model, GGUF or MLX dir) as an "
                                             "MLX model directory with the served weights.")
    ap.add_argument("--model", default="default", help="default | path.gguf | MLX model dir")
    ap.add_argument("--weights", default="auto", choices=WEIGHT_POLICIES,
                    help="weight policy to apply before saving (auto: float32 on CPU, quantized on GPU)")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--tokenizer-only", action="store_true", help="write the tokenizer files only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # the tokenizer alone needs no weight conversion: keep what the file stores
    loaded = load_target(args.model, weights="quantized" if args.tokenizer_only else args.weights)
    if args.tokenizer_only:
        out = save_tokenizer(loaded, args.out)
    else:
        out = save_mlx_dir(loaded, args.out)
    print(json.dumps({"out": str(out), "model": loaded.name, "weights": loaded.weights,
                      "tokenizer_only": args.tokenizer_only}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
