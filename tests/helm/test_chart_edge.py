"""A proxies-only ("edge") release of the chart (controlPlane.enabled false): the
proxies of one cluster registering with a central release's control plane in
another (docs/helm.md, "Several clusters"). What it renders, what it needs, what it
refuses, and that the central (default) render does not change with it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from dataplane import settings as proxy_settings
from ponto.geodb import write_city_db
from ponto.pki import make_bundle
from tests.helm.test_chart import (
    CHART,
    Doc,
    _certificate,
    _materialise,
    container,
    default,
    flags,
    helm,
    objects,
    one,
    refused,
    render,
    values_file,
    volume,
)

__all__ = ["default", "helm"]  # the fixtures, used here by name

EDGE_VALUES = CHART / "ci" / "edge-values.yaml"
EDGE_REGIONS = ("ap-southeast", "ap-northeast")
ADDRESS = "ponto-cp.llm.example.com:7000"
# The least an edge release needs: the address and the central release's Secrets.
MINIMAL = (
    "--set",
    f"controlPlane.enabled=false,controlPlane.address={ADDRESS}",
    "--set",
    "auth.existingSecret=central-tokens,tls.existingSecrets.proxy=central-proxy-tls",
    "--set-json",
    'proxy.regions=[{"name": "ap-southeast"}]',
)


@pytest.fixture(scope="module")
def edge(helm: Path) -> list[Doc]:
    return render(helm, "-f", str(EDGE_VALUES))


def kinds_and_names(docs: list[Doc]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_an_edge_release_renders_the_proxies_and_nothing_of_the_control_plane(
    edge: list[Doc],
) -> None:
    expected = {("ServiceAccount", "ponto-proxy"), ("ServiceAccount", "ponto-redis")}
    for r in EDGE_REGIONS:
        expected |= {
            ("Deployment", f"ponto-proxy-{r}"),
            ("Service", f"ponto-proxy-{r}"),
            ("Service", f"ponto-proxy-{r}-metrics"),
            ("PodDisruptionBudget", f"ponto-proxy-{r}"),
            # The region's shared cache stays with its proxies.
            ("Deployment", f"ponto-redis-{r}"),
            ("Service", f"ponto-redis-{r}"),
            ("NetworkPolicy", f"ponto-redis-{r}"),
        }
    # Monitoring of the proxies only: the control plane's ServiceMonitor and dashboard
    # belong with the central release.
    expected |= {
        ("ServiceMonitor", "ponto-proxy"),
        ("PrometheusRule", "ponto-alerts"),
        ("ConfigMap", "ponto-dashboard-cache"),
        ("ConfigMap", "ponto-dashboard-fleet"),
        ("ConfigMap", "ponto-dashboard-ratelimits"),
    }
    assert kinds_and_names(edge) == expected
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in edge}
    assert not components & {"control-plane", "etcd", "topology", "auth", "tls"}
    # No Secret, no Job, no hook: nothing generated that the central CA or tokens
    # would not know.
    assert objects(edge, "Secret") == {} and objects(edge, "Job") == {}
    assert not any("helm.sh/hook" in d["metadata"].get("annotations", {}) for d in edge)


def test_edge_proxies_dial_the_given_address_with_the_central_credentials(
    edge: list[Doc], tmp_path: Path
) -> None:
    # The copied Secrets, as Kubernetes would mount them, read by the real parser.
    bundle = make_bundle(tmp_path / "pki")
    tokens = tmp_path / "etc" / "ponto" / "tokens"
    tls = tmp_path / "etc" / "ponto" / "tls"
    tokens.mkdir(parents=True)
    tls.mkdir(parents=True)
    (tokens / "bootstrap-token").write_bytes(Path(bundle.bootstrap_token_file).read_bytes())
    for name, source in (("ca.crt", "ca.crt"), ("tls.crt", "proxy.crt"), ("tls.key", "proxy.key")):
        (tls / name).write_bytes((bundle.directory / source).read_bytes())
    geoip = tmp_path / "geoip" / "dbip-city-lite.mmdb"
    geoip.parent.mkdir()
    write_city_db(geoip, {"203.0.113.0/24": (35.68, 139.69, "JP", "Tokyo")})
    for region in EDGE_REGIONS:
        deployment = one(edge, "Deployment", f"ponto-proxy-{region}")
        assert flags(container(deployment))["--control-plane"] == ADDRESS
        assert volume(deployment, "tokens")["secret"]["secretName"] == "ponto-central-tokens"
        assert volume(deployment, "tokens")["secret"]["items"] == [
            {"key": "bootstrap-token", "path": "bootstrap-token"}
        ]
        assert volume(deployment, "tls")["secret"]["secretName"] == "ponto-central-proxy-tls"
        proxy = proxy_settings.parse(_materialise(edge, tmp_path, deployment))
        assert proxy.control_plane == (ADDRESS,)
        assert proxy.region == region
        assert proxy.redis_url == f"redis://ponto-redis-{region}.ponto.svc:6379/0"


def test_several_addresses_reach_the_proxies_as_one_list(helm: Path) -> None:
    docs = render(
        helm, *MINIMAL, "--set", "controlPlane.address=cp-a.example:7000\\,cp-b.example:7000"
    )
    proxy = container(one(docs, "Deployment", "ponto-proxy-ap-southeast"))
    assert flags(proxy)["--control-plane"] == "cp-a.example:7000,cp-b.example:7000"


def test_the_minimal_edge_release_renders(helm: Path) -> None:
    docs = render(helm, *MINIMAL)
    assert {d["kind"] for d in docs} == {
        "ServiceAccount",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    assert "ponto-control" not in objects(docs, "Deployment")


@pytest.mark.parametrize(
    ("drop", "needs"),
    [
        ("controlPlane.address=", "set controlPlane.address"),
        ("auth.existingSecret=", "set auth.existingSecret"),
        ("tls.existingSecrets.proxy=", "set tls.existingSecrets.proxy"),
    ],
)
def test_an_edge_release_without_the_address_or_the_central_secrets_is_refused(
    helm: Path, drop: str, needs: str
) -> None:
    message = refused(helm, *MINIMAL, "--set", drop)
    assert "controlPlane.enabled is false" in message
    assert needs in message


def test_without_tls_an_edge_release_needs_no_certificate(helm: Path) -> None:
    docs = render(helm, *MINIMAL, "--set", "tls.enabled=false,tls.existingSecrets.proxy=")
    proxy = one(docs, "Deployment", "ponto-proxy-ap-southeast")
    assert "--tls-cert" not in flags(container(proxy))
    # The token is still the central release's.
    assert volume(proxy, "tokens")["secret"]["secretName"] == "central-tokens"


@pytest.mark.parametrize(
    "address",
    [
        "ponto-cp.example",  # no port
        "https://ponto-cp.example:7000",  # a URL (trial 54: rendered, and every proxy exited 2)
        "ponto-cp.example:7000/v1",
        "::1:7000",  # IPv6 without brackets
    ],
)
def test_the_schema_refuses_what_is_no_host_port(helm: Path, address: str) -> None:
    message = refused(helm, *MINIMAL, "--set-string", f"controlPlane.address={address}")
    assert "controlPlane.address" in message


@pytest.mark.parametrize(
    "address", ["cp.example:7000", "10.0.0.5:7000", "[fd00::5]:7000", "a.example:1,b.example:2"]
)
def test_the_schema_takes_names_and_addresses(helm: Path, address: str) -> None:
    render(
        helm,
        *MINIMAL,
        "--set-string",
        f"controlPlane.address={address.replace(',', chr(92) + ',')}",
    )


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (
            {
                "topology": {
                    "origins": [
                        {
                            "name": "o",
                            "region": "ap-southeast",
                            "url": "http://o:8000/v1",
                            "models": ["m"],
                        }
                    ]
                }
            },
            "topology.origins",
        ),
        ({"topology": {"tenants": [{"name": "acme"}]}}, "topology.tenants"),
        ({"topology": {"prune": True}}, "topology.prune"),
        ({"proxy": {"regions": [{"name": "ap-southeast", "drained": True}]}}, "sets drained"),
        ({"proxy": {"regions": [{"name": "ap-southeast", "lat": 1.35, "lon": 103.8}]}}, "sets lat"),
    ],
)
def test_an_edge_release_refuses_what_only_the_central_topology_applies(
    helm: Path, tmp_path: Path, values: Doc, named: str
) -> None:
    # --set wins over -f: the regions come with the values file here.
    regions = {"proxy": {"regions": [{"name": "ap-southeast"}]}}
    message = refused(helm, *MINIMAL[:4], "-f", values_file(tmp_path, {**regions, **values}))
    assert named in message
    assert "central release" in message


def test_edge_alerts_read_no_control_plane_series(edge: list[Doc], helm: Path) -> None:
    rules = one(edge, "PrometheusRule", "ponto-alerts")["spec"]["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert names == {
        "PontoProxyNoControlPlane",
        "PontoProxyRefusesTables",
        "PontoProxyDown",
        "PontoOriginFailing",
        "PontoOriginCuttingStreams",
        "PontoOriginSlow",
        "PontoOriginSlowFirstToken",
        "PontoProxyLoadsStale",
        "PontoHighErrorRatio",
        "PontoRegionSpilling",
        "PontoCacheHitRatioCollapse",
        "PontoCacheBypassSurge",
        "PontoHighErrorRatioFast",
        "PontoRegionCacheDown",
        "PontoRegionCacheRefusingWrites",
        "PontoJwksStale",
        "PontoAccessLogDropping",
        "PontoProxyDescriptorsNearLimit",
    }
    # PontoControlPlaneNoLeader's absent() would fire for ever where no control plane is.
    # The proxies' own ponto_control_plane_connected aside.
    control = re.compile(r"ponto_control_(?!plane_connected)")
    assert not [r["alert"] for r in rules if control.search(r["expr"])]
    no_cp = next(r for r in rules if r["alert"] == "PontoProxyNoControlPlane")
    assert "ponto-cp.llm.example.com:7000" in no_cp["annotations"]["runbook"]
    central = render(helm, "--set", "alerts.enabled=true")
    central_rules = one(central, "PrometheusRule", "ponto-alerts")["spec"]["groups"][0]["rules"]
    assert {r["alert"] for r in central_rules} > names
    assert {r["alert"] for r in central_rules} - names == {
        "PontoProxyStaleTable",
        "PontoOriginDown",
        "PontoOriginLoadsStale",
        "PontoRegionDrainedTooLong",
        "PontoControlPlaneNoLeader",
        "PontoEtcdErrors",
        "PontoBudgetNearlySpent",
    }


def test_edge_notes_send_pontoctl_and_the_status_page_to_the_central_release(
    helm: Path,
) -> None:
    from tests.chartrun.__main__ import render as chartrun_render  # noqa: PLC0415

    notes = chartrun_render(str(helm), [EDGE_VALUES], upgrade=False).notes
    assert "Proxies only (controlPlane.enabled is false)" in notes
    assert ADDRESS in notes
    assert "(ap-southeast, ap-northeast) must be in the central release's" in notes
    # Nothing of a control plane in this namespace.
    assert "svc/ponto-control" not in notes
    assert "deploy/ponto-control" not in notes
    assert "logs job/" not in notes
    assert "port-forward svc/RELEASE-control 8090:8080" in notes
    assert "port-forward svc/ponto-proxy-ap-southeast 8080:80" in notes


# ---------------------------------------------------------------- the central release


def test_the_default_render_still_runs_the_control_plane_etcd_and_the_topology(
    default: list[Doc],
) -> None:
    assert kinds_and_names(default) == {
        ("ServiceAccount", "ponto-control"),
        ("ServiceAccount", "ponto-proxy"),
        ("ServiceAccount", "ponto-etcd"),
        ("ServiceAccount", "ponto-topology"),
        ("ServiceAccount", "ponto-redis"),
        ("Secret", "ponto-tokens"),
        ("Secret", "ponto-ca"),
        ("Secret", "ponto-control-tls"),
        ("Secret", "ponto-proxy-tls"),
        ("Secret", "ponto-admin-tls"),
        ("Deployment", "ponto-control"),
        ("Service", "ponto-control"),
        ("PodDisruptionBudget", "ponto-control"),
        ("Service", "ponto-etcd-peer"),
        ("Service", "ponto-etcd"),
        ("StatefulSet", "ponto-etcd"),
        ("PodDisruptionBudget", "ponto-etcd"),
        ("NetworkPolicy", "ponto-etcd"),
        ("Deployment", "ponto-proxy-us-east"),
        ("Service", "ponto-proxy-us-east"),
        ("Service", "ponto-proxy-us-east-metrics"),
        ("PodDisruptionBudget", "ponto-proxy-us-east"),
        ("Deployment", "ponto-redis-us-east"),
        ("Service", "ponto-redis-us-east"),
        ("NetworkPolicy", "ponto-redis-us-east"),
        ("ConfigMap", "ponto-topology"),
        ("Job", "ponto-topology"),
    }
    proxy = container(one(default, "Deployment", "ponto-proxy-us-east"))
    assert flags(proxy)["--control-plane"] == "ponto-control.ponto.svc:7000"
    # No second control plane Service unless asked for.
    assert "ponto-control-external" not in objects(default, "Service")


def test_a_central_release_ignores_controlplane_address(helm: Path) -> None:
    docs = render(helm, "--set", f"controlPlane.address={ADDRESS}")
    proxy = container(one(docs, "Deployment", "ponto-proxy-us-east"))
    assert flags(proxy)["--control-plane"] == "ponto-control.ponto.svc:7000"


def test_a_central_release_still_needs_coordinates(helm: Path) -> None:
    message = refused(helm, "--set-json", 'proxy.regions=[{"name": "us-east"}]')
    assert "proxy.regions.0: lat is required" in message


def test_the_external_service_carries_the_grpc_port_alone(helm: Path) -> None:
    docs = render(
        helm,
        "--set",
        "controlPlane.externalService.enabled=true",
        "--set-json",
        'controlPlane.externalService.annotations={"lb.example/internal": "true"}',
        "--set-json",
        'controlPlane.externalService.loadBalancerSourceRanges=["10.20.0.0/16"]',
        "--set-json",
        'tls.extraDnsNames=["ponto-cp.llm.example.com"]',
    )
    svc = one(docs, "Service", "ponto-control-external")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["loadBalancerSourceRanges"] == ["10.20.0.0/16"]
    assert svc["metadata"]["annotations"] == {"lb.example/internal": "true"}
    # The status page (plain HTTP) stays off it.
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("grpc", 7000, "grpc")
    ]
    control = one(docs, "Deployment", "ponto-control")
    assert svc["spec"]["selector"] == control["spec"]["selector"]["matchLabels"]
    # The name the other clusters' proxies dial is in the generated certificate.
    cert = _certificate(one(docs, "Secret", "ponto-control-tls"))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ponto-cp.llm.example.com" in names.get_values_for_type(x509.DNSName)


def test_the_external_service_with_generated_certificates_needs_its_name(helm: Path) -> None:
    message = refused(helm, "--set", "controlPlane.externalService.enabled=true")
    assert "tls.extraDnsNames" in message
    # A given certificate's names are its owner's; without TLS there is none to check.
    for extra in (
        "tls.existingSecrets.controlPlane=cp,tls.existingSecrets.proxy=px,tls.existingSecrets.admin=adm",
        "tls.enabled=false",
    ):
        docs = render(helm, "--set", "controlPlane.externalService.enabled=true", "--set", extra)
        assert "ponto-control-external" in objects(docs, "Service")


def test_the_edge_values_file_parses(edge: list[Doc]) -> None:
    values = yaml.safe_load(EDGE_VALUES.read_text())
    assert values["controlPlane"] == {"enabled": False, "address": ADDRESS}


def test_central_notes_say_how_other_clusters_reach_the_control_plane(
    helm: Path, tmp_path: Path
) -> None:
    from tests.chartrun.__main__ import render as chartrun_render  # noqa: PLC0415

    values = {
        "controlPlane": {"externalService": {"enabled": True}},
        "tls": {"extraDnsNames": ["ponto-cp.llm.example.com"]},
    }
    notes = chartrun_render(str(helm), [Path(values_file(tmp_path, values))], upgrade=False).notes
    assert "kubectl -n ponto get svc ponto-control-external" in notes
    assert "one of tls.extraDnsNames (ponto-cp.llm.example.com)" in notes
    assert "Secret ponto-proxy-tls and the bootstrap-token of Secret ponto-tokens" in notes
    # Without it the notes say nothing of other clusters.
    assert "control-external" not in chartrun_render(str(helm), [], upgrade=False).notes
