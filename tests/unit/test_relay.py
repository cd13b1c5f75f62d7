"""The latency relay of the geo benchmark (bench/relay.py) against real sockets.

Timings are asserted as lower bounds only: a loaded machine may add delay, but
the relay must never deliver a byte before its one-way delay has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from bench.relay import LinkSpec, Relay, parse_link

RTT = 0.12
ONE_WAY = RTT / 2

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def _serve(handler: Handler) -> AsyncIterator[int]:
    """A loopback server; on exit every connection it accepted is closed and its handler done.

    Python 3.11's Server.close() leaves accepted connections open, and a handler
    still waiting when the loop ends leaks its socket (a ResourceWarning, an
    error here).
    """
    tasks: set[asyncio.Task[None]] = set()
    writers: list[asyncio.StreamWriter] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await handler(reader, writer)

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()
        for writer in writers:
            writer.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in writers:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async with _serve(_echo) as port:
        yield port


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


async def test_each_direction_is_delayed_by_half_the_round_trip() -> None:
    arrived: asyncio.Queue[float] = asyncio.Queue()
    sent_back = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)
        await arrived.put(time.monotonic())
        sent_back.set_result(time.monotonic())
        writer.write(b"world")
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    async with (
        _serve(handler) as port,
        Relay(LinkSpec("t", ("127.0.0.1", port), RTT, setup_rtts=0)) as relay,
    ):
        reader, writer = await asyncio.open_connection(*relay.address)
        t_sent = time.monotonic()
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"world"
        t_back = time.monotonic()
        assert await arrived.get() - t_sent >= ONE_WAY  # client -> server
        assert t_back - sent_back.result() >= ONE_WAY  # server -> client
        assert t_back - t_sent >= RTT
        await _close(writer)
    assert relay.connections == 1


async def test_a_new_connection_pays_its_handshake_once(echo_port: int) -> None:
    spec = LinkSpec("t", ("127.0.0.1", echo_port), RTT, setup_rtts=1)
    async with Relay(spec) as relay:
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection(*relay.address)
        writer.write(b"a")
        await reader.readexactly(1)
        first = time.monotonic() - t0
        t1 = time.monotonic()
        writer.write(b"b")  # the same (kept-alive) connection
        await reader.readexactly(1)
        second = time.monotonic() - t1
        await _close(writer)
    assert first >= 2 * RTT  # handshake, then the round trip
    assert second >= RTT
    assert relay.connections == 1


async def test_concurrent_connections_keep_their_bytes_in_order(echo_port: int) -> None:
    spec = LinkSpec("t", ("127.0.0.1", echo_port), 0.02, setup_rtts=1)

    async def client(index: int) -> bytes:
        rng = random.Random(index)
        reader, writer = await asyncio.open_connection(*relay.address)
        payload = b"".join(f"{index}:{i};".encode() for i in range(300))
        pos = 0
        while pos < len(payload):  # uneven chunks at uneven times
            step = rng.randint(1, 64)
            writer.write(payload[pos : pos + step])
            pos += step
            if rng.random() < 0.2:
                await asyncio.sleep(rng.random() * 0.003)
        received = await reader.readexactly(len(payload))
        await _close(writer)
        assert received == payload
        return received

    async with Relay(spec) as relay:
        results = await asyncio.gather(*(client(i) for i in range(20)))
    assert len(results) == 20
    assert relay.connections == 20


async def test_large_transfers_arrive_whole(echo_port: int) -> None:
    blob = random.Random(7).randbytes(3 << 20)  # above the relay's high-water mark
    async with Relay(LinkSpec("t", ("127.0.0.1", echo_port), 0.01, setup_rtts=0)) as relay:
        reader, writer = await asyncio.open_connection(*relay.address)

        async def send() -> None:
            for i in range(0, len(blob), 1 << 16):
                writer.write(blob[i : i + (1 << 16)])
                await writer.drain()

        sender = asyncio.create_task(send())
        received = await reader.readexactly(len(blob))
        await sender
        await _close(writer)
    assert received == blob


async def test_a_close_reaches_the_other_side_after_the_delay() -> None:
    closed_at = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)
        closed_at.set_result(time.monotonic())
        writer.close()

    async with (
        _serve(handler) as port,
        Relay(LinkSpec("t", ("127.0.0.1", port), RTT, setup_rtts=0)) as relay,
    ):
        reader, writer = await asyncio.open_connection(*relay.address)
        writer.write(b"x")
        assert await reader.read() == b""  # EOF, not a hang
        assert time.monotonic() - closed_at.result() >= ONE_WAY
        await _close(writer)


async def test_an_unreachable_target_closes_the_client() -> None:
    async with _serve(_echo) as port:
        pass  # nothing listens on `port` now
    async with Relay(LinkSpec("t", ("127.0.0.1", port), 0.01, setup_rtts=0)) as relay:
        reader, writer = await asyncio.open_connection(*relay.address)
        writer.write(b"x")
        try:
            data = await asyncio.wait_for(reader.read(), 5)
        except ConnectionError:
            data = b""  # a reset is as good as a close
        assert data == b""
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def test_link_parsing() -> None:
    spec = parse_link("eu>us=127.0.0.1:9000@69", setup_rtts=2)
    assert spec == LinkSpec("eu>us", ("127.0.0.1", 9000), 0.069, 2, ("127.0.0.1", 0))
    assert spec.one_way_s == pytest.approx(0.0345)
    with pytest.raises(ValueError, match="rtt_s"):
        LinkSpec("bad", ("127.0.0.1", 1), -1.0)


def test_delays_hold_on_uvloop() -> None:
    """The relay process runs on uvloop, whose timers round to milliseconds."""
    import uvloop  # noqa: PLC0415

    async def scenario() -> tuple[float, bytes]:
        async with _serve(_echo) as port, Relay(LinkSpec("t", ("127.0.0.1", port), RTT)) as relay:
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection(*relay.address)
            writer.write(b"ping")
            echoed = await reader.readexactly(4)
            elapsed = time.monotonic() - t0
            await _close(writer)
        return elapsed, echoed

    elapsed, echoed = uvloop.run(scenario())
    assert echoed == b"ping"
    assert elapsed >= 2 * RTT  # handshake, then the round trip
