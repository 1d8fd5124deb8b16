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
