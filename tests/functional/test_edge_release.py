"""A connection's requests are freed by reference counting when it ends
(dataplane.http.edge.EdgeProtocol.start): a real EdgeRunner on loopback, and
the garbage collector off; handler_cancellation as the proxy runs where a
client leaves mid-answer.

A client that closes its connection cancels the connection's task; the task
ends with its frame in the cancellation's traceback. Had the frame held the
task, that was a cycle only a full collection frees, and with it the last
request and its body (trial 89: RSS grew 10 MB for every 5 MB request whose
client closed its connection, as httpx.post and a pool's eviction do).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest
from aiohttp import web

from dataplane.http.edge import EdgeLimits, EdgeRunner
from tests.functional.edgestack import listen

WAIT = 10.0


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def reading(seen: list[weakref.ref[web.BaseRequest]]) -> tuple[EdgeRunner, int]:
    """An EdgeRunner on loopback (the caller cleans it up) and its port,
    answering POST /v1/read "ok" once it has read the body, each request
    noted in `seen` (weakly)."""

    async def read(request: web.Request) -> web.Response:
        await request.read()
        seen.append(weakref.ref(request))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/read", read)
    runner, _site, port = await listen(app)
    return runner, port


async def posted(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to `port` on which a POST to `path` of a 100 KB body (one
    a leak would show) has been sent whole."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b"x" * 100_000
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
    )
    await writer.drain()
    return reader, writer


async def test_a_request_is_freed_when_its_client_closes_the_connection(
    no_collector: None,
) -> None:
    seen: list[weakref.ref[web.BaseRequest]] = []
    done = asyncio.Event()
    runner, port = await reading(seen)
    try:
        reader, writer = await posted(port, "/v1/read")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200")
        # The connection is kept alive, its task waiting for the next request:
        # the client closes it, which cancels that task.
        server = runner.server
        assert server is not None and len(server.connections) == 1
        [conn] = server.connections
        task = conn._task_handler
        assert task is not None
        task.add_done_callback(lambda _: done.set())
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(done.wait(), WAIT)
        assert task.cancelled()
        # The request is let go of before the wait (the next test); the task
        # and its frame, with the connection's writer, are freed as well.
        ended = weakref.ref(task)
        del task, conn
        assert len(seen) == 1 and seen[0]() is None
        assert ended() is None
    finally:
        await runner.cleanup()


async def test_an_answered_request_is_freed_while_its_connection_waits_for_the_next(
    no_collector: None,
) -> None:
    """A pooled client's idle connection holds nothing of its last request
    while it waits (up to --keepalive-timeout) for the next one."""
    seen: list[weakref.ref[web.BaseRequest]] = []
    runner, port = await reading(seen)
    try:
        reader, writer = await posted(port, "/v1/read")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 2" in head
        assert await asyncio.wait_for(reader.readexactly(2), WAIT) == b"ok"
        server = runner.server
        assert server is not None
        [conn] = server.connections
        # The answer is out; the connection's task goes back to waiting.
        while conn._waiter is None:
            await asyncio.sleep(0)
        assert len(seen) == 1 and seen[0]() is None
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()


class _Holder:
    """What a handler's timeout or watch is to the task it bounds: an object
    holding that task, and kept by a cycle of its own (as IdleTimeout is, by
    the bound method it keeps to arm its timer with)."""

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.me = self


async def test_a_request_is_freed_when_its_client_leaves_mid_answer(
    no_collector: None,
) -> None:
    """The connection's task ends with the cancellation it was stopped by;
    neither that exception's traceback nor the task's frame holds the request,
    though the handler's objects keep the task until a collection."""
    seen: list[weakref.ref[web.BaseRequest]] = []
    reading = asyncio.Event()

    async def endless(request: web.Request) -> web.Response:
        await request.read()
        seen.append(weakref.ref(request))
        holder = _Holder()
        reading.set()
        await asyncio.Event().wait()  # an answer that never comes
        return web.Response(text=str(holder))

    app = web.Application()
    app.router.add_post("/v1/endless", endless)
    runner = EdgeRunner(app, EdgeLimits(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        _reader, writer = await posted(port, "/v1/endless")
        await asyncio.wait_for(reading.wait(), WAIT)
        server = runner.server
        assert server is not None
        [conn] = server.connections
        task = conn._task_handler
        assert task is not None
        done = asyncio.Event()
        task.add_done_callback(lambda _: done.set())
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(done.wait(), WAIT)
        assert task.cancelled()
        del task, conn
        assert len(seen) == 1 and seen[0]() is None
    finally:
        await runner.cleanup()
