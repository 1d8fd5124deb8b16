"""A reduced draft vocabulary: the drafter proposes only the target's most frequent tokens.

A DSpark draft spends about half of its forward in two vocabulary-wide phases: the LM head over
the block's rows and the Markov head's left-to-right scoring (docs/kernels.md, "Fused DSpark
draft"). FR-Spec (Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling", arXiv 2502.14856) restricts both to the ``V'`` tokens
the target emits most often: rows of the target's own LM head and of the Markov table ``W2``,
nothing retrained. A draft token is then always one of those ``V'``; the target still verifies
over its whole vocabulary, so outputs are unchanged (greedy: the same tokens; sampled: the
draft distribution ``q`` is zero outside the subset, which the rejection rule allows).

Checkpoints carry the subset as EAGLE-3 / speculators do (vLLM ``draft_id_to_target_id``):
``d2t`` ``[V']`` int64 with ``target_id = draft_id + d2t[draft_id]``, optionally ``t2d``
``[V]`` bool (``True`` at the subset's target ids), and ``config.json["draft_vocab_size"] = V'``.
The Markov table ``W1`` stays whole: it is indexed by the previous token, which for the first
draft is the anchor, any target token.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

_ROW_PARAMS = ("weight", "scales", "biases", "bias")  # a head's arrays indexed by vocabulary row


def frequency_ids(counts: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """The ``size`` most frequent token ids, ascending (FR-Spec's frequency ranking).

    Args:
        counts: ``[V]`` occurrences per token id (:func:`count_tokens`), e.g. over the target's
            own responses (the tokens a drafter has to propose).
        size: ``V'``, ``1 <= size <= vocab_size``; ids never seen fill the end of the ranking
            in id order, so a subset larger than the seen tokens is still well defined.
        vocab_size: ``V``, the target's vocabulary.

    Returns:
        ``[size]`` int32 ids, ascending (among equal scores the smallest id wins, as
        ``mx.argmax`` does over the whole vocabulary). Ties in count: the smaller id ranks first.

    Raises:
        ValueError: ``size`` out of range, or ``counts`` not of shape ``[V]``.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape != (vocab_size,):
        raise ValueError(f"counts must have shape ({vocab_size},), got {counts.shape}")
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then by id
    return np.sort(order[:size]).astype(np.int32)


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
    """Occurrences ``[V]`` int64 of each token id over ``sequences`` (ids outside ``0..V-1``
    raise ``ValueError``)."""
    dense = np.zeros(vocab_size, dtype=np.int64)
    for seq in sequences:
        arr = np.asarray(list(seq), dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise ValueError(f"token id outside the vocabulary of {vocab_size}")
        dense += np.bincount(arr, minlength=vocab_size)
    return dense


def d2t_from_ids(ids: np.ndarray) -> np.ndarray:
    """EAGLE-3's ``d2t`` ``[V']`` int64 offsets for draft-to-target ids ``ids``."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids - np.arange(ids.size, dtype=np.int64)


def ids_from_d2t(d2t, vocab_size: int, t2d=None) -> np.ndarray:
    """Target ids ``[V']`` int32 of draft ids ``0..V'-1`` from ``d2t`` (``target = draft +
    d2t[draft]``), checked: unique, inside ``0..V-1``, and equal to ``t2d``'s ``True`` ids when
    that is given.

    Raises:
        ValueError: an id outside the vocabulary, a repeated id, or a ``t2d`` that disagrees.
    """
    d2t = np.asarray(d2t, dtype=np.int64).reshape(-1)
    ids = d2t + np.arange(d2t.size, dtype=np.int64)
    if not d2t.size or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"d2t maps draft ids outside the target vocabulary of {vocab_size}")
    if np.unique(ids).size != ids.size:
        raise ValueError("d2t maps two draft ids to the same target id")
    if t2d is not None:
        t2d = np.asarray(t2d).reshape(-1)
        if t2d.size != vocab_size or not np.array_equal(np.flatnonzero(t2d), np.sort(ids)):
            raise ValueError("t2d does not mark exactly d2t's target ids")
    return ids.astype(np.int32)


def check_ids(ids, vocab_size: int) -> np.ndarray:
    """``ids`` as ``[V']`` int64 target ids, checked: inside ``0..V-1`` and unique (else
    ``ValueError``)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids_from_d2t(d2t_from_ids(ids), vocab_size)
    return ids


def _gather_rows(module: nn.Module, ids: mx.array) -> nn.Module:
    """A copy of a Linear / Embedding (quantized or not) with only the vocabulary rows ``ids``
    (affine quantization groups run along a row, so gathered rows stay valid)."""
    new = copy.copy(module)  # (shallow: attributes such as bits and group_size stay shared)
    for name in _ROW_PARAMS:
        if name in module:
            new[name] = mx.contiguous(module[name][ids])
    if hasattr(new, "refresh"):  # drafters.dspark.loader.DenseQuantizedLinear: its float copy too
        new.refresh()
    return new


@dataclass
class DraftVocab:
    """A draft vocabulary bound to one target head and one network's Markov table.

    Attributes:
        ids: ``[V']`` int32 target ids of draft ids ``0..V'-1`` (ascending from
            :func:`frequency_ids`).
        head_module: the target head's rows ``ids`` (a copy of its tied embedding or
            ``lm_head`` module, same class and quantization; the fused draft launch reads it).
        head: final-normed states ``[..., d]`` -> logits over the subset ``[..., V']``.
        markov_w2: the Markov head's ``W2`` rows ``ids`` (None without a Markov head).
        vocab_size: ``V``.
    """

    ids: mx.array
    head_module: nn.Module
    head: object
    markov_w2: nn.Module | None
    vocab_size: int

    @classmethod
    def build(cls, ids, head_module: nn.Module, tied: bool, network) -> DraftVocab:
        """Gather the subset's rows of ``head_module`` (the tied embedding when ``tied``, whose
        ``as_linear`` is the LM head, else ``lm_head``) and of ``network``'s ``W2``.

        Raises:
            ValueError: ids outside the head's vocabulary or repeated.
        """
        vocab_size = int(head_module.weight.shape[0])
        index = mx.array(check_ids(ids, vocab_size).astype(np.int32))
        rows = _gather_rows(head_module, index)
        w2 = _gather_rows(network.markov_head.markov_w2, index) if network.has_markov else None
        mx.eval([v for m in (rows, w2) if m is not None for _, v in tree_flatten(m.parameters())])
        return cls(index, rows, rows.as_linear if tied else rows, w2, vocab_size)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def to_target(self, draft_ids: mx.array) -> mx.array:
        """Draft ids ``[...]`` -> target ids ``[...]`` int32."""
        return self.ids[draft_ids]

    def scatter(self, probs: mx.array) -> mx.array:
        """Distributions over the subset ``[L, V']`` -> over the target vocabulary ``[L, V]``
        (zero outside the subset)."""
        rows = probs.shape[0]
        return mx.put_along_axis(mx.zeros((rows, self.vocab_size), probs.dtype),
                                 mx.broadcast_to(self.ids[None], probs.shape), probs, axis=-1)

    def draft_index(self) -> np.ndarray:
        """``[V]`` int64: each target id's draft id, ``-1`` outside the subset (host side)."""
        index = np.full(self.vocab_size, -1, dtype=np.int64)
        index[np.asarray(self.ids)] = np.arange(self.size)
        return index


def response_counts(paths: Iterable[str], vocab_size: int, split: str | None = "train") -> np.ndarray:
    """Token counts ``[V]`` over the responses of training-data files (the trainer's
    ``examples.jsonl``, maybe gzipped: one JSON object per line with ``response`` token ids and
    ``split``), of one ``split`` (None: all)."""
    import gzip
    import json

    def responses():
        for path in paths:
            opener = gzip.open if str(path).endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        row = json.loads(line)
                        if split is None or row.get("split") == split:
                            yield row["response"]

    return count_tokens(responses(), vocab_size)


def write_draft_vocab(path, ids, out=None) -> None:
    """Add (or replace) a draft vocabulary in the checkpoint directory ``path``: ``d2t`` in its
    ``model.safetensors`` (or its first ``*.safetensors`` file) and ``draft_vocab_size`` in its
    ``config.json``, every other tensor kept as stored and any earlier map (``d2t``, ``t2d``,
    ``draft_id_to_target_id``, with or without a ``model.`` prefix, in any of its files)
    removed; into a copy of the directory at ``out`` when given. ``ids=None`` removes it. Each
    file is written into a scratch subdirectory first, then moved over the original.

    Raises:
        FileNotFoundError: no ``*.safetensors`` in ``path``.
        ValueError: ids outside the drafter's vocabulary or repeated.
    """
    import json
    import os
    import shutil
    from pathlib import Path

    src = Path(path)
    dst = Path(out) if out is not None else src
    config = json.loads((src / "config.json").read_text())
    if ids is not None:
        ids = check_ids(ids, int(config["vocab_size"]))
    if dst.resolve() != src.resolve():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    files = sorted(dst.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {dst}")
    home = dst / "model.safetensors" if (dst / "model.safetensors").exists() else files[0]
    maps = {prefix + name for prefix in ("", "model.") for name in ("d2t", "t2d", "draft_id_to_target_id")}
    # (new files are written in a subdirectory, where neither this glob nor the loader's sees a
    # leftover, then moved over the originals)
    scratch = dst / ".draft_vocab_tmp"
    scratch.mkdir(exist_ok=True)
    try:
        for file in files:
            tensors, metadata = mx.load(str(file), return_metadata=True)
            kept = {k: v for k, v in tensors.items() if k not in maps}
            if file == home and ids is not None:
                kept["d2t"] = mx.array(d2t_from_ids(ids))
            elif len(kept) == len(tensors):
                continue  # (nothing to change in this file)
            tmp = scratch / file.name
            mx.save_safetensors(str(tmp), kept, metadata=metadata)
            os.replace(tmp, file)
        if ids is None:
            config.pop("draft_vocab_size", None)
        else:
            config["draft_vocab_size"] = int(ids.size)
        tmp = scratch / "config.json"
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, dst / "config.json")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``specserve dspark-vocab DRAFTER --data examples.jsonl.gz --size 16384 [--out DIR]``: give a
    drafter the draft vocabulary of the ``--size`` tokens its training responses use most."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="specserve dspark-vocab", description=main.__doc__)
    ap.add_argument("drafter", help="drafter checkpoint directory (config.json + model.safetensors)")
    ap.add_argument("--data", nargs="+", required=True,
                    help="the trainer's examples.jsonl[.gz] files: their training responses are counted")
    ap.add_argument("--size", type=int, required=True, help="draft vocabulary size V'")
    ap.add_argument("--split", default="train", help="which examples to count ('all': every one)")
    ap.add_argument("--out", default=None, help="write a copy of the drafter here (default: in place)")
    args = ap.parse_args(argv)
    vocab_size = int(json.loads((Path(args.drafter) / "config.json").read_text())["vocab_size"])
    counts = response_counts(args.data, vocab_size, None if args.split == "all" else args.split)
    if not counts.sum():
        ap.error("no responses counted (wrong --data or --split?)")
    ids = frequency_ids(counts, args.size, vocab_size)
    write_draft_vocab(args.drafter, ids, args.out)
    covered = counts[ids].sum() / counts.sum()
    print(f"draft vocabulary of {ids.size} tokens: {covered:.4%} of {counts.sum()} response tokens "
          f"({np.count_nonzero(counts)} distinct)")
    return 0

