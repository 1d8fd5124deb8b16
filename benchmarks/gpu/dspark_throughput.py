"""Throughput of DSpark self-distillation per target weight policy: generation and training.

For each policy (``engine.loader.WEIGHT_POLICIES``: the file's 4-bit layers with float32
activations, or weights dequantized to bfloat16/float16/float32), in one process:

* generation: ``drafters.dspark.train._generate_batch`` on one static batch of ``--gen-batch``
  prompts (the middle of the length-sorted prompt set, as the generator batches them), timed
  for 1 and for ``--gen-steps`` new tokens after a warm-up; seconds per decode step and new
  tokens per second (every row counted);
* training: ``train_loop`` for ``--train-steps`` steps per ``--train-shapes`` entry (sequences
  x anchors per step) on the longest prompts + random response tokens (timing only); seconds
  per step after the first two, and the frozen target pass (``target_pass``) timed alone.

    python -m benchmarks.gpu.dspark_throughput --policies quantized,bfloat16 --out $OUT/t.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core on the CPU)

# isort: split
import mlx.core as mx
import numpy as np

from drafters.dspark.data import build_prompt_set, encode_prompt
from drafters.dspark.target import TargetTaps
from drafters.dspark.train import (
    DraftArch,
    TrainConfig,
    _generate_batch,
    _new_model,
    make_batch,
    make_optimizer,
    target_pass,
    train_loop,
)
from engine.loader import load_target


def time_generation(model, prompts: list[list[int]], steps: int) -> dict:
    _generate_batch(model, prompts, 2, lambda lp: mx.argmax(lp, axis=-1), [-1])  # compile
    times = {}
    for n in (1, steps):
        start = time.perf_counter()
        _generate_batch(model, prompts, n, lambda lp: mx.argmax(lp, axis=-1), [-1])
        times[n] = time.perf_counter() - start
    per_step = (times[steps] - times[1]) / (steps - 1)
    return {"rows": len(prompts), "prompt_tokens_max": max(map(len, prompts)),
            "prefill_s": round(times[1], 4), "decode_step_s": round(per_step, 5),
            "tokens_per_s": round(len(prompts) / per_step, 1)}


def time_training(model, tokenizer, prompts: list[list[int]], batch: int, anchors: int, steps: int,
                  rng) -> dict:
    examples = []
    for p in prompts:
        resp = rng.integers(100, 40000, size=int(rng.integers(150, 320))).tolist()
        examples.append((p + resp, len(p)))
    cfg = TrainConfig(steps=steps, batch_size=batch, num_anchors=anchors, log_every=1, save_every=10**9)
    net = _new_model(model, tokenizer, DraftArch(), 0)
    taps = TargetTaps(model, net.config.target_layer_ids)
    with tempfile.TemporaryDirectory() as tmp:
        rows, _ = train_loop(net, make_optimizer(cfg), 0, taps, examples, cfg, Path(tmp), progress=False)
    el = [r["elapsed_s"] for r in rows]
    per_step = (el[-1] - el[1]) / (len(el) - 2)
    tp = []
    for s in range(4):
        r = np.random.default_rng([0, s])
        picks = r.choice(len(examples), size=batch, replace=False)
        b = make_batch([examples[i] for i in picks], 7, cfg.num_anchors, r)
        start = time.perf_counter()
        mx.eval(*target_pass(taps, b, 7))
        tp.append(time.perf_counter() - start)
    return {"batch": batch, "anchors": anchors, "train_step_s": round(per_step, 4), "first_step_s": el[0],
            "target_pass_s": round(float(np.median(tp[1:])), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="quantized,bfloat16,float32")
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--gen-steps", type=int, default=40)
    ap.add_argument("--train-shapes", default="16x256,64x64", help="sequences x anchors per step, comma-separated")
    ap.add_argument("--train-steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.gen_steps < 2 or args.train_steps < 3:
        ap.error("--gen-steps must be >= 2 and --train-steps >= 3 (the first steps are not timed)")
    out = {"_setup": vars(args)}
    records = build_prompt_set(600, 600, humaneval=False, code_per_file=12)
    prompts = None
    for policy in args.policies.split(","):
        target = load_target("default", weights=policy)
        if prompts is None:
            prompts = sorted((encode_prompt(target.tokenizer, r) for r in records), key=len)
            prompts = [p for p in prompts if 1 < len(p) <= 768]
        mid = max(0, len(prompts) // 2 - args.gen_batch // 2)  # a typical batch of the sorted generator
        res = {"generation": time_generation(target.model, prompts[mid : mid + args.gen_batch], args.gen_steps),
               "training": []}
        print(policy, res["generation"], flush=True)
        for shape in args.train_shapes.split(","):
            batch, anchors = (int(x) for x in shape.split("x"))
            rng = np.random.default_rng(0)
            res["training"].append(time_training(target.model, target.tokenizer, prompts[-256:], batch, anchors,
                                                 args.train_steps, rng))
            print(policy, res["training"][-1], flush=True)
        out[policy] = res
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        del target
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
