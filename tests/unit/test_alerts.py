"""The chart's PrometheusRule: valid rules, each alert firing on the series it is
about and quiet on the others (tests/alerts/ponto-alerts.test.yaml and
ponto-alerts-daylong.test.yaml through `promtool test rules`), reading only
metrics the code exports, tuned by values."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.test_chart import ROOT
from tests.monitoring import (
    exported_names,
    metric_names,
    render,
    run_promtool,
    unproxied_request_selectors,
)

CASES = ROOT / "tests" / "alerts" / "ponto-alerts.test.yaml"
# The cache alerts' cases, against those alerts' rules alone (the file says why).
DAYLONG = ROOT / "tests" / "alerts" / "ponto-alerts-daylong.test.yaml"
ALERTS = {
    "PontoProxyStaleTable",
    "PontoProxyNoControlPlane",
    "PontoProxyRefusesTables",
    "PontoProxyDown",
    "PontoOriginDown",
    "PontoOriginFailing",
    "PontoOriginCuttingStreams",
    "PontoOriginSlow",
    "PontoOriginSlowFirstToken",
    "PontoOriginLoadsStale",
    "PontoProxyLoadsStale",
    "PontoRegionDrainedTooLong",
    "PontoHighErrorRatio",
    "PontoRegionSpilling",
    "PontoCacheHitRatioCollapse",
    "PontoCacheBypassSurge",
    "PontoControlPlaneNoLeader",
    "PontoEtcdErrors",
    "PontoBudgetNearlySpent",
    "PontoHighErrorRatioFast",
    "PontoRegionCacheDown",
    "PontoRegionCacheRefusingWrites",
    "PontoJwksStale",
    "PontoAccessLogDropping",
    "PontoProxyDescriptorsNearLimit",
}


def rule_spec(*values: str) -> dict[str, Any]:
    docs = render("--set", "alerts.enabled=true", *values)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    spec: dict[str, Any] = rule["spec"]
    return spec


def alert_rules(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in spec["groups"] for r in g["rules"]}


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return rule_spec()


def alerts_cased_in(cases: Path) -> set[str]:
    return {
        e["alertname"]
        for t in yaml.safe_load(cases.read_text())["tests"]
        for e in t["alert_rule_test"]
    }


def bare_rules(spec: dict[str, Any], alerts: set[str] | None = None) -> dict[str, Any]:
    """The spec's rules (those of `alerts` if given) without their annotations:
    promtool would compare their full text; test_every_alert_explains_itself
    checks them instead."""
    groups = [
        {
            **g,
            "rules": [
                {k: v for k, v in r.items() if k != "annotations"}
                for r in g["rules"]
                if alerts is None or r.get("alert") in alerts
            ],
        }
        for g in spec["groups"]
    ]
    return {"groups": [g for g in groups if g["rules"]]}


def promtool_test(spec: dict[str, Any], workdir: Path, only: str | None = None) -> tuple[int, str]:
    """Runs both case files against the rules, in one promtool: DAYLONG
    against the rules of the alerts it tests alone. `only`: the cases of that
    alert in CASES alone (the rest take promtool some 6 s)."""
    (workdir / "rules.yaml").write_text(yaml.safe_dump(bare_rules(spec)))
    if only is None:
        shutil.copy(CASES, workdir / CASES.name)
        shutil.copy(DAYLONG, workdir / DAYLONG.name)
        daylong = bare_rules(spec, alerts_cased_in(DAYLONG))
        (workdir / "rules-daylong.yaml").write_text(yaml.safe_dump(daylong))
        files = [CASES.name, DAYLONG.name]
    else:
        cases = yaml.safe_load(CASES.read_text())
        groups = [
            g for g in cases["tests"] if any(e["alertname"] == only for e in g["alert_rule_test"])
        ]
        assert groups, f"no cases of {only}"
        (workdir / CASES.name).write_text(yaml.safe_dump({**cases, "tests": groups}))
        files = [CASES.name]
    out = run_promtool("test", "rules", *files, cwd=workdir)
    return out.returncode, out.stdout + out.stderr


def test_rules_pass_promtool_check(spec: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = run_promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(alert_rules(spec)) == ALERTS


def test_each_alert_fires_when_it_should_and_not_otherwise(
    spec: dict[str, Any], tmp_path: Path
) -> None:
    code, output = promtool_test(spec, tmp_path)
    assert code == 0, output


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    evals = [
        e
        for f in (CASES, DAYLONG)
        for t in yaml.safe_load(f.read_text())["tests"]
        for e in t["alert_rule_test"]
    ]
    firing = {e["alertname"] for e in evals if e["exp_alerts"]}
    quiet = {e["alertname"] for e in evals if not e["exp_alerts"]}
    assert firing == quiet == ALERTS


def test_the_cases_catch_a_changed_threshold(tmp_path: Path) -> None:
    # us-east's 20% of 5xx fires at the default 5%; at 25% the case must fail.
    code, output = promtool_test(
        rule_spec("--set-json", "alerts.errorRatio.threshold=0.25"),
        tmp_path,
        only="PontoHighErrorRatio",
    )
    assert code != 0
    assert "PontoHighErrorRatio" in output


def test_every_alert_explains_itself(spec: dict[str, Any]) -> None:
    for name, rule in alert_rules(spec).items():
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook"} <= set(annotations), name
        assert all(annotations[k].strip() for k in ("summary", "description", "runbook")), name
        assert "runbook_url" not in annotations, name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name


def test_alerts_read_only_exported_metrics(spec: dict[str, Any]) -> None:
    # `up`: Prometheus's own, of each target it scrapes (PontoProxyDown).
    known = exported_names() | {"up"}
    for name, rule in alert_rules(spec).items():
        read = metric_names(rule["expr"])
        assert read, name
        assert read <= known, f"{name} reads {sorted(read - known)}, which nothing exports"


def test_alerts_count_proxied_requests_only(spec: dict[str, Any]) -> None:
    for name, rule in alert_rules(spec).items():
        assert not unproxied_request_selectors(rule["expr"]), name


def test_no_alert_compares_versions_of_two_replicas(spec: dict[str, Any]) -> None:
    # A version is the etcd revision its replica read: a proxy's compares only with
    # its own replica's, which the replica itself does (ponto_control_proxies).
    for name, rule in alert_rules(spec).items():
        assert "table_version" not in rule["expr"], name


def test_thresholds_durations_and_labels_are_values() -> None:
    rules = alert_rules(
        rule_spec(
            "--set-json", "alerts.errorRatio.threshold=0.2",
            "--set", "alerts.errorRatio.window=15m",
            "--set", "alerts.regionDrained.for=12h",
            "--set", "alerts.noLeader.severity=warning",
            "--set", "alerts.alertLabels.team=llm",
            "--set", "alerts.runbookUrl=https://runbooks.example/ponto",
        )
    )  # fmt: skip
    errors = rules["PontoHighErrorRatio"]
    assert ") > 0.2\n" in errors["expr"]
    assert "[15m]" in errors["expr"] and "[5m]" not in errors["expr"]
    assert rules["PontoRegionDrainedTooLong"]["for"] == "12h"
    assert rules["PontoControlPlaneNoLeader"]["labels"] == {"severity": "warning", "team": "llm"}
    assert rules["PontoOriginDown"]["annotations"]["runbook_url"] == (
        "https://runbooks.example/ponto#pontoorigindown"
    )


def test_rule_carries_the_selector_labels_and_is_off_by_default() -> None:
    docs = render("--set", "alerts.enabled=true", "--set", "alerts.labels.release=prometheus")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["metadata"]["namespace"] == "ponto"
    assert not [d for d in render() if d["kind"] == "PrometheusRule"]


def test_the_regional_cache_alert_comes_with_a_regional_cache_only() -> None:
    # Without --redis no proxy exports ponto_cache_region_up: nothing to watch.
    none = alert_rules(rule_spec("--set", "cache.redis.deploy=false"))
    assert "PontoRegionCacheDown" not in none and "PontoRegionCacheRefusingWrites" not in none
    external = rule_spec("--set", "cache.redis.deploy=false",
                         "--set", "cache.redis.url=redis://valkey.cache.svc:6379/0")  # fmt: skip
    assert "PontoRegionCacheDown" in alert_rules(external)
    assert "PontoRegionCacheRefusingWrites" in alert_rules(external)


def test_the_fast_burn_is_tuned_apart_from_the_slow_one() -> None:
    spec = rule_spec(
        "--set-json", "alerts.errorRatioFast.threshold=0.3",
        "--set", "alerts.errorRatioFast.window=2m",
        "--set", "alerts.jwksStale.afterSeconds=3600",
    )  # fmt: skip
    rules = alert_rules(spec)
    fast, slow = rules["PontoHighErrorRatioFast"], rules["PontoHighErrorRatio"]
    assert ") > 0.3\n" in fast["expr"] and "[2m]" in fast["expr"]
    assert ") > 0.05\n" in slow["expr"] and "[5m]" in slow["expr"]
    assert fast["for"] == "2m" and fast["labels"]["severity"] == "critical"
    assert "> 3600\n" in rules["PontoJwksStale"]["expr"]


def test_descriptions_say_thresholds_as_their_values_are_said(spec: dict[str, Any]) -> None:
    """Trial 67: "10% of the answers ... are 5xx (threshold 0.05 )": a ratio
    beside a percentage, and a space before the parenthesis closed."""
    for name, rule in alert_rules(spec).items():
        description = rule["annotations"]["description"]
        assert " )" not in description and " s)" not in description, (name, description)
        if "humanizePercentage" in description and "(threshold" in description:
            assert re.search(r"\(threshold [0-9.]+%\)", description), (name, description)
    described = alert_rules(spec)["PontoHighErrorRatio"]["annotations"]["description"]
    assert described.endswith("are 5xx (threshold 5%).")
