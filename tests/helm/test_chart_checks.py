"""Checks the chart makes at render time, where Kubernetes would otherwise accept
the objects and fail later (pods never created, a Service rendered over another) or
refuse them with a message that does not name the value to change."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dataplane import settings as proxy_settings
from dataplane.supervisor import SHUTDOWN_GRACE_S
from tests.helm.test_chart import (
    CHART,
    THREE_REGIONS,
    Doc,
    helm,
    matches,
    objects,
    refused,
    render,
    template,
    three,
    values_file,
)

__all__ = ["helm", "three"]  # the fixtures, used here by name


def _regions(*names: str) -> Doc:
    return {"proxy": {"regions": [{"name": n, "lat": 1, "lon": 2} for n in names]}}


# ---------------------------------------------------------------- names


def test_the_metrics_service_name_is_checked_against_the_dns_label_limit(
    helm: Path, tmp_path: Path
) -> None:
    # "<fullname>-proxy-<region>" is 56 characters, its metrics Service's name 64.
    name = "f" * 42
    values = {
        **_regions("us-east"),
        "etcd": {"enabled": False, "external": {"endpoints": ["e:2379"]}},
    }
    message = refused(
        helm, "--set", f"fullnameOverride={name}", "-f", values_file(tmp_path, values)
    )
    assert f'name "{name}-proxy-us-east-metrics" is longer than 63 characters' in message


def test_two_regions_whose_services_would_share_a_name_are_refused(
    helm: Path, tmp_path: Path
) -> None:
    message = refused(helm, "-f", values_file(tmp_path, _regions("us", "us-metrics")))
    assert (
        'the metrics Service of region "us" and the proxy Service of region "us-metrics"' in message
    )
    assert 'would both be named "ponto-proxy-us-metrics"' in message


def test_every_service_has_its_own_name(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, "-f", values_file(tmp_path, _regions("us", "us-east", "metrics")))
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    assert len(names) == len(set(names))
    assert {"ponto-proxy-us-metrics", "ponto-proxy-metrics-metrics"} <= set(names)


def test_an_etcd_statefulset_name_its_pods_could_not_carry_is_refused(
    helm: Path, tmp_path: Path
) -> None:
    # 48 + "-etcd": 53 characters, within a DNS label, but the pods' label
    # controller-revision-hash=<name>-<10 characters> would be 64.
    values = values_file(tmp_path, _regions("a"))
    message = refused(helm, "--set", f"fullnameOverride={'f' * 48}", "-f", values)
    assert "StatefulSet name" in message
    assert "is 53 characters, above 52" in message
    assert "controller-revision-hash" in message
    docs = render(helm, "--set", f"fullnameOverride={'f' * 47}", "-f", values)
    (etcd,) = objects(docs, "StatefulSet")
    assert len(etcd) == 52


# ---------------------------------------------------------------- resources


@pytest.mark.parametrize(
    ("setting", "where"),
    [
        ("proxy.resources.limits.cpu=abc", "proxy.resources.limits.cpu"),
        ("controlPlane.resources.requests.memory=128MB", "controlPlane.resources.requests.memory"),
        ("etcd.resources.limits.memory=1 Gi", "etcd.resources.limits.memory"),
        ("cache.redis.resources.requests.cpu=-1", "cache.redis.resources.requests.cpu"),
    ],
)
def test_schema_refuses_what_is_no_kubernetes_quantity(
    helm: Path, setting: str, where: str
) -> None:
    message = refused(helm, "--set", setting)
    assert "values don't meet the specifications of the schema" in message
    assert where in message


def test_schema_refuses_a_region_s_quantity_but_takes_its_null(helm: Path, tmp_path: Path) -> None:
    region = {"name": "us-east", "lat": 1, "lon": 2}
    bad = {**region, "resources": {"limits": {"memory": "lots"}}}
    message = refused(helm, "-f", values_file(tmp_path, {"proxy": {"regions": [bad]}}))
    assert "proxy.regions.0.resources.limits.memory" in message
    good = {**region, "resources": {"limits": {"cpu": None}, "requests": {"cpu": "150m"}}}
    render(helm, "-f", values_file(tmp_path, {"proxy": {"regions": [good]}}))


@pytest.mark.parametrize(
    "quantity", ["2", "1.5", "500m", "256Mi", "1Gi", "500M", "1e3", "1E3", "250000u", ".5"]
)
def test_every_kubernetes_quantity_form_renders(helm: Path, quantity: str) -> None:
    # As a request under a limit it cannot be above: the comparison reads it too.
    render(
        helm,
        "--set-string",
        f"controlPlane.resources.requests.memory={quantity}",
        "--set-string",
        "controlPlane.resources.limits.memory=1Ei",
    )


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "controlPlane.resources.requests.cpu=2",
            "controlPlane.resources: requests.cpu 2 is above limits.cpu 1",
        ),
        (
            "etcd.resources.requests.memory=2Gi",
            "etcd.resources: requests.memory 2Gi is above limits.memory 1Gi",
        ),
        (
            "cache.redis.resources.requests.memory=1Gi",
            "cache.redis.resources: requests.memory 1Gi is above limits.memory 384Mi",
        ),
        (
            "topology.job.resources.requests.cpu=1",
            "topology.job.resources: requests.cpu 1 is above limits.cpu 500m",
        ),
    ],
)
def test_a_request_above_its_limit_is_refused_for_every_component(
    helm: Path, setting: str, message: str
) -> None:
    assert message in refused(helm, "--set", setting)


def test_resources_of_what_the_chart_does_not_run_are_not_checked(helm: Path) -> None:
    render(
        helm,
        "--set",
        "cache.redis.url=redis://r:6379/0",
        "--set",
        "cache.redis.resources.requests.memory=1Gi",
        "--set",
        "topology.apply=false",
        "--set",
        "topology.job.resources.requests.cpu=1",
    )


# ---------------------------------------------------------------- stopping proxies


def test_a_grace_period_shorter_than_a_proxy_s_stop_is_refused(helm: Path, tmp_path: Path) -> None:
    # preStop 5 + drain 10.5 + the supervisor's 75 s: 90.5 s, over the default 90.
    values = values_file(tmp_path, {"proxy": {"drainSeconds": 10.5}})
    message = refused(helm, "-f", values)
    assert (
        "proxy.terminationGracePeriodSeconds 90 is below what a stopping proxy may take" in message
    )
    assert "preStopSleepSeconds 5, then drainSeconds 10.5, then 75 s" in message
    assert "raise terminationGracePeriodSeconds to 91" in message
    longer = render(helm, "-f", values, "--set", "proxy.terminationGracePeriodSeconds=91")
    deployment = objects(longer, "Deployment")["ponto-proxy-us-east"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 91
    # Exactly enough is enough: 5 + 10 + 75.
    render(helm, "--set", "proxy.drainSeconds=10")
    # The preStop sleep counts as well.
    assert "preStopSleepSeconds 20" in refused(helm, "--set", "proxy.preStopSleepSeconds=20")


def test_the_grace_check_holds_the_supervisors_own_allowance() -> None:
    """The chart's 75 s is the supervisor's SHUTDOWN_GRACE_S (review 202:
    nothing tied them); a change to one must be made to the other."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert f"($p.drainSeconds | float64) {SHUTDOWN_GRACE_S:g}" in helpers


def test_no_rendered_text_holds_a_printf_error(helm: Path) -> None:
    """Review 202: PontoOriginFailing's description ended with Go's
    `%!(EXTRA string=10m)`, a printf given one argument too many."""
    for args in ((), ("--set", "alerts.enabled=true"), ("-f", str(THREE_REGIONS))):
        out = template(helm, *args)
        assert out.returncode == 0, out.stderr
        assert "%!" not in out.stdout


def test_a_grace_period_of_zero_is_refused(helm: Path) -> None:
    message = refused(helm, "--set", "proxy.terminationGracePeriodSeconds=0")
    assert "proxy.terminationGracePeriodSeconds: Must be greater than or equal to 1" in message


# ---------------------------------------------------------------- placement


def test_cache_redis_placement_wins_over_the_region_s(helm: Path, tmp_path: Path) -> None:
    region = {
        "name": "us-east",
        "lat": 1,
        "lon": 2,
        "nodeSelector": {"pool": "edge", "zone": "a"},
        "tolerations": [{"key": "edge", "operator": "Exists"}],
    }
    values = {
        "proxy": {"nodeSelector": {"arch": "arm64", "pool": "general"}, "regions": [region]},
        "cache": {
            "redis": {
                "nodeSelector": {"pool": "memory"},
                "tolerations": [{"key": "memory", "operator": "Exists"}],
            }
        },
    }
    docs = render(helm, "-f", values_file(tmp_path, values))
    spec = objects(docs, "Deployment")["ponto-redis-us-east"]["spec"]["template"]["spec"]
    # cache.redis's key wins; the region's and proxy's others still place it.
    assert spec["nodeSelector"] == {"pool": "memory", "zone": "a", "arch": "arm64"}
    assert spec["tolerations"] == [{"key": "memory", "operator": "Exists"}]
    proxy = objects(docs, "Deployment")["ponto-proxy-us-east"]["spec"]["template"]["spec"]
    assert proxy["nodeSelector"] == {"pool": "edge", "zone": "a", "arch": "arm64"}


def test_topology_spread_constraints_select_their_own_pods(helm: Path, tmp_path: Path) -> None:
    """Trial 53: no value spread a component's pods across zones. One given
    without a labelSelector selects the component's own pods (a constraint
    with none counts no pod); a region's own list wins over proxy's."""
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway"}  # fmt: skip
    mine = {
        **zone,
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": {"group": "edge"}},
    }
    values = {
        "controlPlane": {"topologySpreadConstraints": [zone]},
        "etcd": {"topologySpreadConstraints": [zone]},
        "proxy": {
            "topologySpreadConstraints": [zone],
            "regions": [
                {"name": "us-east", "lat": 1, "lon": 2},
                {"name": "eu-west", "lat": 3, "lon": 4, "topologySpreadConstraints": [mine]},
                # An empty list of its own: none (review 205: proxy's applied).
                {"name": "ap-south", "lat": 5, "lon": 6, "topologySpreadConstraints": []},
            ],
        },
    }
    docs = render(helm, "-f", values_file(tmp_path, values))

    def spread(kind: str, name: str) -> list[dict[str, object]]:
        spec = objects(docs, kind)[name]["spec"]["template"]["spec"]
        found: list[dict[str, object]] = spec["topologySpreadConstraints"]
        return found

    (east,) = spread("Deployment", "ponto-proxy-us-east")
    assert east["labelSelector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "ponto",
            "app.kubernetes.io/instance": "ponto",
            "app.kubernetes.io/component": "proxy",
            "ponto.io/region": "us-east",
        }
    }
    assert spread("Deployment", "ponto-proxy-eu-west") == [mine]
    south = objects(docs, "Deployment")["ponto-proxy-ap-south"]["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in south
    (control,) = spread("Deployment", "ponto-control")
    assert control["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "control-plane"  # type: ignore[index]
    (members,) = spread("StatefulSet", "ponto-etcd")
    assert members["topologyKey"] == "topology.kubernetes.io/zone"
    # None given: none rendered.
    spec = objects(render(helm), "Deployment")["ponto-proxy-us-east"]["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in spec


# ---------------------------------------------------------------- labels


def _render_chart(helm: Path, chart: Path, *args: str) -> list[Doc]:
    out = subprocess.run(
        [str(helm), "template", "ponto", str(chart), "--namespace", "ponto", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_a_new_chart_version_rolls_neither_etcd_nor_redis(helm: Path, tmp_path: Path) -> None:
    bumped = tmp_path / "ponto"
    shutil.copytree(CHART, bumped)
    meta = bumped / "Chart.yaml"
    data = yaml.safe_load(meta.read_text())
    meta.write_text(yaml.safe_dump({**data, "version": "9.9.9", "appVersion": "9.9.9"}))
    # The image is pinned, as an upgrade that changes only the chart keeps it.
    pin = ("--set", "image.tag=0.1.0")
    before = {(d["kind"], d["metadata"]["name"]): d for d in _render_chart(helm, CHART, *pin)}
    after = {(d["kind"], d["metadata"]["name"]): d for d in _render_chart(helm, bumped, *pin)}
    for key in (("StatefulSet", "ponto-etcd"), ("Deployment", "ponto-redis-us-east")):
        # The whole pod template: any change to it rolls the pods.
        assert after[key]["spec"]["template"] == before[key]["spec"]["template"], key
        assert after[key]["metadata"]["labels"]["helm.sh/chart"] == "ponto-9.9.9"
    for key, doc in after.items():
        if key[0] in ("Deployment", "StatefulSet", "Job"):
            pod = doc["spec"]["template"]["metadata"]["labels"]
            assert pod == before[key]["spec"]["template"]["metadata"]["labels"], key
            assert "helm.sh/chart" not in pod and "app.kubernetes.io/version" not in pod, key
            # What selects the pods still does (a Job selects its own).
            if key[0] != "Job":
                assert matches(doc["spec"]["selector"]["matchLabels"], pod), key


def test_nothing_selects_pods_by_a_label_their_template_lacks(three: list[Doc]) -> None:
    pods = [
        d["spec"]["template"]["metadata"]["labels"]
        for d in three
        if d["kind"] in ("Deployment", "StatefulSet", "Job")
    ]
    selectors = []
    for d in three:
        spec = d.get("spec", {})
        if d["kind"] in ("Service",):
            selectors.append((d, spec.get("selector") or {}))
        elif d["kind"] in ("PodDisruptionBudget", "Deployment", "StatefulSet"):
            selectors.append((d, spec["selector"]["matchLabels"]))
        elif d["kind"] == "NetworkPolicy":
            selectors.append((d, spec["podSelector"]["matchLabels"]))
            for rule in spec.get("ingress", []):
                for peer in rule.get("from", []):
                    selectors.append((d, peer["podSelector"]["matchLabels"]))
    assert selectors
    for d, selector in selectors:
        if selector:
            assert any(matches(selector, labels) for labels in pods), d["metadata"]["name"]
            assert not {"helm.sh/chart", "app.kubernetes.io/version"} & set(selector)


def test_etcd_takes_its_cluster_state_and_more_flags(helm: Path) -> None:
    """Trial 53: re-adding a member whose volume was lost needed
    --initial-cluster-state=existing, which no value set (an upgrade reverted
    a hand edit), and no value added etcd flags."""
    docs = render(
        helm,
        "--set", "etcd.initialClusterState=existing",
        "--set", "etcd.extraArgs[0]=--snapshot-count=50000",
    )  # fmt: skip
    spec = objects(docs, "StatefulSet")["ponto-etcd"]["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert "--initial-cluster-state=existing" in args and args[-1] == "--snapshot-count=50000"
    assert (
        "--initial-cluster-state=new"
        in objects(render(helm), "StatefulSet")["ponto-etcd"]["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
    )
    assert "initialClusterState" in refused(helm, "--set", "etcd.initialClusterState=old")
    assert "extraArgs" in refused(helm, "--set", "etcd.extraArgs[0]=snapshot-count")


def test_an_ipv6_cluster_listens_on_every_ipv6_address(helm: Path) -> None:
    """Trial 53: every server listened on 0.0.0.0, so none answered on an
    IPv6-only cluster. The proxies and the control plane parse what they are
    given with their own flag parsers."""
    docs = render(helm, "--set", "listenAddress=::")
    proxy = objects(docs, "Deployment")["ponto-proxy-us-east"]["spec"]["template"]["spec"]
    args = proxy["containers"][0]["args"]
    listens = [a for a in args if a.startswith(("--listen=", "--metrics-listen="))]
    assert listens == ["--listen=[::]:8080", "--metrics-listen=[::]:9090"]
    base = ["--control-plane", "cp:7000", "--region", "us-east", "--name", "p", "--workers", "1"]
    settings = proxy_settings.parse([*base, *listens])
    assert (settings.listen_host, settings.listen_port) == ("::", 8080)
    assert settings.metrics_listen is not None and settings.metrics_listen[0] == "::"
    control = objects(docs, "Deployment")["ponto-control"]["spec"]["template"]["spec"]
    assert "--listen=[::]:7000" in control["containers"][0]["args"]
    etcd = objects(docs, "StatefulSet")["ponto-etcd"]["spec"]["template"]["spec"]
    assert "--listen-client-urls=http://[::]:2379" in etcd["containers"][0]["args"]
    assert "listenAddress" in refused(helm, "--set", "listenAddress=127.0.0.1")
    default = objects(render(helm), "Deployment")["ponto-proxy-us-east"]["spec"]["template"]
    assert "--listen=0.0.0.0:8080" in default["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("key", ["tls", "auth", "cache", "proxy", "alerts", "serviceMonitor"])
@pytest.mark.parametrize("extra", [(), ("--set", "topology.apply=false")])
def test_a_key_with_nothing_under_it_is_said_to_be(
    helm: Path, tmp_path: Path, key: str, extra: tuple[str, ...]
) -> None:
    """Trial 54: `tls:` with nothing under it (null: Helm drops the chart's
    defaults) failed with Go's "nil pointer evaluating interface {}". The
    schema requires every top-level map (review 205: a check in a template
    ran only if Helm rendered it first)."""
    values = tmp_path / "null.yaml"
    values.write_text(f"{key}:\n")
    message = refused(helm, "-f", str(values), *extra)
    assert f"(root): {key} is required" in message
    assert "nil pointer" not in message
