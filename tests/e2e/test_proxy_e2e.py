"""Both planes as real processes on loopback, driven by the official openai client.

One fleet per module: etcd, a control plane, an origin in us-east and one in
eu-west, and a proxy in us-east. Tests that break the origins restore them.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionUserMessageParam

from controlplane.cli import main as pontoctl
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from tests.e2e.clients import tracked

pytestmark = pytest.mark.e2e

SIM_HEADERS = "x-sim-fail,x-sim-drop,x-sim-cut-after,x-sim-delay-ms"
USER = [ChatCompletionUserMessageParam(role="user", content="where is the nearest region")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("fleet")) as f:
        f.start_etcd()
        f.start_control()
        for region, lat, lon, origin in (
            ("us-east", 38.9, -77.4, "o-us"),
            ("eu-west", 53.3, -6.3, "o-eu"),
        ):
            f.add_region(RegionDef(region, lat, lon))
            f.start_origin(origin, region)
            f.add_origin(origin, region, f.origin_url(origin))
        version = f.table_version(origins=2)
        f.start_proxy("p-us", "us-east", extra=["--forward-headers", SIM_HEADERS])
        f.wait_proxies_at(version)
        yield f


@pytest.fixture
def sims(fleet: Fleet) -> Iterator[httpx.Client]:
    """HTTP client for the origins' /sim API; every origin is reset around the test."""
    with httpx.Client(timeout=10) as client:

        def reset() -> None:
            for m in fleet.origins.values():
                client.post(
                    f"http://{m.address}/sim/config", json={"mode": "ok", "tokens_per_s": 0}
                )
                client.post(f"http://{m.address}/sim/reset")

        reset()
        yield client
        reset()


def sim_stats(client: httpx.Client, fleet: Fleet, origin: str) -> dict[str, Any]:
    stats: dict[str, Any] = client.get(f"http://{fleet.origins[origin].address}/sim/stats").json()
    return stats


def oai(fleet: Fleet, **kw: Any) -> OpenAI:
    return tracked(
        OpenAI(base_url=fleet.proxy_url("p-us"), api_key="sk-client-secret", max_retries=0, **kw)
    )


def test_chat_non_streaming_reaches_nearest_origin(fleet: Fleet, sims: httpx.Client) -> None:
    raw = oai(fleet).chat.completions.with_raw_response.create(model="sim-small", messages=USER)
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.total_tokens > 0
    assert raw.headers["x-ponto-region"] == "us-east"
    assert raw.headers["x-ponto-origin"] == "o-us"
    assert raw.headers["x-ponto-attempts"] == "1"
    seen = sim_stats(sims, fleet, "o-us")["last_request"]["headers"]
    assert "authorization" not in {k.lower() for k in seen}, "client key leaked to the origin"


def test_chat_streaming_relays_chunks(fleet: Fleet, sims: httpx.Client) -> None:
    client = oai(fleet)
    plain = client.chat.completions.create(model="sim-small", messages=USER)
    stream = client.chat.completions.create(model="sim-small", messages=USER, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 2
    assert "".join(pieces) == plain.choices[0].message.content
    assert stream.response.headers["x-ponto-origin"] == "o-us"


def test_streaming_chunks_arrive_before_the_end(fleet: Fleet, sims: httpx.Client) -> None:
    """Chunk by chunk: the first token arrives long before the last one is generated."""
    sims.post(f"http://{fleet.origins['o-us'].address}/sim/config", json={"tokens_per_s": 20})
    body = {
        "model": "sim-small",
        "stream": True,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "x"}],
    }
    with httpx.stream(
        "POST", fleet.proxy_url("p-us") + "/chat/completions", json=body, timeout=10
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        t_first = time.monotonic()
        rest = [line for line in lines if line.startswith("data:")]
        t_last = time.monotonic()
    assert "chat.completion.chunk" in first
    assert rest[-1] == "data: [DONE]"
    # 20 tokens at 20/s take about a second; a buffering proxy would deliver
    # everything at once (a gap near zero).
    assert t_last - t_first > 0.5


def test_completions_embeddings_and_models(fleet: Fleet, sims: httpx.Client) -> None:
    client = oai(fleet)
    comp = client.completions.create(model="sim-small", prompt="say hi", max_tokens=4)
    assert comp.choices[0].text
    emb = client.embeddings.create(model="sim-small", input=["a", "b"])
    assert len(emb.data) == 2 and emb.data[0].embedding
    assert sorted(m.id for m in client.models.list()) == ["sim-large", "sim-small"]


def test_rerank_as_a_rag_apps_reranker_calls_it(fleet: Fleet, sims: httpx.Client) -> None:
    # LangChain's and llama-index's Jina/Cohere-compatible rerankers POST
    # {base_url}/rerank; the openai SDK has no rerank.
    docs = ["horses eat hay", "the nearest region is us-east", "nearest region"]
    body = {"model": "sim-small", "query": "nearest region", "documents": docs, "top_n": 2}
    headers = {"authorization": "Bearer sk-client-secret"}
    url = fleet.proxy_url("p-us") + "/rerank"
    resp = httpx.post(url, json=body, headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert len(answer["results"]) == 2 and answer["usage"]["total_tokens"] > 0
    assert answer["results"][0]["index"] == 2  # the query itself ranks first
    assert resp.headers["x-ponto-cache"] == "miss"
    again = httpx.post(url, json=body, headers=headers, timeout=10)
    assert again.headers["x-ponto-cache"] == "hit" and again.json() == answer
    bad = httpx.post(url, json={**body, "documents": []}, headers=headers, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
    assert sim_stats(sims, fleet, "o-us")["requests"] == 1


@pytest.mark.parametrize("mode", ["fail", "drop"])
def test_failover_to_next_region_before_first_byte(
    fleet: Fleet, sims: httpx.Client, mode: str
) -> None:
    sims.post(f"http://{fleet.origins['o-us'].address}/sim/config", json={"mode": mode})
    raw = oai(fleet).chat.completions.with_raw_response.create(model="sim-small", messages=USER)
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-ponto-origin"] == "o-eu"
    assert raw.headers["x-ponto-region"] == "eu-west"
    assert raw.headers["x-ponto-attempts"] == "2"


def test_streaming_failover_before_first_byte(fleet: Fleet, sims: httpx.Client) -> None:
    sims.post(f"http://{fleet.origins['o-us'].address}/sim/config", json={"mode": "drop"})
    stream = oai(fleet).chat.completions.create(model="sim-small", messages=USER, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert stream.response.headers["x-ponto-origin"] == "o-eu"


def test_all_origins_failing_is_a_clear_502(fleet: Fleet, sims: httpx.Client) -> None:
    for m in fleet.origins.values():
        sims.post(f"http://{m.address}/sim/config", json={"mode": "fail"})
    with pytest.raises(openai.APIStatusError) as info:
        oai(fleet).chat.completions.create(model="sim-small", messages=USER)
    assert info.value.status_code == 502
    body = info.value.response.json()
    assert body["error"]["type"] == "upstream_error"
    assert body["error"]["code"] == "upstream_unavailable"
    # The allowlist: which origins failed, and why, is in the proxy's log only.
    assert "o-us" not in info.value.response.text and "o-eu" not in info.value.response.text


def test_stream_cut_mid_way_ends_with_error_event_and_done(
    fleet: Fleet, sims: httpx.Client
) -> None:
    body = {"model": "sim-small", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(
        fleet.proxy_url("p-us") + "/chat/completions",
        json=body,
        headers={"x-sim-cut-after": "3"},
        timeout=10,
    )
    events = [line for line in r.text.splitlines() if line.startswith("data:")]
    assert r.status_code == 200
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["code"] == "upstream_stream_broken"
    # Every origin cuts after 3 events (the header reaches the continuation
    # too): the stream is continued on the other origin, which cuts as well,
    # and with no origin left it ends with the error event.
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert len(chunks) == 3 + 3
    assert len({c["id"] for c in chunks}) == 1
    # The openai client surfaces the error event as an exception, not silence.
    with pytest.raises(openai.APIError):
        stream = oai(fleet, default_headers={"x-sim-cut-after": "3"}).chat.completions.create(
            model="sim-small", messages=USER, stream=True
        )
        for _ in stream:
            pass


def _running(client: httpx.Client, fleet: Fleet) -> float:
    """Requests in progress on all origins (passive health may have moved
    traffic off o-us after the failover tests)."""
    total = 0.0
    for m in fleet.origins.values():
        text = client.get(f"http://{m.address}/metrics").text
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
    return total


def test_client_disconnect_cancels_the_origin_request(fleet: Fleet, sims: httpx.Client) -> None:
    for m in fleet.origins.values():
        sims.post(f"http://{m.address}/sim/config", json={"tokens_per_s": 4})
    body = json.dumps(
        {"model": "sim-small", "stream": True, "max_tokens": 40,
         "messages": [{"role": "user", "content": "long answer"}]}
    ).encode()  # fmt: skip
    host, port = fleet.proxies["p-us"].address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert b"200 OK" in s.recv(4096)
        assert _running(sims, fleet) == 1
    # 40 tokens at 4/s would keep the origin busy for 10 s; a cancelled
    # request frees it at once.
    deadline = time.monotonic() + 5
    while _running(sims, fleet) != 0:
        assert time.monotonic() < deadline, "origin still generating for a client that left"
        time.sleep(0.05)


# ---------------------------------------------------------------- bad input

JSON = "application/json"
MSGS = '"messages": [{"role": "user", "content": "x"}]'
BAD_INPUTS = [
    ("malformed json", b'{"model": "sim-small", ', JSON, 400, "invalid_json"),
    ("not an object", b"[1, 2]", JSON, 400, "invalid_json"),
    ("empty body", b"", JSON, 400, None),
    ("missing model", ("{" + MSGS + "}").encode(), JSON, 400, None),
    ("model not a string", b'{"model": 7, "messages": []}', JSON, 400, None),
    ("unknown model", ('{"model": "gpt-9", ' + MSGS + "}").encode(), JSON, 404, "model_not_found"),
    ("messages not a list", b'{"model": "sim-small", "messages": "hi"}', JSON, 400, None),
    ("empty messages", b'{"model": "sim-small", "messages": []}', JSON, 400, None),
    ("stream not a bool", ('{"model": "sim-small", "stream": "yes", ' + MSGS + "}").encode(),
     JSON, 400, None),
    ("text content type", b'{"model": "sim-small"}', "text/plain", 415, "unsupported_media_type"),
    ("form content type", b"model=sim-small", "application/x-www-form-urlencoded", 415,
     "unsupported_media_type"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("label", "body", "ctype", "status", "code"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_gets_openai_error_and_never_reaches_origin(
    fleet: Fleet,
    sims: httpx.Client,
    label: str,
    body: bytes,
    ctype: str,
    status: int,
    code: str | None,
) -> None:
    r = httpx.post(
        fleet.proxy_url("p-us") + "/chat/completions",
        content=body,
        headers={"content-type": ctype},
        timeout=10,
    )
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if code:
        assert error["code"] == code
    assert sim_stats(sims, fleet, "o-us")["requests"] == 0
    assert sim_stats(sims, fleet, "o-eu")["requests"] == 0


def test_oversized_body_is_413(fleet: Fleet, sims: httpx.Client) -> None:
    big = (
        b'{"model": "sim-small", "messages": [{"role": "user", "content": "'
        + b"x" * (10 * 1024 * 1024)
        + b'"}]}'
    )
    r = httpx.post(
        fleet.proxy_url("p-us") + "/chat/completions",
        content=big,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"
    assert sim_stats(sims, fleet, "o-us")["requests"] == 0


def test_unknown_path_and_wrong_method(fleet: Fleet, sims: httpx.Client) -> None:
    base = f"http://{fleet.proxies['p-us'].address}"
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(base + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_openai_client_sees_typed_errors(fleet: Fleet, sims: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai(fleet).chat.completions.create(model="no-such-model", messages=USER)
    assert info.value.code == "model_not_found"


def test_metrics_and_health(fleet: Fleet, sims: httpx.Client) -> None:
    base = f"http://{fleet.proxies['p-us'].address}"
    oai(fleet).chat.completions.create(model="sim-small", messages=USER)
    text = httpx.get(fleet.metrics_url("p-us")).text
    assert 'ponto_requests_total{code="200",endpoint="chat.completions"}' in text
    assert "ponto_control_plane_connected 1.0" in text
    assert "ponto_route_table_version" in text
    # The state on the metrics port; the public port says only that it lives.
    health = fleet.proxy_status("p-us")
    assert health["control_plane_connected"] is True
    assert health["route_table_source"] == "control-plane"
    assert httpx.get(base + "/healthz").json() == {"status": "ok"}
    assert httpx.get(base + "/readyz").status_code == 200


def test_drain_is_pushed_and_proxy_lists_its_ack(
    fleet: Fleet, sims: httpx.Client, tmp_path: Path
) -> None:
    """Drain is stored and pushed; `pontoctl get proxies` shows the ACKed version."""
    control = next(iter(fleet.controls.values())).address
    assert pontoctl(["--control-plane", control, "drain", "region", "us-east"]) == 0
    try:
        version = fleet.wait_table(lambda t: any(r.drained for r in t.regions))
        fleet.wait_proxies_at(version)
        raw = oai(fleet).chat.completions.with_raw_response.create(model="sim-small", messages=USER)
        assert raw.headers["x-ponto-region"] == "eu-west"
        # ACKs reach the listing with the replica's next summary write (200 ms).
        deadline = time.monotonic() + 5
        while True:
            proxies = fleet.admin().ListProxies(apb.ListRequest())
            if [p.acked_version for p in proxies.proxies] == [version] or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.05)
        assert [p.acked_version for p in proxies.proxies] == [version]
        assert proxies.current_version == version
    finally:
        assert pontoctl(["--control-plane", control, "undrain", "region", "us-east"]) == 0
        fleet.wait_proxies_at(fleet.wait_table(lambda t: not any(r.drained for r in t.regions)))
