"""OriginWire (dataplane/upstream/wire.py) against origins on loopback.

Well-behaved origins are aiohttp apps (what they saw is what aiohttp's server
parsed); origins that misbehave at the byte level, or whose connections are
counted, are raw asyncio servers (`RawOrigin`). Timeouts appear only where the
behaviour is a timeout (a read timeout of SHORT against an origin that goes
silent), and as a bound (BOUND) on waits that must end; nothing asserts how
fast anything was.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from dataplane.upstream import wire as wire_module
from dataplane.upstream.wire import (
    DEFAULT_HEADERS,
    USER_AGENT,
    OriginConnection,
    OriginFull,
    OriginWire,
    _Endpoint,
)
from ponto.originca import origin_ssl_context
from tests.tlsorigin import serving_tls

SHORT = 0.05  # the read timeout against an origin that never answers
BOUND = 5.0  # what a wait that must end may take before the test fails

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

# What a RawOrigin does with one request: write (or not) on the connection, and
# say whether to keep it open for the next request.
Answer = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]


def answering(*parts: bytes, keep_open: bool = True) -> Answer:
    """An answer that writes `parts`, each flushed before the next."""

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        for part in parts:
            writer.write(part)
            await writer.drain()
        return keep_open

    return answer


never_answering = answering()  # reads the request, then waits for the next or for EOF
hanging_up = answering(keep_open=False)  # reads the request, then closes


@dataclass
class RawOrigin:
    """A loopback origin speaking bytes: counts connections, keeps each request
    (head and body) and any bytes that were not a whole request head, and
    notes every connection its client closed."""

    answer: Answer = field(default_factory=lambda: answering(OK))
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    stray: list[bytes] = field(default_factory=list)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def url(self, path: str = "/v1/chat/completions") -> URL:
        return URL(f"http://127.0.0.1:{self.port}{path}")

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:  # a handler waiting for a request sees EOF
            writer.close()
        async with asyncio.timeout(BOUND):
            await asyncio.gather(*self._tasks)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.connections += 1
        try:
            while True:
                request = await self._read_request(reader)
                if request is None:
                    self.client_gone.set()
                    return
                self.requests.append(request)
                self.got_request.set()
                if not await self.answer(request, writer):
                    return
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request, or None once the client has closed the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                self.stray.append(exc.partial)
            return None
        except ConnectionError:
            return None
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return head + await reader.readexactly(length)


@pytest.fixture
async def origin() -> AsyncIterator[RawOrigin]:
    raw = RawOrigin()
    await raw.start()
    yield raw
    await raw.stop()


@pytest.fixture
async def wires() -> AsyncIterator[Callable[..., OriginWire]]:
    """Makes wires (connect and read timeouts BOUND unless given), closed at the end."""
    made: list[OriginWire] = []

    def make(**kw: Any) -> OriginWire:
        kw.setdefault("connect_timeout", BOUND)
        kw.setdefault("read_timeout", BOUND)
        made.append(OriginWire(**kw))
        return made[-1]

    yield make
    for each in made:
        await each.close()


@pytest.fixture
def wire(wires: Callable[..., OriginWire]) -> OriginWire:
    return wires()


def no_headers() -> CIMultiDict[str]:
    return CIMultiDict()


async def exchange(wire: OriginWire, origin: RawOrigin) -> bytes:
    """One whole call (body read, connection released); the body."""
    resp = await wire.post(origin.url(), b"{}", no_headers())
    return await resp.read()


# ---------------------------------------------------------------- the request


@dataclass
class Seen:
    """What an aiohttp origin saw of one request."""

    headers: CIMultiDictProxy[str]
    body: bytes
    host: str


@pytest.fixture
async def app_origin() -> AsyncIterator[tuple[TestServer, list[Seen]]]:
    """An aiohttp origin that records each request and answers 201 with JSON."""
    seen: list[Seen] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(Seen(request.headers, await request.read(), request.host))
        return web.json_response({"ok": True}, status=201, headers={"X-Origin": "o1"})

    app = web.Application(client_max_size=2**23)
    app.router.add_post("/v1/chat/completions", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server, seen
    await server.close()


async def test_a_post_carries_the_body_the_callers_headers_and_the_added_ones(
    wire: OriginWire, app_origin: tuple[TestServer, list[Seen]]
) -> None:
    server, seen = app_origin
    body = b'{"model": "m", "messages": []}'
    headers = CIMultiDict(
        {"Content-Type": "application/json", "X-Request-Id": "r1", "X-Multi": "a"}
    )
    headers.add("X-Multi", "b")
    resp = await wire.post(server.make_url("/v1/chat/completions"), body, headers)
    try:
        assert resp.status == 201
        assert resp.headers["X-Origin"] == "o1"
        assert resp.content_type == "application/json"  # without "; charset=utf-8"
        assert await resp.read() == b'{"ok": true}'
    finally:
        resp.close()

    [request] = seen
    assert request.body == body
    assert request.headers["X-Request-Id"] == "r1"
    assert request.headers.getall("X-Multi") == ["a", "b"]
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers.getall(hdrs.HOST) == [f"127.0.0.1:{server.port}"]
    assert request.headers.getall(hdrs.CONTENT_LENGTH) == [str(len(body))]
    for name, value in DEFAULT_HEADERS:
        assert request.headers.getall(name) == [value]
    # Not aiohttp's default, which told origins the versions of Python and aiohttp.
    assert request.headers[hdrs.USER_AGENT] == USER_AGENT == "ponto-proxy"


async def test_the_callers_own_user_agent_and_accept_encoding_are_kept_once(
    wire: OriginWire, app_origin: tuple[TestServer, list[Seen]]
) -> None:
    server, seen = app_origin
    headers = CIMultiDict({"user-agent": "ponto-test/1", "accept-encoding": "identity"})
    resp = await wire.post(server.make_url("/v1/chat/completions"), b"{}", headers)
    await resp.read()
    [request] = seen
    assert request.headers.getall(hdrs.USER_AGENT) == ["ponto-test/1"]
    assert request.headers.getall(hdrs.ACCEPT_ENCODING) == ["identity"]
    assert request.headers.getall(hdrs.ACCEPT) == ["*/*"]  # not set by the caller: added


async def test_credentials_in_an_origin_url_are_sent_as_basic_auth_to_that_origin_only(
    wire: OriginWire, app_origin: tuple[TestServer, list[Seen]]
) -> None:
    server, seen = app_origin
    plain = server.make_url("/v1/chat/completions")
    secured = plain.with_user("ponto").with_password("s3cret")
    headers: CIMultiDict[str] = CIMultiDict({"content-type": "application/json"})
    for url in (secured, plain):  # one dict, as a request's attempts share it
        resp = await wire.post(url, b"{}", headers)
        await resp.read()
    own = CIMultiDict({"authorization": "Bearer origin-key"})
    resp = await wire.post(secured, b"{}", own)
    await resp.read()
    first, second, third = seen
    assert first.headers[hdrs.AUTHORIZATION] == aiohttp.encode_basic_auth("ponto", "s3cret")
    assert hdrs.AUTHORIZATION not in second.headers
    assert third.headers.getall(hdrs.AUTHORIZATION) == ["Bearer origin-key"]  # the call's own wins


async def test_one_header_dict_serves_attempts_on_two_origins(
    wire: OriginWire, app_origin: tuple[TestServer, list[Seen]], origin: RawOrigin
) -> None:
    # Host and Content-Length are set again on each call, never left from the last.
    server, seen = app_origin
    headers = CIMultiDict({"X-Request-Id": "r1"})
    first = await wire.post(server.make_url("/v1/chat/completions"), b"{}", headers)
    await first.read()
    second = await wire.post(origin.url(), b"[1]", headers)
    await second.read()
    assert seen[0].host == f"127.0.0.1:{server.port}"
    [raw] = origin.requests
    head, _, body = raw.partition(b"\r\n\r\n")
    line, *fields = head.lower().split(b"\r\n")
    assert line == b"post /v1/chat/completions http/1.1"
    host = f"host: 127.0.0.1:{origin.port}".encode()
    assert [f for f in fields if f.startswith(b"host:")] == [host]
    assert [f for f in fields if f.startswith(b"content-length:")] == [b"content-length: 3"]
    assert body == b"[1]"


# ---------------------------------------------------------------- keep-alive


async def test_sequential_calls_reuse_one_connection(wire: OriginWire, origin: RawOrigin) -> None:
    for _ in range(3):
        assert await exchange(wire, origin) == b"{}"
    assert (origin.connections, len(origin.requests)) == (1, 3)


async def test_a_kept_alive_connection_keeps_its_response_parser_across_calls(
    wire: OriginWire, origin: RawOrigin
) -> None:
    parsers = []
    for body in (b'{"a":1}', b'{"bb":22}', b"{}"):
        origin.answer = answering(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        resp = await wire.post(origin.url(), b"{}", no_headers())
        assert resp._conn is not None
        parsers.append(resp._conn._parser)
        assert await resp.read() == body
    assert origin.connections == 1
    assert parsers[0] is not None
    assert parsers[0] is parsers[1] is parsers[2]


class Transport(asyncio.Transport):
    """Takes writes; notes whether it was closed."""

    closed = False

    def is_closing(self) -> bool:
        return self.closed

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def fed_connection() -> tuple[OriginConnection, Transport]:
    """An OriginConnection on a Transport, not in any pool."""
    conn = OriginConnection(asyncio.get_running_loop())
    transport = Transport()
    conn.connection_made(transport)
    return conn, transport


async def test_bytes_no_call_asked_for_close_the_connection() -> None:
    conn, transport = fed_connection()
    head = conn.expect(BOUND)
    conn.data_received(OK)
    message, payload = await head
    assert (message.code, await payload.read()) == (200, b"{}")
    assert conn.is_idle()
    conn.data_received(b"HTTP/1.1 2")  # after the whole answer, in a read of its own
    assert (transport.closed, conn.is_idle(), conn.reusable) == (True, False, False)
    conn.connection_lost(None)


async def test_a_second_answer_to_one_request_closes_the_connection() -> None:
    conn, transport = fed_connection()
    head = conn.expect(BOUND)
    conn.data_received(OK + OK)
    message, _ = await head
    assert message.code == 200
    assert transport.closed and not conn.reusable
    conn.connection_lost(None)


async def test_a_body_paused_for_its_reader_resumes_and_its_connection_serves_the_next() -> None:
    conn, _ = fed_connection()
    head = conn.expect(BOUND)
    big = wire_module.READ_BUFSIZE * 3  # past the reader's high-water mark: reading pauses
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (big + 2))
    _, payload = await head
    conn.data_received(b"x" * big)
    assert conn._reading_paused
    conn.data_received(b"yz")  # the transport delivered it before the pause took hold
    assert await payload.read() == b"x" * big + b"yz"
    assert (conn._reading_paused, conn.is_idle()) == (False, True)
    head = conn.expect(BOUND)
    conn.data_received(OK)
    message, payload = await head
    assert (message.code, await payload.read()) == (200, b"{}")
    conn.connection_lost(None)


def chunked_answer(chunks: int, size: int) -> bytes:
    """A 200 whose body is `chunks` chunks of `size` bytes."""
    chunk = b"%x\r\n" % size + b"x" * size + b"\r\n"
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * chunks + b"0\r\n\r\n"


async def test_no_read_timeout_runs_while_a_resumed_body_pauses_again_for_its_reader() -> None:
    # One read holds more chunks than the reader's high-water mark: the parser
    # keeps the rest, and feeds it when the reader catches up, which pauses
    # reading again. The reader is the slow one then: no timeout may run.
    conn, _ = fed_connection()
    head = conn.expect(BOUND)
    conn.start_timeout()
    size = 2**14
    conn.data_received(chunked_answer(wire_module.READ_BUFSIZE * 5 // size, size))
    _, payload = await head
    assert conn._reading_paused and not conn._deadline.armed
    payload.read_nowait(wire_module.READ_BUFSIZE * 3 // 2)  # below the low-water mark: resumes
    assert conn._reading_paused  # the parser's rest filled the buffer again
    assert not conn._deadline.armed
    conn.connection_lost(None)


async def test_a_connection_whose_parser_paused_at_an_answers_end_serves_the_next() -> None:
    # More unread chunks than a body's reader takes pause the parser from the
    # chunk's end, not from a body byte: at the answer's last chunk, nothing
    # consumes that pause before the answer ends, and the next answer would
    # stop at its first body byte (a call waiting for nothing until its read
    # timeout, or for ever without one).
    conn, _ = fed_connection()
    head = conn.expect(None)
    conn.data_received(chunked_answer(wire_module.READ_BUFSIZE // 16 + 1, 1))
    _, payload = await head
    assert payload.is_eof()
    payload.read_nowait()
    assert conn.is_idle()
    head = conn.expect(None)
    conn.data_received(OK)
    message, payload = await head
    assert (message.code, payload.is_eof()) == (200, True)
    assert payload.read_nowait() == b"{}"
    conn.connection_lost(None)


async def test_bytes_in_the_same_read_as_an_answers_end_fail_the_next_answer() -> None:
    # llhttp takes them as the start of the next answer: the next call fails to
    # parse (and is tried on the next origin), where a parser per call would
    # have dropped them. Only an origin that breaks HTTP/1.1 sends them.
    conn, transport = fed_connection()
    head = conn.expect(BOUND)
    conn.data_received(OK + b"HTTP/1.1 2")
    await head
    head = conn.expect(BOUND)
    conn.data_received(OK)
    with pytest.raises(aiohttp.ClientPayloadError, match="unparsable answer"):
        await head
    assert transport.closed
    conn.connection_lost(None)


async def test_release_after_the_body_pools_the_connection(
    wire: OriginWire, origin: RawOrigin
) -> None:
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.content.read() == b"{}"
    resp.release()
    resp.release()  # idempotent
    resp.close()  # a no-op once released: the connection stays pooled
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 1


async def test_release_with_the_body_unread_closes_the_connection(
    wire: OriginWire, origin: RawOrigin
) -> None:
    # Four bytes announced, two sent: the body has not ended when it is released.
    origin.answer = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert resp.status == 200
    resp.release()
    resp.release()
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_a_body_that_ends_with_the_connection_is_read_whole(
    wire: OriginWire, origin: RawOrigin
) -> None:
    # No Content-Length, not chunked: the body is what comes before EOF.
    origin.answer = answering(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: hi\n\n", keep_open=False
    )
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.read() == b"data: hi\n\n"
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2  # that connection ended with its body: never pooled


async def test_a_connection_still_sending_its_request_is_not_pooled(wire: OriginWire) -> None:
    # An origin that answers once it has the head and reads no more of the body
    # (a 413, say): the rest of the body is still in the proxy's buffers when the
    # answer is done, so the next request must not queue behind it.
    connections = 0
    done = asyncio.Event()
    handlers: set[asyncio.Task[None]] = set()

    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await done.wait()  # and reads nothing more
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(early, "127.0.0.1", 0)
    url = URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions")
    try:
        resp = await wire.post(url, b"x" * (32 << 20), no_headers())
        assert resp.status == 413
        assert await resp.read() == b""
        resp = await wire.post(url, b"{}", no_headers())  # a new connection
        assert resp.status == 413
        resp.close()
        assert connections == 2
    finally:
        done.set()
        server.close()
        async with asyncio.timeout(BOUND):
            await asyncio.gather(*handlers, return_exceptions=True)
            await server.wait_closed()


async def test_close_always_closes_the_connection(wire: OriginWire, origin: RawOrigin) -> None:
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.content.read() == b"{}"  # read to its end, and still closed
    resp.close()
    resp.close()
    resp.release()  # a no-op once closed
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_an_origin_that_says_connection_close_is_not_pooled(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = answering(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert await exchange(wire, origin) == b"{}"
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_urls_of_one_origin_share_its_pool(wire: OriginWire, origin: RawOrigin) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/chat/completions?x=1"):
        resp = await wire.post(origin.url(path), b"{}", no_headers())
        assert await resp.read() == b"{}"
    assert origin.connections == 1
    assert len(wire._pools) == 1


async def test_connections_to_an_origin_are_capped_and_calls_past_the_cap_wait_in_turn(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(limit_per_host=2)
    held = [await wire.post(origin.url(), b"{}", no_headers()) for _ in range(2)]
    waiting = [asyncio.create_task(wire.post(origin.url(), b"{}", no_headers())) for _ in range(3)]
    await asyncio.sleep(0)
    waiting[0].cancel()  # a call that gives up while waiting passes its turn on
    for resp in held:
        assert await resp.read() == b"{}"
    async with asyncio.timeout(BOUND):
        answers = await asyncio.gather(*waiting[1:])
    assert [await resp.read() for resp in answers] == [b"{}", b"{}"]
    assert waiting[0].cancelled()
    assert origin.connections == 2


async def test_a_connection_freed_goes_to_the_call_that_waited_not_to_one_arriving(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(limit_per_host=1)
    held = await wire.post(origin.url(), b"{}", no_headers())
    waited = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    await asyncio.sleep(0)
    assert await held.read() == b"{}"  # frees the connection while `waited` waits
    with pytest.raises(TimeoutError):  # a call arriving now, before `waited` runs, waits
        async with asyncio.timeout(SHORT):
            await wire.post(origin.url(), b"{}", no_headers())
    async with asyncio.timeout(BOUND):
        resp = await waited
    assert await resp.read() == b"{}"
    assert await exchange(wire, origin) == b"{}"  # the one that gave up left no trace
    assert origin.connections == 1


async def test_a_woken_call_takes_a_connection_freed_before_it_ran_not_a_new_one(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # A place comes free (a connection lost) and wakes the waiting call; before
    # it runs, another connection is freed and, no call waiting, pooled idle.
    # The woken call takes that one (opening another would leave one idle,
    # and at the cap it would wait again beside it).
    wire = wires(limit_per_host=2)
    held = [await wire.post(origin.url(), b"{}", no_headers()) for _ in range(2)]
    waiting = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    [pool] = wire._pools.values()
    while not pool.waiters:
        await asyncio.sleep(0)
    assert held[1].content.is_eof()
    held[0].close()
    while pool.waiters:  # the loss told: `waiting` is woken, and runs after this
        await asyncio.sleep(0)
    assert not waiting.done() and pool.open == 1
    held[1].release()  # pooled idle: no call waits now
    assert len(pool.idle) == 1
    async with asyncio.timeout(BOUND):
        resp = await waiting
    assert await resp.read() == b"{}"
    assert origin.connections == 2 and pool.open == 1 and len(pool.idle) == 1


async def test_a_call_arriving_while_another_waits_queues_behind_it_though_one_is_idle(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # A call that waits keeps its turn against calls arriving after it,
    # whatever is idle meanwhile: the idle one is the waiting call's first.
    # Set up by hand: _take leaves no call waiting beside an idle connection.
    wire = wires(limit_per_host=1)
    assert await exchange(wire, origin) == b"{}"
    [pool] = wire._pools.values()
    [idle] = pool.idle
    waiting: asyncio.Future[OriginConnection | None] = asyncio.get_running_loop().create_future()
    pool.waiters.append(waiting)
    arriving = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not arriving.done() and list(pool.idle) == [idle]
    assert len(pool.waiters) == 2 and len(origin.requests) == 1
    pool.waiters.remove(waiting)  # the waiting call leaves: its turn passes on
    wire._serve(pool)
    async with asyncio.timeout(BOUND):
        resp = await arriving
    assert await resp.read() == b"{}"
    assert origin.connections == 1


async def test_an_idle_connection_found_closing_is_closed_and_not_taken(
    wire: OriginWire, origin: RawOrigin
) -> None:
    # Its transport closing, its loss not yet told (connection_lost comes in a
    # later turn of the loop): the call opens another.
    assert await exchange(wire, origin) == b"{}"
    [pool] = wire._pools.values()
    [idle] = pool.idle
    assert idle.transport is not None
    idle.transport.close()
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2 and len(origin.requests) == 2
    assert idle not in pool.idle


async def test_a_call_woken_then_cancelled_passes_its_turn_on(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(limit_per_host=1)
    held = await wire.post(origin.url(), b"{}", no_headers())
    woken = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    after = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    await asyncio.sleep(0)
    assert await held.read() == b"{}"  # wakes `woken`, which is cancelled before it runs
    woken.cancel()
    async with asyncio.timeout(BOUND):
        resp = await after
    assert await resp.read() == b"{}"
    assert woken.cancelled()
    assert origin.connections == 1


async def test_a_connection_the_origin_closed_while_idle_is_not_reused(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = answering(OK, keep_open=False)  # no Connection: close, then closed
    assert await exchange(wire, origin) == b"{}"
    [pool] = wire._pools.values()
    async with asyncio.timeout(BOUND):
        while pool.open:  # the proxy saw the close
            await asyncio.sleep(0.01)
    assert not pool.idle
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_an_idle_connection_is_closed_after_the_keepalive_timeout(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(keepalive_timeout=SHORT)
    assert await exchange(wire, origin) == b"{}"
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()
    [pool] = wire._pools.values()
    async with asyncio.timeout(BOUND):
        while pool.open:
            await asyncio.sleep(0.01)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_closing_the_wire_closes_its_idle_connections(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires()
    assert await exchange(wire, origin) == b"{}"
    await wire.close()
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()


async def test_a_call_under_way_when_the_wire_closes_closes_its_connection_at_its_end(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # Pooled, it would stay open with nothing left to close it (the sweeper
    # stopped with the wire); and a call after close opens nothing.
    wire = wires()
    resp = await wire.post(origin.url(), b"{}", no_headers())
    await wire.close()
    assert await resp.read() == b"{}"
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()
    with pytest.raises(aiohttp.ClientConnectionError, match="closed"):
        await wire.post(origin.url(), b"{}", no_headers())
    assert origin.connections == 1


async def test_a_call_waiting_for_a_connection_when_the_wire_closes_fails(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(limit_per_host=1)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    waiting = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    while not wire._endpoint(origin.url()).pool.waiters:
        await asyncio.sleep(0)
    await wire.close()
    with pytest.raises(aiohttp.ClientConnectionError, match="closed"):
        async with asyncio.timeout(BOUND):
            await waiting
    resp.close()


# A stream's head: the call that gets it holds its connection until released.
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def test_a_tenant_past_its_share_is_refused_and_another_is_served(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # The trial: one tenant's streams held every connection to the origin,
    # and another tenant's call waited behind them, untimed.
    origin.answer = answering(STREAM_HEAD)
    wire = wires(limit_per_host=4, share_limit=2)
    alpha = await wire.post(origin.url(), b"{}", no_headers(), tenant="alpha")
    held = [await wire.post(origin.url(), b"{}", no_headers(), tenant="beta") for _ in range(2)]
    with pytest.raises(OriginFull, match="share") as refused:
        await wire.post(origin.url(), b"{}", no_headers(), tenant="beta")
    assert refused.value.why == "share"
    assert len(origin.requests) == 3  # the refused call sent nothing
    second = await wire.post(origin.url(), b"{}", no_headers(), tenant="alpha")
    [pool] = wire._pools.values()
    assert pool.shares == {"beta": 2, "alpha": 2}
    held[0].release()  # a stream's end frees a place in its tenant's share
    alpha.close()
    second.close()
    assert pool.shares == {"beta": 1}
    # Alone on the origin, beta may go past its share, to all but the
    # reserve kept for the tenants that come after it (an eighth, at least 1).
    more = [await wire.post(origin.url(), b"{}", no_headers(), tenant="beta") for _ in range(2)]
    assert pool.shares == {"beta": 3}
    with pytest.raises(OriginFull, match="kept for other tenants"):
        await wire.post(origin.url(), b"{}", no_headers(), tenant="beta")
    # So a tenant that comes after it finds a connection at once (a review:
    # it waited behind beta's streams, past its queue timeout).
    late = await wire.post(origin.url(), b"{}", no_headers(), tenant="alpha")
    assert pool.shares == {"beta": 3, "alpha": 1}
    for resp in (held[1], *more, late):
        resp.close()
        resp.close()  # once only
    assert pool.shares == {}


async def test_a_share_of_the_whole_pool_keeps_no_reserve(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    origin.answer = answering(STREAM_HEAD)
    wire = wires(limit_per_host=4, share_limit=4)
    held = [await wire.post(origin.url(), b"{}", no_headers(), tenant="beta") for _ in range(4)]
    [pool] = wire._pools.values()
    assert pool.shares == {"beta": 4}
    for resp in held:
        resp.close()


async def test_a_whole_answer_read_at_once_leaves_its_share_and_rests_its_connection(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # read_now gives its connection back with release()'s steps of its own:
    # the tenant's place in the pool's share is freed, and the connection,
    # its answer ended, goes back idle for the next call.
    wire = wires(share_limit=1)
    for _ in range(3):
        resp = await wire.post(origin.url(), b"{}", no_headers(), tenant="beta")
        async with asyncio.timeout(BOUND):
            while (body := resp.read_now()) is None:
                await asyncio.sleep(0)  # a turn of the loop for the body's bytes
        assert body == b"{}"
        [pool] = wire._pools.values()
        assert pool.shares == {}
        assert len(pool.idle) == 1
    assert origin.connections == 1


async def test_a_call_that_fails_leaves_its_tenants_share(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    origin.answer = hanging_up
    wire = wires(share_limit=1)
    for _ in range(2):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await wire.post(origin.url(), b"{}", no_headers(), tenant="beta")
    [pool] = wire._pools.values()
    assert pool.shares == {}


async def test_a_call_with_no_connection_within_the_queue_timeout_fails_and_leaves_the_queue(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(limit_per_host=1, queue_timeout=SHORT)
    held = await wire.post(origin.url(), b"{}", no_headers(), tenant="beta")
    with pytest.raises(OriginFull, match="--origin-queue-timeout") as refused:
        async with asyncio.timeout(BOUND):
            await wire.post(origin.url(), b"{}", no_headers(), tenant="alpha")
    assert refused.value.why == "queue"
    assert len(origin.requests) == 1
    [pool] = wire._pools.values()
    assert not pool.waiters and pool.shares == {"beta": 1}
    assert await held.read() == b"{}"
    assert await exchange(wire, origin) == b"{}"  # the freed connection, taken at once
    assert origin.connections == 1


async def test_a_connection_handed_as_the_queue_timeout_passes_is_passed_on(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # The waiting call is handed the connection and times out before it runs:
    # the connection goes to the next call, not lost with it.
    wire = wires(limit_per_host=1, queue_timeout=SHORT)
    held = await wire.post(origin.url(), b"{}", no_headers())
    waiting = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    [pool] = wire._pools.values()
    while not pool.waiters:
        await asyncio.sleep(0)
    assert held.content.is_eof()  # released, its connection goes to `waiting`
    time.sleep(2 * SHORT)  # the loop blocked: the waiter's timer is due when it runs
    # In the loop's next turn, before the timer (due timers run after what was ready).
    asyncio.get_running_loop().call_soon(held.release)
    with pytest.raises(OriginFull):
        async with asyncio.timeout(BOUND):
            await waiting
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 1


@pytest.fixture
async def tls_origin(tmp_path: Path) -> AsyncIterator[tuple[URL, ssl.SSLContext]]:
    """An https origin whose certificate a private CA issued, and a client
    context that trusts that CA (as --origin-ca makes it)."""

    async def handle(request: web.Request) -> web.Response:
        return web.json_response({"tls": request.secure})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    async with serving_tls(app, tmp_path) as (root, bundle):
        trusting = origin_ssl_context(bundle.ca)
        assert trusting is not None
        yield root.with_path("/v1/chat/completions"), trusting


async def test_an_https_origin_is_called_over_verified_tls(
    wires: Callable[..., OriginWire], tls_origin: tuple[URL, ssl.SSLContext]
) -> None:
    url, trusting = tls_origin
    wire = wires(ssl_context=trusting)
    for _ in range(2):
        resp = await wire.post(url, b"{}", no_headers())
        assert await resp.read() == b'{"tls": true}'
    [pool] = wire._pools.values()
    assert pool.open == 1  # kept alive


async def test_an_https_origin_with_an_untrusted_certificate_is_refused(
    wire: OriginWire, tls_origin: tuple[URL, ssl.SSLContext]
) -> None:
    url, _ = tls_origin
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await wire.post(url, b"{}", no_headers())
    [pool] = wire._pools.values()
    assert pool.open == 0


# ---------------------------------------------------------------- failures


async def test_an_origin_that_never_answers_times_out_and_its_connection_closes(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(read_timeout=SHORT)
    origin.answer = never_answering
    with pytest.raises(aiohttp.ServerTimeoutError) as caught:
        async with asyncio.timeout(BOUND):  # a TimeoutError, but not aiohttp's
            await wire.post(origin.url(), b"{}", no_headers())
    assert isinstance(caught.value, TimeoutError)
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


def dripping(answer: bytes, gap: float, sent: list[int]) -> Answer:
    """An answer written a byte at a time, `gap` seconds apart (each well
    under the read timeout, all of them far over it); `sent` counts the
    bytes written."""

    async def drip(request: bytes, writer: asyncio.StreamWriter) -> bool:
        with contextlib.suppress(ConnectionError):
            for at in range(len(answer)):
                if writer.is_closing():
                    break
                writer.write(answer[at : at + 1])
                await writer.drain()
                sent[0] = at + 1
                await asyncio.sleep(gap)
        return False

    return drip


async def test_an_origin_dripping_its_head_times_out_within_one_read_timeout(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # Trial 65: each byte of the head started the read timeout over, and an
    # origin sending its head a byte a second held the call as long as it liked.
    timeout = 0.25
    wire = wires(read_timeout=timeout)
    sent = [0]
    origin.answer = dripping(OK, timeout / 10, sent)
    with pytest.raises(aiohttp.ServerTimeoutError):
        async with asyncio.timeout(BOUND):
            await wire.post(origin.url(), b"{}", no_headers())
    assert 0 < sent[0] < OK.index(b"\r\n\r\n")  # cut while the head still dripped


class Clock:
    """The running loop's clock, moved by the test (its timers fire on the
    loop's next turn once it has passed them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: self.now)

    async def advance(self, seconds: float) -> None:
        self.now += seconds
        for _ in range(3):  # the timer's turn, then its callback's
            await asyncio.sleep(0)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def test_a_heads_bytes_do_not_start_the_read_timeout_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock(monkeypatch)
    conn, transport = fed_connection()
    head = conn.expect(1.0)
    conn.start_timeout()
    for at in range(len(STREAM_HEAD) - 1):  # all but its last byte, each 0.1 s apart
        conn.data_received(STREAM_HEAD[at : at + 1])
        await clock.advance(0.1)
    assert head.done()
    assert isinstance(head.exception(), TimeoutError)
    assert transport.closed
    conn.connection_lost(None)


async def test_the_bodys_first_byte_is_due_by_the_heads_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock(monkeypatch)
    conn, _ = fed_connection()
    head = conn.expect(1.0)
    conn.start_timeout()
    await clock.advance(0.6)
    conn.data_received(STREAM_HEAD)
    _, payload = await head
    await clock.advance(0.6)  # 1.2 s from sending, without a byte of the body
    assert isinstance(payload.exception(), TimeoutError)
    conn.connection_lost(None)


async def test_after_the_bodys_first_byte_each_byte_starts_the_read_timeout_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock(monkeypatch)
    conn, _ = fed_connection()
    head = conn.expect(1.0)
    conn.start_timeout()
    await clock.advance(0.6)
    conn.data_received(STREAM_HEAD + b"1\r\na\r\n")  # the body's first byte with the head
    _, payload = await head
    for _ in range(3):  # 0.9 s apart: 3.3 s from sending in all
        await clock.advance(0.9)
        conn.data_received(b"1\r\nb\r\n")
    assert payload.exception() is None
    assert await payload.readany() == b"abbb"
    conn.connection_lost(None)


async def test_a_call_waiting_for_a_free_connection_is_not_timed_out_by_connect(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # One connection per origin: the second call waits for the first's, longer
    # than the connect timeout, and is served once it is free (a busy origin is
    # not a failing one).
    wire = wires(connect_timeout=SHORT, limit_per_host=1)
    first = await wire.post(origin.url(), b"{}", no_headers())
    second = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    await asyncio.sleep(4 * SHORT)  # the waiting call outlives the connect timeout
    assert not second.done()
    assert await first.read() == b"{}"  # its connection goes back to the pool
    async with asyncio.timeout(BOUND):
        resp = await second
    assert await resp.read() == b"{}"
    assert origin.connections == 1


async def test_a_refused_connection_is_a_client_error(wire: OriginWire) -> None:
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(aiohttp.ClientConnectorError):
        await wire.post(URL(f"http://127.0.0.1:{port}/v1"), b"{}", no_headers())


async def test_a_call_cancelled_while_waiting_for_the_head_closes_its_connection(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = never_answering
    call = asyncio.create_task(wire.post(origin.url(), b"{}", no_headers()))
    async with asyncio.timeout(BOUND):
        await origin.got_request.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-note", "a\r\nx-injected: 1"),
        ("x-note", "a\nx-injected: 1"),
        ("x-note", "a\rb"),
        ("x-note\r\nx-injected", "1"),
    ],
)
async def test_a_header_with_cr_or_lf_is_refused_before_anything_is_sent(
    wire: OriginWire, origin: RawOrigin, name: str, value: str
) -> None:
    with pytest.raises(ValueError, match="Forbidden control character"):
        await wire.post(origin.url(), b"{}", CIMultiDict({name: value}))
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()  # closed, not pooled
    assert (origin.requests, origin.stray) == ([], [])
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_an_origin_that_closes_without_answering_is_a_disconnect(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = hanging_up
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await wire.post(origin.url(), b"{}", no_headers())


async def test_a_garbage_status_line_is_a_client_error_and_closes_the_connection(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = answering(b"SPDY/9 whatever\r\n\r\n")
    with pytest.raises(aiohttp.ClientError):
        await wire.post(origin.url(), b"{}", no_headers())
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_a_body_cut_short_fails_its_read_and_closes_the_connection(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab", keep_open=False)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    resp.release()  # a no-op: read() closed it
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_a_body_that_stalls_times_out_and_its_connection_closes(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    wire = wires(read_timeout=SHORT)
    origin.answer = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
    resp = await wire.post(origin.url(), b"{}", no_headers())
    with pytest.raises(aiohttp.ServerTimeoutError):
        async with asyncio.timeout(BOUND):
            await resp.read()
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()


async def test_a_body_that_keeps_coming_outlasts_several_read_timeouts(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # The read timeout bounds the silence between bytes, not the whole answer:
    # a timer armed for the first bytes must not fail the later ones.
    timeout, gap, parts = 0.5, 0.1, 8  # gaps a fifth of the timeout, 1.6 timeouts in all

    async def trickling(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % parts)
        for _ in range(parts):
            await asyncio.sleep(gap)
            writer.write(b"x")
            await writer.drain()
        return True

    wire = wires(read_timeout=timeout)
    origin.answer = trickling
    resp = await wire.post(origin.url(), b"{}", no_headers())
    async with asyncio.timeout(BOUND):
        assert await resp.read() == b"x" * parts


# ---------------------------------------------------------------- answers


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n",
    ],
)
async def test_interim_answers_are_skipped(
    wire: OriginWire, origin: RawOrigin, interim: bytes
) -> None:
    origin.answer = answering(interim, OK)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert (resp.status, resp.content_type) == (200, "application/json")
    assert await resp.read() == b"{}"
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 1


async def test_the_read_timeout_still_runs_after_an_interim_answer(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # The parser stops the read timeout when a head arrives (its payload is
    # empty); after a 100 the final head is still awaited and must be bounded.
    wire = wires(read_timeout=SHORT)
    origin.answer = answering(b"HTTP/1.1 100 Continue\r\n\r\n")
    with pytest.raises(aiohttp.ServerTimeoutError):
        async with asyncio.timeout(BOUND):
            await wire.post(origin.url(), b"{}", no_headers())
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()


async def test_interim_and_final_answers_in_one_packet_leave_no_timer_behind(
    wires: Callable[..., OriginWire], origin: RawOrigin
) -> None:
    # The pooled connection must not carry a read timeout armed for an
    # answer that had already arrived: the next call on it would fail.
    wire = wires(read_timeout=SHORT)
    origin.answer = answering(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    try:
        assert resp._conn is not None
        assert not resp._conn._deadline.armed  # the body has ended: nothing to time
        assert await resp.read() == b"{}"
    finally:
        resp.close()  # a no-op once read
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 1


async def test_an_answer_without_a_body_reads_empty_and_pools(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = answering(b"HTTP/1.1 204 No Content\r\n\r\n")
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert (resp.status, resp.content_type) == (204, "")
    assert await resp.read() == b""
    assert await exchange(wire, origin) == b""
    assert origin.connections == 1


async def test_a_large_body_arrives_whole(
    wire: OriginWire, app_origin: tuple[TestServer, list[Seen]]
) -> None:
    # Far beyond a socket's buffers: written in one go, it still arrives intact.
    server, seen = app_origin
    body = bytes(range(256)) * 16384  # 4 MiB
    resp = await wire.post(server.make_url("/v1/chat/completions"), body, no_headers())
    try:
        assert resp.status == 201
        await resp.read()
    finally:
        resp.close()
    assert seen[0].body == body


async def test_a_gzip_answer_comes_back_decompressed(wire: OriginWire, origin: RawOrigin) -> None:
    plain = b'{"choices": []}' * 100
    packed = gzip.compress(plain)
    origin.answer = answering(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
        + f"Content-Length: {len(packed)}\r\n\r\n".encode()
        + packed
    )
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.read() == plain
    assert b"\r\naccept-encoding: gzip, deflate\r\n" in origin.requests[0].lower()


# ------------------------------------------------------- the answer's size bound


LIMIT = 100_000  # a read's bound in the tests below


def chunked(*chunks: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)


@pytest.mark.parametrize("size", [LIMIT - 1, LIMIT])
async def test_a_body_up_to_the_bound_is_read_whole(
    wire: OriginWire, origin: RawOrigin, size: int
) -> None:
    # In two chunks, the second after a pause: read through readany, not whole at once.
    origin.answer = answering(CHUNKED_HEAD + chunked(b"a" * 10)[:-5], chunked(b"b" * (size - 10)))
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.read(LIMIT) == b"a" * 10 + b"b" * (size - 10)
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"  # the connection was pooled
    assert origin.connections == 1


async def test_a_body_that_grows_past_the_bound_fails_its_read_and_closes_the_connection(
    wire: OriginWire, origin: RawOrigin
) -> None:
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        # Past the bound, and never ended: the read must stop at the bound.
        writer.write(CHUNKED_HEAD)
        for _ in range(LIMIT // 4096 + 1):
            writer.write(b"1000\r\n" + b"x" * 4096 + b"\r\n")
            await writer.drain()
        return True

    origin.answer = answer
    resp = await wire.post(origin.url(), b"{}", no_headers())
    with pytest.raises(wire_module.AnswerTooLarge) as caught:
        await resp.read(LIMIT)
    assert (caught.value.limit, caught.value.size > LIMIT) == (LIMIT, True)
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()


async def test_a_declared_length_past_the_bound_fails_before_the_body_is_read(
    wire: OriginWire, origin: RawOrigin
) -> None:
    origin.answer = answering(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {10 * LIMIT}\r\n\r\n".encode()
        + b"{"  # the rest never comes: the read must not wait for it
    )
    resp = await wire.post(origin.url(), b"{}", no_headers())
    with pytest.raises(wire_module.AnswerTooLarge) as caught:
        async with asyncio.timeout(BOUND):
            await resp.read(LIMIT)
    assert caught.value.size == 10 * LIMIT
    async with asyncio.timeout(BOUND):
        await origin.client_gone.wait()


async def test_a_body_that_came_whole_with_its_head_is_bounded_too(
    wire: OriginWire, origin: RawOrigin
) -> None:
    # No Content-Length to refuse early, and the whole body in the first read.
    body = b"x" * (LIMIT + 1)
    origin.answer = answering(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n" + body,
        keep_open=False,
    )
    resp = await wire.post(origin.url(), b"{}", no_headers())
    async with asyncio.timeout(BOUND):
        while not resp.content.is_eof():
            await asyncio.sleep(0.01)  # until the origin's close has ended the body
    with pytest.raises(wire_module.AnswerTooLarge):
        await resp.read(LIMIT)


async def test_a_gzip_answer_is_bounded_by_its_size_decompressed(
    wire: OriginWire, origin: RawOrigin
) -> None:
    plain = b"0" * (4 * LIMIT)
    packed = gzip.compress(plain)
    assert len(packed) < LIMIT // 10
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
        + f"Content-Length: {len(packed)}\r\n\r\n".encode()
    )
    origin.answer = answering(head + packed)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    with pytest.raises(wire_module.AnswerTooLarge):
        await resp.read(LIMIT)
    origin.answer = answering(head + packed)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.read(4 * LIMIT) == plain


async def test_a_chunked_answer_streams_through_readany(
    wire: OriginWire, origin: RawOrigin
) -> None:
    more = asyncio.Event()

    async def chunked(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            b"9\r\ndata: 1\n\n\r\n"
        )
        await writer.drain()
        await more.wait()  # the second chunk only once the first was read
        writer.write(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
        await writer.drain()
        return True

    origin.answer = chunked
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert resp.content_type == "text/event-stream"
    assert await resp.content.readany() == b"data: 1\n\n"
    more.set()
    assert await resp.content.readany() == b"data: 2\n\n"
    assert await resp.content.readany() == b""  # the end
    resp.release()
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 1  # the whole stream was read: pooled


def ending_later(gate: asyncio.Event, tail: bytes = b"0\r\n\r\n") -> Answer:
    """A chunked stream whose last event comes at once and whose `tail` (its
    last chunk, unless given) only once `gate` is set, as uvicorn writes it."""

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nE\r\ndata: [DONE]\n\n\r\n"
        )
        await writer.drain()
        await gate.wait()
        writer.write(tail)
        await writer.drain()
        return True

    return answer


async def closed_by_the_proxy(wire: OriginWire) -> None:
    [pool] = wire._pools.values()
    async with asyncio.timeout(BOUND):
        while pool.open:
            await asyncio.sleep(0.01)


async def stream_then_release_ended(wire: OriginWire, origin: RawOrigin) -> None:
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.content.readany() == b"data: [DONE]\n\n"
    resp.release(ended=True)  # the client has the whole answer; the body has not ended


async def test_a_connection_released_before_its_bodys_end_is_kept_when_the_end_comes(
    wire: OriginWire, origin: RawOrigin
) -> None:
    gate = asyncio.Event()
    origin.answer = ending_later(gate)
    await stream_then_release_ended(wire, origin)
    [pool] = wire._pools.values()
    assert (pool.open, len(pool.idle)) == (1, 0)  # waiting for the end
    gate.set()
    async with asyncio.timeout(BOUND):
        while not pool.idle:
            await asyncio.sleep(0.01)
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 1


@pytest.mark.parametrize(
    "tail",
    [b"9\r\ndata: 2\n\n\r\n0\r\n\r\n", b"9\r\ndata: 2\n\n\r\n"],
    ids=["with-its-end", "without"],
)
async def test_more_body_after_the_callers_release_closes_the_connection(
    wire: OriginWire, origin: RawOrigin, tail: bytes
) -> None:
    gate = asyncio.Event()
    origin.answer = ending_later(gate, tail=tail)
    await stream_then_release_ended(wire, origin)
    gate.set()
    await closed_by_the_proxy(wire)
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_a_bodys_end_that_does_not_come_closes_the_connection(
    wire: OriginWire, origin: RawOrigin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire_module, "LINGER", SHORT)
    gate = asyncio.Event()
    origin.answer = ending_later(gate)
    await stream_then_release_ended(wire, origin)
    await closed_by_the_proxy(wire)
    gate.set()
    origin.answer = answering(OK)
    assert await exchange(wire, origin) == b"{}"
    assert origin.connections == 2


async def test_a_release_ended_after_the_wire_closed_closes_the_connection_at_once(
    wire: OriginWire, origin: RawOrigin, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A closed wire pools nothing: waiting for the body's end would only keep
    # the connection (and the origin's generation) open past the wire's close.
    monkeypatch.setattr(wire_module, "LINGER", 3600.0)
    gate = asyncio.Event()
    origin.answer = ending_later(gate)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    assert await resp.content.readany() == b"data: [DONE]\n\n"
    await wire.close()
    resp.release(ended=True)
    await closed_by_the_proxy(wire)
    gate.set()


async def test_another_answer_with_the_bodys_end_closes_the_connection(
    wire: OriginWire, origin: RawOrigin
) -> None:
    gate = asyncio.Event()
    origin.answer = ending_later(gate, tail=b"0\r\n\r\n" + OK)
    await stream_then_release_ended(wire, origin)
    gate.set()
    await closed_by_the_proxy(wire)


async def test_closing_the_wire_closes_a_connection_waiting_for_its_bodys_end(
    wire: OriginWire, origin: RawOrigin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire_module, "LINGER", 3600.0)
    gate = asyncio.Event()
    origin.answer = ending_later(gate)
    await stream_then_release_ended(wire, origin)
    await wire.close()
    await closed_by_the_proxy(wire)
    gate.set()


async def test_a_release_without_ended_closes_an_unfinished_body_at_once(
    wire: OriginWire, origin: RawOrigin
) -> None:
    # A client gone mid-stream: the origin must stop generating for nobody.
    gate = asyncio.Event()
    origin.answer = ending_later(gate)
    resp = await wire.post(origin.url(), b"{}", no_headers())
    await resp.content.readany()
    resp.release()
    await closed_by_the_proxy(wire)
    gate.set()


# ---------------------------------------------------------------- endpoints


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://[::1]:8080/v1", "[::1]:8080"),
        ("http://[::1]/v1", "[::1]"),
        ("https://[2001:db8::1]:443/v1", "[2001:db8::1]"),
        ("http://origin.example/v1", "origin.example"),
        ("http://origin.example:80/v1", "origin.example"),
        ("https://origin.example/v1", "origin.example"),
        ("https://origin.example:8443/v1", "origin.example:8443"),
        ("http://10.0.0.7:8000/v1", "10.0.0.7:8000"),
    ],
)
async def test_the_host_header_of_an_endpoint(url: str, host: str) -> None:
    assert _Endpoint(URL(url), asyncio.get_running_loop()).host == host


async def test_the_request_line_keeps_the_path_and_query() -> None:
    endpoint = _Endpoint(URL("http://o.example/v1/chat?api-version=2"), asyncio.get_running_loop())
    assert endpoint.line == "POST /v1/chat?api-version=2 HTTP/1.1"


async def test_an_ipv6_origin_gets_a_bracketed_host(wire: OriginWire) -> None:
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers[hdrs.HOST])
        return web.Response(body=b"{}")

    app = web.Application()
    app.router.add_post("/v1", handle)
    server = TestServer(app, host="::1")
    try:
        await server.start_server()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback: {exc}")
    port = server.port
    try:
        resp = await wire.post(URL(f"http://[::1]:{port}/v1"), b"{}", no_headers())
        assert await resp.read() == b"{}"
    finally:
        await server.close()
    assert seen == [f"[::1]:{port}"]


@pytest.mark.parametrize("url", ["ftp://origin.example/v1", "ws://origin.example/v1", "/v1"])
async def test_a_url_that_is_not_http_is_refused(wire: OriginWire, url: str) -> None:
    with pytest.raises(ValueError, match="not an origin URL"):
        await wire.post(URL(url), b"{}", no_headers())


async def test_the_same_url_reuses_its_endpoint(wire: OriginWire) -> None:
    url = URL("http://127.0.0.1:9/v1/chat/completions")
    first = wire._endpoint(url)
    assert wire._endpoint(url) is first
    assert wire._endpoint(URL(str(url))) is first  # an equal URL is the same key
    assert wire._endpoint(url.with_path("/v1/embeddings")) is not first


async def test_urls_looked_up_in_turn_each_keep_their_own_endpoint(wire: OriginWire) -> None:
    # The last URL's endpoint is found by identity first (OriginWire._endpoint):
    # never another URL's, whatever the order.
    a = URL("http://127.0.0.1:9/v1/chat/completions")
    b = URL("http://127.0.0.1:9/v1/embeddings")
    first_a, first_b = wire._endpoint(a), wire._endpoint(b)
    assert first_a is not first_b
    for _ in range(2):
        assert wire._endpoint(a) is first_a
        assert wire._endpoint(a) is first_a
        assert wire._endpoint(b) is first_b
        assert wire._endpoint(URL(str(a))) is first_a
        assert wire._endpoint(URL(str(b))) is first_b


async def test_beyond_max_endpoints_the_cache_starts_over(
    wire: OriginWire, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire_module, "MAX_ENDPOINTS", 2)
    a, b, c = (URL(f"http://127.0.0.1:9/v{n}") for n in range(3))
    first_a = wire._endpoint(a)
    wire._endpoint(b)
    assert len(wire._endpoints) == 2
    wire._endpoint(c)
    assert list(wire._endpoints) == [c]
    assert wire._endpoint(a) is not first_a  # forgotten, built again
    assert list(wire._endpoints) == [c, a]


async def test_a_request_head_is_its_headers_then_host_length_and_the_defaults_they_lack() -> None:
    """request_head's bytes: the call's headers in their order, then Host,
    Content-Length and the DEFAULT_HEADERS the call lacks; the endpoint's
    basic auth before them, unless the call has its own Authorization. The
    call's headers are left as they came."""
    loop = asyncio.get_running_loop()
    endpoint = wire_module._Endpoint(URL("http://127.0.0.1:8080/v1/chat/completions"), loop)
    headers = CIMultiDict({"content-type": "application/json", "accept": "text/x"})
    head = wire_module.request_head(endpoint, endpoint.line, headers, 12)
    assert head == (
        b"POST /v1/chat/completions HTTP/1.1\r\n"
        b"content-type: application/json\r\naccept: text/x\r\n"
        b"Host: 127.0.0.1:8080\r\nContent-Length: 12\r\n"
        b"Accept-Encoding: gzip, deflate\r\n"
        b"User-Agent: " + wire_module.USER_AGENT.encode() + b"\r\n\r\n"
    )
    assert list(headers) == ["content-type", "accept"]
    # A second attempt with the same headers: the same head.
    assert wire_module.request_head(endpoint, endpoint.line, headers, 12) == head

    with_auth = wire_module._Endpoint(URL("http://u:p@127.0.0.1:8080/v1/x"), loop)
    head = wire_module.request_head(with_auth, with_auth.line, CIMultiDict(), 0)
    assert head.startswith(
        b"POST /v1/x HTTP/1.1\r\nAuthorization: "
        + aiohttp.encode_basic_auth("u", "p").encode()
        + b"\r\nHost: 127.0.0.1:8080\r\nContent-Length: 0\r\nAccept: */*\r\n"
    )
