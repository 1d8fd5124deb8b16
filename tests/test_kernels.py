"""Small-batch quantized matmul kernels (metal_kernels/): dispatch, patching, correctness.

CPU tier (CI): dispatch decisions, the reference path, patching a tiny quantized Llama,
and (where nvcc exists) that every CUDA kernel family compiles for sm_90 without spills.
GPU tier (``-m gpu``; benchmarks/kernel_check.py runs it on the H200): agreement with
``mx.quantized_matmul`` over M = 1..16, shapes, bits, group sizes and dtypes; row
exactness (row i of an M-row call == the 1-row call, bit for bit); a patched model.
This file must not rely on tests/conftest.py (kernel_check runs it with --noconftest).
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from metal_kernels import (
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    SiblingGroup,
    backend,
    patch_model,
    plan,
    qmv,
    quantized_matmul,
    sibling_matmul,
    swap_layers,
    unpatch_model,
)
from metal_kernels.cuda_source import MLX_PRELUDE, ptxas_usage, render_qmv

ON_GPU = backend() != "cpu"
needs_gpu = pytest.mark.skipif(
    not ON_GPU, reason="needs an MLX GPU backend (Metal or CUDA); this MLX runs on the CPU only")
cpu_only = pytest.mark.skipif(ON_GPU, reason="checks the CPU backend's behaviour")
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
# Relative to max|reference|; the reference is float64 numpy on the same quantized weights. fp16/bf16 outputs
# carry one output rounding plus the weights dequantized to fp16/bf16 (mma kernel).
TOL = {mx.float32: 1e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}
# (N, K): K-chunk counts that split unevenly over warps, a single chunk (one warp, no
# shared-memory reduction) and N not a multiple of 32.
SHAPES = [(256, 1024), (208, 640), (64, 128)]


def _quantized(n, k, gs, bits, wdtype, seed):
    mx.random.seed(seed)
    w = mx.random.normal((n, k)).astype(wdtype)
    return mx.quantize(w, group_size=gs, bits=bits)


def _reference(x, wq, s, b, gs, bits):
    """float64 numpy: unpack the words (LSB first), dequantize, x @ W.T. Independent of
    MLX's own quantized matmul (whose CUDA path returned zeros for K == group size == 128)."""
    q = np.array(wq).astype(np.uint64)
    per = 32 // bits
    vals = np.stack([(q >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], -1)
    vals = vals.reshape(q.shape[0], -1).astype(np.float64)
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    w = np.repeat(f64(s), gs, 1) * vals + np.repeat(f64(b), gs, 1)
    return f64(x) @ w.T


def _tiny_llama(bits=4, gs=32, embed_bits=8, dtype=mx.float32, seed=0):
    """A 2-layer GQA Llama (tied embeddings), quantized like the default model."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=384, rope_theta=10000.0, tie_word_embeddings=True)
    model = llama.Model(args)
    model.set_dtype(dtype)
    nn.quantize(model, class_predicate=lambda _, m: (
        {"group_size": gs, "bits": embed_bits} if isinstance(m, nn.Embedding)
        else {"group_size": gs, "bits": bits} if isinstance(m, nn.Linear) else False))
    mx.eval(model.parameters())
    return model


# ---------------------------------------------------------------- CPU: dispatch decisions


def test_plan_cpu_backend_uses_reference():
    for m in range(0, 18):
        assert plan(m, 256, 1024, 4, 64, mx.float16, "cpu") is None


@pytest.mark.parametrize("be,dtype,n,kind", [
    ("cuda", mx.float16, 256, "mma"), ("cuda", mx.bfloat16, 4096, "mma"),
    ("cuda", mx.float32, 256, "simd"), ("cuda", mx.float16, 200, "simd"),
    ("metal", mx.float16, 256, "simd"), ("metal", mx.bfloat16, 200, "simd"),
    ("metal", mx.float32, 256, "simd")])
def test_plan_kernel_choice(be, dtype, n, kind):
    for m in range(1, 17):
        p = plan(m, n, 1024, 4, 64, dtype, be)
        assert p is not None and p.kind == kind and p.backend == be


@pytest.mark.parametrize("m,bits,gs,k,dtype", [
    (0, 4, 64, 1024, mx.float16), (17, 4, 64, 1024, mx.float16), (64, 8, 32, 1024, mx.float32),
    (1, 3, 64, 1024, mx.float16), (1, 6, 64, 1024, mx.float16), (1, 4, 16, 1024, mx.float16),
    (1, 4, 128, 1000, mx.float16), (1, 4, 64, 1024, mx.int32)])
def test_plan_unsupported_goes_to_reference(m, bits, gs, k, dtype):
    for be in ("cuda", "metal"):
        assert plan(m, 256, k, bits, gs, dtype, be) is None


@pytest.mark.parametrize("n,k,bits", [(4096, 4096, 4), (1024, 4096, 4), (14336, 4096, 4),
                                      (4096, 14336, 4), (128256, 4096, 4), (576, 576, 4),
                                      (192, 576, 4), (49152, 576, 8), (208, 640, 8)])
def test_reduction_order_does_not_depend_on_rows(n, k, bits):
    """Row exactness needs the K split (chunk width, warps per block) fixed by the shape."""
    plans = [plan(m, n, k, bits, 32, mx.float16, "cuda") for m in range(1, 17)]
    assert len({p.k_split for p in plans}) == 1
    assert [p.const("MB") for p in plans] == [8] * 8 + [16] * 8
    for p in plans:
        chunk = 4 * p.const("VW") * 32 // bits
        assert k % chunk == 0 and p.const("WK") <= k // chunk
        assert p.grid[0] % p.threadgroup[0] == 0
        assert (p.grid[0] // p.threadgroup[0]) * 16 * p.const("NT") == n
        assert qmv.mma_config_fits(p.const("NT"), p.const("U"), p.const("MB"), p.const("WK"))
    simd = [plan(m, n, k, bits, 32, mx.float32, "cuda") for m in range(1, 17)]
    assert len({(p.const("R"), p.const("NSG"), p.grid) for p in simd}) == 1
    assert all(p.const("MB") >= m for m, p in enumerate(simd, 1))


def test_one_row_plan_over_long_k_takes_one_tile_per_warp():
    """One row of 4-bit weights over K >= 4096 and N <= 16384 gets twice the blocks (NT = 1,
    faster on the H200 at 14336x4096); more rows keep two tiles per warp; the K split, hence
    every row's bits, is the same."""
    plans = [plan(m, 14336, 4096, 4, 64, mx.bfloat16, "cuda") for m in (1, 2, 8, 16)]
    assert [p.const("NT") for p in plans] == [1, 2, 2, 2]
    assert len({p.k_split for p in plans}) == 1
    assert plans[0].grid[0] == 2 * plans[1].grid[0]

    def one(n, k, bits=4):
        return plan(1, n, k, bits, 64, mx.bfloat16, "cuda").const("NT")

    assert one(14336, 2048) == 2  # short K
    assert one(16384, 4096) == 1 and one(16416, 4096) == 2  # N up to 16384 (wider: not timed)
    assert one(14336, 4096, bits=8) == 2  # 8-bit weights: not timed
    try:  # an override for the 8-row bucket still decides one row too
        qmv.set_mma_config(14336, 4096, 4, nt_u={8: (2, 1)})
        assert one(14336, 4096) == 2
    finally:
        qmv.clear_mma_config()


def test_sixteen_row_bucket_takes_two_tiles_from_n_4096():
    """NT = 2 in the 16-row bucket from N = 4096 (faster on the H200 at 16 rows) and in the
    8-row bucket from N = 6144 (the 8B q/k/v launch, faster on the H100 at 8 rows), one tile
    at 1..8 rows at N = 4096, at one row up to N = 16384 and below N = 4096 at every row count;
    the K split, hence the bits, is shared."""
    def nt(m, n, k=4096):
        return plan(m, n, k, 4, 64, mx.bfloat16, "cuda").const("NT")

    assert [nt(m, 4096) for m in (1, 2, 8, 9, 16)] == [1, 1, 1, 2, 2]
    assert [nt(m, 6144) for m in (1, 2, 8, 16)] == [1, 2, 2, 2]
    # one row outside the one-row forms (8-bit, K < 4096) keeps one tile below N = 8192
    assert [plan(1, 6144, k, b, 64, mx.bfloat16, "cuda").const("NT") for k, b in ((4096, 8), (2560, 4))] == [1, 1]
    assert plan(1, 8192, 2560, 4, 64, mx.bfloat16, "cuda").const("NT") == 2
    assert len({plan(m, 6144, 4096, 4, 64, mx.bfloat16, "cuda").k_split for m in range(1, 17)}) == 1
    assert [nt(m, 4096, 14336) for m in (8, 16)] == [1, 2]
    assert [nt(m, 2048) for m in (8, 16)] == [1, 1]
    assert [nt(m, 4112) for m in (8, 16)] == [1, 1]  # N not a multiple of 32
    assert len({plan(m, 4096, 4096, 4, 64, mx.bfloat16, "cuda").k_split for m in range(1, 17)}) == 1


def test_row_count_is_a_compile_time_constant_for_one_row_launches():
    """MR (the row count fixed at compile time) is 1 for one-row launches and 0 (read from x's
    shape) for 2..16 rows, unless path "fixed_rows" says otherwise; it and the loop options
    leave the K split alone, and the loop options need the compile-time-shape loop."""
    plans = {m: plan(m, 4096, 4096, 4, 64, mx.bfloat16, "cuda") for m in (1, 2, 8, 9, 16)}
    assert {m: p.const("MR") for m, p in plans.items()} == {1: 1, 2: 0, 8: 0, 9: 0, 16: 0}
    assert len({p.k_split for p in plans.values()}) == 1
    assert all(p.const("LP") == 0 for p in plans.values())
    # (one row's default launch shuffles its activations and unrolls its loop on this shape:
    # _one_row_launch)
    assert {m: p.const("XS") for m, p in plans.items()} == {1: 1, 2: 0, 8: 0, 9: 0, 16: 0}
    assert {m: p.const("FU") for m, p in plans.items()} == {1: 1, **{m: int(qmv.UNROLL) for m in (2, 8, 9, 16)}}
    try:
        qmv.set_mma_config(4096, 4096, 4, path={8: {"fixed_rows": True, "unroll": True},
                                                16: {"fixed_rows": False, "const_shape": False,
                                                     "unroll": True}})
        p3, p1, p12 = (plan(m, 4096, 4096, 4, 64, mx.bfloat16, "cuda") for m in (3, 1, 12))
        assert (p3.const("MR"), p1.const("MR"), p12.const("MR")) == (3, 1, 0)
        assert {p.k_split for p in (p3, p1, p12)} == {plans[1].k_split}
        assert (p3.const("FU"), p3.const("LP")) == (1, 0)
        # the runtime-shape loop has no unrolled or prefetch-hinted form
        assert (p12.const("KC"), p12.const("FU"), p12.const("LP")) == (0, 0, 0)
        # shuffled activations: one fixed row of the 8-row bucket, compile-time-shape loop only
        qmv.set_mma_config(4096, 4096, 4, path={8: {"x_shuffle": True}, 16: {"x_shuffle": True}})
        assert [plan(m, 4096, 4096, 4, 64, mx.bfloat16, "cuda").const("XS") for m in (1, 2, 16)] == [1, 0, 0]
        qmv.set_mma_config(4096, 4096, 4, path={8: {"x_shuffle": True, "const_shape": False}})
        assert plan(1, 4096, 4096, 4, 64, mx.bfloat16, "cuda").const("XS") == 0
        qmv.set_mma_config(4096, 4096, 4, path={8: {"l2_prefetch": 256}, 16: {"l2_prefetch": 32}})
        assert plan(1, 4096, 4096, 4, 64, mx.bfloat16, "cuda").const("LP") == 256
        with pytest.raises(ValueError, match="l2_prefetch=32"):
            plan(16, 4096, 4096, 4, 64, mx.bfloat16, "cuda")
    finally:
        qmv.clear_mma_config()


def test_one_row_launch_forms_follow_the_shape():
    """One-row launches of 4-bit weights over K >= 4096 take the launch form measured fastest
    for their shape (shuffled activations and the loop unrolled; two chunks in flight under launch
    bounds, with late activations or shuffled ones and an L2 hint); other row counts, 8 bits, short K, untimed
    widths and benchmark overrides keep theirs."""
    def form(m, n, k, bits=4):
        p = plan(m, n, k, bits, 64, mx.bfloat16, "cuda")
        return (p.const("U"), p.const("XS"), p.const("XL"), p.const("LP"), p.min_blocks, p.const("NT"), p.const("FU"))

    assert form(1, 4096, 4096) == (1, 1, 0, 0, 0, 1, 1)
    assert form(1, 4096, 14336) == (2, 0, 1, 0, 2, 1, 0)
    assert form(1, 14336, 4096) == (2, 1, 0, 256, 2, 1, 0)
    plain = (1, 0, 0, 0, 0, 1, 0)
    assert form(1, 6144, 4096) == form(1, 2048, 2048) == form(1, 4096, 576) == plain
    assert form(1, 4096, 4096, 8) == plain
    assert form(1, 28672, 4096)[:5] == (1, 0, 0, 0, 0)  # wider than 16384: two tiles, as before
    assert form(2, 4096, 4096) == plain
    assert form(8, 14336, 4096)[:5] == plain[:5]  # (NT 2 from N = 8192 at 2..16 rows)
    assert form(1, 2048, 4096) == form(1, 6144, 14336) == form(1, 8192, 14336) == plain  # (untimed)
    assert form(1, 8192, 4096) == form(1, 16384, 4096) == (2, 1, 0, 256, 2, 1, 0)
    generation = qmv.config_generation()
    try:  # a benchmark's override replaces the form, and the switch turns the forms off
        qmv.set_mma_config(4096, 4096, 4, nt_u={8: (1, 1)})
        assert form(1, 4096, 4096) == plain
        qmv.clear_mma_config()
        qmv.set_one_row_forms(False)
        assert form(1, 14336, 4096) == plain and qmv.config_generation() > generation
    finally:
        qmv.set_one_row_forms(True)
        qmv.clear_mma_config()
    assert form(1, 14336, 4096) == (2, 1, 0, 256, 2, 1, 0)


def test_run_plan_refuses_a_fixed_row_count_with_other_rows():
    p = plan(1, 256, 1024, 4, 64, mx.float16, "cuda")
    wq, s, b = _quantized(256, 1024, 64, 4, mx.float16, seed=5)
    with pytest.raises(ValueError, match="compiled for 1 rows; x has 2"):
        qmv.run_plan(p, mx.zeros((2, 1024), dtype=mx.float16), wq, s, b)


def test_set_mma_config_keeps_split_shared_across_rows():
    try:
        qmv.set_mma_config(256, 1024, 4, wk=2, nt_u={8: (2, 1), 16: (1, 2)})
        p8, p16 = (plan(m, 256, 1024, 4, 64, mx.float16, "cuda") for m in (3, 12))
        assert p8.k_split == p16.k_split == (("VW", 4), ("WK", 2))
        assert (p8.const("NT"), p8.const("U"), p16.const("NT"), p16.const("U")) == (2, 1, 1, 2)
    finally:
        qmv.clear_mma_config()
    assert plan(3, 256, 1024, 4, 64, mx.float16, "cuda").const("WK") != 2


def test_multi_row_only_override_keeps_the_one_row_launch():
    """An 8-row-bucket override marked multi_row_only changes the 2..8-row launches and leaves
    the one-row launch form (here the shuffled-activation one of 4096x4096) as it was."""
    shape = (4096, 4096, 4, 64, mx.bfloat16, "cuda")
    default = {m: plan(m, *shape) for m in (1, 2, 8, 16)}
    try:
        qmv.set_mma_config(4096, 4096, 4, nt_u={8: (2, 2)},
                           path={8: {"xl": True, "min_blocks": 2, "multi_row_only": True}})
        got = {m: plan(m, *shape) for m in (1, 2, 8, 16)}
        assert got[1] == default[1] and got[1].const("XS") == 1
        assert got[16] == default[16]
        for m in (2, 8):
            assert (got[m].const("NT"), got[m].const("U"), got[m].const("XL"), got[m].min_blocks) == (2, 2, 1, 2)
            assert got[m].k_split == default[1].k_split
        # without the mark the same override replaces the one-row form too
        qmv.set_mma_config(4096, 4096, 4, path={8: {"xl": True, "min_blocks": 2}})
        assert plan(1, *shape).const("XS") == 0 and plan(1, *shape).const("U") == 2
    finally:
        qmv.clear_mma_config()


# ---------------------------------------------------------------- CPU: reference path


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (2, 3, 256), (40, 256)])
def test_dispatcher_on_cpu_is_the_reference(bits, gs, shape):
    wq, s, b = _quantized(96, 256, gs, bits, mx.float32, seed=1)
    x = mx.random.normal(shape)
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    for kernels in ("auto", "off"):
        y = quantized_matmul(x, wq, s, b, group_size=gs, bits=bits, kernels=kernels)
        assert y.shape == (*shape[:-1], 96) and mx.array_equal(y, ref)


def test_dispatcher_falls_back_for_other_layouts():
    x = mx.random.normal((2, 128))
    wq, s, b = _quantized(32, 128, 64, 3, mx.float32, seed=2)  # 3-bit: no kernel
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=3)
    assert mx.array_equal(quantized_matmul(x, wq, s, b, group_size=64, bits=3), ref)
    wq, s = mx.quantize(mx.random.normal((32, 128)), mode="mxfp4")  # no biases
    ref = mx.quantized_matmul(x, wq, s, transpose=True, mode="mxfp4")
    y = quantized_matmul(x, wq, s, None, group_size=32, bits=4, mode="mxfp4")
    assert mx.array_equal(y, ref)
    with pytest.raises(ValueError, match="kernels"):
        quantized_matmul(x, wq, s, None, kernels="on")


# ---------------------------------------------------------------- CPU: patching


@cpu_only
def test_patch_model_modes_on_cpu():
    model = _tiny_llama()
    for mode in ("auto", "off"):
        report = patch_model(model, mode)
        assert not report.patched and not report.enabled and report.backend == "cpu"
        assert "not patched" in report.summary() and report.reason in report.summary()
    assert type(model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding
    with pytest.raises(ValueError, match="kernel mode"):
        patch_model(model, "fast")


def test_swap_layers_keeps_cpu_forward_identical():
    model = _tiny_llama()
    tokens = mx.array([[3, 17, 250, 9, 44, 101, 7]])
    before = model(tokens)
    report = swap_layers(model)
    # 2 layers x 7 projections + the tied 8-bit embedding (used via as_linear).
    assert len(report.patched) == 15 and not report.skipped
    assert isinstance(model.layers[1].mlp.down_proj, KernelQuantizedLinear)
    assert isinstance(model.model.embed_tokens, KernelQuantizedEmbedding)
    # q/k/v and gate/up of both layers share one concatenated weight; each member's own
    # weight is a row slice of it, with the values it had
    assert report.sibling_groups == 4
    attn = model.layers[0].self_attn
    group, index = attn.k_proj.__dict__["_ssk_sibling"]
    assert isinstance(group, SiblingGroup) and index == 1 and group.cuts == (256, 384)
    assert mx.array_equal(group.weight[256:384], attn.k_proj["weight"])
    after = model(tokens)
    assert mx.array_equal(before, after)
    again = swap_layers(model)  # idempotent
    assert len(again.patched) == 15 and again.sibling_groups == 4
    assert attn.k_proj.__dict__["_ssk_sibling"][0] is group
    assert unpatch_model(model) == 15
    assert type(model.model.embed_tokens) is nn.QuantizedEmbedding
    assert "_ssk_sibling" not in attn.q_proj.__dict__
    assert mx.array_equal(model(tokens), before)


def _fake_cuda(monkeypatch):
    """Pretend the backend is CUDA; every "kernel" computes the reference product (split at
    the sibling cuts for the multi-output variant). Returns the list of launches made."""
    launches = []

    def make(kind, be, nout=1, bounds=None, const_shape=False, extras=False):
        def fake_kernel(*, inputs, template, output_shapes, output_dtypes, **_):
            x, w, s, b = inputs
            t = dict(template)
            launches.append((kind, nout, x.size // x.shape[-1]))
            gs = x.shape[-1] // s.shape[1]
            y = qmv.reference_matmul(x, w, s, b, gs, t["BITS"])
            if nout == 1:
                return [y.reshape(output_shapes[0])]
            cuts = [t[f"S{i}"] for i in range(1, nout)]
            return list(mx.split(y, cuts, axis=-1))
        return fake_kernel

    monkeypatch.setattr(qmv, "backend", lambda: "cuda")
    monkeypatch.setattr(qmv, "_gpu_backend", lambda: "cuda")
    monkeypatch.setattr(qmv, "_kernel", make)
    monkeypatch.setattr("metal_kernels.patch.backend", lambda: "cuda")
    qmv.clear_mma_config()  # (empties the plan and launch caches)
    return launches


def test_sibling_groups_launch_once_per_input(monkeypatch):
    """With the (faked) mma kernel, q/k/v and gate/up each cost one launch, for decode and
    verify widths alike; more than 16 rows go to the reference per projection."""
    model = _tiny_llama(dtype=mx.float16)
    tokens = mx.array([[3, 17, 250, 9, 44, 101, 7]])
    before = model(tokens[:, :1])
    launches = _fake_cuda(monkeypatch)
    try:
        report = swap_layers(model)
        assert report.sibling_groups == 4
        one = model(tokens[:, :1])
        # per layer: q/k/v, o, gate/up, down; then the tied LM head
        assert [(k, n) for k, n, _ in launches] == [("mma", 3), ("mma", 1), ("mma", 2), ("mma", 1)] * 2 + [
            ("mma", 1)]
        assert mx.allclose(one, before, rtol=1e-2, atol=1e-2)
        launches.clear()
        model(tokens)  # 7 rows: the same launches
        assert len(launches) == 9 and {r for _, _, r in launches} == {7}
        launches.clear()
        model(mx.zeros((1, 20), dtype=mx.int32))  # 20 rows: the reference, no launch
        assert launches == []
        # a member called on its own input (not after its siblings) computes itself
        x = mx.random.normal((1, 2, 256)).astype(mx.float16)
        launches.clear()
        k = model.layers[1].self_attn.k_proj(x)
        assert k.shape == (1, 2, 128) and launches == [("mma", 3, 2)]
        assert mx.allclose(k, qmv.reference_matmul(x, *(model.layers[1].self_attn.k_proj[n] for n in (
            "weight", "scales", "biases")), 32, 4), rtol=1e-3, atol=1e-3)
    finally:
        unpatch_model(model)
        qmv.clear_mma_config()


def test_sibling_group_recovers_from_a_failed_launch_and_dissolves_on_new_weights(monkeypatch):
    """A launch that raises leaves no stale outputs behind; replacing a member's weights makes
    every member compute alone (with its new weights) for every row count."""
    model = _tiny_llama(dtype=mx.float16)
    launches = _fake_cuda(monkeypatch)
    try:
        swap_layers(model)
        attn = model.layers[0].self_attn
        ref = lambda lin, x: qmv.reference_matmul(  # noqa: E731
            x, lin["weight"], lin["scales"], lin["biases"], 32, 4)
        x_old, x_new = (mx.random.normal((1, 1, 256)).astype(mx.float16) for _ in range(2))
        attn.q_proj(x_old)  # the group now holds x_old's outputs, k and v not yet taken
        real = qmv.run_sibling_launch

        def broken(*a, **k):
            raise RuntimeError("launch failed")
        monkeypatch.setattr("metal_kernels.patch.run_sibling_launch", broken)
        with pytest.raises(RuntimeError):
            attn.q_proj(x_new)
        monkeypatch.setattr("metal_kernels.patch.run_sibling_launch", real)
        assert mx.array_equal(attn.k_proj(x_new), ref(attn.k_proj, x_new))
        group = attn.q_proj.__dict__["_ssk_sibling"][0]
        assert not group.dissolved
        attn.v_proj.update({"scales": attn.v_proj["scales"] * 2})
        launches.clear()
        for rows in (1, 5):
            x = mx.random.normal((1, rows, 256)).astype(mx.float16)
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
                assert mx.array_equal(lin(x), ref(lin, x))
        assert group.dissolved and {n for _, n, _ in launches} == {1} and len(launches) == 6
    finally:
        unpatch_model(model)
        qmv.clear_mma_config()


@pytest.fixture
def clean_launch_caches():
    """Empty the plan/launch caches and mma overrides before and after (a test that fakes the
    kernels must not leave fake launches cached for the next one)."""
    qmv.clear_mma_config()
    yield
    qmv.clear_mma_config()


def test_sibling_launcher_declines_what_it_cannot_fuse(monkeypatch, clean_launch_caches):
    monkeypatch.setattr(qmv, "_kernel",
                        lambda kind, be, nout=1, bounds=None, const_shape=False, extras=False: (kind, nout))
    sig = (4, 512, 256, 32, (512, 8), (512, 8), mx.float16, mx.uint32, mx.float16, mx.float16, 4, 32)
    kernel, template, *_ = qmv.sibling_launcher(*sig, "cuda", (256, 384))
    assert kernel == ("mma", 3) and template[-2:] == [("S1", 256), ("S2", 384)]
    # a cut inside a 16-row block is fine (the store picks the output per element), and the
    # decision is the same for every row count 1..16 (decode and verify take one path)
    assert qmv.sibling_launcher(*sig, "cuda", (256, 392)) is not None
    qmv.set_mma_config(512, 256, 4, nt_u={16: (2, 1)})
    for cuts in ((256, 384), (248, 392), (16,)):
        assert {qmv.sibling_launcher(m, *sig[1:], "cuda", cuts) is None for m in range(1, 17)} == {False}
    assert qmv.sibling_launcher(*sig, "cuda", (0, 384)) is None
    assert qmv.sibling_launcher(*sig, "cuda", (384, 256)) is None  # not increasing
    assert qmv.sibling_launcher(*sig, "cuda", (128, 256, 384)) is None  # at most 3 projections
    assert qmv.sibling_launcher(*sig, "cpu", (256, 384)) is None
    fp32 = sig[:6] + (mx.float32,) + sig[7:]
    assert qmv.sibling_launcher(*fp32, "cuda", (256, 384)) is None  # simd kernel: no variant
    assert qmv.sibling_launcher(*((17,) + sig[1:]), "cuda", (256, 384)) is None
    with pytest.raises(ValueError, match="mma"):
        qmv.kernel_sources("simd", "cuda", nout=2)


def test_layer_launch_decision_is_cached_and_invalidated(monkeypatch):
    """A patched layer plans once per (rows, dtype, backend) and re-plans when its arrays change.

    The CUDA backend is faked: the "kernel" computes the reference product, so the test
    checks the dispatch and its cache, not the CUDA code (the GPU tests do that).
    """
    launches, plans = [], []

    def fake_kernel(*, inputs, output_shapes, output_dtypes, **_):
        x, w, s, b = inputs
        launches.append(x.shape[0])
        return [qmv.reference_matmul(x, w, s, b, 32, 4)]

    real_launcher = qmv._launcher.__wrapped__

    def counting_launcher(*args):
        plans.append(args[0])
        return real_launcher(*args)

    monkeypatch.setattr(qmv, "backend", lambda: "cuda")
    monkeypatch.setattr(qmv, "_kernel",
                        lambda kind, be, nout=1, bounds=None, const_shape=False, extras=False: fake_kernel)
    monkeypatch.setattr(qmv, "_launcher", counting_launcher)
    layer = nn.QuantizedLinear(64, 48, bias=False, group_size=32, bits=4)
    swap_layers(layer)
    for rows in (1, 1, 3, 1, 17):
        x = mx.random.normal((rows, 64)).astype(mx.float16)
        ref = qmv.reference_matmul(x, layer["weight"], layer["scales"], layer["biases"], 32, 4)
        assert mx.array_equal(layer(x), ref)
    assert plans == [1, 3, 17]  # one plan per row count; 17 rows go to the reference
    assert launches == [1, 1, 3, 1]
    layer.update({"scales": layer["scales"] * 2})
    layer(mx.random.normal((1, 64)).astype(mx.float16))
    assert plans == [1, 3, 17, 1]


def test_swap_layers_skips_unsupported():
    model = _tiny_llama(bits=3, gs=64, embed_bits=6)
    report = swap_layers(model)
    assert not report.patched and len(report.skipped) == 15
    assert {why for _, why in report.skipped} == {"3-bit", "6-bit"}
    assert type(model.layers[0].mlp.up_proj) is nn.QuantizedLinear


# ---------------------------------------------------------------- CPU: CUDA sources compile

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (CUDA toolkit absent)")
def test_cuda_kernels_compile_for_sm90_without_spills(tmp_path):
    cases = []
    for xdt, sdt in ((mx.float16, mx.float16), (mx.bfloat16, mx.bfloat16), (mx.float16, mx.float32),
                     (mx.float32, mx.float32), (mx.float32, mx.bfloat16)):
        for bits in (4, 8):
            for m, n, k in ((1, 4096, 4096), (16, 14336, 4096), (12, 6144, 4096), (9, 576, 576), (4, 208, 640),
                            (1, 14336, 4096), (1, 4096, 14336)):  # (one-row launch forms)
                cases.append((plan(m, n, k, bits, 32, xdt, "cuda"), xdt, sdt))
    # the vocabulary-wide LM head's 2..8-row form (two chunks in flight under launch bounds)
    cases.append((plan(8, 128256, 4096, 4, 64, mx.bfloat16, "cuda"), mx.bfloat16, mx.bfloat16))
    assert (cases[-1][0].const("U"), cases[-1][0].min_blocks) == (2, 2)
    try:  # the compile-time-shape loop: both row buckets, 4/8 bits, XL, launch bounds
        for bits in (4, 8):
            for k, mb, ntu, opts in ((4096, 8, (2, 2), {"const_shape": True, "exact": True}),
                                     (14336, 16, (2, 2), {"const_shape": True, "xl": True, "exact": True}),
                                     (4096, 8, (1, 2), {"const_shape": True, "xl": True, "min_blocks": 2}),
                                     (4096, 8, (1, 2), {"const_shape": True, "unroll": True,
                                                        "fixed_rows": True, "exact": True, "l2_prefetch": 256}),
                                     (576, 16, (1, 1), {"const_shape": True, "unroll": True})):
                qmv.set_mma_config(4096, k, bits, nt_u={mb: ntu}, path={mb: opts})
                cases.append((plan(mb - 1, 4096, k, bits, 64, mx.bfloat16, "cuda"), mx.bfloat16, mx.bfloat16))
                p = cases[-1][0]
                assert (p.const("KC"), p.const("NT"), p.const("U")) == (k, *ntu), p
                assert p.const("FU") == int(opts.get("unroll", False))
                assert p.const("MR") == (mb - 1 if opts.get("fixed_rows") else 0), p
                assert p.const("LP") == opts.get("l2_prefetch", 0), p
                qmv.clear_mma_config()
        # one row's activations shuffled: K 4096, 576, 544 (VW 4/2/1 at 4 bits, 4/4/2 at 8), two
        # chunks in flight under launch bounds, and one without (the H200's fastest one-row
        # launch on 4096x4096, twenty-seventh session)
        for bits in (4, 8):
            for k in (4096, 576, 544):
                for ntu, opts in (((1, 2), {"x_shuffle": True, "min_blocks": 2, "exact": True}),
                                  ((1, 1), {"x_shuffle": True})):
                    qmv.set_mma_config(4096, k, bits, nt_u={8: ntu}, path={8: opts})
                    cases.append((plan(1, 4096, k, bits, 32, mx.float16, "cuda"), mx.float16, mx.float16))
                    assert cases[-1][0].const("XS") == 1 and cases[-1][0].const("U") == ntu[1], cases[-1][0]
                    qmv.clear_mma_config()
        for kc in (True, False):  # one warp on K (no shared-memory sum) with the row count fixed
            qmv.set_mma_config(256, 1024, 4, wk=1, path={8: {"const_shape": kc}, 16: {"fixed_rows": True}})
            for m in (1, 13):
                cases.append((plan(m, 256, 1024, 4, 64, mx.float16, "cuda"), mx.float16, mx.float16))
                assert cases[-1][0].const("WK") == 1 and cases[-1][0].const("MR") == m
            qmv.clear_mma_config()
    finally:
        qmv.clear_mma_config()
    # Two translation units: kernels built without mma_extras.cuh must compile without its
    # definitions (NVRTC, like ptxas_usage's nvcc flags, rejects an inline function referenced
    # and not defined; one unit with an extras kernel in it would hide that).
    srcs = {False: MLX_PRELUDE, True: MLX_PRELUDE}
    for i, (p, x, s) in enumerate(cases):
        srcs[p.source_options()[2]] += render_qmv(p, x, s, f"k{i}")
    assert srcs[True] != MLX_PRELUDE
    # sibling variants: 8B q/k/v (4096 + 1024 + 1024; 1, 8 (two tiles) and 16 rows) and gate/up
    # (2 x 14336; 1 and 16 rows)
    sibs = ((1, 6144, (4096, 5120)), (8, 6144, (4096, 5120)), (16, 6144, (4096, 5120)),
            (1, 28672, (14336,)), (16, 28672, (14336,)))
    for i, (m, n, cuts) in enumerate(sibs):
        p = plan(m, n, 4096, 4, 64, mx.bfloat16, "cuda")
        srcs[False] += render_qmv(p, mx.bfloat16, mx.bfloat16, f"sib{i}", cuts)
        cases.append((p, mx.bfloat16, mx.bfloat16))
    assert cases[-4][0].const("NT") == 2
    usage = {**ptxas_usage(srcs[False]), **ptxas_usage(srcs[True])}
    assert {p.kind for p, _, _ in cases} == {"mma", "simd"}
    names = [f"k{i}" for i in range(len(cases) - len(sibs))] + [f"sib{i}" for i in range(len(sibs))]
    assert sorted(usage) == sorted(names)
    for name, (p, _, _) in zip(names, cases):
        u = usage[name]
        assert u["stack_frame"] == 0 and u["spill_stores"] == 0 and u["spill_loads"] == 0, (name, p, u)
        # launchable: the block's registers fit a multiprocessor's 64K (min_blocks of them; launch
        # bounds make ptxas fit them); without bounds a margin for NVRTC against this nvcc: the
        # H200 refused a 512-thread block this nvcc counted at 128 registers
        assert qmv.registers_fit(u["registers"], p.threadgroup[0], p.min_blocks), (name, p, u)


# ---------------------------------------------------------------- GPU: correctness


def _check_grid(bits, gs, xdt, sdt, shapes=SHAPES):
    for n, k in shapes:
        if k % gs:
            continue
        wq, s, b = _quantized(n, k, gs, bits, sdt, seed=n + k + bits)
        x = mx.random.normal((16, k)).astype(xdt)
        ref = _reference(x, wq, s, b, gs, bits)
        scale = np.abs(ref).max()
        assert scale > 0
        for m in range(1, 17):
            p = plan(m, n, k, bits, gs, xdt)
            assert p is not None
            y = qmv.run_plan(p, x[:m], wq, s, b, init_value=float("nan"))
            assert y.dtype == xdt and y.shape == (m, n)
            yf = np.array(y.astype(mx.float32), dtype=np.float64)
            assert not np.isnan(yf).any(), f"unwritten outputs: {p}"
            err = np.abs(yf - ref[:m]).max() / scale
            assert err < TOL[xdt], f"M={m} N={n} K={k} err={err:.2e} {p}"
            assert np.allclose(yf, ref[:m], rtol=TOL[xdt], atol=TOL[xdt] * scale)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.gpu
@needs_gpu
def test_kernel_matches_reference(bits, gs, dtype):
    dt = DTYPES[dtype]
    _check_grid(bits, gs, dt, dt)


@pytest.mark.parametrize("xdt,sdt", [("float16", "float32"), ("bfloat16", "float32"),
                                     ("float32", "float16")])
@pytest.mark.gpu
@needs_gpu
def test_kernel_matches_reference_mixed_scale_dtype(xdt, sdt):
    _check_grid(4, 32, DTYPES[xdt], DTYPES[sdt], SHAPES[:1])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.gpu
@needs_gpu
def test_rows_bit_identical_for_every_m(bits, gs, dtype):
    dt = DTYPES[dtype]
    for n, k in SHAPES:
        if k % gs:
            continue
        wq, s, b = _quantized(n, k, gs, bits, dt, seed=7 * n + k)
        x = mx.random.normal((16, k)).astype(dt)
        full = quantized_matmul(x, wq, s, b, group_size=gs, bits=bits)
        mx.eval(full)
        for m in range(1, 16):
            part = quantized_matmul(x[:m], wq, s, b, group_size=gs, bits=bits)
            assert mx.array_equal(part, full[:m]).item(), f"M={m} N={n} K={k}"
        for i in range(16):
            one = quantized_matmul(x[i:i + 1], wq, s, b, group_size=gs, bits=bits)
            assert mx.array_equal(one[0], full[i]).item(), f"row {i} N={n} K={k}"


@pytest.mark.gpu
@needs_gpu
def test_tiles_and_prefetch_do_not_change_bits():
    """NT (tiles per warp) and U (chunks in flight) must not touch any row's arithmetic."""
    n, k, gs = 256, 1024, 64
    wq, s, b = _quantized(n, k, gs, 4, mx.float16, seed=3)
    x = mx.random.normal((16, k)).astype(mx.float16)
    outs = []
    try:
        for nt, u in ((1, 1), (2, 2), (1, 4)):
            qmv.set_mma_config(n, k, 4, wk=4, nt_u={8: (nt, u), 16: (nt, u)})
            outs.append([quantized_matmul(x[:m], wq, s, b, group_size=gs, bits=4)
                         for m in (1, 8, 16)])
    finally:
        qmv.clear_mma_config()
    for o in outs[1:]:
        assert all(mx.array_equal(a, c).item() for a, c in zip(outs[0], o))


CONST_SHAPE_CASES = [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,gs", CONST_SHAPE_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="the compile-time-shape loop is the CUDA mma kernel's")
def test_const_shape_paths_give_the_runtime_loops_bits(bits, gs, dtype):
    """K as a compile-time constant (addresses as immediates), activations loaded late (XL),
    launch bounds, the loop unrolled and the row count as a
    compile-time constant (one-row launches by default, every row count in one combo) and an
    L2 prefetch-size hint on the weight loads, and one row's activations shuffled between lanes
    instead of held by row 0's lanes, change how a launch is built, not its
    arithmetic: each row bucket gives the bits of the runtime-shape loop with the row count
    read from x (NaN-filled outputs catch unwritten elements). Each case runs the default
    launch, three of the next five combinations in rotation over the ten cases (each in six of
    them; on the H200 a case took ~78 s, mostly NVRTC compiles, when it ran every combination)
    and the shuffled activations at one row, with U = 2 under launch bounds, with U = 1, and
    with U = 1 and the loop unrolled (every case: VW 1/2/4, 4 and 8 bits, both dtypes)."""
    dt = DTYPES[dtype]
    # ("exact": the plan keeps NT and U as given instead of fitting them to its register rule)
    # (NT, U) per row bucket (8, 16): (2, 2) without XL takes 128 registers at 16 rows, which
    # the H200 refused to launch in blocks of 512 threads
    combos = [({"const_shape": True}, (1, 1), (1, 1)),
              ({"const_shape": True, "exact": True}, (2, 2), (1, 2)),
              ({"const_shape": True, "xl": True, "exact": True}, (2, 2), (2, 2)),
              ({"const_shape": True, "xl": True, "min_blocks": 2}, (1, 2), (1, 2)),
              ({"const_shape": True, "unroll": True, "fixed_rows": True, "exact": True},
               (1, 2), (2, 1)),
              ({"const_shape": True, "l2_prefetch": 128}, (1, 1), (1, 1)),
              # one row's activations held two registers per lane and shuffled (one-row launches):
              # every case (all VW, bits, groups and dtypes), one row only; two chunks in flight
              # under launch bounds, and one chunk without them
              ({"const_shape": True, "x_shuffle": True, "min_blocks": 2, "exact": True}, (1, 2), (1, 1)),
              ({"const_shape": True, "x_shuffle": True}, (1, 1), (1, 1)),
              # and unrolled (the one-row default on 4096x4096 since the forty-fifth session)
              ({"const_shape": True, "x_shuffle": True, "unroll": True}, (1, 1), (1, 1))]
    case = 2 * CONST_SHAPE_CASES.index((bits, gs)) + (dtype == "bfloat16")
    combos = [combos[0]] + [combos[1 + (case + i) % 5] for i in (0, 1, 2)] + combos[6:]
    rows = (1, 3, 8, 9, 16)  # both row buckets, full and partial
    # K = 1024 / 4096: 4 words per thread and row per chunk (VW 4); 576: VW 2 at 4 bits;
    # 544: VW 1 at 4 bits, 2 at 8 bits
    for n, k in ((256, 1024), (4096, 4096), (128, 576), (64, 544)):
        if k % gs:
            continue
        wq, s, b = _quantized(n, k, gs, bits, dt, seed=3 * n + k)
        x = mx.random.normal((16, k)).astype(dt)
        try:  # the runtime-shape loop's bits
            runtime = {"const_shape": False, "fixed_rows": False}
            qmv.set_mma_config(n, k, bits, path={8: runtime, 16: runtime})
            assert plan(1, n, k, bits, gs, dt).const("KC") == plan(1, n, k, bits, gs, dt).const("MR") == 0
            base = {m: quantized_matmul(x[:m], wq, s, b, group_size=gs, bits=bits) for m in rows}
        finally:
            qmv.clear_mma_config()
        for opts, ntu8, ntu16 in combos:
            try:
                qmv.set_mma_config(n, k, bits, nt_u={8: ntu8, 16: ntu16}, path={8: opts, 16: opts})
                p = plan(16, n, k, bits, gs, dt)
                if (4 * p.const("VW") * 32 // bits) % gs:  # a chunk splits a group: runtime loop
                    assert p.const("KC") == 0
                    continue
                assert p.const("KC") == k and p.const("XL") == int(opts.get("xl", False))
                assert p.min_blocks == opts.get("min_blocks", 0)
                assert p.const("FU") == int(opts.get("unroll", False))
                assert (p.const("NT"), p.const("U")) == (ntu16[0] if n % (16 * ntu16[0]) == 0 else 1, ntu16[1])
                assert p.const("LP") == opts.get("l2_prefetch", 0)
                assert p.const("XS") == 0  # (16 rows: never shuffled)
                assert plan(1, n, k, bits, gs, dt).const("XS") == int(opts.get("x_shuffle", False))
                for m in (1,) if opts.get("x_shuffle") else rows:
                    y = qmv.run_plan(plan(m, n, k, bits, gs, dt), x[:m], wq, s, b, init_value=float("nan"))
                    assert mx.array_equal(y, base[m]).item(), (opts, ntu8, ntu16, m, n, k)
            finally:
                qmv.clear_mma_config()


def test_vocabulary_wide_lm_head_takes_two_chunks_in_flight_at_2_to_8_rows():
    """A 4-bit LM head of N >= 65536 and K >= 4096 (the 8B stack's 128256x4096) launches 2..8
    rows with two tiles and two chunks in flight under launch bounds, activations loaded late;
    one row, 9..16 rows, 8-bit weights and short K keep their plans, and the K split is shared."""
    def form(m, n=128256, k=4096, bits=4):
        p = plan(m, n, k, bits, 64, mx.bfloat16, "cuda")
        return p.const("NT"), p.const("U"), p.const("XL"), p.min_blocks

    assert [form(m) for m in (2, 5, 8)] == [(2, 2, 1, 2)] * 3
    assert form(1) == (2, 1, 0, 0) and form(16)[2:] == (0, 0)
    assert form(8, bits=8)[1:] == (1, 0, 0) and form(8, n=49152, k=576)[1:] == (1, 0, 0)
    assert form(8, n=32768)[1:] == (1, 0, 0)
    assert len({plan(m, 128256, 4096, 4, 64, mx.bfloat16, "cuda").k_split for m in range(1, 17)}) == 1


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="the 8-row bucket's forms at 8B width are the CUDA mma kernel's")
@pytest.mark.parametrize("n,k,form", [(6144, 4096, (2, 1, 0, 0)), (128256, 4096, (2, 2, 1, 2))])
def test_eight_row_forms_at_8b_width_keep_every_row_exact(n, k, form):
    """The 8-row bucket's launch forms at the 8B stack's widths (NT 2 on the 6144-wide q/k/v
    launch; two chunks in flight under launch bounds on the 128256-wide LM head): every row of
    a 2..8-row call equals the one-row call bit for bit, and its first and last 1024 outputs
    are close to the float64 reference."""
    p = plan(8, n, k, 4, 64, mx.bfloat16)
    assert (p.const("NT"), p.const("U"), p.const("XL"), p.min_blocks) == form
    for dt in (mx.float16, mx.bfloat16):
        wq, s, b = _quantized(n, k, 64, 4, dt, seed=7 + n)
        x = mx.random.normal((8, k)).astype(dt)
        ones = [quantized_matmul(x[i:i + 1], wq, s, b, group_size=64, bits=4) for i in range(8)]
        for lo in (0, n - 1024):
            ref = _reference(x, wq[lo:lo + 1024], s[lo:lo + 1024], b[lo:lo + 1024], 64, 4)
            got = np.array(mx.concatenate(ones).astype(mx.float32)[:, lo:lo + 1024], dtype=np.float64)
            assert np.abs(got - ref).max() < TOL[dt] * np.abs(ref).max(), (dt, lo)
        for m in (2, 3, 8):
            y = quantized_matmul(x[:m], wq, s, b, group_size=64, bits=4)
            for i in range(m):
                assert mx.array_equal(y[i:i + 1], ones[i]).item(), (dt, m, i)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="the one-row launch forms are the CUDA mma kernel's")
@pytest.mark.parametrize("n,k,form", [
    (14336, 4096, (1, 2, 1, 256, 2, 0)), (4096, 4096, (1, 1, 1, 0, 0, 1)), (4096, 14336, (1, 2, 0, 0, 2, 0))])
def test_one_row_launch_forms_equal_rows_of_wider_calls_at_8b_width(n, k, form):
    """The 8B stack's shapes, where one-row launches take their own form (_one_row_launch:
    one tile per warp, shuffled activations, the compile-time-shape loop unrolled, two chunks in
    flight under launch bounds): row i of every wider call equals the one-row call on x[i] bit
    for bit, groups 64 and 32."""
    for dt, gs in ((mx.float16, 64), (mx.bfloat16, 64), (mx.bfloat16, 32)):
        wq, s, b = _quantized(n, k, gs, 4, dt, seed=11 + n + k)
        x = mx.random.normal((16, k)).astype(dt)
        wide = {m: quantized_matmul(x[:m], wq, s, b, group_size=gs, bits=4) for m in (2, 8, 16)}
        mx.eval(wide)
        ref = _reference(x, wq, s, b, gs, 4)
        p = plan(1, n, k, 4, gs, dt)
        assert (p.const("NT"), p.const("U"), p.const("XS"), p.const("LP"), p.min_blocks, p.const("FU")) == form
        for i in (0, 1, 7, 15):
            one = qmv.run_plan(p, x[i:i + 1], wq, s, b, init_value=float("nan"))
            err = np.abs(np.array(one.astype(mx.float32), dtype=np.float64) - ref[i:i + 1]).max()
            assert err < TOL[dt] * np.abs(ref).max(), (dt, gs, i, err)  # (NaN: an unwritten output)
            for m, y in wide.items():
                if i < m:
                    assert mx.array_equal(y[i:i + 1], one).item(), (dt, gs, m, i)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="the sibling (multi-output) variant is the CUDA mma kernel's")
def test_sibling_matmul_matches_reference_and_rows_are_exact(dtype):
    """One launch for q/k/v-like projections: each output close to the float64 reference of
    its own weight, every row bit-identical whatever the row count (2-D and 3-D inputs)."""
    dt = DTYPES[dtype]
    nan = float("nan")
    # q/k/v-like (NT = 1; a cut inside a 16-row block) and gate/up at 8B width (NT = 2)
    # (and a 12288-wide one: one row takes the launch form of 8192 <= N <= 16384, _one_row_launch)
    # (and the 8B q/k/v launch, 4096 + 1024 + 1024: two tiles from 2 rows, one at one row)
    for k, gs, ns in ((512, 64, (256, 120, 136)), (4096, 64, (14336, 14336)), (4096, 64, (8192, 2048, 2048)),
                      (4096, 64, (4096, 1024, 1024))):
        parts = [_quantized(n, k, gs, 4, dt, seed=101 * i + n) for i, n in enumerate(ns)]
        w, s_, b = (mx.concatenate([p[i] for p in parts]) for i in range(3))
        cuts = tuple(sum(ns[:i + 1]) for i in range(len(ns) - 1))
        x = mx.random.normal((16, k)).astype(dt)
        full = sibling_matmul(x, w, s_, b, cuts, gs, 4, init_value=nan)
        assert full is not None and [y.shape for y in full] == [(16, n) for n in ns]
        for y, (wq, sq, bq) in zip(full, parts):
            ref = _reference(x, wq, sq, bq, gs, 4)
            yf = np.array(y.astype(mx.float32), dtype=np.float64)
            assert not np.isnan(yf).any()
            assert np.abs(yf - ref).max() / np.abs(ref).max() < TOL[dt]
        for m in range(1, 16):
            part = sibling_matmul(x[None, :m], w, s_, b, cuts, gs, 4, init_value=nan)
            for y, yf in zip(part, full):
                assert y.shape == (1, m, yf.shape[1]) and mx.array_equal(y[0], yf[:m]).item(), m


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.gpu
@needs_gpu
def test_patched_model_logits_close(dtype):
    dt = DTYPES[dtype]
    model = _tiny_llama(dtype=dt)
    tokens = mx.array([[3, 17, 250, 9, 44, 101, 7, 300, 12]])
    before = model(tokens).astype(mx.float32)
    report = patch_model(model, "auto")
    assert len(report.patched) == 15 and report.enabled, report.summary()
    after = model(tokens).astype(mx.float32)
    scale = mx.abs(before).max().item()
    err = mx.abs(after - before).max().item() / scale
    assert err < 4 * TOL[dt], err
    # Every projection's rows are exact: one verify pass of 9 rows == 9 one-row passes.
    h = mx.random.normal((1, 9, 256)).astype(dt)
    lin = model.layers[0].mlp.gate_proj
    rows = mx.concatenate([lin(h[:, i:i + 1]) for i in range(9)], axis=1)
    assert mx.array_equal(lin(h), rows).item()
    # the same through a sibling group's one launch (CUDA, half precision: q/k/v fused)
    attn = model.layers[1].self_attn
    assert report.sibling_groups == 4
    group = attn.q_proj.__dict__["_ssk_sibling"][0]
    # CUDA in half precision takes the fused launch; fp32 (simd kernel) and Metal run each member
    fused = backend() == "cuda" and dt != mx.float32
    assert (group._launch(h) is not None) == fused and (group._launch(h[:, :1]) is not None) == fused
    qkv = [(attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))]
    qkv += [(attn.q_proj(h[:, i:i + 1]), attn.k_proj(h[:, i:i + 1]), attn.v_proj(h[:, i:i + 1]))
            for i in range(9)]
    for j in range(3):
        rows = mx.concatenate([t[j] for t in qkv[1:]], axis=1)
        assert mx.array_equal(qkv[0][j], rows).item(), j
    head = model.model.embed_tokens.as_linear
    assert mx.array_equal(head(h)[:, 4], head(h[:, 4:5])[:, 0]).item()
    assert unpatch_model(model) == 15


# ---------------------------------------------------------------- row attention (CUDA)

from metal_kernels import attention as row_attn  # noqa: E402

ON_CUDA = backend() == "cuda"
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="the row-attention kernel is CUDA only; this MLX has no CUDA backend")


def _attn_inputs(h, kv, d, total, dtype, seed, capacity=None):
    """queries [1, h, L, d] are made by the caller; keys/values are [1, kv, total, d] slices of a
    larger cache buffer (strided views, as mlx-lm's KVCache hands them to attention)."""
    mx.random.seed(seed)
    cap = capacity or total + 37
    kbuf = mx.random.normal((1, kv, cap, d)).astype(dtype)
    vbuf = mx.random.normal((1, kv, cap, d)).astype(dtype)
    return kbuf[:, :, :total], vbuf[:, :, :total]


def test_row_attention_declines_off_cuda_and_unsupported_shapes(monkeypatch):
    q = mx.zeros((1, 4, 2, 64))
    k = mx.zeros((1, 2, 10, 64))
    if not ON_CUDA:
        assert row_attn.row_attention(q, k, k, 0.125) is None
        assert "CUDA only" in row_attn.supported(q, k, k)
    # the shape checks are plain Python: run them on any machine, the backend taken as CUDA
    monkeypatch.setattr(row_attn, "backend", lambda: "cuda")
    assert row_attn.supported(q, k, k) == ""
    assert row_attn.supported(mx.zeros((1, 4, 2, 80)), mx.zeros((1, 2, 10, 80)), mx.zeros((1, 2, 10, 80))) == "head dim 80"
    assert row_attn.supported(mx.zeros((2, 4, 2, 64)), mx.zeros((2, 2, 10, 64)), mx.zeros((2, 2, 10, 64))).startswith("shapes")
    assert row_attn.supported(mx.zeros((1, 3, 2, 64)), k, k) == "heads or key length"  # 3 heads over 2 KV heads
    assert row_attn.supported(q, k.astype(mx.float16), k.astype(mx.float16)).startswith("dtype")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (CUDA toolkit absent)")
def test_row_attention_kernel_compiles_for_sm90_without_spills():
    body = row_attn.attention_source()
    src = MLX_PRELUDE + "namespace mlx::core::cu { using Strides = cuda::std::array<int64_t, 10>; }\n"
    for i, (ctype, d) in enumerate((("float", 64), ("float", 128), ("__nv_bfloat16", 64), ("__half", 128))):
        sig = []
        for name in ("q", "k", "v"):  # the parameters mx.fast.cuda_kernel generates
            sig.append(f"const {ctype}* {name},")
            if f"{name}_shape" in body:
                sig.append(f"const __grid_constant__ Shape {name}_shape,")
            if f"{name}_strides" in body:
                sig.append(f"const __grid_constant__ Strides {name}_strides,")
        src += (f"namespace mlx::core::cu {{\n__global__ void a{i}({''.join(sig)} {ctype}* out) {{\n"
                f"using T = {ctype};\nconstexpr int D = {d};\nconstexpr int W = {row_attn.WARPS};\n"
                f"constexpr int SCALE_BITS = 1040187392;\n{body}\n}}\n}}\n")
    usage = ptxas_usage(src)  # (bytes of stack frame, spill stores and loads per kernel)
    assert len(usage) == 4, usage
    assert all(u["stack_frame"] == u["spill_stores"] == u["spill_loads"] == 0 for u in usage.values()), usage


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("h,kv,d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.gpu
@needs_cuda
def test_row_attention_matches_sdpa_and_rows_are_exact(dtype, h, kv, d):
    dt = DTYPES[dtype]
    tol = {mx.float32: 2e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}[dt]
    scale = d ** -0.5
    for start in (0, 1, 31, 32, 33, 255, 1100):
        keys, values = _attn_inputs(h, kv, d, start + 16, dt, seed=start + d)
        q = mx.random.normal((1, 16, h, d)).astype(dt).transpose(0, 2, 1, 3)  # strided, like mlx-lm's
        full = row_attn.row_attention(q, keys, values, scale)
        mx.eval(full)
        for i in range(16):
            ref = mx.fast.scaled_dot_product_attention(
                q[:, :, i:i + 1].astype(mx.float32), keys[:, :, :start + i + 1].astype(mx.float32),
                values[:, :, :start + i + 1].astype(mx.float32), scale=scale)
            err = (mx.abs(full[:, :, i:i + 1].astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
            assert err < tol, (start, i, err)
            one = row_attn.row_attention(q[:, :, i:i + 1], keys[:, :, :start + i + 1],
                                         values[:, :, :start + i + 1], scale)
            assert mx.array_equal(one, full[:, :, i:i + 1]).item(), f"row {i} start {start}"
        for n in (2, 7, 9):  # an n-row pass over the same cache prefix
            part = row_attn.row_attention(q[:, :, :n], keys[:, :, :start + n], values[:, :, :start + n], scale)
            assert mx.array_equal(part, full[:, :, :n]).item(), f"{n} rows start {start}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.gpu
@needs_cuda
def test_row_attention_scalar_fallback_gives_the_same_bits(dtype, d):
    """Keys/values whose rows are not contiguous and aligned (no vector loads) give exactly the
    bits of the aligned inputs (vector loads): both paths run the same arithmetic in order."""
    dt = DTYPES[dtype]
    scale = d ** -0.5
    for start in (0, 33, 300):
        total = start + 16
        keys, values = _attn_inputs(32, 8, d, total, dt, seed=start)
        q = mx.random.normal((1, 16, 32, d)).astype(dt).transpose(0, 2, 1, 3)
        aligned = row_attn.row_attention(q, keys, values, scale)
        # rows one element wider: a row stride of d + 1 breaks alignment and vector width
        wide_k = mx.zeros((1, 8, total, d + 1), dt)
        wide_v = mx.zeros((1, 8, total, d + 1), dt)
        wide_k[..., 1:] = keys
        wide_v[..., 1:] = values
        mx.eval(wide_k, wide_v)
        odd = row_attn.row_attention(q, wide_k[..., 1:], wide_v[..., 1:], scale)
        assert mx.array_equal(aligned, odd).item(), (dtype, d, start)
