"""A real Prometheus scrapes a live specserve; every dashboard query must evaluate.

Prometheus (Debian's `prometheus` package, installed by deploy/install-test-tools.sh) runs
deploy/prometheus/prometheus.yml with the target pointed at a tiny-model server on 127.0.0.1
and a 1 s scrape interval. Two identical rounds of speculative, plain, streaming and failing
requests, each followed by a scrape, give every counter an increase inside the rate window.
"""

from __future__ import annotations

import math
import re
import socket
import subprocess
import time

import httpx
import pytest
import yaml
from deploy_support import (
    ADAPTER_VALUES,
    INSTALL_HINT,
    SCRAPE_CONFIG,
    dashboard,
    dashboard_targets,
    find_tool,
    to_promql,
)

from engine import Engine, EngineConfig

REPETITIVE = "abcabcabcabcabcabcabcabcabcabc abcabcabc"
LONG = "The quick brown fox jumps over the lazy dog. " * 14  # (630 tokens of the byte tokenizer)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live(tiny):
    from conftest import LiveServer

    from server.app import create_app
    from server.metrics import Metrics
    from server.settings import Settings

    metrics = Metrics()
    eng = Engine(EngineConfig(speculation="auto", calibration_contexts=(40, 300)), loaded=tiny, sink=metrics)
    server = LiveServer(create_app(eng, Settings(), metrics), eng, metrics)
    yield server
    server.stop()


class Prometheus:
    """A Prometheus server process and its HTTP API."""

    def __init__(self, url: str, proc: subprocess.Popen, log):
        self.url, self.proc, self.log = url, proc, log

    def query(self, promql: str) -> dict:
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]

    def scalar_values(self, promql: str) -> dict[str, float]:
        """{label set as text: value} of an instant-vector query."""
        data = self.query(promql)
        assert data["resultType"] == "vector", (promql, data)
        return {str(sorted(s["metric"].items())): float(s["value"][1]) for s in data["result"]}


def _scrape_config(target: str) -> dict:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    jobs = [j for j in config["scrape_configs"] if j["job_name"] == "specserve"]
    assert len(jobs) == 1, "deploy/prometheus/prometheus.yml must have one job named specserve"
    jobs[0]["static_configs"] = [{"targets": [target]}]
    return config


@pytest.fixture(scope="module")
def prometheus(live, tmp_path_factory):
    binary, promtool = find_tool("prometheus"), find_tool("promtool")
    if binary is None or promtool is None:
        pytest.skip(f"prometheus/promtool not installed: {INSTALL_HINT} (apt-get as root or sudo)")
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(yaml.safe_dump(_scrape_config(live.url.removeprefix("http://"))))
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = _free_port()
    log = open(work / "prometheus.log", "w+")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, _log_tail(log)
            try:
                if httpx.get(prom.url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "Prometheus not ready after 60 s\n" + _log_tail(log)
            time.sleep(0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _log_tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


def _drive(url: str) -> None:
    """One round of traffic touching every dashboard panel."""
    # min_draft_tokens: draft on every match, whatever the start-up cost measurement says.
    spec = {"speculative": {"method": "prompt_lookup", "min_draft_tokens": 4}, "temperature": 0,
            "ignore_eos": True}
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json={"prompt": REPETITIVE, "max_tokens": 40, **spec}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["speculative_decoding"]["by_drafter"]["prompt_lookup"]["num_draft_tokens"] > 0
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": REPETITIVE}], "max_tokens": 24, "stream": True, **spec})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": "plain decoding", "max_tokens": 8, "temperature": 0, "speculative": {"method": "off"}})
    assert r.status_code == 200, r.text
    for _ in range(2):  # (the second reads whole prefill chunks of the first from the prefix cache)
        r = httpx.post(url + "/v1/completions", json={"prompt": LONG, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 2100, "max_tokens": 8}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(url + "/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=120)
    assert r.status_code == 404, r.text


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _wait_scraped(prom: Prometheus, url: str, timeout: float = 30) -> None:
    """Until Prometheus holds a sample taken after all traffic so far."""
    want = _counter(url, "specserve:generation_tokens_total")
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = prom.scalar_values("sum(specserve:generation_tokens_total)")
        if list(got.values()) == [want]:
            return
        time.sleep(0.25)
    raise AssertionError(f"Prometheus did not scrape generation_tokens_total={want}\n" + _log_tail(prom.log))


@pytest.fixture(scope="module")
def scraped(live, prometheus):
    """Prometheus after two rounds of traffic, each one scraped."""
    for _ in range(2):
        _drive(live.url)
        _wait_scraped(prometheus, live.url)
    return prometheus


def test_every_dashboard_query_evaluates_with_data(scraped):
    targets = dashboard_targets()
    assert len(targets) >= 20
    for title, expr in targets:
        values = scraped.scalar_values(to_promql(expr))
        assert values, f"panel {title!r}: no data for {to_promql(expr)}"
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        assert not bad, f"panel {title!r}: non-finite values {bad} for {to_promql(expr)}"


def _panel_values(prom: Prometheus, title: str) -> dict[str, float]:
    exprs = [e for t, e in dashboard_targets() if t == title]
    assert len(exprs) == 1, f"expected one query in panel {title!r}, found {len(exprs)}"
    return prom.scalar_values(to_promql(exprs[0]))


def test_acceptance_rate_in_unit_interval(scraped):
    values = _panel_values(scraped, "Acceptance rate by drafter")
    rates = {k: v for k, v in values.items() if "prompt_lookup" in k}
    assert len(rates) == 1, values
    assert 0 < next(iter(rates.values())) <= 1, rates
    length = _panel_values(scraped, "Mean acceptance length by drafter")
    assert length and all(1 <= v for v in length.values()), length


def test_scheduler_decisions_show_plain_and_drafted_steps(scraped):
    values = _panel_values(scraped, "Scheduler decisions (sequence steps/s)")
    outcomes = {re.search(r"'outcome', '(\w+)'", k).group(1) for k, v in values.items() if v > 0}
    assert {"plain", "prompt_lookup"} <= outcomes, values
    calibration = _panel_values(scraped, "Scheduler calibration (realised / expected accepted tokens)")
    assert [v for k, v in calibration.items() if "prompt_lookup" in k and v > 0], calibration


def test_prefix_cache_panels_show_the_repeated_prompt(scraped):
    (rate,) = _panel_values(scraped, "Prefix cache hit rate").values()
    assert 0 < rate < 1, rate  # (a repeated 630-token prompt hit; the other prompts missed)
    held, budget = (scraped.scalar_values(to_promql(e)) for t, e in dashboard_targets() if t == "Prefix cache memory")
    assert 0 < sum(held.values()) <= sum(budget.values()), (held, budget)


def test_errors_by_type_counts_the_failed_requests(scraped):
    values = _panel_values(scraped, "Errors/s by type")
    types = {re.search(r"'type', '(\w+)'", k).group(1) for k, v in values.items() if v > 0}
    assert {"invalid_request_error", "not_found_error"} <= types, values


def test_prometheus_holds_the_served_counters(scraped, live):
    for name in ("specserve:spec_decode_num_draft_tokens_total", "specserve:spec_decode_num_accepted_tokens_total"):
        served = _counter(live.url, name + '{drafter="prompt_lookup"}')
        stored = scraped.scalar_values(f'{name}{{drafter="prompt_lookup"}}')
        assert list(stored.values()) == [served], (name, stored, served)


def test_instance_variable_lists_the_server(scraped, live):
    (variable,) = dashboard()["templating"]["list"]
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable["query"]["query"]).groups()
    r = httpx.get(scraped.url + f"/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10)
    assert live.url.removeprefix("http://") in r.json()["data"]


def test_prometheus_adapter_queries_evaluate(scraped):
    """The HPA's custom-metric rule, with the label matchers k8s would add replaced by job."""
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    series = re.sub(r',?(namespace|pod)!=""', "", rule["seriesQuery"])
    names = {s["__name__"] for s in httpx.get(scraped.url + "/api/v1/series", params={"match[]": series},
                                                 timeout=10).json()["data"]}
    assert names == {"specserve:num_requests_waiting", "specserve:num_requests_running"}
    for name in names:
        query = (rule["metricsQuery"].replace("<<.Series>>", name)
                 .replace("<<.LabelMatchers>>", 'job="specserve"').replace("<<.GroupBy>>", "instance"))
        assert scraped.scalar_values(query), query
