"""How little a Python proxy can cost: raw asyncio protocols over aiohttp's parsers.

    .venv/bin/python -m bench.raw_floor [--rounds 3] [--seconds 5] [--conversation-kb N]
                                        [--ponto-features none]

Issue 17 measures Ponto against the bare aiohttp pass-through
(bench/passthrough.py). That is the floor of a proxy built on aiohttp's web
server and ClientSession, not of a Python proxy: most of its CPU goes to
those layers' objects (requests, responses, stream readers, writers, timers,
tasks), not to parsing or to the socket. This module answers "how much of
that could a proxy without them save?":

- `RawFloor` is the least an HTTP/1.1 proxy on uvloop can do while parsing
  properly: a client connection's requests are parsed by aiohttp's own C
  request parser (llhttp), each one is written to a keep-alive connection to
  the origin, the answer is parsed by aiohttp's C response parser and written
  back whole with its status and Content-Type. Nothing else: no timeouts, no
  streaming (an SSE answer is sent once it has ended), no flow control, no
  limits. It is a measuring stick, not a server to put in front of anyone.
- The runner times it beside the pass-through and Ponto (API key auth, rate
  limits and the exact cache on, like bench.compare's CPU phase), each alone
  on CPU 0, in wrk's closed loop (CONNECTIONS connections, from CPU 1) against
  the canned nginx origin, in interleaved rounds; it prints each one's server
  CPU per request in every round, their medians and the ratios (`make bench`
  keeps the print in docs/benchmarks/raw-floor.json through bench.record).

What the figures mean: the raw floor's CPU is what parsing both sides and
four system calls cost in Python; the pass-through's above it is aiohttp's
high-level layers; Ponto's above the raw floor is its own work plus the
aiohttp layers it still uses (its edge runs on aiohttp's RequestHandler; its
origin calls run on its own protocol over aiohttp's response parser).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvloop
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser, HttpResponseParser, RawRequestMessage
from aiohttp.streams import StreamReader

from bench import canned, compare, wrk
from bench.procs import affinity, cpus_available, pin_tree
from ponto.cliargs import listen_address
from ponto.devenv import Managed, python_entry, spawn
from ponto.fleet import Fleet

READ_LIMIT = 2**16
CONNECTIONS = 8

_Request = tuple[RawRequestMessage, StreamReader]


class _OriginSide(BaseProtocol):
    """The keep-alive connection of one client connection to the origin."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: _ClientSide) -> None:
        super().__init__(loop)
        self._client = client
        self._http = HttpResponseParser(
            self, loop, READ_LIMIT, response_with_body=True, auto_decompress=False
        )
        self._answer: Any = None  # (RawResponseMessage, StreamReader) until its body ends

    def data_received(self, data: bytes) -> None:
        try:
            messages, _, _ = self._http.feed_data(data)
        except HttpProcessingError:
            self._client.origin_failed(self)
            return
        if messages:
            self._answer = messages[-1]
        if self._answer is not None and self._answer[1].is_eof():
            message, payload = self._answer
            self._answer = None
            self._client.answer(self, message.code, message.reason,
                                message.headers.get("Content-Type", ""),
                                payload.read_nowait(-1), message.should_close)  # fmt: skip

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._client.origin_failed(self)


class _ClientSide(BaseProtocol):
    """One client connection: its requests, one at a time, to the origin."""

    def __init__(self, origin: tuple[str, int]) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(loop)
        self._loop = loop
        self._origin_address = origin
        self._http = HttpRequestParser(
            self, loop, READ_LIMIT, max_line_size=8190, max_field_size=8190, max_headers=128
        )
        self._queue: deque[_Request] = deque()
        self._busy = False  # a request is at the origin
        self._waiting_body = False  # on_eof of the head of the queue is set
        self._close_after = False
        self._origin: _OriginSide | None = None

    def data_received(self, data: bytes) -> None:
        try:
            messages, _, _ = self._http.feed_data(data)
        except HttpProcessingError:
            self._reply(400, "Bad Request", "text/plain", b"bad request\n", close=True)
            return
        self._queue.extend(messages)
        self._next()

    def _next(self) -> None:
        if self._busy or not self._queue or self.transport is None:
            return
        message, payload = self._queue[0]
        if not payload.is_eof():
            if not self._waiting_body:
                self._waiting_body = True
                payload.on_eof(self._body_done)
            return
        self._queue.popleft()
        self._busy = True
        self._close_after = message.should_close
        body = payload.read_nowait(-1)
        head = (
            b"POST %s HTTP/1.1\r\nHost: origin\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (message.path.encode(), len(body))
        )
        origin = self._origin
        if origin is not None and origin.transport is not None:
            origin.transport.writelines((head, body))
        else:
            self._loop.create_task(self._connect(head, body))

    def _body_done(self) -> None:
        self._waiting_body = False
        self._next()

    async def _connect(self, head: bytes, body: bytes) -> None:
        host, port = self._origin_address
        try:
            transport, origin = await self._loop.create_connection(
                lambda: _OriginSide(self._loop, self), host, port
            )
        except OSError:
            self._reply(502, "Bad Gateway", "text/plain", b"origin unreachable\n", close=True)
            return
        self._origin = origin
        transport.writelines((head, body))

    def answer(self, origin: _OriginSide, status: int, reason: str, content_type: str,
               body: bytes, origin_closes: bool) -> None:  # fmt: skip
        """The origin's whole answer to the request at the origin."""
        if origin_closes and origin.transport is not None:
            self._origin = None
            origin.transport.close()
        self._busy = False
        self._reply(status, reason, content_type, body, close=self._close_after)
        self._next()

    def origin_failed(self, origin: _OriginSide) -> None:
        """The origin connection broke or sent what does not parse."""
        if origin is not self._origin:
            return
        self._origin = None
        if origin.transport is not None:
            origin.transport.close()
        if self._busy:
            self._busy = False
            self._reply(502, "Bad Gateway", "text/plain", b"origin failed\n", close=True)

    def _reply(self, status: int, reason: str, content_type: str, body: bytes, *,
               close: bool) -> None:  # fmt: skip
        transport = self.transport
        if transport is None:
            return
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            status, reason.encode("latin-1"), content_type.encode("latin-1"), len(body),
            b"Connection: close\r\n" if close else b"",
        )  # fmt: skip
        transport.writelines((head, body))
        if close:
            transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        if self._origin is not None and self._origin.transport is not None:
            self._origin.transport.close()
        self._origin = None


class RawFloor:
    """The raw floor proxy on this event loop: POSTs to `origin` ((host, port))."""

    def __init__(self, origin: tuple[str, int]) -> None:
        self._origin = origin
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ClientSide(self._origin), host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _serve(listen: tuple[str, int], origin: tuple[str, int], ready: Path | None) -> None:
    floor = RawFloor(origin)
    await floor.start(*listen)
    if ready is not None:
        tmp = ready.with_name(f".{ready.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{listen[0]}:{floor.port}")
        tmp.replace(ready)  # whole or absent: the runner polls for it
    await asyncio.Event().wait()  # until killed


# ---------------------------------------------------------------- the runner


@dataclass
class Row:
    key: str
    label: str
    pid: int
    url: str
    headers: tuple[tuple[str, str], ...] = ()


def measure(
    rounds: int, seconds: int, conversation_kb: int = 0, features: str = "auth-limits-cache"
) -> dict[str, Any]:
    """Start the three servers and the canned origin, time them in interleaved
    rounds, stop them; returns the report. With `conversation_kb`, each request
    is an agent's conversation of about that many KB
    (bench.compare.conversation_body) instead of one short message.
    `features`: what Ponto runs per request (bench.compare.configure_ponto_features)."""
    body = (
        compare.conversation_body(canned.CANNED_MODEL, conversation_kb)
        if conversation_kb
        else compare.CANNED_BODY
    )
    pinned = cpus_available()
    per: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ponto-raw-floor-") as tmp, Fleet(Path(tmp)) as fleet:
        if pinned:
            os.sched_setaffinity(0, {compare.LOAD_CPU})
        _, proxy = compare.start_ponto(fleet, ["--workers", "1"])
        nginx = compare.start_canned(fleet, Path(tmp) / "canned")
        floor_proc: Managed | None = None
        passthrough: Managed | None = None
        try:
            passthrough = compare.start_passthrough(fleet, nginx.address, "passthrough-canned")
            headers, said = compare.configure_ponto_features(fleet, features)
            ready = fleet.workdir / "raw-floor.addr"
            argv = [*python_entry("bench.raw_floor"), "--serve", "127.0.0.1:0",
                    "--origin", nginx.address, "--ready-file", str(ready)]  # fmt: skip
            with affinity({compare.SERVER_CPU}):
                floor_proc = spawn("raw-floor", argv, fleet.workdir, ready_file=ready)
            pin_tree(floor_proc.proc.pid, {compare.SERVER_CPU})
            path = "/v1/chat/completions"
            rows = [
                Row("raw", "raw floor", floor_proc.proc.pid, f"http://{floor_proc.address}{path}"),
                Row("passthrough", "pass-through", passthrough.proc.pid,
                    f"http://{passthrough.address}{path}"),
                Row("ponto", "Ponto", proxy.proc.pid,
                    fleet.proxy_url("proxy") + "/chat/completions", headers),
            ]  # fmt: skip
            for _ in range(rounds):
                for row in rows:
                    spec = wrk.WrkSpec(
                        url=row.url, body=body, headers=row.headers,
                        connections=CONNECTIONS, duration=seconds, warmup=1, timeout=5,
                        cpus=frozenset({compare.LOAD_CPU}) if pinned else None,
                        watch_pids=(row.pid,),
                    )  # fmt: skip
                    result = wrk.run(spec)
                    if result.error_ratio() > 0.001:
                        raise RuntimeError(f"{row.label}: errors {result.errors}")
                    cpu = result.watched_cpu_s.get(row.pid, 0.0)
                    per.setdefault(row.key, []).append(cpu / max(1, result.ok) * 1e6)
        finally:
            for server in (floor_proc, passthrough):
                if server is not None:
                    server.stop()
            nginx.stop()
    median = {k: statistics.median(v) for k, v in per.items()}
    return {
        "name": "raw-floor",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "ponto_features": said,
        "conversation_kb": conversation_kb,
        "rounds": rounds,
        "seconds": seconds,
        "cpu_us_per_request": {k: [round(x, 1) for x in v] for k, v in per.items()},
        "median_us": {k: round(v, 1) for k, v in median.items()},
        "raw_over_passthrough": round(median["raw"] / median["passthrough"], 3),
        "ponto_over_passthrough": round(median["ponto"] / median["passthrough"], 3),
        "ponto_over_raw": round(median["ponto"] / median["raw"], 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--conversation-kb", type=int, default=0, metavar="N",
                   help="requests of an agent's conversation of about N KB")  # fmt: skip
    p.add_argument("--ponto-features", choices=("auth-limits-cache", "none"),
                   default="auth-limits-cache",
                   help="what Ponto runs per request (none: its defaults)")  # fmt: skip
    p.add_argument("--serve", type=listen_address, help=argparse.SUPPRESS)  # the runner's child
    p.add_argument("--origin", type=listen_address, help=argparse.SUPPRESS)
    p.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve is not None:
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(_serve(a.serve, a.origin, a.ready_file))
        return 0
    report = measure(a.rounds, a.seconds, a.conversation_kb, a.ponto_features)
    print(f"{report['date']}; Ponto: {report['ponto_features']}")
    if a.conversation_kb:
        print(f"requests: an agent's conversation of about {a.conversation_kb} KB")
    print(f"wrk closed loop, {CONNECTIONS} connections, {a.seconds} s a round, canned nginx origin")
    print(f"{'server CPU per request (us)':30s} {'rounds':>24s} {'median':>8s}")
    labels = {"raw": "raw floor", "passthrough": "aiohttp pass-through", "ponto": "Ponto"}
    for key, label in labels.items():
        rounds = " ".join(f"{x:7.1f}" for x in report["cpu_us_per_request"][key])
        print(f"{label:30s} {rounds:>24s} {report['median_us'][key]:8.1f}")
    print(
        f"raw / pass-through {report['raw_over_passthrough']:.2f}x; "
        f"Ponto / pass-through {report['ponto_over_passthrough']:.2f}x; "
        f"Ponto / raw {report['ponto_over_raw']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
