"""A flight's leader whose client reads slowly, or not at all, does not pace
its followers (dataplane.http.reply.LeaderStream): they are paced by the
origin, and the leader's client, once further behind than the flight's bound,
is cut as a lagging follower is, with an error event, while the flight goes on.

The real proxy app on EdgeRunner (production's listener, handler cancellation
on) before a hand-written origin that the test paces by what the follower
has read, so that the follower never lags the flight itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dataplane.http import pipeline
from dataplane.http.errors import stream_broken_event
from dataplane.http.state import ACCESS_LOG, PIPELINE
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import KEY, MODEL
from tests.functional.test_whole_answers import Edge, Start, edges, request, until

# 32 KB events, 8 MB in all: past the leader's socket buffers (on loopback the
# kernel's send buffer grows to 4 MB) and the bound the test sets.
EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk","model":"'
    + MODEL.encode()
    + b'","choices":[{"index":0,"delta":{"content":"'
    + b"a" * (32 << 10)
    + b'"},"finish_reason":null}]}\n\n'
)
EVENTS = 256
LAST = (
    b'data: {"id":"x","object":"chat.completion.chunk","model":"'
    + MODEL.encode()
    + b'","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)
BOUND = 256 << 10  # the flight's (and so the leader's queue's) bound: 8 events
WINDOW = 4  # events the origin may send ahead of what the follower has read
BODY = {
    "model": MODEL,
    "temperature": 0,  # cacheable: identical requests fly together
    "stream": True,
    "messages": [{"role": "user", "content": "a long one"}],
}


@dataclass
class Paced:
    """Streams EVENTS events, each once the test lets it out, then LAST."""

    calls: int = 0
    allowed: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(0))
    # The relay's consumption alone paces it (all of it let out at once).
    free: bool = False

    def __post_init__(self) -> None:
        if self.free:
            self.allowed = asyncio.Semaphore(EVENTS)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for _ in range(EVENTS):
            await self.allowed.acquire()
            await out.write(EVENT)
        await out.write(LAST)
        await out.write_eof()
        return out


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    async with edges(tmp_path) as go:
        yield go


async def follow_to_the_end(edge: Edge, origin: Paced) -> tuple[dict[str, str], bytes]:
    """A fast follower's whole stream, the origin let out as it reads."""
    url = f"http://127.0.0.1:{edge.port}/v1/chat/completions"
    auth = {"authorization": f"Bearer {KEY.key}"}
    coalescer = edge.app[PIPELINE].cache.coalescer
    async with aiohttp.ClientSession() as session:
        answer = asyncio.create_task(session.post(url, json=BODY, headers=auth))
        await until(lambda: coalescer.stats.followers == 1)
        for _ in range(WINDOW):
            origin.allowed.release()
        let = WINDOW
        received = b""
        async with asyncio.timeout(20):
            response = await answer
            while chunk := await response.content.readany():
                received += chunk
                read = received.count(b"chat.completion.chunk")
                while let < min(read + WINDOW, EVENTS):
                    origin.allowed.release()
                    let += 1
        return dict(response.headers), received


async def test_a_leader_that_does_not_read_neither_paces_its_follower_nor_holds_it(
    start: Start, capfd: pytest.CaptureFixture[str]
) -> None:
    origin = Paced()
    edge = await start(origin, "--access-log=on")
    edge.app[PIPELINE].cache.coalescer.max_buffer_bytes = BOUND
    lreader, lwriter = await edge.connect()  # reads nothing until the end
    try:
        lwriter.write(request(json.dumps(BODY).encode()))
        await until(lambda: origin.calls == 1)
        # Before the fix, the relay waited for the leader's client to take each
        # write: the origin was not read past its socket buffers, the follower
        # got nothing more, and this timed out.
        headers, received = await follow_to_the_end(edge, origin)
        assert headers["x-ponto-coalesced"] == "1"
        assert received.count(b"chat.completion.chunk") == EVENTS + 1
        assert received.endswith(b"data: [DONE]\n\n") and b"error" not in received
        # The leader's client, further behind than the bound, was cut: it
        # reads what its connection held, then its error event and the end.
        rest = b""
        async with asyncio.timeout(20):
            while not rest.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
                chunk = await lreader.read(1 << 20)
                assert chunk, "the connection closed before the stream's end"
                rest += chunk
    finally:
        lwriter.close()
    head, _, body = rest.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert stream_broken_event() in body
    assert body.count(b"chat.completion.chunk") < EVENTS
    # The flight went on to its end: the answer is kept.
    assert edge.app[PIPELINE].cache.coalescer.stats.lagged == 0
    assert origin.calls == 1
    edge.app[ACCESS_LOG].flush()
    logged: list[dict[str, Any]] = [json.loads(x) for x in capfd.readouterr().out.splitlines()]
    # The follower's whole answer; the leader's stream cut, as a lagging
    # follower's is (logged with its status, as handed over).
    assert sorted((x["cache"], x["status"], x["error"]) for x in logged) == [
        ("hit", 200, None),
        ("miss", 200, "stream_cut"),
    ]


async def test_a_leader_cut_by_the_send_timeout_leaves_the_flight_going(
    start: Start, capfd: pytest.CaptureFixture[str]
) -> None:
    # A bound the stream does not reach: the leader's client, which never
    # reads, is cut by the edge's send timeout instead, alone.
    origin = Paced()
    edge = await start(origin, "--access-log=on", "--send-timeout=0.5")
    edge.app[PIPELINE].cache.coalescer.max_buffer_bytes = 64 << 20
    _lreader, lwriter = await edge.connect()
    try:
        lwriter.write(request(json.dumps(BODY).encode()))
        await until(lambda: origin.calls == 1)
        _headers, received = await follow_to_the_end(edge, origin)
        assert received.count(b"chat.completion.chunk") == EVENTS + 1
        assert received.endswith(b"data: [DONE]\n\n") and b"error" not in received
        code = {"endpoint": "chat.completions", "code": "499"}
        await until(lambda: edge.sample("ponto_requests_total", code) == 1)
    finally:
        lwriter.close()
    edge.app[ACCESS_LOG].flush()
    logged: list[dict[str, Any]] = [json.loads(x) for x in capfd.readouterr().out.splitlines()]
    assert sorted((x["cache"], x["status"], x["error"]) for x in logged) == [
        ("hit", 200, None),
        ("miss", 499, "send_timeout"),
    ]
    assert not edge.sample("ponto_client_disconnects_total", {})


async def test_a_follower_joining_while_the_leaders_client_holds_the_relay_is_not_held(
    tmp_path: Path,
) -> None:
    """A review: the relay, not followed yet, waited for its client to take a
    write (its socket's buffers full) when a follower joined; the follower
    waited as long, the whole --send-timeout for a client that takes
    nothing. The join now ends that wait (EdgeProtocol.release_drain)."""
    origin = Paced(free=True)
    oapp = web.Application()
    oapp.router.add_post("/v1/chat/completions", origin.handle)
    server = TestServer(oapp)
    await server.start_server()
    served = await serve_on_edge(tmp_path, str(server.make_url("/v1")), shutdown_timeout=1)
    edge = Edge(served.port, served.app)
    # What the relay published before it waited stays joinable.
    edge.app[PIPELINE].cache.coalescer.max_buffer_bytes = 64 << 20
    connections = served.runner.server._connections  # type: ignore[union-attr]
    try:
        _lreader, lwriter = await edge.connect(rcvbuf=4096)  # reads nothing
        try:
            lwriter.write(request(json.dumps(BODY).encode()))
            # The relay waits for the leader's client (aiohttp's drain waiter).
            await until(lambda: any(c._drain_waiter is not None for c in connections))
            _headers, received = await follow_to_the_end(edge, origin)
            assert received.count(b"chat.completion.chunk") == EVENTS + 1
            assert received.endswith(b"data: [DONE]\n\n") and b"error" not in received
            assert origin.calls == 1
        finally:
            lwriter.close()
    finally:
        await served.runner.cleanup()
        await server.close()


class Waits:
    """The asyncio module as dataplane.http.pipeline sees it, noting each
    asyncio.wait that it makes."""

    def __init__(self) -> None:
        self.made = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.made += 1
        return await asyncio.wait(*args, **kwargs)


async def test_a_leader_never_followed_is_awaited_without_asyncio_wait(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r4: every leader's request, followed or not, awaited its flight's
    task with asyncio.wait (for its client's cut, `let_go`), 2.4 us more than
    the `shield` of before; two callbacks on a future of its own now do."""
    origin = Paced(free=True)
    edge = await start(origin)
    waits = Waits()
    monkeypatch.setattr(pipeline, "asyncio", waits)
    url = f"http://127.0.0.1:{edge.port}/v1/chat/completions"
    auth = {"authorization": f"Bearer {KEY.key}"}
    async with aiohttp.ClientSession() as session, session.post(url, json=BODY, headers=auth) as r:
        received = await r.read()
    assert received.count(b"chat.completion.chunk") == EVENTS + 1
    assert received.endswith(b"data: [DONE]\n\n")
    assert edge.app[PIPELINE].cache.coalescer.stats.flights == 1  # it led a flight
    assert waits.made == 0
