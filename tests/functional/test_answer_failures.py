"""Failures once an answer began, on the real listener (EdgeRunner, handler
cancellation on) before the origin simulator: a client that leaves during a
relayed stream, or before a replayed one's write, is a 499, not a bug; a
stream a bug stops part-way is cut, not ended as if whole; a bug in the
boundary's own counting after a whole answer is logged, and the requests
pipelined behind it are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dataplane.cache.entry import to_completion, to_sse_chunks
from dataplane.http import reply
from dataplane.http.edge import EdgeRunner
from dataplane.http.state import METRICS
from dataplane.streaming import relay as relays
from ponto.originsim.app import SimConfig
from ponto.originsim.app import build_app as sim_app
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import KEY, chat


@dataclass
class Edge:
    app: web.Application
    port: int
    session: aiohttp.ClientSession
    runner: EdgeRunner

    async def post(self, body: Any) -> aiohttp.ClientResponse:
        return await self.session.post(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEY.key}"},
        )

    async def raw(self, body: Any) -> bytes:
        """One request on a connection of its own; every byte until it closes."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(_request(body))
            async with asyncio.timeout(10):
                return await reader.read()
        finally:
            writer.close()

    def abort_connections(self) -> None:
        """Reset every client connection, as a client's failed network would."""
        server = self.runner.server
        assert server is not None
        for protocol in server.connections:
            if protocol.transport is not None:
                protocol.transport.abort()

    def counted(self) -> float:
        """Chat requests counted, with the codes these tests see."""
        return sum(
            self.sample("ponto_requests_total", {"endpoint": "chat.completions", "code": code})
            for code in ("200", "499", "500")
        )

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        value = self.app[METRICS].registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else float(value)


@pytest.fixture
async def edge(tmp_path: Path) -> AsyncIterator[Edge]:
    origin = TestServer(sim_app(SimConfig(name="o1", answer_tokens=6, seed=1)))
    await origin.start_server()
    served = await serve_on_edge(tmp_path, str(origin.make_url("/v1")))
    session = aiohttp.ClientSession()
    try:
        yield Edge(served.app, served.port, session, served.runner)
    finally:
        await session.close()
        await served.runner.cleanup()
        await origin.close()


STREAM = chat("stream me, then replay me", stream=True)


async def _cached_stream(edge: Edge) -> None:
    first = await edge.post(STREAM)
    assert first.headers["x-ponto-cache"] == "miss"
    assert b"data: [DONE]" in await first.read()


@pytest.fixture
def broken_relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException]]:
    """A relayed stream fails after its first chunk, its head and that chunk
    sent, with the exception put in the returned list (none: it relays whole)."""
    failure: list[BaseException] = []
    real = relays.relay

    async def first_then_fail(
        first: bytes, content: Any, out: web.StreamResponse, **kwargs: Any
    ) -> Any:
        if not failure:
            return await real(first, content, out, **kwargs)
        await out.write(first)
        raise failure[0]

    monkeypatch.setattr(reply, "relay", first_then_fail)
    yield failure


async def test_a_client_gone_during_a_relayed_stream_is_a_499_not_a_bug(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A relayed stream (reply.relay) or a followed flight's (reply.follow)
    # writing to a client that left raises ConnectionResetError (aiohttp's
    # "Cannot write to closing transport"): a 499, client_disconnected,
    # nothing logged, though the stream's head went out.
    real = web.StreamResponse.write
    writes: list[web.StreamResponse] = []

    async def write(self: web.StreamResponse, data: bytes) -> None:
        if "x-ponto-cache" in self.headers:  # not the origin simulator's own
            writes.append(self)
            if len(writes) == 1:
                # The head went out; then the client's connection fails (a
                # reset): the transport is closing when the stream's first
                # chunk is written. (Failing after it instead, the write of
                # the stream's end alone would fail whenever the origin's
                # chunks came in one read: a client that had the whole answer,
                # which is not a 499.)
                transport = self._req.transport if self._req is not None else None
                assert transport is not None
                transport.abort()
        await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    with caplog.at_level(logging.INFO):
        with contextlib.suppress(ConnectionError):
            await edge.raw(STREAM)
        await until(lambda: edge.counted() == 1)
    assert len(writes) == 1
    bugs = [r for r in caplog.records if "after its answer began" in r.getMessage()]
    assert bugs == [], "a client that left is logged as a proxy bug, with a traceback"
    assert edge.sample("ponto_client_disconnects_total") == 1
    code = {"endpoint": "chat.completions", "code": "499"}
    assert edge.sample("ponto_requests_total", code) == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_client_gone_before_a_hit_is_written_is_a_499_not_a_bug(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    # A hit (reply.replay), streamed or not, is one whole answer handed to the
    # connection at once: a client whose connection failed just before gets
    # nothing, and the request is a 499, client_disconnected, nothing logged.
    body = STREAM if stream else chat("stream me, then replay me")
    cached = await edge.post(body)  # the answer the hit replays
    assert cached.headers["x-ponto-cache"] == "miss"
    await cached.read()

    def gone(real: Any) -> Any:
        def build(*args: Any, **kwargs: Any) -> Any:
            edge.abort_connections()  # the client's connection fails as its answer is built
            return real(*args, **kwargs)

        return build

    monkeypatch.setattr(reply, "to_sse_chunks", gone(to_sse_chunks))
    monkeypatch.setattr(reply, "to_completion", gone(to_completion))
    with caplog.at_level(logging.INFO):
        with contextlib.suppress(ConnectionError):
            assert await edge.raw(body) == b""
        await until(lambda: edge.counted() == 2)
    bugs = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert bugs == [], "a client that left is logged as a proxy bug"
    assert edge.sample("ponto_client_disconnects_total") == 1
    code = {"endpoint": "chat.completions", "code": "499"}
    assert edge.sample("ponto_requests_total", code) == 1


async def until(check: Any) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


async def test_a_stream_a_bug_stops_part_way_does_not_end_as_if_whole(
    edge: Edge, broken_relay: list[BaseException]
) -> None:
    # A bug after a stream's head, before its end: the connection is cut, so
    # the client's read fails rather than finding a well-framed, complete body
    # (aiohttp's finish_response would write the chunked end) with no [DONE].
    broken_relay.append(RuntimeError("a bug part-way through the stream"))
    answer = await edge.post(STREAM)
    assert answer.status == 200
    try:
        body = await answer.read()
    except aiohttp.ClientPayloadError:
        return  # the client is told the body is incomplete: fine
    assert b'"error"' in body, f"a cut stream read as complete: {body!r}"


def _request(body: Any, version: bytes = b"1.1") -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: p\r\n"
        b"Authorization: Bearer " + KEY.key.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
    ) + data


async def test_a_bug_in_the_boundarys_own_bookkeeping_after_a_whole_answer_is_logged(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The boundary's counting (metrics, access log) runs after a whole answer
    # went out. A bug there is logged once, and the connection goes on with
    # the request pipelined behind (escaping, it would reach aiohttp's
    # handle_error, which closes a connection whose answer began, unlogged).
    metrics = edge.app[METRICS]
    real = metrics.account_request
    calls: list[Any] = []

    def failing(*args: Any) -> None:
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("bookkeeping bug in the boundary")
        real(*args)

    monkeypatch.setattr(metrics, "account_request", failing)
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    statuses = []
    try:
        with caplog.at_level(logging.DEBUG):
            writer.write(_request(chat("one")) + _request(chat("two")))
            async with asyncio.timeout(10):
                for _ in range(2):  # both answered, on the same connection
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(length)
                    statuses.append(int(head.split()[1]))
    finally:
        writer.close()
    logged = [
        r
        for r in caplog.records
        if r.levelno >= logging.ERROR and "bookkeeping bug" in str(r.exc_info)
    ]
    assert statuses == [200, 200]
    assert len(logged) == 1


async def test_an_http10_stream_a_bug_stops_part_way_is_not_ended_as_if_whole(
    edge: Edge, broken_relay: list[BaseException]
) -> None:
    # Over HTTP/1.0 a stream ends with its connection (no chunked coding): an
    # orderly close would hand the client a whole-looking answer without
    # [DONE]. The connection is reset instead.
    broken_relay.append(RuntimeError("a bug part-way through the stream"))
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    try:
        writer.write(_request(STREAM, b"1.0"))
        async with asyncio.timeout(10):
            with pytest.raises(ConnectionResetError):
                await reader.read()  # to the connection's end
    finally:
        writer.close()
