"""A stream's first-chunk bound counts from the call, whatever the origin
sends of its response head (trial 65: an origin that dripped its head a byte
a second was left after 84.7 s of a 60 s bound, and the log said 60). The
proxy's app before a raw loopback origin that drips its head, and an aiohttp
origin that answers (tests/functional/test_continuation.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import pytest
from aiohttp.test_utils import TestServer
from yarl import URL

from ponto.v1 import routing_pb2 as pb
from tests.functional.test_continuation import (
    Origin,
    Proxy,
    proxy,
    second_origin,
    text_of,
    whole_chat,
)

__all__ = ["proxy"]  # fixture

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\r\n"
DRIP_EVERY = 0.02  # a byte this often: each far within the bound, the head far past it


class DrippingServer:
    """A loopback origin that reads a request and drips HEAD a byte at a
    time (then sends nothing more); `left` is set when the proxy closed the
    connection, `head_done` once the whole head was sent. As much of
    aiohttp's TestServer as the `proxy` fixture uses."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.head_done = False
        self._server: asyncio.Server | None = None
        self._port = 0

    async def start_server(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]

    def make_url(self, path: str) -> URL:
        return URL(f"http://127.0.0.1:{self._port}{path}")

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            for at in range(len(HEAD)):
                if reader.at_eof():
                    break
                writer.write(HEAD[at : at + 1])
                await writer.drain()
                await asyncio.sleep(DRIP_EVERY)
            else:
                self.head_done = True
            await reader.read()  # until the proxy closes the connection
            self.left.set()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.left.set()
        finally:
            writer.close()


async def test_an_origin_dripping_its_head_is_left_at_the_first_chunk_bound(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    dripping = DrippingServer()
    a = Origin(whole_chat("unused"))
    a.server = cast(TestServer, dripping)  # the fixture starts, names and closes it
    b = await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(hedge_ms=0))
    with caplog.at_level(logging.WARNING):
        chunks, raw = await p.stream()
    assert "error" not in raw and text_of(chunks) == " world"
    async with asyncio.timeout(5):  # a bound on a broken test, not a timing
        await dripping.left.wait()
    assert not dripping.head_done  # left while its head still dripped
    said = [r.getMessage() for r in caplog.records if "o0" in r.getMessage()]
    assert any("sent no first chunk within 0.3 s" in line for line in said), said
