"""Shared by the deploy tests: paths, the dashboard's PromQL, and finding the external tools."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "specserve.json"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
K8S = DEPLOY / "k8s"
ADAPTER_VALUES = K8S / "prometheus-adapter-values.yaml"

# What Grafana substitutes at query time; the windows cover the whole test run.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL as Grafana writes it) for every query target of every panel."""
    out = []
    stack = list(dashboard()["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))  # panels inside collapsed rows
        out += [(panel["title"], t["expr"]) for t in panel.get("targets", [])]
    return out


def to_promql(expr: str) -> str:
    """Replace Grafana's variables with concrete values; any other `$` is an unknown variable."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    unknown = re.findall(r"\$\{?\w+", expr)
    assert not unknown, f"unknown Grafana variables {unknown} in {expr}"
    return expr


def find_tool(name: str) -> str | None:
    """A tool on PATH or in the running venv's bin/ (where `make test-tools` puts some)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


INSTALL_HINT = "`sh deploy/install-test-tools.sh .venv` (run by `make test`) installs it"
