"""The Helm chart (charts/ponto): what its schema refuses and what it renders.

The renders are parsed with PyYAML and checked object by object; the flags the
chart passes are parsed by the same argument parsers the binaries use, so a flag
renamed on one side fails here. `make helm-check` also lints the chart and
validates both renders against the Kubernetes 1.30 schemas.

Helm is the binary `make helm` installs (.cache/helm/helm). When it is missing the
session fetches it with the same script, so nothing here is ever skipped.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from controlplane import apply as topology_apply
from controlplane import cli as pontoctl
from controlplane import settings as control_settings
from controlplane.api.guard import peer_role
from dataplane import settings as proxy_settings
from ponto.geodb import write_city_db
from ponto.pki import make_bundle

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ponto"
THREE_REGIONS = CHART / "ci" / "three-regions-values.yaml"
HELM_DIR = ROOT / ".cache" / "helm"
KUBE_VERSION = "1.30.0"
REGIONS = ("us-east", "eu-west", "ap-southeast")

Doc = dict[str, Any]


def helm_binary() -> Path:
    """The binary `make helm` installs, fetched by the same script when missing."""
    binary = HELM_DIR / "helm"
    if not binary.is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "fetch_helm.py"), str(HELM_DIR)], check=True
        )
    return binary


@pytest.fixture(scope="session")
def helm() -> Path:
    return helm_binary()


def template(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart. The same arguments are rendered once a
    run, unless they name files (a test may write a values file again under
    its path): many tests render the defaults, or the same `--set`s, and each
    render is a process of about half a second, which CI's time could not
    spare. The chart does not change during a run."""
    if any(a in ("-f", "--values", "--set-file") or a.startswith("--values=") for a in args):
        return _template.__wrapped__(str(helm), args)
    return _template(str(helm), args)


@functools.cache
def _template(helm: str, args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            helm,
            "template",
            "ponto",
            str(CHART),
            "--namespace",
            "ponto",
            "--kube-version",
            KUBE_VERSION,
            *args,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def render(helm: Path, *args: str) -> list[Doc]:
    out = template(helm, *args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def refused(helm: Path, *args: str) -> str:
    """Render that must fail; returns Helm's message."""
    out = template(helm, *args)
    assert out.returncode != 0, "the render should have been refused"
    assert out.stdout == ""
    return out.stderr


def values_file(tmp_path: Path, values: Doc) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def objects(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = objects(docs, kind)
    assert name in found, f"no {kind} {name}; have {sorted(found)}"
    return found[name]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Doc) -> Doc:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    c: Doc = containers[0]
    return c


def flags(c: Doc) -> dict[str, str]:
    out = {}
    for arg in c["args"]:
        if arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            out[name] = value
    return out


def volume(workload: Doc, name: str) -> Doc:
    vols = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    assert name in vols, f"no volume {name}; have {sorted(vols)}"
    v: Doc = vols[name]
    return v


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def workloads(docs: list[Doc]) -> Iterator[Doc]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d


@pytest.fixture(scope="module")
def default(helm: Path) -> list[Doc]:
    return render(helm)


@pytest.fixture(scope="module")
def three(helm: Path) -> list[Doc]:
    return render(helm, "-f", str(THREE_REGIONS))


# ---------------------------------------------------------------- the schema


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"controlPlane": {"replicas": "two"}}, "controlPlane.replicas"),
        ({"tls": {"enabled": "yes"}}, "tls.enabled"),
        (
            {"proxy": {"regions": [{"name": "us-east", "lat": "38.9", "lon": -77.4}]}},
            "proxy.regions.0.lat",
        ),
        ({"etcd": {"replicas": 2}}, "etcd.replicas"),
        ({"alerts": {"errorRatio": {"threshold": 5}}}, "alerts.errorRatio.threshold"),
        ({"alerts": {"staleTable": {"for": "5 minutes"}}}, "alerts.staleTable.for"),
        ({"alerts": {"noLeader": {"severity": "page"}}}, "alerts.noLeader.severity"),
        ({"dashboards": {"labelValue": 1}}, "dashboards.labelValue"),
        ({"cache": {"redis": {"url": "http://redis:6379/0"}}}, "cache.redis.url"),
        ({"cache": {"redis": {"urls": {"us-east": "redis:6379"}}}}, "cache.redis.urls.us-east"),
        ({"cache": {"redis": {"maxmemory": "256Mi"}}}, "cache.redis.maxmemory"),
        ({"cache": {"redis": {"server": "memcached"}}}, "cache.redis.server"),
    ],
)
def test_schema_refuses_a_wrong_type(helm: Path, tmp_path: Path, values: Doc, where: str) -> None:
    message = refused(helm, "-f", values_file(tmp_path, values))
    assert "values don't meet the specifications of the schema" in message
    assert where in message


def test_schema_refuses_a_wrong_type_given_with_set(helm: Path) -> None:
    message = refused(helm, "--set-string", "controlPlane.replicas=2")
    assert "controlPlane.replicas: Invalid type. Expected: integer, given: string" in message


def test_schema_refuses_regions_set_to_null(helm: Path) -> None:
    # Helm deletes a key set to null: the schema, not a template, says so.
    message = refused(helm, "--set", "proxy.regions=null")
    assert "proxy: regions is required" in message


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"controlPlane": {"replicaz": 2}}, "replicaz"),
        ({"etcdd": {"enabled": True}}, "etcdd"),
        (
            {"proxy": {"regions": [{"name": "us-east", "lat": 1, "lon": 2, "zone": "a"}]}},
            "zone",
        ),
        # The topology takes pontoctl's own spelling; the values' camelCase is a typo there.
        (
            {
                "topology": {
                    "origins": [
                        {
                            "name": "o",
                            "region": "us-east",
                            "url": "http://o:8000/v1",
                            "models": ["m"],
                            "credentialEnv": "KEY",
                        }
                    ]
                }
            },
            "credentialEnv",
        ),
        ({"proxy": {"resources": {"requests": {"cpu": "1"}, "limit": {}}}}, "limit"),
        ({"alerts": {"originDown": {"after": "3m"}}}, "after"),
        ({"dashboards": {"folder": "Ponto"}}, "folder"),
        ({"cache": {"redis": {"password": "x"}}}, "password"),
        ({"cache": {"exact": {}}}, "exact"),
    ],
)
def test_schema_refuses_an_unknown_key(helm: Path, tmp_path: Path, values: Doc, key: str) -> None:
    message = refused(helm, "-f", values_file(tmp_path, values))
    assert f"Additional property {key} is not allowed" in message


def test_lint_is_strict_clean(helm: Path) -> None:
    for extra in ([], ["-f", str(THREE_REGIONS)]):
        out = subprocess.run(
            [str(helm), "lint", "--strict", str(CHART), *extra],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- proxies


def test_one_proxy_deployment_and_service_per_region(three: list[Doc]) -> None:
    deployments = {n for n in objects(three, "Deployment") if n.startswith("ponto-proxy-")}
    services = {n for n in objects(three, "Service") if n.startswith("ponto-proxy-")}
    assert deployments == {f"ponto-proxy-{r}" for r in REGIONS}
    assert services == deployments | {f"{d}-metrics" for d in deployments}
    for region in REGIONS:
        name = f"ponto-proxy-{region}"
        deployment = one(three, "Deployment", name)
        c = container(deployment)
        assert c["command"] == ["ponto-proxy"]
        f = flags(c)
        assert f["--region"] == region
        assert f["--name"] == "$(POD_NAME)"
        assert f["--control-plane"] == "ponto-control.ponto.svc:7000"
        assert f["--listen"] == "0.0.0.0:8080"
        assert f["--metrics-listen"] == "0.0.0.0:9090"
        assert f["--metrics-key-labels"] == "on"
        assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in c["ports"]
        assert f["--state-dir"] == "/var/lib/ponto"
        # Liveness past the client connection cap (trial 74), readiness under it.
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        pods = deployment["spec"]["template"]["metadata"]["labels"]
        assert pods["ponto.io/region"] == region
        assert matches(deployment["spec"]["selector"]["matchLabels"], pods)
        service = one(three, "Service", name)
        assert matches(service["spec"]["selector"], pods)
        assert service["spec"]["selector"]["ponto.io/region"] == region
        assert service["spec"]["ports"] == [
            {
                "name": "http",
                "port": 80,
                "targetPort": "http",
                "protocol": "TCP",
                "appProtocol": "http",
            }
        ]
        # GeoIP needs the client's address: a LoadBalancer must not SNAT it away.
        assert service["spec"]["type"] == "LoadBalancer"
        assert service["spec"]["externalTrafficPolicy"] == "Local"
        # /metrics (tenant names) only through a Service inside the cluster.
        scraped = one(three, "Service", f"{name}-metrics")
        assert scraped["spec"]["type"] == "ClusterIP"
        assert scraped["spec"]["selector"] == service["spec"]["selector"]
        assert [(p["name"], p["port"], p["targetPort"]) for p in scraped["spec"]["ports"]] == [
            ("metrics", 9090, "metrics")
        ]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == "9090"


def test_regions_take_their_own_settings(three: list[Doc]) -> None:
    use = one(three, "Deployment", "ponto-proxy-us-east")
    assert flags(container(use))["--advertise"] == "https://us-east.llm.example.com"
    assert pod_spec(use)["nodeSelector"] == {"topology.kubernetes.io/region": "us-east-1"}
    assert flags(container(use))["--trusted-proxies"] == "10.0.0.0/8"
    svc = one(three, "Service", "ponto-proxy-us-east")
    assert svc["metadata"]["annotations"] == {
        "service.beta.kubernetes.io/aws-load-balancer-type": "nlb"
    }

    euw = one(three, "Deployment", "ponto-proxy-eu-west")
    terms = pod_spec(euw)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["eu-west-1"]

    aps = one(three, "Deployment", "ponto-proxy-ap-southeast")
    assert pod_spec(aps)["tolerations"][0]["value"] == "edge"
    assert flags(container(aps))["--trusted-proxies"] == "172.16.0.0/12"
    assert flags(container(aps))["--advertise"] == "http://ponto-proxy-ap-southeast.ponto.svc:80"


def test_default_values_run_one_region_with_fixed_replicas(default: list[Doc]) -> None:
    proxies = {n: d for n, d in objects(default, "Deployment").items() if "proxy" in n}
    assert list(proxies) == ["ponto-proxy-us-east"]
    assert proxies["ponto-proxy-us-east"]["spec"]["replicas"] == 2
    assert one(default, "Service", "ponto-proxy-us-east")["spec"]["type"] == "ClusterIP"


def test_origin_credentials_come_from_secrets(three: list[Doc]) -> None:
    env = {e["name"]: e for e in container(one(three, "Deployment", "ponto-proxy-eu-west"))["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["ORIGIN_USE1_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "origin-keys",
        "key": "use1",
    }
    assert "value" not in env["ORIGIN_EUW1_KEY"]


def test_hpa_only_when_enabled(default: list[Doc], three: list[Doc]) -> None:
    assert objects(default, "HorizontalPodAutoscaler") == {}
    hpas = objects(three, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"ponto-proxy-{r}" for r in REGIONS}
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
        }
        target = hpa["spec"]["metrics"][0]["resource"]
        # 65 % of the CPU the default two workers (limit "2") can use.
        assert target == {
            "name": "cpu",
            "target": {"type": "AverageValue", "averageValue": "1300m"},
        }
        # The HPA owns the replica count; the Deployment must not fight it.
        assert "replicas" not in one(three, "Deployment", name)["spec"]
    assert (
        hpas["ponto-proxy-us-east"]["spec"]["minReplicas"],
        hpas["ponto-proxy-us-east"]["spec"]["maxReplicas"],
    ) == (3, 12)
    assert (
        hpas["ponto-proxy-eu-west"]["spec"]["minReplicas"],
        hpas["ponto-proxy-eu-west"]["spec"]["maxReplicas"],
    ) == (2, 8)


@pytest.mark.parametrize(
    ("monitor_name", "port", "services"),
    [
        ("ponto-proxy", "metrics", [f"ponto-proxy-{r}-metrics" for r in REGIONS]),
        # The control plane's status page and /metrics (--http-listen).
        ("ponto-control", "http", ["ponto-control"]),
    ],
)
def test_service_monitors_only_when_enabled(
    default: list[Doc], three: list[Doc], monitor_name: str, port: str, services: list[str]
) -> None:
    assert objects(default, "ServiceMonitor") == {}
    monitor = one(three, "ServiceMonitor", monitor_name)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == (port, "/metrics")
    # The proxies' `endpoint` label must not become `exported_endpoint`: the
    # alerts and dashboards select proxied requests by it.
    assert endpoint.get("honorLabels", False) == (monitor_name == "ponto-proxy")
    selected = {
        n: s
        for n, s in objects(three, "Service").items()
        if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    }
    assert sorted(selected) == sorted(services)
    for name, service in selected.items():
        assert port in [p["name"] for p in service["spec"]["ports"]], name


def test_metrics_port_and_key_labels_are_values(helm: Path) -> None:
    docs = render(
        helm, "--set", "proxy.metrics.port=9100", "--set", "proxy.metrics.keyLabels=false"
    )
    deployment = next(d for n, d in objects(docs, "Deployment").items() if "proxy" in n)
    f = flags(container(deployment))
    assert (f["--metrics-listen"], f["--metrics-key-labels"]) == ("0.0.0.0:9100", "off")
    assert "proxy.metrics.port" in refused(helm, "--set", "proxy.metrics.port=8080")


def test_the_access_log_is_on_unless_turned_off(helm: Path, default: list[Doc]) -> None:
    def access_log(docs: list[Doc]) -> str:
        deployment = next(d for n, d in objects(docs, "Deployment").items() if "proxy" in n)
        return flags(container(deployment))["--access-log"]

    assert access_log(default) == "on"
    assert access_log(render(helm, "--set-string", "proxy.accessLog=off")) == "off"
    assert "accessLog" in refused(helm, "--set-string", "proxy.accessLog=yes")


def test_geoip_database_is_a_mounted_volume(default: list[Doc], three: list[Doc]) -> None:
    for region in REGIONS:
        deployment = one(three, "Deployment", f"ponto-proxy-{region}")
        assert volume(deployment, "geoip")["persistentVolumeClaim"] == {
            "claimName": "geoip",
            "readOnly": True,
        }
        c = container(deployment)
        mount = next(m for m in c["volumeMounts"] if m["name"] == "geoip")
        assert (mount["mountPath"], mount["readOnly"]) == ("/geoip", True)
        assert flags(c)["--geoip-db"] == "/geoip/dbip-city-lite.mmdb"
    plain = one(default, "Deployment", "ponto-proxy-us-east")
    assert "--geoip-db" not in flags(container(plain))
    assert all(v["name"] != "geoip" for v in pod_spec(plain)["volumes"])


def test_geoip_without_a_volume_is_refused(helm: Path) -> None:
    assert "geoip.volume" in refused(helm, "--set", "geoip.enabled=true")


def test_an_origin_ca_is_mounted_and_trusted_by_proxies_and_control_plane(
    helm: Path, default: list[Doc], tmp_path: Path
) -> None:
    pem = make_bundle(tmp_path).ca
    bundle = Path(pem).read_text()
    docs = render(helm, "-f", values_file(tmp_path, {"originCA": {"bundle": bundle}}))
    configmap = one(docs, "ConfigMap", "ponto-origin-ca")
    assert configmap["data"]["ca.crt"].strip() == bundle.strip()
    workloads = [
        one(docs, "Deployment", "ponto-proxy-us-east"),
        one(docs, "Deployment", "ponto-control"),
    ]
    for workload in workloads:
        c = container(workload)
        assert flags(c)["--origin-ca"] == "/etc/ponto/origin-ca/ca.crt"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "origin-ca")
        assert (mount["mountPath"], mount["readOnly"]) == ("/etc/ponto/origin-ca", True)
        assert volume(workload, "origin-ca")["configMap"]["name"] == "ponto-origin-ca"
    # An existing ConfigMap instead: mounted, none rendered.
    theirs = render(helm, "--set", "originCA.configMap=mesh-ca")
    assert "ponto-origin-ca" not in objects(theirs, "ConfigMap")
    assert (
        volume(one(theirs, "Deployment", "ponto-control"), "origin-ca")["configMap"]["name"]
        == "mesh-ca"
    )
    # Neither: nothing of it.
    for workload in (
        one(default, "Deployment", "ponto-proxy-us-east"),
        one(default, "Deployment", "ponto-control"),
    ):
        assert "--origin-ca" not in flags(container(workload))
        assert all(v["name"] != "origin-ca" for v in pod_spec(workload)["volumes"])


def test_a_new_origin_ca_bundle_rolls_the_pods_that_read_it(helm: Path, tmp_path: Path) -> None:
    # Both read the bundle once, at start: a rotated CA (a new bundle in the
    # same ConfigMap) must restart them, or they keep refusing the origins
    # the new CA signed until something else restarts them.
    fixed = [
        "--set",
        "auth.existingSecret=tokens",
        "--set",
        "tls.existingSecrets.controlPlane=cp,tls.existingSecrets.proxy=px,"
        "tls.existingSecrets.admin=adm",
    ]

    def sums(bundle: str) -> list[str]:
        docs = render(helm, *fixed, "-f", values_file(tmp_path, {"originCA": {"bundle": bundle}}))
        return [
            one(docs, "Deployment", name)["spec"]["template"]["metadata"]["annotations"][
                "checksum/secrets"
            ]
            for name in ("ponto-proxy-us-east", "ponto-control")
        ]

    old = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    new = "-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n"
    assert sums(old) == sums(old)  # the render is stable: only the bundle differs
    assert all(a != b for a, b in zip(sums(old), sums(new), strict=True))


def test_an_origin_ca_given_twice_or_not_pem_is_refused(helm: Path) -> None:
    both = (
        "--set",
        "originCA.configMap=x",
        "--set-string",
        "originCA.bundle=-----BEGIN CERTIFICATE-----",
    )
    assert "bundle or configMap, not both" in refused(helm, *both)
    assert "originCA" in refused(helm, "--set", "originCA.bundle=hello")


# ---------------------------------------------------------------- control plane


def test_control_plane_replicas_pdb_and_anti_affinity(three: list[Doc]) -> None:
    deployment = one(three, "Deployment", "ponto-control")
    assert deployment["spec"]["replicas"] == 2
    c = container(deployment)
    assert c["command"] == ["ponto-control"]
    f = flags(c)
    assert f["--listen"] == "0.0.0.0:7000"
    assert f["--id"] == "$(POD_NAME)"
    assert f["--etcd"] == "ponto-etcd.ponto.svc:2379"
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(three, "PodDisruptionBudget", "ponto-control")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert matches(pdb["spec"]["selector"]["matchLabels"], pods)
    anti = pod_spec(deployment)["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert matches(term["labelSelector"]["matchLabels"], pods)
    service = one(three, "Service", "ponto-control")
    assert service["spec"]["ports"][0]["port"] == 7000
    assert matches(service["spec"]["selector"], pods)


def test_hard_anti_affinity(helm: Path) -> None:
    docs = render(helm, "--set", "controlPlane.antiAffinity=hard")
    anti = pod_spec(one(docs, "Deployment", "ponto-control"))["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    )


def test_control_plane_grpc_probes(helm: Path, default: list[Doc]) -> None:
    # The kubelet's native gRPC probes, with or without TLS: they use the
    # plaintext health-only port, since they cannot present a client certificate.
    for docs in (default, render(helm, "--set", "tls.enabled=false")):
        c = container(one(docs, "Deployment", "ponto-control"))
        # Liveness must not ask the readiness service: a replica that cannot read
        # etcd is alive (and restarting it would not help).
        assert c["livenessProbe"]["grpc"] == {"port": 7001, "service": "liveness"}
        assert c["readinessProbe"]["grpc"] == {"port": 7001}
        assert "--health-listen=0.0.0.0:7001" in c["args"]
        assert {"name": "health", "containerPort": 7001, "protocol": "TCP"} in c["ports"]


def test_control_plane_serves_its_status_page_on_the_http_port(
    helm: Path, default: list[Doc]
) -> None:
    c = container(one(default, "Deployment", "ponto-control"))
    assert "--http-listen=0.0.0.0:8080" in c["args"]
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    ports = one(default, "Service", "ponto-control")["spec"]["ports"]
    assert {"name": "http", "port": 8080, "targetPort": "http"}.items() <= next(
        p for p in ports if p["name"] == "http"
    ).items()
    # Changes from the page are off unless asked for (plain HTTP, no admin certificate).
    assert "--http-writes=off" in c["args"]
    on = render(helm, "--set", "controlPlane.statusPage.writes=true")
    assert "--http-writes=on" in container(one(on, "Deployment", "ponto-control"))["args"]
    moved = render(helm, "--set", "controlPlane.service.httpPort=9090")
    ports = one(moved, "Service", "ponto-control")["spec"]["ports"]
    assert [p["port"] for p in ports if p["name"] == "http"] == [9090]


# ---------------------------------------------------------------- etcd


def test_etcd_statefulset_with_three_members_and_volumes(three: list[Doc]) -> None:
    sts = one(three, "StatefulSet", "ponto-etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == "ponto-etcd-peer"
    c = container(sts)
    assert c["image"].startswith("gcr.io/etcd-development/etcd:v3.5.")
    f = flags(c)
    assert f["--initial-cluster"].split(",") == [
        f"ponto-etcd-{i}=http://ponto-etcd-{i}.ponto-etcd-peer.ponto.svc:2380" for i in range(3)
    ]
    assert f["--data-dir"].startswith("/var/lib/etcd/")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert {"name": "data", "mountPath": "/var/lib/etcd"} in c["volumeMounts"]
    peers = one(three, "Service", "ponto-etcd-peer")
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    pods = sts["spec"]["template"]["metadata"]["labels"]
    assert matches(one(three, "Service", "ponto-etcd")["spec"]["selector"], pods)
    assert matches(
        one(three, "PodDisruptionBudget", "ponto-etcd")["spec"]["selector"]["matchLabels"], pods
    )
    policy = one(three, "NetworkPolicy", "ponto-etcd")
    clients = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    control_pods = one(three, "Deployment", "ponto-control")["spec"]["template"]["metadata"]
    assert matches(clients, control_pods["labels"])


def test_external_etcd(helm: Path) -> None:
    docs = render(
        helm,
        "--set",
        "etcd.enabled=false",
        "--set",
        "etcd.external.endpoints={etcd-a.db:2379,etcd-b.db:2379}",
    )
    assert objects(docs, "StatefulSet") == {}
    f = flags(container(one(docs, "Deployment", "ponto-control")))
    assert f["--etcd"] == "etcd-a.db:2379,etcd-b.db:2379"
    assert "--etcd-ca" not in f
    assert "etcd.external.endpoints" in refused(helm, "--set", "etcd.enabled=false")


EXTERNAL_TLS = (
    "--set", "etcd.enabled=false",
    "--set", "etcd.external.endpoints={https://etcd-a.db:2379,https://etcd-b.db:2379}",
    "--set", "etcd.external.tls.secretName=etcd-client",
)  # fmt: skip


def test_external_etcd_over_tls(helm: Path, tmp_path: Path) -> None:
    docs = render(helm, *EXTERNAL_TLS, "--set", "etcd.external.tls.clientCertificate=true")
    control = one(docs, "Deployment", "ponto-control")
    assert volume(control, "etcd-tls")["secret"]["secretName"] == "etcd-client"
    mounts = {m["name"]: m for m in container(control)["volumeMounts"]}
    assert mounts["etcd-tls"]["mountPath"] == "/etc/ponto/etcd-tls"
    # The user's Secret, as Kubernetes would mount it, read by the real parser.
    bundle = make_bundle(tmp_path / "pki")
    mounted = tmp_path / "etc" / "ponto" / "etcd-tls"
    mounted.mkdir(parents=True)
    for name, source in (("ca.crt", "ca.crt"), ("tls.crt", "admin.crt"), ("tls.key", "admin.key")):
        (mounted / name).write_bytes((bundle.directory / source).read_bytes())
    settings = control_settings.parse(_materialise(docs, tmp_path, control))
    assert settings.etcd == ("https://etcd-a.db:2379", "https://etcd-b.db:2379")
    assert settings.etcd_tls is not None
    assert settings.etcd_tls.ca_cert == (bundle.directory / "ca.crt").read_bytes()
    assert settings.etcd_tls.cert_chain == (bundle.directory / "admin.crt").read_bytes()
    # Without a client certificate only the CA is passed.
    f = flags(container(one(render(helm, *EXTERNAL_TLS), "Deployment", "ponto-control")))
    assert f["--etcd-ca"] == "/etc/ponto/etcd-tls/ca.crt"
    assert "--etcd-cert" not in f and "--etcd-key" not in f


def test_external_etcd_at_ipv6_literals_reaches_the_control_plane(
    helm: Path, tmp_path: Path
) -> None:
    endpoints = "https://[fd00::1]:2379,https://[::ffff:10.0.0.2]:2379,https://10.0.0.3:2379"
    docs = render(helm, *EXTERNAL_TLS, "--set", f"etcd.external.endpoints={{{endpoints}}}")
    control = one(docs, "Deployment", "ponto-control")
    assert flags(container(control))["--etcd"] == endpoints
    # The rendered flags, read by the real parser: it accepts them.
    (tmp_path / "etc" / "ponto" / "etcd-tls").mkdir(parents=True)
    # A CA: the control plane checks its etcd files at start (trial 23).
    ca = Path(make_bundle(tmp_path / "pki").ca).read_bytes()
    (tmp_path / "etc" / "ponto" / "etcd-tls" / "ca.crt").write_bytes(ca)
    settings = control_settings.parse(_materialise(docs, tmp_path, control))
    assert settings.etcd == tuple(endpoints.split(","))


def test_external_etcd_schemes_must_agree_with_tls(helm: Path) -> None:
    plain = refused(helm, *EXTERNAL_TLS[:2], "--set", "etcd.external.endpoints={https://e:2379}")
    assert "needs etcd.external.tls.secretName" in plain
    mixed = refused(helm, *EXTERNAL_TLS, "--set", "etcd.external.endpoints={http://e:2379}")
    assert "write https://e:2379" in mixed
    # IPv6 addresses only in brackets (the last group would read as the port),
    # without a zone, and brackets only around them.
    for bad in ("https://e", "https://e:99999", "https://e:0", "https://fd00::1:2379",
                "https://[fd00::1]", "https://[fe80::1%eth0]:2379", "https://[10.0.0.1]:2379",
                "https://[etcd]:2379", "https://[1:2:3:4:5:6:7:8:9]:2379"):  # fmt: skip
        assert "Does not match pattern" in refused(
            helm, *EXTERNAL_TLS, "--set", f"etcd.external.endpoints={{{bad}}}"
        )
    # The bundled etcd is plaintext behind its NetworkPolicy: TLS settings for it
    # are a mistake, not something to ignore.
    bundled = refused(helm, "--set", "etcd.external.tls.secretName=etcd-client")
    assert "etcd.external.tls is for an etcd outside the release" in bundled
    no_secret = refused(
        helm, *EXTERNAL_TLS[:4], "--set", "etcd.external.tls.clientCertificate=true"
    )
    assert "clientCertificate needs etcd.external.tls.secretName" in no_secret
    # Values that drop the whole block render as plaintext, not a template error.
    dropped = render(helm, *EXTERNAL_TLS[:2], "--set", "etcd.external.endpoints={e:2379}",
                   "--set", "etcd.external.tls=null")  # fmt: skip
    assert "--etcd-ca" not in flags(container(one(dropped, "Deployment", "ponto-control")))


# ---------------------------------------------------------------- the regional cache


def redis_flag(docs: list[Doc], region: str) -> str | None:
    """The region's proxies' --redis, or None without one (per-pod caches)."""
    return flags(container(one(docs, "Deployment", f"ponto-proxy-{region}"))).get("--redis")


def redis_objects(docs: list[Doc]) -> set[str]:
    return {
        f"{d['kind']}/{d['metadata']['name']}"
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "redis"
    }


def test_each_region_runs_a_redis_that_only_its_proxies_reach(three: list[Doc]) -> None:
    for region in REGIONS:
        name = f"ponto-redis-{region}"
        deployment = one(three, "Deployment", name)
        assert deployment["spec"]["replicas"] == 1
        c = container(deployment)
        assert (c["image"], c["command"]) == ("valkey/valkey:8.1", ["valkey-server"])
        assert dict(zip(c["args"][::2], c["args"][1::2], strict=True)) == {
            "--port": "6379",
            "--protected-mode": "no",
            "--save": "",
            "--appendonly": "no",
            "--dir": "/data",
            "--maxmemory": "64mb",
            "--maxmemory-policy": "allkeys-lru",
        }
        assert c["readinessProbe"]["tcpSocket"]["port"] == "redis"
        pods = deployment["spec"]["template"]["metadata"]["labels"]
        service = one(three, "Service", name)
        assert matches(service["spec"]["selector"], pods)
        assert service["spec"]["ports"][0]["port"] == 6379
        assert redis_flag(three, region) == f"redis://{name}.ponto.svc:6379/0"
        policy = one(three, "NetworkPolicy", name)
        assert matches(policy["spec"]["podSelector"]["matchLabels"], pods)
        clients = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        proxy = one(three, "Deployment", f"ponto-proxy-{region}")
        for other in REGIONS:
            if other != region:
                other_redis = one(three, "Deployment", f"ponto-redis-{other}")
                assert not matches(
                    service["spec"]["selector"],
                    other_redis["spec"]["template"]["metadata"]["labels"],
                )
            labels = one(three, "Deployment", f"ponto-proxy-{other}")["spec"]["template"]
            assert matches(clients, labels["metadata"]["labels"]) == (other == region)
        # In its region, as the region's proxies are.
        for key in ("nodeSelector", "tolerations"):
            assert pod_spec(deployment).get(key) == pod_spec(proxy).get(key), (region, key)
    eu_west = pod_spec(one(three, "Deployment", "ponto-proxy-eu-west"))["affinity"]
    assert pod_spec(one(three, "Deployment", "ponto-redis-eu-west"))["affinity"] == eu_west


def test_the_default_values_share_a_redis_among_the_region_s_proxies(default: list[Doc]) -> None:
    assert redis_objects(default) == {
        "Deployment/ponto-redis-us-east",
        "Service/ponto-redis-us-east",
        "NetworkPolicy/ponto-redis-us-east",
        "ServiceAccount/ponto-redis",
    }
    assert redis_flag(default, "us-east") == "redis://ponto-redis-us-east.ponto.svc:6379/0"
    assert one(default, "Deployment", "ponto-proxy-us-east")["spec"]["replicas"] == 2


def test_an_external_store_replaces_the_deployed_ones(helm: Path) -> None:
    url = "rediss://cache.example.net:6380/2"
    docs = render(helm, "-f", str(THREE_REGIONS), "--set", f"cache.redis.url={url}")
    assert redis_objects(docs) == set()
    assert {redis_flag(docs, r) for r in REGIONS} == {url}


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pa#ss@cache.example.net:6379/0",  # a '#' in the password
        "redis://cache.example.net:6379/0?client_name=ponto:",  # ':' at the end: a YAML key
    ],
)
def test_a_url_reaches_the_proxies_whole_whatever_its_characters(
    helm: Path, tmp_path: Path, url: str
) -> None:
    values = values_file(tmp_path, {"cache": {"redis": {"url": url, "urls": {"eu-west": url}}}})
    docs = render(helm, "-f", str(THREE_REGIONS), "-f", values)
    assert {redis_flag(docs, r) for r in REGIONS} == {url}


def test_a_region_s_own_url_wins_and_the_others_get_a_deployed_one(
    helm: Path, tmp_path: Path
) -> None:
    own = "redis://valkey.eu-west.example.net:6379/0"
    values = values_file(tmp_path, {"cache": {"redis": {"urls": {"eu-west": own}}}})
    docs = render(helm, "-f", str(THREE_REGIONS), "-f", values)
    assert redis_flag(docs, "eu-west") == own
    assert "Deployment/ponto-redis-eu-west" not in redis_objects(docs)
    assert redis_flag(docs, "us-east") == "redis://ponto-redis-us-east.ponto.svc:6379/0"
    assert "Deployment/ponto-redis-us-east" in redis_objects(docs)


def test_deploy_off_without_a_url_leaves_per_pod_caches(helm: Path) -> None:
    docs = render(helm, "-f", str(THREE_REGIONS), "--set", "cache.redis.deploy=false")
    assert redis_objects(docs) == set()
    assert {redis_flag(docs, r) for r in REGIONS} == {None}


def test_a_url_with_a_password_comes_from_a_secret(helm: Path) -> None:
    docs = render(
        helm,
        "--set",
        "cache.redis.urlSecret.name=ponto-redis",
        "--set",
        "cache.redis.urlSecret.key=url",
    )
    assert redis_objects(docs) == set()
    c = container(one(docs, "Deployment", "ponto-proxy-us-east"))
    assert flags(c)["--redis"] == "$(PONTO_REDIS_URL)"
    env = {e["name"]: e for e in c["env"]}
    assert env["PONTO_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "ponto-redis",
        "key": "url",
    }


def test_a_password_secret_is_a_file_the_proxy_reads(helm: Path, tmp_path: Path) -> None:
    """cache.redis.passwordSecret: the password mounted from its Secret and
    given as --redis-password-file, out of the pod spec and the command line."""
    values = values_file(
        tmp_path,
        {
            "cache": {
                "redis": {
                    "url": "redis://proxy@cache.example.net:6379/0",
                    "passwordSecret": {"name": "ponto-redis", "key": "pw"},
                }
            }
        },
    )
    docs = render(helm, "-f", values)
    deployment = one(docs, "Deployment", "ponto-proxy-us-east")
    c = container(deployment)
    assert flags(c)["--redis-password-file"] == "/etc/ponto/redis/password"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["redis-password"] == {
        "name": "redis-password",
        "mountPath": "/etc/ponto/redis",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    assert volumes["redis-password"]["secret"] == {
        "secretName": "ponto-redis",
        "defaultMode": 0o440,
        "items": [{"key": "pw", "path": "password"}],
    }
    # The proxy takes the rendered flags with the file in place.
    (tmp_path / "etc" / "ponto" / "redis").mkdir(parents=True)
    (tmp_path / "etc" / "ponto" / "redis" / "password").write_text("s3cret\n")
    args = _materialise(docs, tmp_path, deployment)
    args = [a for a in args if not a.startswith("--geoip-db")]
    proxy = proxy_settings.parse(args)
    assert proxy.redis_password == "s3cret"
    assert proxy.redis_url == "redis://proxy@cache.example.net:6379/0"


def test_no_password_file_without_a_password_secret(helm: Path) -> None:
    c = container(one(render(helm), "Deployment", "ponto-proxy-us-east"))
    assert "--redis-password-file" not in flags(c)
    assert "redis-password" not in {m["name"] for m in c["volumeMounts"]}


def test_a_password_secret_for_the_chart_s_own_redis_is_refused(helm: Path) -> None:
    message = refused(helm, "--set", "cache.redis.passwordSecret.name=ponto-redis")
    assert "uses the chart's own Redis" in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw@cache.example.net:6379/0",
        # redis-py reads a password= option too (and it would win over the file's).
        "redis://cache.example.net:6379/0?password=pw",
        "redis://cache.example.net:6379/0?db=0&Password=pw",
    ],
)
def test_a_password_secret_and_a_password_in_the_url_are_refused(helm: Path, url: str) -> None:
    message = refused(
        helm,
        "--set",
        f"cache.redis.url={url}",
        "--set",
        "cache.redis.passwordSecret.name=ponto-redis",
    )
    assert "holds a password too" in message


def test_a_url_for_a_region_without_proxies_is_refused(helm: Path, tmp_path: Path) -> None:
    values = values_file(tmp_path, {"cache": {"redis": {"urls": {"mars": "redis://r:6379/0"}}}})
    assert 'cache.redis.urls names region "mars"' in refused(helm, "-f", values)


def test_redis_server_runs_with_the_rendered_args(three: list[Doc], tmp_path: Path) -> None:
    """Debian's redis-server (what chart-run runs for the image) takes the rendered
    arguments and applies them."""
    import redis  # noqa: PLC0415

    from ponto.devenv import find_redis, free_port, wait_for_port  # noqa: PLC0415
    from tests.conftest import redis_binary_or_skip  # noqa: PLC0415

    redis_binary_or_skip()
    args = container(one(three, "Deployment", "ponto-redis-us-east"))["args"]
    port = free_port()
    args = [str(port) if a == "6379" else str(tmp_path) if a == "/data" else a for a in args]
    proc = subprocess.Popen(
        [str(find_redis()), *args, "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port, 20, proc)
        client = redis.Redis(port=port)
        try:
            config = client.config_get("*")
        finally:
            client.close()
    finally:
        proc.terminate()
        proc.wait(10)
    assert config["maxmemory"] == str(64 * 2**20)
    assert config["maxmemory-policy"] == "allkeys-lru"
    assert (config["save"], config["appendonly"], config["protected-mode"]) == ("", "no", "no")


# ---------------------------------------------------------------- secrets and accounts


def _certificate(secret: Doc, key: str = "tls.crt") -> x509.Certificate:
    return x509.load_pem_x509_certificate(base64.b64decode(secret["data"][key]))


def test_generated_secrets(three: list[Doc]) -> None:
    secrets = objects(three, "Secret")
    assert set(secrets) == {
        "ponto-tokens",
        "ponto-ca",
        "ponto-control-tls",
        "ponto-proxy-tls",
        "ponto-admin-tls",
    }
    tokens = {k: base64.b64decode(v).decode() for k, v in secrets["ponto-tokens"]["data"].items()}
    assert set(tokens) == {"admin-token", "bootstrap-token"}
    assert all(len(t) == 48 and t.isalnum() for t in tokens.values())
    assert tokens["admin-token"] != tokens["bootstrap-token"]

    ca = _certificate(secrets["ponto-ca"])
    for name in ("ponto-control-tls", "ponto-proxy-tls", "ponto-admin-tls"):
        secret = secrets[name]
        assert secret["type"] == "kubernetes.io/tls"
        assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
        assert _certificate(secret, "ca.crt") == ca
        leaf = _certificate(secret)
        leaf.verify_directly_issued_by(ca)
        usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
    server = _certificate(secrets["ponto-control-tls"])
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"ponto-control.ponto.svc", "localhost"} <= set(names.get_values_for_type(x509.DNSName))


def _stated_role(cert: x509.Certificate) -> str | None:
    """The role the control plane reads from `cert`, as grpc would show it."""
    context: dict[str, list[bytes]] = {
        "x509_common_name": [
            str(a.value).encode() for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        ]
    }
    with contextlib.suppress(x509.ExtensionNotFound):
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        context["x509_subject_alternative_name"] = [str(n.value).encode() for n in alt]
    return peer_role(context)


def test_generated_client_certificates_state_their_role(three: list[Doc]) -> None:
    secrets = objects(three, "Secret")
    assert _stated_role(_certificate(secrets["ponto-proxy-tls"])) == "proxy"
    assert _stated_role(_certificate(secrets["ponto-admin-tls"])) == "admin"
    # pontoctl run in the control plane pod (NOTES.txt) presents this one.
    assert _stated_role(_certificate(secrets["ponto-control-tls"])) == "admin"


def test_each_pod_mounts_only_its_own_credentials(three: list[Doc]) -> None:
    control = one(three, "Deployment", "ponto-control")
    assert volume(control, "tls")["secret"]["secretName"] == "ponto-control-tls"
    assert [i["key"] for i in volume(control, "tokens")["secret"]["items"]] == [
        "admin-token",
        "bootstrap-token",
    ]
    for region in REGIONS:
        proxy = one(three, "Deployment", f"ponto-proxy-{region}")
        assert volume(proxy, "tls")["secret"]["secretName"] == "ponto-proxy-tls"
        assert [i["key"] for i in volume(proxy, "tokens")["secret"]["items"]] == ["bootstrap-token"]
    job = one(three, "Job", "ponto-topology")
    assert volume(job, "tls")["secret"]["secretName"] == "ponto-admin-tls"
    assert [i["key"] for i in volume(job, "tokens")["secret"]["items"]] == ["admin-token"]


def test_secret_checksums_roll_pods_on_new_material(three: list[Doc]) -> None:
    sums = {
        one(three, "Deployment", f"ponto-proxy-{r}")["spec"]["template"]["metadata"]["annotations"][
            "checksum/secrets"
        ]
        for r in REGIONS
    }
    assert len(sums) == 1
    control = one(three, "Deployment", "ponto-control")["spec"]["template"]["metadata"]
    assert control["annotations"]["checksum/secrets"] not in sums


def test_given_credentials_are_used(helm: Path) -> None:
    docs = render(
        helm,
        "--set",
        "auth.existingSecret=my-tokens",
        "--set",
        "tls.existingSecrets.controlPlane=cp-cert,tls.existingSecrets.proxy=px-cert",
        "--set",
        "tls.existingSecrets.admin=adm-cert",
    )
    assert objects(docs, "Secret") == {}
    assert volume(one(docs, "Deployment", "ponto-control"), "tls")["secret"]["secretName"] == (
        "cp-cert"
    )
    proxy = one(docs, "Deployment", "ponto-proxy-us-east")
    assert volume(proxy, "tls")["secret"]["secretName"] == "px-cert"
    assert volume(proxy, "tokens")["secret"]["secretName"] == "my-tokens"
    assert volume(one(docs, "Job", "ponto-topology"), "tls")["secret"]["secretName"] == "adm-cert"

    given = render(helm, "--set", "auth.adminToken=admin-secret-value")
    data = one(given, "Secret", "ponto-tokens")["data"]
    assert base64.b64decode(data["admin-token"]) == b"admin-secret-value"

    message = refused(helm, "--set", "tls.existingSecrets.proxy=px-cert")
    assert "give all of controlPlane, proxy and admin" in message


def test_least_privilege_service_accounts(three: list[Doc]) -> None:
    accounts = objects(three, "ServiceAccount")
    assert set(accounts) == {
        "ponto-control",
        "ponto-proxy",
        "ponto-etcd",
        "ponto-topology",
        "ponto-redis",
    }
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())
    assert not [d for d in three if d["kind"] in ("Role", "ClusterRole", "RoleBinding")]
    for w in workloads(three):
        spec = pod_spec(w)
        assert spec["serviceAccountName"] in accounts
        assert spec["automountServiceAccountToken"] is False
    assert pod_spec(one(three, "Deployment", "ponto-control"))["serviceAccountName"] == (
        "ponto-control"
    )


def test_every_container_has_requests_limits_and_a_locked_down_context(three: list[Doc]) -> None:
    seen = 0
    for w in workloads(three):
        spec = pod_spec(w)
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            seen += 1
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), (w["metadata"]["name"], part)
            ctx = c["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"]["drop"] == ["ALL"]
    assert seen == 9  # control plane, etcd, three proxies, three Redis, the topology job


# ---------------------------------------------------------------- topology


def test_topology_is_what_pontoctl_apply_accepts(three: list[Doc]) -> None:
    text = one(three, "ConfigMap", "ponto-topology")["data"]["topology.yaml"]
    desired = topology_apply.parse(yaml.safe_load(text))
    regions, origins, tenants = desired.regions, desired.origins, desired.tenants
    by_name = {r.name: r for r in regions}
    assert list(by_name) == [*REGIONS, "us-west"]
    assert (by_name["us-east"].latitude, by_name["us-east"].longitude) == (38.9, -77.4)
    assert dict(by_name["us-east"].rtt_ms) == {"eu-west": 75.0, "ap-southeast": 215.0}
    assert by_name["us-east"].spill_threshold == pytest.approx(0.8)
    assert by_name["ap-southeast"].drained is True
    assert by_name["eu-west"].drained is False
    assert [o.name for o in origins] == ["vllm-use1", "vllm-euw1", "tgi-usw2"]
    assert origins[0].credential_env == "ORIGIN_USE1_KEY"
    assert [t.name for t in tenants] == ["acme", "globex"]


def test_topology_leaves_out_empty_sections(default: list[Doc]) -> None:
    doc = yaml.safe_load(one(default, "ConfigMap", "ponto-topology")["data"]["topology.yaml"])
    assert doc == {"regions": [{"name": "us-east", "lat": 38.9, "lon": -77.4}]}


def test_with_prune_the_topology_lists_every_kind(helm: Path) -> None:
    """--prune deletes only from the kinds a document lists (trial 52): with
    topology.prune, values without origins or tenants mean none of them."""
    docs = render(helm, "--set", "topology.prune=true")
    doc = yaml.safe_load(one(docs, "ConfigMap", "ponto-topology")["data"]["topology.yaml"])
    assert doc == {
        "regions": [{"name": "us-east", "lat": 38.9, "lon": -77.4}],
        "origins": [],
        "tenants": [],
    }
    assert topology_apply.parse(doc).listed == {"region", "origin", "tenant"}


def test_topology_job_is_a_hook_with_the_admin_credential(three: list[Doc]) -> None:
    job = one(three, "Job", "ponto-topology")
    notes = job["metadata"]["annotations"]
    assert notes["helm.sh/hook"] == "post-install,post-upgrade"
    c = container(job)
    assert c["command"] == ["pontoctl"]
    args = pontoctl._parser().parse_args(c["args"])
    assert args.command == "apply"
    assert args.file == "/etc/ponto/topology/topology.yaml"
    assert args.control_plane == ("ponto-control.ponto.svc:7000",)
    assert args.admin_token_file == "/etc/ponto/tokens/admin-token"
    assert (args.tls_ca, args.tls_cert) == ("/etc/ponto/tls/ca.crt", "/etc/ponto/tls/tls.crt")
    assert args.prune is False
    assert volume(job, "topology")["configMap"]["name"] == "ponto-topology"


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        (
            {"topology": {"extraRegions": [{"name": "us-east", "lat": 1, "lon": 1}]}},
            'region "us-east" is listed twice',
        ),
        (
            {
                "topology": {
                    "origins": [
                        {"name": "o", "region": "mars", "url": "http://o/v1", "models": ["m"]}
                    ]
                }
            },
            'origin "o" is in region "mars"',
        ),
    ],
)
def test_inconsistent_topology_is_refused(
    helm: Path, tmp_path: Path, values: Doc, reason: str
) -> None:
    assert reason in refused(helm, "-f", values_file(tmp_path, values))


# ---------------------------------------------------------------- the binaries accept the flags


def _materialise(docs: list[Doc], root: Path, workload: Doc) -> list[str]:
    """The container's args with its mounted Secrets written under root."""
    secrets = objects(docs, "Secret")
    mounts = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
    for v in pod_spec(workload)["volumes"]:
        if "secret" not in v or v["secret"]["secretName"] not in secrets:
            continue  # a Secret the user makes: the test writes its files
        data = secrets[v["secret"]["secretName"]]["data"]
        keys = [i["key"] for i in v["secret"].get("items", [])] or list(data)
        target = root / mounts[v["name"]].lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for key in keys:
            (target / key).write_bytes(base64.b64decode(data[key]))
    args: list[str] = container(workload)["args"]
    return [
        a.replace("$(POD_NAME)", "pod-0")
        .replace("=/etc/", f"={root}/etc/")
        .replace("=/geoip/", f"={root}/geoip/")
        .replace("=/var/", f"={root}/var/")
        for a in args
    ]


def test_binaries_accept_the_rendered_flags(three: list[Doc], tmp_path: Path) -> None:
    control = control_settings.parse(
        _materialise(three, tmp_path, one(three, "Deployment", "ponto-control"))
    )
    assert control.replica_id == "pod-0"
    assert control.etcd == ("ponto-etcd.ponto.svc:2379",)
    assert control.lease_ttl == 10
    assert control.leader_ttl == 5

    geoip = tmp_path / "geoip" / "dbip-city-lite.mmdb"
    geoip.parent.mkdir()
    # A real database: the proxy opens it as it parses its flags.
    write_city_db(geoip, {"203.0.113.0/24": (-33.87, 151.21, "AU", "Sydney")})
    for region in REGIONS:
        deployment = one(three, "Deployment", f"ponto-proxy-{region}")
        proxy = proxy_settings.parse(_materialise(three, tmp_path, deployment))
        assert proxy.region == region
        assert proxy.control_plane == ("ponto-control.ponto.svc:7000",)
        assert (proxy.listen_host, proxy.listen_port) == ("0.0.0.0", 8080)
        assert proxy.geoip_db == geoip
        assert proxy.redis_url == f"redis://ponto-redis-{region}.ponto.svc:6379/0"


def test_notes_say_when_there_are_no_origins_and_where_the_status_page_is(helm: Path) -> None:
    from tests.chartrun.__main__ import CI_VALUES, render  # noqa: PLC0415

    bare = render(str(helm), [], upgrade=False).notes
    assert "No origins yet (topology.origins is empty)" in bare
    assert "port-forward svc/ponto-control 8090:8080" in bare
    with_origins = render(str(helm), [CI_VALUES], upgrade=False).notes
    assert "No origins yet" not in with_origins


def test_notes_give_a_pontoctl_command_that_presents_an_admin_certificate(
    helm: Path, tmp_path: Path
) -> None:
    from tests.chartrun.__main__ import render  # noqa: PLC0415

    quick = "exec deploy/ponto-control -- pontoctl"
    # The chart's own control-plane certificate counts as admin (ponto-control-plane).
    generated = render(str(helm), [], upgrade=False).notes
    assert quick in generated
    assert "--tls-cert /etc/ponto/tls/tls.crt" in generated
    # A given server certificate (cert-manager's, say) states no admin role: the
    # NOTES send pontoctl to the admin Secret instead of the control plane's.
    given = {
        "tls": {
            "existingSecrets": {"controlPlane": "cp-tls", "proxy": "proxy-tls", "admin": "adm-tls"}
        }
    }
    notes = render(str(helm), [Path(values_file(tmp_path, given))], upgrade=False).notes
    assert quick not in notes
    assert "/etc/ponto/tls/tls.crt" not in notes
    assert "Secret\n   adm-tls (tls.existingSecrets.admin)" in notes
    assert "get secret adm-tls -o jsonpath" in notes
    # Without TLS the admin token alone is the credential, given Secrets or not.
    plain = render(
        str(helm),
        [Path(values_file(tmp_path, {**given, "tls": {**given["tls"], "enabled": False}}))],
        upgrade=False,
    ).notes
    assert quick in plain
    assert "--tls-cert" not in plain


def test_cors_origins_become_the_proxies_flag(helm: Path, default: list[Doc]) -> None:
    assert "--cors-origins" not in flags(
        container(one(default, "Deployment", "ponto-proxy-us-east"))
    )
    docs = render(
        helm,
        "--set-json",
        'proxy.corsOrigins=["https://app.example","http://localhost:3000"]',
    )
    use = container(one(docs, "Deployment", "ponto-proxy-us-east"))
    assert flags(use)["--cors-origins"] == "https://app.example,http://localhost:3000"
    for bad in (
        '["https://app.example/path"]',
        '["*","https://a.example"]',
        '["https://a.example:443"]',
    ):
        assert "corsOrigins" in refused(helm, "--set-json", f"proxy.corsOrigins={bad}")
    star = render(helm, "--set-json", 'proxy.corsOrigins=["*"]')
    assert flags(container(one(star, "Deployment", "ponto-proxy-us-east")))["--cors-origins"] == "*"


def test_origin_connection_limits_become_the_proxies_flags_only_when_set(
    helm: Path, default: list[Doc], tmp_path: Path
) -> None:
    named = ("--max-origin-connections", "--max-origin-connections-per-tenant")
    unset = flags(container(one(default, "Deployment", "ponto-proxy-us-east")))
    assert not {*named, "--origin-queue-timeout"} & set(unset)
    docs = render(
        helm,
        "--set-json",
        'proxy.originConnections={"max":2048,"perTenant":2048,"queueTimeoutSeconds":2.5}',
    )
    deployment = one(docs, "Deployment", "ponto-proxy-us-east")
    f = flags(container(deployment))
    assert [f[n] for n in (*named, "--origin-queue-timeout")] == ["2048", "2048", "2.5"]
    # The proxy's own parser takes them as given.
    upstream = proxy_settings.parse(_materialise(docs, tmp_path, deployment)).upstream
    assert upstream.max_origin_connections == 2048
    assert upstream.max_origin_connections_per_tenant == 2048
    assert upstream.origin_queue_timeout == 2.5
    # One alone renders only its own flag; a large count stays an integer.
    alone = render(
        helm, "-f", values_file(tmp_path, {"proxy": {"originConnections": {"max": 30000000}}})
    )
    f = flags(container(one(alone, "Deployment", "ponto-proxy-us-east")))
    assert f["--max-origin-connections"] == "30000000"
    assert not {"--max-origin-connections-per-tenant", "--origin-queue-timeout"} & set(f)
    for bad in ('{"max":-1}', '{"perTenant":1.5}', '{"queueTimeout":5}'):
        assert "originConnections" in refused(helm, "--set-json", f"proxy.originConnections={bad}")


def test_stream_values_become_the_proxies_flags_only_when_set(
    helm: Path, default: list[Doc], tmp_path: Path
) -> None:
    named = ("--stream-hold-seconds", "--max-transcripts-mb")
    assert not set(named) & set(flags(container(one(default, "Deployment", "ponto-proxy-us-east"))))
    # Zero is a setting of its own for both (the head at once; no transcripts), not
    # "the default", so it renders.
    for hold, mb, parsed in (("2.5", "512", 2.5), ("0", "0", 0.0), ("-1", "64", None)):
        docs = render(
            helm,
            "--set-json",
            f'proxy.streams={{"holdSeconds":{hold},"maxTranscriptsMB":{mb}}}',
        )
        deployment = one(docs, "Deployment", "ponto-proxy-us-east")
        f = flags(container(deployment))
        assert [f[n] for n in named] == [hold, mb]
        settings = proxy_settings.parse(_materialise(docs, tmp_path, deployment))
        assert settings.stream_hold_seconds == parsed
        assert settings.max_transcripts_bytes == int(mb) << 20
    alone = render(helm, "--set-json", 'proxy.streams={"holdSeconds":30}')
    f = flags(container(one(alone, "Deployment", "ponto-proxy-us-east")))
    assert f["--stream-hold-seconds"] == "30" and "--max-transcripts-mb" not in f
    for bad in ('{"maxTranscriptsMB":-1}', '{"maxTranscriptsMB":1.5}', '{"hold":5}'):
        assert "streams" in refused(helm, "--set-json", f"proxy.streams={bad}")
