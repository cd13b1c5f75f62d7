"""Traces from a real proxy process to a real OTLP receiver on loopback.

One fleet per module (etcd, a control plane, an origin); each test starts a
receiver (`python -m ponto.otlpsink`) and a proxy whose OTEL_* variables point
at it, calls the proxy with the official openai client, stops the proxy (which
flushes its spans) and reads what the receiver decoded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionUserMessageParam

from ponto.devenv import python_entry, spawn
from ponto.fleet import Fleet, RegionDef
from tests.e2e.clients import tracked

pytestmark = pytest.mark.e2e

USER = [ChatCompletionUserMessageParam(role="user", content="trace me")]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("fleet")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o-us", "us-east")
        f.add_origin("o-us", "us-east", f.origin_url("o-us"))
        f.table_version(origins=1)
        yield f


def spans_from(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.mark.parametrize(("protocol", "workers"), [("http/protobuf", 1), ("grpc", 2)])
def test_spans_reach_an_otlp_receiver(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, protocol: str, workers: int
) -> None:
    tag = protocol.split("/", maxsplit=1)[0]
    out = fleet.workdir / f"spans-{tag}.jsonl"
    ready = fleet.workdir / f"sink-{tag}.addr"
    sink = spawn(
        f"sink-{tag}",
        [
            *python_entry("ponto.otlpsink"),
            "--listen",
            "127.0.0.1:0",
            "--protocol",
            protocol,
            "--out",
            str(out),
            "--ready-file",
            str(ready),
        ],
        fleet.workdir,
        ready_file=ready,
    )
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://{sink.address}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "edge-under-test")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=e2e")
        name = f"p-{tag}"
        proxy = fleet.start_proxy(name, "us-east", workers=workers)
        fleet.wait_proxies_at(fleet.table_version(origins=1))
        client = tracked(
            OpenAI(base_url=fleet.proxy_url(name), api_key="sk-client-secret", max_retries=0)
        )
        raw = client.chat.completions.with_raw_response.create(
            model="sim-small",
            messages=USER,
            max_tokens=5,
            extra_headers={"traceparent": CLIENT_TRACEPARENT},
        )
        completion = raw.parse()
        request_id = raw.headers["x-request-id"]
        assert proxy.stop() == 0  # SIGTERM: the proxy flushes its spans on the way out
        del fleet.proxies[name]
    finally:
        sink.stop()

    spans = [s for s in spans_from(out) if s["trace_id"] == CLIENT_TRACE]
    [root] = [s for s in spans if s["kind"] == "SPAN_KIND_SERVER"]
    assert root["name"] == "chat sim-small"
    assert root["parent_span_id"] == "00f067aa0ba902b7"
    a = root["attributes"]
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "sim-small"
    assert a["gen_ai.response.model"] == completion.model
    assert a["gen_ai.request.max_tokens"] == 5
    assert completion.usage is not None
    assert a["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert a["http.response.status_code"] == 200
    assert a["ponto.region"] == "us-east"
    assert a["ponto.origin"] == "o-us"
    assert a["ponto.attempts"] == 1
    assert a["ponto.request_id"] == request_id
    resource = root["resource"]
    assert resource["service.name"] == "edge-under-test"
    assert resource["deployment.environment.name"] == "e2e"
    assert resource["ponto.region"] == "us-east"
    assert str(resource["ponto.proxy"]).startswith(name)
    children = {s["name"]: s for s in spans if s is not root}
    assert {"ponto.auth", "ponto.limits", "ponto.cache.lookup", "chat sim-small"} <= set(children)
    for child in children.values():
        assert child["parent_span_id"] == root["span_id"]
    attempt = children["chat sim-small"]
    assert attempt["kind"] == "SPAN_KIND_CLIENT"
    assert attempt["attributes"]["ponto.outcome"] == "ok"


def test_an_unknown_protocol_stops_the_proxy_with_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataplane",
            "--region",
            "r1",
            "--control-plane",
            "127.0.0.1:9",
            "--state-dir",
            str(tmp_path),
        ],
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": ":".join(p for p in sys.path if p),
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "ponto-proxy: error: OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol 'http/json' "
        "(expected http/protobuf or grpc)"
    ]
