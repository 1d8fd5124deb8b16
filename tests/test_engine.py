"""Engine behaviour on the tiny random model: exactness of speculation, limits, cancellation."""

import random
import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import generate_all, pass_logits, run
from scipy import stats
from tiny import tiny_loaded

from engine import (
    ContextLengthExceeded,
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    SpeculativeParams,
)


def prompts(n, seed=0):
    """Varied prompts: repetitive token patterns (prompt lookup fires) and random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:
            pattern = [rng.randrange(3, 259) for _ in range(rng.randint(2, 6))]
            out.append(pattern * rng.randint(3, 8))
        elif i % 3 == 1:
            out.append([rng.randrange(3, 259) for _ in range(rng.randint(1, 40))])
        else:
            base = [rng.randrange(3, 259) for _ in range(12)]
            out.append(base + [rng.randrange(3, 259)] + base[:7])
    return out


def test_calibration_found_an_exact_verify_width(tiny_engine):
    cal = tiny_engine.calibration
    assert cal.max_rows >= 4, cal.summary()
    assert len(cal.verify_cost) == cal.max_rows and all(t > 0 for t in cal.verify_cost)


def test_greedy_speculation_is_token_identical(tiny_engine):
    accepted = 0
    for p in prompts(45):
        plain, plain_text, _ = run(tiny_engine, p, "off", max_tokens=48)
        spec, spec_text, last = run(tiny_engine, p, "prompt_lookup", max_tokens=48)
        assert spec == plain and spec_text == plain_text
        accepted += last.stats.total.num_accepted_tokens
    assert accepted > 50  # speculation really happened


FORCE = SpeculativeParams("prompt_lookup", min_draft_tokens=4)  # draft whenever lookup matches


# The tiny model's byte token for "q" (ids 3..258 are the bytes). Biased this hard, greedy output
# is "q" repeated, so from the first cycle prompt lookup drafts (at least FORCE's 4 tokens, at
# most the verify width) and every draft is accepted: limits and stops then fall inside an
# accepted block, never on a bonus token.
Q = 3 + ord("q")
Q_PROMPT = [Q] * 12
Q_BIAS = ((Q, 30.0),)


def q_events(engine, method="prompt_lookup", max_tokens=60, **kw):
    """Every event of a greedy, q-biased request on ``Q_PROMPT`` (drafting whenever lookup matches)."""
    speculative = FORCE if method != "off" else SpeculativeParams("off")
    req = GenerationRequest(prompt_tokens=Q_PROMPT, max_tokens=max_tokens, speculative=speculative,
                            sampling=SamplingParams(temperature=0.0, logit_bias=Q_BIAS), **kw)
    events = list(engine.generate(req, timeout=600))
    assert events[-1].error is None, events[-1].error
    return events


@pytest.mark.parametrize("temperature, extra", [(0.8, {}), (1.0, {"top_k": 20, "top_p": 0.9}),
                                                (0.7, {"repetition_penalty": 1.2, "frequency_penalty": 0.3})])
def test_sampled_speculation_with_fixed_seed_matches_plain_sampling(tiny_engine, temperature, extra):
    # the q-biased prompt makes sure drafts are accepted under every parameter set (the random
    # prompts alone accept as few as one draft token with the penalties)
    cases = [(p, extra) for p in prompts(9, seed=1)] + [(Q_PROMPT, {**extra, "logit_bias": Q_BIAS})]
    drafted = accepted = 0
    for i, (p, kw) in enumerate(cases):
        a, _, _ = run(tiny_engine, p, "off", max_tokens=24, temperature=temperature, seed=i, sampling_kw=kw)
        b, _, last = run(tiny_engine, p, "prompt_lookup", max_tokens=24, temperature=temperature, seed=i,
                         sampling_kw=kw)
        c, _, _ = run(tiny_engine, p, "prompt_lookup", max_tokens=24, temperature=temperature, seed=i,
                      sampling_kw=kw)
        assert a == b == c
        drafted += last.stats.total.num_draft_tokens
        accepted += last.stats.total.num_accepted_tokens
    assert drafted > 0 and accepted > 0  # sampled verification really ran, and kept drafts


def test_max_tokens_never_exceeded_mid_block(tiny_engine):
    # (the context limit cannot be reached first: validate() rejects prompt + max_tokens > context)
    last_blocks = []  # tokens of the block that reached max_tokens
    for max_tokens in (1, 2, 3, 5, 8, 13):
        events = q_events(tiny_engine, max_tokens=max_tokens)
        assert [t for e in events for t in e.token_ids] == [Q] * max_tokens == [Q] * events[-1].completion_tokens
        assert events[-1].finish_reason is FinishReason.LENGTH
        last_blocks.append(len(events[-1].token_ids))
    assert max(last_blocks) > 1, last_blocks  # the limit was reached inside a block of accepted drafts


def test_stop_string_and_stop_token_inside_accepted_block(tiny_engine):
    full = q_events(tiny_engine)
    ids = [t for e in full for t in e.token_ids]
    assert ids == [Q] * 60 and "".join(e.text for e in full) == "q" * 60
    first = len(full[0].token_ids)
    assert first > 4  # the first block already holds accepted drafts (4 at least; ~10 on a CPU)
    for method in ("off", "prompt_lookup"):
        # the stop token is the block's first token: the drafts after it are not emitted
        events = q_events(tiny_engine, method, stop_token_ids=(Q,))
        assert [t for e in events for t in e.token_ids] == [Q] and events[-1].completion_tokens == 1
        assert events[-1].finish_reason is FinishReason.STOP
        # a stop string completed by the first block's last-but-one token: its text is cut, as
        # is the rest of the block
        events = q_events(tiny_engine, method, stop=("q" * (first - 1),))
        assert "".join(e.text for e in events) == "" and events[-1].finish_reason is FinishReason.STOP
        assert [t for e in events for t in e.token_ids] == ids[:first - 1]
        assert events[-1].completion_tokens == first - 1


def test_usage_counts_emitted_tokens_only(tiny_engine):
    events = q_events(tiny_engine, stop_token_ids=(Q,))  # stops on the first token of a drafted block
    last = events[-1]
    assert last.stats.total.num_accepted_tokens > 1  # the block committed more than it emitted
    assert last.completion_tokens == sum(len(e.token_ids) for e in events) == 1
    assert last.prompt_tokens == len(Q_PROMPT)


def test_per_request_max_draft_tokens_is_respected(tiny_engine):
    p = [3, 4, 5, 6, 7] * 8
    req = GenerationRequest(prompt_tokens=p, max_tokens=40, sampling=SamplingParams(temperature=0.0),
                            speculative=SpeculativeParams("prompt_lookup", 2, min_draft_tokens=2))
    events = list(tiny_engine.generate(req))
    stats = events[-1].stats
    assert stats.total.num_drafts > 0
    assert len(stats.total.accepted_per_position) <= 2


def test_validation_errors(tiny_engine):
    with pytest.raises(ContextLengthExceeded):
        tiny_engine.validate(GenerationRequest(prompt_tokens=[5] * 100, max_tokens=5000))
    with pytest.raises(InvalidRequestError):
        tiny_engine.validate(GenerationRequest(prompt_tokens=[], max_tokens=5))
    with pytest.raises(InvalidRequestError):
        tiny_engine.validate(GenerationRequest(prompt_tokens=[999999], max_tokens=5))
    with pytest.raises(InvalidRequestError):
        tiny_engine.validate(GenerationRequest(prompt_tokens=[5], max_tokens=0))
    with pytest.raises(InvalidRequestError):
        tiny_engine.validate(GenerationRequest(prompt_tokens=[5], max_tokens=3,
                                               speculative=SpeculativeParams("bogus")))


def test_cancel_frees_the_request_and_others_continue(tiny_engine):
    long_req = GenerationRequest(prompt_tokens=[5, 6, 7], max_tokens=1500,
                                 sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    events = []
    it = tiny_engine.generate(long_req)
    events.append(next(it))
    tiny_engine.cancel(long_req.request_id)
    rest = list(it)
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert sum(len(e.token_ids) for e in events + rest) < 1500
    ids, _, _ = run(tiny_engine, [5, 6, 7], "prompt_lookup", max_tokens=10)
    assert len(ids) == 10
    assert tiny_engine.running() == 0


def test_concurrent_requests_are_isolated(tiny_engine):
    ps = prompts(8, seed=3)
    solo = [run(tiny_engine, p, "prompt_lookup", max_tokens=30)[0] for p in ps]
    results = [None] * len(ps)

    def worker(i):
        results[i] = run(tiny_engine, ps[i], "prompt_lookup", max_tokens=30)[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == solo


def test_echo_prompt_logprobs_with_zero_max_tokens(tiny_engine):
    req = GenerationRequest(prompt_tokens=[5, 6, 7, 8], max_tokens=0, logprobs=2, prompt_logprobs=True)
    events = list(tiny_engine.generate(req))
    lps = events[0].prompt_logprobs
    assert [x.token for x in lps] == [5, 6, 7, 8] and lps[0].logprob is None
    assert all(x.logprob is not None and x.logprob <= 0 and len(x.top) == 2 for x in lps[1:])
    assert events[-1].completion_tokens == 0


@pytest.mark.slow
def test_sampled_distribution_is_preserved():
    """The second generated token's distribution with prompt-lookup speculation equals the exact
    target marginal sum_t1 p(t1) p(t2 | t1) (chi-square over 20k samples). A logit bias makes the
    drafted tokens likely, so both accepted and recovered tokens occur often.

    The target is the tiny model in 4 bits, as the default model loads, so on the CPU the engine
    serves it through the fused pass (q16 activations) and, with 4-token prefill blocks, the
    prefix cache holds the shared prompt: ~2x fewer seconds per request than the float32 model
    through mlx-lm's modules. The exact marginal is computed from the engine's own passes
    (helpers.pass_logits: the rows it samples from, bit for bit)."""
    tiny = tiny_loaded(quantize_bits=4)
    eng = Engine(EngineConfig(speculation="prompt_lookup", calibration_contexts=(32,), warmup=False,
                              prefill_step=4),
                 loaded=tiny).start(wait=True)
    try:
        model = tiny.model

        def raw(context):
            return np.array(model(mx.array(context)[None])[0, -1].astype(mx.float32).tolist())

        # Pattern [a b c]*4 + [a b]: when t1 = c, prompt lookup drafts `a` for t2. Biases on a and
        # c cannot change r = p2(a)/p2(c) * p1(c)/p1(a), so pick tokens whose r is large, then
        # biases that make t1 = c about 70% of the time and accept the draft about 40%.
        rng = np.random.default_rng(0)
        best = None
        for _ in range(60):
            a, b, c = (int(t) for t in rng.choice(np.arange(3, 259), 3, replace=False))
            prompt = [a, b, c] * 4 + [a, b]
            raw1, raw2 = raw(prompt), raw(prompt + [c])
            r = raw2[a] - raw2[c] + raw1[c] - raw1[a]
            if best is None or r > best[0]:
                best = (r, a, b, c, prompt, raw1, raw2)
        _, a, b, c, prompt, raw1, raw2 = best

        def probs(z, ba, bc):
            z = z.copy()
            z[a] += ba
            z[c] += bc
            z = np.exp(z - z.max())
            return z / z.sum()

        grid = np.arange(0.0, 30.0, 0.25)
        _, ba, bc = min((abs(probs(raw1, x, y)[c] - 0.7) + abs(probs(raw2, x, y)[a] - 0.4), x, y)
                        for x in grid for y in grid)
        bias = ((a, float(ba)), (c, float(bc)))
        params = dict(temperature=1.0, logit_bias=bias)
        # exact marginal of t2: one pass of the engine's for every possible t1
        vocab = tiny.config["vocab_size"]
        rows = pass_logits(eng, prompt, [[t] for t in range(vocab)])
        pipe_bias = mx.zeros((vocab,))
        for t, v in bias:
            pipe_bias[t] = v
        p1 = mx.softmax(rows[0][0] + pipe_bias)
        p2 = mx.softmax(mx.stack([r[1] for r in rows]) + pipe_bias, axis=-1)
        exact = np.array((p1[:, None] * p2).sum(0).tolist())
        counts = np.zeros(vocab)
        drafted = accepted = 0
        n = 20_000
        requests = [GenerationRequest(prompt_tokens=prompt, max_tokens=3, ignore_eos=True,
                                      sampling=SamplingParams(seed=seed, **params),
                                      speculative=SpeculativeParams("prompt_lookup", min_draft_tokens=1))
                    for seed in range(n)]
        for events in generate_all(eng, requests):
            ids = [t for e in events for t in e.token_ids]
            counts[ids[1]] += 1
            drafted += events[-1].stats.total.num_draft_tokens
            accepted += events[-1].stats.total.num_accepted_tokens
        assert drafted > n / 4 and drafted / 20 < accepted < drafted * 0.8  # both paths exercised
        big = exact * n >= 5
        observed = np.append(counts[big], counts[~big].sum())
        expected = np.append(exact[big] * n, exact[~big].sum() * n)
        _, p_value = stats.chisquare(observed, expected * observed.sum() / expected.sum())
        assert p_value > 1e-3, p_value
    finally:
        eng.stop()


@pytest.mark.parametrize("policy,dtype", [("quantized", mx.float32), ("quantized-bfloat16", mx.bfloat16),
                                          ("quantized-float16", mx.float16)])
def test_quantized_weight_policies_keep_quantized_layers_and_set_activation_dtype(policy, dtype):
    import mlx.nn as nn
    from tiny import tiny_model

    from engine.loader import apply_weight_policy

    model, _ = tiny_model(seed=3)
    nn.quantize(model, group_size=32, bits=4)
    packed = model.layers[0].mlp.up_proj["weight"]
    assert apply_weight_policy(model, policy) == policy
    proj = model.layers[0].mlp.up_proj
    assert isinstance(proj, nn.QuantizedLinear) and mx.array_equal(proj["weight"], packed)
    assert proj["scales"].dtype == dtype and model.layers[0].input_layernorm.weight.dtype == dtype
    assert model(mx.array([[5, 6, 7]])).dtype == dtype


def test_exact_verify_kernel_mode_routes_every_decode_and_verify_pass_through_the_kernel(tiny, monkeypatch):
    """SPECSERVE_EXACT_VERIFY=kernel: decode, verify and batched passes attend through the
    row-attention kernel (a stand-in here with the same contract: one call, rows independent),
    prefill does not, and greedy output stays token-identical. The CUDA kernel itself is checked
    on a GPU (tests/test_kernels.py); off CUDA the mode falls back to `row`."""
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx

    from engine import Engine, EngineConfig, exact_attention
    from metal_kernels import attention

    calls = []  # (rows, inside a batched pass)
    in_batch = []

    def stand_in(queries, keys, values, scale):
        n, start = queries.shape[2], keys.shape[2] - queries.shape[2]
        calls.append((n, bool(in_batch)))
        return mx.concatenate([mx.fast.scaled_dot_product_attention(
            queries[:, :, i:i + 1], keys[:, :, :start + i + 1], values[:, :, :start + i + 1], scale=scale)
            for i in range(n)], axis=2)

    batched_sdpa = exact_attention._batched_sdpa

    def recording_batched_sdpa(*args):
        in_batch.append(True)
        try:
            return batched_sdpa(*args)
        finally:
            in_batch.pop()

    cfg = dict(speculation="prompt_lookup", exact_verify="kernel", max_verify_rows=8, calibration_contexts=(40,),
               max_active=2)
    eng = Engine(EngineConfig(**cfg), loaded=tiny).start(wait=True, timeout=300)
    try:
        assert not eng.calibration.attention_kernel  # CPU: falls back to row
    finally:
        eng.stop()
    monkeypatch.setattr(attention, "backend", lambda: "cuda")
    monkeypatch.setattr(attention, "row_attention", stand_in)
    monkeypatch.setattr(exact_attention, "_batched_sdpa", recording_batched_sdpa)
    eng = Engine(EngineConfig(**cfg), loaded=tiny).start(wait=True, timeout=300)
    try:
        assert eng.calibration.attention_kernel and eng.calibration.max_rows >= 4
        assert eng.batch_rows >= 2  # batched passes were calibrated through the kernel too
        calls.clear()
        p = [5, 6, 7, 8, 9] * 12
        forced = SpeculativeParams(method="prompt_lookup", min_draft_tokens=3)  # drafts every cycle
        spec, _, last = run(eng, p, speculative=forced, max_tokens=40)
        rows = [n for n, _ in calls]
        assert last.stats.total.num_draft_tokens > 0
        assert 1 in rows and 1 < max(rows) <= 8 and len(rows) % tiny.num_layers == 0
        calls.clear()
        plain, _, _ = run(eng, p, "off", max_tokens=40)
        assert spec == plain and {n for n, _ in calls} == {1}
        calls.clear()
        q = [11, 12, 13, 14] * 15
        with ThreadPoolExecutor(2) as pool:  # two decoding sequences share batched passes
            both = list(pool.map(lambda prompt: run(eng, prompt, speculative=forced, max_tokens=40)[0], [p, q]))
        assert both[0] == plain and both[1] == run(eng, q, "off", max_tokens=40)[0]
        assert any(batched for _, batched in calls)
    finally:
        eng.stop()
