"""What the chart's dashboards and alerts are checked with: promtool, the chart's
render, the metric names the code exports, and the names a PromQL expression reads.

promtool is Debian's (package `prometheus`; `make check` run as root or under CI=true
installs it when missing).
Under CI=true a missing promtool fails the test that needs it; elsewhere it skips, saying
so. Helm renders the chart as tests/helm/test_chart.py does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from dataplane.http.pipeline import ENDPOINTS
from tests.helm.test_chart import helm_binary
from tests.helm.test_chart import render as chart_render


def promtool() -> str:
    """The promtool binary; skips the test (fails it under CI=true) when there is none."""
    found = shutil.which("promtool")
    if found is None:
        message = "promtool not found: `apt-get install prometheus` (or `make check`) brings it"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, check=False, timeout=120, cwd=cwd
    )


def render(*args: str) -> list[dict[str, Any]]:
    """`helm template` of the chart (release and namespace "ponto") with extra args."""
    return chart_render(helm_binary(), *args)


# Sample names a family of each type exports (prometheus_client's, less `_created`).
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry's collectors export, labelled families that have
    no series yet included (their family is described all the same)."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


def exported_names() -> set[str]:
    """The names a proxy's /metrics and the control plane's /metrics export."""
    # Imported here so that only the tests that need the planes' metrics import them.
    from controlplane import metrics as control  # noqa: PLC0415
    from dataplane import metrics as proxy  # noqa: PLC0415

    # Families a proxy registers once it has what they are about: a regional
    # cache (--redis), JWKS URLs, tracing.
    metrics = proxy.Metrics()
    metrics.bind_region(lambda: True)
    metrics.bind_jwks(())
    metrics.bind_tracing(float, dict)
    return sample_names(metrics.registry) | sample_names(control.ControlMetrics().registry)


_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left"}
    | {"group_right", "offset", "inf", "nan"}
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_OFFSET = re.compile(r"\b(?:offset\s+-?|@\s*)[\w.()]+")
_NAME = re.compile(r"(?<![\w.$:])[a-zA-Z_:][a-zA-Z0-9_:]*(?![\w:])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers outside strings, label
    matchers, ranges and grouping clauses that are neither functions nor keywords."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    return {n for n in _NAME.findall(text) if n.lower() not in _KEYWORDS}


def check_exprs(exprs: dict[str, str], workdir: Path) -> str:
    """Syntax-checks PromQL expressions with `promtool check rules`, each as the
    recording rule named by its key. Returns promtool's complaint, "" when none."""
    rules = {
        "groups": [{"name": "check", "rules": [{"record": k, "expr": v} for k, v in exprs.items()]}]
    }
    path = workdir / "exprs.rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    out = run_promtool("check", "rules", str(path))
    return "" if out.returncode == 0 else out.stdout + out.stderr


# How the alerts and dashboards select the clients' requests in ponto_requests_total:
# the proxied endpoints, not probes (readyz answers 503 while a proxy starts or
# drains), /metrics or /v1/models.
PROXIED = 'endpoint=~"' + "|".join(ENDPOINTS) + '"'
_REQUESTS = re.compile(r"ponto_requests_total(\{[^}]*\})?")


def unproxied_request_selectors(expr: str) -> list[str]:
    """The selectors of ponto_requests_total in expr that do not keep to PROXIED."""
    return [m[0] for m in _REQUESTS.finditer(expr) if PROXIED not in (m[1] or "")]
