"""The origin wire alone: CPU per origin call, against a bare raw client and a ClientSession.

    .venv/bin/python -m bench.wire_micro [--rounds 7] [--calls 4000]

Every call is the proxy's: a POST of a chat body over a kept-alive connection
to the canned nginx origin (bench/canned.py, on CPU 1), its answer read whole.
This process runs on CPU 0 with `CONCURRENCY` call loops at once, so the CPU
time it spends per call is the client side's cost, syscalls included. Three
clients, their rounds interleaved so that the machine's drift hits all alike:

- **raw floor**: an `asyncio.Protocol` feeding aiohttp's C response parser,
  one idle list, nothing else (no timeouts, limits, TLS or error handling):
  what the wire's work costs at the least;
- **OriginWire** (dataplane/upstream/wire.py), as the Forwarder calls it;
- **ClientSession**: aiohttp's own client, the peer the wire replaced.

Prints each client's median over the rounds and its ratio to the raw floor.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import uvloop
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_parser import HttpResponseParser, RawResponseMessage
from aiohttp.http_writer import _serialize_headers
from aiohttp.streams import StreamReader
from multidict import CIMultiDict
from yarl import URL

from bench.canned import CannedOrigin
from bench.procs import affinity, cpus_available
from dataplane.upstream.wire import OriginWire

BODY = b'{"model":"canned","messages":[{"role":"user","content":"hi"}]}'
CONCURRENCY = 8
WARMUP = 200  # calls per loop before a round is timed

Call = Callable[[], Awaitable[None]]


class _RawConnection(BaseProtocol):
    """The least a kept-alive call needs: the parser, and the head's future."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._parser = HttpResponseParser(self, loop, 2**16, read_until_eof=True)
        self.head: asyncio.Future[tuple[RawResponseMessage, StreamReader]] | None = None

    def data_received(self, data: bytes) -> None:
        assert self._parser is not None
        messages, _, _ = self._parser.feed_data(data)
        for message, payload in messages:
            if self.head is not None and not self.head.done():
                self.head.set_result((message, payload))


async def _raw_client(url: URL) -> tuple[Call, Callable[[], None]]:
    loop = asyncio.get_running_loop()
    idle: list[_RawConnection] = []
    line = f"POST {url.raw_path} HTTP/1.1"
    host, port = url.raw_host or "", url.port or 80
    opened: list[_RawConnection] = []

    async def call() -> None:
        if idle:
            conn = idle.pop()
        else:
            _, conn = await loop.create_connection(lambda: _RawConnection(loop), host, port)
            opened.append(conn)
        headers = CIMultiDict({"Host": f"{host}:{port}", "Content-Type": "application/json"})
        headers["Content-Length"] = str(len(BODY))
        assert conn.transport is not None
        conn.transport.writelines((_serialize_headers(line, headers), BODY))
        conn.head = loop.create_future()
        message, payload = await conn.head
        assert message.code == 200
        if not payload.is_eof():
            await payload.read()
        idle.append(conn)

    def close() -> None:
        for conn in opened:
            if conn.transport is not None:
                conn.transport.close()

    return call, close


async def _wire_client(url: URL) -> tuple[Call, Callable[[], Awaitable[None]]]:
    wire = OriginWire(connect_timeout=5.0, read_timeout=30.0)

    async def call() -> None:
        resp = await wire.post(url, BODY, CIMultiDict({"content-type": "application/json"}))
        assert resp.status == 200
        await resp.read()

    return call, wire.close


async def _session_client(url: URL) -> tuple[Call, Callable[[], Awaitable[None]]]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=1024, keepalive_timeout=30)
    session = aiohttp.ClientSession(connector=connector)
    headers = {"content-type": "application/json"}

    async def call() -> None:
        async with session.post(url, data=BODY, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()

    return call, session.close


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _round(kind: str, url: URL, calls: int) -> float:
    """CPU us per call of one client over `calls` calls."""
    closer: Callable[[], object]
    if kind == "raw floor":
        call, closer = await _raw_client(url)
    elif kind == "OriginWire":
        call, closer = await _wire_client(url)
    else:
        call, closer = await _session_client(url)

    async def loop_of(n: int) -> None:
        for _ in range(n):
            await call()

    try:
        await asyncio.gather(*(loop_of(WARMUP) for _ in range(CONCURRENCY)))
        started = _cpu()
        await asyncio.gather(*(loop_of(calls // CONCURRENCY) for _ in range(CONCURRENCY)))
        return (_cpu() - started) / calls * 1e6
    finally:
        closed = closer()
        if asyncio.iscoroutine(closed):
            await closed


KINDS = ("raw floor", "OriginWire", "ClientSession")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args(argv)
    if not cpus_available():
        print("bench.wire_micro needs CPUs 0 and 1 (it pins the client and nginx)", file=sys.stderr)
        return 2
    runs: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with (
        tempfile.TemporaryDirectory(prefix="ponto-wire-") as tmp,
        CannedOrigin(Path(tmp), cpus={1}) as origin,
        affinity({0}),
    ):
        url = URL(origin.url).with_path("/v1/chat/completions")
        for _ in range(args.rounds):
            for kind in KINDS:
                runs[kind].append(uvloop.run(_round(kind, url, args.calls)))
    floor = statistics.median(runs["raw floor"])
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; {args.rounds} rounds of "
          f"{args.calls} calls, {CONCURRENCY} loops on CPU 0, nginx on CPU 1")  # fmt: skip
    print(f"{'client CPU per call (us)':<28}{'median':>8}{'/ raw floor':>14}")
    for kind in KINDS:
        median = statistics.median(runs[kind])
        print(f"{kind:<28}{median:>8.1f}{median / floor:>13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
