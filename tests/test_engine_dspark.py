"""DSpark inside the engine, on the tiny target with a tiny random drafter.

A random drafter proposes mostly wrong tokens; to exercise accepted drafts too, tests give the
drafter a Markov bias that favours chosen tokens and push the target toward the same tokens
with a request logit_bias.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from dspark_helpers import DS, FORCE, make_drafter
from helpers import generate_all, pass_logits, run
from scipy import stats
from test_engine import prompts
from test_structured import GRAMMAR, _json_prompts
from tiny import tiny_loaded

from engine import (
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeParams,
)


@pytest.fixture(scope="module")
def dspark_engine(tiny, tmp_path_factory):
    path = make_drafter(tiny, tmp_path_factory.mktemp("dspark") / "drafter", {77: 12.0})
    eng = Engine(EngineConfig(speculation="auto", dspark=True, dspark_drafter=str(path),
                              calibration_contexts=(40, 300)), loaded=tiny).start(wait=True, timeout=300)
    yield eng
    eng.stop()


def test_greedy_identity_with_dspark_and_auto(dspark_engine):
    accepted = {"dspark": 0, "prompt_lookup": 0}
    bias = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}  # the target's argmax is 77: drafts pass
    for i, p in enumerate(prompts(24, seed=7)):
        kw = bias if i % 3 == 0 else {}
        plain, text, last_plain = run(dspark_engine, p, "off", max_tokens=40, **kw)
        for spec in (FORCE, SpeculativeParams("auto")):
            ids, spec_text, last = run(dspark_engine, p, "x", max_tokens=40, speculative=spec, **kw)
            assert ids == plain and spec_text == text
            assert last.finish_reason == last_plain.finish_reason
            for name, counts in last.stats.by_drafter.items():
                accepted[name] += counts.num_accepted_tokens
    assert accepted["dspark"] > 20


def test_greedy_identity_with_a_draft_vocabulary(tiny, tmp_path):
    """A drafter with a draft vocabulary (every third token and 77) drafts from it: greedy output
    stays identical to plain, and drafts of 77, the target's choice under the bias, get accepted
    (as target ids: a draft left as its row in the subset would be another token). Turned off
    (SPECSERVE_DSPARK_DRAFT_VOCAB=0), the engine drafts from the whole vocabulary."""
    subset = np.union1d(np.arange(1, tiny.config["vocab_size"], 3), [77])
    path = make_drafter(tiny, tmp_path / "drafter", {77: 12.0}, draft_vocab=subset)
    bias = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}
    for use in (True, False):
        eng = Engine(EngineConfig(speculation="auto", dspark=True, dspark_drafter=str(path), dspark_draft_vocab=use,
                                  calibration_contexts=(40,), warmup=False), loaded=tiny).start(wait=True, timeout=300)
        try:
            assert (eng.draft_vocab is not None) == use and eng._dspark_step.vocab is eng.draft_vocab
            if use:
                assert eng.draft_vocab.ids.tolist() == subset.tolist()
            accepted = 0
            for i, p in enumerate(prompts(8, seed=11)):
                kw = bias if i % 2 == 0 else {}
                plain, text, _ = run(eng, p, "off", max_tokens=32, **kw)
                ids, spec_text, last = run(eng, p, "x", max_tokens=32, speculative=FORCE, **kw)
                assert ids == plain and spec_text == text
                accepted += last.stats.by_drafter["dspark"].num_accepted_tokens
            assert accepted > 20
        finally:
            eng.stop()


def test_dspark_cut_by_max_tokens_and_stops_inside_accepted_block(dspark_engine):
    """The target agrees with every draft (77), so cycles accept blocks of drafts; max_tokens,
    a stop token and a stop string each end the output inside one, and the accepted drafts after
    the cut are dropped."""
    p = [9, 10, 11] * 4
    kw = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}
    ids, _, last = run(dspark_engine, p, "x", max_tokens=1, speculative=FORCE, **kw)
    assert ids == [77] and last.finish_reason is FinishReason.LENGTH
    for max_tokens in (2, 4, 6, 9):
        ids, _, last = run(dspark_engine, p, "x", max_tokens=max_tokens, speculative=FORCE, **kw)
        assert ids == [77] * max_tokens and last.finish_reason is FinishReason.LENGTH
        assert last.stats.by_drafter["dspark"].num_accepted_tokens >= 1
        assert last.stats.num_verify_steps < max_tokens  # (so some pass committed several tokens)
    # The first pass commits the anchor's token (77, a stop token) and accepts drafts after it.
    ids, _, last = run(dspark_engine, p, "x", max_tokens=20, speculative=FORCE, stop_token_ids=(77,), **kw)
    assert ids == [77] and last.finish_reason is FinishReason.STOP
    assert last.stats.by_drafter["dspark"].num_accepted_tokens >= 1
    _, two, _ = run(dspark_engine, p, "off", max_tokens=2, **kw)
    ids, text, last = run(dspark_engine, p, "x", max_tokens=20, speculative=FORCE, stop=(two,), **kw)
    assert ids == [77, 77] and text == "" and last.finish_reason is FinishReason.STOP
    assert last.stats.by_drafter["dspark"].num_accepted_tokens >= 2


def test_sampled_dspark_fixed_seed_is_fixed(dspark_engine):
    p = prompts(3, seed=2)[1]
    outs = [run(dspark_engine, p, "x", max_tokens=24, temperature=0.9, seed=5, speculative=FORCE)[0]
            for _ in range(3)]
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [False, True])
def test_sampled_distribution_with_dspark(tmp_path, vocab):
    """The first generated token is DSpark's first draft judged by the rejection rule (q: the
    drafter's Markov-corrected, temperature-scaled distribution): its distribution over 20k
    seeds must equal the target's processed distribution p (chi-square). With a draft vocabulary
    that leaves out c, one of the two tokens the target favours, q is zero there and c comes
    from the residual distribution alone.

    As in test_engine's sampled test, the target is the tiny model in 4 bits (the CPU's fused
    pass) with 4-token prefill blocks, so the prefix cache holds the whole prompt before the
    anchor: ~2x fewer seconds per request. p comes from the engine's own pass
    (helpers.pass_logits: the row it samples from, bit for bit)."""
    a, c = 60, 61
    tiny = tiny_loaded(quantize_bits=4)
    subset = np.setdiff1d(np.arange(tiny.config["vocab_size"]), [c, 62, 90]) if vocab else None
    path = make_drafter(tiny, tmp_path / "d", {a: 6.0, c: 5.0}, draft_vocab=subset)
    eng = Engine(EngineConfig(speculation="dspark", dspark=True, dspark_drafter=str(path),
                              calibration_contexts=(32,), warmup=False, prefill_step=4),
                 loaded=tiny).start(wait=True)
    try:
        prompt = [20, 21, 22, 23, 24]
        bias = ((a, 4.0), (c, 4.0))
        vocab = tiny.config["vocab_size"]
        shift = mx.zeros((vocab,))
        for t, v in bias:
            shift[t] = v
        exact = np.array(mx.softmax(pass_logits(eng, prompt, [[]])[0][0] + shift).tolist())
        n = 20_000
        counts = np.zeros(vocab)
        drafted = accepted = 0
        requests = [GenerationRequest(prompt_tokens=prompt, max_tokens=2, ignore_eos=True,
                                      sampling=SamplingParams(temperature=1.0, seed=seed, logit_bias=bias),
                                      speculative=SpeculativeParams("dspark", min_draft_tokens=1))
                    for seed in range(n)]
        for events in generate_all(eng, requests):
            counts[events[0].token_ids[0]] += 1
            drafted += events[-1].stats.total.num_draft_tokens
            accepted += events[-1].stats.total.num_accepted_tokens
        assert drafted >= n and n / 20 < accepted < drafted * 0.9  # both paths exercised
        big = exact * n >= 5
        observed, expected = counts[big], exact[big] * n
        if (~big).any():
            observed = np.append(observed, counts[~big].sum())
            expected = np.append(expected, exact[~big].sum() * n)
        _, p_value = stats.chisquare(observed, expected * observed.sum() / expected.sum())
        assert p_value > 1e-3, p_value
    finally:
        eng.stop()


def test_losing_dspark_is_probed_not_run_every_cycle(tiny, tmp_path, monkeypatch):
    """A drafter whose drafts never pass (its Markov bias pushes a token the target never picks)
    costs a draft forward on the first cycle and then only on probes, at intervals that double
    while it keeps losing: its measured yield loses to plain decoding, also under
    ``method = dspark``. Output stays plain greedy."""
    from drafters.dspark import DSparkDrafter
    from engine.generation import DSPARK_PROBE_EVERY

    path = make_drafter(tiny, tmp_path / "drafter", {5: 40.0})
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    calls = []
    original = DSparkDrafter.propose
    monkeypatch.setattr(DSparkDrafter, "propose", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    eng.dspark_stats.decode_seconds = 1e6  # the probe budget is tested below: here only the back-off
    # no draft cost before the first timed forward (the start-up timing is this machine's, and a
    # loaded CI runner's can make the priors lose): the priors alone decide the first cycle
    eng.dspark_stats.steady_cost = eng.dspark_stats.draft_cost = 0.0
    # a fixed curve (T(k) = 3 + 0.2 (k - 1) ms): the priors' verdict on the first cycle must not
    # hang on this machine's timing
    monkeypatch.setattr(eng.cost, "alpha", 0.0)
    monkeypatch.setattr(eng.cost, "_curve", [0.003 + 0.0002 * k for k in range(eng.cost.max_rows)])
    try:
        prompt = prompts(1, seed=3)[0]
        plain, _, _ = run(eng, prompt, "off", max_tokens=120, ignore_eos=True)
        ids, _, last = run(eng, prompt, "dspark", max_tokens=120, ignore_eos=True)
        assert ids == plain
        assert last.stats.total.num_accepted_tokens == 0
        cycles = last.stats.num_verify_steps
        assert cycles >= 100  # nothing accepted: about one cycle per token
        # a forward at cycle 0 (the priors say it wins; the warm-up left no evidence), probes at
        # cycle 32 and, the interval doubled, 32 + 64; the next would come 128 cycles later
        assert 3 * DSPARK_PROBE_EVERY < cycles < 7 * DSPARK_PROBE_EVERY
        assert len(calls) == 3, (len(calls), cycles)
    finally:
        eng.stop()


def test_a_request_whose_own_dspark_cycles_win_keeps_drafting_with_per_request_evidence(tiny, tmp_path,
                                                                                       monkeypatch):
    """The engine-wide evidence says DSpark yields nothing (other requests' cycles), but this
    request's drafts pass: with ``DsparkStats.REQUEST_PRIOR`` 0 it runs DSpark only on probes;
    with 2 (the default), its own first probe lifts its estimate above plain decoding and it drafts
    with DSpark every cycle after. Output stays plain greedy either way."""
    from engine.scheduler import DsparkStats

    path = make_drafter(tiny, tmp_path / "drafter", {77: 12.0})
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40,),
                              warmup=False), loaded=tiny).start(wait=True, timeout=300)
    # a fixed, slow curve (T(k) = 30 + 2 (k - 1) ms): the verdicts must not hang on this
    # machine's timing of the tiny drafter's forward (a few ms)
    monkeypatch.setattr(eng.cost, "alpha", 0.0)
    monkeypatch.setattr(eng.cost, "_curve", [0.03 + 0.002 * k for k in range(eng.cost.max_rows)])
    bias = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}  # the target's argmax is 77: drafts pass
    try:
        prompt = prompts(1, seed=5)[0]
        plain, _, _ = run(eng, prompt, "off", max_tokens=100, ignore_eos=True, **bias)
        drafts = {}
        for prior in (0, 2):
            monkeypatch.setattr(DsparkStats, "REQUEST_PRIOR", prior)
            stats = eng.dspark_stats
            stats.decode_seconds = 1e6  # (probes always fit the budget here)
            stats.accepted_ema, stats.cycles, stats.alpha = 0.0, 10**6, 1e-4  # other requests' verdict, pinned
            ids, _, last = run(eng, prompt, "dspark", max_tokens=100, ignore_eos=True, **bias)
            assert ids == plain
            counts = last.stats.by_drafter["dspark"]
            assert counts.num_accepted_tokens >= counts.num_drafts  # (its drafts do pass)
            drafts[prior] = counts.num_drafts
        assert drafts[0] <= 3 and drafts[2] >= 10, drafts
    finally:
        eng.stop()


def test_request_accepted_blends_the_engine_wide_estimate_as_prior_cycles(monkeypatch):
    from engine.scheduler import CostModel, DsparkStats

    stats = DsparkStats()
    stats.accepted_ema = 0.4
    assert DsparkStats.REQUEST_PRIOR == 2  # (the default)
    assert stats.request_accepted(0.0, 0) is None  # (no cycle of its own: the engine-wide value)
    assert stats.request_accepted(9.0, 3) == pytest.approx((2 * 0.4 + 9.0) / 5)
    monkeypatch.setattr(DsparkStats, "REQUEST_PRIOR", 0)
    assert stats.request_accepted(9.0, 3) is None  # (0: the engine-wide value)
    monkeypatch.setattr(DsparkStats, "REQUEST_PRIOR", 2)
    assert stats.request_accepted(9.0, 3) == pytest.approx((2 * 0.4 + 9.0) / 5)
    cost = CostModel([0.01 * (1 + 0.1 * k) for k in range(8)])
    assert stats.expected_rate(cost, accepted=2.0) > stats.expected_rate(cost)


def slow_losing_dspark(tiny, tmp_path, monkeypatch, delay: float = 0.05) -> tuple[Engine, list]:
    """A started engine whose DSpark drafts are never accepted (its Markov bias pushes a token
    the target never picks) and whose every forward takes ``delay`` seconds more (by default
    50 ms, far more than the tiny target's steps), and the list each forward appends to."""
    import time

    from drafters.dspark import DSparkDrafter

    path = make_drafter(tiny, tmp_path / "drafter", {5: 40.0})
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    calls = []
    original = DSparkDrafter.propose

    def slow_propose(self, *args, **kwargs):
        calls.append(1)
        time.sleep(delay)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DSparkDrafter, "propose", slow_propose)
    return eng, calls


def test_losing_dspark_probes_stay_within_the_engine_wide_budget(tiny, tmp_path, monkeypatch):
    """Every new request would probe DSpark on its first cycle; with a drafter that always
    loses and costs 50 ms a forward (far more than the tiny target's steps), the engine-wide
    budget keeps the time spent on probes within 2% of the decode time (plus the probe that
    always runs first), however many requests arrive."""
    from engine.scheduler import DsparkStats

    eng, calls = slow_losing_dspark(tiny, tmp_path, monkeypatch)
    try:
        for p in prompts(8, seed=11):
            run(eng, p, "dspark", max_tokens=24, ignore_eos=True)
        ds = eng.dspark_stats
        assert 1 <= len(calls) < 8  # not one probe per request
        assert ds.probe_seconds <= DsparkStats.PROBE_SHARE * ds.decode_seconds + 0.1
    finally:
        eng.stop()


def test_a_dspark_that_could_not_win_with_every_draft_accepted_stops_being_probed(tiny, tmp_path, monkeypatch):
    """On a CPU a DSpark forward costs ~10 one-row passes, so even a block accepted whole would
    lose to plain decoding. The first ``BOUND_AFTER`` probes measure that cost; after them no
    probe runs, however much probe budget is left (here: unlimited) and however many requests
    arrive (each would probe on its first cycle and after 32 more), and requests start without
    DSpark at all (no taps), unless they force drafts. Output stays plain greedy."""
    from engine.generation import Sequence
    from engine.scheduler import DsparkStats

    # 50 ms forwards: (1 + L) / (T(L + 1) + 50 ms / 1.5) is far below 1 / T(1) = 1 / 3 ms for any L
    eng, calls = slow_losing_dspark(tiny, tmp_path, monkeypatch)
    monkeypatch.setattr(eng.cost, "alpha", 0.0)
    monkeypatch.setattr(eng.cost, "_curve", [0.003 + 0.0002 * k for k in range(eng.cost.max_rows)])
    eng.dspark_stats.decode_seconds = 1e6  # the budget would allow a probe every time
    dropped = []  # requests that started with DSpark and dropped it
    original_drop = Sequence._drop_dspark

    def recording_drop(seq):
        original_drop(seq)
        dropped.append((seq.request.request_id, seq.taps, "dspark" in seq.drafters, seq.pending_hidden))

    monkeypatch.setattr(Sequence, "_drop_dspark", recording_drop)

    def request(method: str, forced: int = 0) -> GenerationRequest:
        return GenerationRequest(prompt_tokens=[1, 2, 3], max_tokens=4,
                                 speculative=SpeculativeParams(method, min_draft_tokens=forced))

    try:
        assert eng._runs_dspark(request("auto"))  # nothing timed yet
        for p in prompts(4, seed=5):
            plain, _, _ = run(eng, p, "off", max_tokens=80, ignore_eos=True)
            ids, _, last = run(eng, p, "dspark", max_tokens=80, ignore_eos=True)
            assert ids == plain
            assert last.stats.num_verify_steps > 32
        assert len(calls) == DsparkStats.BOUND_AFTER
        assert eng.dspark_stats.fastest_forward >= 0.05
        # the first request dropped DSpark on its last cycle (no room to draft), and the one
        # whose probe settled the bound (the second: probes at cycles 0 and 32 in the first, 0
        # in the second) on its next cycle
        assert [d[1:] for d in dropped] == [(None, False, [])] * 2
        assert not eng._runs_dspark(request("auto")) and not eng._runs_dspark(request("dspark"))
        assert eng._runs_dspark(request("dspark", forced=1))  # forced drafts still run it
        for method in ("auto", "dspark"):
            ids, _, _ = run(eng, p, method, max_tokens=80, ignore_eos=True)
            assert ids == plain and len(calls) == DsparkStats.BOUND_AFTER
        # without DSpark, a dspark request's grammar still drafts the tokens it forces (not under off)
        json_prompt = _json_prompts(tiny.tokenizer, 1)[0]
        plain, _, off = run(eng, json_prompt, "off", max_tokens=48, grammar=GRAMMAR)
        ids, _, last = run(eng, json_prompt, "dspark", max_tokens=48, grammar=GRAMMAR)
        assert ids == plain and len(calls) == DsparkStats.BOUND_AFTER
        assert last.stats.by_drafter["grammar"].num_draft_tokens > 0 and off.stats.total.num_draft_tokens == 0
    finally:
        eng.stop()


def test_best_case_rate_bounds_what_a_probe_could_find():
    from engine.scheduler import CostModel, DsparkStats

    cost = CostModel([0.003 + 0.0002 * k for k in range(16)])
    ds = DsparkStats()
    for seconds in (0.05, 0.002, 0.001):  # one slow reading (a stall) among fast ones
        assert ds.best_case_rate(cost, 7) == float("inf")  # too few forwards timed: probes measure
        assert ds.best_case_rate(cost, 0) == 0.0 and not ds.can_win(cost, 0)  # but no room, no win
        ds.observe_cost(seconds, rows=1)
    forward = 0.001 / DsparkStats.ABSORB_MARGIN  # the fastest, less what absorbing rows may add
    expected = max((1 + n) / (cost.T(n + 1) + forward) for n in range(1, 8))
    assert ds.best_case_rate(cost, 7) == pytest.approx(expected) == pytest.approx(8 / (cost.T(8) + forward))
    assert ds.can_win(cost, 7)  # priced at the fastest forward: the stall shuts nothing out
    assert ds.best_case_rate(cost, 2) == pytest.approx(3 / (cost.T(3) + forward))
    assert ds.best_case_rate(cost, 0) == 0.0
    short = CostModel([0.003 + 0.0002 * k for k in range(3)])  # widths up to 3 rows: L <= 2
    assert ds.best_case_rate(short, 7) == pytest.approx(3 / (short.T(3) + forward))
    slow = CostModel([0.003 + 0.0002 * k for k in range(16)], context_slope=1e-5, reference_context=100)
    assert ds.best_case_rate(slow, 7, context=1100) == pytest.approx(8 / (slow.T(8, 1100) + forward))
    ds = DsparkStats()
    for _ in range(DsparkStats.BOUND_AFTER):
        ds.observe_cost(0.05, rows=1)
    assert ds.best_case_rate(cost, 7) < 1 / cost.T(1) and not ds.can_win(cost, 7)  # a dear one could not


def test_worth_tapping_needs_a_drafter_that_could_be_chosen_or_probed(monkeypatch):
    from engine.scheduler import CostModel, DsparkStats

    cost = CostModel([0.003 + 0.0002 * k for k in range(16)])
    ds = DsparkStats()
    assert ds.worth_tapping(cost, 7)  # no evidence yet: the first probe always fits the budget
    for _ in range(DsparkStats.BOUND_AFTER):
        ds.observe_cost(0.002, rows=1)  # forwards cheap enough that a block accepted whole would win
    ds.observe([0.9] * 7, 7, 0)  # ... but nothing it drafted was accepted
    ds.observe_probe(0.002)  # and its probe spent the budget (no decode time earned yet)
    assert ds.can_win(cost, 7) and not ds.may_probe()
    assert ds.expected_rate(cost) < 1 / cost.T(1)
    assert not ds.worth_tapping(cost, 7)  # neither chosen nor probed: taps would feed nothing
    with monkeypatch.context() as m:  # the knob for side-by-side benchmarks: the old behaviour
        m.setattr(DsparkStats, "TAP_WHILE_IDLE", True)
        assert ds.worth_tapping(cost, 7)
    ds.observe_cycle(10.0)  # decode time refills the budget: it may be probed again
    assert ds.worth_tapping(cost, 7)
    ds.probe_seconds = 1e9
    ds.accepted_ema = 6.0  # it delivers more than plain decoding: worth tapping without probes
    assert ds.expected_rate(cost) > 1 / cost.T(1) and ds.worth_tapping(cost, 7)
    dear = DsparkStats()
    for _ in range(DsparkStats.BOUND_AFTER):
        dear.observe_cost(0.05, rows=1)
    dear.accepted_ema = 6.0
    assert dear.may_probe() and not dear.worth_tapping(cost, 7)  # could not win even then


def test_a_losing_dspark_is_tapped_only_while_a_probe_fits_the_budget(tiny, tmp_path, monkeypatch):
    """A DSpark that could win (a block accepted whole would beat plain decoding) but loses
    (nothing accepted), with no probe budget left after a request's first probe: that request
    drops DSpark on its next cycle instead of tapping hidden rows to its end, and the next one
    drops it on its first cycle, without a probe. Every pass of a request that may run DSpark
    earns the budget, carried or dropped (off and prompt-lookup requests do not), so once it
    has room again a request probes. Output stays plain greedy."""
    from engine.generation import Sequence
    from engine.scheduler import DsparkStats

    eng, calls = slow_losing_dspark(tiny, tmp_path, monkeypatch, delay=0.0)
    # a fixed T(k), steep enough that the optimistic prior (2 tokens in T(5)) does not beat plain
    # decoding, so the first forward is a probe; a block accepted whole still would
    monkeypatch.setattr(eng.cost, "alpha", 0.0)
    monkeypatch.setattr(eng.cost, "_curve", [0.003 + 0.0009 * k for k in range(eng.cost.max_rows)])
    monkeypatch.setattr(DsparkStats, "ABSORB_MARGIN", 1e6)  # any forward: a whole block would win
    for knob in ("PROBE_SHARE", "PROBE_SHARE_MIN"):  # no probe budget beyond the first probe
        monkeypatch.setattr(DsparkStats, knob, 0.0)
    eng.dspark_stats.probe_share = 0.0
    started, dropped, earned = [], [], []  # (request id, carries DSpark); (request id, tokens); passes
    original_make, original_drop = Engine._make_sequence, Sequence._drop_dspark
    original_earn = DsparkStats.observe_cycle

    def recording_make(self, request, dspark=None, submitted_at=None):
        seq = original_make(self, request, dspark, submitted_at)
        started.append((request.request_id, "dspark" in seq.drafters))
        return seq

    def recording_drop(seq):
        dropped.append((seq.request.request_id, seq.num_generated))
        original_drop(seq)

    def recording_earn(self, seconds):
        earned.append(seconds)
        original_earn(self, seconds)

    monkeypatch.setattr(Engine, "_make_sequence", recording_make)
    monkeypatch.setattr(Sequence, "_drop_dspark", recording_drop)
    monkeypatch.setattr(DsparkStats, "observe_cycle", recording_earn)
    try:
        p = prompts(1, seed=9)[0]
        plain, _, _ = run(eng, p, "off", max_tokens=60, ignore_eos=True)
        ids, _, _ = run(eng, p, "prompt_lookup", max_tokens=60, ignore_eos=True)
        assert ids == plain and not earned  # requests that may not run DSpark earn nothing
        ids, _, first = run(eng, p, "dspark", max_tokens=60, ignore_eos=True)
        assert ids == plain and len(calls) == 1  # the first cycle's probe, then no more
        assert started[-1] == (first.request_id, True)
        assert [d[0] for d in dropped] == [first.request_id] and dropped[0][1] <= 2  # on its next cycle
        assert len(earned) == first.stats.num_verify_steps  # every pass earned, DSpark dropped or not
        ids, _, second = run(eng, p, "dspark", max_tokens=60, ignore_eos=True)
        assert ids == plain and started[-1] == (second.request_id, True) and len(calls) == 1
        assert dropped[-1][0] == second.request_id and dropped[-1][1] <= 1  # on its first cycle, no probe
        ids, _, one = run(eng, p, "dspark", max_tokens=1, ignore_eos=True)  # no room to draft
        assert ids == plain[:1] and dropped[-1][0] == one.request_id  # dropped all the same
        with monkeypatch.context() as m:  # the old behaviour: tapped to the end, never probed
            m.setattr(DsparkStats, "TAP_WHILE_IDLE", True)
            ids, _, idle = run(eng, p, "dspark", max_tokens=60, ignore_eos=True)
        # (dropped only on its last cycle, which has no room to draft)
        assert ids == plain and started[-1] == (idle.request_id, True)
        assert dropped[-1] == (idle.request_id, 59) and len(dropped) == 4
        assert len(calls) == 1
        # the budget as a share of the decode time earned: ~180 passes against one forward
        eng.dspark_stats.probe_share = 1.0
        ids, _, again = run(eng, p, "dspark", max_tokens=60, ignore_eos=True)
        assert ids == plain and len(calls) == 2  # probed again
        no_drafts = GenerationRequest(prompt_tokens=p, max_tokens=4,
                                      speculative=SpeculativeParams("dspark", max_draft_tokens=0))
        assert not eng._runs_dspark(no_drafts) and not eng._may_run_dspark(no_drafts)
    finally:
        eng.stop()


def test_batched_passes_earn_the_probe_budget_once_and_only_for_requests_that_may_run_dspark(
        tiny, tmp_path, monkeypatch):
    """Continuous batching: each target pass that carries a request that may run DSpark earns
    the probe budget once, whether it verifies one sequence or several; passes of off requests
    earn nothing."""
    from engine.scheduler import DsparkStats

    eng, _ = slow_losing_dspark(tiny, tmp_path, monkeypatch, delay=0.0)
    assert eng.batch_rows >= 2, "needs continuous batching"
    passes, earned = {"single": 0, "batched": 0}, []
    single, batched, earn = eng.runner.verify, eng.runner.verify_batch, DsparkStats.observe_cycle

    def counting_single(*args, **kwargs):
        passes["single"] += 1
        return single(*args, **kwargs)

    def counting_batched(*args, **kwargs):
        passes["batched"] += 1
        return batched(*args, **kwargs)

    def recording_earn(self, seconds):
        earned.append(seconds)
        earn(self, seconds)

    monkeypatch.setattr(eng.runner, "verify", counting_single)
    monkeypatch.setattr(eng.runner, "verify_batch", counting_batched)
    monkeypatch.setattr(DsparkStats, "observe_cycle", recording_earn)
    try:
        def requests(method):
            return [GenerationRequest(prompt_tokens=p, max_tokens=40, ignore_eos=True,
                                      speculative=SpeculativeParams(method)) for p in prompts(4, seed=21)]

        generate_all(eng, requests("off"), workers=4)
        assert passes["batched"] > 0 and not earned  # batched, and off requests earn nothing
        passes.update(single=0, batched=0)
        generate_all(eng, requests("dspark"), workers=4)
        assert passes["batched"] > 0
        assert len(earned) == passes["single"] + passes["batched"]  # one credit per pass
    finally:
        eng.stop()


def test_warm_up_drafts_leave_no_dspark_evidence(tiny, tmp_path, monkeypatch):
    """The start-up warm-up forces DSpark drafts on a 4-token completion of "Hello, world"; its
    outcome (here: every draft rejected) must not gate DSpark for real requests."""
    from drafters.dspark import DSparkDrafter
    from engine.scheduler import DsparkStats

    path = make_drafter(tiny, tmp_path / "drafter", {77: 12.0})  # drafts 77s the target rejects
    calls = []
    original = DSparkDrafter.propose

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DSparkDrafter, "propose", counting)
    before_timing = []
    timing = Engine._time_dspark_forward
    monkeypatch.setattr(Engine, "_time_dspark_forward", lambda self: (before_timing.append(len(calls)), timing(self))[1])
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    try:
        assert before_timing[0] > 0 and len(before_timing) == 1  # the warm-up drafted, before the timing
        ds, fresh = eng.dspark_stats, DsparkStats()
        assert (ds.cycles, ds.accepted_ema, ds.length_ema, ds.timed_forwards) == (0, fresh.accepted_ema,
                                                                                  fresh.length_ema, 0)
        assert ds.realised == fresh.realised and ds.predicted == fresh.predicted
        # the draft cost is the start-up timing of steady forwards, not the warm-up's forwards
        assert ds.draft_cost == ds.steady_cost > 0 and not ds.recent_costs and not ds.catch_up_costs
        run(eng, prompts(1, seed=2)[0], "dspark", max_tokens=8)
        assert eng.dspark_stats is ds and ds.cycles >= 1  # requests feed this object
    finally:
        eng.stop()


def test_early_dspark_evidence_is_a_running_mean():
    """The first observation replaces the prior; the next ones are averaged with equal weight
    until the EMA's weight takes over, so one unlucky first probe does not outweigh later ones."""
    from engine.scheduler import DsparkStats

    ds = DsparkStats(alpha=0.05)
    ds.observe([0.9] * 4, 4, 0)
    assert ds.accepted_ema == 0.0 and ds.length_ema == 4.0
    ds.observe([0.9] * 4, 4, 4)
    assert ds.accepted_ema == pytest.approx(2.0)
    ds.observe([0.9] * 2, 2, 2)
    assert ds.accepted_ema == pytest.approx(2.0) and ds.length_ema == pytest.approx(10 / 3)
    for _ in range(40):
        ds.observe([0.9] * 4, 4, 4)
    before = ds.accepted_ema
    ds.observe([0.9] * 4, 4, 0)
    assert before - ds.accepted_ema == pytest.approx(0.05 * before)  # the EMA from 1/alpha cycles on
    # a cycle cut to no draft counts for the acceptance, not for the length
    ds = DsparkStats(alpha=0.05)
    ds.observe([], 0, 0)
    ds.observe([0.9, 0.9], 2, 1)
    assert ds.length_ema == 2.0 and ds.accepted_ema == pytest.approx(0.5)


def test_first_cycle_weight_sets_how_much_a_requests_first_cycle_counts(monkeypatch):
    """``FIRST_CYCLE_WEIGHT``: 1 (default) counts a request's first DSpark cycle as any other; 0
    leaves it out of ``accepted_ema`` (and of the running mean's count); 0.5 moves the estimate
    half as far (a weighted running mean)."""
    from engine.scheduler import DsparkStats

    default = DsparkStats(alpha=0.05)
    default.observe([0.9] * 4, 4, 0, first=True)
    assert (default.cycles, default.accepted_ema) == (1, 0.0)  # (as before the knob)
    monkeypatch.setattr(DsparkStats, "FIRST_CYCLE_WEIGHT", 0.0)
    ds = DsparkStats(alpha=0.05)
    ds.observe([0.9] * 4, 4, 0, first=True)
    ds.observe([], 0, 0, first=True)
    assert (ds.cycles, ds.accepted_ema) == (0, 1.0)
    ds.observe([0.9] * 4, 4, 3)
    assert (ds.cycles, ds.accepted_ema) == (1, 3.0)
    monkeypatch.setattr(DsparkStats, "FIRST_CYCLE_WEIGHT", 0.5)
    half = DsparkStats(alpha=0.05)
    half.observe([0.9] * 4, 4, 3)
    half.observe([0.9] * 4, 4, 0, first=True)  # weights 1 and 0.5: mean (3 * 1 + 0 * 0.5) / 1.5
    assert half.cycles == 1.5 and half.accepted_ema == pytest.approx(2.0)


def test_the_engine_marks_a_requests_first_dspark_cycle(tiny, tmp_path, monkeypatch):
    """Each request's first verified DSpark draft, the draft of its first forward, reaches
    ``DsparkStats.observe`` with ``first=True``; later ones with False."""
    from engine.scheduler import DsparkStats

    seen = []
    observe = DsparkStats.observe

    def recording(self, conditional, num_draft, num_accepted, first=False):
        seen.append(first)
        return observe(self, conditional, num_draft, num_accepted, first)

    monkeypatch.setattr(DsparkStats, "observe", recording)
    path = make_drafter(tiny, tmp_path / "drafter")
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    try:
        for prompt in prompts(2, seed=5):
            seen.clear()
            _, _, last = run(eng, prompt, max_tokens=12,
                             speculative=SpeculativeParams(method="dspark", min_draft_tokens=1))
            assert len(seen) == last.stats.by_drafter["dspark"].num_drafts >= 2
            assert seen == [True] + [False] * (len(seen) - 1)
    finally:
        eng.stop()


def test_a_drafter_for_another_target_is_refused_at_start_up(tiny, tmp_path):
    """A drafter whose widths match but whose target had other layers (its taps would read the
    wrong depths) does not load: the engine reports why instead of drafting nonsense."""
    path = make_drafter(tiny, tmp_path / "drafter")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_target_layers": 30}))
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40,)),
                 loaded=tiny)
    try:
        with pytest.raises(RuntimeError, match="does not fit the target: drafter for a target of 30 layers"):
            eng.start(wait=True, timeout=300)
    finally:
        eng.stop()


def test_engine_starts_when_the_start_up_timing_fails(tiny, tmp_path, monkeypatch):
    """The start-up timing of a steady forward is only a first estimate: if it raises, the
    engine starts anyway and prices DSpark from the forwards requests time."""
    path = make_drafter(tiny, tmp_path / "drafter")

    def broken(self):
        raise RuntimeError("no launch")

    monkeypatch.setattr(Engine, "_time_dspark_forward", broken)
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    try:
        assert eng.dspark_stats.steady_cost == 0.0
        ids, _, _ = run(eng, prompts(1, seed=2)[0], "dspark", max_tokens=8)
        assert ids and eng.dspark_stats.timed_forwards >= 1 and eng.dspark_stats.draft_cost > 0
    finally:
        eng.stop()


def test_draft_cost_is_the_steady_forwards_cost():
    """Forwards that project more than ``STEADY_ROWS`` new context rows (a probe after 32+ cycles
    of other drafters) and a request's first (over its prompt) leave the draft cost at the steady
    forwards' (timed at start-up until requests time their own); without either, they set it."""
    from engine.scheduler import CostModel, DsparkStats

    cost = CostModel([0.0015 + 0.0001 * k for k in range(16)])
    ds = DsparkStats(steady_cost=0.0012)
    ds.accepted_ema, ds.length_ema = 1.2, 3.0  # (2.2 tokens per 3.0 ms against 1.5 ms per token)
    assert ds.draft_cost == 0.0012 and ds.expected_rate(cost) > 1 / cost.T(1)
    for rows in (200, 40, DsparkStats.STEADY_ROWS + 1):
        ds.observe_cost(0.0028, rows=rows)
    assert ds.draft_cost == 0.0012 and ds.catch_up_cost == 0.0028 and ds.timed_forwards == 3
    assert ds.expected_rate(cost) > 1 / cost.T(1)  # (priced at 2.8 ms it would lose)
    # ... and a forward that itself projects more than STEADY_ROWS rows is priced at 2.8 ms
    assert ds.forward_cost(DsparkStats.STEADY_ROWS) == 0.0012 and ds.forward_cost(DsparkStats.STEADY_ROWS + 1) == 0.0028
    assert ds.expected_rate(cost, rows=DsparkStats.STEADY_ROWS + 1) < 1 / cost.T(1)
    ds.observe_cost(0.0014, rows=DsparkStats.STEADY_ROWS)
    ds.observe_cost(0.0016, rows=3)
    assert ds.draft_cost == pytest.approx(0.0015) and ds.fastest_forward == 0.0014
    ds.observe_cost(0.009, rows=600, first=True)  # a long prompt's projection is not a catch-up's cost
    assert ds.catch_up_cost == 0.0028 and ds.fastest_forward == 0.0014 and ds.timed_forwards == 6
    unknown = DsparkStats()  # nothing timed at start-up: the dear forwards are all there is
    unknown.observe_cost(0.0028, rows=200, first=True)
    assert unknown.draft_cost == 0.0028 and unknown.catch_up_cost == 0.0
    assert unknown.forward_cost(200) == pytest.approx(DsparkStats.ABSORB_MARGIN * 0.0028)
    fresh = DsparkStats(steady_cost=0.0012)  # no catch-up timed yet: the steady cost and a margin
    assert fresh.forward_cost(200) == pytest.approx(DsparkStats.ABSORB_MARGIN * 0.0012)
    unknown.observe_cost(0.0013, rows=2)
    assert unknown.draft_cost == 0.0013


@pytest.mark.parametrize("prompt", [list(range(10, 50)), [10]], ids=["40 tokens", "1 token"])
def test_a_dspark_forward_that_must_catch_up_is_priced_as_one(dspark_engine, monkeypatch, prompt):
    """A DSpark forward projects every row committed since the request's last one: after cycles
    without DSpark, more than ``steady_rows`` rows make it a catch-up, which costs more (2.33 ms
    against 1.23 ms steady on an H100, where auto, pricing such forwards as steady ones, ran
    code_edit at 0.973x prompt lookup alone); the extra is charged times the share of forwards
    that are catch-ups. Here DSpark wins the first cycle, loses the next 20 (no probe is due and
    none may run), then its recent yield beats plain decoding again at a 1 ms steady forward but
    not at a 20 ms catch-up: charged in full (runs of one forward), it is not run again, and,
    when the request may not keep idle taps, it is dropped on that cycle; charged at a share of
    0.05 (runs of 20 forwards), or with catch-ups as cheap as steady forwards, it runs again.
    A verified draft counts as a win when it beats the other options at the price of the forward
    that made it. A 1-token prompt's first forward projects no row, and the rule still knows it
    ran. Costs and evidence are fixed (a frozen curve, T(k) = 3 + 0.2 (k - 1) ms), so the verdicts
    do not hang on this machine's timing."""
    from collections import deque

    from drafters.dspark import DSparkDrafter
    from engine import generation

    ds, cost = dspark_engine.dspark_stats, dspark_engine.cost
    monkeypatch.setattr(cost, "alpha", 0.0)
    monkeypatch.setattr(cost, "_curve", [0.003 + 0.0002 * k for k in range(cost.max_rows)])
    for name in ("observe_cost", "observe_forward"):
        monkeypatch.setattr(ds, name, lambda *a, **k: None)
    monkeypatch.setattr(ds, "draft_cost", 0.001)
    monkeypatch.setattr(ds, "length_ema", 4.0)
    monkeypatch.setattr(ds, "probe_seconds", 1e9)  # no probe may run
    passes, state = [], {}

    def losing_after_a_draft(*args, **kwargs):  # the first DSpark cycle: its evidence now says it loses
        if len(passes) < state["flip"]:
            ds.accepted_ema = 0.0

    def cycle(seconds):  # after 20 more passes it says DSpark wins again
        passes.append(seconds)
        if len(passes) == state["flip"]:
            ds.accepted_ema, ds.TAP_WHILE_IDLE = 4.0, state["idle_taps"]

    monkeypatch.setattr(ds, "observe", losing_after_a_draft)
    monkeypatch.setattr(ds, "observe_cycle", cycle)
    calls, drops = [], []
    original = DSparkDrafter.propose
    monkeypatch.setattr(DSparkDrafter, "propose", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    drop = generation.Sequence._drop_dspark
    monkeypatch.setattr(generation.Sequence, "_drop_dspark", lambda self: drops.append(self.num_generated) or drop(self))
    bars = []  # (rows the DSpark forward was priced at, the seconds its verified draft must beat)
    choose = generation.Sequence._choose

    def recording_choose(self, *args, **kwargs):
        rows = self._dspark_rows() if "dspark" in self.drafters else None
        out = choose(self, *args, **kwargs)
        if self.dspark_bar is not None:
            bars.append((rows, self.dspark_bar[1] - cost.T(len(out[0].tokens) + 1, len(self.tokens))))
        return out

    monkeypatch.setattr(generation.Sequence, "_choose", recording_choose)
    seen = {}
    for catch_up, share, idle_taps in ((0.02, 1.0, True), (0.02, 1.0, False), (0.02, 0.05, False),
                                       (0.001, 1.0, False)):
        monkeypatch.setattr(ds, "catch_up_costs", deque([catch_up]))
        monkeypatch.setattr(ds, "catch_up_share", share)
        monkeypatch.setattr(ds, "accepted_ema", 4.0)
        monkeypatch.setattr(ds, "TAP_WHILE_IDLE", True)  # (kept while it loses: no probe budget)
        passes.clear(), calls.clear(), drops.clear(), bars.clear()
        state.update(flip=21, idle_taps=idle_taps)
        ids, _, last = run(dspark_engine, prompt, max_tokens=40, temperature=1.0, seed=1, ignore_eos=True,
                           speculative=SpeculativeParams("auto"))  # (sampled: little for prompt lookup to copy)
        assert len(passes) > 25 and len(ids) == 40
        seen[catch_up, share, idle_taps] = (len(calls), list(drops))
        assert bars[0] == (0, pytest.approx(0.001))  # the first forward: priced as a steady one
        for rows, seconds in bars[1:]:  # the catch-up after the flip, then steady ones
            steady = rows <= ds.steady_rows
            assert seconds == pytest.approx(0.001 if steady else 0.001 + share * (catch_up - 0.001)), bars
    # the first forward (over the prompt) ran; the catch-up never did; no drop before the end
    assert seen[0.02, 1.0, True][0] == 1 and min(seen[0.02, 1.0, True][1], default=40) > 30, seen
    # ... and with no idle taps allowed, dropped on the cycle after the flip (about 20 tokens in)
    assert seen[0.02, 1.0, False][0] == 1 and 18 <= seen[0.02, 1.0, False][1][0] <= 24, seen
    for key in ((0.02, 0.05, False), (0.001, 1.0, False)):
        assert seen[key][0] >= 3 and min(seen[key][1], default=40) > 30, seen
    assert any(rows > ds.steady_rows for rows, _ in bars), bars  # (the last case's catch-up)


def test_only_requests_with_another_drafter_measure_how_long_dspark_runs(dspark_engine, monkeypatch):
    """``DsparkStats.catch_up_share`` (how often a DSpark forward is a catch-up, which spreads a
    catch-up's cost over the run it starts) is fed by the unforced forwards of requests that
    have prompt lookup too (auto); dspark-only and forced requests are left out."""
    import math

    ds = dspark_engine.dspark_stats
    for name in ("decode_seconds", "probe_seconds", "probe_share", "catch_up_share", "shared_forwards",
                 "accepted_ema", "length_ema", "cycles", "drafted_cycles"):  # (restored afterwards)
        monkeypatch.setattr(ds, name, getattr(ds, name))
    ds.decode_seconds += 1e6  # probe budget to spare
    monkeypatch.setattr(ds, "can_win", lambda *a, **k: True)
    monkeypatch.setattr(ds, "best_case_rate", lambda *a, **k: math.inf)  # auto's first cycle probes
    fed = []
    observe_forward = ds.observe_forward
    monkeypatch.setattr(ds, "observe_forward", lambda rows: fed.append(rows) or observe_forward(rows))
    prompt = list(range(10, 50))
    for params in (FORCE, SpeculativeParams("auto", min_draft_tokens=3)):
        _, _, last = run(dspark_engine, prompt, max_tokens=8, ignore_eos=True, speculative=params)
        assert last.stats.by_drafter["dspark"].num_drafts >= 2 and fed == []
    run(dspark_engine, prompt, max_tokens=8, ignore_eos=True, speculative=SpeculativeParams("auto"))
    assert fed[:1] == [0]  # the first forward, over the prompt, counts as a steady one


def test_a_forward_of_more_rows_than_a_cycle_commits_is_a_catch_up():
    """A steady forward projects what one DSpark cycle commits (``steady_rows``: the block's rows,
    which the engine passes); more rows make a catch-up even where the fused launch projects them
    itself (up to 64 with its 8-row kernel): on an H200 the forwards of up to 64 rows auto timed,
    counted as steady ones, set the draft cost to 1.8-2.5 ms against 1.1-1.4 ms."""
    from engine.scheduler import DsparkStats

    ds = DsparkStats(steady_cost=0.001, steady_rows=8)
    ds.observe_cost(0.0025, rows=40)
    assert ds.draft_cost == 0.001 and ds.catch_up_cost == 0.0025
    assert ds.forward_cost(8) == 0.001 and ds.forward_cost(9) == pytest.approx(0.0025)  # (share 1 before any)
    ds.observe_cost(0.0012, rows=8)
    assert ds.draft_cost == 0.0012
    ds.observe_forward(9)
    assert ds.catch_up_share == 1.0


def test_the_engine_counts_one_cycles_rows_as_steady(tiny, tmp_path):
    """The engine's steady rows are what one DSpark cycle commits (``block_size + 1``), within
    what the drafter projects in its steady path (``DraftStep.steady_rows``)."""
    path = make_drafter(tiny, tmp_path / "drafter")
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40,),
                              warmup=False), loaded=tiny).start(wait=True, timeout=300)
    try:
        block = eng.dspark.config.block_size
        assert eng.dspark_stats.steady_rows == min(block + 1, eng._dspark_step.steady_rows) == block + 1
    finally:
        eng.stop()


def test_a_requests_first_forward_is_never_a_steady_one():
    """A request's first forward projects its prompt and sets up its draft cache: kept out of the
    draft cost however short the prompt (the first forwards of short prompts were most of what
    auto timed on an H200, probes being rare)."""
    from engine.scheduler import DsparkStats

    ds = DsparkStats(steady_cost=0.0013, steady_rows=8)
    ds.observe_cost(0.0024, rows=5, first=True)
    assert ds.draft_cost == 0.0013 and list(ds.prompt_costs) == [0.0024] and not ds.recent_costs
    assert ds.fastest_forward == 0.0024 and ds.timed_forwards == 1
    untimed = DsparkStats(steady_rows=8)  # nothing timed at start-up: it is all there is
    untimed.observe_cost(0.0024, rows=5, first=True)
    assert untimed.draft_cost == 0.0024


def test_a_catch_up_is_charged_by_the_share_of_forwards_that_are_catch_ups():
    from engine.scheduler import DsparkStats

    ds = DsparkStats(steady_cost=0.001)
    assert ds.catch_up_share == 1.0  # before any evidence: a catch-up is charged in full
    assert ds.forward_cost(40) == pytest.approx(DsparkStats.ABSORB_MARGIN * 0.001)
    ds.observe_cost(0.003, rows=40)
    assert ds.forward_cost(40) == pytest.approx(0.003) and ds.forward_cost(DsparkStats.STEADY_ROWS) == 0.001
    ds.observe_forward(2)  # one steady forward halves the prior (it counts as one forward) ...
    assert ds.catch_up_share == pytest.approx(0.5) and ds.forward_cost(40) == pytest.approx(0.002)
    ds.observe_forward(40)
    for _ in range(2):
        ds.observe_forward(2)
    assert ds.catch_up_share == pytest.approx(0.4)  # ... in a running mean over the first forwards
    assert ds.forward_cost(40) == pytest.approx(0.001 + 0.4 * 0.002)
    for _ in range(200):  # then an EMA: runs of one forward again
        ds.observe_forward(DsparkStats.STEADY_ROWS + 1)
    assert ds.catch_up_share > 0.99 and ds.forward_cost(40) == pytest.approx(0.003, rel=0.01)


def test_engine_times_each_forward_by_the_new_context_rows_it_projects(tiny, tmp_path, monkeypatch):
    """A request's first DSpark forward projects its whole context; every later one of a request
    drafting each cycle projects only the last cycle's committed rows (the anchor and the
    accepted drafts), so only the first projects more than ``STEADY_ROWS``, and it is kept out of
    the catch-up cost."""
    from engine.scheduler import DsparkStats

    path = make_drafter(tiny, tmp_path / "drafter")
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    seen = []
    try:
        ds = eng.dspark_stats
        original = ds.observe_cost
        firsts = []
        monkeypatch.setattr(ds, "observe_cost", lambda seconds, *, rows, first=False: (
            seen.append(rows), firsts.append(first), original(seconds, rows=rows, first=first)))
        prompt = [int(t) for t in np.random.default_rng(3).integers(3, 259, 48)]
        _, _, last = run(eng, prompt, speculative=FORCE, max_tokens=24, ignore_eos=True)
        steps = last.stats.num_verify_steps
        assert len(seen) >= steps - 1 > 3
        assert seen[0] == len(prompt) - 1 > DsparkStats.STEADY_ROWS  # (the prompt's last token is the anchor)
        assert all(1 <= r <= eng.dspark.config.block_size + 1 for r in seen[1:]), seen
        assert firsts[0] and not any(firsts[1:])  # (the prompt's projection is kept out of catch_up_cost)
        assert len(ds.prompt_costs) == 1 and not ds.catch_up_costs
        assert len(ds.recent_costs) == min(len(seen) - 1, DsparkStats.COST_WINDOW)
    finally:
        eng.stop()


def test_draft_cost_ignores_a_first_forward_that_compiled_kernels():
    """The draft cost is the median of the recent timed forwards: a first forward that compiled
    CUDA kernels (~17 s on a fresh H100) stops counting from the third forward on, where an
    average seeded with it read 147 ms after 45 forwards of ~2 ms; a lasting change is followed."""
    from engine.scheduler import CostModel, DsparkStats

    cost = CostModel([0.0015 + 0.0001 * k for k in range(16)])
    ds = DsparkStats()
    ds.observe_cost(17.0, rows=1)
    assert ds.draft_cost == 17.0
    ds.observe_cost(0.002, rows=1)
    ds.observe_cost(0.0021, rows=1)
    assert ds.draft_cost == pytest.approx(0.0021)
    ds.accepted_ema, ds.length_ema = 6.0, 7.0  # blocks accepted nearly whole: DSpark wins
    assert ds.expected_rate(cost) > 1 / cost.T(1)
    for _ in range(DsparkStats.COST_WINDOW):  # forwards got dearer for good
        ds.observe_cost(0.05, rows=1)
    assert ds.draft_cost == 0.05 and ds.expected_rate(cost) < 1 / cost.T(1)


def test_probe_budget_rule():
    from engine.scheduler import DsparkStats

    ds = DsparkStats()
    for _ in range(DsparkStats.BOUND_AFTER):  # a forward's cost is known: losing probes halve the share
        ds.observe_cost(0.05, rows=1)
    assert ds.may_probe()  # the first probe always runs
    ds.observe_probe(0.1)
    assert not ds.may_probe()
    ds.observe_cycle(4.0)  # 2% of 4 s = 80 ms < 100 ms spent
    assert not ds.may_probe()
    ds.observe_cycle(1.0)  # 2% of 5 s = 100 ms
    assert not ds.may_probe()  # but that probe halved the share: 1% of 5 s
    ds.observe_cycle(5.0)  # 1% of 10 s = 100 ms
    assert ds.may_probe()


def test_probe_share_shrinks_with_every_losing_probe_and_recovers_on_a_win():
    from engine.scheduler import DsparkStats

    ds = DsparkStats()
    for _ in range(DsparkStats.BOUND_AFTER - 1):  # probes that measure a forward's cost keep the share
        ds.observe_cost(0.01, rows=1)
        ds.observe_probe(0.01)
        assert ds.probe_share == DsparkStats.PROBE_SHARE
    ds.observe_cost(0.01, rows=1)
    ds.probe_seconds = 0.0
    shares = []
    for _ in range(8):
        ds.observe_probe(0.01)
        shares.append(ds.probe_share)
    assert shares[:3] == [0.01, 0.005, 0.0025]
    assert shares[3:] == [DsparkStats.PROBE_SHARE_MIN] * 5  # the floor: probes never stop
    ds.observe_cycle(33.0)  # 0.25% of 33 s = 82.5 ms >= 80 ms spent
    assert ds.may_probe()
    ds.observe_probe(0.01)
    assert not ds.may_probe()
    ds.observe_win()
    assert ds.probe_share == DsparkStats.PROBE_SHARE and ds.may_probe()


def test_a_winning_dspark_restores_the_probe_share(dspark_engine, monkeypatch):
    """After losing probes shrank the budget, DSpark's evidence says it wins (recent cycles
    accepted 4 of 4 drafts) and its drafts pass (the target's argmax is the token the drafter
    favours): its verified drafts beat plain decoding, forward included, and that restores the
    full share for later probes. Drafts that fail restore nothing. The costs are fixed (a frozen
    curve, T(k) = 3 + 0.2 (k - 1) ms, and a 1 ms forward) so that the verdict does not hang on
    this machine's timing: a fully accepted draft of L tokens then yields (1 + L) / (T(L + 1) +
    1 ms) > 1 / T(1) for every L >= 1, and a rejected one 1 / (T(L + 1) + 1 ms) < 1 / T(1)."""
    from engine.scheduler import DsparkStats

    ds = dspark_engine.dspark_stats
    cost = dspark_engine.cost
    monkeypatch.setattr(cost, "alpha", 0.0)  # (observe() leaves the curve alone)
    monkeypatch.setattr(cost, "_curve", [0.003 + 0.0002 * k for k in range(cost.max_rows)])
    monkeypatch.setattr(ds, "draft_cost", 0.001)
    monkeypatch.setattr(ds, "observe_cost", lambda seconds, *, rows, first=False: None)
    monkeypatch.setattr(ds, "probe_share", DsparkStats.PROBE_SHARE_MIN)
    monkeypatch.setattr(ds, "accepted_ema", 4.0)
    monkeypatch.setattr(ds, "length_ema", 4.0)
    kw = {"sampling_kw": {"logit_bias": ((77, 30.0),)}}
    _, _, last = run(dspark_engine, prompts(1, seed=4)[0], "x", max_tokens=30, speculative=DS)
    assert last.stats.by_drafter["dspark"].num_drafts >= 1
    assert last.stats.by_drafter["dspark"].num_accepted_tokens == 0  # (the drafter favours 77)
    assert ds.probe_share == DsparkStats.PROBE_SHARE_MIN
    monkeypatch.setattr(ds, "accepted_ema", 4.0)
    _, _, last = run(dspark_engine, prompts(1, seed=4)[0], "x", max_tokens=30, speculative=DS, **kw)
    assert last.stats.by_drafter["dspark"].num_accepted_tokens > 5
    assert ds.probe_share == DsparkStats.PROBE_SHARE


def test_unused_dspark_forwards_are_counted(dspark_engine, monkeypatch):
    """DSpark runs on the first cycle of an auto request and its proposal loses (here: its
    calibrated acceptance is zero, so it is cut to nothing; which option wins otherwise depends
    on the measured forward cost and on earlier tests' evidence), so that forward is paid for
    and not verified: the request's stats and the server's counter say so."""
    from server.metrics import Metrics

    p = [9, 10, 11, 12, 13] * 6
    dspark_engine.dspark_stats.decode_seconds += 1e6  # probe budget to spare (tested above)
    # (and DSpark not gated off: earlier tests on this module's engine, timed under a loaded CI
    # worker, can leave a forward cost with which it could never beat plain decoding)
    monkeypatch.setattr(dspark_engine.dspark_stats, "can_win", lambda *a, **k: True)
    monkeypatch.setattr(dspark_engine.dspark_stats, "calibrated", lambda conditional: [0.0] * len(conditional))
    _, _, last = run(dspark_engine, p, "x", max_tokens=30, speculative=SpeculativeParams("auto"))
    ds = last.stats.by_drafter["dspark"]
    assert ds.num_unused_proposals >= 1 and last.stats.total.num_unused_proposals == ds.num_unused_proposals
    assert last.stats.as_dict()["by_drafter"]["dspark"]["num_unused_proposals"] == ds.num_unused_proposals
    metrics = Metrics()
    metrics.request_finished(last)
    text = metrics.render().decode()
    assert f'specserve:spec_decode_num_unused_proposals_total{{drafter="dspark"}} {float(ds.num_unused_proposals)}' in text
    # forced DSpark drafts are verified: none unused
    _, _, forced = run(dspark_engine, p, "x", max_tokens=12, speculative=FORCE)
    assert forced.stats.by_drafter["dspark"].num_unused_proposals == 0


def test_pending_hidden_states_are_folded_while_dspark_rests(tiny, tmp_path, monkeypatch):
    """While DSpark is not run (its probes are rare), the committed rows' hidden states pile up
    for its next forward; every PENDING_HIDDEN_MAX cycles the new ones are folded into one
    evaluated chunk instead of holding every pass's full hidden output, and the drafter still
    gets every committed row."""
    from drafters.dspark import DSparkDrafter
    from engine import generation

    path = make_drafter(tiny, tmp_path / "drafter", {5: 40.0})
    eng = Engine(EngineConfig(speculation="dspark", dspark_drafter=str(path), calibration_contexts=(40,)),
                 loaded=tiny).start(wait=True, timeout=300)
    seen = []
    original = DSparkDrafter.propose
    monkeypatch.setattr(DSparkDrafter, "propose",
                        lambda self, ctx, *a, **k: seen.append(None if ctx.hidden is None else ctx.hidden.shape[0])
                        or original(self, ctx, *a, **k))
    lengths = []
    original_observe = generation.Sequence.observe

    def observe(self, *args, **kwargs):
        out = original_observe(self, *args, **kwargs)
        lengths.append(len(self.pending_hidden) - self.pending_folded)  # lazy slices held
        return out

    monkeypatch.setattr(generation.Sequence, "observe", observe)
    eng.dspark_stats.decode_seconds = 1e6
    try:
        prompt = prompts(1, seed=5)[0]
        run(eng, prompt, "dspark", max_tokens=100, ignore_eos=True)
        assert max(lengths) <= generation.PENDING_HIDDEN_MAX
        # the second forward (the first probe, 32 cycles after the first forward lost) got every
        # row committed since the first
        assert len(seen) >= 2 and seen[1] >= generation.DSPARK_PROBE_EVERY
    finally:
        eng.stop()


def test_a_probe_after_other_drafters_cycles_drafts_from_the_whole_context(tiny, tmp_path, monkeypatch):
    """DSpark's probes come after cycles of prompt lookup and plain decoding, whose committed
    rows reach the drafter as pending hidden states (folded every PENDING_HIDDEN_MAX cycles)
    and are projected at the probe: the drafter's context cache then equals that of a fresh
    drafter given the whole sequence's tapped rows at once, at every forward, and so do its
    drafts (auto judges DSpark by what its probes accept)."""
    from drafters.base import DraftContext
    from drafters.dspark import DSparkDrafter
    from engine import generation
    from engine.scheduler import DsparkStats

    path = make_drafter(tiny, tmp_path / "drafter", {5: 4.0})
    eng = Engine(EngineConfig(speculation="auto", dspark=True, dspark_drafter=str(path), calibration_contexts=(40,)),
                 loaded=tiny).start(wait=True, timeout=300)
    seen = []
    original = DSparkDrafter.propose

    def propose(self, ctx, max_len):
        out = original(self, ctx, max_len)
        cache = [np.array(a[:, :, : self.context_length]) for a in (*self._keys, *self._values)]
        seen.append((list(ctx.tokens), max_len, list(out.tokens), cache))
        return out

    try:
        monkeypatch.setattr(DSparkDrafter, "propose", propose)
        monkeypatch.setattr(DsparkStats, "best_case_rate", lambda *a, **k: float("inf"))  # probes always due
        monkeypatch.setattr(DsparkStats, "worth_tapping", lambda *a, **k: True)
        monkeypatch.setattr(generation, "DSPARK_PROBE_EVERY", 5)
        monkeypatch.setattr(generation, "DSPARK_PROBE_MAX", 5)
        monkeypatch.setattr(generation, "PENDING_HIDDEN_MAX", 3)  # (folds between forwards)
        monkeypatch.setattr(eng.cost, "alpha", 0.0)  # (a fixed cost curve: the same cycles every run)
        monkeypatch.setattr(eng.cost, "_curve", [0.003 + 0.0002 * k for k in range(eng.cost.max_rows)])
        eng.dspark_stats.decode_seconds = 1e6
        prompt = prompts(1, seed=5)[0]
        ids, _, last = run(eng, (prompt * 2)[:60], "auto", max_tokens=160, ignore_eos=True)
        assert last.stats.by_drafter["prompt_lookup"].num_drafts > 0
        taps = eng.target_taps
        assert len(seen) >= 4
        for tokens, max_len, drafts, cache in seen:
            hidden = taps.forward(mx.array(tokens[:-1])[None])[1][0].astype(mx.float32)
            fresh = DSparkDrafter(eng.dspark, taps.embed, taps.lm_head, eng._dspark_step)
            assert original(fresh, DraftContext(tokens, hidden), max_len).tokens == drafts
            want = [np.array(a[:, :, : fresh.context_length]) for a in (*fresh._keys, *fresh._values)]
            for got, exp in zip(cache, want):
                np.testing.assert_allclose(got, exp, atol=1e-4, rtol=1e-4)
        # some forward caught up more rows than one DSpark cycle commits (block 5 + the bonus)
        assert max(len(b[0]) - len(a[0]) for a, b in zip(seen, seen[1:])) > 6
    finally:
        eng.stop()
