"""The chart's `proxy.otel` values: the OTEL_* variables every proxy pod gets,
read back by the parser the proxy itself uses (dataplane.telemetry.config)."""

from __future__ import annotations

from pathlib import Path

from dataplane.telemetry.config import TraceConfig, trace_config
from tests.helm.test_chart import (
    container,
    helm,  # noqa: F401 - the fixture
    objects,
    refused,
    render,
    values_file,
)

OTEL = {
    "endpoint": "http://otel-collector.observability:4317",
    "protocol": "grpc",
    "sampleRatio": 0.25,
    "resourceAttributes": "deployment.environment.name=prod",
}


def proxy_env(docs: list[dict[str, object]]) -> list[dict[str, str]]:
    """The plain-valued environment of every proxy Deployment, one dict each."""
    proxies = [d for name, d in objects(docs, "Deployment").items() if "proxy" in name]
    assert proxies
    return [{e["name"]: e["value"] for e in container(d)["env"] if "value" in e} for d in proxies]


def test_no_tracing_variables_by_default(helm: Path) -> None:  # noqa: F811
    for env in proxy_env(render(helm)):
        assert not [name for name in env if name.startswith("OTEL_")]
        assert trace_config(env) is None


def test_an_endpoint_turns_tracing_on_as_configured(helm: Path, tmp_path: Path) -> None:  # noqa: F811
    docs = render(helm, "-f", values_file(tmp_path, {"proxy": {"otel": OTEL}}))
    for env in proxy_env(docs):
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == OTEL["endpoint"]
        assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
        assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
        assert env["OTEL_SERVICE_NAME"] == "ponto-proxy"
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == OTEL["resourceAttributes"]
        assert trace_config(env) == TraceConfig(("otlp",), "grpc")


def test_the_schema_refuses_a_protocol_the_proxy_cannot_speak(
    helm: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    values = {"proxy": {"otel": {**OTEL, "protocol": "http/json"}}}
    message = refused(helm, "-f", values_file(tmp_path, values))
    assert "proxy.otel.protocol" in message
