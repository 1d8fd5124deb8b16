"""The CPU fused pass (metal_kernels/fused_cpu.py, sources/fused_cpu.c): one native call per
decode/verify pass, rows bit-identical for every width, agreeing with mlx-lm's modules."""

from __future__ import annotations

import platform
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import assert_pass_matches_mlx_lm, assert_writes_only_its_own_buffers, run
from tiny import quantize_like_gguf, tiny_loaded, tiny_model

from engine import Engine, EngineConfig, SpeculativeParams
from engine.runner import TargetRunner
from metal_kernels import fused_cpu
from metal_kernels.fused_cpu import CpuFusedPass, quantized_modules, unsupported_reason

pytestmark = pytest.mark.skipif(fused_cpu.backend() != "cpu", reason="the CPU fused pass runs on the CPU backend")


def _models(bits=4, head_dim=64, seed=1, hidden=320, group_size=32):
    """The same tiny Llama twice: float32 weights dequantized from the quantized ones (as the
    loader serves them on the CPU) with those quantized layers aside, and the quantized one."""
    model, _ = tiny_model(seed, head_dim=head_dim, hidden=hidden)
    quantize_like_gguf(model, bits, group_size)
    stored = quantized_modules(model)
    from engine.loader import apply_weight_policy

    apply_weight_policy(model, "float32")
    return model, stored


def _prefilled(model, tokens):
    runner = TargetRunner(model)
    cache = runner.make_cache()
    mx.eval(runner.prefill(tokens, cache)[0])
    return runner, cache


@pytest.mark.parametrize("bits,head_dim,context", [(4, 64, 37), (8, 64, 37), (4, 80, 37), (4, 64, 600)])
def test_pass_matches_mlx_lm_and_appends_the_cache(bits, head_dim, context):
    """Float32 activations: logits, every layer's output and the appended keys/values agree with
    mlx-lm's forward of the same rows over the dequantized weights (to rounding: the reductions
    differ); at 600 cached positions attention combines three 256-key segments."""
    model, stored = _models(bits, head_dim)
    prompt = mx.random.randint(3, 259, (context,), key=mx.random.key(5)).tolist()
    assert_pass_matches_mlx_lm(model, CpuFusedPass(model, stored, activations="float32"), prompt,
                               [17, 250, 3, 99, 42], _prefilled)


def _quantized(x: mx.array, digits: int) -> mx.array:
    """``x`` as the C pass quantizes a projection's input, per block of 32: ``d = max|x| / 127``,
    ``q = round-half-even(x * (127 / max|x|))``, then (two digits) the same for ``x - d q``;
    returns the sum of ``d q`` over the digits."""
    rest = x.reshape(*x.shape[:-1], -1, 32)
    out = mx.zeros_like(rest)
    for _ in range(digits):
        amax = mx.abs(rest).max(axis=-1, keepdims=True)
        part = mx.round(rest * mx.where(amax > 1e-30, 127.0 / amax, 0.0)) * (amax / 127.0)
        out, rest = out + part, rest - part
    return out.reshape(x.shape)


class _QuantizedInput(nn.Module):
    def __init__(self, linear, digits):
        super().__init__()
        self.linear, self.digits = linear, digits

    def __call__(self, x):
        return self.linear(_quantized(x, self.digits))


def _with_quantized_inputs(model, digits):
    """``model`` with every projection (and the tied LM head) fed inputs quantized to ``digits``
    8-bit digits: the arithmetic the C pass's integer activations stand for, in mlx-lm's
    modules."""
    for layer in model.model.layers:
        for owner in (layer.self_attn, layer.mlp):
            for name, child in list(owner.children().items()):
                if isinstance(child, nn.Linear):
                    setattr(owner, name, _QuantizedInput(child, digits))
    embed = model.model.embed_tokens
    head = embed.as_linear
    embed.as_linear = lambda x: head(_quantized(x, digits))
    return model


@pytest.mark.parametrize("activations", ["q16", "q8"])
@pytest.mark.parametrize("bits,head_dim,hidden,group_size,context", [
    (4, 64, 320, 32, 37),    # inputs of 10 blocks (a partial 16-block group), 20 (a half-width tail), 16
    (8, 64, 320, 32, 37),
    (4, 80, 512, 32, 600),   # 16 and 32 blocks (whole groups only), 20; three attention segments
    (4, 64, 320, 64, 37),    # a scale per two blocks
])
def test_integer_pass_computes_its_layers_on_quantized_inputs(bits, head_dim, hidden, group_size, context,
                                                              activations):
    """Integer activations (q16, the default, and q8): each layer's output, the appended
    keys/values and the logits equal mlx-lm's layer over the dequantized weights, applied to the
    pass's own output of the layer before, when every projection's input is quantized the same
    way. Layer by layer, since a rounding difference before quantization (mlx-lm's and the
    pass's RMSNorm differ in the last bit) can move an input by one step of its block, and later
    layers would carry that on. The logits also stay close to the float32 pass's (q16 to 1e-3 of
    their scale, q8 to 5e-2), and differ from them."""
    from mlx_lm.models.base import create_attention_mask

    model, stored = _models(bits, head_dim, hidden=hidden, group_size=group_size)
    prompt = mx.random.randint(3, 259, (context,), key=mx.random.key(5)).tolist()
    rows = [17, 250, 3, 99, 42]
    _, cache = _prefilled(model, prompt)
    plain = np.array(CpuFusedPass(model, stored, activations="float32")(rows, cache).logits)
    _, cache = _prefilled(model, prompt)
    _, eager = _prefilled(model, prompt)
    out = CpuFusedPass(model, stored, activations=activations)(rows, cache)
    logits = np.array(out.logits)
    scale = np.abs(plain).max()
    assert 0 < np.abs(logits - plain).max() < (1e-3 if activations == "q16" else 5e-2) * scale
    assert (logits.argmax(-1) == plain.argmax(-1)).all()

    reference = _with_quantized_inputs(model, 2 if activations == "q16" else 1)
    h = reference.model.embed_tokens(mx.array(rows)[None])
    mask = create_attention_mask(h, eager[0])
    for layer, c, got in zip(reference.model.layers, eager, out.hidden):
        want = layer(h, mask, cache=c)[0]
        assert mx.abs(got - want).max().item() < 5e-3 * mx.abs(want).max().item()
        h = got[None]  # (the pass's own output feeds the next layer)
    for c, e in zip(cache, eager):
        n = e.offset
        for a, b in ((c.keys, e.keys), (c.values, e.values)):
            assert mx.abs(a[..., :n, :] - b[..., :n, :]).max().item() < 5e-3 * mx.abs(b[..., :n, :]).max().item()
    want = reference.model.embed_tokens.as_linear(reference.model.norm(out.hidden[-1]))
    assert mx.abs(out.logits - want).max().item() < 5e-3 * mx.abs(want).max().item()


@pytest.mark.parametrize("context,activations", [(1, "q16"), (33, "q16"), (250, "q16"), (300, "q16"),
                                                 (33, "q8"), (250, "q8"), (33, "float32"), (250, "float32")])
def test_rows_bit_identical_for_every_width(context, activations):
    """Row i of an M-row pass equals the one-row pass at its position, bit for bit, for M up to
    16 (the exactness greedy speculation rests on), whatever was cached beyond the row; at 250
    the rows of one pass straddle an attention segment boundary (256 keys)."""
    model, stored = _models(4, 64, seed=2)
    fp = CpuFusedPass(model, stored, activations=activations)
    tokens = mx.random.randint(3, 259, (context + 16,), key=mx.random.key(context)).tolist()
    _, cache = _prefilled(model, tokens[:context])
    singles = []
    for t in tokens[context:]:
        singles.append(np.asarray(fp([t], cache).logits)[0])
    singles = np.stack(singles)
    for m in (2, 5, 8, 9, 16):
        for c in cache:
            c.trim(c.offset - context)
        out = np.asarray(fp(tokens[context:context + m], cache).logits)
        assert np.array_equal(out, singles[:m]), m


def test_pass_writes_only_buffers_of_its_own_and_grows_them():
    """Keys and values are written into the cache buffers in place; a prefix-cache hit's views
    of stored arrays are copied into buffers of the cache's own first, so the stored arrays keep
    their bits; the buffers grow by KVCache.step keeping every row."""
    model, stored = _models(4, 64, seed=3)
    # (float32 activations: the helper checks the new rows' keys against mlx-lm's to 1e-3)
    assert_writes_only_its_own_buffers(model, CpuFusedPass(model, stored, activations="float32"), _prefilled)


def test_unsupported_models_and_calls_are_refused(monkeypatch, tmp_path):
    model, _ = tiny_model(4, head_dim=64)  # float weights, no quantized layers aside
    assert "not affine-quantized" in unsupported_reason(model)
    with pytest.raises(ValueError, match="not affine-quantized"):
        CpuFusedPass(model)
    quantized, stored = _models(4, 72)
    assert "head dim 72" in unsupported_reason(quantized, stored)
    q, stored = _models(4, 64)
    fp = CpuFusedPass(q, stored)
    _, cache = _prefilled(q, [5, 6, 7])
    with pytest.raises(ValueError, match="1..16 rows"):
        fp(list(range(3, 20)), cache)
    with pytest.raises(ValueError, match="1..16 rows"):
        fp([], cache)
    # no compiler: refused with the reason (the library is built per process, once)
    fused_cpu.library.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    try:
        assert "no C compiler" in unsupported_reason(q, stored)
    finally:
        fused_cpu.library.cache_clear()


def _engine(loaded, **cfg):
    base = dict(speculation="prompt_lookup", max_verify_rows=16, calibration_contexts=(40, 300), warmup=False)
    return Engine(EngineConfig(**{**base, **cfg}), loaded=loaded).start(wait=True, timeout=600)


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_engine_runs_decode_and_verify_through_the_cpu_pass(mode):
    """`auto` builds the CPU pass for a quantized target served dequantized (calibration finds
    all 16 rows exact); greedy speculative output equals plain output, through wide passes."""
    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4, dequantize=True)
    eng = _engine(loaded, fused=mode)
    try:
        fp = eng.runner.fused
        assert isinstance(fp, CpuFusedPass) == (mode == "auto") and eng.calibration.fused_pass == (mode == "auto")
        if fp is None:
            return
        assert eng.calibration.max_rows == 16
        rng = np.random.default_rng(0)
        prompts = [[5, 6, 7, 8, 9, 10] * 10, list(rng.integers(3, 259, 50)) * 2, [40, 41] * 30]
        for prompt in prompts:
            before = fp.passes
            spec, _, last = run(eng, [int(t) for t in prompt],
                                speculative=SpeculativeParams("prompt_lookup", min_draft_tokens=4), max_tokens=48)
            plain = run(eng, [int(t) for t in prompt], "off", max_tokens=48)[0]
            assert spec == plain and len(plain) == 48 and fp.passes > before
        assert last.stats.total.num_accepted_tokens > 0
    finally:
        eng.stop()


def test_batched_pass_rows_equal_each_sequences_own_pass():
    """Several sequences in one pass (weights read once for all): each sequence's rows and
    appended keys/values equal its own pass's, bit for bit; a sequence with an empty cache takes
    its own pass (position 0 runs through mlx-lm's modules, as in plain decoding)."""
    model, stored = _models(4, 64, seed=5)
    runner = TargetRunner(model, fused=CpuFusedPass(model, stored))
    rng = np.random.default_rng(3)
    cases = [([1, 1, 1], None), ([4, 1, 2], None), ([1, 6], None), ([3, 3, 1, 1], None), ([8, 8], None),
             ([8, 1, 3], [250, 600, 37]), ([2, 5, 9], [511, 255, 700]), ([12, 4], [300, 250])]  # segment crossings
    for lengths, contexts in cases:
        seqs = []
        for i, n in enumerate(lengths):
            cache = runner.make_cache()
            context = (contexts[i] if contexts else
                       0 if (i == 1 and n == 1 and len(lengths) == 4) else int(rng.integers(5, 90)))
            if context:
                mx.eval(runner.prefill(rng.integers(3, 259, context).tolist(), cache)[0])
            seqs.append((cache, rng.integers(3, 259, n).tolist(), context))
        alone = []
        for cache, rows, _ in seqs:
            logits = runner.verify(rows, cache)[0]
            alone.append((np.array(logits), [np.array(c.keys[..., : c.offset, :]) for c in cache]))
            runner.trim(cache, len(rows))
        before = runner.fused.passes
        together = runner.verify_batch([s[1] for s in seqs], [s[0] for s in seqs])
        # one pass for all (an empty cache's lone row goes through mlx-lm's modules instead)
        assert runner.fused.passes == before + 1
        for (cache, rows, start), (logits, keys), (got, hidden) in zip(seqs, alone, together):
            assert np.array_equal(np.array(got), logits) and hidden is None
            assert all(c.offset == start + len(rows) for c in cache)
            assert all(np.array_equal(np.array(c.keys[..., : c.offset, :]), k) for c, k in zip(cache, keys))
    with pytest.raises(ValueError, match="distinct caches"):
        cache = seqs[0][0]
        runner.fused.batch([[5], [6]], [cache, cache])
    with pytest.raises(ValueError, match="rows in all"):
        runner.fused.batch([[5] * 9, [6] * 8], [seqs[0][0], seqs[1][0]])


def test_engine_batches_concurrent_sequences_through_the_cpu_pass(monkeypatch):
    """Continuous batching over the CPU pass: calibration finds several sequences per pass
    exact, and concurrent outputs (greedy and seeded sampling, every method, logprobs, stops)
    equal the solo outputs of an engine that steps one sequence per pass."""
    from test_batching import BatchRecorder, collect, concurrently, requests

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4, dequantize=True)
    cfg = dict(speculation="auto", calibration_contexts=(40, 300), max_active=8, warmup=False)
    solo = Engine(EngineConfig(batching="off", **cfg), loaded=loaded).start(wait=True, timeout=300)
    rec = BatchRecorder()
    batched = Engine(EngineConfig(**cfg), loaded=loaded, sink=rec).start(wait=True, timeout=300)
    try:
        fp = batched.runner.fused
        assert isinstance(fp, CpuFusedPass) and batched.batch_rows >= 8
        sizes = []  # sequences per pass of the CPU pass
        real_batch = fp.batch

        def recording_batch(rows, *args, **kwargs):
            sizes.append(len(rows))
            return real_batch(rows, *args, **kwargs)

        monkeypatch.setattr(fp, "batch", recording_batch)
        for seed in range(2):
            reqs = requests(seed, 8)
            alone = [collect(solo, r) for r in reqs]
            assert concurrently(batched, reqs) == alone
        assert max(n for n, _ in rec.batches) >= 4
        assert max(sizes) >= 4  # one native pass really held 4 sequences
    finally:
        solo.stop()
        batched.stop()


def test_a_forked_child_starts_its_own_threads():
    """The thread pool does not survive fork(): a child's first pass starts its own workers
    instead of waiting for the parent's at a barrier (the pass is called through C directly:
    MLX itself is not fork-safe)."""
    import ctypes
    import os
    import time

    model, stored = _models(4, 64, seed=6)
    fp = CpuFusedPass(model, stored)
    if fp.threads < 2:
        pytest.skip("one thread: the pool has no workers to lose")
    _, cache = _prefilled(model, list(range(3, 40)))
    want = np.array(fp([7, 8], cache).logits)
    from metal_kernels.fused import writable_cache

    for c in cache:
        c.trim(2)
    writable_cache(cache, 2, fp.kv_heads, fp.head_dim)
    x0 = np.ascontiguousarray(np.array(model.model.embed_tokens(mx.array([7, 8]))), np.float32)
    pos, seq, cap = (np.array(v, np.int32) for v in ([37, 38], [0, 0], [cache[0].keys.shape[2]]))
    keys = (ctypes.c_void_p * fp.layers)(*(np.asarray(c.keys).ctypes.data for c in cache))
    values = (ctypes.c_void_p * fp.layers)(*(np.asarray(c.values).ctypes.data for c in cache))
    logits = np.zeros_like(want)
    hidden = np.empty((fp.layers, 2, fp.hidden_size), np.float32)
    pid = os.fork()
    if pid == 0:  # the child: one pass, exit 0 if it matches
        rc = fp.lib.specserve_cpu_pass(ctypes.byref(fp._model), 2, ctypes.c_void_p(pos.ctypes.data),
                                       ctypes.c_void_p(seq.ctypes.data), ctypes.c_void_p(x0.ctypes.data), keys, values,
                                       ctypes.c_void_p(cap.ctypes.data), ctypes.c_void_p(logits.ctypes.data),
                                       ctypes.c_void_p(hidden.ctypes.data))
        os._exit(0 if rc == 0 and np.array_equal(logits, want) else 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's pass did not finish (its workers were never started)")


@pytest.fixture(scope="module")
def alt_build(tmp_path_factory):
    """``build(flag)``: the fused pass's library compiled with one more flag, once per flag and
    test worker (each build takes 20-45 s of a CI core; the parameters below share them)."""
    import os
    import subprocess

    built = {}

    def build(flag):
        if flag not in built:
            path = tmp_path_factory.mktemp("alt") / "alt.so"
            cc = os.environ.get("CC") or "cc"
            subprocess.run([cc, *fused_cpu._CFLAGS, flag, "-o", str(path), str(fused_cpu._SOURCE), "-lm"],
                           check=True, capture_output=True)
            built[flag] = path
        return built[flag]

    return build


@pytest.mark.parametrize("flag,activations,group_size,bits,head_dim", [
    ("-mno-avx512f", "q16", 32, 4, 64), ("-mno-avx512f", "q8", 32, 4, 64), ("-mno-avx512f", "float32", 32, 4, 64),
    ("-mno-avx512f", "q16", 32, 8, 64),
    ("-mno-avx2", "q16", 32, 4, 64), ("-mno-avx2", "q8", 64, 4, 64), ("-mno-avx2", "float32", 32, 4, 64),
    ("-mno-avx2", "q16", 32, 8, 64), ("-mno-avx2", "q16", 32, 4, 80)])
def test_builds_for_other_cpus_compute_the_same_bits(alt_build, flag, activations, group_size, bits, head_dim):
    """A build without AVX-512 (4 rows per weight read, 8 with integer activations, instead of 16;
    8-lane halves of every vector, integer dot products by vpmaddubsw instead of VNNI) and one
    without AVX2 (the generic vector code) give every row the same bits as the machine's own build:
    the per-row arithmetic is the same whatever the vector width. (On a CPU without AVX-512 the
    first compares the AVX2 build with itself, and the second checks its AVX2 code, in 16-row and
    3-row passes, which take its two shapes of the integer dot products.) Hidden size 320 and
    intermediate 640 give the integer path whole groups of 16 blocks, a partial group spanning both
    8-block halves (10 blocks) and one within the first (4), in 4-bit and (bits = 8, the
    nibble-split path) 8-bit projections. Head size 80 (10 lanes of 8) also takes the AVX2
    attention's value loop through a partial register block."""
    import ctypes

    alt = alt_build(flag)
    model, stored = _models(bits, head_dim, seed=7, group_size=group_size)
    fp = CpuFusedPass(model, stored, activations=activations)
    tokens = mx.random.randint(3, 259, (300,), key=mx.random.key(9)).tolist()
    _, cache = _prefilled(model, tokens[:284])
    widths = (16, 3)  # (AVX2: 2 tiles of 8 rows, accumulators in memory; 3 rows in registers)
    want = []
    for n in widths:
        want.append(np.array(fp(tokens[284:284 + n], cache).logits))
        for c in cache:
            c.trim(n)
    fp.lib = ctypes.CDLL(str(alt))
    fp.lib.specserve_cpu_pass.restype = ctypes.c_int
    fp.lib.specserve_cpu_threads(2)
    for n, logits in zip(widths, want):
        assert np.array_equal(np.array(fp(tokens[284:284 + n], cache).logits), logits), n
        for c in cache:
            c.trim(n)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the -mno-avx2/-mno-avx512f builds are x86 flags")
def test_integer_projections_every_leftover_block_count_every_build(tmp_path):
    """tests/native/qmv_exactness.c drives the integer projections directly over every input
    size of 1..40 blocks (so every count of blocks left past the whole groups of 16: 256-bit
    halves, 128-bit quarters, masked loads), group sizes 32/64/128, 4- and 8-bit codes, one and
    two digits, and 1..16 rows: in every build (this CPU's, without AVX-512, without AVX2) each
    row of an M-row projection equals its one-row projection, and all builds hash the outputs
    to the same bits."""
    import os
    import subprocess

    cc = os.environ.get("CC") or "cc"
    harness = Path(__file__).parent / "native" / "qmv_exactness.c"
    hashes = {}
    for flag in ("", "-mno-avx512f", "-mno-avx2"):
        exe = tmp_path / f"qmv{flag}"
        subprocess.run([cc, "-O2", "-march=native", *([flag] if flag else []), "-std=gnu11", "-pthread",
                        f'-DKERNEL_SOURCE="{fused_cpu._SOURCE}"', "-o", str(exe), str(harness), "-lm"],
                       check=True, capture_output=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=120).stdout
        *_, last = out.strip().splitlines()
        _, digest, _, bad = last.split()
        assert bad == "0", out
        hashes[flag or "native"] = digest
    assert len(set(hashes.values())) == 1, hashes


def test_prefill_through_the_pass_equals_decoding_the_prompt():
    """A runner whose CPU pass prefills takes a prompt 16 rows at a time (position 0 through
    mlx-lm's modules): the cache, the logits and the tapped hidden states equal feeding the
    prompt one decode step at a time, bit for bit, however the prompt is chunked; without
    logits the LM head is skipped and the cache is the same."""
    from drafters.dspark import TargetTaps

    model, stored = _models(4, 64, seed=8)
    runner = TargetRunner(model, fused=CpuFusedPass(model, stored))
    taps = TargetTaps(model, [0, 1])
    tokens = mx.random.randint(3, 259, (70,), key=mx.random.key(4)).tolist()
    stepped = runner.make_cache()
    steps = [runner.verify([t], stepped, taps) for t in tokens]
    want_logits = np.concatenate([np.array(s[0]) for s in steps])
    want_hidden = np.concatenate([np.array(s[1]) for s in steps])
    for chunks in ([70], [1, 69], [37, 33], [16, 16, 38]):
        cache, at, logits, hidden = runner.make_cache(), 0, [], []
        for n in chunks:
            lg, hd = runner.prefill(tokens[at:at + n], cache, taps)
            logits.append(np.array(lg))
            hidden.append(np.array(hd))
            at += n
        assert np.array_equal(np.concatenate(logits), want_logits), chunks
        assert np.array_equal(np.concatenate(hidden), want_hidden), chunks
        for c, s in zip(cache, stepped):
            assert c.offset == s.offset == 70
            assert np.array_equal(np.array(c.keys[..., :70, :]), np.array(s.keys[..., :70, :]))
            assert np.array_equal(np.array(c.values[..., :70, :]), np.array(s.values[..., :70, :]))
    cache = runner.make_cache()
    lg, hd = runner.prefill(tokens, cache, logits=False)
    assert lg is None and hd is None and cache[0].offset == 70
    assert np.array_equal(np.array(cache[0].keys[..., :70, :]), np.array(stepped[0].keys[..., :70, :]))


def test_tapped_rows_are_the_tapped_layers_side_by_side():
    """A fused pass's taps are, row by row, the tapped layers' hidden states side by side in the
    drafter's order ([rows, taps * hidden] float32), as DSpark's context projection reads them,
    the embeddings (layer -1) included."""
    from drafters.dspark import TargetTaps

    model, stored = _models(4, 64, seed=9)
    fp = CpuFusedPass(model, stored)
    _, cache = _prefilled(model, list(range(3, 40)))
    out = fp([7, 8, 9], cache)
    for ids in ([1, 0], [0, 1], [1], [-1, 1]):
        _, hidden = TargetRunner._fused_result(out, TargetTaps(model, ids))
        layers = [np.array(out.embeddings if i < 0 else out.hidden[i]) for i in ids]
        assert hidden.shape == (3, len(ids) * 320) and hidden.dtype == mx.float32
        assert np.array_equal(np.array(hidden), np.concatenate(layers, axis=-1)), ids


def test_layer_rows_join_to_the_laid_out_taps():
    """A cycle keeps its fused pass's tapped rows as LayerRows (a view, no copy); joined with
    other passes' rows and prompt rows, in order and cut to the committed rows, they equal the
    rows laid out pass by pass."""
    from drafters.dspark import TargetTaps
    from engine.runner import LayerRows, join_rows

    model, stored = _models(4, 64, seed=10)
    fp = CpuFusedPass(model, stored)
    runner = TargetRunner(model, fused=fp)
    taps = TargetTaps(model, [1, 0])
    _, cache = _prefilled(model, list(range(3, 30)))
    _, twin = _prefilled(model, list(range(3, 30)))
    prompt_rows = mx.random.normal((5, 2 * 320))
    entries, want = [prompt_rows], [np.array(prompt_rows)]
    for tokens, keep, as_rows in (([7, 8, 9], 2, True), ([4], 1, True), ([1, 2], 1, False), ([5, 6], 2, True)):
        _, rows = runner.verify(tokens, cache, taps, layer_rows=as_rows)  # (an array: a batched cycle's)
        _, laid_out = runner.verify(tokens, twin, taps)  # the same pass, laid out at once
        assert isinstance(rows, LayerRows) == as_rows and len(rows) == len(tokens)
        assert not isinstance(laid_out, LayerRows)
        entries.append(rows[:keep])
        want.append(np.array(laid_out)[:keep])
        runner.trim(cache, len(tokens) - keep)
        runner.trim(twin, len(tokens) - keep)
    joined = join_rows(entries)
    assert joined.shape == (5 + 6, 2 * 320)
    assert np.array_equal(np.array(joined), np.concatenate(want))
    with pytest.raises(ValueError):
        join_rows([])


def test_prefill_slices_stay_in_their_chunk_and_need_a_pass_that_splits():
    """``prefill_step(seq, max_rows)`` feeds at most ``max_rows`` tokens and never crosses a
    chunk boundary, with the cache, the prompt logprobs and the DSpark taps of whole chunks, bit
    for bit; a runner whose chunks must run whole (mlx-lm's modules) refuses slices."""
    from drafters.dspark import TargetTaps
    from engine import GenerationRequest
    from engine.generation import Sequence, prefill_step

    model, stored = _models(4, 64, seed=8)
    prompt = mx.random.randint(3, 259, (90,), key=mx.random.key(5)).tolist()
    runner = TargetRunner(model, prefill_step=40, fused=CpuFusedPass(model, stored))
    assert runner.prefill_slice_rows == 16

    def sequence(runner):  # (prefill reads no token table)
        request = GenerationRequest(prompt_tokens=prompt, max_tokens=4, logprobs=2, prompt_logprobs=True)
        return Sequence(request, runner, table=None, eos_token_ids=frozenset(), context_length=512, seed=0,
                        taps=TargetTaps(model, [0, 1]))

    seq, ends = sequence(runner), []
    while not seq.prefilled:
        prefill_step(seq, 32)
        ends.append(seq.num_prefilled)
        assert (seq.prefill_row_seconds is None) == (ends == [32])  # (not timed from position 0)
    assert ends == [32, 40, 72, 80, 90]  # (slices of <= 32 inside chunks of 40; the last prompt token is the anchor)
    whole = sequence(runner)
    while not whole.prefilled:
        prefill_step(whole)
    for a, b in zip(seq.cache, whole.cache):
        assert np.array_equal(np.array(a.keys[..., :89, :]), np.array(b.keys[..., :89, :]))
        assert np.array_equal(np.array(a.values[..., :89, :]), np.array(b.values[..., :89, :]))
    assert np.array_equal(np.array(seq.prompt_hidden()), np.array(whole.prompt_hidden()))
    assert [(lp.token, lp.logprob, lp.top) for lp in seq.prompt_logprobs] == \
        [(lp.token, lp.logprob, lp.top) for lp in whole.prompt_logprobs] and len(seq.prompt_logprobs) == 90
    with pytest.raises(ValueError, match="prefill slices"):
        prefill_step(sequence(runner), 20)
    plain = TargetRunner(model, prefill_step=40)
    assert plain.prefill_slice_rows is None
    with pytest.raises(ValueError, match="prefill slices"):
        prefill_step(sequence(plain), 16)


def test_prefill_slice_sizes_follow_the_budget():
    """Whole passes worth about ``prefill_slice_ms`` at the sequence's measured seconds per row
    (the engine's last measurement before its own, one pass before any), at least one pass;
    whole chunks where the runner cannot split them or the budget is 0."""
    from types import SimpleNamespace

    eng = Engine(EngineConfig(prefill_slice_ms=100.0))
    eng.runner = SimpleNamespace(prefill_slice_rows=16)

    def rows(own, engine_wide=None):
        eng._prefill_row_seconds = engine_wide
        return eng._prefill_slice(SimpleNamespace(prefill_row_seconds=own))

    assert rows(None) == 16 and rows(None, 1e-3) == 96  # (100 ms at 1 ms a row)
    assert rows(2e-3) == 48 and rows(2e-3, 1e-4) == 48 and rows(0.05) == 16 and rows(1e-4) == 992
    eng.config.prefill_slice_ms = 0
    assert rows(2e-3) is None
    eng.config.prefill_slice_ms = 100.0
    eng.runner = SimpleNamespace(prefill_slice_rows=None)
    assert rows(2e-3) is None


def test_a_long_prefill_runs_in_slices_while_another_stream_decodes(monkeypatch):
    """A prompt is prefilled in slices of whole passes (here one: the budget is tiny), so the
    stream beside it keeps stepping; outputs equal those of an engine that prefills whole
    chunks."""
    import threading

    from test_batching import collect

    import engine.engine as engine_module
    from engine import GenerationRequest, SamplingParams

    loaded = tiny_loaded(seed=4, head_dim=64, quantize_bits=4, dequantize=True)
    rng = np.random.default_rng(7)
    long_req = GenerationRequest(prompt_tokens=[int(t) for t in rng.integers(3, 259, 700)], max_tokens=8,
                                 sampling=SamplingParams(temperature=0.0))
    # (500 tokens: the short stream outlasts the long prompt's ~44 slices even if the thread that
    # submits the long request starts late)
    short_req = GenerationRequest(prompt_tokens=[5, 6, 7, 8, 9, 10] * 3, max_tokens=500,
                                  sampling=SamplingParams(temperature=0.0), ignore_eos=True,
                                  speculative=SpeculativeParams("off"))
    whole = _engine(loaded, speculation="auto", prefill_slice_ms=0)
    try:
        want = [collect(whole, long_req), collect(whole, short_req)]
    finally:
        whole.stop()
    calls = []
    steps = []  # in order: "long" per prefill step of the long prompt, "short" per decode step of the short one
    original = engine_module.prefill_step
    original_step = engine_module.speculative_step

    def recording(seq, max_rows=None):
        calls.append((len(seq.tokens), max_rows))
        steps.append("long" if seq.prompt_len == 700 else "other")
        return original(seq, max_rows)

    def recording_step(seq, cost):
        steps.append("short" if seq.prompt_len == len(short_req.prompt_tokens) else "other")
        return original_step(seq, cost)

    monkeypatch.setattr(engine_module, "prefill_step", recording)
    monkeypatch.setattr(engine_module, "speculative_step", recording_step)
    sliced = _engine(loaded, speculation="auto", prefill_slice_ms=1e-3)
    try:
        assert sliced.runner.prefill_slice_rows == 16
        first = sliced.generate(short_req, timeout=600)
        short_out = [next(first)]  # the short stream is decoding
        got_long = {}
        thread = threading.Thread(target=lambda: got_long.update(out=collect(sliced, long_req)))
        thread.start()
        short_out += list(first)
        thread.join()
        assert got_long["out"] == want[0]
        assert [t for e in short_out for t in e.token_ids] == want[1][0]
        long_calls = [rows for n, rows in calls if n == 700]
        assert len(long_calls) >= 699 // 16 and set(long_calls) == {16}, long_calls
        # the short stream kept decoding between the slices, not after the whole prompt
        first, last = steps.index("long"), len(steps) - 1 - steps[::-1].index("long")
        assert steps[first:last].count("short") >= len(long_calls) // 2, steps
    finally:
        sliced.stop()
