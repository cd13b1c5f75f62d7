"""What follows a whole answer that its handler hands to the edge first
(boundary.send_whole): keeping it, settling its flight and its tokens, the
metrics. None of it waits for the client to read the answer, none of it is
cut short by a client that leaves, and a bug in it gets no second answer.
The real proxy app on EdgeRunner (production's listener, handler
cancellation on), with a hand-written origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dataplane.http.state import HOLDER, METRICS, PIPELINE
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import KEY, LIMITED_KEY, MODEL, table

# Past the socket buffers (on loopback the kernel's send buffer grows to 4 MB,
# tcp_wmem): the proxy's write must wait for the client to read.
BIG = 16 << 20


class OriginHandler(Protocol):
    async def handle(self, request: web.Request) -> web.StreamResponse: ...


@dataclass
class Origin:
    calls: int = 0
    gate: asyncio.Event | None = None
    size: int = 10
    usage: dict[str, int] | None = None

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        body = {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "a" * self.size},
                    "finish_reason": "stop",
                }
            ],
            "usage": self.usage or {"prompt_tokens": 3, "completion_tokens": 5000},
        }
        return web.json_response(body)


@dataclass
class Edge:
    port: int
    app: web.Application

    async def connect(self, rcvbuf: int | None = None) -> tuple[Any, Any]:
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        return await asyncio.open_connection(sock=sock)

    def sample(self, name: str, labels: dict[str, str]) -> float | None:
        value = self.app[METRICS].registry.get_sample_value(name, labels)
        return None if value is None else float(value)


Start = Callable[..., Awaitable[Edge]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    async with edges(tmp_path) as go:
        yield go


@contextlib.asynccontextmanager
async def edges(tmp_path: Path) -> AsyncIterator[Start]:
    """Starts the proxy on EdgeRunner before a hand-written origin, with more
    proxy flags; all of them stopped at the end."""
    cleanup: list[Any] = []

    async def go(origin: OriginHandler, *flags: str) -> Edge:
        oapp = web.Application()
        oapp.router.add_post("/v1/chat/completions", origin.handle)
        server = TestServer(oapp)
        await server.start_server()
        cleanup.append(server.close)
        served = await serve_on_edge(
            tmp_path, str(server.make_url("/v1")), "--metrics-key-labels=on", *flags
        )
        cleanup.insert(0, served.runner.cleanup)
        return Edge(served.port, served.app)

    try:
        yield go
    finally:
        for close in cleanup:
            await close()


BODY = json.dumps(
    {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def request(body: bytes = BODY) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n"
        b"Authorization: Bearer " + KEY.key.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body


async def read_answer(reader: Any) -> tuple[int, dict[str, str], bytes]:
    status_line = await reader.readline()
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


async def test_a_slow_reader_leading_a_flight_does_not_hold_its_followers(start: Start) -> None:
    # The leader's client does not read its answer (past the socket buffers);
    # the flight is finished all the same, and its follower answered.
    gate = asyncio.Event()
    origin = Origin(gate=gate, size=BIG)
    edge = await start(origin)
    coalescer = edge.app[PIPELINE].cache.coalescer
    _lreader, lwriter = await edge.connect(rcvbuf=4096)  # a client that does not read
    lwriter.write(request())
    await until(lambda: origin.calls == 1)
    freader, fwriter = await edge.connect()
    fwriter.write(request())  # the same question: it follows the flight
    await until(lambda: coalescer.stats.followers == 1)
    gate.set()
    try:
        # The follower (a whole answer, here too large to keep, so it calls
        # the origin itself once the flight ends) is answered.
        async with asyncio.timeout(10):
            status, _headers, _ = await read_answer(freader)
        assert status == 200
    finally:
        lwriter.transport.abort()
        fwriter.close()


async def test_a_client_that_does_not_read_its_big_answer_is_charged_its_tokens(
    start: Start,
) -> None:
    # The origin spent 5000 completion tokens. They are accounted while the
    # client has not read its answer (past the socket buffers), and stay
    # accounted once it resets the connection; the request is counted once.
    origin = Origin(size=BIG)
    edge = await start(origin)
    _reader, writer = await edge.connect(rcvbuf=4096)
    writer.write(request())
    completion = {"tenant": "acme", "key": KEY.key_id, "kind": "completion"}
    await until(lambda: edge.sample("ponto_tenant_tokens_total", completion) == 5000)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()  # RST
    labels = {"endpoint": "chat.completions", "code": "499"}
    ok = {"endpoint": "chat.completions", "code": "200"}
    # Counted when its answer was handed over, as the 200 it was, and once.
    await until(lambda: edge.sample("ponto_requests_total", ok) is not None)
    assert (
        edge.sample("ponto_requests_total", ok),
        edge.sample("ponto_requests_total", labels),
    ) == (
        1.0,
        None,
    )
    assert edge.sample("ponto_tenant_tokens_total", completion) == 5000


async def test_bookkeeping_that_fails_after_the_answer_is_counted_as_what_the_client_got(
    start: Start, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Work after the answer raises (the token accounting, made to fail once:
    # a stand-in for any bug there). The client has its 200, which is what is
    # counted; the connection serves the requests pipelined behind it in order;
    # the bug is logged once.
    origin = Origin()
    edge = await start(origin, "--access-log=on")
    metrics = edge.app[METRICS]
    real = metrics.account_tokens
    calls = []

    def failing(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("bookkeeping bug")
        real(*args)

    monkeypatch.setattr(metrics, "account_tokens", failing)
    reader, writer = await edge.connect()
    with caplog.at_level(logging.INFO):
        writer.write(request() + request(BODY.replace(b"hi", b"ho")))
        first = await read_answer(reader)
        second = await read_answer(reader)
        writer.write(request(BODY.replace(b"hi", b"hu")))
        third = await read_answer(reader)
    writer.close()
    assert (second[0], third[0]) == (200, 200)  # the connection serves on, in order
    counted = {
        code: edge.sample("ponto_requests_total", {"endpoint": "chat.completions", "code": code})
        for code in ("200", "500")
    }
    assert first[0] == 200
    assert counted == {"200": 3.0, "500": None}
    bugs = [r for r in caplog.records if "after its answer began" in r.getMessage()]
    assert len(bugs) == 1 and bugs[0].exc_info is not None


async def test_an_admitted_whole_answer_on_the_edge_carries_its_limit_headers(
    tmp_path: Path,
) -> None:
    """A whole answer written as header lines (WholeAnswer) carries the
    admission's x-ratelimit-* lines (Admission.lines), once each, with the
    values of each admission; review 396: a pipeline passing no lines left
    every such answer without them, and no test failed (the stacks on
    aiohttp's own server write the pairs, not the lines)."""
    oapp = web.Application()
    oapp.router.add_post("/v1/chat/completions", Origin().handle)
    server = TestServer(oapp)
    await server.start_server()
    url = str(server.make_url("/v1"))
    served = await serve_on_edge(tmp_path, url)
    try:
        # The second table brings LIMITED_KEY, limited to 2 requests a minute.
        served.app[HOLDER].apply(table([("o1", url)], version=2), "control-plane")
        edge = Edge(served.port, served.app)
        for i, remaining in enumerate(("1", "0")):
            body = json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}]}
            ).encode()
            reader, writer = await edge.connect()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n"
                b"Authorization: Bearer " + LIMITED_KEY.key.encode() + b"\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            async with asyncio.timeout(10):
                head = await reader.readuntil(b"\r\n\r\n")
            writer.close()
            assert head.startswith(b"HTTP/1.1 200 ")
            limits = [line for line in head.split(b"\r\n") if line.startswith(b"x-ratelimit-")]
            assert [line.partition(b": ")[0] for line in limits] == [
                b"x-ratelimit-limit-requests",
                b"x-ratelimit-remaining-requests",
                b"x-ratelimit-reset-requests",
            ]
            assert limits[0] == b"x-ratelimit-limit-requests: 2"
            assert limits[1] == b"x-ratelimit-remaining-requests: " + remaining.encode()
    finally:
        await served.runner.cleanup()
        await server.close()


async def test_a_whole_answer_handed_over_at_once_is_charged_and_kept(start: Start) -> None:
    # A small whole answer goes out as a plain call (Pipeline.respond's path
    # that waits for nothing, reached on the edge alone): its tokens are
    # charged and its entry kept, so the repeat is a hit the origin never sees.
    origin = Origin(usage={"prompt_tokens": 3, "completion_tokens": 7})
    edge = await start(origin)
    reader, writer = await edge.connect()
    completion = {"tenant": "acme", "key": KEY.key_id, "kind": "completion"}
    try:
        writer.write(request())
        status, headers, _ = await read_answer(reader)
        assert (status, headers["x-ponto-cache"]) == (200, "miss")
        await until(lambda: edge.sample("ponto_tenant_tokens_total", completion) is not None)
        assert edge.sample("ponto_tenant_tokens_total", completion) == 7
        writer.write(request())
        status, headers, _ = await read_answer(reader)
        assert (status, headers["x-ponto-cache"]) == (200, "hit")
        assert origin.calls == 1
        assert edge.sample("ponto_tenant_tokens_total", completion) == 7
    finally:
        writer.close()
