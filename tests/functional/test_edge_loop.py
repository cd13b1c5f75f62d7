"""EdgeProtocol.start runs every request of a connection in the connection's task.

aiohttp gives each request a task of its own; the proxy's loop does not (issue
17), so state a request leaves on the task must not reach the next request of
the same connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web, web_protocol
from aiohttp.helpers import ceil_timeout

from dataplane.http import edge
from dataplane.http.edge import EdgeLimits, EdgeRunner
from tests.logcheck import errors


async def swallows_a_cancel(request: web.Request) -> web.Response:
    # A handler that cancels its own task and catches it, leaving the task's
    # cancellation count at 1: harmless in a task of its own.
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(0)
    return web.Response(text="a")


async def leaves_its_body(request: web.Request) -> web.Response:
    return web.Response(text="b")


async def test_a_cancellation_one_request_left_does_not_fail_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = web.Application()
    app.router.add_get("/a", swallows_a_cancel)
    app.router.add_post("/b", leaves_its_body)
    runner = EdgeRunner(app, EdgeLimits(), lingering_time=0.2, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\na")).startswith(b"HTTP/1.1 200")
            # The next request's body never comes whole: the lingering read after
            # its answer times out, which must close the connection quietly.
            writer.write(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
            assert (await reader.readuntil(b"\r\n\r\nb")).startswith(b"HTTP/1.1 200")
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after lingering
            writer.close()
        assert "Unhandled exception" not in caplog.text
        assert not errors(caplog.records)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
async def test_a_request_still_running_at_the_shutdown_timeout_is_cancelled_then(
    streaming: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aiohttp's own shutdown would fail only the request's body at the timeout
    # and wait as long again for a handler that reads no more of it: the stop
    # took twice the timeout (two waits ran out). The edge cancels the handler
    # at the timeout: one wait runs out, and the handler ends cancelled.
    expired: list[float | None] = []
    real = ceil_timeout

    @contextlib.asynccontextmanager
    async def counted(delay: float | None, ceil_threshold: float = 5) -> AsyncIterator[None]:
        try:
            async with real(delay, ceil_threshold):
                yield
        except TimeoutError:
            expired.append(delay)
            raise

    monkeypatch.setattr(web_protocol, "ceil_timeout", counted)
    monkeypatch.setattr(edge, "ceil_timeout", counted)
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse()
        if streaming:
            await response.prepare(request)
            await response.write(b"data: 1\n\n")
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return response  # pragma: no cover - never reached

    seen_at_cleanup: list[bool] = []

    async def cleanup(app: web.Application) -> None:
        seen_at_cleanup.append(cancelled.is_set())

    app = web.Application()
    app.router.add_post("/forever", forever)
    app.on_cleanup.append(cleanup)
    runner = EdgeRunner(app, EdgeLimits(), handler_cancellation=True, access_log=None,
                        shutdown_timeout=0.2)  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /forever HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.wait_for(runner.cleanup(), 30)
        assert seen_at_cleanup == [True]
        assert expired == [0.2]
    finally:
        writer.close()
