"""A DSpark draft vocabulary (drafters/dspark/vocab.py; FR-Spec): ranking, the checkpoint's
``d2t``/``t2d``, and drafts over the subset equal to drafts over the whole vocabulary with every
other token masked out (greedy tokens, sampled ``q`` and confidence)."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_dspark import D, V, deepspec_tensors, qwen3_config_json, tiny_net, write_checkpoint

from drafters.base import DraftContext
from drafters.dspark import (
    DraftStep,
    DraftVocab,
    DSparkConfig,
    DSparkDrafter,
    load_dspark,
    save_dspark,
)
from drafters.dspark.model import sample_block
from drafters.dspark.vocab import count_tokens, d2t_from_ids, frequency_ids, ids_from_d2t


@pytest.fixture(scope="module")
def head():
    """A quantized tied embedding standing in for the target's (its ``as_linear`` the LM head)."""
    emb = nn.Embedding(V, D)
    emb.weight = mx.random.normal((V, D), key=mx.random.key(17))
    return nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=8)


SUBSET = np.sort(np.random.default_rng(5).choice(V, 40, replace=False)).astype(np.int32)


def masked(logits: mx.array, ids) -> mx.array:
    """Whole-vocabulary logits with every token outside ``ids`` at -inf."""
    keep = np.zeros(logits.shape[-1], bool)
    keep[np.asarray(ids)] = True
    return mx.where(mx.array(keep), logits, -mx.inf)


def test_frequency_ids_rank_by_count_then_id_and_come_out_ascending():
    counts = count_tokens([[5, 5, 5, 9, 9, 2], [9, 7, 7, 7, 3]], vocab_size=12)
    assert counts.tolist() == [0, 0, 1, 1, 0, 3, 0, 3, 0, 3, 0, 0]
    assert frequency_ids(counts, 3, 12).tolist() == [5, 7, 9]
    assert frequency_ids(counts, 4, 12).tolist() == [2, 5, 7, 9]  # (2 and 3 tie: the smaller id)
    assert frequency_ids(count_tokens([[5, 5, 5, 1, 1, 1]], 12), 3, 12).tolist() == [0, 1, 5]  # unseen ids fill up in id order
    assert frequency_ids(counts, 12, 12).tolist() == list(range(12))
    for bad in (0, 13):
        with pytest.raises(ValueError, match="size"):
            frequency_ids(counts, bad, 12)
    with pytest.raises(ValueError, match="outside"):
        count_tokens([[3, 12]], 12)
    with pytest.raises(ValueError, match="shape"):
        frequency_ids(counts[:11], 3, 12)


def test_d2t_round_trips_and_bad_maps_are_refused():
    ids = np.array([0, 3, 4, 10], np.int32)
    d2t = d2t_from_ids(ids)
    assert d2t.dtype == np.int64 and d2t.tolist() == [0, 2, 2, 7]
    t2d = np.zeros(12, bool)
    t2d[ids] = True
    assert ids_from_d2t(d2t, 12, t2d).tolist() == ids.tolist()
    with pytest.raises(ValueError, match="outside"):
        ids_from_d2t(d2t, 10)
    with pytest.raises(ValueError, match="same target id"):
        ids_from_d2t([0, -1], 12)
    t2d[5] = True
    with pytest.raises(ValueError, match="t2d"):
        ids_from_d2t(d2t, 12, t2d)


def test_a_draft_vocabulary_round_trips_through_a_checkpoint(tmp_path):
    net = tiny_net(seed=2)
    net.draft_vocab = SUBSET
    out = save_dspark(net, tmp_path / "d", bits=4, group_size=32)
    stored = mx.load(str(out / "model.safetensors"))
    assert stored["d2t"].dtype == mx.int64 and (np.array(stored["d2t"]) + np.arange(SUBSET.size)).tolist() == \
        SUBSET.tolist()
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == SUBSET.size
    back = load_dspark(out)
    assert back.draft_vocab.tolist() == SUBSET.tolist()
    assert "d2t" not in dict(back.parameters())  # (not a parameter of the network)
    again = save_dspark(back, tmp_path / "again")  # kept by a later save; dropped with the vocabulary
    assert load_dspark(again).draft_vocab.tolist() == SUBSET.tolist()
    back.draft_vocab = None
    plain = save_dspark(back, tmp_path / "plain")
    assert load_dspark(plain).draft_vocab is None and "draft_vocab_size" not in json.loads(
        (plain / "config.json").read_text())


def test_write_draft_vocab_replaces_or_removes_every_earlier_map(tmp_path, monkeypatch):
    """specserve dspark-vocab's writer: an earlier map under any of its names (prefixed or not,
    with its t2d) is replaced or removed, the other tensors and the metadata stay bit for bit,
    and a relative path to the same directory edits it in place."""
    from safetensors.numpy import save_file

    from drafters.dspark.vocab import write_draft_vocab

    cfg = DSparkConfig.from_dict(qwen3_config_json())
    base = deepspec_tensors(cfg, np.random.default_rng(6), shared=False)
    old = np.arange(0, V, 2)
    t2d = np.zeros(V, bool)
    t2d[old] = True
    write_checkpoint(tmp_path / "d", qwen3_config_json(draft_vocab_size=int(old.size)),
                     base | {"model.d2t": d2t_from_ids(old), "model.t2d": t2d})
    save_file({"model.draft_id_to_target_id": d2t_from_ids(old)}, str(tmp_path / "d" / "extra.safetensors"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d" / ".draft_vocab_tmp").mkdir()  # an interrupted run's leftover
    (tmp_path / "d" / ".draft_vocab_tmp" / "model.safetensors").write_bytes(b"partial")
    write_draft_vocab("d", SUBSET, out=tmp_path / "d")  # (the same directory, named two ways)
    assert not (tmp_path / "d" / ".draft_vocab_tmp").exists()
    back = load_dspark(tmp_path / "d")
    assert back.draft_vocab.tolist() == SUBSET.tolist()
    stored, meta = mx.load(str(tmp_path / "d" / "model.safetensors"), return_metadata=True)
    assert meta == {"format": "pt"} and {"model.d2t", "model.t2d"}.isdisjoint(stored)
    assert np.array_equal(np.array(stored["fc.weight"]), base["fc.weight"])
    assert mx.load(str(tmp_path / "d" / "extra.safetensors")) == {}
    write_draft_vocab(tmp_path / "d", None)
    assert load_dspark(tmp_path / "d").draft_vocab is None
    assert "draft_vocab_size" not in json.loads((tmp_path / "d" / "config.json").read_text())


def test_official_reduced_vocabulary_tensors_load_and_bad_ones_are_refused(tmp_path):
    """``d2t`` (or vLLM's ``draft_id_to_target_id``) and ``t2d`` as EAGLE-3 / speculators
    checkpoints store them, with ``draft_vocab_size``; an inconsistent map or an LM head of the
    drafter's own (its rows are the target's here) is refused with the reason."""
    rng = np.random.default_rng(3)
    cfg = DSparkConfig.from_dict(qwen3_config_json())
    base = deepspec_tensors(cfg, rng, shared=False)
    d2t = d2t_from_ids(SUBSET)
    t2d = np.zeros(V, bool)
    t2d[SUBSET] = True
    size = {"draft_vocab_size": int(SUBSET.size)}
    cases = {
        "d2t": (base | {"d2t": d2t, "t2d": t2d}, size, None),
        "vllm": (base | {"model.draft_id_to_target_id": d2t}, size, None),
        "size": (base | {"d2t": d2t}, {"draft_vocab_size": 7}, (ValueError, "draft_vocab_size 7")),
        "t2d": (base | {"d2t": d2t, "t2d": ~t2d}, size, (ValueError, "t2d")),
        "range": (base | {"d2t": d2t + V}, size, (ValueError, "outside")),
        "no_d2t": (base | {"t2d": t2d}, size, (ValueError, "without d2t")),
        "own_head": (base | {"d2t": d2t, "lm_head.weight": np.zeros((SUBSET.size, D), np.float32)}, size,
                     (NotImplementedError, "LM head of its own")),
        "own_head_vllm": (base | {"draft_id_to_target_id": d2t, "model.lm_head.weight":
                                  np.zeros((SUBSET.size, D), np.float32)}, size, (NotImplementedError, "of its own")),
        "two_maps": (base | {"d2t": d2t, "draft_id_to_target_id": d2t}, size, (ValueError, "two draft vocabulary")),
        # DeepSpec's frozen copies of the target's embedding and head, [V, d]: dropped as without d2t
        "frozen_heads": (deepspec_tensors(cfg, np.random.default_rng(4), shared=True) | {"d2t": d2t}, size, None),
    }
    for name, (tensors, extra, error) in cases.items():
        write_checkpoint(tmp_path / name, qwen3_config_json(**extra), tensors)
        if error is None:
            assert load_dspark(tmp_path / name).draft_vocab.tolist() == SUBSET.tolist(), name
        else:
            with pytest.raises(error[0], match=error[1]):
                load_dspark(tmp_path / name)
    write_checkpoint(tmp_path / "whole", qwen3_config_json(draft_vocab_size=V), base)  # (the whole vocabulary)
    assert load_dspark(tmp_path / "whole").draft_vocab is None


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_drafts_over_a_draft_vocabulary_are_the_whole_vocabularys_masked(head, temperature):
    """sample_block over the subset (the head's and W2's rows ``ids``) drafts as the whole
    vocabulary does with every other token at -inf, after the same previous tokens: greedy, the
    masked argmax; sampled, ``q`` the masked distribution over the whole vocabulary (zero
    outside) and draws inside the subset; the same confidence (W1 stays whole: the anchor, here
    outside the subset, may be any token). Tokens come out as target ids."""
    net = tiny_net(seed=4)
    vocab = DraftVocab.build(SUBSET, head, True, net)
    assert vocab.size == SUBSET.size and vocab.head(mx.zeros((1, D))).shape == (1, SUBSET.size)
    h = mx.random.normal((5, D), key=mx.random.key(8))
    anchor = mx.array([int(np.setdiff1d(np.arange(V), SUBSET)[0])], dtype=mx.int32)
    full = head.as_linear(h).astype(mx.float32)
    sub = vocab.head(h).astype(mx.float32)
    assert mx.allclose(sub, full[:, mx.array(SUBSET)], atol=1e-5).item()
    tokens, q, conf = sample_block(net, sub, h, anchor, 20, temperature, seed=3, vocab=vocab)
    assert set(tokens.tolist()) <= set(SUBSET.tolist())
    prevs = mx.concatenate([anchor, tokens[:-1]])
    corrected = masked(full + net.markov_bias(prevs).astype(mx.float32), SUBSET)
    assert mx.allclose(conf, mx.sigmoid(net.confidence_logits(h, prevs)), atol=1e-6).item()
    if temperature:
        assert q.shape == (5, V) and mx.allclose(q, mx.softmax(corrected / temperature, axis=-1), atol=1e-6).item()
        outside = np.setdiff1d(np.arange(V), SUBSET)
        assert float(mx.abs(q[:, mx.array(outside)]).max()) == 0.0
        assert all(q[k, t].item() > 0 for k, t in enumerate(tokens.tolist()))
    else:
        assert q is None and tokens.tolist() == mx.argmax(corrected, axis=-1).tolist()


def test_compiled_and_eager_steps_draft_the_same_over_a_draft_vocabulary(head):
    """The drafter with a draft vocabulary, compiled and eager, over cycles of growing context:
    the same tokens, all inside the subset, and the sampled ``q`` over the whole vocabulary."""
    net = tiny_net(seed=6)
    vocab = DraftVocab.build(SUBSET, head, True, net)
    emb = nn.Embedding(V, D)
    emb.weight = mx.dequantize(head.weight, head.scales, head.biases, group_size=32, bits=8)
    drafters = {c: DSparkDrafter(net, emb, head.as_linear,
                                 DraftStep(net, emb, head.as_linear, compiled=c, vocab=vocab)) for c in (True, False)}
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, V, 60).tolist()
    hidden = mx.random.normal((60, 2 * D), key=mx.random.key(6))
    seen = 0
    allowed = set(SUBSET.tolist())
    for cut, temperature in ((10, 0.0), (13, 1.1), (20, 0.0), (21, 0.7)):
        ctx = DraftContext(tokens[: cut + 1], hidden[seen:cut], temperature=temperature, seed=cut)
        a, b = (drafters[c].propose(ctx, 5) for c in (True, False))
        seen = cut
        assert a.tokens == b.tokens and set(a.tokens) <= allowed
        assert np.allclose(a.confidence, b.confidence, atol=1e-5)
        if temperature:
            assert a.draft_probs.shape == (5, V) and mx.allclose(a.draft_probs, b.draft_probs, atol=1e-6).item()
            assert all(a.draft_probs[k, t].item() > 0 for k, t in enumerate(a.tokens))
