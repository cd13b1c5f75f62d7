"""The chart's Grafana dashboards (charts/ponto/dashboards/*.json): the part of
Grafana's model they use (tests/dashboards/schema.json), a layout Grafana draws as
written, valid PromQL (promtool), only metric names the code exports, and the
ConfigMaps Grafana's sidecar loads them from."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from tests.helm.test_chart import CHART, ROOT
from tests.monitoring import (
    check_exprs,
    exported_names,
    metric_names,
    render,
    unproxied_request_selectors,
)

Dashboard = dict[str, Any]

DASHBOARDS = CHART / "dashboards"
SCHEMA = ROOT / "tests" / "dashboards" / "schema.json"
# Grafana's built-in variables, replaced by a value of their kind for promtool.
BUILTINS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+), *(?P<label>\w+)\)$")

# What each dashboard must show, by the series it reads.
MUST_READ = {
    "ponto-fleet": {
        "ponto_requests_total",
        "gen_ai_client_operation_time_to_first_chunk_seconds_bucket",
        "gen_ai_client_operation_duration_seconds_bucket",
        "ponto_stream_mean_chunk_interval_seconds_bucket",
        "ponto_upstream_time_to_commit_seconds_bucket",
        "gen_ai_client_token_usage_sum",
        "ponto_route_decisions_total",
        "ponto_upstream_attempts_total",
        "ponto_origin_prompt_tokens_total",
        "ponto_origin_cached_prompt_tokens_total",
        "ponto_origin_slowness",
    },
    "ponto-cache": {
        "ponto_cache_requests_total",
        "ponto_cache_entries",
        "ponto_cache_bytes",
        "ponto_cache_evictions_total",
        "ponto_cache_expired_total",
        "ponto_cache_purged_total",
    },
    "ponto-ratelimits": {"ponto_requests_total", "ponto_tenant_requests_total"}
    | {"ponto_tenant_tokens_total"},
    "ponto-control-plane": {
        "ponto_control_table_version",
        "ponto_route_table_version",
        "ponto_control_proxies",
        "ponto_control_push_latency_seconds_bucket",
        "ponto_control_pushes_total",
        "ponto_control_etcd_request_duration_seconds_bucket",
        "ponto_control_etcd_errors_total",
        "ponto_control_leader",
        "ponto_control_probes_total",
        "ponto_control_origin_healthy",
        "ponto_control_origin_drained",
        "ponto_control_region_drained",
        "ponto_control_admin_calls_total",
    },
}


def load() -> dict[str, Dashboard]:
    boards = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        board: Dashboard = json.loads(path.read_text())
        boards[path.stem] = board
    return boards


BOARDS = load()


def data_panels(board: Dashboard) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def queries(board: Dashboard) -> dict[str, str]:
    """Every PromQL expression of a dashboard by where it is: its panels' targets and
    the selectors of its label_values() variables."""
    found = {}
    for panel in data_panels(board):
        for target in panel["targets"]:
            found[f"panel {panel['id']} ({panel['title']}) {target['refId']}"] = target["expr"]
    for variable in board["templating"]["list"][1:]:
        match = LABEL_VALUES.match(variable["definition"])
        assert match, variable["definition"]
        assert variable["query"]["query"] == variable["definition"]
        found[f"variable {variable['name']}"] = match["selector"]
    return found


def concrete(expr: str, variables: set[str]) -> str:
    """The expression as Grafana would send it with every variable at "All" (.*)."""

    def value(m: re.Match[str]) -> str:
        name = m[1]
        assert name in BUILTINS or name in variables, f"${name} is not defined"
        return BUILTINS.get(name, ".*")

    return VARIABLE.sub(value, expr)


def test_there_are_the_four_dashboards() -> None:
    assert sorted(b["uid"] for b in BOARDS.values()) == sorted(MUST_READ)


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_matches_the_schema(name: str) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(schema).iter_errors(BOARDS[name])
    ]
    assert not errors, errors


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panels_have_unique_ids_and_do_not_overlap(name: str) -> None:
    panels = BOARDS[name]["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"panel {p['id']} passes the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"panels {taken[x, y]} and {p['id']} overlap"
                taken[x, y] = p["id"]
        assert len({t["refId"] for t in p.get("targets", [])}) == len(p.get("targets", []))


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_has_a_datasource_and_a_region_variable(name: str) -> None:
    variables = [v["name"] for v in BOARDS[name]["templating"]["list"]]
    assert variables[0] == "datasource"
    assert "region" in variables
    assert len(variables) == len(set(variables))


def test_uids_and_titles_are_unique() -> None:
    for key in ("uid", "title"):
        values = [b[key] for b in BOARDS.values()]
        assert len(values) == len(set(values))


def test_every_expression_is_valid_promql(tmp_path: Path) -> None:
    exprs = {}
    for name, board in BOARDS.items():
        variables = {v["name"] for v in board["templating"]["list"]}
        for i, expr in enumerate(queries(board).values()):
            exprs[f"dashboard:{name.replace('-', '_')}:{i}"] = concrete(expr, variables)
    complaint = check_exprs(exprs, tmp_path)
    assert not complaint, complaint


def test_the_check_refuses_invalid_promql(tmp_path: Path) -> None:
    assert check_exprs({"ok": "sum(rate(ponto_requests_total[5m]))"}, tmp_path) == ""
    assert "unclosed" in check_exprs({"bad": "sum(rate(ponto_requests_total[5m])"}, tmp_path)


def test_dashboards_read_only_exported_metrics() -> None:
    known = exported_names()
    unknown = {
        f"{name}: {where}": sorted(read - known)
        for name, board in BOARDS.items()
        for where, expr in queries(board).items()
        if (read := metric_names(expr)) - known
    }
    assert not unknown, unknown


def test_request_panels_count_proxied_requests_only() -> None:
    stray = {
        f"{name}: {where}": found
        for name, board in BOARDS.items()
        for where, expr in queries(board).items()
        if (found := unproxied_request_selectors(expr))
    }
    assert not stray, stray


def test_error_and_refusal_panels_read_0_not_no_data_before_the_first() -> None:
    """A 5xx or 429 series exists from its first answer on: until then the
    panels read "No data" (trial 41), which looks like a broken scrape."""
    blank = [
        f"{name}: {where}"
        for name, board in BOARDS.items()
        for where, expr in queries(board).items()
        if re.search(r'ponto_requests_total\{[^}]*code=~?"(5\.\.|429)"', expr)
        and not re.search(r"\bor (vector\(0\)|0 \*)", expr)
    ]
    assert not blank, blank


def test_duration_quantiles_are_of_answered_requests_only() -> None:
    # Refusals (401, 404, 429) come back in a millisecond: in a duration quantile
    # they would pass for fast answers (SRE trial).
    quantiles = [
        (f"{name}: {where}", expr)
        for name, board in BOARDS.items()
        for where, expr in queries(board).items()
        if "histogram_quantile" in expr and "operation_duration_seconds_bucket" in expr
    ]
    assert quantiles
    assert [where for where, expr in quantiles if 'error_type=""' not in expr] == []


def test_proxies_are_counted_by_pod_not_by_worker() -> None:
    # ponto_proxy_info is one series per worker process (--workers N).
    for name, board in BOARDS.items():
        for where, expr in queries(board).items():
            if expr.startswith("count") and "ponto_proxy_info" in expr:
                assert "count by (namespace, pod, version)" in expr, f"{name}: {where}"


def test_no_expression_compares_versions_of_two_sources() -> None:
    # Versions are each control plane replica's own etcd revision: a proxy's
    # compares with its replica's only, which ponto_control_proxies reports.
    mixed = [
        f"{name}: {where}"
        for name, board in BOARDS.items()
        for where, expr in queries(board).items()
        if {"ponto_route_table_version", "ponto_control_table_version"} <= metric_names(expr)
    ]
    assert not mixed, mixed


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_shows_what_it_is_for(name: str) -> None:
    board = BOARDS[name]
    read = set().union(*(metric_names(e) for e in queries(board).values()))
    assert MUST_READ[board["uid"]] <= read, sorted(MUST_READ[board["uid"]] - read)


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (code) (rate(ponto_requests_total{code=~"5.."}[5m]))', {"ponto_requests_total"}),
        (
            "a_total < on (namespace) group_left () max by (namespace) (b) or c == 0",
            {"a_total", "b", "c"},
        ),
        ("rate(x_total[1h] offset 1d) / ignoring (kind) group_left sum(y)", {"x_total", "y"}),
        ("histogram_quantile(0.95, sum by (le) (rate(h_bucket[$__rate_interval])))", {"h_bucket"}),
        ("count(m > 1e3) or vector(0)", {"m"}),
        ('label_replace(up, "dst", "$1", "src", "(.*)")', {"up"}),
        ('topk(5, sum by (tenant) (increase(t{x="a b"}[$__range])))', {"t"}),
    ],
)
def test_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def dashboard_maps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in docs
        if d["kind"] == "ConfigMap"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == "dashboards"
    ]


def test_config_maps_for_the_grafana_sidecar() -> None:
    assert not dashboard_maps(render())
    maps = {
        d["metadata"]["name"]: d for d in dashboard_maps(render("--set", "dashboards.enabled=true"))
    }
    assert sorted(maps) == sorted(f"ponto-dashboard-{name}" for name in BOARDS)
    for name, board in BOARDS.items():
        cm = maps[f"ponto-dashboard-{name}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "ponto"
        assert json.loads(cm["data"][f"ponto-{name}.json"]) == board


def test_sidecar_label_namespace_and_annotations_are_values() -> None:
    docs = render(
        "--set", "dashboards.enabled=true",
        "--set", "dashboards.label=my_dashboards",
        "--set-string", "dashboards.labelValue=yes",
        "--set", "dashboards.namespace=monitoring",
        "--set", "dashboards.annotations.grafana_folder=Ponto",
    )  # fmt: skip
    maps = dashboard_maps(docs)
    assert len(maps) == len(BOARDS)
    for cm in maps:
        meta = cm["metadata"]
        assert meta["labels"]["my_dashboards"] == "yes"
        assert "grafana_dashboard" not in meta["labels"]
        assert meta["namespace"] == "monitoring"
        assert meta["annotations"] == {"grafana_folder": "Ponto"}
