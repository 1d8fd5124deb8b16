"""Fuzzing the HTTP surface (hypothesis, tiny model): malformed requests get a 4xx OpenAI error.

Requests mix well-formed field values with wrong types, huge and negative numbers, NaN and
infinities, lone surrogates, invalid UTF-8, truncated and deeply nested JSON, odd stop lists and
unknown fields. Properties: never a 5xx; every 4xx is the JSON error envelope; every 200 is a
well-formed completion (or SSE stream ending in ``[DONE]``); the server stays up and leaks no
request state. Runs are derandomized in CI (bounded: ~200 examples); set
``SPECSERVE_FUZZ_EXAMPLES=5000 SPECSERVE_FUZZ_RANDOM=1`` for a longer random search.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from conftest import tiny_live_server
from helpers import assert_no_leaks
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_server import sse_events

EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("SPECSERVE_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], database=None)
ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
               "timeout_error", "unavailable_error"}


@pytest.fixture(scope="module")
def fuzz_server(tiny):
    # tight limits keep each valid request cheap (at most 4 tokens per choice)
    live = tiny_live_server(tiny, max_n=2, max_tokens_limit=4, default_max_tokens=4, max_prompt_tokens=64,
                            max_body_bytes=256 * 1024, request_timeout=20)
    yield live
    live.stop()


# ---- strategies -------------------------------------------------------------------------------

surrogate = st.integers(0xD800, 0xDFFF).map(chr)
text = st.one_of(st.text(max_size=12), st.lists(st.one_of(st.characters(), surrogate), max_size=6).map("".join),
                 st.sampled_from(["", " ", "\x00", "<|im_end|>", "a" * 300, "\U0001F600" * 3]))
ints = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70),
                 st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(10**30)]))
nums = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5),
                 st.sampled_from([0.0, 1e-300, 1e308, -0.0, 0.5, 2.0, 2.0000001]))
scalar = st.one_of(st.none(), st.booleans(), ints, nums, text)
junk = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(text, inner, max_size=3)), max_leaves=8)


def field(good):
    return st.one_of(good, good, junk)


token_lists = st.lists(ints, max_size=8)
prompt = st.one_of(text, st.lists(text, max_size=3), token_lists, st.lists(token_lists, max_size=3))
stop = st.one_of(text, st.lists(text, max_size=20), st.lists(st.just("x" * 1001), max_size=2),
                 st.just([""]), st.lists(st.sampled_from(["a", "b", " ", "\n", "ab", "<|im_end|>"]), max_size=5))
part = st.fixed_dictionaries({"type": field(st.just("text")), "text": field(text)})
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"]))},
    optional={"content": field(st.one_of(text, st.none(), st.lists(part, max_size=3))), "name": field(text)})
COMMON = {
    "model": st.sampled_from(["tiny-llama", "TINY-LLAMA", "gpt-4", ""]),
    "temperature": nums, "top_p": nums, "top_k": ints, "min_p": nums, "n": ints,
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": stop, "presence_penalty": nums, "frequency_penalty": nums, "repetition_penalty": nums,
    "logit_bias": st.dictionaries(st.one_of(ints.map(str), text), nums, max_size=4),
    "seed": ints, "user": text, "ignore_eos": st.booleans(), "stop_token_ids": st.lists(ints, max_size=3),
    "speculative": st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["auto", "prompt_lookup", "dspark", "off", "magic"]),
        "max_draft_tokens": ints, "min_draft_tokens": ints}),
    "max_tokens": ints, "unknown_field": junk, "functions": junk,
}
COMPLETION = {**COMMON, "prompt": prompt, "logprobs": ints, "echo": st.booleans(), "suffix": text,
              "best_of": ints}
CHAT = {**COMMON, "messages": st.lists(message, max_size=3), "max_completion_tokens": ints,
        "logprobs": st.booleans(), "top_logprobs": ints, "response_format": junk, "tools": junk,
        "tool_choice": junk}


# in range: requests that mostly succeed, to exercise generation, streaming, stops and logprobs
unit = st.floats(0, 1, allow_nan=False)
PLAUSIBLE = {
    "model": st.just("tiny-llama"), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 300), "min_p": unit, "n": st.integers(1, 2), "max_tokens": st.integers(0, 4),
    "max_completion_tokens": st.integers(1, 4), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.1, 3), "seed": st.integers(0, 2**63),
    "logit_bias": st.dictionaries(st.integers(0, 258).map(str), st.floats(-100, 100), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 258), max_size=3), "logprobs": st.integers(0, 5),
    "top_logprobs": st.integers(0, 20), "best_of": st.just(1), "suffix": st.just(""),
    "prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(3, 258), min_size=1, max_size=8)),
    "speculative": st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(["auto", "prompt_lookup", "off"]), "max_draft_tokens": st.integers(0, 64),
        "min_draft_tokens": st.integers(0, 64)}),
}


def body_for(fields, mode: str):
    if mode != "plausible":
        return st.fixed_dictionaries({}, optional={k: field(v) if mode == "junk" else v for k, v in fields.items()})
    fields = {k: PLAUSIBLE.get(k, v) for k, v in fields.items()
              if k not in ("response_format", "tools", "tool_choice", "functions", "unknown_field",
                           "stream_options", "best_of", "suffix")}
    fields["user"] = fields["model"] = st.just("tiny-llama")
    fields["stop"] = st.lists(st.sampled_from(["a", "b", " ", "\n", "ab", "<|im_end|>", "\U0001F600"]), max_size=4)
    needed = "messages" if "messages" in fields else "prompt"
    if needed == "messages":
        fields["logprobs"] = st.booleans()
        fields["messages"] = st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}),
            min_size=1, max_size=3)
    return st.fixed_dictionaries({needed: fields.pop(needed)}, optional=fields)


@st.composite
def raw_request(draw):
    """(path, body bytes, content type)."""
    path, fields = draw(st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]))
    body = draw(body_for(fields, draw(st.sampled_from(["junk", "wild", "plausible"]))))
    if body.get("stream"):  # keep valid streams cheap
        body["max_tokens"] = 2
    data = json.dumps(body).encode()  # NaN/Infinity and \ud800 escapes pass through as Python reads them
    kind = draw(st.sampled_from(["json"] * 6 + ["utf8", "truncated", "deep", "top", "empty", "ctype"]))
    ctype = "application/json"
    if kind == "utf8":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])) + data[at:]
    elif kind == "truncated":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    elif kind == "deep":
        depth = draw(st.sampled_from([50, 500, 5000, 100_000]))
        key = draw(st.sampled_from(["prompt", "messages", "stop", "logit_bias", "zzz"]))
        data = b'{"%s": ' % key.encode() + b"[" * depth + b"]" * depth + b"}"
    elif kind == "top":
        data = draw(st.sampled_from([b"[]", b'"x"', b"1", b"null", b"true", b"[{}]"]))
    elif kind == "empty":
        data = b""
    elif kind == "ctype":
        ctype = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=latin-1"]))
    return path, data, ctype


# ---- properties -------------------------------------------------------------------------------


def check_response(r: httpx.Response, streamed: bool) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] in ERROR_TYPES and isinstance(err["message"], str) and err["message"]
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        assert streamed
        events = sse_events(r)
        assert all("error" not in e or e["error"]["type"] in ERROR_TYPES for e in events)
    else:
        assert not streamed
        assert r.json()["choices"]


def asks_to_stream(data: bytes) -> bool:
    """Whether a request body asks for a stream (``"stream": true``; the schema takes no other
    spelling of true)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # (not JSON, or the fuzzer's 100,000-deep arrays)
        return False
    return isinstance(body, dict) and body.get("stream") is True


@FUZZ
@given(req=raw_request())
def test_fuzzed_requests_never_get_a_5xx(fuzz_server, req):
    path, data, ctype = req
    headers = {"Content-Type": ctype} if ctype else {}
    r = httpx.post(fuzz_server.url + path, content=data, headers=headers, timeout=60)
    event(f"HTTP {r.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    check_response(r, streamed=asks_to_stream(data))


@pytest.mark.parametrize("data", [
    b'{"prompt": "\\ud800", "max_tokens": 2}', b'{"prompt": ["ok", "\\udfff x"], "max_tokens": 2}',
    b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', b'{"prompt": "a", "user": "\\ud800"}',
    b'{"prompt": [300, 2], "echo": true, "max_tokens": 1}', b'{"prompt": [99999999999], "echo": true}',
    b'{"prompt": [[5], [-1]]}', b'{"prompt": "a", "logit_bias": {"-1": 1}}',
    b'{"prompt": "a", "logit_bias": {"99999999999999999999": 1}}', b'{"prompt": "a", "seed": 1e400}',
    b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "top_p": Infinity}',
    b'{"prompt": "a", "max_tokens": 1e10}', b'{"prompt": "a", "n": 1.5}', b'{"prompt": "a", "stop": [1, 2]}',
    b'{"prompt": "a", "stop_token_ids": [99999999999999]}', b'{"prompt": "\xff\xfe"}',
    b'{"prompt": "a", "speculative": {"method": "auto", "max_draft_tokens": 1e9}}',
    b'{"prompt": "a", "speculative": "auto"}', b'{"prompt": "a", "stream_options": 5, "stream": true}',
    b'{"prompt": "a"' + b', "x": 1' * 20000 + b"}",
])
def test_known_hard_cases(fuzz_server, data):
    r = httpx.post(fuzz_server.url + "/v1/completions", content=data,
                   headers={"Content-Type": "application/json"}, timeout=60)
    check_response(r, streamed=asks_to_stream(data))


@pytest.mark.parametrize("data", [
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}',
    b'{"messages": [{"role": "assistant"}]}', b'{"messages": [{"role": "user", "content": "a", "name": 5}]}',
    b'{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 50, "logprobs": true}',
    b'{"messages": [{"role": "user", "content": "a"}], "stop": "\\ud800"}',
    b'{"messages": "hello"}', b'{"messages": [[]]}', b'{"messages": [null]}',
])
def test_known_hard_chat_cases(fuzz_server, data):
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", content=data,
                   headers={"Content-Type": "application/json"}, timeout=60)
    check_response(r, streamed=asks_to_stream(data))


def test_server_is_healthy_after_fuzzing(fuzz_server):
    assert httpx.get(fuzz_server.url + "/health").json()["status"] == "ok"
    r = httpx.post(fuzz_server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    assert_no_leaks(fuzz_server.engine)
    metrics = httpx.get(fuzz_server.url + "/metrics").text
    assert 'specserve:requests_total{endpoint="/v1/completions",status="500"}' not in metrics
