"""The proxy's edge limits with real processes on loopback: a proxy started with
short deadlines and a small connection cap, held by slow clients, still serves
the official openai client; parser and content-coding refusals come back as
OpenAI errors from the real process and reach no origin.

The in-process tests (tests/functional/test_edge.py) cover each limit in detail.
"""

from __future__ import annotations

import gzip
import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionUserMessageParam

from ponto.fleet import Fleet, RegionDef
from tests.e2e.clients import tracked

pytestmark = pytest.mark.e2e

CAP = 16
USER = [ChatCompletionUserMessageParam(role="user", content="are you still there")]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("fleet")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o-us", "us-east")
        f.add_origin("o-us", "us-east", f.origin_url("o-us"))
        version = f.table_version(origins=1)
        f.start_proxy(
            "p-us",
            "us-east",
            extra=[
                "--header-timeout=0.5",
                "--body-timeout=0.5",
                f"--max-connections={CAP}",
                f"--max-connections-per-client={CAP}",
            ],
        )
        f.wait_proxies_at(version)
        yield f


def origin_requests(fleet: Fleet) -> int:
    stats = httpx.get(f"http://{fleet.origins['o-us'].address}/sim/stats", timeout=10).json()
    return int(stats["requests"])


def address(fleet: Fleet) -> tuple[str, int]:
    host, port = fleet.proxies["p-us"].address.rsplit(":", 1)
    return host, int(port)


def raw(fleet: Fleet, data: bytes) -> tuple[int, dict[str, Any], bytes]:
    """Send `data` on a new connection; the status and JSON error of the answer,
    and whatever follows until the proxy closes."""
    with socket.create_connection(address(fleet), timeout=10) as s:
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)["error"], head


def test_slow_clients_past_the_cap_do_not_starve_the_openai_client(fleet: Fleet) -> None:
    before = origin_requests(fleet)
    slow = []
    try:
        for _ in range(3 * CAP):
            s = socket.create_connection(address(fleet), timeout=10)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n")
            slow.append(s)
        client = tracked(
            OpenAI(base_url=fleet.proxy_url("p-us"), api_key="sk-client-secret", max_retries=0)
        )
        for _ in range(3):
            answer = client.chat.completions.create(model="sim-small", messages=USER)
            assert answer.choices[0].message.content
    finally:
        for s in slow:
            s.close()
    assert origin_requests(fleet) == before + 3


def test_a_slow_head_is_closed_at_its_deadline(fleet: Fleet) -> None:
    with socket.create_connection(address(fleet), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n")
        assert s.recv(1) == b""  # closed, not answered


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"GET /v1/models HTTP/1.1\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n", 431, None),
        (b"GET /v1/models HTTP/1.1\r\nX-Ctl: a\x01b\r\n\r\n", 400, "invalid_http_request"),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{",
            408,
            "body_timeout",
        ),
    ],
    ids=["long-header", "control-character", "slow-body"],
)
def test_refusals_from_the_real_process_are_openai_errors(
    fleet: Fleet, data: bytes, status: int, code: str | None
) -> None:
    before = origin_requests(fleet)
    got, error, head = raw(fleet, data)
    assert got == status, error
    assert error["message"] and error["type"]
    assert code is None or error["code"] == code
    assert b"x-request-id" in head.lower()
    assert origin_requests(fleet) == before


@pytest.mark.parametrize(
    ("encoding", "status"), [("gzip", 200), ("br", 415), ("zstd", 415), ("deflate", 400)]
)
def test_request_content_codings(fleet: Fleet, encoding: str, status: int) -> None:
    before = origin_requests(fleet)
    body = json.dumps({"model": "sim-small", "messages": USER}).encode()
    r = httpx.post(
        fleet.proxy_url("p-us") + "/chat/completions",
        content=gzip.compress(body) if encoding == "gzip" else body,
        headers={"content-type": "application/json", "content-encoding": encoding},
        timeout=10,
    )
    assert r.status_code == status, r.text
    assert origin_requests(fleet) == before + (1 if status == 200 else 0)
    if status != 200:
        assert r.headers["content-type"].startswith("application/json")
