"""How the proxy's listener stops (runner.cleanup(), after SIGTERM and any
drain): a real EdgeRunner on loopback, raw connections.

Each connection finishes the request begun on it, still reading its head and
body, answers it with `Connection: close` and closes; a connection with no
request begun is closed at once. aiohttp's own shutdown read nothing more
from any connection: a body half received when the stop came waited out the
body timeout (then a 408 for a request the client had sent whole), and a head
half received was never answered.

The deadlines here are long (LONG) so that a request left waiting shows as a
test timeout rather than as an answer after a deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from dataplane.http.edge import EdgeLimits, EdgeRunner
from dataplane.run import under_way
from tests.functional.edgestack import listen

WAIT = 10.0
LONG = 120.0


async def echo(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


@pytest.fixture
async def served() -> AsyncIterator[tuple[EdgeRunner, int]]:
    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/echo", echo)
    limits = EdgeLimits(header_timeout=LONG, body_timeout=LONG, keepalive_timeout=LONG)
    runner, _, port = await listen(app, limits)
    try:
        yield runner, port
    finally:
        await runner.cleanup()  # a second cleanup does nothing


async def began(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has sent `data` and whose bytes the server has read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    await asyncio.sleep(0.1)
    return reader, writer


async def stopping(runner: EdgeRunner) -> asyncio.Task[None]:
    """runner.cleanup() under way: the listener is closed and each connection
    has been told to stop."""
    stop = asyncio.create_task(runner.cleanup())
    await asyncio.sleep(0.1)
    assert not stop.done()  # a request begun holds it
    return stop


async def whole_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The answer's head and body, read to the end of the connection."""
    data = await asyncio.wait_for(reader.read(), WAIT)
    head, _, body = data.partition(b"\r\n\r\n")
    return head.lower(), body


@pytest.mark.parametrize(
    ("first", "rest", "body"),
    [
        pytest.param(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhello",
            b"world",
            b"helloworld",
            id="body-half-received",
        ),
        pytest.param(b"GET /echo HTTP/1.1\r\nHo", b"st: x\r\n\r\n", b"", id="head-half-received"),
    ],
)
async def test_a_request_half_received_when_the_stop_comes_is_read_and_answered(
    served: tuple[EdgeRunner, int], first: bytes, rest: bytes, body: bytes
) -> None:
    runner, port = served
    reader, writer = await began(port, first)
    stop = await stopping(runner)
    writer.write(rest)
    await writer.drain()
    head, answer = await whole_answer(reader)
    assert head.startswith(b"http/1.1 200")
    assert b"connection: close" in head
    assert answer == body
    await asyncio.wait_for(stop, WAIT)
    writer.close()


async def test_a_pipelined_request_after_the_one_begun_is_not_taken(
    served: tuple[EdgeRunner, int],
) -> None:
    runner, port = served
    reader, writer = await began(
        port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\na"
    )
    stop = await stopping(runner)
    writer.write(b"bGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    head, body = await whole_answer(reader)
    assert head.startswith(b"http/1.1 200")
    assert body == b"ab"  # and no second answer after it
    await asyncio.wait_for(stop, WAIT)
    writer.close()


async def test_connections_with_no_request_begun_are_closed_at_once(
    served: tuple[EdgeRunner, int],
) -> None:
    runner, port = served
    fresh, fresh_w = await began(port, b"")  # connected, nothing sent
    kept, kept_w = await began(port, b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(kept.readuntil(b"\r\n\r\n"), WAIT)
    assert head.startswith(b"HTTP/1.1 200") and b"close" not in head.lower()  # kept alive
    await asyncio.wait_for(runner.cleanup(), WAIT)  # not the keep-alive or header timeout
    assert await asyncio.wait_for(fresh.read(), WAIT) == b""
    assert await asyncio.wait_for(kept.read(), WAIT) == b""
    fresh_w.close()
    kept_w.close()


async def test_a_stop_counts_the_connections_open_and_the_requests_under_way() -> None:
    """What the drain's and the shutdown's log lines say (trial 34: only
    "shutting down", while streams ran on for a minute)."""
    app = web.Application()
    app.router.add_post("/echo", echo)
    limits = EdgeLimits(header_timeout=LONG, body_timeout=LONG, keepalive_timeout=LONG)
    runner, site, port = await listen(app, limits)
    writers: list[asyncio.StreamWriter] = []
    try:
        assert under_way(site) == (0, 0)
        _, idle = await began(port, b"")
        _, busy = await began(
            port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhe"
        )
        writers += [idle, busy]
        assert under_way(site) == (2, 1)
    finally:
        for writer in writers:
            writer.close()
        await runner.cleanup()
