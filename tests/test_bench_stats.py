"""The paired bootstrap interval and the side-by-side variants of benchmarks/bench_speculative.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import bench_speculative as bench
from benchmarks.bench_speculative import paired_interval
from engine.scheduler import RequestAcceptance


def runs(seconds: list[float], tokens: int = 97, prompts: list[int] | None = None) -> list[dict]:
    rows = [{"tokens": tokens, "decode_s": s} for s in seconds]
    return rows if prompts is None else [{**r, "prompt": p} for r, p in zip(rows, prompts)]


def test_interval_brackets_the_ratio_and_pairs_cancel_shared_noise():
    # every run of b is 5% slower than its twin in a, under noise shared by the pair
    shared = [1.0, 3.0, 1.5, 2.5, 0.8, 2.0, 1.2, 2.8]
    a, b = runs(shared), runs([s * 1.05 for s in shared])
    low, high = paired_interval(a, b)
    assert low == pytest.approx(1.05) and high == pytest.approx(1.05)
    # unpaired noise of +-10% per run widens the interval around the true ratio
    jitter = [1.1, 0.9, 1.05, 0.95, 1.1, 0.9, 1.0, 1.0]
    low, high = paired_interval(runs([s * j for s, j in zip(shared, jitter)]), b)
    assert low < 1.05 < high and high - low > 0.05
    assert paired_interval(a, b, seed=1) == paired_interval(a, b, seed=1)
    assert paired_interval([], []) == [] and paired_interval(a, b[:-1]) == []
    # runs of one prompt are drawn together: two prompts, one 10% faster under a, one 10% slower
    prompts = [0, 0, 0, 0, 1, 1, 1, 1]
    fast = runs([1.0] * 4 + [1.1] * 4, prompts=prompts)
    low, high = paired_interval(fast, runs([1.1] * 4 + [1.0] * 4, prompts=prompts))
    assert (low, high) == (round(1 / 1.1, 4), 1.1)  # each draw holds 0, 1 or 2 copies of a prompt
    assert paired_interval(fast, runs([1.0] * 8, prompts=[1] * 8)) == []  # not the same prompts
    # one prompt (a single session): its runs are resampled one by one, not as one group
    low, high = paired_interval(runs([1.0] * 4 + [1.1] * 4, prompts=[0] * 8), runs([1.1] * 4 + [1.0] * 4, prompts=[0] * 8))
    assert low < 1.0 < high


class RecordingEngine:
    """Stands in for the engine: records the method of each request and the scheduler knob's
    value while the request is being served."""

    def __init__(self):
        self.seen = []

    def generate(self, req, timeout):
        self.seen.append((req.speculative.method, RequestAcceptance.OPTIMISM))
        yield SimpleNamespace(error=None, token_ids=[1, 2], stats=None)
        self.seen.append((req.speculative.method, RequestAcceptance.OPTIMISM))
        yield SimpleNamespace(error=None, token_ids=[3], stats=None)


def test_a_variant_holds_while_its_request_runs_and_is_restored(monkeypatch):
    monkeypatch.setattr(bench, "VARIANTS", dict([bench.parse_variant(
        "greedy:engine.scheduler.RequestAcceptance.OPTIMISM=0")]))
    default = RequestAcceptance.OPTIMISM
    eng = RecordingEngine()
    assert bench.run_once(eng, [5, 6], "auto+greedy", 3)["ids"] == [1, 2, 3]
    bench.run_once(eng, [5, 6], "auto", 3)
    assert eng.seen == [("auto", 0), ("auto", 0), ("auto", default), ("auto", default)]
    assert RequestAcceptance.OPTIMISM == default

    class Boom(RecordingEngine):
        def generate(self, req, timeout):
            yield SimpleNamespace(error="engine failed", token_ids=[], stats=None)

    with pytest.raises(RuntimeError):
        bench.run_once(Boom(), [5], "prompt_lookup+greedy", 3)
    assert RequestAcceptance.OPTIMISM == default  # restored after a failed request too
    for bad in ("auto+other", "auto+", "+greedy", "autox+greedy"):
        with pytest.raises(ValueError):
            bench.run_once(eng, [5], bad, 3)


def test_an_inherited_attribute_is_inherited_again_after_its_variant(monkeypatch):
    class Base:
        KNOB = 1

    class Child(Base):
        pass

    monkeypatch.setattr(bench, "VARIANTS", {"v": [(Child, "KNOB", 2)]})
    with bench.method_variant("auto+v") as base:
        assert base == "auto" and Child.KNOB == 2 and Base.KNOB == 1
    assert "KNOB" not in vars(Child)
    Base.KNOB = 3
    assert Child.KNOB == 3  # it follows its base class again


@pytest.mark.parametrize("spec", [
    "nocolon", ":engine.scheduler.RequestAcceptance.OPTIMISM=0", "a+b:engine.scheduler.RequestAcceptance.OPTIMISM=0",
    "x:engine.scheduler.RequestAcceptance.OPTIMISM", "x:engine.scheduler.RequestAcceptance.NO_SUCH=1",
    "x:no_such_module.Owner.ATTR=1", "x:engine.scheduler.RequestAcceptance.OPTIMISM=not-json", "x:OPTIMISM=1",
])
def test_malformed_variants_are_refused(spec):
    with pytest.raises(ValueError):
        bench.parse_variant(spec)


def test_a_variant_sets_several_attributes():
    name, assigns = bench.parse_variant(
        "v:engine.scheduler.RequestAcceptance.OPTIMISM=0.25,engine.scheduler.DsparkStats.BOUND_AFTER=[1, 2]")
    assert name == "v" and [(a, v) for _, a, v in assigns] == [("OPTIMISM", 0.25), ("BOUND_AFTER", [1, 2])]


def test_the_command_line_refuses_bad_variants_before_loading_a_model():
    for argv in (["--methods", "off,auto+x"], ["--methods", "off,nope"],
                 ["--variant", "x:engine.scheduler.RequestAcceptance.OPTIMISM=0",
                  "--variant", "x:engine.scheduler.RequestAcceptance.OPTIMISM=1"]):
        with pytest.raises(SystemExit):
            bench.main(argv)


def test_a_forced_method_asks_for_drafts_every_cycle():
    """``METHOD@N`` runs METHOD with ``min_draft_tokens=N``; the plain name asks for none; a bad
    N is refused before a model loads."""
    from types import SimpleNamespace

    seen = []

    class Eng:
        def generate(self, req, timeout=None):
            seen.append(req.speculative)
            yield SimpleNamespace(error=None, token_ids=[5], stats=None)

    for method in ("dspark@3", "dspark", "auto@1"):
        bench.run_once(Eng(), [1, 2], method, 4)
    assert [(p.method, p.min_draft_tokens) for p in seen] == [("dspark", 3), ("dspark", 0), ("auto", 1)]
    for bad in ("off,dspark@0", "off,dspark@x", "off,nope@2", "off,off@1", "off,dspark@\uff11", "off,auto+v@2"):
        with pytest.raises(SystemExit):
            bench.main(["--methods", bad])


@pytest.mark.parametrize("repeats", [1, 2, 3])
def test_method_order_gives_every_method_every_position_equally_often(repeats):
    methods = ["off", "prompt_lookup", "dspark", "auto"]
    for rep in range(repeats):
        orders = [bench.method_order(methods, rep, i) for i in range(len(methods))]
        assert all(sorted(o) == sorted(methods) for o in orders)  # each runs once per prompt
        for pos in range(len(methods)):  # ... and once in each position over len(methods) prompts
            assert sorted(o[pos] for o in orders) == sorted(methods)
    assert bench.method_order(methods, 0, 0) == methods  # the first prompt keeps the given order
    assert bench.method_order(methods, 1, 3) == methods[::-1]  # (1 + 3) % 4 = 0: reversed only


def test_a_session_runs_turn_by_turn_with_every_method_in_every_position(monkeypatch):
    """run_methods on a 4-turn session: every method answers a turn (same prompt tokens) before
    the next turn starts, the order rotates from turn to turn so each method runs in each
    position once, the history grows with the first method's reply, and each method's rows
    and ids come in turn order."""
    from types import SimpleNamespace

    methods = ["off", "prompt_lookup", "dspark", "auto"]
    calls = []

    def fake_run_once(eng, tokens, method, max_tokens, grammar=None):
        calls.append((tuple(tokens), method))
        turn = sum(1 for c in calls if c[1] == method) - 1
        return {"ids": [100 * turn + methods.index(method)], "tokens": 1, "decode_s": 1.0, "turn": turn}

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt):
            return [len(m["content"]) for m in messages] + [hash(messages[-1]["content"]) % 97]

    eng = SimpleNamespace(loaded=SimpleNamespace(token_table=SimpleNamespace(
        decode=lambda ids: "reply" + "x" * ids[0])))
    monkeypatch.setattr(bench, "run_once", fake_run_once)
    session = {"kind": "session", "turns": ["a", "bb", "ccc", "dddd"]}
    outs, rows = bench.run_methods(eng, Tok(), session, methods, 1, 0, 8)
    turns = [calls[4 * t:4 * t + 4] for t in range(4)]
    for t, block in enumerate(turns):
        assert sorted(m for _, m in block) == sorted(methods)  # every method on this turn ...
        assert len({tokens for tokens, _ in block}) == 1  # ... with the same prompt
        assert [m for _, m in block] == bench.method_order(methods, 1, t)
    for pos in range(4):
        assert sorted(block[pos][1] for block in turns) == sorted(methods)
    # turn 2's prompt: user, reply, user, reply, user (+ a marker); the replies are methods[0]'s
    # ("off": ids [0] and [100], decoded to "reply" and "reply" + 100 x's)
    assert turns[2][0][0][:5] == (1, len("reply"), 2, len("reply" + "x" * 100), 3)
    for m in methods:
        assert [r["turn"] for r in rows[m]] == [0, 1, 2, 3] and all("ids" not in r for r in rows[m])
        assert outs[m] == [100 * t + methods.index(m) for t in range(4)]
    calls.clear()  # a plain prompt runs each method whole, in method_order
    monkeypatch.setattr(bench, "run_prompt", lambda eng, tok, p, m, n: (calls.append(((), m)) or [1], [{}]))
    outs, rows = bench.run_methods(eng, Tok(), {"kind": "raw", "prompt": "p"}, methods, 0, 2, 8)
    assert [m for _, m in calls] == bench.method_order(methods, 0, 2) and set(outs) == set(methods)
