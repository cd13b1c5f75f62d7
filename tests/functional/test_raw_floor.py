"""bench/raw_floor.py's measuring stick relays what it claims to: an origin's
status, Content-Type and body, request after request on one connection, in
order when pipelined, with a body that arrives in pieces, and a 502 when the
origin cannot be reached. Its CPU figures mean nothing if it does less.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.raw_floor import RawFloor


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    status = 404 if request.path.endswith("/missing") else 200
    return web.Response(status=status, body=b"seen " + body, content_type="application/json")


@pytest.fixture
async def floor() -> AsyncIterator[RawFloor]:
    app = web.Application()
    app.router.add_post("/{tail:.*}", echo)
    origin = TestServer(app)
    await origin.start_server()
    proxy = RawFloor(("127.0.0.1", origin.port or 0))
    await proxy.start()
    yield proxy
    await proxy.close()
    await origin.close()


def post(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
        path.encode(),
        len(body),
        body,
    )


async def read_answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head.rstrip(b"\r\n").split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    body = await reader.readexactly(int(headers[b"Content-Length"]))
    return status, headers, body


async def test_answers_are_relayed_in_order_on_one_connection(floor: RawFloor) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", floor.port)
    try:
        await relay_four(reader, writer)
    finally:
        writer.close()
        await writer.wait_closed()


async def relay_four(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(post("/v1/a", b"one"))
    assert await read_answer(reader) == (
        b"HTTP/1.1 200 OK",
        {b"Content-Type": b"application/json", b"Content-Length": b"8"},
        b"seen one",
    )
    # Pipelined: both in one write; the second waits for the first's answer.
    writer.write(post("/v1/b", b"two") + post("/v1/missing", b"three"))
    assert (await read_answer(reader))[2] == b"seen two"
    status, _, body = await read_answer(reader)
    assert (status, body) == (b"HTTP/1.1 404 Not Found", b"seen three")
    # A body in two pieces is sent once it is whole.
    writer.write(post("/v1/c", b"four")[:-2])
    await writer.drain()
    await asyncio.sleep(0)
    writer.write(b"ur")
    assert (await read_answer(reader))[2] == b"seen four"


async def test_an_unreachable_origin_is_a_502() -> None:
    unused = TestServer(web.Application())
    await unused.start_server()
    port = unused.port or 0
    await unused.close()  # nothing listens there now
    proxy = RawFloor(("127.0.0.1", port))
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(post("/v1/a", b"x"))
        status, headers, _ = await read_answer(reader)
        assert status == b"HTTP/1.1 502 Bad Gateway"
        assert headers[b"Connection"] == b"close"
        assert await reader.read() == b""  # and the connection is closed
        writer.close()
        await writer.wait_closed()
    finally:
        await proxy.close()
