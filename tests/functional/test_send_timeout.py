"""A client that stops reading its stream is cut after the edge's send
timeout (`--send-timeout`): its connection closed, its origin request ended,
a 499 logged once as `send_timeout`; a client that reads slowly but keeps
reading gets its whole stream. On the real listener (EdgeRunner, handler
cancellation on), with a hand-written origin.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from dataplane.http.state import ACCESS_LOG
from tests.functional.test_pipeline import MODEL
from tests.functional.test_whole_answers import Edge, Origin, Start, edges, request

CHUNK = (
    b'data: {"id":"x","object":"chat.completion.chunk","model":"'
    + MODEL.encode()
    + b'","choices":[{"index":0,"delta":{"content":"'
    + b"a" * 4000
    + b'"},"finish_reason":null}]}\n\n'
)
STEADY_TIMEOUT_S = 3
STEADY_PAUSE_S = 0.008
STREAM = json.dumps(
    {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "go on"}]}
).encode()


@dataclass
class Streaming:
    """An origin streaming `chunks` chunks (None: until its client leaves)."""

    chunks: int | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            sent = 0
            while self.chunks is None or sent < self.chunks:
                await out.write(CHUNK)
                sent += 1
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        finally:
            self.ended.set()
        return out


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    async with edges(tmp_path) as go:
        yield go


def count(edge: Edge, code: str) -> float:
    return edge.sample("ponto_requests_total", {"endpoint": "chat.completions", "code": code}) or 0


async def test_a_client_that_stops_reading_a_stream_is_cut(
    start: Start, capfd: pytest.CaptureFixture[str]
) -> None:
    origin = Streaming()
    edge = await start(origin, "--send-timeout=0.5", "--access-log=on")
    reader, writer = await edge.connect(rcvbuf=4096)
    try:
        writer.write(request(STREAM))
        assert b" 200 " in await reader.readuntil(b"\r\n\r\n")
        # Nothing more is read: the buffers fill, the proxy's write waits, and
        # after the send timeout the proxy cuts the client and ends the origin's
        # request (without a cut, this waits for the bound and fails).
        async with asyncio.timeout(30):
            await origin.ended.wait()
            while not count(edge, "499"):
                await asyncio.sleep(0.02)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            async with asyncio.timeout(30):
                while True:  # what was in flight, then the end
                    await reader.readexactly(1 << 16)
    finally:
        writer.close()
    assert (count(edge, "499"), count(edge, "200")) == (1, 0)
    # Not counted as a client that left: the proxy cut it.
    assert not edge.sample("ponto_client_disconnects_total", {})
    edge.app[ACCESS_LOG].flush()
    logged: list[dict[str, Any]] = [json.loads(x) for x in capfd.readouterr().out.splitlines()]
    assert [(x["status"], x["error"]) for x in logged] == [(499, "send_timeout")]


async def test_a_client_cut_for_not_reading_is_reset_its_unsent_bytes_dropped(
    start: Start,
) -> None:
    """Trial 91: the cut closed the socket with its send buffer full (the
    kernel grows it to 4 MB for a fast stream), which the kernel then kept in
    FIN-WAIT-1 for minutes, probing the stalled client's zero window; the
    client, reading again, got those megabytes and an ordinary end. Reset,
    the kernel drops them at once and the client reads that it was cut."""
    origin = Streaming()
    edge = await start(origin, "--send-timeout=0.5")
    reader, writer = await edge.connect(rcvbuf=4096)
    try:
        writer.write(request(STREAM))
        assert b" 200 " in await reader.readuntil(b"\r\n\r\n")
        async with asyncio.timeout(30):
            while not count(edge, "499"):
                await asyncio.sleep(0.02)
        # What reached the client's own buffer before the cut, then the reset
        # (a close would go on with the proxy's buffer, then end the stream).
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(30):
                while await reader.read(1 << 16):
                    pass
    finally:
        writer.close()


async def test_a_client_that_reads_slowly_gets_its_whole_stream(start: Start) -> None:
    origin = Streaming(chunks=64)  # some 256 KB, several times the buffers
    edge = await start(origin, "--send-timeout=2")
    reader, writer = await edge.connect(rcvbuf=4096)
    received = b""
    try:
        writer.write(request(STREAM))
        async with asyncio.timeout(60):
            while chunk := await reader.read(16 << 10):
                received += chunk
                if received.endswith(b"0\r\n\r\n"):  # the chunked body's end
                    break
                await asyncio.sleep(0.01)  # slow, but never still for long
    finally:
        writer.close()
    assert received.count(b"chat.completion.chunk") == 64
    assert b"data: [DONE]" in received
    assert (count(edge, "200"), count(edge, "499")) == (1, 0)


async def test_a_client_that_reads_a_big_whole_answer_slowly_but_steadily_is_not_cut(
    start: Start,
) -> None:
    # The timeout is between two takes of the client, not for the whole drain:
    # a 12 MB whole answer read in reads of at most 16 KB, 8 ms apart, takes
    # twice the timeout to drain, and is not cut, since the client never stops
    # for long. The timeout is 3 s, not 1 s: client and proxy share this
    # process, which on a loaded machine can wait a second for the CPU, and a
    # look at the client's progress then comes before the read it was waiting
    # for. Twice, not just over: the proxy's write waits only for the part of
    # the answer the kernel's buffers do not hold (some 10 MB), and that wait
    # must outlast the timeout for a bound over the whole drain to cut it.
    origin = Origin(size=12 << 20)  # a 12 MB whole answer (an embeddings batch, say)
    edge = await start(origin, f"--send-timeout={STEADY_TIMEOUT_S}")
    reader, writer = await edge.connect(rcvbuf=4096)
    received = 0
    reads = 0
    try:
        writer.write(request())
        async with asyncio.timeout(60):
            head = await reader.readuntil(b"\r\n\r\n")
            assert b" 200 " in head
            size = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while received < size and (chunk := await reader.read(16 << 10)):
                received += len(chunk)
                reads += 1
                await asyncio.sleep(STEADY_PAUSE_S)
    finally:
        writer.close()
    # The reads' own pauses alone outlast the timeout twice: the drain was long.
    assert reads * STEADY_PAUSE_S > 2 * STEADY_TIMEOUT_S
    assert received == size
    assert (count(edge, "200"), count(edge, "499")) == (1, 0)


@pytest.mark.parametrize("cacheable", [False, True])
async def test_a_stalled_client_cut_mid_stream_is_logged_as_a_send_timeout(
    start: Start, capfd: pytest.CaptureFixture[str], cacheable: bool
) -> None:
    """Trial 36: a reader that stalled after its first bytes was cut by the
    send timeout, and logged as a client that left (`client_disconnected`):
    the relay's write found the connection gone before the cut cancelled
    the handler. A cacheable stream is relayed by a flight's task of its own."""
    origin = Streaming()
    edge = await start(origin, "--send-timeout=0.5", "--access-log=on")
    reader, writer = await edge.connect(rcvbuf=4096)
    body = json.loads(STREAM)
    body["temperature"] = 0 if cacheable else 1
    try:
        writer.write(request(json.dumps(body).encode()))
        assert b" 200 " in await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(100)
        async with asyncio.timeout(30):
            await origin.ended.wait()
            while not count(edge, "499"):
                await asyncio.sleep(0.02)
    finally:
        writer.close()
    assert not edge.sample("ponto_client_disconnects_total", {})
    edge.app[ACCESS_LOG].flush()
    logged: list[dict[str, Any]] = [json.loads(x) for x in capfd.readouterr().out.splitlines()]
    assert [(x["status"], x["error"]) for x in logged] == [(499, "send_timeout")]
