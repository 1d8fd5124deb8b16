"""Continuous batching: decoding sequences share target passes; each output equals its solo output."""

import random
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from dspark_helpers import make_drafter
from helpers import assert_no_leaks, pin_cost
from test_engine import prompts

from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, SpeculativeParams
from engine.runner import TargetRunner
from engine.stats import NullSink


class BatchRecorder(NullSink):
    def __init__(self):
        self.batches = []

    def batch_step(self, num_sequences, num_committed):
        self.batches.append((num_sequences, num_committed))


class ShapeRecorder:
    """Stands in for a runner's model: records the shape of every call's input ids (a batched
    pass of mlx-lm's modules is one call over ``[sequences, padded rows]``); the rest passes
    through."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __call__(self, ids, *args, **kwargs):
        self.shapes.append(tuple(ids.shape))
        return self.model(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def requests(seed: int, n: int) -> list[GenerationRequest]:
    """Varied requests: greedy and seeded sampling, every method, logprobs, stops, lengths."""
    rng = random.Random(seed)
    out = []
    for i, p in enumerate(prompts(n, seed=seed)):
        sampled = i % 4 == 3
        out.append(GenerationRequest(
            prompt_tokens=p, max_tokens=rng.randint(8, 40),
            sampling=SamplingParams(temperature=0.8 if sampled else 0.0, seed=1000 + i if sampled else None,
                                    top_k=20 if i % 5 == 0 else 0),
            logprobs=2 if i % 3 == 0 else None, stop=("ab",) if i % 7 == 0 else (),
            speculative=SpeculativeParams(("auto", "prompt_lookup", "off")[i % 3]),
        ))
    return out


def collect(engine, req: GenerationRequest):
    clone = GenerationRequest(**{**req.__dict__, "request_id": f"{req.request_id}-{id(engine)}-{random.random()}"})
    events = list(engine.generate(clone, timeout=600))
    assert events[-1].error is None, events[-1].error
    lps = [(lp.token, lp.logprob, lp.top) for e in events for lp in (e.logprobs or [])]
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), lps, events[-1].finish_reason


def concurrently(engine, reqs):
    with ThreadPoolExecutor(len(reqs)) as pool:
        return list(pool.map(lambda r: collect(engine, r), reqs))


@pytest.fixture(scope="module")
def pair(tiny):
    cfg = dict(speculation="auto", calibration_contexts=(40, 300), max_active=8)
    solo = Engine(EngineConfig(batching="off", **cfg), loaded=tiny).start(wait=True, timeout=300)
    rec = BatchRecorder()
    batched = Engine(EngineConfig(**cfg), loaded=tiny, sink=rec).start(wait=True, timeout=300)
    yield solo, batched, rec
    solo.stop()
    batched.stop()


def test_verify_batch_rows_equal_each_sequences_own_pass(tiny):
    runner = TargetRunner(tiny.model)
    runner.calibrate(tiny.config["vocab_size"], max_rows=8, contexts=(40,))
    runner.model = recorder = ShapeRecorder(runner.model)  # (this runner's own: tiny.model is untouched)
    rng = random.Random(3)
    for lengths in ([1, 1, 1], [4, 1, 2], [1, 6], [3, 3, 1, 1]):
        seqs = []
        for n in lengths:
            cache = runner.make_cache()
            mx.eval(runner.prefill([rng.randrange(3, 259) for _ in range(rng.randint(5, 60))], cache)[0])
            seqs.append((cache, [rng.randrange(3, 259) for _ in range(n)], cache[0].offset))
        alone = []
        for cache, rows, _ in seqs:
            logits = runner.verify(rows, cache)[0]
            mx.eval(logits)
            runner.trim(cache, len(rows))
            alone.append(logits)
        together = runner.verify_batch([s[1] for s in seqs], [s[0] for s in seqs])
        assert recorder.shapes[-1] == (len(lengths), max(lengths))  # one padded pass for all of them
        for (cache, rows, start), a, (logits, hidden) in zip(seqs, alone, together):
            assert logits.shape == a.shape and mx.array_equal(logits, a).item() and hidden is None
            # every layer appended the sequence's real rows, not the padding
            assert all(c.offset == start + len(rows) for c in cache)


def test_concurrent_outputs_equal_solo_outputs(pair, monkeypatch):
    solo, batched, rec = pair
    assert batched.batch_rows >= 2, "calibration found batching inexact on this machine"
    recorder = ShapeRecorder(batched.runner.model)
    monkeypatch.setattr(batched.runner, "model", recorder)  # (restored after the test: the engine is shared)
    for seed in range(3):
        reqs = requests(seed, 8)
        alone = [collect(solo, r) for r in reqs]
        together = concurrently(batched, reqs)
        for a, t in zip(alone, together):
            assert t == a  # tokens, text, logprobs (floats compared exactly), finish reason
    assert len(rec.batches) > 10 and max(n for n, _ in rec.batches) >= 4
    assert max(shape[0] for shape in recorder.shapes) >= 4  # a target pass really held 4 sequences
    assert_no_leaks(batched)


def test_few_sequences_draft_long_within_their_share(pair):
    """Three sequences share 12 rows: up to 4 each, drafts of 3 tokens (row-exact attention).
    The batched engine's verify cost is made flat and frozen (no context term, no online refresh,
    as pin_cost freezes it: unfrozen, passes timed on a loaded worker can steepen it again, and
    once in a fresh-clone run no batched pass accepted drafts), so the scheduler spends those
    rows on drafts."""
    solo, batched, rec = pair
    cost = batched.cost
    saved = cost.verify_cost, cost.alpha, cost.context_slope, cost.context_row_slope
    cost.reset([saved[0][0]] * len(saved[0]))
    cost.alpha = cost.context_slope = cost.context_row_slope = 0.0
    reqs = []
    for i in range(3):
        p = prompts(1, seed=20 + i)[0]  # a repeated pattern: prompt lookup drafts long
        reqs.append(GenerationRequest(prompt_tokens=p * 2, max_tokens=40, logprobs=3,
                                      sampling=SamplingParams(temperature=0.0),
                                      speculative=SpeculativeParams("prompt_lookup")))
    before = len(rec.batches)
    try:
        for _ in range(2):
            assert concurrently(batched, reqs) == [collect(solo, r) for r in reqs]
    finally:
        cost.alpha, cost.context_slope, cost.context_row_slope = saved[1:]
        cost.reset(saved[0])
    assert any(n == 3 and c > 3 for n, c in rec.batches[before:])  # batched passes accepted drafts


def test_more_sequences_than_a_batch_all_progress(tiny):
    rec = BatchRecorder()
    eng = Engine(EngineConfig(speculation="auto", calibration_contexts=(40, 300), max_active=12, max_verify_rows=3),
                 loaded=tiny, sink=rec).start(wait=True, timeout=300)
    try:
        eng.batch_rows = 3  # force rotation: 12 sequences, 3 per pass
        reqs = requests(5, 12)
        solo = [collect(eng, r) for r in reqs]
        assert concurrently(eng, reqs) == solo
        assert max(n for n, _ in rec.batches) == 3
    finally:
        eng.stop()


def test_batched_dspark_sequences_equal_solo(tiny, tmp_path, monkeypatch):
    import engine.engine as engine_module

    steps = []  # (drafter, drafted, accepted, expected) of each sequence in each batched cycle
    real_step = engine_module.speculative_batch_step

    def recording_step(*args, **kwargs):
        results = real_step(*args, **kwargs)
        steps.extend(r.verify_step for r in results if not isinstance(r, Exception))
        return results

    monkeypatch.setattr(engine_module, "speculative_batch_step", recording_step)
    path = make_drafter(tiny, tmp_path / "drafter", {77: 12.0})
    cfg = dict(speculation="auto", dspark=True, dspark_drafter=str(path), calibration_contexts=(40, 300))
    solo = Engine(EngineConfig(batching="off", **cfg), loaded=tiny).start(wait=True, timeout=300)
    rec = BatchRecorder()
    batched = Engine(EngineConfig(**cfg), loaded=tiny, sink=rec).start(wait=True, timeout=300)
    try:
        pin_cost([batched])  # batch widths (DSpark's share of a batch) must not follow this machine's timings
        reqs = requests(9, 6)
        for i, r in enumerate(reqs):
            r.speculative = SpeculativeParams("dspark", min_draft_tokens=2) if i % 2 else SpeculativeParams("auto")
            if i % 3 == 0:
                r.sampling = SamplingParams(temperature=0.0, logit_bias=((77, 30.0),))
        alone = [collect(solo, r) for r in reqs]
        assert concurrently(batched, reqs) == alone
        assert rec.batches
        # DSpark drafted inside a batched pass, and its drafts were accepted there
        assert any(drafter == "dspark" and accepted > 0 for drafter, _, accepted, _ in steps), steps
    finally:
        solo.stop()
        batched.stop()


def test_unknown_batching_mode_fails_start_up(tiny):
    with pytest.raises(RuntimeError, match="batching"):
        Engine(EngineConfig(batching="sometimes", calibration_contexts=(40, 300)), loaded=tiny).start(
            wait=True, timeout=300)


def test_batch_metrics_over_http(tiny):
    from conftest import tiny_live_server
    from test_server import metric, post

    live = tiny_live_server(tiny, max_active=8)
    try:
        before = metric(live, "batch_size_count")
        body = {"prompt": [5, 6, 7, 8] * 6, "max_tokens": 24, "temperature": 0, "speculative": {"method": "off"}}
        alone = post(live, "/v1/completions", body).json()["choices"][0]["text"]
        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(lambda _: post(live, "/v1/completions", body).json()["choices"][0]["text"], range(6)))
        assert texts == [alone] * 6
        assert metric(live, "batch_size_count") > before
        assert metric(live, "batch_committed_tokens_total") >= metric(live, "batch_size_sum")
    finally:
        live.stop()


def test_batch_width_weighs_draft_rows_against_the_whole_batch():
    from engine.scheduler import CostModel, batch_width

    flat = CostModel([1.0] * 12)
    steep = CostModel([1.0 + 0.5 * k for k in range(12)])  # T(k) = 0.5 + 0.5 k
    sure, unsure, none = [0.95] * 5, [0.3] * 5, []
    assert batch_width([sure, sure], flat, 6) == 6  # rows are free: draft all
    assert batch_width([none, none], flat, 6) == 1  # nothing to verify
    assert batch_width([unsure] * 4, steep, 3) == 1  # weak drafts do not pay for 4 more rows each
    assert batch_width([sure, sure], steep, 6) > 1
    assert steep.T(14) == steep.T(12) + 2 * 0.5  # extrapolated past the measured range


def test_a_failing_sequence_ends_alone(pair, monkeypatch):
    """A commit that raises for one request in a batch ends that request with an error; the
    other requests of the same batched passes finish with their solo outputs."""
    import inspect

    from engine import generation

    solo, batched, _ = pair
    reqs = requests(31, 6)
    alone = [collect(solo, r) for r in reqs]
    victim = reqs[2].prompt_tokens
    real_commit = generation.Sequence.commit
    raised_in_batch = []  # per raise: whether it came from a batched cycle

    def commit(self, tokens, logprobs):
        if self.request.prompt_tokens == victim and self.num_generated >= 3:
            raised_in_batch.append(any(f.function == "speculative_batch_step" for f in inspect.stack(0)))
            raise RuntimeError("boom in one request")
        return real_commit(self, tokens, logprobs)

    monkeypatch.setattr(generation.Sequence, "commit", commit)

    def attempt(r):
        try:
            return collect(batched, r)
        except AssertionError as exc:
            return exc

    with ThreadPoolExecutor(len(reqs)) as pool:
        got = list(pool.map(attempt, reqs))
    assert isinstance(got[2], AssertionError) and "boom in one request" in str(got[2])
    assert raised_in_batch == [True]  # the failure hit a batched cycle, beside the other requests
    assert [g for i, g in enumerate(got) if i != 2] == [a for i, a in enumerate(alone) if i != 2]
    assert_no_leaks(batched)


def test_batching_off_steps_one_sequence_per_pass(tiny):
    rec = BatchRecorder()
    eng = Engine(EngineConfig(batching="off", calibration_contexts=(40, 300)), loaded=tiny, sink=rec).start(
        wait=True, timeout=300)
    try:
        assert eng.batch_rows == 0
        assert concurrently(eng, requests(4, 4)) and not rec.batches
    finally:
        eng.stop()


def test_cost_curve_measured_under_load_recovers():
    """A start-up curve measured while the CPU was busy (every width 1.17 s) next to real
    7 ms decode passes: after three such passes the whole curve follows (by their median ratio),
    so drafts can run again and correct the wider widths; lone outliers leave it alone."""
    from engine.scheduler import CostModel, choose_length

    cost = CostModel([1.17 + 0.001 * k for k in range(16)])
    for _ in range(20):  # without the rescale only T(1) would follow, slowly: drafting never pays
        cost.observe(1, 0.007)
    assert cost.T(1) < 0.01 and cost.T(16) < 0.01
    assert choose_length([0.9] * 8, cost)[0] > 0
    steady = CostModel([0.01 * (1 + 0.1 * k) for k in range(16)])
    before = list(steady.verify_cost)
    steady.observe(1, 0.5)  # a lone one-row spike, then a miss the other way: the curve is left alone
    steady.observe(1, 0.0001)  # (a miss the other way starts a new streak)
    assert steady.verify_cost == before
    steady.observe(4, 0.5)  # a lone wide spike moves its own width by at most alpha of T(4)
    after = steady.verify_cost
    assert before[3] < after[3] <= before[3] * 1.05 + 1e-12 and after[:3] == before[:3]
    steady.observe(1, before[0] * 1.1)  # an ordinary one-row pass: every width moves a little
    again = steady.verify_cost
    assert all(b < a < b * 1.1 for a, b in zip(again, after))

