"""EdgeProtocol._handle, aiohttp's `_handle_request` copied: what a handler's
answer or error becomes on an application without the proxy's error boundary
(dataplane.http.boundary), and a stop that waits for a request under way."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from dataplane.http.edge import EdgeRunner
from tests.functional.edgestack import listen


async def not_found(request: web.Request) -> web.Response:
    raise web.HTTPNotFound()


async def redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/elsewhere")


async def times_out(request: web.Request) -> web.Response:
    raise TimeoutError


async def a_bug(request: web.Request) -> web.Response:
    raise ValueError("a bug")


async def returns_nothing(request: web.Request) -> web.Response:
    return None  # type: ignore[return-value]  # a handler's bug


RELEASE = web.AppKey("release", asyncio.Event)
# What the transport still held of earlier answers as each /unsent began, and its high-water mark.
UNSENT = web.AppKey("unsent", list[tuple[int, int]])
BIG = 32 << 20  # far past what the loopback's socket buffers take at once


async def big(request: web.Request) -> web.Response:
    return web.Response(body=b"a" * BIG)


async def unsent(request: web.Request) -> web.Response:
    transport = request.transport
    assert transport is not None
    request.app[UNSENT].append(
        (transport.get_write_buffer_size(), transport.get_write_buffer_limits()[1])
    )
    return web.Response(text="noted")


async def held(request: web.Request) -> web.Response:
    await request.app[RELEASE].wait()
    return web.Response(text="held")


ANSWERS = [
    ("GET", "/not-found", 404, None),
    ("GET", "/redirect", 302, None),
    ("GET", "/nowhere", 404, None),  # the router's own
    ("POST", "/not-found", 405, None),
    ("GET", "/times-out", 504, "close"),
    ("GET", "/a-bug", 500, "close"),
    ("GET", "/returns-nothing", 500, None),  # aiohttp's answer to it, not a dropped connection
]


@pytest.fixture
async def served() -> AsyncIterator[tuple[EdgeRunner, str]]:
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app[UNSENT] = []
    for path, handler in [
        ("/not-found", not_found), ("/redirect", redirect), ("/times-out", times_out),
        ("/a-bug", a_bug), ("/returns-nothing", returns_nothing), ("/held", held),
        ("/big", big), ("/unsent", unsent),
    ]:  # fmt: skip
        app.router.add_get(path, handler)
    runner, _, port = await listen(app)
    try:
        yield runner, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_handlers_errors_are_answered_as_aiohttp_answers_them(
    served: tuple[EdgeRunner, str],
) -> None:
    _, base = served
    async with aiohttp.ClientSession() as session:
        for method, path, status, connection in ANSWERS:
            async with session.request(method, base + path, allow_redirects=False) as resp:
                await resp.read()
                assert (resp.status, resp.headers.get("Connection")) == (status, connection), path


async def test_a_handlers_timeout_is_told_as_one(
    served: tuple[EdgeRunner, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, base = served
    async with aiohttp.ClientSession() as session, session.get(base + "/times-out") as resp:
        body = await resp.json()
    assert resp.status == 504
    assert (body["error"]["code"], body["error"]["message"]) == (
        "timeout",
        "the request timed out in the proxy",
    )
    told = [r for r in caplog.records if "timed out in its handler" in r.getMessage()]
    assert len(told) == 1 and told[0].exc_info is None


async def test_a_stop_waits_for_the_request_under_way(served: tuple[EdgeRunner, str]) -> None:
    runner, base = served
    async with aiohttp.ClientSession() as session:
        answer = asyncio.create_task(session.get(base + "/held"))
        while not runner.server or not any(  # the request is in its handler
            c._request_in_progress for c in runner.server.connections
        ):
            await asyncio.sleep(0.01)
        # shutdown sets _handler_waiter; _handle resolves it once the handler ends.
        stopping = asyncio.create_task(runner.cleanup())
        try:
            for _ in range(20):
                await asyncio.sleep(0)
            assert not stopping.done()  # waiting for the handler
        finally:
            runner.app[RELEASE].set()  # else a failure here waits for the shutdown timeout
            await stopping
        resp = await answer
        assert (resp.status, await resp.text()) == (200, "held")


async def test_a_whole_answer_is_drained_before_the_next_request_is_handled(
    served: tuple[EdgeRunner, str],
) -> None:
    # A whole answer past the transport's high-water mark is waited for (its
    # drain, which the send timeout bounds) before the connection's next
    # request: a client that reads slowly holds its own connection, not a
    # buffer that grows with each request it pipelines.
    runner, base = served
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    port = int(base.rsplit(":", 1)[1])
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\nGET /unsent HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(60):
            assert b" 200 " in await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(BIG)
            assert b" 200 " in await reader.readuntil(b"\r\n\r\n")
            assert await reader.readexactly(5) == b"noted"
    finally:
        writer.close()
    [(left, high)] = runner.app[UNSENT]
    assert left <= high
