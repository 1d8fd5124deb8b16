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
