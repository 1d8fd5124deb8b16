"""Structured output (engine/constraint.py): grammar masks per verify row, exact speculation under
a grammar, the grammar's end, and response_format / structured_outputs over HTTP."""

import json
import random
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from helpers import generate_all, run
from llguidance import LLMatcher
from test_server import metric, post, sse_events

from drafters import Draft
from engine import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    SpeculativeParams,
    generation,
    json_grammar,
    regex_grammar,
)
from engine.constraint import GrammarConstraint, compile_grammar, ll_tokenizer
from engine.generation import Sequence
from engine.sampling import LogitsPipeline

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count", "tags"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3}}}
GRAMMAR = json_grammar(SCHEMA)


def _conforms(text):
    value = json.loads(text)
    assert set(value) == {"answer", "count", "tags"} and value["answer"] in ("yes", "no")
    assert 0 <= value["count"] <= 99 and len(value["tags"]) <= 3 and all(len(t) <= 4 for t in value["tags"])


_LL = {}


def _constraint(tiny, grammar=GRAMMAR, **kw):
    vocab = tiny.config["vocab_size"]
    if id(tiny) not in _LL:
        _LL[id(tiny)] = ll_tokenizer(tiny.tokenizer, vocab, tiny.eos_token_ids)
    matcher = compile_grammar(grammar, _LL[id(tiny)])
    return GrammarConstraint(matcher, vocab, tiny.eos_token_ids, **kw)


def test_masks_per_row_equal_masks_one_token_at_a_time(tiny):
    c = _constraint(tiny)
    tok = tiny.tokenizer
    rng = random.Random(0)
    committed = tok.encode('{"answer":"yes","count":4', add_special_tokens=False)
    for t in committed:
        c.commit(t)
    for _ in range(30):
        valid = tok.encode(rng.choice([',"tags":["ab","c"]}', ',"tags":[]}', '1,"tags":["x"', "7"]),
                           add_special_tokens=False)
        draft = valid[: rng.randint(0, len(valid))] + [rng.randrange(3, 259) for _ in range(rng.randint(0, 3))]
        masks = np.array(c.masks(draft))
        n = c.valid_prefix(draft)
        assert masks.shape == (len(draft) + 1, tiny.config["vocab_size"])
        for r in range(n + 1):  # a fresh matcher fed committed + draft[:r], one token at a time
            fresh = _constraint(tiny)
            for t in committed + draft[:r]:
                fresh.commit(t)
            assert (masks[r] == np.array(fresh.masks([]))[0]).all(), (draft, r)
        if n < len(draft):  # the first forbidden draft is masked in its row (later rows: unreachable)
            assert not masks[n][draft[n]] and (masks[n + 1:] == masks[n]).all()
        # reading the masks left the committed state as it was
        assert c.consumed == len(committed) and c.valid_prefix(draft) == n


def test_a_proposal_is_cut_before_the_first_forbidden_token(tiny):
    c = _constraint(tiny)
    tok = tiny.tokenizer
    ok = tok.encode('{"answer":"no"', add_special_tokens=False)
    bad = tok.encode('{"answer":"maybe"', add_special_tokens=False)
    owner = SimpleNamespace(constraint=c)
    draft = Sequence._grammar_cut(owner, Draft(tokens=list(bad), confidence=[0.9] * len(bad)))
    assert draft.tokens == bad[:len(draft.tokens)] and len(draft.confidence) == len(draft.tokens)
    assert len(draft.tokens) == c.valid_prefix(bad) < len(bad)
    assert Sequence._grammar_cut(owner, Draft(tokens=list(ok))).tokens == ok


def test_sampled_drafts_with_draft_probs_keep_the_target_distribution(tiny):
    """A DSpark-style draft (tokens drawn from q, verified by the rejection rule) under a grammar:
    q puts half its mass on a token the grammar forbids. The first committed token must follow
    the masked target p (the draft is cut after, not before, the forbidden token)."""
    import mlx.core as mx
    from scipy import stats

    vocab = tiny.config["vocab_size"]
    a, b, c = (tiny.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    logits = mx.full((2, vocab), -30.0)
    logits[:, a], logits[:, b], logits[:, c] = 1.0, 0.0, 2.0  # masked p: a 0.73, b 0.27
    q = np.zeros((1, vocab), np.float32)
    q[0, a] = q[0, c] = 0.5
    expected = np.exp([1.0, 0.0]) / np.exp([1.0, 0.0]).sum()
    rng = np.random.default_rng(0)
    counts = {a: 0, b: 0}
    n = 3000
    for seed in range(n):
        c_ = _constraint(tiny, regex_grammar("[ab]x"))
        pipe = LogitsPipeline(SamplingParams(temperature=1.0, seed=seed), seed, 0, c_)
        x = a if rng.random() < 0.5 else c
        draft = Sequence._grammar_cut(SimpleNamespace(constraint=c_), Draft(tokens=[x], draft_probs=mx.array(q)))
        rows = pipe.process(logits[: len(draft.tokens) + 1], [], draft.tokens)
        row_tokens, passed = pipe.verify(rows, draft.tokens, draft.draft_probs, 0)
        accepted = next((i for i, ok in enumerate(passed.tolist()) if not ok), len(draft.tokens))
        first = (draft.tokens[:accepted] + [row_tokens.tolist()[accepted]])[0]
        counts[first] += 1
    assert stats.chisquare([counts[a], counts[b]], expected * n).pvalue > 1e-3, counts


def test_mask_unpacking_on_host_and_device_agree(tiny):
    c = _constraint(tiny)
    packed = np.random.default_rng(0).integers(0, 2**32, size=(5, (tiny.config["vocab_size"] + 31) // 32),
                                               dtype=np.uint64).astype(np.uint32)
    host, device = np.array(c._unpack(packed, on_device=False)), np.array(c._unpack(packed, on_device=True))
    assert host.shape == (5, tiny.config["vocab_size"]) and (host == device).all()
    assert host[0, 0] == bool(packed[0, 0] & 1) and host[0, 33] == bool(packed[0, 1] >> 1 & 1)


class _SlipperyMatcher:
    """An llguidance matcher whose rollback fails, as one left in its error state does."""

    def __init__(self, inner):
        self.inner = inner

    def rollback(self, n):
        return False

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_failed_rollback_rebuilds_the_committed_state(tiny):
    tok = tiny.tokenizer
    committed = tok.encode('{"answer":"no","count":1', add_special_tokens=False)
    draft = tok.encode('2,"tags":["a"]}', add_special_tokens=False)
    c = _constraint(tiny)
    for t in committed:
        c.commit(t)
    reference = np.array(c.masks(draft))
    c.matcher = _SlipperyMatcher(c.matcher)
    assert (np.array(c.masks(draft)) == reference).all()  # the rows were read before the restore
    fresh = _constraint(tiny)
    for t in committed:
        fresh.commit(t)
    assert (np.array(c.masks(draft)) == np.array(fresh.masks(draft))).all()
    assert c.valid_prefix(draft) == len(draft)


def test_wider_logits_and_ignore_eos(tiny):
    import mlx.core as mx

    c = _constraint(tiny, regex_grammar("[a-c]{1,3}"), ignore_eos=True)
    vocab = tiny.config["vocab_size"]
    out = np.array(c.apply(mx.zeros((1, vocab + 5)), []))
    assert np.isneginf(out[0, vocab:]).all() and np.isfinite(out[0, 3 + ord("a")])
    for ch in "ab":
        c.commit(tiny.tokenizer.encode(ch, add_special_tokens=False)[0])
    row = np.array(c.masks([]))[0]  # accepting, but may go on: EOS stays forbidden with ignore_eos
    assert not row[2] and row[3 + ord("c")]
    plain = _constraint(tiny, regex_grammar("[a-c]{1,3}"))
    for ch in "ab":
        plain.commit(tiny.tokenizer.encode(ch, add_special_tokens=False)[0])
    assert np.array(plain.masks([]))[0][2]


def _json_prompts(tok, n, seed=0):
    """Prompts that quote conforming JSON (prompt lookup drafts from them) and random bytes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            out.append([rng.randrange(3, 259) for _ in range(rng.randint(1, 30))])
        else:
            item = json.dumps({"answer": rng.choice(["yes", "no"]), "count": rng.randrange(100),
                               "tags": ["ab", "c"][: rng.randint(0, 2)]}, separators=(",", ":"))
            out.append(tok.encode((item + " ") * rng.randint(1, 4), add_special_tokens=False))
    return out


def test_forced_tokens(tiny):
    c = _constraint(tiny)
    for t in tiny.tokenizer.encode('{"answer":"yes"', add_special_tokens=False):
        c.commit(t)
    forced = tiny.token_table.decode(c.forced_tokens(16))
    assert forced and ',"count":'.startswith(forced)
    assert len(c.forced_tokens(2)) == min(2, len(c.forced_tokens(16))) and c.forced_tokens(0) == []
    assert c.consumed == len(tiny.tokenizer.encode('{"answer":"yes"', add_special_tokens=False))


def test_an_eos_inside_a_draft_is_not_consumed(tiny):
    """llguidance does not count a consumed EOS, so rolling one back undid a token too many."""
    c = _constraint(tiny, json_grammar(None))
    tok = tiny.tokenizer
    draft = tok.encode('{"a":1}', add_special_tokens=False) + [2] + tok.encode("x", add_special_tokens=False)
    before = np.array(c.masks([]))
    masks = np.array(c.masks(draft))
    assert masks.shape[0] == len(draft) + 1 and masks[draft.index(2)][2]  # EOS allowed where it stands
    assert c.consumed == 0 and (np.array(c.masks([])) == before).all() and c.valid_prefix(draft[:7]) == 7


class _FailingStep:
    """An LLMatcher whose step at output position ``at`` fails: ``"slow"``, it costs 1 s of a
    fake CPU clock, as llguidance's costly steps do (``compute_ff_tokens`` does the work and
    keeps it for the next ``compute_bitmask`` at the same state, free then; any other mask there
    pays); ``"refuse"``, consuming the token there fails (an llguidance limit)."""

    def __init__(self, matcher, clock, at, how):
        self._m, self._clock, self._at, self._how = matcher, clock, at, how
        self._pos, self._kept = 0, None
        self.forced_at_the_slow_step = False

    def __getattr__(self, name):
        return getattr(self._m, name)

    def _moved(self, ok, by):
        if ok:
            self._pos, self._kept = self._pos + by, None
        return ok

    def consume_token(self, token):
        if self._how == "refuse" and self._pos == self._at:
            return False
        return self._moved(self._m.consume_token(token), 1)

    def consume_tokens(self, tokens):
        return self._moved(self._m.consume_tokens(tokens), len(tokens))

    def rollback(self, n):
        return self._moved(self._m.rollback(n), -n)

    def reset(self):
        self._m.reset()
        self._pos, self._kept = 0, None

    def compute_ff_tokens(self):
        if self._how == "slow" and self._pos == self._at:
            self._clock[0] += 1.0
            self._kept, self.forced_at_the_slow_step = self._pos, True
        return self._m.compute_ff_tokens()

    def compute_bitmask(self):
        if self._how == "slow" and self._pos == self._at and self._kept != self._pos:
            self._clock[0] += 1.0
        return self._m.compute_bitmask()


@pytest.mark.parametrize("how", ["slow", "refuse"])
def test_a_failing_grammar_step_ends_speculation_where_it_ends_plain_decoding(tiny_engine, tiny, monkeypatch, how):
    """A grammar step that fails at a draft row ends the request after the same tokens, with
    the same error, as plain decoding: the drafts before that step are emitted, then the error.
    For a slow step: compute_ff_tokens does the costly part of the next step (llguidance keeps it
    for the next mask), so drafting forced tokens must not let a request past the per-step limit
    that plain decoding meets. A fake CPU clock puts the costly step on the same output position
    whatever the machine's speed or load (a real slow grammar flipped near the limit on CI)."""
    clock = [0.0]
    monkeypatch.setattr("engine.constraint.time", SimpleNamespace(thread_time=lambda: clock[0]))
    accept, cache_lengths = generation._accept, []

    def checked_accept(seq, *args):
        assert seq.pending_error is None  # a failure the last cycle reached ended the request
        result = accept(seq, *args)
        # the KV cache holds every output token but the next anchor
        cache_lengths.append((seq.runner.cache_length(seq.cache), len(seq.tokens) - 1))
        failed_row = seq.constraint.failed_row
        if failed_row is not None and result.verify_step[2] >= failed_row and not seq.finished:
            assert seq.pending_error is not None  # (not recomputed: that step costs as much again)
        return result

    monkeypatch.setattr(generation, "_accept", checked_accept)
    grammar = json_grammar({"type": "object", "additionalProperties": False, "required": ["a", "b"],
                            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"const": "abc def ghi jkl mno pqr stu vwx"}}})
    prompt = tiny.tokenizer.encode("hi")
    forced_at_a_slow_step = 0
    for at in range(1, 14):
        outcomes = []
        for method in ("off", "prompt_lookup"):
            request = GenerationRequest(prompt_tokens=prompt, max_tokens=40, grammar=grammar, logprobs=1,
                                        sampling=SamplingParams(temperature=0.0),
                                        speculative=SpeculativeParams(method))
            request.grammar_matcher = matcher = _FailingStep(tiny_engine.prepare_grammar(grammar), clock, at, how)
            events = list(tiny_engine.generate(request, timeout=600))
            outcomes.append(([t for e in events for t in e.token_ids], "".join(e.text for e in events),
                             [(lp.token, lp.logprob) for e in events for lp in e.logprobs or []],
                             events[-1].completion_tokens, str(events[-1].error)))
            forced_at_a_slow_step += matcher.forced_at_the_slow_step
        assert outcomes[0] == outcomes[1], at
        # plain decoding emits the tokens before the failing step (and counts only them), then its error
        ids, text, logprobs, completion_tokens, error = outcomes[0]
        assert len(ids) == completion_tokens == len(logprobs) == at and text and error != "None", (at, outcomes[0])
    assert cache_lengths and all(a == b for a, b in cache_lengths), cache_lengths
    if how == "slow":
        assert forced_at_a_slow_step > 0  # the grammar drafted at the slow step (its cost came first)


def test_greedy_and_seeded_speculation_are_identical_under_a_grammar(tiny_engine, tiny):
    drafted = forced = 0
    for i, prompt in enumerate(_json_prompts(tiny.tokenizer, 24)):
        for temperature in (0.0, 0.9):
            plain, plain_text, last = run(tiny_engine, prompt, "off", max_tokens=64, temperature=temperature,
                                          seed=i, grammar=GRAMMAR)
            spec, spec_text, spec_last = run(tiny_engine, prompt, temperature=temperature, seed=i, grammar=GRAMMAR,
                                             speculative=SpeculativeParams("prompt_lookup", None, 1), max_tokens=64)
            assert spec == plain and spec_text == plain_text, (i, temperature)
            assert spec_last.finish_reason == last.finish_reason
            if last.finish_reason is FinishReason.STOP:
                _conforms(plain_text)
            drafted += spec_last.stats.total.num_draft_tokens
            grammar = spec_last.stats.by_drafter.get("grammar")
            forced += grammar.num_draft_tokens if grammar else 0
    assert drafted > 100  # the drafts were verified under the masks, not skipped
    assert forced > 20  # the grammar drafted the keys it forces (and they changed nothing)


def test_batched_requests_under_grammars(tiny_engine, tiny):
    prompts = _json_prompts(tiny.tokenizer, 8, seed=1)
    grammars = [GRAMMAR, None, LLMatcher.grammar_from_regex("[a-c]{3,9}x"), GRAMMAR]

    def requests(method):
        return [GenerationRequest(prompt_tokens=p, max_tokens=48, grammar=grammars[i % 4],
                                  sampling=SamplingParams(temperature=0.0),
                                  speculative=SpeculativeParams(method, None, 1 if method != "off" else 0))
                for i, p in enumerate(prompts)]

    plain = generate_all(tiny_engine, requests("off"))
    spec = generate_all(tiny_engine, requests("prompt_lookup"))
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert [t for e in a for t in e.token_ids] == [t for e in b for t in e.token_ids], i
    drafted = {}
    for events in spec:
        for name, counts in events[-1].stats.by_drafter.items():
            drafted[name] = drafted.get(name, 0) + counts.num_draft_tokens
    # (so the match above compares speculated outputs: prompt-lookup drafts and forced grammar tokens)
    assert drafted.get("prompt_lookup", 0) > 20 and drafted.get("grammar", 0) > 20, drafted
    regex_out = "".join(e.text for e in plain[2])
    assert 4 <= len(regex_out) <= 10 and regex_out.endswith("x") and set(regex_out[:-1]) <= set("abc")


def test_output_ends_with_the_grammar_even_with_ignore_eos(tiny_engine, tiny):
    _, text, last = run(tiny_engine, tiny.tokenizer.encode("hi"), max_tokens=200, ignore_eos=True,
                        grammar=LLMatcher.grammar_from_regex("(ab){2}c"))
    assert text == "ababc" and last.finish_reason is FinishReason.STOP and last.completion_tokens == 5
    # a grammar that could end earlier runs to where it must end
    ids, text, last = run(tiny_engine, tiny.tokenizer.encode("hi"), max_tokens=200, ignore_eos=True,
                          grammar=regex_grammar("[a-c]{1,30}"), speculative=SpeculativeParams("prompt_lookup", None, 1))
    assert len(text) == 30 and set(text) <= set("abc") and 2 not in ids and last.finish_reason is FinishReason.STOP


# ---- over HTTP -------------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "Answer in JSON."}]
PROMPT_FOR_BATCH = "abcabcabc abc abc"


def test_response_format_json_schema_whole_and_streamed(tiny_server):
    for path, body, field in (
            ("/v1/chat/completions", {"messages": MSGS}, "message"),
            ("/v1/completions", {"prompt": "Answer in JSON:"}, "text")):
        body = {**body, "temperature": 0, "max_tokens": 80,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
        r = post(tiny_server, path, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if field == "message" else choice["text"]
        assert choice["finish_reason"] == "stop"
        _conforms(text)
        events = sse_events(post(tiny_server, path, {**body, "stream": True}))
        streamed = "".join((e["choices"][0]["delta"].get("content") or "") if field == "message"
                           else e["choices"][0]["text"] for e in events if e["choices"])
        assert streamed == text


def test_json_object_regex_and_choice(tiny_server, tiny):
    close = tiny.tokenizer.encode("}", add_special_tokens=False)[0]
    r = post(tiny_server, "/v1/chat/completions", {
        "messages": MSGS, "max_tokens": 300, "temperature": 0, "response_format": {"type": "json_object"},
        "logit_bias": {str(close): 40}}).json()  # (the grammar still decides where "}" may go)
    assert r["choices"][0]["finish_reason"] == "stop"
    assert json.loads(r["choices"][0]["message"]["content"]) == {}
    # stop strings, logprobs and n > 1 under a grammar: each choice has its own matcher
    r = post(tiny_server, "/v1/chat/completions", {
        "messages": MSGS, "temperature": 1.0, "seed": 3, "n": 3, "logprobs": True, "stop": [","],
        "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}).json()
    for choice in r["choices"]:
        assert choice["message"]["content"].startswith('{"answer":"') and "," not in choice["message"]["content"]
        assert choice["finish_reason"] == "stop" and choice["logprobs"]["content"]
    r = post(tiny_server, "/v1/chat/completions", {"messages": MSGS, "temperature": 0.8, "seed": 1, "n": 4,
                                                   "structured_outputs": {"choice": ["red", "green", "blue"]}}).json()
    assert {c["message"]["content"] for c in r["choices"]} <= {"red", "green", "blue"}
    r = post(tiny_server, "/v1/completions", {"prompt": "x", "temperature": 0, "max_tokens": 20,
                                              "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}).json()
    text = r["choices"][0]["text"]
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),  # (a keyword llguidance does not enforce: refused, not ignored)
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a\\"}}, "structured_outputs.regex"),  # (a lone trailing backslash)
    ({"structured_outputs": {"regex": "\\d+\\\\\\"}}, "structured_outputs.regex"),  # (\d+\\\: three)
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    # formats llguidance compiles but cannot enforce: refused at their first step, every time
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs.regex"),  # matches nothing
    ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json"),
    # a first step of ~0.7 s: it would stall every other request at each token
    ({"structured_outputs": {"regex": "(a{300}){300}(b{300}){300}(c{300}){300}(d{300}){300}"}},
     "structured_outputs.regex"),
    # an integer past 64 bits (the grammar builder cannot serialise it)
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 10**30}}}},
     "response_format.json_schema.schema"),
    # integer sets llguidance saturates to {i64::MIN} (its compiler segfaulted: the whole server
    # went down) or to i64::MAX (allowed against the schema): refused before llguidance sees them
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "integer", "minimum": -2e19, "maximum": -1e19}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"const": -9223372036854775807}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer", "enum": [-2e19]}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 1e19, "maximum": 2e19}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"allOf": [{"type": "integer"}, {"exclusiveMaximum": -9.3e18}]}}},
     "structured_outputs.json"),
    # integers beyond 2**53 round to a neighbour as floats (9007199254740993 matched ...992)
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"const": {"b": [2**53 + 1]}}}}}},
     "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer", "enum": [2**53 + 1, -5]}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "integer", "exclusiveMinimum": 2**53}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"$defs": {"n": {"type": "integer", "minimum": 2**53 + 1}},
                                      "$ref": "#/$defs/n"}}}, "structured_outputs.json"),
    # an integer no float holds (it overflowed the check into a 500)
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 10**400}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": [-10**400]}}}},
     "response_format.json_schema.schema"),
])
def test_bad_output_formats(tiny_server, extra, param):
    for _ in range(2):  # (a refused grammar is not kept)
        r = post(tiny_server, "/v1/chat/completions", {"messages": MSGS, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and len(r.json()["error"]["message"]) < 700
        assert "NoExtensionBias" not in r.json()["error"]["message"]
        if "does not compile" in r.json()["error"]["message"]:  # (as every other format the grammar refuses)
            assert r.json()["error"]["code"] == "invalid_output_format", r.text
    assert post(tiny_server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("schema, accepted, refused", [
    ({"type": "integer", "minimum": 3, "maximum": 2e19}, ["3", "9223372036854775807"], ["2"]),  # (open side saturates)
    ({"type": "integer", "enum": [2**53, -5]}, ["9007199254740992", "-5"], ["9007199254740993", "9007199254740991"]),
    ({"type": "integer", "exclusiveMinimum": 2**53 - 1}, ["9007199254740992"], ["9007199254740991"]),
    ({"type": "object", "properties": {"const": {"type": "integer", "maximum": 1e20}, "enum": {"type": "integer"}},
      "required": ["const"], "examples": [{"const": 1e19}]}, ['{"const":7}'], ['{"enum":7}']),
    ({"const": {"b": [1e19]}}, ['{"b":[10000000000000000000]}'], ['{"b":[2]}']),  # (a float: written in full)
])
def test_large_numbers_llguidance_can_enforce_are_enforced(tiny, schema, accepted, refused):
    """What ``check_schema_numbers`` lets through is enforced exactly: bounds that saturate on
    their open side, integers up to 2**53, floats nested in a constant, and properties named
    like keywords or ``examples`` (data, not schema). (Ranges llguidance's regex builder cannot
    express, such as int64's whole range or a minimum of -1e300, it refuses itself: a 400 too.)"""
    from llguidance import LLMatcher

    from engine.constraint import json_grammar

    grammar = json_grammar(schema)
    _constraint(tiny, grammar)  # (compiles)
    ll = _LL[id(tiny)]
    for text, ok in [(t, True) for t in accepted] + [(t, False) for t in refused]:
        matcher = LLMatcher(ll, grammar, log_level=0)
        ids = [3 + b for b in text.encode()]  # (the tiny tokenizer: one token per byte, ids 3..)
        got = matcher.consume_tokens(ids) and matcher.is_accepting()
        assert got == ok, (schema, text, ok)


def test_a_grammar_failing_mid_output_fails_only_its_request(tiny_server, caplog):
    """A regex past llguidance's lexer limits after a dozen tokens: each request gets its own
    matcher (copies of one share a lexer cache that wears out), fails with a 400-type error
    naming the field, and a request batched alongside it is unaffected."""
    import concurrent.futures

    bad = {"prompt": "hi", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
           "structured_outputs": {"regex": "((((b{1,50}){1,50}){1,50}){1,50})"}}
    plain = {"prompt": PROMPT_FOR_BATCH, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = post(tiny_server, "/v1/completions", plain).json()["choices"][0]["text"]
    errors = metric(tiny_server, "request_success_total", 'finished_reason="error"')
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, tiny_server, "/v1/completions", body) for body in (bad, plain, bad, plain)]
        results = [f.result() for f in futures]
    for r in results[0::2]:
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
    for r in results[1::2]:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone
    events = sse_events(post(tiny_server, "/v1/completions", {**bad, "stream": True}))
    assert events[-1]["error"]["param"] == "structured_outputs.regex"
    # (each failed request counted once under finished_reason="error", as docs/metrics.md says)
    assert metric(tiny_server, "request_success_total", 'finished_reason="error"') == errors + 3
    # the request's fault: a warning without a traceback, not the server's error
    failed = [r for r in caplog.records if r.name == "specserve.engine" and "failed" in r.getMessage()]
    assert len(failed) == 3 and all(r.levelname == "WARNING" and r.exc_info is None for r in failed), failed


def test_a_failed_later_row_is_deferred(tiny):
    """A step that fails at a draft row (r > 0) is recorded, not raised: plain decoding only
    meets it if the pass accepts the drafts before that row (the engine then emits the drafts
    before the failed step and fails the next one)."""
    tok = tiny.tokenizer
    c = _constraint(tiny)
    draft = tok.encode('{"answer":"yes"', add_special_tokens=False)
    reference = np.array(c.masks(draft))

    class FailsAfterTwo(_SlipperyMatcher):
        consumed = 0

        def consume_token(self, t):
            self.consumed += 1
            return self.inner.consume_token(t)

        def is_error(self):
            return self.consumed >= 2 or self.inner.is_error()

        def rollback(self, n):
            self.consumed = 0
            return self.inner.rollback(n)

    c.matcher = FailsAfterTwo(c.matcher)
    masks = np.array(c.masks(draft))
    assert c.failed_row == 2 and "failed" in c.failure
    assert (masks[:2] == reference[:2]).all() and (masks[2:] == masks[1]).all()
    assert c.valid_prefix(draft) == len(draft)  # the committed state was restored


def test_strict_schemas_close_their_objects(tiny_server, tiny):
    from engine.constraint import closed_schema

    schema = {"type": "object", "properties": {"v": {"type": "integer"}, "w": {
        "type": "array", "items": {"type": "object", "properties": {"x": {"type": "boolean"}}}}},
        "$defs": {"d": {"type": "object"}}, "anyOf": [{"properties": {"v": {"minimum": 0}}}]}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["w"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False and closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["v"] and "additionalProperties" not in schema
    assert closed_schema({"type": "object", "additionalProperties": True}) == {"type": "object", "additionalProperties": True}
    quote, x = (tiny.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in '"x')
    bias = {str(quote): 30, str(x): 20}  # (pushes the model toward keys of its own, such as "x")
    fmt = {"type": "json_schema", "json_schema": {"name": "v", "schema": {
        "type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
    keys = {}
    for strict in (False, True):
        fmt["json_schema"]["strict"] = strict
        for seed in range(3):
            r = post(tiny_server, "/v1/chat/completions", {
                "messages": MSGS, "temperature": 1.0, "seed": seed, "max_tokens": 60, "logit_bias": bias,
                "response_format": fmt}).json()
            choice = r["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            keys.setdefault(strict, set()).update(json.loads(choice["message"]["content"]))
    assert keys[True] == {"v"}  # strict: the only key the schema names
    assert keys[False] - {"v"}  # (without strict the same requests write other keys)


def test_regex_classes_are_ascii(tiny_server):
    r = post(tiny_server, "/v1/completions", {"prompt": "year:", "temperature": 1.0, "seed": 4, "n": 4,
                                              "structured_outputs": {"regex": "\\d{4}-\\w\\s"}}).json()
    for choice in r["choices"]:
        text = choice["text"]
        assert len(text) == 7 and text[:4].isascii() and text[:4].isdigit() and text[4] == "-", text
        assert (text[5].isascii() and (text[5].isalnum() or text[5] == "_")) and text[6] in " \t\n\r\f\v", text


def test_format_and_tools_together_are_refused(tiny_server):
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": MSGS, "tools": tools, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
