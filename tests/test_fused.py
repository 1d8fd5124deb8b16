"""Fused decode/verify passes (metal_kernels/fused.py): support checks, the launcher, the engine.

CPU tier: which models are supported and why not; the launcher (weight stacking, RoPE
frequencies, KV-cache appends, hidden-state taps) and the engine's use of it, with
:func:`reference_pass` standing in for the CUDA kernel (the same contract, in MLX ops).
GPU tier (CUDA): the kernel against :func:`reference_pass`, rows bit-identical for every width
1..16, and greedy speculative output equal to plain output through the engine.
"""

from __future__ import annotations

import os
import re
import struct
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import assert_pass_matches_mlx_lm, assert_writes_only_its_own_buffers, run
from tiny import quantize_like_gguf, tiny_loaded, tiny_model

from drafters.dspark.drafter import MAX_PADDED_ROWS
from engine import Engine, EngineConfig, SpeculativeParams
from engine.engine import DRAFT_PROBE_TOLERANCE
from engine.runner import TargetRunner
from metal_kernels import fused
from metal_kernels.fused import FusedPass, structure_reason, unsupported_reason

ON_CUDA = fused.backend() == "cuda"
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="the fused pass is CUDA only; this MLX has no CUDA backend")


def _unbits(i: int) -> float:
    return struct.unpack("<f", struct.pack("<i", i))[0]


def reference_pass(inputs, template, output_shapes, **_):
    """What the kernel computes, in MLX ops: same inputs (as FusedPass and DraftFusedPass hand them to
    ``mx.fast.cuda_kernel``), the two outputs that matter (logits, hidden), and the kernel's
    in-place append: the rows' keys and values go into the cache buffers it was handed (the
    inputs ``kc*``/``vc*``, updated in place as the kernel writes them). Scratch outputs are
    zeros. Attention runs row by row, so rows do not depend on the width (causal, or over the
    whole new block with ``BIDIR``); ``QKN`` adds the per-head q/k norms of a DSpark block."""
    t = dict(template)
    names = ["x0", "pos", "pseg", *FusedPass._WEIGHT_NAMES, *FusedPass._DRAFT_NAMES]
    w = dict(zip(names, inputs))
    nl, nh, nkv, hd, di = t["NL"], t["NH"], t["NKV"], t["HD"], t["DI"]
    eps, scale = _unbits(t["EPS_BITS"]), _unbits(t["SCALE_BITS"])
    kc, vc = inputs[len(names):len(names) + nl], inputs[len(names) + nl:len(names) + 2 * nl]
    start, h = w["pos"].shape[0], w["x0"]
    m = h.shape[0]
    assert m <= t["MB"], "more rows than the kernel was built for"

    def qmm(a, wq, s, b, bits):
        return mx.quantized_matmul(a, wq, s, b, transpose=True, group_size=a.shape[-1] // s.shape[-1], bits=bits)

    def proj(a, key, layer):
        return qmm(a, w["w" + key][layer], w["s" + key][layer], w["b" + key][layer], t["BITS"])

    angle = mx.arange(start, start + m).astype(mx.float32)[:, None] * w["inv_freq"][None]
    cos, sin = mx.cos(angle)[:, None], mx.sin(angle)[:, None]

    def rope(v):  # [m, heads, hd], non-traditional: pairs (i, i + hd / 2)
        lo, hi = v[..., : hd // 2], v[..., hd // 2:]
        return mx.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1)

    def rope_at(v, first):  # [n, heads, hd] at positions first..first+n-1
        ang = mx.arange(first, first + v.shape[0]).astype(mx.float32)[:, None] * w["inv_freq"][None]
        c, s_ = mx.cos(ang)[:, None], mx.sin(ang)[:, None]
        lo, hi = v[..., : hd // 2], v[..., hd // 2:]
        return mx.concatenate([lo * c - hi * s_, hi * c + lo * s_], axis=-1)

    if t["ABS"]:  # a draft cache update first: rows of positions start - A .. start - 1
        rows = w["crow"]
        a = rows.shape[0]
        ctx = mx.fast.rms_norm(qmm(rows, w["wfc"], w["sfc"], w["bfc"], t["BITS"]), w["hnw"], eps)
        for layer in range(nl):
            kv = proj(ctx, "qkv", layer)[:, nh * hd:]
            k = mx.fast.rms_norm(kv[:, : nkv * hd].reshape(a, nkv, hd), w["qkn"][layer, 1], eps)
            kc[layer][..., start - a:start, :] = rope_at(k, start - a).transpose(1, 0, 2)[None]
            vc[layer][..., start - a:start, :] = kv[:, nkv * hd:].reshape(a, nkv, hd).transpose(1, 0, 2)[None]

    hidden = []
    for layer in range(nl):
        qkv = proj(mx.fast.rms_norm(h, w["norms"][layer, 0], eps), "qkv", layer)
        q, kn = qkv[:, : nh * hd].reshape(m, nh, hd), qkv[:, nh * hd:(nh + nkv) * hd].reshape(m, nkv, hd)
        if t["QKN"]:  # a DSpark block: Qwen3's per-head q/k norms
            q, kn = mx.fast.rms_norm(q, w["qkn"][layer, 0], eps), mx.fast.rms_norm(kn, w["qkn"][layer, 1], eps)
        q, kn = rope(q).transpose(1, 0, 2)[None], rope(kn).transpose(1, 0, 2)
        vn = qkv[:, (nh + nkv) * hd:].reshape(m, nkv, hd).transpose(1, 0, 2)
        keys = mx.concatenate([kc[layer][0, :, :start], kn], axis=1)[None]
        values = mx.concatenate([vc[layer][0, :, :start], vn], axis=1)[None]
        att = mx.concatenate([mx.fast.scaled_dot_product_attention(
            q[:, :, i:i + 1], keys[:, :, :start + (m if t["BIDIR"] else i + 1)],
            values[:, :, :start + (m if t["BIDIR"] else i + 1)], scale=scale)
            for i in range(m)], axis=2)
        hmid = h + proj(att[0].transpose(1, 0, 2).reshape(m, nh * hd), "o", layer)
        gu = proj(mx.fast.rms_norm(hmid, w["norms"][layer, 1], eps), "gu", layer)
        h = hmid + proj(nn.silu(gu[:, :di]) * gu[:, di:], "d", layer)
        hidden.append(h)
        kc[layer][..., start:start + m, :] = kn[None]  # the kernel's in-place append
        vc[layer][..., start:start + m, :] = vn[None]
    normed = mx.fast.rms_norm(h, w["fnorm"], eps)
    logits = qmm(normed, w["we"], w["se"], w["bee"], t["HBITS"])
    drafts, conf = mx.zeros(output_shapes[9], dtype=mx.int32), mx.zeros(output_shapes[10])
    if t["MARKOV"]:  # greedy drafts left to right, Markov bias W2 W1[prev], confidence
        r, prev, drafts, conf = t["MR"], w["tok0"], [], []
        for k in range(m):
            w1 = (mx.dequantize(w["mw1"][prev], w["ms1"][prev], w["mb1"][prev], group_size=r // w["ms1"].shape[1],
                                bits=t["MBITS"]) if r else mx.zeros((1, 0)))
            bias = qmm(w1, w["mw2"], w["ms2"], w["mb2"], t["MBITS"])[0] if r else 0.0
            if t["CONF"]:
                feats = mx.concatenate([normed[k], w1[0]]) if t["CONF"] == 2 else normed[k]
                conf.append(mx.sigmoid((feats * w["cw"]).sum() + w["cb"][0]))
            prev = mx.argmax(logits[k] + bias, keepdims=True).astype(mx.int32)
            if t["DV"]:  # a draft vocabulary's row -> its target id
                prev = w["dvoc"][prev]
            drafts.append(prev)
        drafts = mx.concatenate(drafts)
        conf = mx.stack(conf) if conf else mx.zeros((m,))
    scratch = [mx.zeros(s) for s in output_shapes[2:7]]
    return [logits, mx.stack(hidden), *scratch, mx.zeros(output_shapes[7], dtype=mx.uint32),
            mx.zeros(output_shapes[8], dtype=mx.int32), drafts, conf, *(mx.zeros(s) for s in output_shapes[11:])]


@pytest.fixture
def stand_in(monkeypatch):
    """Off CUDA: FusedPass launches reference_pass instead of the kernel."""
    if not ON_CUDA:
        monkeypatch.setattr(fused, "backend", lambda: "cuda")
        monkeypatch.setattr(fused, "multiprocessors", lambda: 4)
        monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: reference_pass))


def _quantized_model(seed=0, bits=4, head_dim=64, dtype=mx.float32):
    model, _ = tiny_model(seed, head_dim=head_dim)
    model.set_dtype(dtype)
    return quantize_like_gguf(model, bits)


# ---------------------------------------------------------------- CPU: what is supported


def test_structure_reason_accepts_the_default_layout_and_names_what_it_rejects():
    assert structure_reason(_quantized_model()) == ""
    assert structure_reason(_quantized_model(bits=8)) == ""
    assert "head dim 80" in structure_reason(_quantized_model(head_dim=80))
    assert "float32 only" in structure_reason(_quantized_model(dtype=mx.bfloat16))
    plain, _ = tiny_model(0, head_dim=64)
    assert "affine-quantized" in structure_reason(plain)
    traditional = _quantized_model()
    for layer in traditional.model.layers:
        layer.self_attn.rope = nn.RoPE(64, traditional=True, base=10000.0)
    assert "RoPE" in structure_reason(traditional)
    if not ON_CUDA:
        assert "CUDA only" in unsupported_reason(_quantized_model())
        with pytest.raises(ValueError, match="CUDA only"):
            FusedPass(_quantized_model())


# ---------------------------------------------------------------- the launcher (stand-in off CUDA)


def _prefilled(model, tokens):
    runner = TargetRunner(model)
    cache = runner.make_cache()
    mx.eval(runner.prefill(tokens, cache)[0])
    return runner, cache


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_pass_matches_mlx_lm_and_appends_the_cache(stand_in, bits):
    """Logits, every layer's output and the appended keys/values agree with mlx-lm's own
    forward of the same rows (to rounding: the kernel's reductions differ from MLX's)."""
    model = _quantized_model(seed=1, bits=bits)
    prompt = mx.random.randint(3, 259, (37,), key=mx.random.key(5)).tolist()
    assert_pass_matches_mlx_lm(model, FusedPass(model), prompt, [17, 250, 3, 99, 42], _prefilled)


def test_runner_routes_decode_and_verify_through_the_fused_pass(stand_in):
    """Decode/verify passes go through the fused pass (prefill does not), and DSpark's tapped
    hidden states come from its per-layer outputs: the same as mlx-lm's modules give."""
    from drafters.dspark import TargetTaps

    model = _quantized_model(seed=2)
    taps = TargetTaps(model, [-1, 1])
    fp = FusedPass(model)
    runner, eager = TargetRunner(model, fused=fp), TargetRunner(model)
    prompt = list(range(3, 40))
    cache, eager_cache = runner.make_cache(), eager.make_cache()
    mx.eval(runner.prefill(prompt, cache)[0], eager.prefill(prompt, eager_cache)[0])
    assert fp.passes == 0  # prefill stays on mlx-lm's modules
    logits, hidden = runner.verify([5, 6, 7], cache, taps=taps)
    want_logits, want_hidden = eager.verify([5, 6, 7], eager_cache, taps=taps)
    assert fp.passes == 1 and logits.shape == (3, 259) and hidden.shape == want_hidden.shape == (3, 2 * 320)
    assert mx.allclose(hidden, want_hidden, rtol=1e-4, atol=1e-4).item()
    assert mx.allclose(logits, want_logits, rtol=1e-4, atol=1e-4 * mx.abs(want_logits).max().item()).item()
    runner.trim(cache, 3)
    assert cache[0].offset == len(prompt)
    assert runner.calibrate_batch(259, 4, 4) == 0  # one sequence per pass with fused passes


def _engine(loaded, **cfg):
    base = dict(speculation="prompt_lookup", max_verify_rows=16, calibration_contexts=(40, 300), warmup=False)
    return Engine(EngineConfig(**{**base, **cfg}), loaded=loaded).start(wait=True, timeout=600)


def _greedy(eng, prompt, speculation, max_tokens=48):
    return run(eng, prompt, speculation, max_tokens=max_tokens)[0]


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_engine_fused_modes(stand_in, mode):
    """`auto`/`on` run every decode/verify pass fused where supported (calibration finds all 16
    rows exact), greedy speculative output equals plain output; `off` keeps mlx-lm's modules."""
    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    eng = _engine(loaded, fused=mode, max_active=2, max_verify_rows=24)  # fused: capped at 16
    try:
        fp = eng.runner.fused
        assert (fp is not None) == (mode != "off") and eng.calibration.fused_pass == (mode != "off")
        if fp is None:
            return
        assert eng.calibration.max_rows == 16 and eng.batch_rows == 0
        assert eng.calibration.probed_rows == 16  # 24 asked for: capped at the fused pass's width
        prompt = [5, 6, 7, 8, 9, 10] * 10
        before = fp.passes
        # min_draft_tokens: draft on every match, whatever the start-up cost measurement says
        spec, _, last = run(eng, prompt, speculative=SpeculativeParams("prompt_lookup", min_draft_tokens=4),
                            max_tokens=48)
        plain = _greedy(eng, prompt, "off")
        assert spec == plain and len(plain) == 48 and fp.passes > before
        assert last.stats.total.num_accepted_tokens > 0  # wide verify passes did run
    finally:
        eng.stop()


def test_engine_fused_off_where_unsupported(stand_in, caplog):
    loaded = tiny_loaded(seed=4, quantize_bits=4)  # head dim 80
    eng = _engine(loaded, fused="on", calibration_contexts=(40,), max_verify_rows=4)
    try:
        assert eng.runner.fused is None and not eng.calibration.fused_pass
    finally:
        eng.stop()
    assert any("fused passes off" in r.getMessage() and "head dim 80" in r.getMessage() for r in caplog.records)


def test_engine_falls_back_when_the_probe_pass_fails_in_auto_only(stand_in, monkeypatch):
    """A kernel that fails to compile or launch: `auto` serves with mlx-lm's modules, `on` does
    not start."""
    def broken(*args, **kwargs):
        raise RuntimeError("nvrtc: compilation failed")

    monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: broken))
    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    eng = _engine(loaded, fused="auto", calibration_contexts=(40,), max_verify_rows=4)
    try:
        assert eng.runner.fused is None
        assert run(eng, [5, 6, 7], "off", max_tokens=4)[0]
    finally:
        eng.stop()
    with pytest.raises(RuntimeError, match="compilation failed"):
        _engine(loaded, fused="on", calibration_contexts=(40,), max_verify_rows=4)


def test_engine_probe_spans_several_attention_segments(stand_in, monkeypatch):
    """The start-up probe's rows attend over 2 and 3 key segments, so a wrong cross-segment
    combine fails the probe instead of going live for every context over one segment."""
    seen = []
    inner = FusedPass._kernel

    def recording(self):
        kernel = inner.__get__(self)

        def run(inputs, **kwargs):
            seen.append((inputs[1].shape[0], kwargs["output_shapes"][0][0], self.segment))
            return kernel(inputs=inputs, **kwargs)
        return run

    monkeypatch.setattr(FusedPass, "_kernel", property(recording))
    eng = _engine(tiny_loaded(seed=4, head_dim=64, quantize_bits=4), fused="on", calibration_contexts=(40,),
                  max_verify_rows=2)
    eng.stop()
    cached, rows, segment = seen[0]  # the probe is the first launch
    assert (cached // segment + 1, (cached + rows - 1) // segment + 1) == (2, 3)


def test_segment_count_reaches_the_kernel_and_sizes_the_partials(stand_in, monkeypatch):
    """`pseg` (a stride-0 view whose length the kernel reads) and the partials' segment axis
    both equal the last row's segment count, (S + M - 1) // (32 warps) + 1, at the boundaries."""
    model = _quantized_model(seed=2)
    seen, inner = [], FusedPass._kernel

    def recording(self):
        kernel = inner.__get__(self)

        def run(inputs, **kwargs):
            seen.append((inputs[2].shape[0], kwargs["output_shapes"][6][2]))
            return kernel(inputs=inputs, **kwargs)
        return run

    monkeypatch.setattr(FusedPass, "_kernel", property(recording))
    for warps in (16, 8):
        fp = FusedPass(model, warps=warps)
        seen.clear()
        segment = 32 * warps
        for cached, rows in ((segment - 2, 2), (segment - 1, 2), (3 * segment - 1, 1), (3 * segment, 1)):
            _, cache = _prefilled(model, [3 + i % 250 for i in range(cached)])
            fp(list(range(5, 5 + rows)), cache)
            want = (cached + rows - 1) // segment + 1
            assert seen[-1] == (want, want), (warps, cached, rows)
        assert [s for s, _ in seen] == [1, 2, 3, 4]


def test_one_stale_layer_reallocates_every_layer(stand_in):
    """The kernel reads layer 0's strides for every layer, so the launcher keeps or replaces
    all layers' buffers together: one layer's array replaced from outside gives every layer
    new buffers of one shape, with every row kept."""
    model = _quantized_model(seed=2)
    fp = FusedPass(model)
    _, cache = _prefilled(model, list(range(3, 40)))
    mx.eval(fp([5, 6], cache).logits)
    before = [(c.keys, c.values) for c in cache]
    kept = [np.array(c.keys[..., :39, :]) for c in cache]
    cache[1].values = mx.array(cache[1].values)  # rebound by someone else
    mx.eval(fp([7], cache).logits)
    assert all(c.keys is not k and c.values is not v for c, (k, v) in zip(cache, before))
    assert len({c.keys.shape for c in cache} | {c.values.shape for c in cache}) == 1
    for c, k in zip(cache, kept):
        assert np.array_equal(np.array(c.keys[..., :39, :]), k)


def test_failed_pass_raises_and_the_runner_keeps_the_fused_pass(stand_in, monkeypatch):
    """Blocks that time out at a grid barrier set their error flags: the pass raises (that
    sequence ends) and later passes still go through the fused pass (never mixing paths)."""
    model = _quantized_model(seed=2)
    fp = FusedPass(model)
    runner = TargetRunner(model, fused=fp)
    cache = runner.make_cache()
    mx.eval(runner.prefill(list(range(3, 30)), cache)[0])
    good = fp._kernel

    def timed_out(*args, **kwargs):
        outs = good(*args, **kwargs)
        return outs[:8] + [mx.ones_like(outs[8])]

    monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: timed_out))
    with pytest.raises(fused.FusedPassError, match="timed out"):
        runner.verify([5], cache)
    assert runner.fused is fp
    monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: good))
    before = fp.passes
    runner.verify([6], cache)
    assert fp.passes == before + 1


def test_supports_cache_and_call_reject_what_the_kernel_cannot_take(stand_in):
    model = _quantized_model(seed=2)
    fp = FusedPass(model)
    runner = TargetRunner(model)
    empty = runner.make_cache()
    assert not fp.supports_cache(empty, 1)  # nothing prefilled yet
    cache = runner.make_cache()
    mx.eval(runner.prefill(list(range(3, 30)), cache)[0])
    assert fp.supports_cache(cache, 1) and fp.supports_cache(cache, 16)
    assert not fp.supports_cache(cache, 0) and not fp.supports_cache(cache, 17)
    assert not fp.supports_cache(cache[:-1], 1)
    with pytest.raises(ValueError, match="1..16 rows"):
        fp(list(range(3, 20)), cache)
    odd = runner.make_cache()
    mx.eval(runner.prefill(list(range(3, 30)), odd)[0])
    odd[1].state = (odd[1].keys[..., :20, :], odd[1].values[..., :20, :], 20)  # layers out of step
    assert not fp.supports_cache(odd, 1)
    half = runner.make_cache()
    mx.eval(runner.prefill(list(range(3, 30)), half)[0])
    for c in half:
        c.state = (c.keys.astype(mx.float16), c.values.astype(mx.float16), c.offset)
    assert not fp.supports_cache(half, 1)


def test_engine_rejects_a_bad_fused_mode():
    with pytest.raises(RuntimeError, match="fused must be"):
        _engine(tiny_loaded(seed=4), fused="maybe", calibration_contexts=(40,), max_verify_rows=2)
    # (on any backend, before a drafter is loaded: the fused draft's own check would be swallowed
    # by fused=auto, or never run off CUDA)
    with pytest.raises(RuntimeError, match="draft_kernel_rows must be 8 or 16"):
        _engine(tiny_loaded(seed=4), draft_kernel_rows=12, calibration_contexts=(40,), max_verify_rows=2)


def test_empty_cache_runs_position_zero_as_plain_decoding_does(stand_in):
    """A one-token prompt leaves the cache empty: position 0 goes through mlx-lm's modules (as
    plain decoding's first step does) and later rows through the fused pass, so a k-row first
    pass equals k one-row steps bit for bit."""
    model = _quantized_model(seed=2)
    fp = FusedPass(model)
    runner = TargetRunner(model, fused=fp)
    tokens = [7, 100, 42, 9]
    wide = runner.make_cache()
    logits, _ = runner.verify(tokens, wide)
    mx.eval(logits)
    assert fp.passes == 1 and wide[0].offset == 4
    steps = runner.make_cache()
    rows = [runner.verify([t], steps)[0] for t in tokens]
    mx.eval(rows)
    assert fp.passes == 4  # the three steps after position 0
    for i, row in enumerate(rows):
        assert mx.array_equal(logits[i], row[0]).item(), i


def test_every_launch_gets_fresh_zeroed_barrier_slots(stand_in, monkeypatch):
    model = _quantized_model(seed=2)
    fp = FusedPass(model)
    runner = TargetRunner(model, fused=fp)
    cache = runner.make_cache()
    mx.eval(runner.prefill(list(range(3, 30)), cache)[0])
    inner, seen = fp._kernel, []

    def recording(inputs, **kwargs):
        seen.append((inputs[-1], np.array(inputs[-1])))  # the contents before the kernel writes them
        return inner(inputs=inputs, **kwargs)

    monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: recording))
    runner.verify([5], cache)
    runner.verify([6, 7], cache)
    assert len(seen) == 2 and seen[0][0] is not seen[1][0]
    heads = model.args.num_attention_heads
    for (bar, before), rows in zip(seen, (1, 2)):  # barrier slots, then one counter per (layer, row, head)
        assert bar.shape == (fp.blocks * 32 + fp.layers * rows * heads,)
        assert bar.dtype == mx.uint32 and not before.any()


def test_pass_writes_only_buffers_of_its_own_and_grows_them(stand_in):
    """The kernel appends keys/values into the cache buffers in place. A prefix-cache hit
    leaves views of stored arrays: the launcher copies them into buffers of the cache's own
    first, so the stored arrays keep their bits; later passes reuse that buffer (no copy) until
    it is full, then it grows by KVCache.step keeping every row. (Off CUDA the stand-in appends
    with MLX's copy-on-write slice assignment, so the stored arrays' check bites on CUDA only;
    the buffer bookkeeping is checked everywhere.)"""
    model = _quantized_model(seed=2)
    assert_writes_only_its_own_buffers(model, FusedPass(model), _prefilled)


def test_lm_head_and_shared_memory_limits_are_checked(stand_in):
    odd_head = _quantized_model()
    odd_head.model.embed_tokens.group_size = 48
    assert "LM head group size 48" in structure_reason(odd_head)
    wide, _ = tiny_model(0, hidden=640, head_dim=128)
    quantize_like_gguf(wide, 4)
    FusedPass(wide, warps=8)
    with pytest.raises(ValueError, match="registers"):
        FusedPass(wide, warps=16)
    assert FusedPass(wide).warps == 8  # the default takes 16 warps only where they fit
    from mlx_lm.models import llama

    # 4 query heads per KV head: 16 warps' attention scratch (16 x 4 x 64 floats) plus the new
    # keys overflow the 16 x 256-float row buffer; 8 warps fit
    grouped = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, vocab_size=300, tie_word_embeddings=True))
    nn.quantize(grouped, class_predicate=lambda _, m: (
        {"group_size": 32, "bits": 8} if isinstance(m, nn.Embedding)
        else {"group_size": 32, "bits": 4} if isinstance(m, nn.Linear) else False))
    with pytest.raises(ValueError, match="shared memory"):
        FusedPass(grouped, warps=16)
    assert FusedPass(grouped).warps == 8
    with pytest.raises(ValueError, match="registers|shared memory"):  # head dim 128 at 16 warps: neither fits
        FusedPass(_quantized_model(head_dim=128), warps=16)
    assert FusedPass(_quantized_model(head_dim=128)).warps == 8
    assert FusedPass(_quantized_model()).warps == 16


# ---------------------------------------------------------------- CPU: the CUDA source compiles


def _nvrtc():
    """NVRTC (libnvrtc.so, CUDA 12 or 13) through ctypes, or None: ``SPECSERVE_NVRTC`` (the
    library's path), the ``nvidia-cuda-nvrtc`` pip wheels, or the system library."""
    import ctypes
    import ctypes.util
    import glob
    import os

    candidates = [os.environ.get("SPECSERVE_NVRTC", "")]
    try:
        import nvidia

        for root in nvidia.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.1*")))
    except ImportError:
        pass
    candidates.append(ctypes.util.find_library("nvrtc") or "")
    for path in filter(None, candidates):
        try:
            for builtins in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*")):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


_C_TYPES = {mx.float32: "float", mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int32: "int32_t"}
_NVRTC_PRELUDE = """typedef unsigned int uint32_t; typedef int int32_t; typedef unsigned char uint8_t;
typedef long long int64_t;
struct Shape { int d[10]; __device__ int operator[](int i) const { return d[i]; } };
struct Strides { int64_t d[10]; __device__ int64_t operator[](int i) const { return d[i]; } };
"""


def _render_fused(fp: FusedPass, name: str, markov: bool = False, absorb: bool = False) -> str:
    """The fused kernel as mx.fast.cuda_kernel builds it (mlx/backend/cuda/custom_kernel.cpp):
    inputs as const pointers, with ``<name>_shape`` / ``<name>_strides`` parameters where the
    body uses them, outputs as pointers, template arguments as constants."""
    header, body, inputs, outputs = fp.kernel_source()
    dtypes = {"x0": mx.float32, "pos": mx.uint8, "pseg": mx.uint8, "bar": mx.uint32,
              **{k: v.dtype for k, v in fp.weights.items()}, **{k: v.dtype for k, v in fp._draft_inputs.items()}}
    sig = []
    for n in inputs:
        sig.append(f"const {_C_TYPES[dtypes.get(n, mx.float32)]}* {n}")
        if f"{n}_shape" in body:
            sig.append(f"const __grid_constant__ Shape {n}_shape")
        if f"{n}_strides" in body:
            sig.append(f"const __grid_constant__ Strides {n}_strides")
    out_types = {"prof": "uint32_t", "err": "int32_t", "dtok": "int32_t"}
    sig += [f"{out_types.get(n, 'float')}* {n}" for n in outputs]
    consts = "".join(f"using {k} = {_C_TYPES[v]};\n" if isinstance(v, mx.Dtype) else f"constexpr int {k} = {v};\n"
                     for k, v in fp.template(markov, absorb))
    return f"extern \"C\" __global__ void {name}({', '.join(sig)}) {{\n{consts}{body}}}\n"


def _default_like_drafter(target, block_size=7, num_target_layers=30):
    """A random drafter of the first shipped ones' shapes for ``target`` (4-bit, group 64)."""
    from drafters.dspark import DSparkModel, init_weights
    from drafters.dspark.config import draft_config_from_target
    from drafters.dspark.loader import quantizable

    taps = [1, 8, 14, 20, 27] if num_target_layers == 30 else [0, 1, 2]
    cfg = draft_config_from_target({**vars(target.args), "num_hidden_layers": num_target_layers}, num_hidden_layers=3,
                                   target_layer_ids=taps, block_size=block_size, markov_rank=128,
                                   mask_token_id=0)
    net = DSparkModel(cfg)
    init_weights(net, seed=2)
    nn.quantize(net, group_size=64, bits=4, class_predicate=quantizable(64))
    return net


@pytest.mark.skipif(_nvrtc() is None, reason="NVRTC not found (pip nvidia-cuda-nvrtc, or SPECSERVE_NVRTC=<libnvrtc.so>)")
def test_fused_kernel_compiles_for_sm90_without_spills(stand_in):
    """The kernel source, rendered as MLX renders it, compiles for sm_90 (H100/H200) with NVRTC
    and no register spills, for the default model's shapes (also with the cycle profile) and the
    test model's (more query dims than hidden), 4- and 8-bit, 8 and 16 warps, head dim 64 and
    128, and the shipped DSpark drafter's four launch variants. No GPU needed."""
    import ctypes

    from metal_kernels.fused import DraftFusedPass

    lib = _nvrtc()
    from mlx_lm.models import llama

    # The default model's shapes (SmolLM2-135M: 30 layers, 9:3 heads of 64, 576 / 1536), small vocab.
    default_like = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=512,
        rope_theta=100000.0, tie_word_embeddings=True))
    quantize_like_gguf(default_like, 4)
    # (one NVRTC program: ~10 s of a CI core per kernel, so one case per distinct path)
    cases = [(FusedPass(_quantized_model(bits=b), warps=w), w, False) for b, w in ((4, 16), (8, 8))]
    cases += [(FusedPass(_quantized_model(head_dim=128), warps=8), 8, False)]
    cases += [(FusedPass(default_like, warps=16, profile=p), 16, False) for p in (False, True)]
    # the shipped DSpark drafter's shapes (3 layers of the target's width, Markov rank 128):
    draft = _default_like_drafter(default_like)
    # its block forward alone, with the greedy draft, and with the context update before it
    cases = [(fp, w, False, False) for fp, w, _ in cases]
    dp = DraftFusedPass(draft, default_like, rows=8)
    assert dp.markov and dp.absorbs and dp.max_rows == 8  # (a block of 7: the 8-row kernel, 16 warps)
    cases += [(dp, 16, False, False), (dp, 16, True, False), (dp, 16, True, True), (dp, 16, False, True)]
    # the default launch over a draft vocabulary (the shipped drafter's: its tokens mapped to target ids)
    dv = DraftFusedPass(draft, default_like, vocab=_vocab(default_like, draft, np.arange(0, 512, 3)))
    assert dv.max_rows == 8 and dv.vocab is not None
    cases += [(dv, 16, True, True)]
    # the 16-row kernel, whose registers fit 8 warps only
    wide = DraftFusedPass(draft, default_like, rows=16)
    assert wide.max_rows == 16 and wide.max_absorb == 16
    cases += [(wide, 8, True, True)]
    src = _NVRTC_PRELUDE + cases[0][0].kernel_source()[0]  # the header, once
    for i, (fp, warps, markov, absorb) in enumerate(cases):
        assert fp.warps == warps
        src += _render_fused(fp, f"fused{i}", markov, absorb)
    # CUDA 13's NVRTC reuses cubins from the persistent compute cache (~/.nv/ComputeCache) for a
    # PTX it has seen, and then runs no ptxas and logs nothing: a global unique to this run makes
    # the PTX new (it adds 4 bytes of gmem and nothing to the kernels)
    src += f"__device__ int specserve_uncached_{os.getpid()}_{time.time_ns()};\n"
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"fused.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode()
    assert rc == 0, text[-4000:]
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", text)
    assert len(spills) == 2 * len(cases) and set(spills) == {"0"}, text[-4000:]
    # one block per SM must fit the register file (64K 32-bit registers on sm_90)
    regs = dict(re.findall(r"Function properties for (fused\d+)\s*\n[^\n]*\n[^\n]*Used (\d+) registers", text))
    assert len(regs) == len(cases), text[-4000:]
    for i, (_, warps, *_) in enumerate(cases):
        assert int(regs[f"fused{i}"]) * 32 * warps <= 65536, (i, regs)


# ---------------------------------------------------------------- GPU: the CUDA kernel


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bits,head_dim", [(4, 64), (8, 64), (4, 128)])
def test_kernel_matches_reference_pass(bits, head_dim):
    model = _quantized_model(seed=3, bits=bits, head_dim=head_dim)
    prompt = mx.random.randint(3, 259, (1100,), key=mx.random.key(6)).tolist()  # 3 attention segments
    rows = [11, 12, 13, 200, 7, 7, 7, 9, 100]
    _, cache = _prefilled(model, prompt)
    _, ref_cache = _prefilled(model, prompt)
    fp = FusedPass(model)
    out = fp(rows, cache)
    mx.eval(out.logits, out.hidden)
    fp.check(out)
    ref = FusedPass(model)
    ref.__dict__["_kernel"] = reference_pass
    want = ref(rows, ref_cache)
    scale = mx.abs(want.logits).max().item()
    assert mx.abs(out.logits - want.logits).max().item() < 1e-4 * scale
    assert mx.allclose(out.hidden, want.hidden, rtol=1e-4, atol=1e-4).item()
    for c, r in zip(cache, ref_cache):
        n = r.offset
        assert mx.allclose(c.keys[..., :n, :], r.keys[..., :n, :], rtol=1e-4, atol=1e-4).item()
        assert mx.allclose(c.values[..., :n, :], r.values[..., :n, :], rtol=1e-4, atol=1e-4).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("context", [1, 45, 500, 700, 1530])
def test_kernel_rows_bit_identical_for_every_width(context):
    """Row i of a k-row pass equals the one-row decode step at its position, bit for bit, for
    k = 2..16 (and the keys/values each appends are the same bits). With 512-key attention
    segments (16 warps), contexts 500 and 1530 mix rows of 1 and 2, and of 3 and 4 segments in
    one pass."""
    model = _quantized_model(seed=5)
    fp = FusedPass(model)
    prompt = mx.random.randint(3, 259, (context,), key=mx.random.key(7)).tolist()
    probe = mx.random.randint(3, 259, (16,), key=mx.random.key(8)).tolist()
    runner, cache = _prefilled(model, prompt)
    decoded, keys = [], []
    for t in probe:
        out = fp([t], cache)
        mx.eval(out.logits)
        fp.check(out)
        decoded.append(out.logits[0])
    keys = [np.array(c.keys[..., : context + 16, :]) for c in cache]  # a copy: later passes write in place
    for width in range(2, 17):
        runner.trim(cache, cache[0].offset - context)
        out = fp(probe[:width], cache)
        mx.eval(out.logits)
        fp.check(out)
        for i in range(width):
            assert mx.array_equal(out.logits[i], decoded[i]).item(), (width, i)
        n = context + width
        for c, k in zip(cache, keys):
            assert np.array_equal(np.array(c.keys[..., :n, :]), k[..., :n, :]), width


@pytest.mark.gpu
@needs_cuda
def test_kernel_engine_greedy_identity_and_speed_counters():
    loaded = tiny_loaded(seed=6, head_dim=64, quantize_bits=4)
    eng = _engine(loaded, fused="on")
    try:
        assert eng.runner.fused is not None and eng.calibration.max_rows == 16
        for prompt in ([5, 6, 7, 8, 9, 10] * 10, list(range(3, 200)), [40, 41] * 30):
            assert _greedy(eng, prompt, "prompt_lookup") == _greedy(eng, prompt, "off")
    finally:
        eng.stop()


@pytest.mark.gpu
@needs_cuda
def test_kernel_reads_cache_views_like_whole_buffers():
    """A prefix-cache hit restores each layer as slices of stored arrays (views whose head
    stride is not the cached length): the launcher copies them into buffers of the cache's own,
    the pass gives the same bits as over whole buffers, and the stored arrays (whose padding
    would silently absorb writes past the view) keep their bits."""
    model = _quantized_model(seed=9)
    prompt = mx.random.randint(3, 259, (70,), key=mx.random.key(10)).tolist()
    _, whole = _prefilled(model, prompt)
    _, viewed = _prefilled(model, prompt)
    stored = []
    for c in viewed:
        pad = mx.zeros((1, c.keys.shape[1], 50, c.keys.shape[3]))
        n = c.offset
        stored.append((mx.concatenate([c.keys[..., :n, :], pad], axis=2),
                       mx.concatenate([c.values[..., :n, :], pad], axis=2)))
        c.state = (stored[-1][0][..., :n, :], stored[-1][1][..., :n, :], n)
    mx.eval(stored)
    before = [(np.array(k), np.array(v)) for k, v in stored]
    fp = FusedPass(model)
    a = fp([5, 9, 200], whole)
    mx.eval(a.logits)
    b = fp([5, 9, 200], viewed)
    mx.eval(b.logits)
    fp.check(a)
    fp.check(b)
    assert mx.array_equal(a.logits, b.logits).item()
    for (k, v), (k0, v0) in zip(stored, before):
        assert np.array_equal(np.array(k), k0) and np.array_equal(np.array(v), v0)


@pytest.mark.gpu
@needs_cuda
def test_kernel_rows_do_not_depend_on_the_block_count():
    """Which block or warp computes a row must not change its bits (one block per SM, 8, 1),
    also where rows' attention spans several segments (the last unit to finish combines)."""
    model = _quantized_model(seed=11)
    prompt = mx.random.randint(3, 259, (1100,), key=mx.random.key(12)).tolist()
    outs = []
    for blocks in (None, 8, 1):
        _, cache = _prefilled(model, prompt)
        fp = FusedPass(model, blocks=blocks)
        out = fp([7, 8, 9, 10, 11], cache)
        mx.eval(out.logits, out.hidden)
        fp.check(out)
        outs.append(out)
    for other in outs[1:]:
        assert outs[0].logits.shape == other.logits.shape
        assert mx.array_equal(outs[0].logits, other.logits).item()
        assert mx.array_equal(outs[0].hidden, other.hidden).item()


def test_engine_fused_passes_feed_dspark_its_hidden_states(stand_in, tmp_path):
    """DSpark reads the target's tapped hidden states from every verify pass: with fused passes
    they come from the pass's per-layer outputs, and greedy output stays identical to plain."""
    from dspark_helpers import FORCE, make_drafter

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    path = make_drafter(loaded, tmp_path / "drafter", {77: 12.0})
    eng = _engine(loaded, fused="on", dspark=True, dspark_drafter=str(path), speculation="auto")
    try:
        fp = eng.runner.fused
        assert fp is not None
        bias = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}  # the target's argmax is 77: drafts pass
        accepted = 0
        for prompt in ([5, 6, 7, 8] * 6, list(range(30, 70))):
            plain = run(eng, prompt, "off", max_tokens=32, **bias)[0]
            before = fp.passes
            ids, _, last = run(eng, prompt, "x", max_tokens=32, speculative=FORCE, **bias)
            assert ids == plain and fp.passes > before
            accepted += last.stats.by_drafter["dspark"].num_accepted_tokens
        assert accepted > 10
    finally:
        eng.stop()


# ---------------------------------------------------------------- a DSpark block forward in one launch


def _draft_net(loaded, path, bits=4, boosts=None):
    """A tiny 2-layer DSpark drafter for ``loaded``, saved with ``bits`` (None: plain weights)
    and loaded back the way the engine loads it on a GPU (float32, quantized layers kept)."""
    from dspark_helpers import favour

    from drafters.dspark import DSparkModel, init_weights, load_dspark, save_dspark
    from drafters.dspark.config import draft_config_from_target

    cfg = draft_config_from_target(loaded.config, num_hidden_layers=2, target_layer_ids=[-1, 0], block_size=5,
                                   mask_token_id=0, markov_rank=64)  # (a quantized Markov head: rank = group)
    net = DSparkModel(cfg)
    init_weights(net, std=0.05, seed=3)
    if boosts:
        favour(net, boosts)
    save_dspark(net, path, bits=bits)
    return path, load_dspark(path, dtype="float32")


def _vocab(model, net, ids):
    """A draft vocabulary of token ids ``ids`` for ``net`` over ``model``'s LM head."""
    from drafters.dspark import DraftVocab, TargetTaps

    taps = TargetTaps(model, net.config.target_layer_ids)
    return DraftVocab.build(np.asarray(ids), taps.head_module, taps.tied, net)


# a draft vocabulary of the tiny target (259 tokens): 77 (which tests make the target's choice)
# and every third token
TINY_SUBSET = np.union1d(np.arange(1, 259, 3), [77])


def _draft_parts(loaded, net):
    from drafters.dspark import TargetTaps

    return TargetTaps(loaded.model, net.config.target_layer_ids)


def test_draft_unsupported_reason_names_what_it_rejects(tmp_path, monkeypatch):
    from metal_kernels.fused import DraftFusedPass, draft_unsupported_reason

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, quantized = _draft_net(loaded, tmp_path / "q")
    _, plain = _draft_net(loaded, tmp_path / "plain", bits=None)
    if not ON_CUDA:
        assert "CUDA only" in draft_unsupported_reason(quantized, loaded.model)
        with pytest.raises(ValueError, match="CUDA only"):
            DraftFusedPass(quantized, loaded.model)
    monkeypatch.setattr(fused, "backend", lambda: "cuda")
    assert draft_unsupported_reason(quantized, loaded.model) == ""
    assert "affine-quantized" in draft_unsupported_reason(plain, loaded.model)
    assert "LM head" in draft_unsupported_reason(quantized, tiny_loaded(seed=4, head_dim=64).model)
    quantized.layers[0].self_attn.rope = nn.RoPE(64, traditional=True)
    assert "RoPE" in draft_unsupported_reason(quantized, loaded.model)


@pytest.mark.parametrize("hidden, heads, kv_heads, block, rows, warps", [
    (576, 9, 3, 7, 8, 16), (512, 8, 2, 7, 8, 8), (640, 10, 2, 7, 8, 8), (576, 9, 3, 16, 8, 8), (576, 9, 3, 7, 16, 8)])
def test_draft_launch_takes_16_warps_where_its_rows_and_scratch_fit(monkeypatch, hidden, heads, kv_heads, block,
                                                                   rows, warps):
    """Asked for the 8-row kernel, a block of at most 8 rows gets it, with 16 warps where
    attention's scratch (8 rows of a head, then each warp's values for a KV head's query heads)
    fits the row buffer, else 8 warps; a block of 16, or rows=16, the 16-row kernel, whose
    registers fit 8 warps only (and 16 context rows in the launch, not 64)."""
    from mlx_lm.models import llama

    from metal_kernels.fused import DraftFusedPass

    monkeypatch.setattr(fused, "backend", lambda: "cuda")
    monkeypatch.setattr(fused, "multiprocessors", lambda: 4)
    target = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=4, intermediate_size=2 * hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, rms_norm_eps=1e-5, vocab_size=256,
        rope_theta=10000.0, tie_word_embeddings=True))
    quantize_like_gguf(target, 4)
    fp = DraftFusedPass(_default_like_drafter(target, block_size=block, num_target_layers=4), target, rows=rows)
    kernel = 8 if block <= 8 and rows == 8 else 16
    assert (fp.max_rows, fp.warps, fp.max_absorb) == (kernel, warps, 64 if kernel == 8 else 16)
    assert fp._shared_bytes(fp.warps) <= 48 * 1024 and fp.markov and fp.absorbs


@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("context", [4, 40, 300])
def test_draft_fused_pass_matches_the_mlx_block_forward(stand_in, tmp_path, context, vocab):
    """The launch's logits (q/k norms, bidirectional block, context strictly before the anchor,
    the target's LM head, or its rows of a draft vocabulary) equal the MLX ops' block forward to
    rounding, and its greedy draft theirs."""
    from drafters.dspark import DraftStep
    from metal_kernels.fused import DraftFusedPass

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, net = _draft_net(loaded, tmp_path / "d")
    taps = _draft_parts(loaded, net)
    dv = _vocab(loaded.model, net, TINY_SUBSET) if vocab else None
    fp = DraftFusedPass(net, loaded.model, vocab=dv)
    assert fp.markov and fp.confidence == 2  # (the quantized Markov head drafts inside the launch)
    assert (fp.vocab is dv) and fp.weights["we"].shape[0] == (TINY_SUBSET.size if vocab else 259)
    step = DraftStep(net, taps.embed, taps.lm_head, compiled=False, fused=fp, vocab=dv)
    # (on CUDA the MLX side's float32 matmuls run in TF32: the engine's probe allows DRAFT_PROBE_TOLERANCE)
    assert step.fused_error(context) < (1e-3 if ON_CUDA else 1e-4)


def test_draft_step_and_launch_must_share_one_draft_vocabulary(stand_in, tmp_path, monkeypatch):
    """A launch over a draft vocabulary's rows goes with a step over the same vocabulary: also
    where its greedy draft cannot run in the launch (the Markov loop then runs as MLX ops on its
    V'-row logits, and the probe passes); a step without it, or with another, is refused."""
    from drafters.dspark import DraftStep
    from metal_kernels.fused import DraftFusedPass

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, net = _draft_net(loaded, tmp_path / "d")
    taps = _draft_parts(loaded, net)
    dv, other = _vocab(loaded.model, net, TINY_SUBSET), _vocab(loaded.model, net, TINY_SUBSET)
    monkeypatch.setattr(fused, "markov_reason", lambda network: "not in the launch")
    fp = DraftFusedPass(net, loaded.model, vocab=dv)
    assert not fp.markov and fp.vocab is dv
    step = DraftStep(net, taps.embed, taps.lm_head, compiled=False, fused=fp, vocab=dv)
    assert step.fused_error(40) < (1e-3 if ON_CUDA else 1e-4)  # (TF32 on CUDA: 4.4e-4 on an H200)
    for wrong in (None, other):
        with pytest.raises(ValueError, match="same draft vocabulary"):
            DraftStep(net, taps.embed, taps.lm_head, fused=fp, vocab=wrong)
    with pytest.raises(ValueError, match="same draft vocabulary"):
        DraftStep(net, taps.embed, taps.lm_head, fused=DraftFusedPass(net, loaded.model), vocab=dv)


@pytest.mark.parametrize("broken", ["context_rows", "later_chunks", "greedy_draft", "later_slots", "logits",
                                    "nan_confidence", "short_draft", "unmapped"])
def test_start_up_probe_catches_a_broken_context_update_or_greedy_draft(stand_in, tmp_path, monkeypatch, broken):
    """The engine's probe runs every launch variant: a launch that writes wrong context rows,
    (all of them, or only those past the kernel's first chunk of ``MB`` rows), drafts other
    tokens than the MLX ops' greedy draft (at every slot, or after a right first one), fewer
    tokens than the block, whose logits are 2% off (its tokens still right) or whose confidence
    is NaN, or that leaves a draft vocabulary's rows unmapped to target ids, fails it (the engine
    then keeps the MLX ops under ``fused=auto``)."""
    from drafters.dspark import DraftStep
    from metal_kernels.fused import DraftFusedPass

    def bad(inputs, template, output_shapes, **kw):
        outs = reference_pass(inputs, template, output_shapes)
        t = dict(template)
        names = ["x0", "pos", "pseg", *FusedPass._WEIGHT_NAMES, *FusedPass._DRAFT_NAMES]
        if broken == "context_rows" and t["ABS"]:  # (rows written, but the block saw them shifted)
            outs = reference_pass([*inputs[:1], mx.broadcast_to(inputs[1][:1], (inputs[1].shape[0] + 1,)),
                                   *inputs[2:]], template, output_shapes)
        crow = names.index("crow")
        if broken == "later_chunks" and t["ABS"] and inputs[crow].shape[0] > t["MB"]:  # (one chunk's rows only)
            first = inputs[crow][: t["MB"]]
            outs = reference_pass([*inputs[:crow], mx.concatenate([first, mx.zeros_like(inputs[crow][t["MB"]:])]),
                                   *inputs[crow + 1:]], template, output_shapes)
        if broken == "greedy_draft" and t["MARKOV"]:
            outs[9] = (outs[9] + 1) % inputs[names.index("we")].shape[0]
        if broken == "later_slots" and t["MARKOV"]:  # (the first token right, the rest wrong)
            flat = outs[9].reshape(-1)
            later = (flat[1:] + 1) % inputs[names.index("we")].shape[0]
            outs[9] = mx.concatenate([flat[:1], later]).reshape(outs[9].shape)
        if broken == "short_draft" and t["MARKOV"]:
            outs[9] = outs[9].reshape(-1)[:1]
        if broken == "unmapped" and t["DV"]:  # (draft vocabulary rows, not target ids)
            outs = reference_pass(inputs, [(k, 0 if k == "DV" else v) for k, v in template], output_shapes)
        if broken == "logits":
            outs[0] = outs[0] * 1.02
        if broken == "nan_confidence" and t["MARKOV"] and t["CONF"]:
            outs[10] = outs[10] * float("nan")
        return outs

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, net = _draft_net(loaded, tmp_path / "d")
    taps = _draft_parts(loaded, net)
    dv = _vocab(loaded.model, net, TINY_SUBSET) if broken == "unmapped" else None
    step = DraftStep(net, taps.embed, taps.lm_head, compiled=False,
                     fused=DraftFusedPass(net, loaded.model, rows=8, vocab=dv), vocab=dv)
    assert step.fused_error(40) < (1e-3 if ON_CUDA else 1e-4)
    monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: bad))
    assert step.fused_error(40) > DRAFT_PROBE_TOLERANCE


def test_probe_scores_a_greedy_draft_by_its_gaps_after_its_own_tokens(tmp_path):
    """The probe's greedy-draft rule (``DraftStep._greedy_draft_errors``), against the MLX ops fed
    the launch's own tokens: the MLX ops' own draft scores 0; a launch token that a near tie in
    the MLX ops' corrected logits (TF32 rounding on MLX-CUDA) puts just below their best costs
    that gap of the logits' scale, within the engine's DRAFT_PROBE_TOLERANCE, while a wrong token
    at any slot, a near tie included before it, costs far more; a draft of the wrong length, a
    token outside the vocabulary, or a missing or wrong confidence fails outright."""
    from types import SimpleNamespace

    from drafters.dspark import DraftStep
    from drafters.dspark.model import sample_block

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, net = _draft_net(loaded, tmp_path / "d")
    taps = _draft_parts(loaded, net)
    step = DraftStep(net, taps.embed, taps.lm_head, compiled=False)
    slots, vocab = net.config.block_size, net.config.vocab_size
    logits = mx.random.normal((slots, vocab), key=mx.random.key(3)) * 4
    h = mx.random.normal((slots, net.config.hidden_size), key=mx.random.key(5))
    anchor = mx.array([1], dtype=mx.int32)
    tokens, _, conf = sample_block(net, logits, h, anchor, 0)
    scale = mx.abs(logits).max()

    def score(logits, tokens, confidence=conf):
        return max(step._greedy_draft_errors(SimpleNamespace(tokens=tokens, confidence=confidence), logits, h,
                                             anchor, scale))

    assert score(logits, tokens) < 1e-6
    # a near tie at slot 0: another token X now leads the launch's token by eps of the scale
    corrected = logits[0] + net.markov_bias(anchor)[0].astype(mx.float32)
    first = tokens[0].item()
    other = mx.argsort(-corrected).tolist()[1]
    for eps in (1e-3, 5e-2):
        lift = (corrected[first] - corrected[other]).item() + eps * scale.item()
        tied = logits.at[0, other].add(lift)
        assert abs(score(tied, tokens) - eps) < 1e-4
        assert (score(tied, tokens) <= DRAFT_PROBE_TOLERANCE) == (eps < DRAFT_PROBE_TOLERANCE)
    wrong_later = mx.concatenate([tokens[:1], (tokens[1:] + 1) % vocab])
    assert score(logits.at[0, other].add((corrected[first] - corrected[other]).item()), wrong_later) > 0.05
    assert score(logits, (tokens + 1) % vocab) > 0.05
    assert score(logits, tokens[:1]) == float("inf")
    assert score(logits, tokens.at[2].add(vocab)) == float("inf")
    assert score(logits, tokens, confidence=None) == float("inf")
    assert score(logits, tokens, confidence=conf * 0.5) > 0.05


@pytest.mark.parametrize("rows, vocab", [(16, False), (8, False), (16, True), (8, True)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafter_with_the_fused_step_drafts_as_the_mlx_ops_over_many_cycles(stand_in, tmp_path, temperature, rows,
                                                                           vocab):
    """Two drafters fed the same committed rows, one through the launch and one through MLX ops,
    propose the same tokens (and draft_probs / confidence to rounding) for 80 cycles that grow
    the draft cache past its first capacity, some after 20 new rows (projected in the launch by
    the 8-row kernel, in chunks; MLX ops first with the 16-row one) or 70 (MLX ops first); the
    launch's writes past the
    context (the block's own keys) never reach a later block, and the cache keeps room for them."""
    from drafters.base import DraftContext
    from drafters.dspark import DraftStep, DSparkDrafter
    from metal_kernels.fused import DraftFusedPass

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, net = _draft_net(loaded, tmp_path / "d")
    taps = _draft_parts(loaded, net)
    dv = _vocab(loaded.model, net, TINY_SUBSET) if vocab else None  # (drafts from its tokens only)
    fp = DraftFusedPass(net, loaded.model, rows=rows, vocab=dv)
    assert fp.absorbs and fp.markov  # (new context rows and the greedy draft go into the launch)
    launch, in_launch = fp._launch, []
    fp._launch = lambda *a, **kw: (in_launch.append(0 if a[5] is None else int(a[5].shape[0])), launch(*a, **kw))[1]
    tokens = mx.random.randint(3, 259, (700,), key=mx.random.key(2)).tolist()
    hidden = taps.forward(mx.array(tokens)[None])[1][0]
    mx.eval(hidden)
    fused_d = DSparkDrafter(net, taps.embed, taps.lm_head, DraftStep(net, taps.embed, taps.lm_head, fused=fp,
                                                                     vocab=dv))
    plain_d = DSparkDrafter(net, taps.embed, taps.lm_head, DraftStep(net, taps.embed, taps.lm_head, vocab=dv))
    pos, seen, block, differ = 30, 0, net.config.block_size, 0
    allowed = set(TINY_SUBSET.tolist()) if vocab else set(range(259))
    for cycle in range(80):
        ctx = DraftContext(tokens[: pos + 1], hidden[seen:pos], temperature=temperature, seed=11)
        a, b = fused_d.propose(ctx, block), plain_d.propose(ctx, block)
        assert set(a.tokens) <= allowed
        if a.tokens != b.tokens:
            differ += 1
        else:  # (to rounding: on CUDA MLX's float32 matmuls round more coarsely than the launch)
            assert np.allclose(a.confidence, b.confidence, atol=1e-3 if ON_CUDA else 1e-5)
            if temperature:
                assert mx.allclose(a.draft_probs, b.draft_probs, rtol=1e-2 if ON_CUDA else 1e-5,
                                   atol=1e-4 if ON_CUDA else 1e-6).item()
        assert fused_d._length == pos and fused_d._keys[0].shape[2] >= pos + block
        seen, pos = pos, pos + (1 + cycle % 5 if cycle % 10 != 9 else 20 if cycle < 50 else 70)
    # The stand-in computes what the MLX ops do: identical drafts. On CUDA a sampled draw that
    # sits on a boundary between two tokens may fall the other way after rounding, rarely.
    assert differ <= (2 if ON_CUDA and temperature else 0), differ
    assert fp.passes == 80 and fused_d.step.fused_failures == 0
    assert fused_d._keys[0].shape[2] > 256  # the cache doubled on the way
    assert (20 in in_launch) == (rows == 8) and 70 not in in_launch and max(in_launch) <= fp.max_absorb


def test_failed_draft_launch_falls_back_to_mlx_ops(stand_in, tmp_path, monkeypatch):
    """A launch that gave up at a grid barrier has garbage logits and drafts, and garbage in the
    context rows it was to write: the drafter drafts again with MLX ops, writing those rows
    itself, counts the failure, and later cycles (through the launch again) see a sound cache."""
    from drafters.base import DraftContext
    from drafters.dspark import DraftStep, DSparkDrafter
    from metal_kernels.fused import DraftFusedPass

    def timed_out(inputs, template, output_shapes, **kw):
        outs = reference_pass(inputs, template, output_shapes)
        t = dict(template)
        names = ["x0", "pos", "pseg", *FusedPass._WEIGHT_NAMES, *FusedPass._DRAFT_NAMES]
        if t["ABS"]:  # the rows it was to write are garbage
            start, a, nl = inputs[1].shape[0], inputs[names.index("crow")].shape[0], t["NL"]
            for buf in inputs[len(names):len(names) + 2 * nl]:
                buf[..., start - a:start, :] = 1e3
        outs[0], outs[8], outs[9] = mx.zeros_like(outs[0]), mx.ones(output_shapes[8], dtype=mx.int32), outs[9] * 0
        return outs

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, net = _draft_net(loaded, tmp_path / "d")
    taps = _draft_parts(loaded, net)
    tokens = mx.random.randint(3, 259, (60,), key=mx.random.key(2)).tolist()
    hidden = taps.forward(mx.array(tokens)[None])[1][0]
    fp = DraftFusedPass(net, loaded.model)
    fused_d = DSparkDrafter(net, taps.embed, taps.lm_head, DraftStep(net, taps.embed, taps.lm_head, fused=fp))
    plain_d = DSparkDrafter(net, taps.embed, taps.lm_head)
    for cycle, (seen, pos) in enumerate(((0, 39), (39, 43), (43, 47))):
        if cycle == 1:
            monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: timed_out))
        if cycle == 2:
            monkeypatch.setattr(FusedPass, "_kernel", property(lambda self: reference_pass))
        ctx = DraftContext(tokens[: pos + 1], hidden[seen:pos])
        want = plain_d.propose(ctx, 5).tokens
        assert want != [0] * 5  # (the garbage draft)
        assert fused_d.propose(ctx, 5).tokens == want, cycle
        assert fused_d.step.fused_failures == (0 if cycle == 0 else 1)
    assert fp.passes == 3


@pytest.mark.parametrize("mode", ["on", "on16", "off", "on_vocab", "off_vocab"])
def test_engine_drafts_dspark_blocks_in_one_launch(stand_in, tmp_path, mode):
    """With fused passes on, the engine probes and uses the one-launch block forward for a
    quantized drafter, over the drafter's draft vocabulary when its checkpoint has one; greedy
    output stays identical to plain and DSpark drafts get accepted. With them off it keeps to
    MLX ops."""
    from dspark_helpers import FORCE

    from drafters.dspark.vocab import write_draft_vocab

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    path, _ = _draft_net(loaded, tmp_path / "d", boosts={77: 12.0})
    if mode.endswith("_vocab"):
        write_draft_vocab(path, TINY_SUBSET)
    kw = {"draft_kernel_rows": 16} if mode == "on16" else {}  # (else the default, 8)
    eng = _engine(loaded, fused=mode.split("_")[0].removesuffix("16"), dspark=True, dspark_drafter=str(path),
                  speculation="auto", **kw)
    try:
        fp = eng._dspark_step.fused
        assert (fp is not None) == mode.startswith("on")
        assert fp is None or fp.max_rows == (16 if mode == "on16" else 8)
        vocab = eng._dspark_step.vocab
        assert (vocab is not None) == mode.endswith("_vocab") and (fp is None or fp.vocab is vocab)
        if vocab is not None:
            assert vocab.ids.tolist() == TINY_SUBSET.tolist()
        # the launch projects up to its capacity of new context rows itself, but only forwards of
        # one cycle's rows (the block's) are priced as steady ones
        assert eng._dspark_step.steady_rows == (fp.max_absorb if fp is not None else MAX_PADDED_ROWS)
        assert eng.dspark_stats.steady_rows == eng.dspark.config.block_size + 1
        bias = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}  # the target's argmax is 77: drafts pass
        accepted, before = 0, fp.passes if fp else 0
        for prompt in ([5, 6, 7, 8] * 6, list(range(30, 70))):
            plain = run(eng, prompt, "off", max_tokens=32, **bias)[0]
            ids, _, last = run(eng, prompt, "x", max_tokens=32, speculative=FORCE, **bias)
            assert ids == plain
            accepted += last.stats.by_drafter["dspark"].num_accepted_tokens
        assert accepted > 10
        if fp is not None:
            assert fp.passes > before
    finally:
        eng.stop()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("context", [1, 45, 600, 1100])
@pytest.mark.parametrize("rows, vocab", [(16, False), (8, False), (16, True), (8, True)])
def test_kernel_draft_pass_matches_reference(tmp_path, context, rows, vocab):
    """The CUDA kernel's DSpark block forward (q/k norms, bidirectional block; over a draft
    vocabulary's rows, its greedy tokens mapped to target ids) against :func:`reference_pass`,
    with contexts of 1..3 attention segments; the context rows the launch was handed keep their
    bits (it writes only past them)."""
    from metal_kernels.fused import DraftFusedPass

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4)
    _, net = _draft_net(loaded, tmp_path / "d")
    taps = _draft_parts(loaded, net)
    dv = _vocab(loaded.model, net, TINY_SUBSET) if vocab else None
    shape = (1, net.config.num_key_value_heads, context + 64, net.config.head_dim)
    keys = [mx.random.normal(shape, key=mx.random.key(i)) for i in range(2)]
    values = [mx.random.normal(shape, key=mx.random.key(10 + i)) for i in range(2)]
    ref_keys, ref_values = [mx.array(np.array(k)) for k in keys], [mx.array(np.array(v)) for v in values]
    x0 = taps.embed(mx.array([5, 0, 0, 0, 0]))
    fp = DraftFusedPass(net, loaded.model, rows=rows, vocab=dv)
    out = fp(x0, keys, values, context)
    mx.eval(out.logits, out.hidden, out.errors)
    fp.check(out)
    ref = DraftFusedPass(net, loaded.model, rows=rows, vocab=dv)
    ref.__dict__["_kernel"] = reference_pass
    want = ref(x0, ref_keys, ref_values, context)
    mx.eval(want.logits, want.hidden)
    scale = mx.abs(want.logits).max().item()
    assert mx.abs(out.logits - want.logits).max().item() < 1e-4 * scale
    assert mx.allclose(out.hidden, want.hidden, rtol=1e-4, atol=1e-4).item()
    for k, r in zip(keys, ref_keys):
        assert mx.array_equal(k[..., :context, :], r[..., :context, :]).item()
    anchor = mx.array([5], dtype=mx.int32)  # the greedy draft inside the launch
    out, want = fp(x0, keys, values, context, anchor), ref(x0, ref_keys, ref_values, context, anchor)
    mx.eval(out.tokens, out.confidence, out.errors, want.tokens, want.confidence)
    fp.check(out)
    assert out.tokens.tolist() == want.tokens.tolist()
    assert not vocab or set(out.tokens.tolist()) <= set(TINY_SUBSET.tolist())
    assert mx.allclose(out.confidence, want.confidence, atol=1e-5).item()
    assert (fp.max_rows, fp.warps) == ((8, 16) if rows == 8 else (16, 8))  # (a block of 5)
    # the last context rows projected into the cache inside the launch: 3 (a steady cycle's),
    # 3 chunks of the kernel's rows and a part, and the most it takes (8 chunks; rows committed
    # over cycles of other drafters)
    for new in sorted({3, min(3 * fp.max_rows + 2, fp.max_absorb), fp.max_absorb}) if context >= 4 else ():
        new = min(new, context)
        crows = mx.random.normal((new, net.config.num_taps * net.config.hidden_size), key=mx.random.key(new))
        out, want = fp(x0, keys, values, context, anchor, crows), ref(x0, ref_keys, ref_values, context, anchor, crows)
        mx.eval(out.tokens, out.logits, out.errors, want.tokens, want.logits, *keys, *values)
        fp.check(out)
        assert mx.abs(out.logits - want.logits).max().item() < 1e-4 * scale
        assert out.tokens.tolist() == want.tokens.tolist()
        for got, ref_buf in zip(keys + values, ref_keys + ref_values):
            assert mx.allclose(got[..., context - new:context, :], ref_buf[..., context - new:context, :],
                               rtol=1e-4, atol=1e-4).item()
