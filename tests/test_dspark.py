"""DSpark drafter: config, DeepSpec-layout loading, masks, Markov/confidence heads, losses,
the per-request drafter and a tiny training run (CPU, tiny shapes)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from safetensors.numpy import save_file
from tiny import byte_tokenizer, tiny_model

from drafters.base import DraftContext
from drafters.dspark import (
    DraftStep,
    DSparkConfig,
    DSparkDrafter,
    DSparkModel,
    TargetTaps,
    build_target_layer_ids,
    init_weights,
    load_dspark,
    prefix_survival,
    reference_draft,
    save_dspark,
)
from drafters.dspark.data import (
    PromptRecord,
    code_prompts,
    humaneval_prompts,
    instruction_prompts,
    pre_query_prompt,
)
from drafters.dspark.model import block_inputs
from drafters.dspark.train import (
    Batch,
    DataConfig,
    DraftArch,
    TrainConfig,
    batch_gradients,
    default_mask_token_id,
    draft_pass,
    dspark_loss,
    evaluate_acceptance,
    generate_examples,
    init_from_target,
    latest_checkpoint,
    make_batch,
    restore,
    self_instruct_prompts,
    target_pass,
    train_dspark,
    train_loop,
)

V, D = 97, 64


def tiny_config(**kw) -> DSparkConfig:
    base = dict(hidden_size=D, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=V, target_layer_ids=[0, 2],
                mask_token_id=5, block_size=5, markov_rank=32, num_target_layers=4, rope_theta=1e4)
    base.update(kw)
    return DSparkConfig(**base)


def tiny_net(seed=0, **kw) -> DSparkModel:
    model = DSparkModel(tiny_config(**kw))
    init_weights(model, std=0.3, seed=seed)
    return model


@pytest.fixture(scope="module")
def heads():
    """A frozen stand-in for the target's embedding and (tied) LM head."""
    emb = nn.Embedding(V, D)
    emb.weight = mx.random.normal((V, D), key=mx.random.key(7))
    return emb, emb.as_linear


def deepspec_tensors(cfg: DSparkConfig, rng: np.random.Generator, shared=True, prefix="") -> dict:
    """Random tensors named exactly as a DeepSpec ``Qwen3DSparkModel`` state dict."""
    d, hd, r = cfg.hidden_size, cfg.head_dim, cfg.markov_rank
    qo, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    t = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(qo, d), p + "self_attn.k_proj.weight": w(kv, d),
              p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, qo),
              p + "self_attn.q_norm.weight": 1 + w(hd), p + "self_attn.k_norm.weight": 1 + w(hd),
              p + "mlp.gate_proj.weight": w(cfg.intermediate_size, d),
              p + "mlp.up_proj.weight": w(cfg.intermediate_size, d),
              p + "mlp.down_proj.weight": w(d, cfg.intermediate_size),
              p + "input_layernorm.weight": 1 + w(d), p + "post_attention_layernorm.weight": 1 + w(d)}
    t |= {"norm.weight": 1 + w(d), "fc.weight": w(d, cfg.num_taps * d), "hidden_norm.weight": 1 + w(d),
          "markov_head.markov_w1.weight": w(cfg.vocab_size, r), "markov_head.markov_w2.weight": w(cfg.vocab_size, r),
          "confidence_head.proj.weight": w(1, d + r), "confidence_head.proj.bias": w(1)}
    if shared:
        t |= {"embed_tokens.weight": w(cfg.vocab_size, d), "lm_head.weight": w(cfg.vocab_size, d)}
    return {prefix + k: v for k, v in t.items()}


def qwen3_config_json(**kw) -> dict:
    """A Qwen3-shaped DeepSpec draft config.json (tiny widths; head_dim != hidden/heads)."""
    cfg = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": D,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "rope_scaling": None, "vocab_size": V, "max_position_embeddings": 40960,
           "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
           "torch_dtype": "bfloat16", "num_target_layers": 4, "block_size": 5,
           "layer_types": ["full_attention"] * 2, "mask_token_id": 5, "target_layer_ids": [0, 2],
           "num_anchors": 512, "enable_confidence_head": True, "confidence_head_with_markov": True,
           "markov_rank": 32, "markov_head_type": "vanilla", "bos_token_id": 1, "use_cache": True}
    cfg.update(kw)
    return cfg


def write_checkpoint(path, cfg_json, tensors):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_json))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


# ---- config ---------------------------------------------------------------------------------


def test_default_layer_ids_follow_zlab_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert build_target_layer_ids(30, 1) == [15]


def test_config_validation_and_round_trip():
    raw = qwen3_config_json(some_unknown_key={"x": 1})
    cfg = DSparkConfig.from_dict(raw)
    assert (cfg.head_dim, cfg.rope_theta, cfg.num_taps, cfg.model_type) == (32, 1e6, 2, "qwen3")
    again = DSparkConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() and again.extra["some_unknown_key"] == {"x": 1}
    with pytest.raises(ValueError, match="never the last"):
        DSparkConfig.from_dict(qwen3_config_json(target_layer_ids=[0, 3]))
    with pytest.raises(NotImplementedError, match="gated"):
        DSparkConfig.from_dict(qwen3_config_json(markov_head_type="gated"))
    with pytest.raises(KeyError, match="mask_token_id"):
        DSparkConfig.from_dict({k: v for k, v in raw.items() if k != "mask_token_id"})
    v5 = {k: v for k, v in raw.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    assert DSparkConfig.from_dict(v5).rope_theta == 5e5
    legacy = {k: v for k, v in raw.items() if k not in ("mask_token_id", "target_layer_ids")}
    legacy["dflash_config"] = {"mask_token_id": 9, "target_layer_ids": [1, 2]}
    assert DSparkConfig.from_dict(legacy).mask_token_id == 9


# ---- loader ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "model."])
def test_synthetic_deepspec_checkpoint_loads_and_drafts(tmp_path, heads, prefix):
    rng = np.random.default_rng(0)
    cfg = DSparkConfig.from_dict(qwen3_config_json())
    tensors = deepspec_tensors(cfg, rng, shared=True, prefix=prefix)
    write_checkpoint(tmp_path, qwen3_config_json(), tensors)
    model = load_dspark(tmp_path)
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == {k[len(prefix):] for k in tensors} - {"embed_tokens.weight", "lm_head.weight"}
    for name in ("fc.weight", "layers.1.self_attn.k_norm.weight", "markov_head.markov_w2.weight"):
        assert np.array_equal(np.array(params[name]), tensors[prefix + name])
    emb, lm_head = heads
    drafter = DSparkDrafter(model, emb, lm_head)
    tokens = [3, 14, 15, 9, 2, 6, 5, 3]
    hidden = mx.random.normal((len(tokens) - 1, 2 * D), key=mx.random.key(1))
    out = drafter.propose(DraftContext(tokens, hidden), 16)
    assert len(out.tokens) == cfg.block_size and all(0 <= t < V for t in out.tokens)
    assert out.draft_probs is None and len(out.confidence) == cfg.block_size
    assert all(0.0 < c < 1.0 for c in out.confidence)
    ref, _, conf = reference_draft(model, emb, lm_head, hidden, tokens, 16)
    assert ref.tolist() == out.tokens
    assert np.allclose(conf.tolist(), out.confidence, atol=1e-5)


def test_shared_heads_absent_are_aliased_and_bad_ones_refused(tmp_path):
    rng = np.random.default_rng(1)
    cfg = DSparkConfig.from_dict(qwen3_config_json())
    write_checkpoint(tmp_path / "a", qwen3_config_json(), deepspec_tensors(cfg, rng, shared=False))
    assert load_dspark(tmp_path / "a").config.vocab_size == V
    bad = deepspec_tensors(cfg, rng) | {"lm_head.weight": np.zeros((V, D + 1), np.float32)}
    write_checkpoint(tmp_path / "b", qwen3_config_json(), bad)
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_dspark(tmp_path / "b")
    missing = deepspec_tensors(cfg, rng)
    del missing["layers.0.mlp.up_proj.weight"]
    write_checkpoint(tmp_path / "c", qwen3_config_json(), missing)
    with pytest.raises(ValueError, match="up_proj"):
        load_dspark(tmp_path / "c")


def test_save_load_round_trip_plain_and_quantized(tmp_path, heads):
    model = tiny_net(seed=3)
    plain = save_dspark(model, tmp_path / "plain")
    names = set(mx.load(str(plain / "model.safetensors")))
    assert "fc.weight" in names and not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    back = load_dspark(plain)
    for (k, a), (k2, b) in zip(tree_flatten(model.parameters()), tree_flatten(back.parameters())):
        assert k == k2 and mx.array_equal(a, b)

    q = save_dspark(model, tmp_path / "q4", bits=4, group_size=32, dtype="float16")
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    stored = mx.load(str(q / "model.safetensors"))
    assert stored["layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert "layers.0.mlp.up_proj.scales" in stored and "markov_head.markov_w1.biases" in stored
    assert stored["confidence_head.proj.weight"].dtype == mx.float16  # kept unquantized
    assert (q / "model.safetensors").stat().st_size < (plain / "model.safetensors").stat().st_size / 4
    small = load_dspark(q)
    assert isinstance(small.layers[0].mlp.up_proj, nn.QuantizedLinear)
    again = save_dspark(small, tmp_path / "q4b")  # a quantized model saves as is
    assert mx.array_equal(mx.load(str(again / "model.safetensors"))["fc.weight"], stored["fc.weight"])
    emb, lm_head = heads
    tokens, hidden = [4, 8, 15, 16, 23, 42], mx.random.normal((5, 2 * D), key=mx.random.key(2))
    full_h = reference_draft(model, emb, lm_head, hidden, tokens, 5)[2]
    q_h = reference_draft(small, emb, lm_head, hidden, tokens, 5)[2]
    deq = load_dspark(q, dequantize=True)
    assert isinstance(deq.layers[0].mlp.up_proj, nn.Linear) and deq.config.quantization is None
    assert np.allclose(reference_draft(deq, emb, lm_head, hidden, tokens, 5)[2], q_h, atol=1e-4)
    assert np.abs(np.array(full_h) - np.array(q_h)).max() < 0.2  # 4-bit stays close


@pytest.mark.parametrize("rank,group", [(32, 32), (64, 64), (64, 32), (128, 128), (128, 64)])
def test_loaded_quantized_markov_heads_compute_their_dequantized_product(tmp_path, rank, group):
    """On whatever backend runs the tests, a quantized drafter loaded as the engine loads it
    (float32, packed) gives the Markov bias of its dequantized tables: one group per row
    included (MLX-CUDA 0.32.4 gets that wrong or has no kernel for it; the loader's guard
    covers it there), for 1 and 7 previous tokens."""
    q = save_dspark(tiny_net(seed=7, markov_rank=rank), tmp_path / "q", bits=4, group_size=group)
    net = load_dspark(q, dtype="float32")
    # MLX-CUDA runs float32 GEMMs in TF32 by default (10-bit mantissa; ml-explore/mlx#3860): on
    # the H100 a right product was 4.7e-4 of the scale off, a wrong one is off by ~1
    tol = 1e-4 if mx.default_device() == mx.cpu else 3e-3
    w1, w2 = net.markov_head.markov_w1, net.markov_head.markov_w2
    for prev in (mx.array([3]), mx.array([3, 9, 0, 96, 5, 5, 41])):
        rows = np.array(mx.dequantize(w1.weight, w1.scales, w1.biases, group_size=group, bits=4), np.float64)
        table = np.array(mx.dequantize(w2.weight, w2.scales, w2.biases, group_size=group, bits=4), np.float64)
        want = rows[np.array(prev)] @ table.T
        got = np.array(net.markov_bias(prev))
        assert got.shape == want.shape == (len(prev), V)
        assert np.abs(got - want).max() <= tol * np.abs(want).max()


def test_quantized_layers_a_backend_gets_wrong_multiply_with_dequantized_weights(tmp_path, heads, monkeypatch):
    """``guard_quantized_matmuls``: a layer whose ``mx.quantized_matmul`` is wrong (as MLX-CUDA
    0.32.4's for one group per row: here the rank-32 Markov head's ``markov_w2``, group 32) or
    raises is swapped for a ``DenseQuantizedLinear``: the same packed tables (still a
    ``QuantizedLinear``, saved byte for byte), the dequantized product; other layers stay."""
    from drafters.dspark.loader import DenseQuantizedLinear, guard_quantized_matmuls

    q = save_dspark(tiny_net(seed=6), tmp_path / "q4", bits=4, group_size=32, dtype="float16")
    good = load_dspark(q, check_matmuls=False)
    if mx.default_device().type == mx.cpu:  # (MLX's reference: right for every layer, in any dtype)
        assert guard_quantized_matmuls(good) == []
        assert guard_quantized_matmuls(load_dspark(q, dtype=None, check_matmuls=False)) == []  # (float16)
        assert type(good.markov_head.markov_w2) is nn.QuantizedLinear
    real = mx.quantized_matmul

    def wrong_at(k, raises=False):
        def qmm(x, w, *args, **kw):
            if x.shape[-1] != k:
                return real(x, w, *args, **kw)
            if raises:
                raise RuntimeError("[quantized_matmul] No implementation for problem shape")
            return mx.zeros((*x.shape[:-1], w.shape[0]), x.dtype)
        return qmm

    emb, lm_head = heads
    tokens, hidden = [4, 8, 15, 16, 23, 42], mx.random.normal((5, 2 * D), key=mx.random.key(2))
    want = reference_draft(good, emb, lm_head, hidden, tokens, 5)
    monkeypatch.setattr(mx, "quantized_matmul", wrong_at(32))
    loaded = load_dspark(q, check_matmuls=True)  # (what loading on a GPU does)
    assert isinstance(loaded.markov_head.markov_w2, DenseQuantizedLinear)
    assert type(load_dspark(q, check_matmuls=False).markov_head.markov_w2) is nn.QuantizedLinear
    monkeypatch.setattr(mx, "quantized_matmul", real)
    for raises in (False, True):
        net = load_dspark(q, check_matmuls=False)
        monkeypatch.setattr(mx, "quantized_matmul", wrong_at(32, raises))
        if raises:  # (broken as set up)
            with pytest.raises(RuntimeError, match="No implementation"):
                mx.eval(net.markov_bias(mx.array([3])))
        else:
            assert not mx.abs(net.markov_bias(mx.array([3]))).max().item()
        swapped = guard_quantized_matmuls(net)
        assert [name for name, _ in swapped] == ["markov_head.markov_w2"]
        assert ("failed" if raises else "off by") in swapped[0][1]
        w2 = net.markov_head.markov_w2
        assert isinstance(w2, DenseQuantizedLinear) and isinstance(w2, nn.QuantizedLinear)
        assert type(net.layers[0].mlp.up_proj) is nn.QuantizedLinear  # (K = 64: right, kept)
        got = reference_draft(net, emb, lm_head, hidden, tokens, 5)
        bias = net.markov_bias(mx.array([3, 9]))  # (still with the broken matmul in place)
        mx.eval(got, bias)
        monkeypatch.setattr(mx, "quantized_matmul", real)
        assert got[0].tolist() == want[0].tolist()
        assert np.allclose(got[2], want[2], atol=1e-5)  # (confidence)
        assert np.allclose(bias, good.markov_bias(mx.array([3, 9])), atol=1e-5)
        again = save_dspark(net, tmp_path / f"again{raises}")
        a, b = mx.load(str(again / "model.safetensors")), mx.load(str(q / "model.safetensors"))
        assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("bits", [None, 4])
def test_markov_variants_cut_the_bias_matrix_to_its_best_low_rank(tmp_path, bits):
    """``benchmarks.markov_variants``: rank k gives the best rank-k approximation of ``W1 W2^T``
    (its SVD truncated) by projecting ``W1``, rank r the same product, ``nomarkov`` a zero bias;
    nothing else moves (``W2`` included, and every tensor's dtype), and every variant loads."""
    from benchmarks.markov_variants import main, markov_spectrum, truncated

    rng = np.random.default_rng(4)
    w1, w2 = rng.standard_normal((V, 32)).astype(np.float32), rng.standard_normal((V, 32)).astype(np.float32)
    product = w1.astype(np.float64) @ w2.T
    u, s, vt = np.linalg.svd(product)
    assert np.allclose(markov_spectrum(w1, w2), s[:32])
    for k in (32, 8):
        a = truncated(w1, w2, k)
        assert a.shape == (V, 32) and np.linalg.matrix_rank(a) == k
        assert np.allclose(a @ w2.T, (u[:, :k] * s[:k]) @ vt[:k], atol=1e-3)

    model = tiny_net(seed=5)
    kw = {"bits": bits, "group_size": 32, "dtype": "float16"} if bits else {}
    src = save_dspark(model, tmp_path / "src", **kw)
    assert main([str(src), "--out", str(tmp_path / "mv"), "--ranks", "32,4"]) == 0
    base, metadata = mx.load(str(src / "model.safetensors"), return_metadata=True)

    def bias_factors(path):
        net = load_dspark(path, dequantize=True)
        return np.array(net.markov_head.markov_w1.weight), np.array(net.markov_head.markov_w2.weight)

    def bias(path):
        w1, w2 = bias_factors(path)
        return w1 @ w2.T

    def error(path):  # relative Frobenius error against the source's bias matrix
        return np.linalg.norm(bias(path) - full) / np.linalg.norm(full)

    full = bias(src)
    assert not bias(tmp_path / "mv" / "nomarkov").any()
    same, cut = error(tmp_path / "mv" / "rank32"), error(tmp_path / "mv" / "rank4")
    assert same < (0.06 if bits else 1e-5)  # (4-bit: W1 dequantized and quantized again, ~4% here)
    s = markov_spectrum(*bias_factors(src))  # (Eckart-Young: the rank-4 cut's error)
    assert cut == pytest.approx(np.sqrt((s[4:] ** 2).sum() / (s ** 2).sum()), rel=0.1 if bits else 1e-4)
    if not bits:  # (4-bit: the projected W1 is quantized again, which adds full-rank noise)
        assert np.linalg.matrix_rank(bias(tmp_path / "mv" / "rank4"), tol=1e-3 * np.abs(full).max()) == 4
    for name in ("nomarkov", "rank32", "rank4"):
        out, meta = mx.load(str(tmp_path / "mv" / name / "model.safetensors"), return_metadata=True)
        assert set(out) == set(base) and meta == metadata
        assert all(out[k].dtype == base[k].dtype and out[k].shape == base[k].shape for k in base)
        assert all(mx.array_equal(out[k], base[k]) for k in base if not k.startswith("markov_head.markov_w1."))
        assert json.loads((tmp_path / "mv" / name / "config.json").read_text()) == \
            json.loads((src / "config.json").read_text())


def test_quant_noise_perturbs_each_quantized_matrix_by_at_most_half_its_groups_step(tmp_path):
    """``benchmarks.dspark_quant_noise``: ``float`` is the export dequantized; each noise copy moves
    every quantized matrix (and nothing else) by at most half its own group's grid step, filling
    that range (uniform); seeds give other noise, ``--scale`` shrinks it, ``--only`` picks the
    matrices, and every copy loads."""
    from benchmarks.dspark_quant_noise import main

    src = save_dspark(tiny_net(seed=8), tmp_path / "q4", bits=4, group_size=32, dtype="float16")
    assert main([str(src), str(tmp_path / "n"), "--seeds", "1,2"]) == 0
    assert main([str(src), str(tmp_path / "h"), "--seeds", "1", "--scale", "0.5", "--only", "markov_head"]) == 0
    quantized = {k[: -len(".scales")] for k in mx.load(str(src / "model.safetensors")) if k.endswith(".scales")}
    assert {"fc", "layers.0.mlp.up_proj", "markov_head.markov_w1"} <= quantized

    def params(path):
        return {k: np.array(v) for k, v in tree_flatten(load_dspark(path, dequantize=True).parameters())}

    base, flt = params(src), params(tmp_path / "n" / "float")
    assert base.keys() == flt.keys() and all(np.array_equal(base[k], flt[k]) for k in base)
    n1, n2, half = params(tmp_path / "n" / "noise-1"), params(tmp_path / "n" / "noise-2"), params(tmp_path / "h" / "noise-1")
    for k, w in base.items():
        name = k[: -len(".weight")]
        if name not in quantized:
            assert np.array_equal(n1[k], w) and np.array_equal(half[k], w), k
            continue
        groups = w.reshape(w.shape[0], -1, 32)
        step = (groups.max(-1, keepdims=True) - groups.min(-1, keepdims=True)) / 15
        rel = (n1[k] - w).reshape(groups.shape) / np.where(step > 0, step, 1)
        assert np.abs(rel).max() <= 0.5 + 1e-4, k
        assert np.abs(rel).max() > 0.4 and abs(np.mean(rel ** 2) - 1 / 12) < 0.03, k  # (uniform: variance 1/12)
        assert not np.array_equal(n1[k], n2[k]), k
        if name.startswith("markov_head"):
            rel_half = np.abs((half[k] - w).reshape(groups.shape) / np.where(step > 0, step, 1))
            assert 0.2 < rel_half.max() <= 0.25 + 1e-4, k
        else:
            assert np.array_equal(half[k], w), k
    report = json.loads((tmp_path / "n" / "noise.json").read_text())
    assert sorted(report["matrices"]) == sorted(quantized) and report["bits"] == 4 and report["group_size"] == 32


# ---- masks, alignment, heads ------------------------------------------------------------------


def test_context_strictly_before_the_anchor(heads):
    model = tiny_net(seed=4)
    emb, lm_head = heads
    tokens = [7, 1, 2, 3, 4, 5, 6, 8, 9, 10]
    anchor_pos = len(tokens) - 1
    hidden = mx.random.normal((anchor_pos + 4, 2 * D), key=mx.random.key(3))
    base = reference_draft(model, emb, lm_head, hidden, tokens, 5, temperature=1.0, seed=1)
    for row in (anchor_pos, anchor_pos + 2):  # at / after the anchor: invisible
        moved = hidden.at[row].add(5.0)
        other = reference_draft(model, emb, lm_head, moved, tokens, 5, temperature=1.0, seed=1)
        assert mx.array_equal(other[1], base[1]) and mx.array_equal(other[0], base[0])
    moved = hidden.at[anchor_pos - 1].add(5.0)  # just before the anchor: visible
    other = reference_draft(model, emb, lm_head, moved, tokens, 5, temperature=1.0, seed=1)
    assert mx.abs(other[1] - base[1]).max().item() > 1e-3


def test_block_is_non_causal_and_blocks_are_independent(heads):
    model = tiny_net(seed=5)
    emb, _ = heads
    ctx_hidden = mx.random.normal((1, 12, 2 * D), key=mx.random.key(4))
    kv = model.context_kv(model.project_context(ctx_hidden))
    x = block_inputs(emb, 11, 5, 5)
    anchors = mx.array([[6]])
    mask = (mx.arange(12) < 6)[None, None]
    h = model(x, anchors, kv, mask)
    x2 = x.at[0, 0, 4].add(1.0)  # last slot changes -> the first slot's state changes too
    assert mx.abs(model(x2, anchors, kv, mask)[0, 0, 0] - h[0, 0, 0]).max().item() > 1e-4
    # Three blocks in one forward (block-diagonal mask) equal three separate forwards.
    xs = mx.concatenate([block_inputs(emb, t, 5, 5) for t in (11, 12, 13)], axis=1)
    anchors3 = mx.array([[2, 6, 9]])
    mask3 = mx.arange(12)[None, None, :] < anchors3[..., None]
    together = model(xs, anchors3, kv, mask3)
    for b in range(3):
        alone = model(xs[:, b : b + 1], anchors3[:, b : b + 1], kv, mask3[:, b : b + 1])
        assert mx.allclose(together[0, b], alone[0, 0], atol=1e-5)
        sliced = [(k[..., : int(anchors3[0, b]), :], v[..., : int(anchors3[0, b]), :]) for k, v in kv]
        fast = model(xs[:, b : b + 1], anchors3[:, b : b + 1], sliced, None, fast=True)
        assert mx.allclose(together[0, b], fast[0, 0], atol=1e-4)


def test_training_slots_align_with_inference(heads):
    """Slot j of a training block at anchor p predicts x_{p+j+1}; its base logits equal the
    drafter's for the same anchor with context 0..p-1 (sample_from_anchor=True)."""
    model = tiny_net(seed=6, markov_rank=0, enable_confidence_head=False)
    emb, lm_head = heads
    ids = np.array([[3, 9, 27, 81 % V, 50, 60, 70, 80, 90, 11, 12, 13]], np.int32)
    hidden = mx.random.normal((1, 12, 2 * D), key=mx.random.key(5))
    anchors = np.array([[4, 7]], np.int32)
    labels = np.take_along_axis(ids[:, None], np.minimum(anchors[..., None] + 1 + np.arange(5), 11), 2)
    batch = Batch(ids, anchors, np.ones((1, 2), bool), labels, np.ones((1, 2, 5), np.float32))
    logits, conf = draft_pass(model, emb, lm_head, batch, hidden)
    assert conf is None and logits.shape == (1, 2, 5, V)
    for b, p in enumerate(anchors[0]):
        drafter = DSparkDrafter(model, emb, lm_head)
        out = drafter.propose(DraftContext(ids[0, : p + 1].tolist(), hidden[0, :p]), 5)
        assert out.tokens == mx.argmax(logits[0, b], axis=-1).tolist()


def test_markov_head_applies_left_to_right(heads):
    """With zero base logits and a Markov bias that maps prev -> (prev + 3) % V, the greedy
    drafts form the chain anchor+3, anchor+6, ...; sampled q rows use the drafted prev."""
    model = tiny_net(seed=7, markov_rank=V, enable_confidence_head=True)
    model.markov_head.markov_w1.weight = mx.eye(V)
    perm = (np.arange(V) + 3) % V
    w2 = np.zeros((V, V), np.float32)
    w2[perm, np.arange(V)] = 8.0  # bias[prev][perm[prev]] = 8
    model.markov_head.markov_w2.weight = mx.array(w2)
    zero_head = lambda h: mx.zeros((*h.shape[:-1], V))
    emb, _ = heads
    tokens = [1, 2, 40]
    hidden = mx.random.normal((2, 2 * D), key=mx.random.key(6))
    drafter = DSparkDrafter(model, emb, zero_head)
    out = drafter.propose(DraftContext(tokens, hidden), 5)
    assert out.tokens == [43, 46, 49, 52, 55]
    drafter.reset()
    sampled = drafter.propose(DraftContext(tokens, hidden, temperature=2.0, seed=11), 4)
    prevs = [40, *sampled.tokens[:-1]]
    expect = mx.softmax(mx.array(w2.T[prevs]) / 2.0, axis=-1)
    assert mx.allclose(sampled.draft_probs, expect, atol=1e-6)
    # Confidence uses [h_k ; W1[x_{k-1}]]: identical h, different prev -> different c_k.
    assert len(set(round(c, 6) for c in out.confidence)) > 1


def test_compiled_draft_step_matches_eager_and_reference_as_the_cache_grows(heads, monkeypatch):
    """The compiled step (static, padded, masked context buffers) drafts what the eager step and
    the from-scratch reference draft, through absorbs of 1..16 padded rows, a large unpadded one
    and three doublings of the cache; sampled drafts keep the same keys and q rows."""
    from drafters.dspark import drafter as drafter_mod

    monkeypatch.setattr(drafter_mod, "MIN_CAPACITY", 8)
    model = tiny_net(seed=9)
    emb, lm_head = heads
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, V, 80).tolist()
    hidden = mx.random.normal((80, 2 * D), key=mx.random.key(9))
    steps = {c: DraftStep(model, emb, lm_head, compiled=c) for c in (True, False)}
    drafters = {c: DSparkDrafter(model, emb, lm_head, steps[c]) for c in steps}
    cut, seen = 3, 0
    for grow in (1, 2, 5, 16, 3, 30):  # 30 rows: the unpadded path; capacity 8 -> 16 -> 32 -> 64
        cut += grow
        temperature = 0.0 if grow % 2 else 1.3
        ctx = DraftContext(tokens[: cut + 1], hidden[seen:cut], temperature=temperature, seed=grow)
        outs = {c: d.propose(ctx, 5) for c, d in drafters.items()}
        seen = cut
        ref = reference_draft(model, emb, lm_head, hidden[:cut], tokens[: cut + 1], 5, temperature, grow)
        for out in outs.values():
            assert out.tokens == ref[0].tolist()
            assert np.allclose(out.confidence, ref[2].tolist(), atol=1e-5)
            if temperature:
                assert mx.allclose(out.draft_probs, ref[1], atol=1e-5)
    assert drafters[True]._keys[0].shape[2] == 64 and drafters[True]._length == cut
    assert set(k[0] for k in steps[True]._fns) == {"absorb", "draft"}


def test_prefix_survival_is_cumulative_product():
    c = [0.9, 0.5, 0.8, 1.0, 0.1]
    assert np.allclose(prefix_survival(c), np.cumprod(c))
    assert prefix_survival([]) == []


def test_drafter_contract_and_determinism(heads):
    model = tiny_net(seed=8)
    emb, lm_head = heads
    tokens = list(range(10, 22))
    hidden = mx.random.normal((11, 2 * D), key=mx.random.key(8))
    d = DSparkDrafter(model, emb, lm_head)
    with pytest.raises(ValueError, match="anchor is at position 11"):
        d.propose(DraftContext(tokens, hidden[:9]), 5)
    runs = []
    for seed in (3, 3, 4):
        d = DSparkDrafter(model, emb, lm_head)
        d.on_commit(0, DraftContext(tokens[:6], hidden[:5]))  # rows may arrive in pieces
        runs.append(d.propose(DraftContext(tokens, hidden[5:], temperature=1.5, seed=seed), 3))
    assert runs[0].tokens == runs[1].tokens and mx.array_equal(runs[0].draft_probs, runs[1].draft_probs)
    assert runs[0].draft_probs.shape == (3, V) and runs[0].draft_probs.dtype == mx.float32
    assert np.allclose(runs[0].draft_probs.sum(axis=-1), 1.0, atol=1e-5)
    ref = reference_draft(model, emb, lm_head, hidden, tokens, 3, temperature=1.5, seed=4)
    assert ref[0].tolist() == runs[2].tokens and mx.allclose(ref[1], runs[2].draft_probs, atol=1e-5)
    assert DSparkDrafter(model, emb, lm_head).propose(DraftContext(tokens, hidden), 0).tokens == []


# ---- losses ---------------------------------------------------------------------------------


def test_loss_matches_hand_computation():
    draft = np.array([[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]], np.float32)  # [1 block, B=2, V=3]
    target = np.array([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]], np.float32)
    labels = np.array([[0, 2]])
    conf = np.array([[0.3, -1.2]], np.float32)
    mask = np.array([[1.0, 1.0]], np.float32)
    loss, m = dspark_loss(mx.array(draft), mx.array(conf), mx.array(target), mx.array(labels), mx.array(mask))
    p = np.exp(draft) / np.exp(draft).sum(-1, keepdims=True)
    w = np.exp(-np.arange(2) / 4.0)
    ce = -np.log(p[0, [0, 1], labels[0]])
    l1 = np.abs(p - target).sum(-1)[0]
    acc = np.clip(1 - 0.5 * l1, 0, 1)
    sig = 1 / (1 + np.exp(-conf[0]))
    bce = -(acc * np.log(sig) + (1 - acc) * np.log(1 - sig))
    expect = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / w.sum()
    assert math.isclose(loss.item(), expect, rel_tol=1e-5)
    assert math.isclose(m["tau"].item(), 1 + acc[0] + acc[0] * acc[1], rel_tol=1e-5)
    # A masked second label leaves only the first position's terms.
    loss1, _ = dspark_loss(mx.array(draft), mx.array(conf), mx.array(target), mx.array(labels),
                           mx.array([[1.0, 0.0]]))
    assert math.isclose(loss1.item(), 0.1 * ce[0] + 0.9 * l1[0] + bce[0], rel_tol=1e-5)


def test_batches_keep_labels_inside_the_response():
    rng = np.random.default_rng(0)
    tokens = list(range(100, 120))  # prompt 0..7, response 8..19
    batch = make_batch([(tokens, 8), (tokens[:12], 8)], block_size=4, num_anchors=16, rng=rng, pad_to=8)
    assert batch.ids.shape == (2, 24)
    for i, length in enumerate((20, 12)):
        kept = batch.anchors[i][batch.keep[i]]
        assert len(kept) == min(16, length - 8) and kept.min() >= 7 and kept.max() <= length - 2
        assert list(kept) == sorted(set(kept))
        for a, lab, em in zip(batch.anchors[i], batch.labels[i], batch.eval_mask[i]):
            n = int(em.sum())
            assert list(em) == [1.0] * n + [0.0] * (4 - n)  # a contiguous prefix
            if n:
                assert list(lab[:n]) == tokens[a + 1 : a + 1 + n] and a + n <= length - 1
    assert batch.eval_mask[1][~batch.keep[1]].sum() == 0


# ---- target taps, training, data ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    model, _ = tiny_model(layers=3, hidden=64)
    return model, TokenizerWrapper(byte_tokenizer(), eos_token_ids=[2])


def test_target_taps_match_the_model(tiny_target):
    model, _ = tiny_target
    taps = TargetTaps(model, [-1, 0, 1])
    ids = mx.array([[5, 9, 30, 31, 100]])
    final, hidden = taps.forward(ids)
    assert mx.array_equal(taps.lm_head(final), model(ids))
    assert hidden.shape == (1, 5, 3 * 64)
    assert hidden[0, 0].astype(mx.float32).nbytes == taps.row_bytes  # (the prefix cache's budgeting)
    assert mx.array_equal(hidden[..., :64], model.model.embed_tokens(ids))
    h0 = model.model.layers[0](model.model.embed_tokens(ids), "causal")
    assert mx.allclose(hidden[..., 64:128], h0, atol=1e-6)


def test_target_taps_refuse_a_forward_that_does_more(tmp_path):
    """A target whose forward scales its embeddings (as Gemma, Granite and MiniCPM do) would
    give other logits under DSpark's taps, and other KV to the prefix cache: refused, by the
    trainer too before it generates anything."""
    model, _ = tiny_model(layers=2, hidden=64)
    TargetTaps(model, [0, 1])  # (the plain model passes)

    class Scaled(type(model.model)):
        def __call__(self, inputs, cache=None, input_embeddings=None):
            return super().__call__(inputs, cache, self.embed_tokens(inputs) * 1.5)

    model.model.__class__ = Scaled
    with pytest.raises(ValueError, match="Scaled's differs"):
        TargetTaps(model, [0, 1])
    tok = TokenizerWrapper(byte_tokenizer(), eos_token_ids=[2])
    with pytest.raises(ValueError, match="Scaled's differs"):
        train_dspark(model, tok, tmp_path / "run", records=[], progress=False)  # (no prompts: fails fast either way)
    assert not (tmp_path / "run" / "data").exists()


def test_init_from_target_starts_from_the_last_layers(tiny_target):
    """``init="target"``: draft layer i is target layer n - L + i (projections, both norms; a
    quantized target's dequantized), the final norm is the target's, ``fc`` passes the deepest
    tap through, and the Markov head keeps its fresh weights."""
    model, tok = tiny_target
    arch = DraftArch(layers=2, target_layer_ids=[0, 1], block_size=4, markov_rank=16, mask_token_id=0,
                     init="target")
    quantized, _ = tiny_model(layers=3, hidden=64, seed=1)
    nn.quantize(quantized, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    for target in (model, quantized):
        net = train_dspark_new_model(target, tok, arch)
        inner = target.model
        for i, j in ((0, 1), (1, 2)):
            src, dst = inner.layers[j], net.layers[i]
            for group, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                 ("mlp", ("gate_proj", "up_proj", "down_proj"))):
                for name in names:
                    s_mod, d_mod = getattr(getattr(src, group), name), getattr(getattr(dst, group), name)
                    want = (mx.dequantize(s_mod.weight, s_mod.scales, s_mod.biases, group_size=32, bits=4)
                            if isinstance(s_mod, nn.QuantizedLinear) else s_mod.weight)
                    assert d_mod.weight.dtype == mx.float32 and mx.array_equal(d_mod.weight, want), (i, name)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                assert mx.array_equal(getattr(dst, norm).weight, getattr(src, norm).weight)
        assert mx.array_equal(net.norm.weight, inner.norm.weight)
        c = mx.random.normal((3, 2 * 64))
        assert mx.allclose(net.fc(c), c[:, 64:], atol=1e-6)
    copied = train_dspark_new_model(model, tok, arch)
    fresh = train_dspark_new_model(model, tok, DraftArch(layers=2, target_layer_ids=[0, 1], block_size=4,
                                                        markov_rank=16, mask_token_id=0))
    assert not mx.array_equal(fresh.layers[0].mlp.up_proj.weight, copied.layers[0].mlp.up_proj.weight)
    assert mx.array_equal(fresh.markov_head.markov_w1.weight, copied.markov_head.markov_w1.weight)
    with pytest.raises(ValueError, match="4 draft layers from a target of 3"):
        train_dspark_new_model(model, tok, DraftArch(layers=4, target_layer_ids=[0, 1], mask_token_id=0,
                                                     init="target"))
    with pytest.raises(ValueError, match="init='copy'"):
        train_dspark_new_model(model, tok, DraftArch(layers=2, target_layer_ids=[0, 1], mask_token_id=0, init="copy"))
    wide = train_dspark_new_model(model, tok, DraftArch(layers=1, target_layer_ids=[0, 1], mask_token_id=0))
    wide.layers[0].mlp.up_proj.weight = mx.zeros((7, 64))  # a shape the target's layer lacks
    with pytest.raises(ValueError, match="up_proj"):
        init_from_target(wide, model)


def test_init_from_a_saved_drafter_trains_it_further(tiny_target, tmp_path):
    """``init=<drafter dir>``: the saved drafter (4-bit here) in float32 with its own
    architecture (the arch's other fields ignored), its weights the file's dequantized ones;
    a drafter for another target, or a path that holds none, is refused."""
    model, tok = tiny_target
    start = train_dspark_new_model(model, tok, DraftArch(layers=2, target_layer_ids=[0, 1], block_size=4,
                                                         markov_rank=16, mask_token_id=0))
    saved = save_dspark(start, tmp_path / "q4", bits=4, group_size=32)
    want = load_dspark(saved, dequantize=True)
    net = train_dspark_new_model(model, tok, DraftArch(layers=1, block_size=7, markov_rank=64, init=str(saved)))
    assert net.config.to_dict() == want.config.to_dict() and net.config.num_hidden_layers == 2
    assert net.config.quantization is None and isinstance(net.layers[1].mlp.up_proj, nn.Linear)
    got, ref = dict(tree_flatten(net.parameters())), dict(tree_flatten(want.parameters()))
    assert got.keys() == ref.keys() == dict(tree_flatten(net.trainable_parameters())).keys()  # (none frozen)
    assert all(got[k].dtype == mx.float32 and mx.array_equal(got[k], ref[k]) for k in got)
    assert not mx.array_equal(got["layers.0.mlp.up_proj.weight"], start.layers[0].mlp.up_proj.weight)  # (4-bit)
    other, _ = tiny_model(layers=3, hidden=32, seed=1)
    with pytest.raises(ValueError, match="hidden 64; the target has vocab .* hidden 32"):
        train_dspark_new_model(other, tok, DraftArch(init=str(saved)))
    with pytest.raises(ValueError, match="a drafter directory"):
        train_dspark_new_model(model, tok, DraftArch(init=str(tmp_path)))
    deeper, _ = tiny_model(layers=5, hidden=64, seed=1)  # (same widths, taps in range: another target)
    with pytest.raises(ValueError, match="a target of 3 layers tapping .*the target has 5"):
        train_dspark_new_model(deeper, tok, DraftArch(init=str(saved)))
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "mask_token_id": 10**6}))
    with pytest.raises(ValueError, match="mask token 1000000 outside the vocabulary"):
        train_dspark_new_model(model, tok, DraftArch(init=str(saved)))
    with pytest.raises(ValueError, match="a drafter directory"):  # (before any data is generated)
        train_dspark(model, tok, tmp_path / "run", arch=DraftArch(init=str(tmp_path / "typo")), progress=False)
    assert not (tmp_path / "run").exists()


def test_init_from_a_saved_drafter_can_add_taps(tiny_target, tmp_path):
    """``init=<drafter dir>`` with ``target_layer_ids`` a superset of the drafter's taps (the
    "later tap" experiment without losing a trained drafter): ``fc`` gains zero columns at the
    new taps' places in layer order, so the block's logits equal the drafter's own; every other
    tensor is the file's; the new columns get gradient; dropping a tap is refused."""
    from drafters.dspark.train import widen_taps

    model, tok = tiny_target
    start = train_dspark_new_model(model, tok, DraftArch(layers=2, target_layer_ids=[0, 1], block_size=4,
                                                         markov_rank=16, mask_token_id=0))
    saved = save_dspark(start, tmp_path / "q4", bits=4, group_size=32)
    narrow = load_dspark(saved, dequantize=True)
    wide = train_dspark_new_model(model, tok, DraftArch(init=str(saved), target_layer_ids=[-1, 0, 1]))
    assert wide.config.target_layer_ids == [-1, 0, 1] and wide.config.num_hidden_layers == 2
    assert wide.fc.weight.shape == (64, 3 * 64)
    assert not wide.fc.weight[:, :64].any().item()  # (the embedding output comes first in layer order)
    assert mx.array_equal(wide.fc.weight[:, 64:], narrow.fc.weight)
    got, ref = dict(tree_flatten(wide.parameters())), dict(tree_flatten(narrow.parameters()))
    assert got.keys() == ref.keys()
    assert all(mx.array_equal(got[k], ref[k]) for k in got if k != "fc.weight")

    taps_wide, taps_narrow = TargetTaps(model, [-1, 0, 1]), TargetTaps(model, [0, 1])
    examples = [(list(range(3, 40)), 10), (list(range(5, 25)), 8)]
    batch = make_batch(examples, 4, 8, np.random.default_rng(0))
    ids = mx.array(batch.ids)
    (_, h_wide), (_, h_narrow) = taps_wide.forward(ids), taps_narrow.forward(ids)
    logits_wide, conf_wide = draft_pass(wide, taps_wide.embed, taps_wide.lm_head, batch, h_wide)
    logits_narrow, conf_narrow = draft_pass(narrow, taps_narrow.embed, taps_narrow.lm_head, batch, h_narrow)
    assert mx.allclose(logits_wide, logits_narrow, atol=1e-5, rtol=1e-5)
    assert mx.allclose(conf_wide, conf_narrow, atol=1e-6)

    def loss_fn(m, b, h, t):
        logits, conf = draft_pass(m, taps_wide.embed, taps_wide.lm_head, b, h)
        return dspark_loss(logits, conf, t, mx.array(b.labels), mx.array(b.eval_mask))

    _, _, grads = batch_gradients(nn.value_and_grad(wide, loss_fn), wide, taps_wide, batch, 1, 4.0)
    assert mx.abs(grads["fc"]["weight"][:, :64]).max().item() > 0  # (the new tap can learn)

    # a tap between two of the drafter's own: its zero block lands in the middle
    outer = save_dspark(train_dspark_new_model(model, tok, DraftArch(layers=1, target_layer_ids=[-1, 1], block_size=4,
                                                                     markov_rank=16, mask_token_id=0)),
                        tmp_path / "outer", bits=4, group_size=32)
    w_outer = load_dspark(outer, dequantize=True).fc.weight
    middle = train_dspark_new_model(model, tok, DraftArch(init=str(outer), target_layer_ids=[-1, 0, 1])).fc.weight
    assert mx.array_equal(middle[:, :64], w_outer[:, :64]) and mx.array_equal(middle[:, 128:], w_outer[:, 64:])
    assert not middle[:, 64:128].any().item()

    same = train_dspark_new_model(model, tok, DraftArch(init=str(saved), target_layer_ids=[0, 1]))
    assert same.config.target_layer_ids == [0, 1] and mx.array_equal(same.fc.weight, narrow.fc.weight)
    with pytest.raises(ValueError, match=r"leave out the drafter's taps \[0\]"):
        train_dspark_new_model(model, tok, DraftArch(init=str(saved), target_layer_ids=[-1, 1]))
    with pytest.raises(ValueError, match="reach layer 2"):  # (the last layer stays refused)
        train_dspark_new_model(model, tok, DraftArch(init=str(saved), target_layer_ids=[0, 1, 2]))
    with pytest.raises(ValueError, match="float drafter"):
        widen_taps(load_dspark(saved), [-1, 0, 1])


def train_dspark_new_model(target, tok, arch):
    from drafters.dspark.train import _new_model

    return _new_model(target, tok, arch, seed=0)


def test_micro_batches_give_the_whole_batch_gradient(tiny_target):
    """``batch_gradients`` over 2, 3 or 7 slices of a batch's sequences (uneven slices, more
    slices than sequences, a sequence with no labels, row-dependent losses so that a slice's
    weight matters) gives the one-pass loss, metrics and gradient."""
    from drafters.dspark.train import _new_model

    target, tok = tiny_target
    net = _new_model(target, tok, DraftArch(layers=1, target_layer_ids=[0, 1], block_size=4, markov_rank=16,
                                            mask_token_id=0), seed=1)
    taps = TargetTaps(target, net.config.target_layer_ids)
    examples = [(list(range(3, 40)), 10), (list(range(5, 25)), 8), (list(range(7, 70)), 20),
                (list(range(2, 15)), 15), (list(range(9, 50)), 30), (list(range(4, 90)), 5)]
    batch = make_batch(examples, 4, 16, np.random.default_rng(0))
    assert not batch.eval_mask[3].any()  # (the fourth has no response)

    def loss_fn(m, b, h, t):  # (logits scaled per sequence: slices' losses differ a lot)
        logits, conf = draft_pass(m, taps.embed, taps.lm_head, b, h)
        scale = mx.array(1.0 + 2.0 * ((b.ids[:, 0] + b.ids[:, 1]) % 7), mx.float32)  # (by content, not row)
        return dspark_loss(logits * scale[:, None, None, None], conf, t, mx.array(b.labels), mx.array(b.eval_mask))

    loss_and_grad = nn.value_and_grad(net, loss_fn)
    want_loss, want, want_grads = batch_gradients(loss_and_grad, net, taps, batch, 1, 4.0)
    mx.eval(want_loss, want, want_grads)
    for parts in (2, 3, 7):
        loss, metrics, grads = batch_gradients(loss_and_grad, net, taps, batch, parts, 4.0)
        assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
        for k in ("ce", "l1", "bce", "tau"):
            assert metrics[k].item() == pytest.approx(want[k].item(), rel=1e-5), k
        assert np.allclose(metrics["accept"], want["accept"], atol=1e-6)
        flat, want_flat = dict(tree_flatten(grads)), dict(tree_flatten(want_grads))
        assert flat.keys() == want_flat.keys()
        for k, g in want_flat.items():
            assert np.allclose(flat[k], g, rtol=1e-4, atol=1e-6 * float(mx.abs(g).max().item()) + 1e-9), k


@pytest.mark.parametrize("group_size", [32, 64])
def test_fake_quantizer_gives_the_exports_weights_with_straight_through_gradients(tmp_path, group_size):
    """``fake_quantizer`` (quantization-aware training): the float weights become exactly what
    the 4-bit float16 export loads as (group grid where the export has scales, float16 rounding
    elsewhere, the confidence head included); the gradient is the identity."""
    from drafters.dspark.train import fake_quantizer

    net = tiny_net(seed=8)
    saved = save_dspark(net, tmp_path / "q", bits=4, group_size=group_size, dtype="float16")
    want = dict(tree_flatten(load_dspark(saved, dequantize=True).parameters()))
    floats = dict(tree_flatten(net.parameters()))
    rounding = fake_quantizer(net, 4, group_size)
    got = rounding(floats)
    assert got.keys() == want.keys() == floats.keys()
    assert all(got[k].dtype == mx.float32 and mx.array_equal(got[k], want[k]) for k in got)
    on_grid = {k[: -len(".scales")] + ".weight" for k in mx.load(str(saved / "model.safetensors")) if k.endswith(".scales")}
    assert "fc.weight" in on_grid and not any(k.startswith("confidence_head") for k in on_grid)
    for k, w in floats.items():  # (a grid step, not a float16 ulp, where the export quantizes)
        moved = mx.abs(got[k] - w).max().item()
        assert (moved > 1e-3) == (k in on_grid), (k, moved)
    weights = {k: mx.random.normal(w.shape, key=mx.random.key(i)) for i, (k, w) in enumerate(floats.items())}
    grads = mx.grad(lambda p: sum((rounding(p)[k] * weights[k]).sum() for k in p))(floats)
    assert all(mx.array_equal(grads[k], weights[k]) for k in floats)


def test_quantization_aware_loss_is_the_exports_loss(tiny_target, tmp_path):
    """``quantization_aware``: the loss and gradient of the float drafter through the export's
    rounding are the exported drafter's own (dequantized); afterwards the drafter holds its
    float weights again, so the optimizer updates those."""
    from drafters.dspark.train import _new_model, fake_quantizer, quantization_aware

    target, tok = tiny_target
    net = _new_model(target, tok, DraftArch(layers=1, target_layer_ids=[0, 1], block_size=4, markov_rank=16,
                                            mask_token_id=0), seed=1)
    taps = TargetTaps(target, net.config.target_layer_ids)
    batch = make_batch([(list(range(3, 40)), 10), (list(range(5, 60)), 8)], 4, 16, np.random.default_rng(0))

    def loss_fn(m, b, h, t):
        logits, conf = draft_pass(m, taps.embed, taps.lm_head, b, h)
        return dspark_loss(logits, conf, t, mx.array(b.labels), mx.array(b.eval_mask))

    floats = {k: mx.array(v) for k, v in tree_flatten(net.parameters())}
    qat = nn.value_and_grad(net, quantization_aware(loss_fn, fake_quantizer(net, 4, 32)))
    loss, metrics, grads = batch_gradients(qat, net, taps, batch, 1, 4.0)
    assert all(mx.array_equal(v, floats[k]) for k, v in tree_flatten(net.parameters()))
    exported = load_dspark(save_dspark(net, tmp_path / "q4", bits=4, group_size=32, dtype="float16"), dequantize=True)
    want_loss, want, want_grads = batch_gradients(nn.value_and_grad(exported, loss_fn), exported, taps, batch, 1, 4.0)
    plain_loss, _, _ = batch_gradients(nn.value_and_grad(net, loss_fn), net, taps, batch, 1, 4.0)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6) and metrics["tau"].item() == want["tau"].item()
    assert abs(plain_loss.item() - want_loss.item()) > 1e-4  # (the rounding changes the loss: the test can tell)
    flat, want_flat = dict(tree_flatten(grads)), dict(tree_flatten(want_grads))
    assert flat.keys() == want_flat.keys()
    for k, g in want_flat.items():
        assert np.allclose(flat[k], g, rtol=1e-4, atol=1e-6 * float(mx.abs(g).max().item()) + 1e-9), k


def test_the_last_qat_steps_train_through_the_rounding(tiny_target, tmp_path):
    """``TrainConfig.qat_steps``: the run matches a plain one step for step until the last
    ``qat_steps`` (logged ``"qat": true``), whose losses are those of the export (on the
    configured grid) of the weights before the step; the checkpoints and the model keep float
    weights (off the grid), and a run resumed mid-QAT ends with the same weights."""
    from drafters.dspark.train import _new_model, make_optimizer

    target, tok = tiny_target
    arch = DraftArch(layers=1, target_layer_ids=[0, 1], block_size=4, markov_rank=16, mask_token_id=0)
    taps = TargetTaps(target, arch.target_layer_ids)
    examples = [(list(range(3, 40)), 10), (list(range(5, 60)), 8), (list(range(7, 30)), 4), (list(range(2, 50)), 20)]
    runs = {}
    for name, qat_steps in (("plain", 0), ("qat", 3)):
        cfg = TrainConfig(steps=6, batch_size=2, num_anchors=8, log_every=1, save_every=1, keep_checkpoints=6,
                          lr=3e-3, qat_steps=qat_steps, qat_group_size=32)
        net = _new_model(target, tok, arch, seed=1)
        (tmp_path / name).mkdir()
        rows, done = train_loop(net, make_optimizer(cfg), 0, taps, examples, cfg, tmp_path / name, False)
        runs[name] = (rows, net, cfg)
        assert done == 6
    plain, qat = runs["plain"][0], runs["qat"][0]
    assert [r.get("qat", False) for r in qat] == [False] * 3 + [True] * 3 and not any("qat" in r for r in plain)
    assert [r["loss"] for r in qat[:3]] == [r["loss"] for r in plain[:3]]
    assert all(abs(a["loss"] - b["loss"]) > 1e-5 for a, b in zip(qat[3:], plain[3:]))
    # the first QAT step's loss is the group-32 export's, of the weights after step 3, on step 4's batch
    rng = np.random.default_rng([0, 3])
    picks = rng.choice(len(examples), size=2, replace=False)
    batch = make_batch([examples[i] for i in picks], 4, 8, rng)
    ckpt = tmp_path / "qat" / "checkpoints" / "step-0000003"
    for group_size, same in ((32, True), (64, False)):
        exported = load_dspark(save_dspark(load_dspark(ckpt), tmp_path / f"e{group_size}", bits=4,
                                           group_size=group_size, dtype="float16"), dequantize=True)
        hidden, probs = target_pass(taps, batch, 4)
        logits, conf = draft_pass(exported, taps.embed, taps.lm_head, batch, hidden)
        loss, _ = dspark_loss(logits, conf, probs, mx.array(batch.labels), mx.array(batch.eval_mask))
        assert (loss.item() == pytest.approx(qat[3]["loss"], rel=1e-6)) == same, group_size
    net, cfg = runs["qat"][1], runs["qat"][2]
    floats = dict(tree_flatten(net.parameters()))
    grid = dict(tree_flatten(load_dspark(save_dspark(net, tmp_path / "end", bits=4, group_size=32, dtype="float16"),
                                         dequantize=True).parameters()))
    assert not mx.array_equal(floats["fc.weight"], grid["fc.weight"])  # (float master weights)
    # resume from step 4 (mid-QAT): the same weights at the end
    for late in ("step-0000005", "step-0000006"):
        shutil.rmtree(tmp_path / "qat" / "checkpoints" / late)
    again, opt, step = restore(latest_checkpoint(tmp_path / "qat"), cfg)
    assert step == 4
    rows, _ = train_loop(again, opt, step, taps, examples, cfg, tmp_path / "qat", False)
    assert [r["step"] for r in rows] == [5, 6] and all(r["qat"] for r in rows)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in qat[4:]], rel=1e-6)
    for k, v in tree_flatten(again.parameters()):
        assert mx.allclose(v, floats[k], atol=1e-6), k


def test_qat_checks_and_flags(tiny_target, tmp_path, monkeypatch):
    """``--qat-steps`` trains for the export's grid (``--export-bits``, ``--export-group-size``);
    QAT without an export, beyond the run's steps, or for another grid than the export's, and an
    export grid MLX cannot write, are refused before anything is generated."""
    import drafters.dspark.train as train_mod

    seen = []
    monkeypatch.setattr(train_mod, "train_dspark", lambda *a, **kw: seen.append(kw) or train_mod.RunResult(str(tmp_path), True, 0))
    loader = lambda spec, weights: tiny_target  # noqa: E731
    argv = ["--out", str(tmp_path), "--no-progress", "--qat-steps", "100"]
    assert train_mod.main(argv + ["--export-bits", "8", "--export-group-size", "32"], load_target=loader) == 0
    train = seen[0]["train"]
    assert (train.qat_steps, train.qat_bits, train.qat_group_size) == (100, 8, 32)
    assert (seen[0]["export_bits"], seen[0]["export_group_size"]) == (8, 32)
    assert train_mod.main(argv, load_target=loader) == 0
    assert (seen[1]["train"].qat_bits, seen[1]["train"].qat_group_size, seen[1]["export_group_size"]) == (4, 64, 64)
    for bad in (["--export-bits", "0"], ["--qat-steps", "-1"], ["--steps", "50"], ["--export-group-size", "16"],
                ["--export-bits", "7"]):
        with pytest.raises(SystemExit):
            train_mod.main(argv + bad, load_target=lambda *a: pytest.fail("the target loaded before the check"))
    assert len(seen) == 2
    monkeypatch.undo()
    monkeypatch.setattr(train_mod, "_load_or_generate", lambda *a, **k: pytest.fail("generation before the check"))
    model, tok = tiny_target
    for train, bits, group, match in (
            (TrainConfig(steps=10, qat_steps=11), 4, 64, "qat_steps must be in 0..steps"),
            (TrainConfig(steps=10, qat_steps=-1), 4, 64, "qat_steps must be in 0..steps"),
            (TrainConfig(steps=10, qat_steps=5, qat_bits=8), 4, 64, "8-bit groups of 64, but the export is 4-bit"),
            (TrainConfig(steps=10, qat_steps=5), 4, 32, "4-bit groups of 64, but the export is 4-bit groups of 32"),
            (TrainConfig(steps=10, qat_steps=5), None, 64, "there is none"),
            (TrainConfig(steps=10), 4, 16, "group size must be one of"),
            (TrainConfig(steps=10), 7, 64, "bits must be one of")):
        with pytest.raises(ValueError, match=match):
            train_dspark(model, tok, tmp_path / "run", train=train, export_bits=bits, export_group_size=group,
                         progress=False)
    assert not (tmp_path / "run").exists()


def test_qat_benchmark_scores_weight_batches_by_their_blocks(tiny_target):
    """``benchmarks.dspark_qat_cpu``: the held-out batches are fixed by the seed, and a score is
    the per-batch loss and tau weighted by each batch's kept blocks (a batch with more blocks
    counts more), the same numbers ``dspark_loss`` gives each batch."""
    from benchmarks.dspark_qat_cpu import held_out_batches, score
    from drafters.dspark.train import _new_model

    target, tok = tiny_target
    net = _new_model(target, tok, DraftArch(layers=1, target_layer_ids=[0, 1], block_size=4, markov_rank=16,
                                            mask_token_id=0), seed=1)
    taps = TargetTaps(target, net.config.target_layer_ids)
    examples = [(list(range(3, 40)), 10), (list(range(5, 60)), 8), (list(range(7, 12)), 4)]
    batches = held_out_batches(examples, 4, 2, 16, seed=3)
    again = held_out_batches(examples, 4, 2, 16, seed=3)
    assert len(batches) == 2 and all(np.array_equal(a.anchors, b.anchors) for a, b in zip(batches, again))
    targets = [target_pass(taps, b, 4) for b in batches]
    got = score(net, taps, batches, targets)
    parts = []
    for b, (h, t) in zip(batches, targets):
        logits, conf = draft_pass(net, taps.embed, taps.lm_head, b, h)
        loss, metrics = dspark_loss(logits, conf, t, mx.array(b.labels), mx.array(b.eval_mask))
        parts.append((float((b.eval_mask[..., 0] > 0).sum()), loss.item(), metrics["tau"].item()))
    blocks = [w for w, _, _ in parts]
    assert blocks[0] != blocks[1]  # (unequal weights: the weighting matters)
    assert got["loss"] == pytest.approx(sum(w * lo for w, lo, _ in parts) / sum(blocks), abs=1e-5)
    assert got["tau"] == pytest.approx(sum(w * ta for w, _, ta in parts) / sum(blocks), abs=1e-4)
    assert len(got["accept"]) == 4 and all(0 <= a <= 1 for a in got["accept"])


def test_reround_measures_moves_in_group_steps(tmp_path):
    """``benchmarks.dspark_reround``: exporting an export's dequantized weights again moves some
    values (MLX's affine grid is refit), by less than a step each, measured per quantized
    matrix in its own group steps; kinds drop the layer index."""
    from benchmarks.dspark_reround import kind, main, reround_moves

    src = save_dspark(tiny_net(seed=8), tmp_path / "q4", bits=4, group_size=32, dtype="float16")
    moves = reround_moves(src, 4, 32)
    quantized = {k[: -len(".scales")] for k in mx.load(str(src / "model.safetensors")) if k.endswith(".scales")}
    assert moves.keys() == quantized
    flat = np.concatenate([m.ravel() for m in moves.values()])
    assert 0 < (flat > 0.01).mean() < 0.5 and flat.max() < 1.0
    assert kind("layers.3.mlp.up_proj") == "mlp.up_proj" and kind("fc") == "fc"
    assert main([str(src), "--out", str(tmp_path / "r.json"), "--group-size", "32"]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["all"]["values"] == flat.size and report["all"]["max_steps"] == round(float(flat.max()), 3)
    with pytest.raises(ValueError, match="no quantized matrix"):
        reround_moves(save_dspark(tiny_net(seed=8), tmp_path / "plain"))


def test_micro_batches_flag():
    from drafters.dspark.train import build_parser

    assert build_parser().parse_args(["--out", "x", "--micro-batches", "3"]).micro_batches == 3
    assert build_parser().parse_args(["--out", "x"]).micro_batches == 1
    for bad in ("0", "-2", "abc"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--out", "x", "--micro-batches", bad])


def test_cli_passes_the_loss_weights_and_taps(tiny_target, tmp_path, monkeypatch):
    """``--ce-weight`` / ``--l1-weight`` reach the loss (TrainConfig) and ``--target-layer-ids``
    the architecture; without them the recipe's 0.1 / 0.9."""
    import drafters.dspark.train as train_mod

    seen = []
    monkeypatch.setattr(train_mod, "train_dspark", lambda *a, **kw: seen.append(kw) or train_mod.RunResult(str(tmp_path), True, 0))
    loader = lambda spec, weights: tiny_target  # noqa: E731
    argv = ["--out", str(tmp_path), "--no-progress"]
    assert train_mod.main(argv + ["--ce-weight", "0.5", "--l1-weight", "0.25", "--target-layer-ids=-1,1"],
                          load_target=loader) == 0
    assert (seen[0]["train"].ce_weight, seen[0]["train"].l1_weight) == (0.5, 0.25)
    assert seen[0]["arch"].target_layer_ids == [-1, 1]
    assert train_mod.main(argv, load_target=loader) == 0
    assert (seen[1]["train"].ce_weight, seen[1]["train"].l1_weight) == (0.1, 0.9)


def test_tiny_training_run_learns_checkpoints_and_resumes(tmp_path, tiny_target):
    model, tok = tiny_target
    records = instruction_prompts(16, seed=0)
    arch = DraftArch(layers=1, target_layer_ids=[0, 1], block_size=4, markov_rank=16, mask_token_id=0)
    data = DataConfig(max_new_tokens=24, temperature=1.0, gen_batch_size=16, shard_size=8)
    train = TrainConfig(steps=12, batch_size=4, num_anchors=16, save_every=6, log_every=1, lr=3e-3)
    kw = dict(arch=arch, data=data, train=train, eval_per_source=0, export_bits=None, progress=False)
    first = train_dspark(model, tok, tmp_path / "run", records=records, time_budget_s=1e-9, **kw)
    assert not first.completed and first.steps == 0  # out of time before the first shard
    run = train_dspark(model, tok, tmp_path / "run", **kw)  # picks the saved prompt set up
    assert run.completed and len(list((tmp_path / "run" / "data" / "shards").iterdir())) == 2
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 13))
    assert np.mean([r["loss"] for r in log[-3:]]) < 0.8 * log[0]["loss"]
    trained = load_dspark(run.drafter_dir)
    assert trained.config.target_layer_ids == [0, 1] and trained.config.num_target_layers == 3
    assert latest_checkpoint(tmp_path / "run").name == "step-0000012"
    # Drop the last checkpoint: a rerun resumes at step 6 and ends with the same weights.
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-0000012")
    rerun = train_dspark(model, tok, tmp_path / "run", **kw, draft_vocab_size=50)
    assert rerun.completed and rerun.final_metrics["step"] == 12
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert steps[12:] == list(range(7, 13))
    resumed = load_dspark(rerun.drafter_dir)
    for (_, a), (_, b) in zip(tree_flatten(trained.parameters()), tree_flatten(resumed.parameters())):
        assert mx.allclose(a, b, atol=1e-6)
    # ... and exports a draft vocabulary: the 50 tokens its training responses use most
    rows = [json.loads(line) for line in (tmp_path / "run" / "data" / "examples.jsonl").read_text().splitlines()]
    counts = np.bincount([t for r in rows if r["split"] == "train" for t in r["response"]],
                         minlength=model.args.vocab_size)
    assert trained.draft_vocab is None and resumed.draft_vocab.size == 50
    assert set(np.argsort(-counts, kind="stable")[:10].tolist()) <= set(resumed.draft_vocab.tolist())
    # A deadline already past: one more step, a checkpoint, then a clean stop.
    longer = TrainConfig(**{**train.__dict__, "steps": 20})
    net, opt, step = restore(latest_checkpoint(tmp_path / "run"), longer)
    taps = TargetTaps(model, net.config.target_layer_ids)
    examples = [(list(range(3, 40)), 10)]
    _, done = train_loop(net, opt, step, taps, examples, longer, tmp_path / "run", False, time.perf_counter())
    assert (step, done) == (12, 13) and latest_checkpoint(tmp_path / "run").name == "step-0000013"
    prompts = [tok.encode("hello there"), tok.encode("abc")]
    seen = []
    ev = evaluate_acceptance(taps, trained, prompts, [2], max_new_tokens=12,
                             on_cycle=lambda logits, drafts, a, conf: seen.append((logits.shape, len(drafts), a, conf)))
    assert 1.0 <= ev["mean_acceptance_length"] <= 5.0 and len(ev["acceptance_per_position"]) == 4
    assert math.isclose(ev["mean_acceptance_length"], ev["tokens"] / ev["cycles"])
    assert ev["tokens"] >= ev["cycles"] >= 2
    assert len(seen) == ev["cycles"] and sum(a + 1 for _, _, a, _ in seen) == ev["tokens"]
    assert all(shape == (n + 1, model.args.vocab_size) and 0 <= a <= n for shape, n, a, _ in seen)
    assert all(len(conf) == n and all(0.0 <= c <= 1.0 for c in conf) for _, n, _, conf in seen)
    # each prompt's first cycle apart from the others, as each prompt alone gives them
    alone = []
    for prompt in prompts:
        got = []
        one = evaluate_acceptance(taps, trained, [prompt], [2], max_new_tokens=12,
                                  on_cycle=lambda logits, drafts, a, conf, got=got: got.append(a))
        assert one["first_cycle_accepted"] == got[0] and len(got) >= 2
        assert math.isclose(one["later_cycle_accepted"], sum(got[1:]) / len(got[1:]), abs_tol=1e-4)
        alone.append(got)
    assert math.isclose(ev["first_cycle_accepted"], sum(g[0] for g in alone) / len(alone))
    later = [a for g in alone for a in g[1:]]
    assert math.isclose(ev["later_cycle_accepted"], sum(later) / len(later), abs_tol=1e-4)
    drafted = []  # the evaluation drafts from a drafter's draft vocabulary, as the engine does
    evaluate_acceptance(taps, resumed, prompts, [2], max_new_tokens=12,
                        on_cycle=lambda logits, drafts, a, conf: drafted.extend(drafts))
    assert drafted and set(drafted) <= set(resumed.draft_vocab.tolist())


def test_acceptance_by_target_confidence_bins():
    """``benchmarks.dspark_confidence.by_confidence``: shares and acceptance per ``p_top1`` bin,
    first slot apart, a probability of exactly 1 in the last bin."""
    from benchmarks.dspark_confidence import by_confidence

    slots = np.array([[0, 0.95, 1], [0, 0.2, 0], [1, 0.95, 0], [0, 1.0, 1], [1, 0.4, 1]])
    out = by_confidence(slots)
    first, every = out["first_slot"], out["all_slots"]
    assert (first["slots"], every["slots"]) == (3, 5)
    assert first["acceptance"] == pytest.approx(2 / 3, abs=1e-3) and every["acceptance"] == pytest.approx(3 / 5)
    assert [b["share"] for b in first["bins"]] == pytest.approx([1 / 3, 0, 0, 0, 2 / 3], abs=1e-3)
    assert [b["acceptance"] for b in first["bins"]] == [0.0, None, None, None, 1.0]
    assert [b["acceptance"] for b in every["bins"]] == [0.0, 1.0, None, None, pytest.approx(2 / 3, abs=1e-3)]


def test_confidence_head_calibration_per_slot():
    """``benchmarks.dspark_confidence.confidence_head``: mean ``prod_{i<=k} c_i`` per slot
    against the share of cycles with the first ``k`` drafts accepted; None without a head."""
    from benchmarks.dspark_confidence import confidence_head

    out = confidence_head([([0.5, 0.5, 1.0], 0), ([1.0, 0.8, 0.5], 2), ([0.9, 0.1, 0.2], 3)])
    assert out["predicted_prefix_survival"] == pytest.approx([0.8, 0.38, 0.223], abs=1e-3)
    assert out["realised_prefix_survival"] == pytest.approx([2 / 3, 2 / 3, 1 / 3], abs=1e-3)
    assert confidence_head([(None, 1)]) == {"predicted_prefix_survival": None, "realised_prefix_survival": None}


def test_prompt_sources_and_splits(tmp_path):
    inst = instruction_prompts(200, seed=1)
    assert inst == instruction_prompts(200, seed=1) and len({r.messages[0]["content"] for r in inst}) == 200
    whole = ("compare", "email")  # (held-out families; the rest are held out by a hash, ~10%)
    assert {r.id.split(":")[1] for r in inst} > set(whole)
    assert all(r.split == "eval" for r in inst if r.id.split(":")[1] in whole)
    others = [r for r in inst if r.id.split(":")[1] not in whole]
    hashed = [r for r in others if r.split == "eval"]
    assert 0.03 < len(hashed) / len(others) < 0.25 and all(r.split in ("train", "eval") for r in others)
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text("def f(x):\n    y = x + 1\n    z = y * 2\n    return z\n")
    code = code_prompts(3, root=str(tmp_path), eval_fraction=0.0)
    assert len(code) == 3 and all(r.split == "train" for r in code)
    he = humaneval_prompts()
    assert len(he) == 2 * 164 and all(r.split == "eval" for r in he)
    raw, chat = he[0::2], he[1::2]
    assert all(r.id.endswith(":raw") and "def " in r.text for r in raw)
    assert all(r.id.endswith(":chat") and r.messages[0]["content"].endswith(f"{p.text}```")
               for r, p in zip(chat, raw))


def test_code_prompts_from_extra_roots(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for i in range(4):
        (pkg / f"m{i}.py").write_text(f"def g{i}(x):\n    y = x - {i}\n    z = y * 3\n    return z\n")
    code = code_prompts(1000, root=str(tmp_path / "empty"), eval_fraction=0.0, extra_roots=(str(pkg),))
    assert sorted(r.id for r in code) == [f"code:pkg/m{i}.py:0" for i in range(4)]
    body = [r.text or r.messages[0]["content"] for r in code]
    assert all(any(f"def g{i}(x)" in b for b in body) for i in range(4))


def test_held_out_code_copied_into_training_files_is_dropped(tmp_path):
    """Files are split by a hash of their path; a held-out snippet whose code (whitespace
    aside) also sits in a training file is dropped, so eval prompts never reach training."""
    from drafters.dspark.data import _hashed_fraction

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    names = [f"f{i}.py" for i in range(40)]
    split = {n: _hashed_fraction(f"code:pkg/{n}") < 0.5 for n in names}  # True: held out
    shared = "def shared(x):\n    y = x + 1\n    z = y * 2\n    return z\n"
    for i, n in enumerate(names):
        own = f"def own{i}(x):\n    y = x - {i}\n    z = y * 3\n    return z\n"
        (pkg / n).write_text(own + "\n\n" + (shared if i % 2 else shared.replace("    ", "  ")))
    code = code_prompts(1000, root=str(tmp_path / "empty"), eval_fraction=0.5, extra_roots=(str(pkg),),
                        per_file=2)
    held = [r for r in code if r.split == "eval"]
    assert held and any(split.values()) and not all(split.values())
    assert all("shared" not in (r.text or r.messages[0]["content"]) for r in held)
    assert any("shared" in (r.text or r.messages[0]["content"]) for r in code if r.split == "train")
    assert len(held) == sum(split.values())  # each held-out file keeps its own snippet


def test_pre_query_prompt_is_the_template_up_to_user_content():
    tok = TokenizerWrapper(byte_tokenizer(), eos_token_ids=[2])
    prefix = pre_query_prompt(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=True)
    assert prefix and list(full[: len(prefix)]) == prefix
    assert tok.decode(list(full[len(prefix):])).startswith("hi there")


def test_self_instruct_keeps_finished_new_questions(tiny_target, monkeypatch, tmp_path):
    """Questions the target ended with EOS, of >= 3 words, first occurrence only, at most n; a
    hashed share and held-out-family look-alikes held out; a run cut by its deadline goes on
    from its batch log with the result of an uninterrupted run."""
    import drafters.dspark.train as train_mod
    from drafters.dspark.data import _hashed_fraction

    model, tok = tiny_target
    eos = 2

    def ids(text):
        return list(tok.encode(text, add_special_tokens=False))

    batches = [[ids("how do I sort a list") + [eos], ids("too short") + [eos], ids("no end in sight here"),
                ids("how do I sort a list") + [eos], []],
               [ids("what is a hash table") + [eos], ids("how do I sort a list") + [eos],
                ids("write an email to my boss") + [eos], ids("one more question here") + [eos], []]]
    calls = []

    def fake_generate(m, prompts, max_new, sampler, eos_ids):
        calls.append((prompts, max_new, eos_ids))
        return batches[(len(calls) - 1) % 2][: len(prompts)]

    monkeypatch.setattr(train_mod, "_generate_batch", fake_generate)
    cfg = DataConfig(n_self_instruct=3, gen_batch_size=5, eval_fraction=0.5)
    recs = self_instruct_prompts(model, tok, cfg, progress=False)
    texts = ["how do I sort a list", "what is a hash table", "write an email to my boss"]
    assert [r.messages[0]["content"] for r in recs] == texts and len(calls) == 2
    assert [r.id for r in recs] == ["self_instruct:0", "self_instruct:1", "self_instruct:2"]
    assert calls[0][0] == [pre_query_prompt(tok)] * 5 and calls[0][1] == cfg.self_instruct_max_tokens
    for r, text in zip(recs, texts):
        held = "email" in text or _hashed_fraction("self_instruct:" + text) < 0.5
        assert r.split == ("eval" if held else "train") and r.source == "self_instruct"
    assert recs[2].split == "eval"  # an email: a held-out family
    # A deadline after the first batch, then a rerun from the log: same records, no batch redone.
    log_path = tmp_path / "self_instruct.jsonl"
    calls.clear()
    monkeypatch.setattr(train_mod.time, "perf_counter", lambda: 10.0 if calls else 0.0)
    assert self_instruct_prompts(model, tok, cfg, progress=False, deadline=5.0, log_path=log_path) is None
    assert len(calls) == 1 and len(log_path.read_text().splitlines()) == 1
    resumed = self_instruct_prompts(model, tok, cfg, progress=False, log_path=log_path)
    assert len(calls) == 2 and [(r.id, r.split, r.messages) for r in resumed] == [
        (r.id, r.split, r.messages) for r in recs]


def test_self_instruct_batches_are_seeded(tiny_target):
    """Real sampled batches: the same seed gives the same questions, batch by batch."""
    model, tok = tiny_target
    cfg = DataConfig(n_self_instruct=64, gen_batch_size=8, self_instruct_max_tokens=12,
                     self_instruct_top_p=1.0)
    import drafters.dspark.train as train_mod

    original = train_mod._generate_batch
    outs: list[list] = [[], []]
    for seen in outs:
        def spy(*a, _seen=seen, **k):
            out = original(*a, **k)
            _seen.append(out)
            return out

        train_mod._generate_batch = spy
        try:
            self_instruct_prompts(model, tok, cfg, progress=False)
        finally:
            train_mod._generate_batch = original
    assert outs[0] == outs[1] and len(outs[0]) == 32  # ceil(4 * 64 / 8) batches: few questions end
    assert outs[0][0] != outs[0][1]  # each batch has its own seed


def test_default_mask_token():
    tok = TokenizerWrapper(byte_tokenizer(), eos_token_ids=[2])
    with pytest.raises(ValueError, match="mask_token_id"):
        default_mask_token_id(tok)


def test_batched_generation_equals_one_prompt_greedy(tiny_target):
    """Left-padded batches of mixed lengths produce each prompt's own greedy continuation,
    cut after the first EOS (mlx-lm's generate_step, one prompt at a time, is the reference)."""
    from mlx_lm.generate import generate_step

    model, tok = tiny_target
    records = [PromptRecord(f"r{i}", "instruct", "train", text=t) for i, t in enumerate(
        ["ab", "hello there", "The quick brown fox jumps", "x" * 40, "def f(x):\n    return", "zz"])]
    data = DataConfig(max_new_tokens=20, gen_batch_size=4)
    rows = generate_examples(model, tok, records, data, progress=False)
    assert [r["id"] for r in rows] == [r.id for r in records]
    for row in rows:
        ref = []
        for token, _ in generate_step(mx.array(row["prompt"]), model, max_tokens=20):
            ref.append(int(token))
            if token == 2:
                break
        assert row["response"] == ref
    assert generate_examples(model, tok, records, data, progress=False, deadline=0.0) is None
    # EOS cuts: make a token some rows emit mid-stream the EOS; those rows end right after it,
    # the others run to max_new_tokens.
    free = {i: r["response"] for i, r in enumerate(rows)}
    eos = free[1][5]
    expect = {i: (r[: r.index(eos) + 1] if eos in r else r) for i, r in free.items()}
    assert any(len(e) < 20 for e in expect.values()) and any(len(e) == 20 for e in expect.values())
    tok_eos = TokenizerWrapper(tok._tokenizer, eos_token_ids=[eos])
    cut = generate_examples(model, tok_eos, records, data, progress=False)
    assert [r["response"] for r in cut] == [expect[i] for i in range(len(rows))]


def test_teacher_forced_positions_agree_with_the_decoding_loop(tiny_target):
    """``benchmarks.dspark_positions``: on the target's own greedy continuation every data token
    is the target's argmax, blocks past the end score zero, the cycles a greedy decoding loop
    would run over the teacher-forced rows are those of ``evaluate_acceptance``, the soft tau is
    the trainer's, and on the drafter's own drafts the Markov head sees what inference feeds it."""
    from benchmarks.dspark_positions import acceptance_summary, block_scores, positions_batch

    model, tok = tiny_target
    arch = DraftArch(layers=2, target_layer_ids=[0, 1], block_size=4, markov_rank=16, mask_token_id=0,
                     init="target")
    net = train_dspark_new_model(model, tok, arch)
    taps = TargetTaps(model, net.config.target_layer_ids)
    prompt = tok.encode("hello there")
    tokens = list(prompt)
    for _ in range(24):
        tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1])))
    response = tokens[len(prompt):]
    scores = block_scores(taps, net, prompt, response)
    greedy = scores["greedy"]
    assert greedy.shape == scores["soft"].shape == scores["draft"].shape == (24, 4)
    assert scores["data_match"].all()
    assert (greedy[-1, 1:] == 0).all() and (scores["soft"][-1, 1:] == 0).all()
    assert ((scores["soft"] >= 0) & (scores["soft"] <= 1)).all()
    # Replay the decoding loop on the rows: each cycle's anchor is the last committed token.
    pos, lengths, per_position = 0, [], np.zeros(4)
    while pos < 16:
        run = np.cumprod(greedy[pos])
        per_position += run
        lengths.append(int(run.sum()) + 1)
        pos += lengths[-1]
    assert sum(lengths) > len(lengths)  # some drafts are accepted: the comparison has teeth
    loop = evaluate_acceptance(taps, net, [prompt], [], max_new_tokens=16)
    assert loop["cycles"] == len(lengths) and loop["tokens"] == sum(lengths)
    assert loop["acceptance_per_position"] == (per_position / len(lengths)).round(4).tolist()
    # The soft tau over every position is the trainer's logged tau on the same batch.
    batch = positions_batch(prompt, response, 4)
    hidden, target_probs = target_pass(taps, batch, 4)
    logits, conf = draft_pass(net, taps.embed, taps.lm_head, batch, hidden)
    _, metrics = dspark_loss(logits, conf, target_probs, mx.array(batch.labels), mx.array(batch.eval_mask))
    assert acceptance_summary(scores["soft"], greedy)["tau_soft"] == pytest.approx(metrics["tau"].item(), abs=1e-3)
    # With a Markov head strong enough to steer the drafts, teacher-forcing the drafter's own
    # drafts reproduces them slot for slot; other data tokens change the later slots.
    w1, w2 = net.markov_head.markov_w1.weight, net.markov_head.markov_w2.weight
    net.markov_head.markov_w1.weight = mx.random.normal(w1.shape, key=mx.random.key(11))
    net.markov_head.markov_w2.weight = 3.0 * mx.random.normal(w2.shape, key=mx.random.key(12))
    final, hidden_rows = taps.forward(mx.array([prompt]))
    drafts = DSparkDrafter(net, taps.embed, taps.lm_head).propose(DraftContext(prompt, hidden_rows[0, :-1]), 4).tokens
    assert len(drafts) == 4 and len(set(drafts)) > 1
    assert block_scores(taps, net, prompt, drafts)["draft"][0].tolist() == drafts
    other = [(t + 1) % 256 for t in drafts]
    assert block_scores(taps, net, prompt, other)["draft"][0, 1:].tolist() != drafts[1:]
    with pytest.raises(ValueError, match="non-empty"):
        positions_batch([], response, 4)
    hand = acceptance_summary(np.array([[1.0, 0.5, 0.0], [0.2, 1.0, 1.0]]), np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]))
    assert hand == {"blocks": 2, "tau_soft": round((2.5 + 1.6) / 2, 3), "tau_greedy": 2.0, "first_slot": 0.5}


def test_eval_result_keeps_its_run_sets_for_a_later_evaluation(tmp_path):
    """``benchmarks.dspark_eval``: run sets take the first held-out prompts per source (template
    instructions: per family in turn); a result keeps their prompts (``_setup.run_records``)
    and ``saved_run_sets`` reads back the same records and new tokens, without the run's prompt
    file; a result without them is refused."""
    from benchmarks.dspark_eval import run_prompt_sets, saved_run_sets, setup_record
    from drafters.dspark.data import PromptRecord

    rows = [PromptRecord("code:a.py:0", "code", "eval", text="def f(x):\n    return x\n"),
            PromptRecord("code:b.py:0", "code", "train", text="import os\n"),
            PromptRecord("instruct:math:3", "instruct", "eval", messages=[{"role": "user", "content": "2+2?"}]),
            PromptRecord("instruct:math:4", "instruct", "eval", messages=[{"role": "user", "content": "3+3?"}])]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in rows))
    run = run_prompt_sets(str(prompts), per_source=1)
    assert {k: [r.id for r in v[0]] for k, v in run.items()} == {"run_code": ["code:a.py:0"],
                                                                 "run_instruct": ["instruct:math:3"]}
    # template instructions: one per training family in turn; held-out families stay out
    more = rows + [PromptRecord("instruct:email:5", "instruct", "eval", messages=[{"role": "user", "content": "e"}]),
                   PromptRecord("instruct:explain:6", "instruct", "eval", messages=[{"role": "user", "content": "x"}])]
    prompts.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in more))
    assert [r.id for r in run_prompt_sets(str(prompts), per_source=3)["run_instruct"][0]] == [
        "instruct:math:3", "instruct:explain:6", "instruct:math:4"]
    fixed = {"fixed": ([rows[1]], 64)}
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"_setup": setup_record("tiny", {**fixed, **run}, run)}))
    assert saved_run_sets(str(result)) == run
    result.write_text(json.dumps({"_setup": setup_record("tiny", fixed, {})}))
    with pytest.raises(ValueError, match="keeps no run sets"):
        saved_run_sets(str(result))


def test_dspark_eval_workload_sets_are_the_benchmark_prompts(tiny):
    """``--workloads``: a workload's non-session prompts, encoded as ``bench_speculative``
    sends them, with its max_tokens; a workload of sessions only gives no set."""
    from benchmarks.bench_speculative import load_workloads, prompt_tokens
    from benchmarks.dspark_eval import workload_prompt_sets

    got = workload_prompt_sets(tiny.tokenizer, ["novel_code", "novel_chat", "agent_session"])
    assert set(got) == {"wl_novel_code", "wl_novel_chat"}
    for w in load_workloads(["novel_code", "novel_chat"]):
        prompts, n = got[f"wl_{w['name']}"]
        assert n == w["max_tokens"] and prompts == [prompt_tokens(tiny.tokenizer, p) for p in w["prompts"]]
