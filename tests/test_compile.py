"""Compiled target passes over the static KV cache (engine/static_cache.py): exactness.

The engine's other exactness tests run on this path too with ``SPECSERVE_COMPILE=on``.
"""

import random

import mlx.core as mx
import pytest
from helpers import pin_cost, run
from test_engine import prompts
from tiny import tiny_loaded

from drafters.dspark import TargetTaps
from engine import Engine, EngineConfig
from engine.runner import TargetRunner
from engine.static_cache import MIN_CAPACITY, CompiledPasses, StaticCache, bucket
from metal_kernels import backend, patch_model

# How far two float32 passes that attend a different number of query rows per call may differ
# (the bit-for-bit checks are separate): on the CPU MLX's attention rounds the same either way;
# on MLX-CUDA an attention call over several float32 rows rounds differently from a one-row
# call (up to 5e-4 on the tiny model's logits on an H200, twenty-first session).
ROUNDING = 2e-3 if backend() == "cuda" else 1e-4


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


@pytest.fixture(scope="module")
def exact_tiny(tiny):
    """The tiny model in the form whose verify rows can equal one-row decodes on this backend.

    On the CPU: the float32 model (OpenBLAS's sgemm keeps rows bit-identical up to the width
    calibration finds). On a GPU: the model quantized to 4 bits (group 32, 8-bit tied
    embedding, as the default model loads) with the small-batch kernels patched in. MLX-CUDA's
    float32 matmul gives rows that depend on the row count, so calibration of the float32
    model finds one exact row there and these tests would check nothing; the kernels' rows are
    bit-identical for 1..16 rows by construction (docs/kernels.md)."""
    if backend() == "cpu":
        return tiny
    loaded = tiny_loaded(quantize_bits=4)
    report = patch_model(loaded.model, mode="auto")
    assert report.patched, report.summary()
    return loaded


@pytest.fixture(scope="module")
def runners(exact_tiny):
    """(compiled runner, the same passes uncompiled) on the tiny model, batched attention."""
    tiny = exact_tiny
    runner = TargetRunner(tiny.model, compile=True, max_context=tiny.context_length)
    eager = CompiledPasses(runner.passes().forward, compile=False)
    return runner, eager


def _prefilled(runner, ids):
    cache = runner.make_cache()
    mx.eval(runner.prefill(ids, cache)[0])
    return cache


def _clone(cache: StaticCache) -> StaticCache:
    twin = StaticCache(len(cache.keys), cache.shape[1], cache.shape[3], cache.dtype, cache.capacity,
                       cache.limit)
    twin.keys, twin.values, twin.length = list(cache.keys), list(cache.values), cache.length
    return twin


def _equal(a, b) -> bool:
    return mx.array_equal(a, b).item()


def test_bucket_doubles_and_respects_the_context():
    assert [bucket(n) for n in (1, 256, 257, 600)] == [256, 256, 512, 1024]
    assert bucket(300, limit=400) == 400 and bucket(200, limit=400) == MIN_CAPACITY
    small = StaticCache(2, 1, 4, mx.float32, limit=100)
    assert small.capacity == 100
    small.length = 90
    small.reserve(10)
    assert small.capacity == 100


def test_compiled_passes_trace_each_shape_once(exact_tiny):
    """The passes really are compiled: the Python forward runs once per pass shape (its trace),
    not on every call as the uncompiled passes would. (Every other test here compares compiled
    against uncompiled results, which also agree if nothing was compiled.)"""
    runner = TargetRunner(exact_tiny.model, compile=True, max_context=exact_tiny.context_length)
    passes = runner.passes()
    real, rows = passes.forward, []

    def forward(ids, layers):
        rows.append(ids.shape[1])
        return real(ids, layers)

    passes.forward = forward
    cache = runner.make_cache()
    mx.eval(runner.prefill(_ids(30, 1), cache)[0])
    for t in _ids(5, 2):
        mx.eval(runner.verify([t], cache)[0])
    for _ in range(3):
        mx.eval(runner.verify(_ids(3, 3), cache)[0])
        runner.trim(cache, 3)
    assert rows == [1, 3], rows


def test_compiled_decode_equals_uncompiled_static_pass_bit_for_bit(runners):
    runner, eager = runners
    for seed in range(4):
        ids = _ids(30 + 17 * seed, seed)
        a = _prefilled(runner, ids[:-6])
        b = _clone(a)
        for t in ids[-6:]:  # decode steps, then a 5-row verify
            la, lb = runner.passes().run([t], a, False)[0], eager.run([t], b, False)[0]
            assert _equal(la, lb)
        rows = _ids(5, 100 + seed)
        assert _equal(runner.passes().run(rows, a, False)[0], eager.run(rows, b, False)[0])
        assert all(_equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


@pytest.fixture(scope="module")
def calibrated(exact_tiny):
    """A compiled runner after the engine's start-up calibration, and its result."""
    tiny = exact_tiny
    runner = TargetRunner(tiny.model, compile=True, max_context=tiny.context_length)
    return runner, runner.calibrate(tiny.config["vocab_size"], max_rows=16, mode="batched", contexts=(40, 300))


def test_verify_rows_equal_one_row_decode_in_the_compiled_path(calibrated):
    """After calibration in ``batched`` mode (batched attention up to its exact width at the
    probed contexts, per-row attention inside the compiled graph beyond it), every row of every
    width equals a one-row decode bit for bit."""
    runner, cal = calibrated
    # same widths as the eager path on this machine (OpenBLAS bounds both); both modes in use
    assert cal.max_rows > cal.batched_rows >= 1 and cal.max_rows >= 4, cal.summary()
    for seed, width in enumerate((2, cal.batched_rows, cal.batched_rows + 1, cal.max_rows)):
        _assert_verify_rows_equal_decodes(runner, width, seed, 10 + seed, 20 + seed)


def _assert_verify_rows_equal_decodes(runner, width, seed, prompt_seed, block_seed):
    """A ``width``-row verify after a prompt of ``40 + 31 * seed`` tokens, then each of its
    tokens as a one-row decode at the same position: bit-identical logits row by row."""
    cache = _prefilled(runner, _ids(40 + 31 * seed, prompt_seed))
    block = _ids(width, block_seed)
    rows = runner.verify(block, cache)[0]
    runner.trim(cache, width)
    for i, t in enumerate(block):
        assert _equal(runner.verify([t], cache)[0][0], rows[i]), (width, i)


def test_padded_one_row_attention_keeps_decode_and_verify_rows_identical(exact_tiny, monkeypatch):
    """With ``PAD_ONE_ROW`` (CUDA's setting: a lone query row is attended as row 0 of a two-row
    call, see engine/exact_attention.py), a one-row decode still agrees with the unpadded pass to
    rounding, and after calibration every verify row equals a one-row decode bit for bit.

    On this CPU a one-row and a two-row attention call give the same bits, so MLX's attention is
    wrapped to add ``1e-3 x (query rows)``: a decode row and a verify row then agree only where
    they make the same call (a padded decode against an unpadded row-exact loop, or the reverse,
    leaves calibration 2 exact rows at most)."""
    from engine import exact_attention
    tiny = exact_tiny
    cache_ids = _ids(60, 31)
    plain = TargetRunner(tiny.model, compile=True, max_context=tiny.context_length)
    ref = plain.verify(cache_ids[-1:], _prefilled(plain, cache_ids[:-1]))[0]
    short_ref = plain.verify(cache_ids[1:2], _prefilled(plain, cache_ids[:1]))[0]
    monkeypatch.setattr(exact_attention, "PAD_ONE_ROW", True)
    monkeypatch.setattr(exact_attention, "PAD_DTYPES", (mx.float32,))
    runner = TargetRunner(tiny.model, compile=True, max_context=tiny.context_length)
    padded = runner.verify(cache_ids[-1:], _prefilled(runner, cache_ids[:-1]))[0]
    assert mx.allclose(padded, ref, rtol=ROUNDING, atol=ROUNDING).item()
    # a one-token prefill chunk through the static cache (mlx-lm's mask, no array) is not padded
    short = runner.verify(cache_ids[1:2], _prefilled(runner, cache_ids[:1]))[0]
    assert mx.allclose(short, short_ref, rtol=ROUNDING, atol=ROUNDING).item()
    # (which the checks above cannot tell from no padding at all:) a lone decode's attention
    # calls really receive two query rows
    sdpa, rows = mx.fast.scaled_dot_product_attention, []
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: rows.append(q.shape[2]) or sdpa(q, k, v, **kw))
    fresh = TargetRunner(tiny.model, compile=True, max_context=tiny.context_length)
    cache = _prefilled(fresh, cache_ids[:-1])
    rows.clear()
    mx.eval(fresh.verify(cache_ids[-1:], cache)[0])
    assert rows and set(rows) == {2}, rows

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: sdpa(q, k, v, **kw) + 1e-3 * q.shape[2])
    runner = TargetRunner(tiny.model, compile=True, max_context=tiny.context_length)
    cal = runner.calibrate(tiny.config["vocab_size"], max_rows=8, mode="batched", contexts=(40, 300))
    assert cal.max_rows >= 4 and cal.batched_rows <= 2, cal.summary()
    for seed, width in enumerate(sorted({2, cal.batched_rows + 1, cal.max_rows} - {1})):
        _assert_verify_rows_equal_decodes(runner, width, seed, 50 + seed, 60 + seed)


def test_rollback_leaves_no_trace(runners):
    """Decode after a rejected 6-row verify equals decode on a cache that never saw it."""
    runner = runners[0]
    ids = _ids(50, 3)
    clean = _prefilled(runner, ids)
    dirty = _clone(clean)
    runner.verify(_ids(6, 4), dirty)
    runner.trim(dirty, 6)
    assert dirty.length == clean.length
    for t in _ids(4, 5):
        assert _equal(runner.verify([t], dirty)[0], runner.verify([t], clean)[0])


def test_capacity_grows_across_a_bucket_mid_generation(runners):
    runner, eager = runners
    ids = _ids(MIN_CAPACITY - 3, 6)
    cache = _prefilled(runner, ids[:-1])
    twin = _clone(cache)
    tok, seen = ids[-1], []
    for _ in range(8):  # crosses 256 -> 512 on the 3rd step
        logits = runner.verify([tok], cache)[0]
        assert _equal(logits, eager.run([tok], twin, False)[0])
        tok = mx.argmax(logits[0]).item()
        seen.append(cache.capacity)
    assert seen[0] == MIN_CAPACITY and seen[-1] == 2 * MIN_CAPACITY
    # the grown cache holds what an eager (mlx-lm cache) decode of the same tokens gives
    plain = TargetRunner(runner.model)
    ref = plain.make_cache()
    mx.eval(plain.prefill(ids[:-1], ref)[0])
    tok, want = ids[-1], []
    for _ in range(8):
        tok = mx.argmax(plain.verify([tok], ref)[0][0]).item()
        want.append(tok)
    got, tok = [], ids[-1]
    fresh = _prefilled(runner, ids[:-1])
    for _ in range(8):
        tok = mx.argmax(runner.verify([tok], fresh)[0][0]).item()
        got.append(tok)
    assert got == want


def test_dspark_taps_through_the_compiled_path(exact_tiny, calibrated):
    runner, cal = calibrated
    tiny = exact_tiny
    taps = TargetTaps(tiny.model, [0, 1])
    ids = _ids(60, 7)
    plain = TargetRunner(tiny.model)
    ref = plain.make_cache()
    mx.eval(plain.prefill(ids, ref, taps))
    cache = _prefilled(runner, ids)
    block = _ids(cal.max_rows, 8)
    logits, hidden = runner.verify(block, cache, taps)
    ref_logits, ref_hidden = plain.verify(block, ref, taps)
    assert hidden.shape == (len(block), 2 * tiny.config["hidden_size"]) and hidden.dtype == mx.float32
    assert mx.allclose(hidden, ref_hidden, atol=ROUNDING).item()
    assert mx.argmax(logits, -1).tolist() == mx.argmax(ref_logits, -1).tolist()
    runner.trim(cache, len(block))
    for i, t in enumerate(block):  # rows with taps equal one-row decodes with taps, bit for bit
        lg, hd = runner.verify([t], cache, taps)
        assert _equal(lg[0], logits[i]) and _equal(hd[0], hidden[i])


@pytest.fixture(scope="module")
def engines(exact_tiny):
    # exact_tiny is already patched on a GPU (kernels "auto" would find nothing left to swap)
    made = {mode: Engine(EngineConfig(speculation="prompt_lookup", compile=mode, kernels="off", fused="off",
                                      calibration_contexts=(40, 300)),
                         loaded=exact_tiny).start(wait=True, timeout=600) for mode in ("on", "off")}
    pin_cost(made.values())  # (the drafting must not depend on how fast this machine timed the widths)
    yield made
    for eng in made.values():
        eng.stop()


def test_engine_compiled_matches_eager_and_plain_greedy(engines):
    """Many prompts: compiled speculative == compiled plain == eager plain, token for token."""
    on, off = engines["on"], engines["off"]
    assert on.runner.compiled and not off.runner.compiled
    accepted = 0
    for p in prompts(30, seed=5):
        plain_on, _, _ = run(on, p, "off", max_tokens=40)
        spec_on, _, last = run(on, p, "prompt_lookup", max_tokens=40)
        plain_off, _, _ = run(off, p, "off", max_tokens=40)
        assert spec_on == plain_on == plain_off
        accepted += last.stats.total.num_accepted_tokens
    assert accepted > 30


def test_request_cache_is_sized_up_front_so_verify_rows_equal_decodes_across_a_bucket_edge(calibrated):
    """A verify pass crossing the 512 edge leaves the capacity where a decode would find it (the
    cache is sized for the whole request), and its rows equal one-row decodes bit for bit."""
    runner, cal = calibrated
    ids = _ids(505, 21)
    cache = runner.make_cache(505 + 24 + 64)
    capacity = cache.capacity
    assert capacity == bucket(505 + 24 + 64) == 1024
    mx.eval(runner.prefill(ids, cache)[0])
    block = _ids(min(8, cal.max_rows), 22)  # positions 505..512: across the edge
    rows = runner.verify(block, cache)[0]
    mx.eval(rows)
    assert cache.capacity == capacity and cache.length == 505 + len(block)
    runner.trim(cache, len(block))
    for i, t in enumerate(block):
        row = runner.verify([t], cache)[0][0]
        assert _equal(row, rows[i]), i
    assert cache.capacity == capacity


def test_compile_on_fails_loudly_when_the_static_cache_cannot_serve(tiny, monkeypatch):
    import engine.runner as runner_module

    def unsupported(model):
        raise ValueError("mixed K/V shapes")

    monkeypatch.setattr(Engine, "__init__", getattr(Engine, "_unforced_init", Engine.__init__))
    monkeypatch.setattr(runner_module, "kv_layout", unsupported)
    cfg = dict(speculation="off", calibration_contexts=(40,), warmup=False)
    forced = Engine(EngineConfig(compile="on", **cfg), loaded=tiny).start()
    try:
        with pytest.raises(RuntimeError, match="mixed K/V shapes"):
            forced.wait_ready(300)
    finally:
        forced.stop()
    auto = Engine(EngineConfig(compile="auto", **cfg), loaded=tiny).start(wait=True, timeout=300)
    try:  # auto = eager passes (measured faster everywhere so far)
        assert auto.ready and not auto.runner.compiled and auto.info()["compiled_passes"] is False
    finally:
        auto.stop()
