"""Teacher-forced acceptance of a DSpark drafter on a run's own examples, by response position.

The trainer logs ``tau`` over random anchors of whole training responses (``1 + sum_k prod_{i<=k}
acc_i`` with ``acc = 1 - 0.5 L1``, DeepSpec's soft acceptance). Held-out evaluation
(``benchmarks/dspark_eval.py``) decodes greedily from the start of each response. This script
puts the two on one scale: for the first ``--per-source`` examples of each source in a run's
``examples.jsonl[.gz]`` it builds one block at every response position (the trainer's
``target_pass``/``draft_pass``, the Markov head fed the data tokens) and reports, for anchors in
the first ``--first`` response tokens and after them (the last ``B - 1`` blocks of each
response are cut short by its end, and fall in the opening of responses shorter than
``--first``):

- ``tau_soft``: the trainer's metric;
- ``tau_greedy``: ``1 + sum_k prod_{i<=k} [argmax draft_i == argmax target_i]``, greedy
  acceptance counting every position once (a decoding loop visits only the positions where
  its cycles start, so its mean differs);
- ``first_slot``: the greedy acceptance of the first draft.

It also reports how often this machine's target argmax equals the data token (the data was
generated on another backend and dtype).

    python -m benchmarks.dspark_positions models/dspark-smollm2-135m-instruct \\
        --examples run/data/examples.jsonl --split train --per-source 4 --out positions.json
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from drafters.dspark.loader import load_dspark
from drafters.dspark.target import TargetTaps
from drafters.dspark.train import Batch, draft_pass, target_pass
from engine.loader import load_target


def read_examples(path: str, split: str, per_source: int) -> dict[str, list[dict]]:
    """``source -> the first per_source rows`` of ``split`` with a non-empty prompt and response."""
    opener = gzip.open if path.endswith(".gz") else open
    out: dict[str, list[dict]] = {}
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row["split"] == split and row.get("prompt") and row.get("response"):
                rows = out.setdefault(row["source"], [])
                if len(rows) < per_source:
                    rows.append(row)
    return out


def positions_batch(prompt: list[int], response: list[int], block_size: int) -> Batch:
    """One training batch (``N = 1``) with an anchor at every response position: anchor ``j``
    is ``len(prompt) - 1 + j``, whose block's first label is response token ``j``. Labels past
    the end are masked (``eval_mask`` 0), so the last ``block_size - 1`` blocks are short.

    Raises:
        ValueError: an empty prompt or response.
    """
    if not prompt or not response:
        raise ValueError("positions_batch needs a non-empty prompt and response")
    ids = np.array(prompt + response, np.int32)[None]
    size = ids.shape[1]
    anchors = np.arange(len(prompt) - 1, size - 1, dtype=np.int32)[None]
    label_idx = anchors[..., None] + 1 + np.arange(block_size)
    labels = np.take_along_axis(ids[:, None, :], np.minimum(label_idx, size - 1), axis=2)
    inside = np.cumprod(label_idx < size, axis=-1).astype(np.float32)
    return Batch(ids, anchors, np.ones_like(anchors, bool), labels.astype(np.int32), inside)


def block_scores(taps: TargetTaps, net, prompt: list[int], response: list[int]) -> dict[str, np.ndarray]:
    """Score one teacher-forced block at every response position (:func:`positions_batch`;
    ``A = len(response)`` anchors, ``B`` the drafter's block size), through the trainer's
    ``target_pass`` and ``draft_pass`` (the Markov head is fed the data tokens).

    Returns:
        ``soft`` ``[A, B]`` float32: ``1 - 0.5 L1(draft_probs, target_probs)``, DeepSpec's soft
        acceptance (the trainer's ``acc``, 0 past the end); ``greedy`` ``[A, B]`` float32: 1 where
        the draft's argmax equals the target's; ``draft`` ``[A, B]`` int32: the draft's argmax
        tokens; ``data_match`` ``[A]`` bool: the target's argmax equals the data token.
        Where the data leaves the target's greedy path (``data_match`` False), later blocks
        follow a context a greedy decoding loop would not reach.

    Raises:
        ValueError: an empty prompt or response.
    """
    b = net.config.block_size
    batch = positions_batch(prompt, response, b)
    inside = batch.eval_mask
    hidden, target_probs = target_pass(taps, batch, b)
    logits, _ = draft_pass(net, taps.embed, taps.lm_head, batch, hidden)
    draft_probs = mx.softmax(logits, axis=-1)
    soft = np.array(1.0 - 0.5 * mx.abs(draft_probs - target_probs).sum(axis=-1))[0] * inside[0]
    target_top = np.array(mx.argmax(target_probs, axis=-1))[0]
    draft = np.array(mx.argmax(logits, axis=-1))[0].astype(np.int32)
    greedy = (draft == target_top) * inside[0]
    return {"soft": np.clip(soft, 0.0, 1.0).astype(np.float32), "greedy": greedy.astype(np.float32),
            "draft": draft, "data_match": target_top[:, 0] == batch.labels[0, :, 0]}


def acceptance_summary(soft: np.ndarray, greedy: np.ndarray) -> dict:
    """Mean acceptance lengths of blocks ``[A, B]``: ``tau_soft`` and ``tau_greedy`` (``1 +
    sum_k prod_{i<=k} acc_i``, averaged over blocks, each position once, as the trainer's
    ``tau``), and ``first_slot`` (mean greedy acceptance of the first draft)."""
    if len(soft) == 0:
        return {"blocks": 0}
    return {"blocks": int(len(soft)),
            "tau_soft": round(float(np.mean(1 + np.cumprod(soft, axis=-1).sum(axis=-1))), 3),
            "tau_greedy": round(float(np.mean(1 + np.cumprod(greedy, axis=-1).sum(axis=-1))), 3),
            "first_slot": round(float(np.mean(greedy[:, 0])), 3)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("drafter", help="drafter directory (config.json + safetensors)")
    ap.add_argument("--examples", required=True, help="a run's examples.jsonl[.gz]")
    ap.add_argument("--split", choices=("train", "eval"), default="train")
    ap.add_argument("--per-source", type=int, default=4)
    ap.add_argument("--first", type=int, default=96, help="response tokens counted as the opening")
    ap.add_argument("--target", default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = load_target(args.target)
    net = load_dspark(args.drafter)
    taps = TargetTaps(target.model, net.config.target_layer_ids)
    result: dict = {"drafter": args.drafter, "examples": args.examples, "split": args.split,
                    "first": args.first, "target": f"{target.name} ({target.weights})"}
    for source, rows in sorted(read_examples(args.examples, args.split, args.per_source).items()):
        scores = [block_scores(taps, net, row["prompt"], row["response"]) for row in rows]
        head = [np.concatenate([s[k][: args.first] for s in scores]) for k in ("soft", "greedy")]
        tail = [np.concatenate([s[k][args.first:] for s in scores]) for k in ("soft", "greedy")]
        match = np.concatenate([s["data_match"] for s in scores])
        result[source] = {"examples": len(rows), "data_match": round(float(np.mean(match)), 4),
                          "opening": acceptance_summary(*head), "rest": acceptance_summary(*tail)}
        print(source, json.dumps(result[source]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
