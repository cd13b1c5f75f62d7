"""How a worker leaving its group to a successor (a reload) ends its connections
(dataplane.run._drain): a real EdgeRunner on loopback, raw connections.

With the listener stopped, the wait closes the connections its clients keep
idle once `idle_after` has passed, finishes the requests it holds for as long
as they run (a reload should cut no stream), and says how many it cut when it
must end: at its deadline, or sooner when the group stops meanwhile (`hurry`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from dataplane.run import _drain
from tests.functional.edgestack import listen

RELEASE = web.AppKey("release", asyncio.Event)
WAIT = 10.0


async def held(request: web.Request) -> web.Response:
    await request.app[RELEASE].wait()
    return web.Response(text="held", headers={"connection": "close"})


async def ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def served() -> AsyncIterator[tuple[web.Application, web.TCPSite, int]]:
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_get("/held", held)
    app.router.add_get("/ok", ok)
    runner, site, port = await listen(app)
    try:
        yield app, site, port
    finally:
        app[RELEASE].set()
        await runner.cleanup()


async def request(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def answered(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    return head + await asyncio.wait_for(reader.read(4), WAIT)


async def test_idle_connections_are_closed_and_a_running_request_finishes(
    served: tuple[web.Application, web.TCPSite, int],
) -> None:
    app, site, port = served
    idle, idle_w = await request(port, "/ok")
    assert (await answered(idle)).endswith(b"ok")  # kept alive, then idle
    busy, busy_w = await request(port, "/held")
    half, half_w = await asyncio.open_connection("127.0.0.1", port)
    half_w.write(b"GET /ok HTTP/1.1\r\nHo")  # a head begun: not idle
    await half_w.drain()
    await asyncio.sleep(0.05)
    await site.stop()  # the leave stops listening first
    drain = asyncio.create_task(_drain(site, 30.0, idle_after=0.0))
    # The idle one is closed (EOF); the one with a request running is not.
    assert await asyncio.wait_for(idle.read(), WAIT) == b""
    assert not drain.done()
    half_w.write(b"st: x\r\n\r\n")
    await half_w.drain()
    assert (await answered(half)).endswith(b"ok")  # its head was not cut
    app[RELEASE].set()
    assert (await answered(busy)).endswith(b"held")
    assert await asyncio.wait_for(drain, WAIT) == 0
    for w in (idle_w, busy_w, half_w):
        w.close()


async def test_a_stop_during_the_wait_ends_it_within_its_budget(
    served: tuple[web.Application, web.TCPSite, int],
) -> None:
    _, site, port = served
    _, busy_w = await request(port, "/held")
    await asyncio.sleep(0.05)
    await site.stop()
    hurry = asyncio.Event()
    drain = asyncio.create_task(_drain(site, 600.0, idle_after=0.0, hurry=(hurry, 0.1)))
    await asyncio.sleep(0.1)
    assert not drain.done()
    hurry.set()  # SIGTERM: the group stops
    assert await asyncio.wait_for(drain, WAIT) == 1  # the request it must cut
    busy_w.close()
