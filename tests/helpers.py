"""Small helpers for driving the engine synchronously in tests."""

from __future__ import annotations

from engine import GenerationRequest, SamplingParams, SpeculativeParams


def run(engine, prompt_tokens, method="off", max_tokens=32, temperature=0.0, seed=None, **kw):
    """Generate one sequence; returns (token ids, text, last event)."""
    sampling = kw.pop("sampling", None) or SamplingParams(temperature=temperature, seed=seed,
                                                          **kw.pop("sampling_kw", {}))
    speculative = kw.pop("speculative", None) or SpeculativeParams(method=method)
    req = GenerationRequest(prompt_tokens=list(prompt_tokens), max_tokens=max_tokens, sampling=sampling,
                            speculative=speculative, **kw)
    events = list(engine.generate(req, timeout=600))
    assert events[-1].error is None, events[-1].error
    ids = [t for e in events for t in e.token_ids]
    return ids, "".join(e.text for e in events), events[-1]


def pin_cost(engines, row_share: float = 0.05) -> None:
    """Replace each engine's measured cost curve by a fixed one, ``T(k) = 1 ms (1 + row_share
    (k - 1))`` up to the exact verify width calibration found, with no context term and no online
    refresh. If an engine has no exact verify width to pin, every engine given is stopped before
    the error is raised, so a failing fixture leaves no worker thread behind.

    How much the scheduler drafts then depends on the outputs alone, not on how fast the machine
    timed the widths at start-up: CI's 2-core runner, loaded by another test worker, once timed a
    curve so steep that a compiled engine drafted nothing in 30 requests."""
    engines = list(engines)
    try:
        for engine in engines:
            cost = engine.cost
            assert cost.max_rows > 1, engine.calibration
            cost.reset([1e-3 * (1 + row_share * k) for k in range(cost.max_rows)])
            cost.context_slope = cost.context_row_slope = 0.0
            cost.alpha = 0.0
    except BaseException:
        for engine in engines:
            engine.stop()
        raise


def pass_logits(engine, prompt: list[int], tails: list[list[int]]) -> list:
    """For each tail, the float32 logits ``[1 + len(tail), V]`` of a verify pass over
    ``[prompt[-1], *tail]`` after ``prompt[:-1]``, computed as the engine computes them: its
    fused pass where it has one, its calibrated attention mode and row kernel, and the prompt
    prefilled in the engine's chunks (``[j S, (j + 1) S)`` for its ``prefill_step`` S, as
    ``engine.generation.prefill_step`` cuts them). On eager and fused passes these are the rows the
    engine samples from, bit for bit (a row depends on its own tokens only, whichever other rows
    or sequences share its pass); with compiled passes (static caches) they may differ from the
    engine's in the last bits, the cache's capacity being sized differently. Call it while the
    engine is idle (before or between requests): it uses the engine's fused pass object."""
    import mlx.core as mx

    from engine.runner import TargetRunner

    ref = engine.runner
    runner = TargetRunner(engine.loaded.model, prefill_step=ref.prefill_step, compile=ref.compiled,
                          max_context=ref.max_context, fused=ref.fused)
    runner.row_exact_attention, runner.batched_rows = ref.row_exact_attention, ref.batched_rows
    runner.row_kernel = ref.row_kernel
    cache = runner.make_cache()
    end, step = len(prompt) - 1, ref.prefill_step
    for start in range(0, end, step):
        runner.prefill(prompt[start:min(start + step, end)], cache, logits=False)
        mx.eval(runner.cache_arrays(cache))
    out = []
    for tail in tails:
        rows = [prompt[-1], *tail]
        logits = runner.verify(rows, cache)[0]
        mx.eval(logits)
        out.append(logits)
        runner.trim(cache, len(rows))
    return out


def generate_all(engine, requests, workers: int = 8) -> list[list]:
    """Each request's events, the requests run ``workers`` at a time (the engine batches
    them); the order of the result is the order of ``requests``. For the statistical tests'
    20k short requests: 10-25% faster than one at a time on a 2-vCPU machine (each request's
    prefill and first cycle still run alone)."""
    from concurrent.futures import ThreadPoolExecutor

    def events(request):
        out = list(engine.generate(request, timeout=600))
        assert out[-1].error is None, out[-1].error
        return out

    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(events, request) for request in requests]
        try:
            return [f.result() for f in futures]
        except BaseException:  # report the first failure now, not after the other 20k requests
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def assert_no_leaks(engine, timeout: float = 10.0) -> None:
    """Every per-request map of the engine is empty once all requests have ended."""
    import time

    deadline = time.monotonic() + timeout
    while not engine.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # let the worker finish the step it is in
    with engine._lock:
        assert not engine._live and not engine._cancelled and not engine._abort_errors
        assert engine._queued == 0
    assert not engine._active and not engine._waiting


def assert_pass_matches_mlx_lm(model, fused_pass, prompt, rows, prefilled) -> None:
    """A one-call pass (CUDA ``FusedPass`` or ``CpuFusedPass``) of ``rows`` after ``prompt``:
    logits, every layer's output and the appended keys/values agree with mlx-lm's own forward of
    the same rows (to rounding: the reductions differ). ``prefilled(model, tokens)`` returns
    ``(runner, cache)`` holding ``tokens``."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    _, eager_cache = prefilled(model, prompt)
    h = model.model.embed_tokens(mx.array(rows)[None])
    mask = create_attention_mask(h, eager_cache[0])
    hidden = []
    for layer, c in zip(model.model.layers, eager_cache):
        h = layer(h, mask, cache=c)
        hidden.append(h[0])
    logits = model.model.embed_tokens.as_linear(model.model.norm(h))[0]
    _, cache = prefilled(model, prompt)
    out = fused_pass(rows, cache)
    mx.eval(out.logits, out.hidden)
    fused_pass.check(out)
    assert out.logits.shape == logits.shape and out.hidden.shape == (len(hidden), *hidden[0].shape)
    scale = mx.abs(logits).max().item()
    assert mx.abs(out.logits - logits).max().item() < 1e-4 * scale
    for layer, want in enumerate(hidden):
        assert mx.allclose(out.hidden[layer], want, rtol=1e-4, atol=1e-4).item(), layer
    assert cache[0].offset == eager_cache[0].offset == len(prompt) + len(rows)
    for c, e in zip(cache, eager_cache):
        n = e.offset
        assert mx.allclose(c.keys[..., :n, :], e.keys[..., :n, :], rtol=1e-4, atol=1e-4).item()
        assert mx.allclose(c.values[..., :n, :], e.values[..., :n, :], rtol=1e-4, atol=1e-4).item()


def assert_writes_only_its_own_buffers(model, fused_pass, prefilled) -> None:
    """A one-call pass appends keys/values into the cache buffers in place. A prefix-cache hit
    leaves views of stored arrays: the launcher copies them into buffers of the cache's own
    first, so the stored arrays keep their bits; later passes reuse that buffer (no copy) until
    it is full, then it grows by KVCache.step keeping every row."""
    import mlx.core as mx
    import numpy as np

    runner, cache = prefilled(model, list(range(3, 253)))  # 250 cached rows
    stored = [(mx.concatenate([c.keys[..., :250, :], mx.ones_like(c.keys[..., :6, :])], axis=2),
               mx.concatenate([c.values[..., :250, :], mx.ones_like(c.values[..., :6, :])], axis=2)) for c in cache]
    mx.eval(stored)
    snapshot = [(np.array(k), np.array(v)) for k, v in stored]
    for c, (k, v) in zip(cache, stored):
        c.state = (k[..., :250, :], v[..., :250, :], 250)  # views of the stored arrays
    _, reference = prefilled(model, list(range(3, 253)))
    mx.eval(fused_pass([5, 6, 7], cache).logits)
    for (k, v), (k0, v0) in zip(stored, snapshot):
        assert np.array_equal(np.array(k), k0) and np.array_equal(np.array(v), v0)
    owned = [c.keys for c in cache]
    assert all(c.keys.shape[2] == 256 and c.offset == 253 for c in cache)
    mx.eval(fused_pass([8, 9, 10], cache).logits)  # 256 rows: fits, same buffers
    assert all(c.keys is k for c, k in zip(cache, owned))
    mx.eval(fused_pass([11], cache).logits)  # 257: grows
    assert all(c.keys.shape[2] == 512 and c.offset == 257 for c in cache)
    mx.eval(runner.prefill([5, 6, 7, 8, 9, 10, 11], reference)[0])
    for c, r in zip(cache, reference):  # the copied rows keep their bits; the new ones agree to rounding
        assert mx.array_equal(c.keys[..., :250, :], r.keys[..., :250, :]).item()
        assert mx.array_equal(c.values[..., :250, :], r.values[..., :250, :]).item()
        assert mx.allclose(c.keys[..., 250:257, :], r.keys[..., 250:257, :], rtol=1e-3, atol=1e-3).item()
        assert mx.allclose(c.values[..., 250:257, :], r.values[..., 250:257, :], rtol=1e-3, atol=1e-3).item()
