"""Engine reliability: cancels take effect within one step, timeouts, abort/drain, no leaked state."""

from __future__ import annotations

import random
import threading
import time

import pytest
from helpers import assert_no_leaks, run

from engine import (
    Engine,
    EngineConfig,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    RequestTimeout,
    SamplingParams,
    SpeculativeParams,
)

LONG = dict(max_tokens=1900, ignore_eos=True)


def greedy(prompt, method="auto", max_tokens=48, rid=None, **kw):
    extra = {"request_id": rid} if rid else {}
    return GenerationRequest(prompt_tokens=list(prompt), max_tokens=max_tokens, ignore_eos=True,
                             sampling=SamplingParams(temperature=0.0),
                             speculative=SpeculativeParams(method=method), **extra, **kw)


class Recorder:
    """An emit callback that keeps every event and signals the last."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.finish_reason is not None or event.error is not None:
            self.done.set()


def test_cancel_takes_effect_before_the_next_step(tiny_engine):
    for method in ("off", "prompt_lookup"):
        rec = Recorder()
        req = greedy([5, 6, 7, 8, 9] * 4, method=method, max_tokens=1900)
        tiny_engine._enqueue(req, rec)
        while sum(1 for e in rec.events if e.token_ids) < 3:
            time.sleep(0.001)
        tiny_engine.cancel(req.request_id)
        seen = len(rec.events)  # (counted once cancel() returned: the test thread may be preempted)
        assert rec.done.wait(30)
        after = [e for e in rec.events[seen:] if e.token_ids]
        assert len(after) <= 1, f"{len(after)} steps ran after cancel ({method})"  # the one in flight
        last = rec.events[-1]
        assert last.finish_reason is FinishReason.CANCELLED and last.error is None
        assert last.completion_tokens < 1900
        assert_no_leaks(tiny_engine)


def test_cancels_interleaved_with_other_requests_do_not_change_their_outputs(tiny_engine):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    prompts += [[10, 11, 12, 13] * 6, list(b"def f(x):\n    return x + 1\n\ndef g(x):\n")]
    solo = [run(tiny_engine, p, method="auto", max_tokens=48, ignore_eos=True)[0] for p in prompts]
    assert_no_leaks(tiny_engine)

    results: dict[int, list[int]] = {}

    def keep(i):
        results[i] = [t for e in tiny_engine.generate(greedy(prompts[i]), timeout=120) for t in e.token_ids]

    def victim(j):  # abandon the stream after a few events: the generator's close cancels it
        gen = tiny_engine.generate(greedy(prompts[j % len(prompts)], max_tokens=1900), timeout=120)
        for k, _ in enumerate(gen):
            if k >= j % 4:
                break
        gen.close()

    threads = []
    for i in range(len(prompts)):
        threads.append(threading.Thread(target=keep, args=(i,)))
        threads.append(threading.Thread(target=victim, args=(i,)))
    rng.shuffle(threads)
    for t in threads:
        t.start()
        time.sleep(rng.random() * 0.02)
    for t in threads:
        t.join(120)
    assert [results[i] for i in range(len(prompts))] == solo
    assert_no_leaks(tiny_engine)


@pytest.fixture(scope="module")
def timeout_engine(tiny):
    eng = Engine(EngineConfig(speculation="auto", calibration_contexts=(40, 300), max_active=1,
                              request_timeout=1.5), loaded=tiny).start(wait=True, timeout=300)
    yield eng
    eng.stop()


def test_request_timeout_stops_running_and_queued_requests(timeout_engine):
    running, queued = Recorder(), Recorder()
    started = time.monotonic()
    first = timeout_engine._enqueue(greedy([3, 4, 5], method="off", max_tokens=1900), running)
    second = timeout_engine._enqueue(greedy([6, 7, 8], method="off", max_tokens=1900), queued)
    # the second request's deadline is set a little after the first's (however long this thread
    # took between the two calls): once the first times out, the slot it frees could admit the
    # second just before its own deadline (CI saw one token). It cannot start before the first
    # ends (max_active=1), so give it the first's deadline: it must time out while still queued.
    second.deadline = first.deadline
    assert running.done.wait(30) and queued.done.wait(30)
    elapsed = time.monotonic() - started
    for rec in (running, queued):
        last = rec.events[-1]
        assert last.finish_reason is FinishReason.TIMEOUT
        assert isinstance(last.error, RequestTimeout) and last.error.status == 408
    assert 0 < running.events[-1].completion_tokens < 1900
    assert sum(len(e.token_ids) for e in running.events) == running.events[-1].completion_tokens
    assert queued.events == [queued.events[-1]] and queued.events[-1].completion_tokens == 0
    assert 1.5 <= elapsed < 15.0
    assert_no_leaks(timeout_engine)
    # a short request inside the limit is unaffected
    ids, _, last = run(timeout_engine, [3, 4, 5], max_tokens=8, ignore_eos=True)
    assert len(ids) == 8 and last.finish_reason is FinishReason.LENGTH


def test_drain_finishes_short_requests_and_aborts_long_ones(tiny):
    eng = Engine(EngineConfig(speculation="auto", calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    try:
        # the deadline from this machine's speed now: ~10 of the short request's time, under a
        # tenth of the long one's (a fixed 1 s deadline failed under load)
        started = time.monotonic()
        run(eng, [3, 4, 5], max_tokens=16)
        deadline = max(1.0, 10 * (time.monotonic() - started))
        short, long_ = Recorder(), Recorder()
        eng._enqueue(greedy([3, 4, 5], max_tokens=16), short)
        eng._enqueue(greedy([6, 7, 8], method="off", max_tokens=1900), long_)
        started = time.monotonic()
        assert eng.drain(timeout=deadline) is False
        assert time.monotonic() - started < deadline + 10.0
        assert short.events[-1].finish_reason is FinishReason.LENGTH and short.events[-1].error is None
        assert short.events[-1].completion_tokens == 16
        last = long_.events[-1]
        assert last.finish_reason is FinishReason.CANCELLED and isinstance(last.error, EngineUnavailable)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            eng.validate(greedy([3, 4, 5]))
        with pytest.raises(EngineUnavailable):
            eng._enqueue(greedy([3, 4, 5]), Recorder())
        assert_no_leaks(eng)
        assert eng.drain(timeout=1.0) is True  # nothing left: returns at once
    finally:
        eng.stop()


def test_stop_during_start_up_ends_the_worker_at_the_next_phase_boundary(tiny, monkeypatch):
    """stop() while the worker calibrates cannot interrupt that phase: it returns False at its
    timeout, and the worker ends as soon as the phase does, before batch calibration and the
    warm-up, reporting 'stopped' (not an error); a request then gets EngineUnavailable."""
    entered, release = threading.Event(), threading.Event()
    calibrate = Engine._calibrate

    def blocked_calibrate(self, compiled):
        entered.set()
        assert release.wait(60)
        calibrate(self, compiled)

    def past_a_stop_point(*args, **kwargs):  # batch calibration, the warm-up's sequence
        raise AssertionError("start-up went on past a stop point")

    from engine.runner import TargetRunner

    monkeypatch.setattr(Engine, "_calibrate", blocked_calibrate)
    monkeypatch.setattr(TargetRunner, "calibrate_batch", past_a_stop_point)
    monkeypatch.setattr(Engine, "_make_sequence", past_a_stop_point)
    engine = Engine(EngineConfig(max_active=4), loaded=tiny).start()
    assert entered.wait(60)
    t0 = time.monotonic()
    assert engine.stop(timeout=0.2) is False
    assert time.monotonic() - t0 < 2
    assert engine.health()["state"] == "loading"
    release.set()
    engine._thread.join(60)
    assert not engine._thread.is_alive()
    health = engine.health()
    assert health["state"] == "stopped" and not engine.ready, health
    assert engine.prefix_cache is None and engine.batch_rows == 0
    with pytest.raises(EngineUnavailable):
        run(engine, [5, 6, 7])


def test_timings_count_the_wait_for_a_slot(tiny):
    """A request queued behind another (max_active=1) reports that wait as its ``queue_time``,
    and its time to first token and elapsed time count from submission, as docs/metrics.md
    says; ``time_per_output_token`` spans its first to its last token. (No request timeout:
    on a loaded machine the second request's wait alone could pass one.)"""
    eng = Engine(EngineConfig(speculation="auto", calibration_contexts=(40, 300), max_active=1),
                 loaded=tiny).start(wait=True, timeout=300)
    try:
        first, second = Recorder(), Recorder()
        h1 = eng._enqueue(greedy([3, 4, 5], method="off", max_tokens=60), first)
        h2 = eng._enqueue(greedy([6, 7, 8], method="off", max_tokens=12), second)
        assert first.done.wait(60) and second.done.wait(60)
        a, b = first.events[-1], second.events[-1]
        assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
        assert 0 <= a.queue_time < a.elapsed
        # it was admitted only once the first had ended (one slot): its wait covers the first's run
        assert h2.submitted_at + b.queue_time >= h1.submitted_at + a.elapsed
        ttft = next(e.time_to_first_token for e in second.events if e.token_ids)
        assert b.queue_time <= ttft <= b.elapsed
        assert 0 < b.time_per_output_token * (b.completion_tokens - 1) <= b.elapsed - ttft + 1e-6
        assert_no_leaks(eng)
    finally:
        eng.stop()
