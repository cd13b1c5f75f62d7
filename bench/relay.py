"""A user-space TCP relay that gives a loopback link the round trip of a long one.

    .venv/bin/python -m bench.relay --link NAME=HOST:PORT@RTT_MS [--link ...] \
        [--setup-rtts 1] [--listen-host 127.0.0.1] [--ready-file PATH]

Every link listens on a port of its own and relays each accepted connection to
its target. Bytes in either direction are held for RTT/2 after they arrive and
then written on, in the order they came, so a request and its response cost one
RTT more than on loopback, and a stream keeps its pacing (shifted by RTT/2).
No `tc`/netem is needed, so this runs unprivileged and in containers.

What is modelled and what is not:

* Propagation delay only. There is no bandwidth limit, loss or jitter, and the
  delay is fixed: the link adds RTT/2 per direction, never less (a chunk is
  never written before it is due) and at most about a millisecond more (timers
  are armed in whole milliseconds, rounded up).
* Connection set-up: a new connection's first bytes towards the target leave
  `setup_rtts` round trips after the connection was accepted (1 = the TCP
  handshake; 2 would add a TLS 1.3 handshake). Keep-alive connections pay it
  once, as they do on a real network.
* Half-closes travel with the same delay; a reset arrives as a close.
* Reading from a side pauses while more than HIGH_WATER bytes wait to be
  delivered from it, or while the far side's socket buffer is full.

Scheduling: each direction of each connection is a FIFO of (due time, chunk)
with one timer armed for its head. Due times are arrival time plus a constant,
so they never decrease and the FIFO is time-ordered; reading never waits for
writing, so a link's throughput is not serialised by its delay.

With `--ready-file`, the relay writes a JSON object {link name: "HOST:PORT"} of
the bound addresses there once every link listens (atomically). SIGTERM or
SIGINT stops it; it then prints how many connections each link accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast

from ponto.cliargs import listen_address

HIGH_WATER: Final = 1 << 20
LOW_WATER: Final = 1 << 18


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One emulated link: where to listen, where to relay to, and its round trip.

    Attributes:
        name: Label in logs and in the ready file.
        target: (host, port) every accepted connection is relayed to.
        rtt_s: Round-trip time the link adds; each direction gets half.
        setup_rtts: Round trips a new connection costs before its first bytes
            towards the target leave (TCP handshake = 1).
        listen: (host, port) to bind; port 0 picks a free one.
    """

    name: str
    target: tuple[str, int]
    rtt_s: float
    setup_rtts: float = 1.0
    listen: tuple[str, int] = ("127.0.0.1", 0)

    def __post_init__(self) -> None:
        for label, value in (("rtt_s", self.rtt_s), ("setup_rtts", self.setup_rtts)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")

    @property
    def one_way_s(self) -> float:
        return self.rtt_s / 2


class _Pipe:
    """One direction of one relayed connection.

    Chunks read from `source` are written to `dest` `delay` seconds after they
    arrived, in arrival order. `None` in the queue marks the end of the source
    (EOF or connection lost); delivering it half-closes `dest`.
    """

    def __init__(self, conn: _Connection, delay: float) -> None:
        self._conn = conn
        self._delay = delay
        self._queue: deque[tuple[float, bytes | None]] = deque()
        self._queued = 0
        self._timer: asyncio.Handle | None = None
        self.source: asyncio.Transport | None = None
        self.dest: asyncio.Transport | None = None
        self._pause_reasons: set[str] = set()
        self.ended = False  # the end marker was pushed
        self.done = False  # the end was delivered, or dest is gone

    def push(self, data: bytes | None, not_before: float = 0.0) -> None:
        if self.ended or self.done:
            return
        due = max(time.monotonic(), not_before) + self._delay
        self._queue.append((due, data))
        if data is None:
            self.ended = True
        else:
            self._queued += len(data)
            if self._queued > HIGH_WATER:
                self.pause_source("queue")
        self._arm()

    def attach(self, dest: asyncio.Transport) -> None:
        self.dest = dest
        self._arm()

    def abandon(self) -> None:
        """`dest` is gone: nothing more can be delivered."""
        self.done = True
        self._queue.clear()
        self._queued = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def pause_source(self, reason: str) -> None:
        if not self._pause_reasons and self.source is not None and not self.source.is_closing():
            self.source.pause_reading()
        self._pause_reasons.add(reason)

    def resume_source(self, reason: str) -> None:
        if reason not in self._pause_reasons:
            return
        self._pause_reasons.discard(reason)
        if not self._pause_reasons and self.source is not None and not self.source.is_closing():
            self.source.resume_reading()

    def _arm(self) -> None:
        if self._timer is not None or not self._queue or self.dest is None or self.done:
            return
        wait = self._queue[0][0] - time.monotonic()
        loop = asyncio.get_running_loop()
        if wait <= 0:
            self._timer = loop.call_soon(self._flush)
        else:
            # Whole milliseconds, rounded up: uvloop rounds a delay to the nearest
            # millisecond and runs one under 0.5 ms at once, which would spin here.
            self._timer = loop.call_later(math.ceil(wait * 1000) / 1000, self._flush)

    def _flush(self) -> None:
        self._timer = None
        dest = self.dest
        if dest is None or self.done:
            return
        # Timers may fire a little early (uvloop rounds to milliseconds); what is
        # not yet due waits for the next arming, so no chunk ever leaves early.
        now = time.monotonic()
        while self._queue and self._queue[0][0] <= now:
            _, data = self._queue.popleft()
            if data is None:
                self.done = True
                self._queue.clear()
                self._conn.delivered_end(self)
                return
            self._queued -= len(data)
            if not dest.is_closing():
                dest.write(data)
        if self._queued < LOW_WATER:
            self.resume_source("queue")
        self._arm()


class _Side(asyncio.Protocol):
    """The protocol of one of the two sockets of a relayed connection."""

    def __init__(self, conn: _Connection, outgoing: _Pipe, incoming: _Pipe) -> None:
        self._conn = conn
        self._out = outgoing  # what this side sends
        self._in = incoming  # what is delivered to this side
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        stream = cast(asyncio.Transport, transport)
        self.transport = stream
        self._out.source = stream
        self._in.attach(stream)

    def data_received(self, data: bytes) -> None:
        self._conn.link.bytes_relayed += len(data)
        self._out.push(data, self._conn.not_before(self._out))

    def eof_received(self) -> bool:
        self._out.push(None, self._conn.not_before(self._out))
        return True  # keep the socket open: the other direction may still flow

    def connection_lost(self, exc: Exception | None) -> None:
        self._out.push(None, self._conn.not_before(self._out))
        self._in.abandon()
        self._conn.side_lost()

    def pause_writing(self) -> None:
        self._in.pause_source("dest")

    def resume_writing(self) -> None:
        self._in.resume_source("dest")


class _Connection:
    """One accepted connection and the one it opened to the target."""

    def __init__(self, link: Relay) -> None:
        self.link = link
        self.accepted_at = time.monotonic()
        delay = link.spec.one_way_s
        self.up = _Pipe(self, delay)  # client -> target
        self.down = _Pipe(self, delay)  # target -> client
        self.client = _Side(self, self.up, self.down)
        self.target = _Side(self, self.down, self.up)
        self._connecting: asyncio.Task[None] | None = None

    def not_before(self, pipe: _Pipe) -> float:
        # The client's first bytes can only leave once the handshake is done.
        if pipe is self.up:
            return self.accepted_at + self.link.spec.setup_rtts * self.link.spec.rtt_s
        return 0.0

    def connect(self) -> None:
        self._connecting = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        host, port = self.link.spec.target
        try:
            await asyncio.get_running_loop().create_connection(lambda: self.target, host, port)
        except OSError:
            self.abort()

    def delivered_end(self, pipe: _Pipe) -> None:
        dest = pipe.dest
        if dest is not None and not dest.is_closing():
            if self.up.done and self.down.done:
                dest.close()
            elif dest.can_write_eof():
                dest.write_eof()
            else:
                dest.close()
        if self.up.done and self.down.done:
            self.close()

    def side_lost(self) -> None:
        if self.up.done and self.down.done:
            self.close()

    def close(self) -> None:
        for side in (self.client, self.target):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.close()
        self.link.forget(self)

    def abort(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        for pipe in (self.up, self.down):
            pipe.abandon()
        for side in (self.client, self.target):
            if side.transport is not None:
                side.transport.abort()
        self.link.forget(self)


class Relay:
    """Listens for one link and relays every connection with the link's delay.

    Lives on one event loop: `start()` binds, `close()` stops listening and
    aborts connections still open. Not thread-safe.
    """

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.connections = 0  # accepted so far: new connections that crossed the link
        self.bytes_relayed = 0
        self._open: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self.address: tuple[str, int] = spec.listen

    async def start(self) -> tuple[str, int]:
        """Bind and return the (host, port) actually listened on."""
        host, port = self.spec.listen
        self._server = await asyncio.get_running_loop().create_server(self._accept, host, port)
        sockname = self._server.sockets[0].getsockname()
        self.address = (str(sockname[0]), int(sockname[1]))
        return self.address

    def _accept(self) -> _Side:
        conn = _Connection(self)
        self.connections += 1
        self._open.add(conn)
        conn.connect()
        return conn.client

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._open):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        # Let aborted transports run their connection_lost callbacks.
        await asyncio.sleep(0)

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ----------------------------------------------------------------------------- CLI


def parse_link(value: str, *, setup_rtts: float = 1.0, listen_host: str = "127.0.0.1") -> LinkSpec:
    """Parse NAME=HOST:PORT@RTT_MS into a LinkSpec listening on a free port."""
    name, eq, rest = value.partition("=")
    target, at, rtt = rest.rpartition("@")
    if not eq or not name or not at:
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT@RTT_MS, got {value!r}")
    try:
        rtt_ms = float(rtt)
        return LinkSpec(name, listen_address(target), rtt_ms / 1000, setup_rtts, (listen_host, 0))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from exc


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


async def _serve(specs: list[LinkSpec], ready_file: Path | None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    relays = [Relay(spec) for spec in specs]
    try:
        bound: dict[str, str] = {}
        for relay in relays:
            host, port = await relay.start()
            bound[relay.spec.name] = f"{host}:{port}"
            t_host, t_port = relay.spec.target
            print(f"relay {relay.spec.name} {host}:{port} -> {t_host}:{t_port} "
                  f"rtt {relay.spec.rtt_s * 1000:.1f} ms")  # fmt: skip
        sys.stdout.flush()
        if ready_file is not None:
            _write_atomically(ready_file, json.dumps(bound))
        await stop.wait()
    finally:
        for relay in relays:
            await relay.close()
    for relay in relays:
        print(f"relay {relay.spec.name}: {relay.connections} connections, "
              f"{relay.bytes_relayed} bytes")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.relay", description="Latency relay for emulated links")
    p.add_argument("--link", action="append", default=[], metavar="NAME=HOST:PORT@RTT_MS")
    p.add_argument("--setup-rtts", type=float, default=1.0, help="round trips per new connection")
    p.add_argument("--listen-host", default="127.0.0.1")
    p.add_argument("--ready-file", type=Path, help="write {name: HOST:PORT} here once listening")
    args = p.parse_args(argv)
    if not args.link:
        p.error("at least one --link is needed")
    try:
        specs = [parse_link(v, setup_rtts=args.setup_rtts, listen_host=args.listen_host)
                 for v in args.link]  # fmt: skip
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if len({s.name for s in specs}) != len(specs):
        p.error("link names must be unique")
    if args.ready_file is not None:
        args.ready_file.unlink(missing_ok=True)
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up, a dependency of the project

        return uvloop.run(_serve(specs, args.ready_file))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
