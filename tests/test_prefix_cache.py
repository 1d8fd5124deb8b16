"""Prefix cache: whole prefill chunks reused across requests, bit-identical to a cold prefill."""

import random
import time

import httpx
import mlx.core as mx
import pytest
from conftest import tiny_live_server
from dspark_helpers import make_drafter
from helpers import run
from test_server import metric, post, sse_events

from engine import (
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeParams,
)
from engine.exact_attention import ExactKVCache
from engine.prefix_cache import PrefixCache

BLOCK = 16


def kv_cache(tokens: int, layers: int = 2, seed: int = 0) -> list:
    """Per-layer caches holding ``tokens`` positions of random keys/values ([1, 2, S, 4])."""
    cache = []
    for i in range(layers):
        c = ExactKVCache()
        k, v = mx.random.normal((2, 1, 2, tokens, 4), key=mx.random.key(seed * 1000 + i))
        c.update_and_fetch(k, v)
        cache.append(c)
    return cache


def test_whole_chunks_only_and_longest_prefix():
    pc = PrefixCache(BLOCK, 1 << 30)
    prompt = list(range(100, 150))  # 50 tokens: 49 prefillable, 48 in whole chunks
    cache = kv_cache(49)
    assert pc.insert(prompt, cache, None, taps=False) == 48
    assert pc.insert(prompt, cache, None, taps=False, already=48) == 0  # nothing new

    # A prompt sharing 40 tokens gets 32 (the whole chunks inside the shared part), bit for bit.
    hit = pc.fetch(prompt[:40] + [7] * 30, taps=False)
    assert hit.num_tokens == 32 and all(c.offset == 32 for c in hit.cache)
    for got, ref in zip(hit.cache, cache):
        assert mx.array_equal(got.keys[..., :32, :], ref.keys[..., :32, :]).item()
        assert mx.array_equal(got.values[..., :32, :], ref.values[..., :32, :]).item()

    # Sharing exactly the stored 48 with a longer prompt keeps all 48 (not one chunk less).
    assert pc.fetch(prompt[:48] + [1] * 20, taps=False).num_tokens == 48
    # A prompt whose prefillable part is a whole chunk shorter than the entry: 32 of 48.
    assert pc.fetch(prompt[:33], taps=False).num_tokens == 32
    # Under one chunk shared, or another salt / the taps namespace: misses.
    assert pc.fetch(prompt[:15] + [1] * 40, taps=False) is None
    assert pc.fetch(prompt, taps=False, salt="tenant-b") is None
    assert pc.fetch(prompt, taps=True) is None
    info = pc.info()
    assert info["hits"] == 32 + 48 + 32 and info["queries"] == 70 + 68 + 33 + 55 + 50 + 50
    assert info["entries"] == 1 and info["bytes"] == 2 * 2 * (2 * 48 * 4) * 4  # layers, k/v, [2, 48, 4] float32


def test_fetched_cache_is_a_copy():
    pc = PrefixCache(BLOCK, 1 << 30)
    prompt = list(range(40))
    pc.insert(prompt, kv_cache(39), None, taps=False)
    first = pc.fetch(prompt, taps=False)
    before = mx.array(first.cache[0].keys[..., :32, :])
    k, v = mx.ones((2, 1, 2, 5, 4))
    first.cache[0].trim(10)
    first.cache[0].update_and_fetch(k, v)  # the live request writes over positions 22..26
    again = pc.fetch(prompt, taps=False)
    assert mx.array_equal(again.cache[0].keys[..., :32, :], before).item()


def test_taps_rows_follow_the_kv():
    pc = PrefixCache(BLOCK, 1 << 30)
    prompt = list(range(60))
    hidden = mx.arange(59 * 3, dtype=mx.float32).reshape(59, 3)
    with pytest.raises(ValueError):
        pc.insert(prompt, kv_cache(59), None, taps=True)
    assert pc.insert(prompt, kv_cache(59), hidden, taps=True) == 48
    hit = pc.fetch(prompt[:35] + [9] * 10, taps=True)
    assert hit.num_tokens == 32 and mx.array_equal(hit.hidden, hidden[:32]).item()
    assert pc.fetch(list(range(1, 60)), taps=True) is None and pc.fetch(prompt, taps=True, salt="b") is None


def test_plain_requests_read_tapped_entries_and_take_the_longer_match():
    """A tapped entry's KV serves a request without taps (hidden rows left out; same salt only),
    never the reverse; between a plain and a tapped entry the longer match wins, and a hit that
    uses a whole tapped entry refreshes it in its own namespace."""
    one = 2 * 2 * (2 * BLOCK * 4) * 4  # one chunk of KV: layers, k/v, [2, BLOCK, 4] float32
    pc = PrefixCache(BLOCK, 1 << 30)
    prompt = list(range(300, 360))
    tapped = kv_cache(59, seed=1)
    assert pc.insert(prompt, tapped, mx.zeros((59, 3)), taps=True) == 48
    hit = pc.fetch(prompt, taps=False)
    assert hit.num_tokens == 48 and hit.hidden is None and len(hit.cache) == len(tapped)
    for got, ref in zip(hit.cache, tapped):
        assert mx.array_equal(got.keys, ref.keys[..., :48, :]).item()
        assert mx.array_equal(got.values, ref.values[..., :48, :]).item()
    assert pc.fetch(prompt, taps=False, salt="tenant-b") is None

    plain = kv_cache(59, seed=2)
    assert pc.insert(prompt[:2 * BLOCK + 1], plain, None, taps=False) == 2 * BLOCK
    assert pc.fetch(prompt[:40], taps=True).hidden.shape == (32, 3)  # (only the tapped entry is read)
    hit = pc.fetch(prompt, taps=False)  # tapped: 48 positions, plain: 32
    assert hit.num_tokens == 48 and mx.array_equal(hit.cache[0].keys, tapped[0].keys[..., :48, :]).item()
    hit = pc.fetch(prompt[:2 * BLOCK + 1], taps=False)  # 32 each: either holds the same bits in use
    assert hit.num_tokens == 2 * BLOCK
    pc = PrefixCache(BLOCK, 1 << 30)  # the plain entry longer
    pc.insert(prompt[:2 * BLOCK + 1], tapped, mx.zeros((59, 3)), taps=True)
    pc.insert(prompt, plain, None, taps=False)
    hit = pc.fetch(prompt, taps=False)
    assert hit.num_tokens == 48 and mx.array_equal(hit.cache[0].keys, plain[0].keys[..., :48, :]).item()

    # The tapped entry, used whole by a plain request, becomes the most recent: a third entry
    # then evicts the plain one.
    pc = PrefixCache(BLOCK, 5 * one + 48 * 3 * 4)  # room for the first two entries
    pc.insert(prompt, tapped, mx.zeros((59, 3)), taps=True)  # 3 chunks + hidden rows
    other = [7] * (2 * BLOCK + 1)
    pc.insert(other, kv_cache(2 * BLOCK), None, taps=False)  # 2 chunks
    assert pc.fetch(prompt, taps=False).num_tokens == 48
    pc.insert([8] * (2 * BLOCK + 1), kv_cache(2 * BLOCK), None, taps=False)  # over the budget
    assert pc.fetch(prompt, taps=False) is not None and pc.fetch(other, taps=False) is None


def test_storable_counts_what_insert_stores_with_and_without_taps():
    """A waiting request counts on :meth:`PrefixCache.storable` positions of an owner's prompt:
    exactly what :meth:`PrefixCache.insert` then stores, tapped hidden rows sharing the budget."""
    one = 2 * 2 * (2 * BLOCK * 4) * 4  # one chunk of KV: layers, k/v, [2, BLOCK, 4] float32
    prompt = list(range(500, 500 + 4 * BLOCK + 1))
    for taps in (False, True):
        pc = PrefixCache(BLOCK, 3 * one + 100)  # 3 chunks of KV; 2 with 3 float32 hidden values a row
        cache = kv_cache(4 * BLOCK)
        hidden = mx.zeros((4 * BLOCK, 3)) if taps else None
        expected = pc.storable(len(prompt), cache, hidden_bytes=3 * 4 if taps else 0)
        assert expected == pc.insert(prompt, cache, hidden, taps=taps) == (2 if taps else 3) * BLOCK


def test_a_hit_holds_only_the_rows_it_uses_and_refreshes_a_whole_entry():
    one = 2 * 2 * (2 * BLOCK * 4) * 4  # one stored chunk: layers, k/v, [2, BLOCK, 4] float32
    pc = PrefixCache(BLOCK, 3 * one)
    long = list(range(200, 200 + 4 * BLOCK + 1))  # 4 chunks
    pc.insert(long, kv_cache(4 * BLOCK), None, taps=False)
    assert pc.info()["entries"] == 1 and pc.info()["bytes"] == 3 * one  # only the 3 chunks that fit
    hit = pc.fetch(long[:BLOCK + 3], taps=False)  # uses 1 chunk of the 3-chunk entry
    assert hit.num_tokens == BLOCK and all(c.keys.shape[2] == BLOCK for c in hit.cache)
    # a: 1 chunk, b: 1 chunk; a reused whole stays, b (stored after a) goes when c arrives
    a, b, c = ([i] * (BLOCK + 1) for i in (1, 2, 3))
    pc = PrefixCache(BLOCK, 2 * one)
    pc.insert(a, kv_cache(BLOCK), None, taps=False)
    pc.insert(b, kv_cache(BLOCK), None, taps=False)
    assert pc.fetch(a, taps=False).num_tokens == BLOCK
    pc.insert(c, kv_cache(BLOCK), None, taps=False)
    assert pc.fetch(a, taps=False) is not None and pc.fetch(b, taps=False) is None
    assert pc.info()["bytes"] == 2 * one


def test_byte_budget_evicts_least_recent():
    one = 2 * 2 * (2 * BLOCK * 4) * 4  # one stored chunk: layers, k/v, [2, BLOCK, 4] float32
    pc = PrefixCache(BLOCK, 2 * one + 1)
    prompts = [[i] * (BLOCK + 1) for i in range(3)]
    for p in prompts:
        pc.insert(p, kv_cache(BLOCK), None, taps=False)
    assert pc.info()["entries"] == 2 and pc.info()["bytes"] <= 2 * one + 1
    assert pc.fetch(prompts[0], taps=False) is None  # the oldest went
    assert pc.fetch(prompts[2], taps=False).num_tokens == BLOCK


def test_only_plain_kv_caches_are_supported():
    assert PrefixCache.supports(kv_cache(4))
    from engine.static_cache import StaticCache

    assert not PrefixCache.supports(StaticCache(2, 2, 4, mx.float32))
    assert not PrefixCache.supports([object()])


# ---- in the engine -----------------------------------------------------------------------------


def session_prompts(seed: int) -> list[list[int]]:
    """A multi-turn session: each prompt is the previous one plus an answer and a new question;
    and a few prompts that share only a system prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 259) for _ in range(37)]
    out, convo = [], list(system)
    for _ in range(4):
        convo = convo + [rng.randrange(3, 259) for _ in range(rng.randint(5, 30))]
        out.append(list(convo))
    pattern = [rng.randrange(3, 259) for _ in range(5)]
    out += [system + pattern * rng.randint(2, 6) + [rng.randrange(3, 259)] for _ in range(3)]
    return out


def count_prefill_rows(monkeypatch, eng, starts: list | None = None) -> list[int]:
    """Wrap ``eng``'s runner.prefill (until the test ends): the list each call appends its row
    count to, and ``starts`` (when given) each call's ``(cache offset, rows)``. A hit must skip
    its cached rows, not only report them in ``cached_tokens``."""
    rows = []
    prefill = eng.runner.prefill

    def counting_prefill(tokens, cache, *args, **kwargs):
        rows.append(len(tokens))
        if starts is not None:
            starts.append((cache[0].offset, len(tokens)))
        return prefill(tokens, cache, *args, **kwargs)

    monkeypatch.setattr(eng.runner, "prefill", counting_prefill)
    return rows


@pytest.fixture(scope="module")
def engines(tiny):
    cfg = dict(speculation="auto", prefill_step=BLOCK, calibration_contexts=(40, 300))
    cold = Engine(EngineConfig(prefix_cache_bytes=0, **cfg), loaded=tiny).start(wait=True, timeout=300)
    warm = Engine(EngineConfig(**cfg), loaded=tiny).start(wait=True, timeout=300)
    yield cold, warm
    cold.stop()
    warm.stop()


def test_warm_output_equals_cold_output(engines, monkeypatch):
    cold, warm = engines
    rows = count_prefill_rows(monkeypatch, warm)
    cached = []
    for seed in range(3):
        for p in session_prompts(seed):
            for method in ("off", "auto"):
                kw = dict(max_tokens=24, logprobs=3)
                ids, text, last = run(cold, p, method, **kw)
                rows.clear()
                w_ids, w_text, w_last = run(warm, p, method, **kw)
                assert (w_ids, w_text) == (ids, text)
                assert last.cached_tokens == 0
                assert w_last.cached_tokens % BLOCK == 0 and w_last.cached_tokens < len(p)
                assert sum(rows) == len(p) - 1 - w_last.cached_tokens  # (the anchor is never prefilled)
                cached.append(w_last.cached_tokens)
    assert sum(c > 0 for c in cached) >= len(cached) // 2
    info = warm.prefix_cache_info()
    assert info["hits"] == sum(cached) and info["entries"] >= 1 and cold.prefix_cache_info() is None


def test_warm_logprobs_and_seeded_samples_equal_cold(engines, monkeypatch):
    cold, warm = engines
    p = session_prompts(11)[-1]
    run(warm, p, "off", max_tokens=1)  # store its chunks
    rows = count_prefill_rows(monkeypatch, warm)
    for temperature, seed in ((0.0, None), (0.9, 1234)):
        outs = []
        rows.clear()
        for eng in (cold, warm):
            req = GenerationRequest(prompt_tokens=p, max_tokens=20, logprobs=4,
                                    sampling=SamplingParams(temperature=temperature, seed=seed),
                                    speculative=SpeculativeParams("auto"))
            events = list(eng.generate(req, timeout=600))
            lps = [(lp.token, lp.logprob, lp.top) for e in events for lp in (e.logprobs or [])]
            outs.append(([t for e in events for t in e.token_ids], lps, events[-1].cached_tokens))
        (ids, lps, c0), (w_ids, w_lps, c1) = outs
        assert w_ids == ids and w_lps == lps  # floats compared exactly
        assert c0 == 0 and c1 == (len(p) - 1) // BLOCK * BLOCK
        assert sum(rows) == len(p) - 1 - c1  # the warm run prefilled only the uncached rest


def test_prompt_logprobs_prefill_from_scratch(engines):
    cold, warm = engines
    p = session_prompts(12)[0]
    run(warm, p, "off", max_tokens=1)
    outs = []
    for eng in (cold, warm):
        req = GenerationRequest(prompt_tokens=p, max_tokens=3, logprobs=2, prompt_logprobs=True)
        events = list(eng.generate(req, timeout=600))
        outs.append(([(lp.token, lp.logprob) for lp in events[0].prompt_logprobs], events[-1].cached_tokens))
    assert outs[0] == outs[1] and outs[1][1] == 0 and len(outs[0][0]) == len(p)


def test_salted_requests_do_not_share(engines, monkeypatch):
    _, warm = engines
    p = session_prompts(13)[2]
    assert run(warm, p, "off", max_tokens=2, cache_salt="a")[2].cached_tokens == 0
    assert run(warm, p, "off", max_tokens=2, cache_salt="b")[2].cached_tokens == 0
    assert run(warm, p, "off", max_tokens=2)[2].cached_tokens == 0
    rows = count_prefill_rows(monkeypatch, warm)
    cached = run(warm, p, "off", max_tokens=2, cache_salt="a")[2].cached_tokens
    assert cached > 0 and sum(rows) == len(p) - 1 - cached


def test_dspark_drafts_read_cached_hidden_states(tiny, tmp_path, monkeypatch):
    from drafters.dspark import DSparkDrafter

    firsts = []  # the context rows of each request's first DSpark forward: its prompt's taps
    real_propose = DSparkDrafter.propose

    def recording_propose(self, ctx, max_len):
        if self.context_length == 0 and ctx.hidden is not None:
            firsts.append(ctx.hidden)
        return real_propose(self, ctx, max_len)

    monkeypatch.setattr(DSparkDrafter, "propose", recording_propose)
    path = make_drafter(tiny, tmp_path / "drafter", {77: 12.0})
    cfg = dict(speculation="auto", dspark=True, dspark_drafter=str(path), prefill_step=BLOCK,
               calibration_contexts=(40, 300))
    cold = Engine(EngineConfig(prefix_cache_bytes=0, **cfg), loaded=tiny).start(wait=True, timeout=300)
    warm = Engine(EngineConfig(**cfg), loaded=tiny).start(wait=True, timeout=300)
    try:
        force = SpeculativeParams("dspark", min_draft_tokens=3)
        bias = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}
        accepted = compared = 0
        for i, p in enumerate(session_prompts(21)):
            kw = bias if i % 2 else {}
            firsts.clear()
            ids, text, last = run(cold, p, "x", max_tokens=20, speculative=force, **kw)
            w_ids, w_text, w_last = run(warm, p, "x", max_tokens=20, speculative=force, **kw)
            assert (w_ids, w_text) == (ids, text)  # (draft lengths follow measured timings: not compared)
            accepted += w_last.stats.total.num_accepted_tokens if w_last.cached_tokens else 0
            cold_rows, warm_rows = firsts  # (min_draft_tokens: DSpark drafts on each first cycle)
            if w_last.cached_tokens:  # the warm drafter read the cached rows, the cold one's bits
                assert warm_rows.shape[0] == len(p) - 1 and mx.array_equal(warm_rows, cold_rows).item()
                compared += 1
        assert accepted > 0 and compared >= 3 and warm.prefix_cache_info()["hits"] > 0
        # a prompt cut short mid-prefill stores its hidden rows with its chunks' KV
        cancelled_mid_prefill(cold, warm, 29, False, force)
        plain_requests_reuse_tapped_prompts(cold, warm, force)
    finally:
        cold.stop()
        warm.stop()


def plain_requests_reuse_tapped_prompts(cold, warm, force: SpeculativeParams) -> None:
    """Requests without DSpark reuse prompts prefilled with its taps (the same KV bits): from the
    prefix cache, and as a prompt twin sent beside a DSpark request; each output equals cold's."""
    import asyncio

    for p in session_prompts(23)[:3]:
        run(warm, p, "x", max_tokens=2, speculative=force)  # stored with its hidden rows
        ids, text, _ = run(cold, p, "off", max_tokens=12)
        w_ids, w_text, w_last = run(warm, p, "off", max_tokens=12)
        assert (w_ids, w_text) == (ids, text) and w_last.cached_tokens == warm.prefix_cache.cacheable(len(p))
    rng = random.Random(31)
    prompt = [rng.randrange(3, 259) for _ in range(6 * BLOCK + 5)]
    reference = run(cold, prompt, "off", max_tokens=12)[0]

    async def together(dspark_prompt, plain_prompt):
        streams = [warm.submit(GenerationRequest(prompt_tokens=list(p), max_tokens=12, speculative=spec,
                                                 sampling=SamplingParams(temperature=0.0)))
                   for p, spec in ((dspark_prompt, force), (plain_prompt, SpeculativeParams("off")))]

        async def drain(stream):
            return [e async for e in stream]
        return await asyncio.gather(*(drain(s) for s in streams))

    tapped, plain = asyncio.run(together(prompt, prompt))
    assert tapped[-1].error is None and plain[-1].error is None
    assert [t for e in plain for t in e.token_ids] == reference
    assert (tapped[-1].cached_tokens, plain[-1].cached_tokens) == (0, len(prompt) - 1)
    # Sharing only whole chunks with the DSpark request, whose prompt ends sooner: the plain one
    # waits for them (engine._awaits_prefill) instead of prefilling them too.
    shared = [rng.randrange(3, 259) for _ in range(6 * BLOCK)]
    owner, waiter = shared + [5], shared + [rng.randrange(3, 259) for _ in range(2 * BLOCK)]
    reference = run(cold, waiter, "off", max_tokens=12)[0]
    tapped, plain = asyncio.run(together(owner, waiter))
    assert [t for e in plain for t in e.token_ids] == reference
    assert (tapped[-1].cached_tokens, plain[-1].cached_tokens) == (0, 6 * BLOCK)


# ---- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefix_server(tiny):
    live = tiny_live_server(tiny, prefill_step=BLOCK)
    yield live
    live.stop()


def test_usage_reports_cached_tokens_and_metrics_move(prefix_server, monkeypatch):
    prompt = session_prompts(31)[3]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    q0, h0 = metric(prefix_server, "prefix_cache_queries_total"), metric(prefix_server, "prefix_cache_hits_total")
    first = post(prefix_server, "/v1/completions", body).json()
    rows = count_prefill_rows(monkeypatch, prefix_server.engine)
    second = post(prefix_server, "/v1/completions", body).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = (len(prompt) - 1) // BLOCK * BLOCK
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    assert sum(rows) == len(prompt) - 1 - cached  # the hit's rows were not prefilled again
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert metric(prefix_server, "prefix_cache_queries_total") - q0 == 2 * len(prompt)
    assert metric(prefix_server, "prefix_cache_hits_total") - h0 == cached
    assert metric(prefix_server, "prefix_cache_entries") >= 1 and metric(prefix_server, "prefix_cache_bytes") > 0

    salted = post(prefix_server, "/v1/completions", {**body, "cache_salt": "tenant-7"}).json()
    assert salted["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    stream = httpx.post(prefix_server.url + "/v1/completions", timeout=120, json={
        **body, "stream": True, "stream_options": {"include_usage": True}})
    assert sse_events(stream)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def test_empty_cache_salt_is_rejected(prefix_server):
    r = post(prefix_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "cache_salt" in r.json()["error"]["param"]


def test_identical_prompts_arriving_together_prefill_once(engines):
    """n > 1, or the same prompt sent twice at once: requests that arrive while the same prompt
    is being prefilled wait for it and copy every position but the anchor (not just its whole
    chunks), so the prompt is prefilled once; each output equals the cold one."""
    import asyncio

    cold, warm = engines
    rng = random.Random(7)
    prompt = [rng.randrange(3, 259) for _ in range(20 * BLOCK + 5)]
    cold_events = list(cold.generate(GenerationRequest(prompt_tokens=list(prompt), max_tokens=12, logprobs=3,
                                                       sampling=SamplingParams(temperature=0.0),
                                                       speculative=SpeculativeParams(method="auto")), timeout=600))
    reference = [t for e in cold_events for t in e.token_ids]
    ref_logprobs = [(lp.token, lp.logprob, lp.top) for e in cold_events for lp in e.logprobs or []]
    rows = []
    prefill = warm.runner.prefill

    def counting_prefill(tokens, cache, taps=None, **kw):
        rows.append(len(tokens))
        return prefill(tokens, cache, taps, **kw)

    warm.runner.prefill = counting_prefill

    async def all_at_once():
        reqs = [GenerationRequest(prompt_tokens=list(prompt), max_tokens=12, request_id=f"same-{i}", logprobs=3,
                                  sampling=SamplingParams(temperature=0.0),
                                  speculative=SpeculativeParams(method="auto")) for i in range(4)]
        streams = [warm.submit(r) for r in reqs]  # all queued before the worker admits them

        async def drain(stream):
            return [e async for e in stream]
        return await asyncio.gather(*(drain(s) for s in streams))

    try:
        results = asyncio.run(all_at_once())
    finally:
        warm.runner.prefill = prefill
    for events in results:  # (logprobs too: the copied rows are the cold ones, bit for bit)
        assert events[-1].error is None and [t for e in events for t in e.token_ids] == reference
        assert [(lp.token, lp.logprob, lp.top) for e in events for lp in e.logprobs or []] == ref_logprobs
    copied = len(prompt) - 1  # (the last prompt token is the first anchor, never prefilled)
    assert sorted(events[-1].cached_tokens for events in results) == [0, copied, copied, copied]
    assert sum(rows) == len(prompt) - 1, rows


def cancelled_mid_prefill(cold, warm, seed: int, twin: bool, speculative: SpeculativeParams) -> None:
    """A request cancelled after 5 prefill chunks stores them: the same prompt sent again (or, with
    ``twin``, sent beside it and waiting for its prefill) starts from them, with the cold output."""
    import asyncio

    rng = random.Random(seed)
    prompt = [rng.randrange(3, 259) for _ in range(12 * BLOCK + 3)]
    req = dict(max_tokens=10, logprobs=2, sampling=SamplingParams(temperature=0.0), speculative=speculative)

    def output(events):
        events = list(events)
        return [t for e in events for t in e.token_ids], [(lp.token, lp.logprob) for e in events for lp in e.logprobs or []]

    reference = output(cold.generate(GenerationRequest(prompt_tokens=list(prompt), **req), timeout=600))
    chunks = []
    prefill = warm.runner.prefill

    def cancelling_prefill(tokens, cache, taps=None, **kw):
        out = prefill(tokens, cache, taps, **kw)
        chunks.append(len(tokens))
        if len(chunks) == 5:  # (the engine sees the cancel before its next step)
            warm.cancel("left")
        return out

    async def together():
        streams = [warm.submit(GenerationRequest(prompt_tokens=list(prompt), request_id=rid, **req))
                   for rid in ("left", "twin")]

        async def drain(stream):
            return [e async for e in stream]
        return await asyncio.gather(*(drain(s) for s in streams))

    warm.runner.prefill = cancelling_prefill
    try:
        if twin:
            left, again = asyncio.run(together())
        else:
            left = list(warm.generate(GenerationRequest(prompt_tokens=list(prompt), request_id="left", **req),
                                      timeout=600))
    finally:
        warm.runner.prefill = prefill
    assert left[-1].finish_reason == FinishReason.CANCELLED and chunks[:5] == [BLOCK] * 5
    if not twin:
        again = list(warm.generate(GenerationRequest(prompt_tokens=list(prompt), **req), timeout=600))
    assert output(again) == reference and len(reference[0]) == 10
    assert again[-1].cached_tokens == 5 * BLOCK


@pytest.mark.parametrize("twin", [False, True], ids=["sent-again", "twin-waiting"])
def test_a_request_cancelled_mid_prefill_leaves_its_whole_chunks(engines, twin):
    cold, warm = engines
    cancelled_mid_prefill(cold, warm, 23 + twin, twin, SpeculativeParams(method="auto"))


def _first_tokens_in_order(eng, requests):
    """Submit every request at once; returns (request ids in order of first token, last events)."""
    import asyncio

    async def go():
        order, lasts = [], {}

        async def drain(req, stream):
            async for e in stream:
                if e.token_ids and req.request_id not in order:
                    order.append(req.request_id)
                lasts[req.request_id] = e

        streams = [(r, eng.submit(r)) for r in requests]
        await asyncio.gather(*(drain(r, s) for r, s in streams))
        return order, lasts

    return asyncio.run(go())


def _req(rid, prompt, max_tokens=8):
    return GenerationRequest(prompt_tokens=list(prompt), max_tokens=max_tokens, request_id=rid,
                             sampling=SamplingParams(temperature=0.0), speculative=SpeculativeParams(method="off"))


def test_waiting_pays_only_when_it_ends_sooner(engines):
    """The deferral rule on an owner caught mid-prefill (white-box: the worker is idle while the
    test builds the state): a prompt sharing the owner's whole prefix waits; one sharing a single
    chunk of a much longer prompt starts at once; a salted or prompt-logprobs request never waits,
    nor one with a prefilled prompt twin to copy."""
    import dataclasses

    from engine.engine import _Handle

    _, warm = engines
    rng = random.Random(1011)  # not a seed of session_prompts (their prefixes are cached)
    long_prompt = [rng.randrange(3, 259) for _ in range(60 * BLOCK + 3)]
    owner = warm._make_sequence(_req("owner", long_prompt))
    owner.cache[0].keys = None  # nothing prefilled yet
    saved_active = warm._active
    warm._active = [(None, owner)]
    try:
        def waits(prompt, **kw):
            return warm._awaits_prefill(_Handle(dataclasses.replace(_req("w", prompt), **kw), lambda e: None))

        short = long_prompt[:BLOCK] + [rng.randrange(3, 259) for _ in range(BLOCK)]
        assert waits(long_prompt) and waits(long_prompt[:40 * BLOCK])
        assert not waits(short)
        assert not waits(long_prompt, cache_salt="tenant-b") and not waits(long_prompt, prompt_logprobs=1)
        owner.num_prefilled = 60 * BLOCK  # the owner is nearly done: now even the short one waits
        assert waits(short)
        # a prefilled twin of the whole prompt (one that just finished, say): copy it now rather
        # than wait for the owner's chunks
        twin = warm._make_sequence(_req("twin", long_prompt[:40 * BLOCK]))
        twin.num_prefilled = twin.prompt_len
        warm._active = [(None, owner), (None, twin)]
        assert not waits(long_prompt[:40 * BLOCK]) and waits(long_prompt)
    finally:
        warm._active = saved_active


def test_waiting_requests_keep_their_place_in_the_queue(tiny):
    """A request waiting for a shared prefill holds its slot: a later request does not start
    ahead of it (max_active 2: the owner, the waiter; the third starts when one ends)."""
    eng = Engine(EngineConfig(speculation="off", prefill_step=BLOCK, max_active=2, calibration_contexts=(40,)),
                 loaded=tiny).start(wait=True, timeout=300)
    try:
        rng = random.Random(1012)
        prompt = [rng.randrange(3, 259) for _ in range(20 * BLOCK + 1)]
        other = [rng.randrange(3, 259) for _ in range(2 * BLOCK)]
        order, lasts = _first_tokens_in_order(
            eng, [_req("owner", prompt), _req("same", prompt), _req("later", other, max_tokens=4)])
        assert order.index("same") < order.index("later")
        assert lasts["same"].cached_tokens == len(prompt) - 1  # (a copy of the owner's whole prompt)
    finally:
        eng.stop()


def test_a_prompt_twin_is_copied_only_where_it_computes_the_same_rows(engines, monkeypatch):
    """The same prompt sent twice at once: the second waits for the first's prefill and copies
    its rows (here a prompt shorter than one chunk, which the prefix cache cannot hold), with
    the tokens and logprobs of a cold engine; a salted prompt, prompt logprobs, another prompt,
    DSpark taps or an engine without the prefix cache never copy."""
    import asyncio
    import dataclasses

    cold, warm = engines
    rng = random.Random(1013)
    prompt = [rng.randrange(3, 259) for _ in range(BLOCK // 2 + 3)]

    def req(rid, max_tokens):
        return dataclasses.replace(_req(rid, prompt, max_tokens), logprobs=4)

    def lps(events):
        return [(lp.token, lp.logprob, lp.top) for e in events for lp in e.logprobs or []]

    reference = list(cold.generate(req("cold", 16), timeout=600))

    async def both():
        streams = [warm.submit(req("first", 40)), warm.submit(req("second", 16))]

        async def drain(stream):
            return [e async for e in stream]
        return await asyncio.gather(*(drain(s) for s in streams))

    first, second = asyncio.run(both())
    assert first[-1].cached_tokens == 0 and second[-1].cached_tokens == len(prompt) - 1
    assert lps(second) == lps(reference) and lps(second)
    deadline = time.time() + 30
    while not warm.idle():  # (the worker's last step may still be ending)
        assert time.time() < deadline
        time.sleep(0.01)
    owner = warm._make_sequence(_req("owner", prompt))
    owner.num_prefilled = owner.prompt_len  # (white-box: an active, prefilled owner)
    saved_active, warm._active = warm._active, [(None, owner)]
    try:
        assert warm._prompt_twin(_req("same", prompt), False) is owner
        for kw in ({"cache_salt": "tenant-b"}, {"prompt_logprobs": True}, {"prompt_tokens": prompt[:-1]}):
            assert warm._prompt_twin(dataclasses.replace(_req("other", prompt), **kw), False) is None, kw
        assert warm._prompt_twin(_req("same", prompt), True) is None  # a request that runs DSpark
        monkeypatch.setattr(warm, "prefix_cache", None)  # (copies follow the cache's sharing rules)
        assert warm._prompt_twin(_req("same", prompt), False) is None
    finally:
        warm._active = saved_active


def test_one_token_choices_copy_the_first_ones_prompt(engines, monkeypatch):
    """The choices of an n > 1 request with max_tokens 1 (a classifier's call): the first one's
    prefill is also its last step, and it keeps its KV until the next admission, so the others
    copy its whole prompt (not only the whole chunks the prefix cache stored), all from it (not
    each from the choice admitted before it, a step later), with a cold engine's token and
    logprobs; after that the finished first choice holds no KV."""
    import asyncio
    import dataclasses

    cold, warm = engines
    rng = random.Random(1016)
    prompt = [rng.randrange(3, 259) for _ in range(6 * BLOCK + 3)]  # (six prefill steps)

    def req(rid):
        return dataclasses.replace(_req(rid, prompt, max_tokens=1), logprobs=3)

    def lps(events):
        return [(lp.token, lp.logprob, lp.top) for e in events for lp in e.logprobs or []]

    reference = lps(cold.generate(req("cold"), timeout=600))
    copied_from = []  # the prefilled twins the choices copy (white-box)
    find_twin = warm._prompt_twin

    def spy(request, dspark):
        twin = find_twin(request, dspark)
        if twin is not None and twin.prefilled:
            copied_from.append(twin)
        return twin
    monkeypatch.setattr(warm, "_prompt_twin", spy)

    async def choices():
        streams = [warm.submit(req(f"choice-{i}")) for i in range(4)]

        async def drain(stream):
            return [e async for e in stream]
        return await asyncio.gather(*(drain(s) for s in streams))

    first, *others = asyncio.run(choices())
    assert first[-1].cached_tokens == 0 and len(reference) == 1
    assert [o[-1].cached_tokens for o in others] == [len(prompt) - 1] * 3  # (6 whole chunks: 96)
    assert all(lps(events) == reference for events in (first, *others))
    assert {twin.request.request_id for twin in copied_from} == {"choice-0"}
    deadline = time.time() + 30
    while not warm.idle():
        assert time.time() < deadline
        time.sleep(0.01)
    assert warm._donors == [] and all(twin.cache is None for twin in copied_from)


def test_echo_logprobs_choices_share_one_prefill(engines, monkeypatch):
    """The n choices of an echo + logprobs request (the same prompt with prompt logprobs, sent at
    once) prefill it once: the others copy the first one's rows and prompt logprobs, decoding
    (max_tokens 4) or only scoring (max_tokens 0: the first one's answer), with a cold engine's
    tokens and bits; another logprobs count prefills again, and a decoding request never waits
    for a scoring one (it leaves no KV to copy)."""
    import asyncio
    import dataclasses

    cold, warm = engines
    rng = random.Random(1015)
    prompt = [rng.randrange(3, 259) for _ in range(3 * BLOCK + 5)]

    def req(rid, max_tokens, logprobs=2):
        return dataclasses.replace(_req(rid, prompt, max_tokens), logprobs=logprobs, prompt_logprobs=True)

    def output(events):
        return ([(lp.token, lp.logprob, lp.top) for lp in events[0].prompt_logprobs],
                [t for e in events for t in e.token_ids],
                [(lp.token, lp.logprob, lp.top) for e in events for lp in e.logprobs or []])

    async def at_once(requests):
        async def drain(stream):
            return [e async for e in stream]
        return await asyncio.gather(*(drain(warm.submit(r)) for r in requests))

    rows = count_prefill_rows(monkeypatch, warm)
    for max_tokens in (4, 0):
        ref = output(list(cold.generate(req("cold", max_tokens), timeout=600)))
        ref3 = output(list(cold.generate(req("cold3", max_tokens, logprobs=3), timeout=600)))
        rows.clear()
        got = asyncio.run(at_once([req(f"c{i}", max_tokens) for i in range(3)] + [req("k3", max_tokens, 3)]))
        assert sum(rows) == 2 * (len(prompt) - 1), (max_tokens, rows)  # c0's and k3's prefills only
        assert [output(events) for events in got] == [ref, ref, ref, ref3]
        assert len(ref[0]) == len(prompt) and len(ref[1]) == max_tokens
        assert [events[-1].cached_tokens for events in got] == [0, len(prompt) - 1, len(prompt) - 1, 0]
        assert all(events[-1].finish_reason == FinishReason.LENGTH for events in got)

    scorer = warm._make_sequence(req("scorer", 0))  # (white-box: an active scoring owner)
    saved_active, warm._active = warm._active, [(None, scorer)]
    try:
        assert warm._prompt_twin(req("score-too", 0), False) is scorer
        for other in (req("decodes", 4), dataclasses.replace(req("plain", 4), prompt_logprobs=False),
                      req("other-count", 0, logprobs=1)):
            assert warm._prompt_twin(other, False) is None, other.request_id
    finally:
        warm._active = saved_active


def test_only_identical_waiting_scoring_requests_take_a_scored_answer(tiny):
    """max_active 1: a scoring request (max_tokens 0, prompt logprobs) runs while identical ones,
    one with another cache_salt, one with another logprobs count and one cancelled in the step
    that scores the prompt all wait. When it ends, only the identical ones take its answer (the others prefill their own, with
    their own bits; the cancelled one ends cancelled); each request finishes once, the queue
    empties, and a later identical request prefills again."""
    import asyncio
    import dataclasses

    class Recorder:
        def __init__(self):
            self.finished = []

        def request_finished(self, event):
            self.finished.append((event.request_id, event.finish_reason))
            if event.request_id == "first":  # (cancelled in the step that scores its prompt)
                eng.cancel("gone")

        def __getattr__(self, name):  # (the other sink calls)
            return lambda *a, **k: None

    sink = Recorder()
    cfg = dict(speculation="off", prefill_step=BLOCK, max_active=1, calibration_contexts=(40,))
    eng = Engine(EngineConfig(**cfg), loaded=tiny, sink=sink).start(wait=True, timeout=300)
    cold = Engine(EngineConfig(prefix_cache_bytes=0, **cfg), loaded=tiny).start(wait=True, timeout=300)
    try:
        rng = random.Random(1017)
        prompt = [rng.randrange(3, 259) for _ in range(2 * BLOCK + 7)]

        def req(rid, logprobs=2, salt=None):
            return dataclasses.replace(_req(rid, prompt, 0), logprobs=logprobs, prompt_logprobs=True, cache_salt=salt)

        def lps(events):
            return [(lp.token, lp.logprob, lp.top) for lp in events[0].prompt_logprobs]

        rows = []
        real_prefill = eng.runner.prefill
        eng.runner.prefill = lambda tokens, *a, **k: rows.append(len(tokens)) or real_prefill(tokens, *a, **k)
        ids = ["first", "same1", "salted", "k3", "gone", "same2"]
        requests = [req("first"), req("same1"), req("salted", salt="b"), req("k3", logprobs=3), req("gone"), req("same2")]

        async def at_once():
            async def drain(stream):
                return [e async for e in stream]
            streams = [eng.submit(r) for r in requests]
            return await asyncio.gather(*(drain(s) for s in streams))

        got = dict(zip(ids, asyncio.run(at_once())))
        ref, ref3 = (list(cold.generate(r, timeout=600)) for r in (req("c"), req("c3", logprobs=3)))
        assert [lps(got[r]) for r in ("first", "same1", "same2", "salted", "k3")] == [lps(ref)] * 4 + [lps(ref3)]
        assert [got[r][-1].cached_tokens for r in ("first", "same1", "same2", "salted", "k3")] == \
            [0, len(prompt) - 1, len(prompt) - 1, 0, 0]
        assert got["gone"][-1].finish_reason == FinishReason.CANCELLED
        assert sum(rows) == 3 * (len(prompt) - 1), rows  # first, salted, k3
        assert sorted(sink.finished) == sorted(
            [(r, FinishReason.LENGTH) for r in ids if r != "gone"] + [("gone", FinishReason.CANCELLED)])
        assert eng.queue_depth() == 0
        rows.clear()
        assert lps(list(eng.generate(req("later"), timeout=600))) == lps(ref) and sum(rows) == len(prompt) - 1
    finally:
        eng.stop()
        cold.stop()


def test_usage_counts_a_requests_cache_hit_once_for_n_choices(prefix_server, monkeypatch):
    """n choices of one prompt: the first prefills it, the others copy it; usage reports the
    request's own cache hit (0 for a new prompt), streamed or not, per prompt of a list."""
    rng = random.Random(1014)

    def words():
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(60))

    body = {"prompt": [words(), words()], "max_tokens": 3, "n": 3, "temperature": 0}
    whole = post(prefix_server, "/v1/completions", body).json()
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, whole["usage"]
    events = sse_events(post(prefix_server, "/v1/completions", {**body, "prompt": words(), "stream": True,
                                                                "stream_options": {"include_usage": True}}))
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, events[-1]
    starts = []  # (cache offset, rows) of each prefill call
    count_prefill_rows(monkeypatch, prefix_server.engine, starts)
    again = post(prefix_server, "/v1/completions", body).json()  # (now a hit: the prompts' whole chunks)
    usage, cached = again["usage"], again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, usage
    # every prefill starts after a hit's chunks, and each prompt's uncached rows (anchors aside)
    # are prefilled: once when its other choices copy its first, as they do unless admission
    # splits them (then one may prefill its rest again from the cache's chunks)
    uncached = usage["prompt_tokens"] - len(body["prompt"]) - cached
    assert starts and min(offset for offset, _ in starts) > 0, starts
    assert uncached <= sum(rows for _, rows in starts) <= body["n"] * uncached, starts


def test_echo_logprobs_with_n_choices_gives_each_the_prompts_logprobs(prefix_server):
    """echo + logprobs with n = 3 (the choices share one prefill, above): every choice echoes the
    prompt with the same logprobs, streamed or not, scoring (max_tokens 0) or decoding; usage
    counts the prompt once."""
    rng = random.Random(1016)
    prompt = " ".join(f"w{rng.randrange(10**6)}" for _ in range(30))
    for max_tokens in (0, 2):
        body = {"prompt": prompt, "max_tokens": max_tokens, "n": 3, "echo": True, "logprobs": 2, "temperature": 0}
        whole = post(prefix_server, "/v1/completions", body).json()
        choices = sorted(whole["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1, 2]
        assert all(c["logprobs"] == choices[0]["logprobs"] and c["text"] == choices[0]["text"] for c in choices)
        lp = choices[0]["logprobs"]
        assert choices[0]["text"].startswith(prompt) and lp["token_logprobs"][0] is None
        n_prompt = whole["usage"]["prompt_tokens"]
        assert len(lp["tokens"]) == n_prompt + max_tokens and all(x is not None for x in lp["token_logprobs"][1:])
        assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert whole["usage"]["completion_tokens"] == 3 * max_tokens
        events = sse_events(post(prefix_server, "/v1/completions", {**body, "stream": True}))
        per_choice = {}
        for e in events:
            for c in e["choices"]:
                got = per_choice.setdefault(c["index"], {"text": "", "tokens": [], "lps": []})
                got["text"] += c["text"]
                got["tokens"] += c["logprobs"]["tokens"]
                got["lps"] += c["logprobs"]["token_logprobs"]
        assert sorted(per_choice) == [0, 1, 2]
        assert all(per_choice[i] == {"text": choices[0]["text"], "tokens": lp["tokens"], "lps": lp["token_logprobs"]}
                   for i in (0, 1, 2)), per_choice
