"""The offline scheduler replay (benchmarks/replay_scheduler.py) on synthetic outputs."""

from benchmarks.replay_scheduler import replay

FLAT = [1.0, 1.0, 1.05, 1.1] + [1.1 + 0.05 * i for i in range(1, 13)]
STEEP = [1.0 + 0.6 * i for i in range(16)]


def test_copying_output_pays_and_novel_output_costs_nothing_extra():
    block = list(range(100, 140))
    copying = {"copy": [[block + [7, 8], block[:38]]]}  # the output repeats the prompt
    novel = {"novel": [[[1, 2, 3, 4], list(range(200, 260))]]}  # nothing to look up
    fast = replay(copying, FLAT)["copy"]
    assert fast["speedup"] > 3.0 and fast["accepted"] >= 30
    none = replay(novel, FLAT)["novel"]
    assert none["speedup"] == 1.0 and none["drafts"] == 0
    # a steep curve (every row costs 0.6 of a step) makes the same copy worth less
    assert 1.0 < replay(copying, STEEP)["copy"]["speedup"] < fast["speedup"]


def test_draft_overhead_is_charged_per_drafted_cycle():
    block = list(range(100, 140))
    copying = {"copy": [[block + [7, 8], block[:38]]]}
    base = replay(copying, FLAT)["copy"]
    slow = replay(copying, FLAT, draft_overhead=0.5)["copy"]
    assert slow["drafts"] == base["drafts"] > 0
    assert slow["speedup"] < base["speedup"]


def test_replay_drafts_exactly_what_the_engine_drafts(tiny):
    """On the tiny model, with a fixed cost curve, the replay of the recorded plain outputs
    makes the engine's choices: the same drafts, drafted tokens and accepted tokens per request
    (so the replay measures the engine's policy, not a look-alike)."""
    from test_engine import prompts

    from engine import Engine, EngineConfig, GenerationRequest, SamplingParams, SpeculativeParams
    from engine.scheduler import AcceptanceModel

    eng = Engine(EngineConfig(speculation="prompt_lookup", max_verify_rows=16, calibration_contexts=(40, 300)),
                 loaded=tiny).start(wait=True, timeout=300)
    try:
        # A fixed flat curve, no context term and no online refresh: the engine's choices then
        # depend on the outputs alone, not on how fast this machine timed the widths at start-up
        # (CI's 2-core runner, loaded by another test worker, once timed a curve so steep that
        # prompt lookup drafted once in 12 requests)
        # (truncated to the exact verify width that calibration found: wider passes are not exact)
        assert eng.cost.max_rows > 1
        eng.cost.reset([1e-3 * t for t in FLAT[:eng.cost.max_rows]])
        eng.acceptance = AcceptanceModel()
        eng.cost.context_slope = eng.cost.context_row_slope = 0.0
        eng.cost.alpha = 0.0
        curve = eng.cost.relative()
        max_tokens = 40

        def run(tokens, method):
            req = GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens,
                                    sampling=SamplingParams(temperature=0.0),
                                    speculative=SpeculativeParams(method=method))
            events = list(eng.generate(req, timeout=300))
            return [t for e in events for t in e.token_ids], events[-1].stats

        requests = [[p, run(p, "off")[0]] for p in prompts(12, seed=5)]
        engine_counts = []
        for p, _ in requests:
            _, stats = run(p, "prompt_lookup")
            engine_counts.append((stats.total.num_drafts, stats.total.num_draft_tokens,
                                  stats.total.num_accepted_tokens))
        assert eng.cost.relative() == curve
    finally:
        eng.stop()
    assert sum(c[0] for c in engine_counts) > 10  # prompt lookup drafted
    model = AcceptanceModel()
    cfg = EngineConfig()
    replayed = [replay({"r": [r]}, curve, max_draft=cfg.prompt_lookup_max_draft, min_n=cfg.prompt_lookup_min_ngram,
                       max_n=cfg.prompt_lookup_max_ngram, max_tokens=max_tokens, model=model)["r"]
                for r in requests]
    assert [(r["drafts"], r["drafted"], r["accepted"]) for r in replayed] == engine_counts
