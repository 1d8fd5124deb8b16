"""What quantization-aware training does to a drafter's export, side by side with plain training.

From one saved drafter (its weights dequantized to float32), two arms train the same number of
steps on the same batches (``drafters.dspark.train.train_loop``, the trainer's own loop): ``plain``
as the trainer always has, ``qat`` with every step quantization-aware (``TrainConfig.qat_steps``:
the forward through the export's rounding, straight-through gradients). Then each arm's float
weights and its 4-bit export (``save_dspark(bits, group_size, dtype="float16")``, loaded back
dequantized) are scored on fixed held-out batches with the training loss: loss, probabilistic
acceptance length ``tau`` (the train log's) and per-slot acceptance ``1 - 0.5 L1``. The start
drafter is scored too. The gap float -> export is what the export costs; QAT should close it.

The data are the target's own greedy responses to fresh prompts (code files and instruction
templates, ``--seed``), generated here: the prompts' held-out split gives the evaluation
batches, the rest the training ones. Sized for a CPU; the GPU trainer's run is the real thing.

    python -m benchmarks.dspark_qat_cpu models/dspark-smollm2-135m-instruct \\
        --out benchmarks/results/dspark_qat_cpu.json --keep /tmp/qat

``--keep DIR`` writes the arms' exports (``DIR/plain``, ``DIR/qat``) for ``dspark_eval``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from drafters.dspark.data import code_prompts, instruction_prompts
from drafters.dspark.loader import load_dspark, save_dspark
from drafters.dspark.model import DSparkModel
from drafters.dspark.target import TargetTaps
from drafters.dspark.train import (
    Batch,
    DataConfig,
    TrainConfig,
    draft_pass,
    dspark_loss,
    examples_for_training,
    generate_examples,
    make_batch,
    make_optimizer,
    target_pass,
    train_loop,
)


def held_out_batches(examples: list[tuple[list[int], int]], block_size: int, per_batch: int, anchors: int,
                     seed: int) -> list[Batch]:
    """Fixed evaluation batches: ``examples`` in order, ``per_batch`` sequences each, anchors
    drawn with ``numpy.random.default_rng([seed, i])`` for batch ``i``."""
    return [make_batch(examples[i:i + per_batch], block_size, anchors, np.random.default_rng([seed, i // per_batch]))
            for i in range(0, len(examples), per_batch)]


def score(net: DSparkModel, taps: TargetTaps, batches: list[Batch], targets: list[tuple[mx.array, mx.array]]) -> dict:
    """Loss, ``tau`` and per-slot acceptance of ``net`` on ``batches``, each batch weighted by its
    kept blocks (``targets``: each batch's :func:`target_pass`, computed once)."""
    totals, weight = {"loss": 0.0, "tau": 0.0, "accept": 0.0}, 0.0
    for batch, (hidden, probs) in zip(batches, targets):
        logits, conf = draft_pass(net, taps.embed, taps.lm_head, batch, hidden)
        loss, metrics = dspark_loss(logits, conf, probs, mx.array(batch.labels), mx.array(batch.eval_mask))
        blocks = float((batch.eval_mask[..., 0] > 0).sum())
        totals["loss"] += blocks * loss.item()
        totals["tau"] += blocks * metrics["tau"].item()
        totals["accept"] = totals["accept"] + blocks * np.array(metrics["accept"])
        weight += blocks
    return {"loss": round(totals["loss"] / weight, 5), "tau": round(totals["tau"] / weight, 4),
            "accept": [round(float(a), 4) for a in totals["accept"] / weight]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", help="the start drafter's directory")
    ap.add_argument("--target", default="default")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", default=None, help="write the arms' exports here")
    ap.add_argument("--n-code", type=int, default=60)
    ap.add_argument("--n-instruct", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--num-anchors", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=48)
    args = ap.parse_args(argv)

    from engine.loader import load_target

    target = load_target(args.target)
    start = load_dspark(args.drafter, dequantize=True)
    cfg = start.config
    taps = TargetTaps(target.model, cfg.target_layer_ids)
    records = (code_prompts(args.n_code, seed=args.seed, eval_fraction=0.25)
               + instruction_prompts(args.n_instruct, seed=args.seed, eval_fraction=0.25))
    began = time.perf_counter()
    rows = generate_examples(target.model, target.tokenizer, records,
                             DataConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, gen_batch_size=32,
                                        seed=args.seed), progress=False)
    generated_s = time.perf_counter() - began
    train_examples = examples_for_training(rows, 1024)
    eval_examples = examples_for_training([{**r, "split": "train"} for r in rows if r["split"] == "eval"], 1024)
    batches = held_out_batches(eval_examples, cfg.block_size, args.batch_size, args.num_anchors, args.seed)
    targets = [target_pass(taps, b, cfg.block_size) for b in batches]
    mx.eval(targets)
    out = {"_setup": {**vars(args), "train_sequences": len(train_examples), "eval_sequences": len(eval_examples),
                      "eval_blocks": int(sum((b.eval_mask[..., 0] > 0).sum() for b in batches)),
                      "response_tokens": sum(len(r["response"]) for r in rows), "generate_s": round(generated_s, 1)},
           "start": score(start, taps, batches, targets)}
    print("start", out["start"], flush=True)
    for arm in ("plain", "qat"):
        net = load_dspark(args.drafter, dequantize=True)
        net.train()
        train_cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors,
                                max_seq_len=1024, lr=args.lr, save_every=args.steps + 1, log_every=5,
                                seed=args.seed, qat_steps=args.steps if arm == "qat" else 0,
                                qat_bits=args.bits, qat_group_size=args.group_size)
        with tempfile.TemporaryDirectory() as tmp:
            began = time.perf_counter()
            log, _ = train_loop(net, make_optimizer(train_cfg), 0, taps, train_examples, train_cfg, Path(tmp), False)
            seconds = time.perf_counter() - began
            export_dir = Path(args.keep) / arm if args.keep else Path(tmp) / "export"
            save_dspark(net, export_dir, bits=args.bits, group_size=args.group_size, dtype="float16")
            exported = load_dspark(export_dir, dequantize=True)
        net.eval()
        out[arm] = {"float": score(net, taps, batches, targets), "export": score(exported, taps, batches, targets),
                    "train_s": round(seconds, 1), "log": [{k: r[k] for k in ("step", "loss", "tau")} for r in log]}
        print(arm, "float", out[arm]["float"], "export", out[arm]["export"], f"{seconds:.0f} s", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
