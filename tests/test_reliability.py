"""Reliability and security over HTTP (tiny model): queue bound, cancels, auth, limits, timeouts, logs."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import threading
import time
import types

import httpx
import openai
import pytest
from conftest import tiny_live_server
from helpers import assert_no_leaks
from test_server import metric, sse_events

KEY = "sk-test-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "a", "max_tokens": 1900, "ignore_eos": True, "temperature": 0,
        "speculative": {"method": "off"}}


def assert_envelope(r: httpx.Response, status: int, type_: str, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == type_
    if code is not None:
        assert err["code"] == code
    return err


@pytest.fixture(scope="module")
def queue_server(tiny):
    live = tiny_live_server(tiny, max_active=1, max_queue=2)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def guarded_server(tiny):
    live = tiny_live_server(tiny, api_key=KEY, max_body_bytes=64 * 1024, max_prompt_tokens=200,
                            max_tokens_limit=24, default_max_tokens=100, log_requests=True)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def timeout_server(tiny):
    live = tiny_live_server(tiny, request_timeout=1.5)  # (room for a first token on a loaded CI machine)
    yield live
    live.stop()


# ---- 1. bounded queue -----------------------------------------------------------------------


def _wait_metric(server, name, value, timeout=20.0):
    deadline = time.time() + timeout
    while metric(server, name) != value:
        assert time.time() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_full_queue_gets_429_with_retry_after_and_metrics(queue_server):
    url = queue_server.url + "/v1/completions"
    rejected = metric(queue_server, "requests_rejected_total", 'reason="EngineOverloaded"')
    client = httpx.Client(timeout=60)
    held = []
    try:
        held.append(client.send(client.build_request("POST", url, json={**LONG, "stream": True}), stream=True))
        _wait_metric(queue_server, "num_requests_running", 1)
        for _ in range(2):  # max_active=1 is busy: these two wait, filling max_queue=2
            held.append(client.send(client.build_request("POST", url, json={**LONG, "stream": True}),
                                    stream=True))
        assert [r.status_code for r in held] == [200, 200, 200]
        _wait_metric(queue_server, "num_requests_waiting", 2)
        for body in ({"prompt": "x", "max_tokens": 2}, {"prompt": "x", "max_tokens": 2, "stream": True}):
            r = httpx.post(url, json=body, timeout=30)
            err = assert_envelope(r, 429, "rate_limit_error", "queue_full")
            assert "queue" in err["message"] and int(r.headers["Retry-After"]) >= 1
        assert metric(queue_server, "requests_rejected_total", 'reason="EngineOverloaded"') == rejected + 2
        assert metric(queue_server, "errors_total", 'type="rate_limit_error"') >= 2
    finally:
        for r in held:
            r.close()
        client.close()
    assert_no_leaks(queue_server.engine)
    assert metric(queue_server, "num_requests_waiting") == 0
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


def test_a_request_that_does_not_fit_the_queue_queues_none_of_its_choices(queue_server):
    """One slot busy and one request waiting: n=2 does not fit the queue (2) now, so it gets a
    429 before any choice is queued (none runs for nobody or counts as cancelled); n=3 can never
    fit, so it gets a 400 a client will not retry."""
    url = queue_server.url + "/v1/completions"
    cancelled = metric(queue_server, "request_success_total", 'finished_reason="cancelled"')
    rejected = metric(queue_server, "requests_rejected_total", 'reason="EngineOverloaded"')
    with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as held, \
            httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as waiting:
        _wait_metric(queue_server, "num_requests_running", 1)
        _wait_metric(queue_server, "num_requests_waiting", 1)
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 5, "n": 2}, timeout=30)
        assert_envelope(r, 429, "rate_limit_error", "queue_full")
        r = httpx.post(url, json={"prompt": ["x", "y", "z"], "max_tokens": 5}, timeout=30)
        err = assert_envelope(r, 400, "invalid_request_error", "too_many_generations")
        assert err["param"] == "prompt" and "3 generations" in err["message"] and "at most 2" in err["message"]
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 5, "n": 3,
                                  "response_format": {"type": "json_object"}}, timeout=30)
        assert assert_envelope(r, 400, "invalid_request_error", "too_many_generations")["param"] == "n"
        assert len(queue_server.engine._live) == 2  # only the held streams
        assert metric(queue_server, "num_requests_waiting") == 1
        assert held.status_code == waiting.status_code == 200
    assert_no_leaks(queue_server.engine)
    assert metric(queue_server, "requests_rejected_total", 'reason="EngineOverloaded"') == rejected + 1
    # (the two held streams were cancelled by their clients; the refused choices were not counted)
    _wait_metric(queue_server, "num_requests_running", 0)
    assert metric(queue_server, "request_success_total", 'finished_reason="cancelled"') == cancelled + 2


# ---- 2. cancellation --------------------------------------------------------------------------


def test_disconnects_interleaved_with_requests_do_not_change_outputs(tiny_server, caplog):
    caplog.set_level(logging.WARNING)
    url = tiny_server.url + "/v1/completions"
    errors_500 = metric(tiny_server, "requests_total", 'endpoint="/v1/completions",status="500"')
    rng = random.Random(1)
    prompts = ["abcabcabc abc", "the cat sat on the mat, the cat", "xyz" * 9, "def f(x):\n    return x\n",
               "".join(chr(rng.randrange(97, 123)) for _ in range(30)), "0 1 2 3 0 1 2 3 0 1"]
    base = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "speculative": {"method": "auto"}}
    solo = [httpx.post(url, json={**base, "prompt": p}, timeout=60).json()["choices"][0]["text"]
            for p in prompts]
    assert_no_leaks(tiny_server.engine)
    out: dict[int, str] = {}
    failures: list[BaseException] = []

    def keep(i):
        try:
            if i % 2:
                r = httpx.post(url, json={**base, "prompt": prompts[i], "stream": True}, timeout=60)
                out[i] = "".join(e["choices"][0]["text"] for e in sse_events(r))
            else:
                out[i] = httpx.post(url, json={**base, "prompt": prompts[i]}, timeout=60).json()["choices"][0]["text"]
        except BaseException as exc:  # surfaced below
            failures.append(exc)

    def victim(i):
        body = {**base, "prompt": prompts[i], "max_tokens": 1900}
        if i % 2:  # stream: hang up after the first chunk
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                next(r.iter_lines())
        else:  # non-stream: the client gives up mid-generation
            try:
                httpx.post(url, json=body, timeout=0.3 + rng.random() * 0.3)
            except httpx.TimeoutException:
                pass

    threads = [threading.Thread(target=f, args=(i,)) for i in range(len(prompts)) for f in (keep, victim)]
    rng.shuffle(threads)
    for t in threads:
        t.start()
        time.sleep(rng.random() * 0.05)
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert [out[i] for i in range(len(prompts))] == solo
    assert_no_leaks(tiny_server.engine)
    # a hang-up is not a server error: nothing logged at ERROR, no 500 counted
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], _log_text(caplog)[:3000]
    assert metric(tiny_server, "requests_total", 'endpoint="/v1/completions",status="500"') == errors_500


# ---- 3. auth ---------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
    {"Authorization": "Bearer"}, {"Authorization": KEY}, {"X-API-Key": KEY},
])
def test_missing_or_wrong_api_key_gets_401(guarded_server, headers):
    before = metric(guarded_server, "requests_rejected_total", 'reason="Unauthorized"')
    paths = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
             ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/v1/models/tiny-llama"), ("GET", "/openapi.json"))
    for method, path in paths:
        r = httpx.request(method, guarded_server.url + path, headers=headers, timeout=30,
                          json={"prompt": "x", "max_tokens": 1} if method == "POST" else None)
        assert_envelope(r, 401, "authentication_error", "invalid_api_key")
        assert r.headers["WWW-Authenticate"] == "Bearer" and len(r.headers["X-Request-Id"]) == 32
    assert metric(guarded_server, "requests_rejected_total", 'reason="Unauthorized"') == before + len(paths)


def test_right_key_passes_and_probes_stay_open(guarded_server):
    url = guarded_server.url
    assert httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-llama"
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"bearer  {KEY}"}).status_code == 200
    for path in ("/health", "/ready", "/metrics"):  # probes and scrapes need no key by default
        assert httpx.get(url + path).status_code == 200
        assert httpx.get(url + path + "/").status_code == 200  # (a trailing slash: the same path)
    for path in ("/v1/models/", "/v1/models/tiny-llama/"):  # ... and no way around the key
        assert_envelope(httpx.get(url + path), 401, "authentication_error", "invalid_api_key")
        assert httpx.get(url + path, headers=AUTH).status_code == 200
    assert_envelope(httpx.post(url + "/v1/completions/", json={"prompt": "x", "max_tokens": 1}),
                    401, "authentication_error", "invalid_api_key")
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny-llama", prompt="ab", max_tokens=3).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


def _guard_app(**settings):
    """The guard in front of a trivial app: auth and draining without a model."""
    from server.guard import Guard
    from server.metrics import Metrics
    from server.settings import Settings

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    state = types.SimpleNamespace(settings=Settings(**settings), metrics=Metrics(), draining=False)
    return Guard(ok, state), state


def _call(app, method, path, **kw) -> httpx.Response:
    """One request to ``app`` in process (no lifespan: the engine is not started)."""
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, **kw)

    return asyncio.run(go())


def _get(app, path, headers=None) -> httpx.Response:
    return _call(app, "GET", path, headers=headers)


def _post(app, path, body) -> httpx.Response:
    return _call(app, "POST", path, json=body)


def test_protect_metrics_and_draining_gates():
    app, state = _guard_app(api_key=KEY, protect_metrics=True)
    assert _get(app, "/metrics").status_code == 401
    assert _get(app, "/metrics", AUTH).status_code == 200
    assert _get(app, "/health").status_code == 200
    open_app, _ = _guard_app(api_key=KEY)
    assert _get(open_app, "/metrics").status_code == 200
    state.draining = True
    r = _get(app, "/v1/models", AUTH)
    assert_envelope(r, 503, "unavailable_error", "shutting_down")
    assert r.headers["Connection"] == "close" and r.headers["Retry-After"] == "1"
    assert _get(app, "/ready").status_code == 503
    assert _get(app, "/health").status_code == 200


def test_empty_api_key_is_refused_at_startup():
    import pydantic

    from server.settings import Settings

    with pytest.raises(pydantic.ValidationError, match="empty"):
        Settings(api_key="  ")
    assert "sk-test" not in repr(Settings(api_key=KEY))  # never printed


# ---- 3. limits --------------------------------------------------------------------------------


def test_declared_body_over_limit_gets_413(guarded_server):
    before = metric(guarded_server, "requests_rejected_total", 'reason="BodyTooLarge"')
    body = json.dumps({"prompt": "a" * (70 * 1024), "max_tokens": 1}).encode()
    r = httpx.post(guarded_server.url + "/v1/completions", content=body, timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert_envelope(r, 413, "invalid_request_error", "body_too_large")
    assert metric(guarded_server, "requests_rejected_total", 'reason="BodyTooLarge"') == before + 1


def test_chunked_body_is_cut_off_while_it_is_read(guarded_server):
    """No Content-Length: the server answers 413 once 64 KiB have arrived, without waiting for
    the (never sent) end of the body."""
    host, port = guarded_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"a" * 8192
        for _ in range(10):  # 80 KiB, then silence: the terminating chunk never comes
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            data += part
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(payload[payload.index(b"{"):payload.rindex(b"}") + 1])["error"]["code"] == "body_too_large"


def test_prompt_token_limit(guarded_server):
    url = guarded_server.url
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "a" * 201, "max_tokens": 1})
    err = assert_envelope(r, 400, "invalid_request_error", "prompt_too_long")
    assert err["param"] == "prompt" and "201" in err["message"]
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": [5] * 250, "max_tokens": 1})
    assert_envelope(r, 400, "invalid_request_error", "prompt_too_long")
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "b" * 300}]})
    assert assert_envelope(r, 400, "invalid_request_error", "prompt_too_long")["param"] == "messages"
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "a" * 200, "max_tokens": 1})
    assert r.status_code == 200  # at the limit


def test_max_tokens_limit_rejects_and_caps_defaults(guarded_server):
    url = guarded_server.url
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "ab", "max_tokens": 25})
    assert assert_envelope(r, 400, "invalid_request_error", "max_tokens_too_large")["param"] == "max_tokens"
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 9})
    assert assert_envelope(r, 400, "invalid_request_error")["param"] == "max_completion_tokens"
    # omitted: the server default (100 here) and the chat default (rest of the context) are capped
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "ab", "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 24 and r["choices"][0]["finish_reason"] == "length"
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 24


# ---- 3. timeouts ------------------------------------------------------------------------------


def test_timeout_stops_generation_with_a_clear_error(timeout_server):
    url = timeout_server.url + "/v1/completions"
    before = metric(timeout_server, "request_success_total", 'finished_reason="timeout"')
    started = time.time()
    r = httpx.post(url, json=LONG, timeout=30)
    assert time.time() - started < 15
    err = assert_envelope(r, 408, "timeout_error", "request_timeout")
    assert "1.5 s" in err["message"]
    r = httpx.post(url, json={**LONG, "stream": True}, timeout=30)
    events = sse_events(r)
    assert "error" in events[-1] and events[-1]["error"]["type"] == "timeout_error"
    assert sum(len(e["choices"][0]["text"]) for e in events[:-1]) > 0  # tokens made in time arrive
    r = httpx.post(timeout_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "ignore_eos": True, "stream": True})
    assert sse_events(r)[-1]["error"]["code"] == "request_timeout"
    assert metric(timeout_server, "request_success_total", 'finished_reason="timeout"') == before + 3
    # n choices: one error event, the stream's last (no second one, no usage chunk after it)
    for path, body in (("/v1/completions", LONG), ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "a"}], "ignore_eos": True, "max_tokens": 1900})):
        r = httpx.post(timeout_server.url + path, timeout=30, json={
            **body, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(r)
        assert [e["error"]["code"] for e in events if "error" in e] == ["request_timeout"], events[-3:]
        assert "error" in events[-1] and all(e.get("usage") is None for e in events), events[-3:]
    assert_no_leaks(timeout_server.engine)
    assert httpx.post(url, json={"prompt": "ab", "max_tokens": 4}).status_code == 200


# ---- 3. logs ----------------------------------------------------------------------------------


def _log_text(caplog) -> str:
    return "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)


def test_logs_carry_no_prompt_or_output_text_by_default(tiny_server, caplog):
    caplog.set_level(logging.DEBUG)
    marker = "SECRET-7f3a9c"
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=60,
                   json={"prompt": marker, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).json()
    output = r["choices"][0]["text"]
    httpx.post(tiny_server.url + "/v1/completions", json={"prompt": marker, "temperature": 9})
    httpx.post(tiny_server.url + "/v1/completions", json={"prompt": marker, "stream": True, "max_tokens": 3})
    time.sleep(0.1)
    text = _log_text(caplog)
    assert r["id"] in text  # the request line is there (DEBUG) ...
    assert marker not in text and (len(output) < 4 or output not in text)  # ... but no text


def test_log_requests_setting_logs_text(guarded_server, caplog):
    caplog.set_level(logging.INFO)
    marker = "VISIBLE-51be"
    r = httpx.post(guarded_server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": marker, "max_tokens": 4, "temperature": 0}).json()
    time.sleep(0.1)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specserve.requests"]
    assert any(r["id"] in line and marker in line for line in lines), lines


def test_probe_answers_are_not_counted_as_errors():
    """While the model loads, /ready answers 503 to every probe: counted by endpoint and status,
    not in errors_total (an operator alerting on error rates would otherwise page during every
    start-up). A 503 on an API route still counts."""
    from server.app import create_app
    from server.metrics import Metrics

    class Loading:  # what the routes and the scrape read from an engine that is still loading
        ready = False
        loaded = None
        cost = None

        def health(self):
            return {"state": "loading"}

        def queue_depth(self):
            return 0

        def running(self):
            return 0

        def prefix_cache_info(self):
            return None

    app = create_app(Loading(), metrics=Metrics())
    for _ in range(3):
        assert_envelope(_get(app, "/ready"), 503, "unavailable_error")
    assert _get(app, "/v1/models").status_code == 200  # (no model yet: an empty list)
    scrape = _get(app, "/metrics").text
    assert 'specserve:requests_total{endpoint="/ready",status="503"} 3.0' in scrape
    assert 'specserve:engine_ready 0.0' in scrape
    assert "specserve:errors_total{" not in scrape  # (no error response yet)
    # the API answers 503 while loading (the prompt needs the model's tokenizer), not a 500
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        err = assert_envelope(_post(app, path, body), 503, "unavailable_error")
        assert "still loading" in err["message"]
    scrape = _get(app, "/metrics").text
    assert 'specserve:errors_total{type="unavailable_error"} 2.0' in scrape
    assert 'specserve:requests_rejected_total{reason="EngineUnavailable"} 2.0' in scrape


def _raw_exchange(server, data: bytes) -> bytes:
    """``data`` sent as is over a fresh connection; everything the server answers until it closes."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("raw", [
    b"NOT AN HTTP REQUEST\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\na header without a colon\r\n\r\n",
    b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: many\r\n\r\n{"prompt": "a"}',
], ids=["request_line", "header_line", "content_length"])
def test_malformed_http_gets_an_openai_style_400_and_the_server_keeps_serving(tiny_server, raw):
    """Bytes uvicorn refuses before the app runs get the API's JSON error envelope (not its
    plain-text 400), count as a rejection, and close only their own connection."""
    rejected = metric(tiny_server, "requests_rejected_total", 'reason="InvalidHTTP"')
    head, _, body = _raw_exchange(tiny_server, raw).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 400"), lines
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body) and headers["server"] == "uvicorn" and headers["date"]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_http_request")
    assert metric(tiny_server, "requests_rejected_total", 'reason="InvalidHTTP"') == rejected + 1
    r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_body_that_breaks_after_the_apps_answer_closes_quietly(guarded_server, caplog):
    """A chunked body that turns malformed after the app has answered (a 401: no key, sent before
    the body is read) cannot get a second response: the connection just closes, with no error
    logged (uvicorn's own 400 raises h11's LocalProtocolError there, a fatal-error traceback)
    and no InvalidHTTP counted; the server keeps serving."""
    rejected = metric(guarded_server, "requests_rejected_total", 'reason="InvalidHTTP"')
    host, port = guarded_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\n')
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            assert part, data
            data += part
        assert data.startswith(b"HTTP/1.1 401"), data
        sock.sendall(b"not a chunk size\r\n")
        rest = b""
        while part := sock.recv(65536):
            rest += part
    assert rest == b""  # closed, nothing after the 401
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert metric(guarded_server, "requests_rejected_total", 'reason="InvalidHTTP"') == rejected
    assert httpx.get(guarded_server.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
