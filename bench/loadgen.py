"""Open-loop and closed-loop HTTP/1.1 load for the benchmarks.

    .venv/bin/python -m bench.loadgen URL --rate 1000 [--duration 10] [--stream]
    .venv/bin/python -m bench.loadgen URL --closed 16 [--duration 10]

Open loop (the measurement): request i is due at ``t0 + i / rate`` whatever
happened to the requests before it, and its latency runs from that due time,
not from when it was written. A server that stalls is charged for every request
it holds up, and a generator that falls behind is charged too, never hidden
(no coordinated omission). A request waits for a free keep-alive connection
only when all are busy; the pool starts sized for the rate and grows up to
``max_connections``, reusing the most recently freed connection first so that a
low rate keeps few connections warm instead of spraying bursts over many.

Closed loop (only for the maximum rate): ``connections`` connections each send
their next request as soon as the previous answer ends. Its latencies are
service times; its throughput is the figure of interest.

Timing. Stamps come from ``time.monotonic()`` (nanosecond clock). Open-loop runs
use a selector event loop over ``select()``, whose timeout has microsecond
resolution: uvloop and epoll round timers to whole milliseconds, which would
send requests up to 1 ms late and bury sub-millisecond differences. Closed-loop
runs need no timers and use uvloop. The client is a minimal HTTP/1.1 client on
asyncio protocols (keep-alive, Content-Length and chunked bodies): an aiohttp
client spends several times more CPU per request and would itself become the
bottleneck above a few thousand requests/s on one core.

A run is bounded: nothing is sent after ``warmup + duration``, and requests
still open ``timeout`` seconds after their due time are aborted and counted as
timeouts. ``LoadGenerator`` runs specs in a separate process pinned to one CPU,
so the generator never competes with the server under test for its core.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import math
import multiprocessing
import os
import selectors
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, cast
from urllib.parse import urlsplit

import uvloop

Mode = Literal["open", "closed"]
INDEX_MARK = b"{i}"
_NAN = math.nan
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One run of load against one URL. Frozen and picklable (sent to a worker).

    Attributes:
        url: ``http://host:port/path``; only plain HTTP/1.1 is spoken.
        body: POST body; if it holds ``{i}`` once, each request gets its own
            index there (distinct prompts, so no cache answers a repeat).
            Empty means GET.
        headers: Extra request headers (``Content-Type: application/json`` is
            always sent with a body).
        mode: "open" (paced at ``rate``) or "closed" (back to back).
        rate: Requests per second in open mode.
        connections: Open mode: connections opened before t0 (0 sizes it for
            the rate). Closed mode: the number of concurrent connections.
        max_connections: Open mode: the pool never grows past this.
        duration: Seconds measured, after the warm-up.
        warmup: Seconds of the same load sent first and not measured.
        timeout: A request unanswered this long after its due time is aborted.
        stream: The answer is SSE; it counts as ok only if it ends with
            ``data: [DONE]``.
        cpu: Pin the generator process to this CPU (LoadGenerator only).
        watch_pids: Processes whose CPU time (utime + stime) is read at the
            start and end of the measured window.
    """

    url: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    mode: Mode = "open"
    rate: float = 100.0
    connections: int = 0
    max_connections: int = 256
    duration: float = 5.0
    warmup: float = 1.0
    timeout: float = 5.0
    stream: bool = False
    cpu: int | None = None
    watch_pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode == "open" and not self.rate > 0:
            raise ValueError("open mode needs a rate > 0")
        if self.mode == "closed" and self.connections < 1:
            raise ValueError("closed mode needs connections >= 1")
        if self.duration <= 0 or self.warmup < 0 or self.timeout <= 0:
            raise ValueError("duration and timeout must be > 0, warmup >= 0")
        if self.body.count(INDEX_MARK) > 1:
            raise ValueError("the body may hold {i} at most once")

    def initial_connections(self) -> int:
        if self.mode == "closed":
            return self.connections
        if self.connections:
            return min(self.connections, self.max_connections)
        # Enough for ~3 ms of arrivals in flight at once, at least two.
        return max(2, min(self.max_connections, math.ceil(self.rate * 0.003)))


def due_times(rate: float, count: int, t0: float = 0.0) -> list[float]:
    """The open-loop schedule: request i is due at t0 + i / rate (no drift)."""
    return [t0 + i / rate for i in range(count)]


@dataclass(slots=True)
class LoadResult:
    """What one run measured. Times are seconds relative to t0 (the first due time).

    The per-request lists cover the measured requests only (warm-up excluded),
    in due order, and have equal lengths; ``nan`` marks a stamp that never came
    (not sent, no body byte, not finished). ``status`` is 0 for a request with
    no complete answer; ``error`` is "" for an ok request and otherwise a kind:
    "http_<status>", "timeout", "connect", "closed", "bad_response" or
    "incomplete_stream".
    """

    spec: LoadSpec
    window: tuple[float, float]
    due: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    status: list[int] = field(default_factory=list)
    error: list[str] = field(default_factory=list)
    connections_opened: int = 0
    gen_cpu_s: float = 0.0
    watched_cpu_s: dict[int, float] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.due)

    @property
    def ok(self) -> int:
        return sum(1 for e in self.error if not e)

    @property
    def elapsed(self) -> float:
        return self.window[1] - self.window[0]

    def errors(self) -> dict[str, int]:
        return dict(collections.Counter(e for e in self.error if e))

    def error_ratio(self) -> float:
        return (self.requests - self.ok) / self.requests if self.requests else 1.0

    def latency(self) -> list[float]:
        """Seconds from due time to the end of the answer, ok requests only."""
        return [d - u for d, u, e in zip(self.done, self.due, self.error, strict=True) if not e]

    def ttfb(self) -> list[float]:
        """Seconds from due time to the first body byte (a stream's first event)."""
        return [f - u for f, u, e in zip(self.first, self.due, self.error, strict=True) if not e]

    def service(self) -> list[float]:
        """Seconds from the request's write to the end of its answer, ok requests."""
        return [d - s for d, s, e in zip(self.done, self.sent, self.error, strict=True) if not e]

    def lateness(self) -> list[float]:
        """Seconds each sent request left after its due time (generator lag + queueing)."""
        return [s - u for s, u in zip(self.sent, self.due, strict=True) if not math.isnan(s)]

    def throughput(self) -> float:
        """Ok answers per second of the measured window."""
        return self.ok / self.elapsed if self.elapsed > 0 else 0.0


def merge(results: Sequence[LoadResult]) -> LoadResult:
    """One result from several runs of the same kind (e.g. alternating rounds).

    Per-request times stay relative to each run's own t0 (only differences are
    used); the window becomes the sum of the measured windows, CPU times add up.
    """
    if not results:
        raise ValueError("nothing to merge")
    out = LoadResult(spec=results[0].spec, window=(0.0, sum(r.elapsed for r in results)))
    for r in results:
        out.due += r.due
        out.sent += r.sent
        out.first += r.first
        out.done += r.done
        out.status += r.status
        out.error += r.error
        out.connections_opened += r.connections_opened
        out.gen_cpu_s += r.gen_cpu_s
        for pid, cpu in r.watched_cpu_s.items():
            out.watched_cpu_s[pid] = out.watched_cpu_s.get(pid, 0.0) + cpu
    return out


# ---------------------------------------------------------------- client


class _Request:
    __slots__ = ("done", "due", "error", "first", "index", "sent", "status")

    def __init__(self, index: int, due: float) -> None:
        self.index = index
        self.due = due
        self.sent = _NAN
        self.first = _NAN
        self.done = _NAN
        self.status = 0
        self.error = ""


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER, _UNTIL_EOF = range(6)
_MAX_HEAD = 64 * 1024


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.request: _Request | None = None
        self.closed = False
        self._buf = bytearray()
        self._state = _HEAD
        self._remaining = 0
        self._keep_alive = True
        self._tail = b""

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; both have write().
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        request = self.request
        if request is not None:
            self.request = None
            if self._state == _UNTIL_EOF:
                self._finish(request, time.monotonic())
            else:
                request.error = "closed"
                self.pool.finished(request, self, time.monotonic())
        self.pool.lost(self)

    def data_received(self, data: bytes) -> None:
        request = self.request
        if request is None:  # bytes nobody asked for
            self.abort()
            return
        now = time.monotonic()
        if self._state == _LENGTH:  # the common case: no copying
            n = len(data)
            if n and math.isnan(request.first):
                request.first = now
            if self.pool.spec.stream:
                self._tail = (self._tail + data)[-32:]
            self._remaining -= n
            if self._remaining <= 0:
                self._finish(request, now)
            return
        self._buf += data
        try:
            self._parse(request, now)
        except ValueError:
            request.error = "bad_response"
            self.request = None
            self.abort()
            self.pool.finished(request, self, now)

    # -- parsing

    def _parse(self, request: _Request, now: float) -> None:
        buf = self._buf
        pos = 0
        while True:
            if self._state == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if len(buf) - pos > _MAX_HEAD:
                        raise ValueError("response head too large")
                    break
                head = bytes(buf[pos:end])
                pos = end + 4
                self._head(request, head)
                if self.request is not request:  # finished with an empty body
                    return
            elif self._state in (_LENGTH, _UNTIL_EOF):
                n = len(buf) - pos
                if n and math.isnan(request.first):
                    request.first = now
                if self.pool.spec.stream:
                    self._tail = (self._tail + bytes(buf[pos:]))[-32:]
                pos = len(buf)
                if self._state == _LENGTH:
                    self._remaining -= n
                    if self._remaining <= 0:
                        self._finish(request, now)
                        return
                break
            elif self._state == _CHUNK_SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                size = int(bytes(buf[pos:end]).split(b";", 1)[0].strip(), 16)
                pos = end + 2
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._remaining = size
                    self._state = _CHUNK_DATA
            elif self._state == _CHUNK_DATA:
                available = len(buf) - pos
                if available <= 0:
                    break
                if self._remaining > 0:
                    take = min(available, self._remaining)
                    if math.isnan(request.first):
                        request.first = now
                    if self.pool.spec.stream:
                        self._tail = (self._tail + bytes(buf[pos : pos + take]))[-32:]
                    pos += take
                    self._remaining -= take
                    continue
                if available < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk not followed by CRLF")
                pos += 2
                self._state = _CHUNK_SIZE
            else:  # _TRAILER: header lines until an empty one
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                empty = end == pos
                pos = end + 2
                if empty:
                    self._finish(request, now)
                    return
        del buf[:pos]

    def _head(self, request: _Request, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError("not an HTTP/1.x status line")
        request.status = int(parts[1])
        length = -1
        chunked = False
        self._keep_alive = parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == b"content-length":
                length = int(value.strip())
            elif key == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif key == b"connection":
                token = value.strip().lower()
                self._keep_alive = token != b"close" and (
                    self._keep_alive or token == b"keep-alive"
                )
        if chunked:
            self._state = _CHUNK_SIZE
        elif length >= 0:
            self._state = _LENGTH
            self._remaining = length
            if length == 0:
                self._finish(request, time.monotonic())
        else:
            self._state = _UNTIL_EOF
            self._keep_alive = False

    def _finish(self, request: _Request, now: float) -> None:
        # The pool may send the next request on this connection before this
        # returns: callers must not touch the parse state afterwards.
        request.done = now
        if request.status != 200:
            request.error = f"http_{request.status}"
        elif self.pool.spec.stream and not self._tail.rstrip().endswith(b"data: [DONE]"):
            request.error = "incomplete_stream"
        self.request = None
        keep = self._keep_alive and not self.closed
        self._state = _HEAD
        self._tail = b""
        self._buf.clear()
        if not keep:
            self.abort()
        self.pool.finished(request, self, now)

    # -- use

    def send(self, request: _Request, data: bytes) -> None:
        assert self.transport is not None
        self.request = request
        request.sent = time.monotonic()
        self.transport.write(data)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Pool:
    """Connections, requests waiting for one, and the bookkeeping of one run."""

    def __init__(self, spec: LoadSpec, loop: asyncio.AbstractEventLoop) -> None:
        self.spec = spec
        self.loop = loop
        parts = urlsplit(spec.url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http:// URLs are supported, got {spec.url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        method = b"POST" if spec.body else b"GET"
        head = [f"{method.decode()} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{k}: {v}" for k, v in spec.headers]
        if spec.body:
            head.append("Content-Type: application/json")
        self._head = ("\r\n".join(head) + "\r\n").encode()
        self._body_parts = spec.body.split(INDEX_MARK, 1)
        self._fixed = self._encode(0) if len(self._body_parts) == 1 else None
        self.idle: list[_Connection] = []  # a stack: the warmest connection first
        self.busy: set[_Connection] = set()
        self.connecting = 0
        self.opened = 0
        self.connect_failures = 0
        self.waiting: collections.deque[_Request] = collections.deque()
        self.outstanding = 0
        self.all_done = asyncio.Event()
        self.closed_loop_until = 0.0  # closed mode: send again until this time
        self.limit = spec.connections if spec.mode == "closed" else spec.max_connections
        self.requests: list[_Request] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def _encode(self, index: int) -> bytes:
        if not self.spec.body:
            return self._head + b"\r\n"
        parts = self._body_parts
        body = parts[0] if len(parts) == 1 else parts[0] + str(index).encode() + parts[1]
        return self._head + b"Content-Length: %d\r\n\r\n" % len(body) + body

    def request_bytes(self, index: int) -> bytes:
        return self._fixed if self._fixed is not None else self._encode(index)

    # -- connections

    async def open(self, count: int) -> None:
        """Open `count` connections up front (before t0); raises if none opens."""
        results = await asyncio.gather(
            *(self._connect() for _ in range(count)), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if len(failures) == count:
            raise ConnectionError(f"cannot connect to {self.host}:{self.port}: {failures[0]}")

    async def _connect(self) -> None:
        self.connecting += 1
        try:
            _, conn = await self.loop.create_connection(
                lambda: _Connection(self), self.host, self.port
            )
        except OSError:
            self.connect_failures += 1
            raise
        finally:
            self.connecting -= 1
        self.opened += 1
        self._available(conn)

    def _grow(self) -> None:
        if len(self.idle) + len(self.busy) + self.connecting < self.limit:
            task = self.loop.create_task(self._connect())
            self._tasks.add(task)
            task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # Nothing listens: fail the oldest waiting request rather than retry forever.
        if self.waiting:
            request = self.waiting.popleft()
            request.error = "connect"
            self.finished(request, None, time.monotonic())

    def _available(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        if conn.closed:
            return
        if self.waiting:
            self._send(conn, self.waiting.popleft())
        elif self.spec.mode == "closed" and time.monotonic() < self.closed_loop_until:
            self._send(conn, self._track(_Request(len(self.requests), time.monotonic())))
        else:
            self.idle.append(conn)

    def _send(self, conn: _Connection, request: _Request) -> None:
        self.busy.add(conn)
        conn.send(request, self.request_bytes(request.index))

    def lost(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)
        if self.waiting:
            self._grow()

    # -- requests

    def _track(self, request: _Request) -> _Request:
        self.requests.append(request)
        self.outstanding += 1
        self.all_done.clear()
        return request

    def submit(self, request: _Request) -> None:
        self._track(request)
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self._send(conn, request)
                return
        self.waiting.append(request)
        self._grow()

    def finished(self, request: _Request, conn: _Connection | None, now: float) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self.all_done.set()
        if conn is not None and not conn.closed:
            self._available(conn)
        elif conn is not None:
            self.busy.discard(conn)
            if self.waiting or (
                self.spec.mode == "closed" and time.monotonic() < self.closed_loop_until
            ):
                self._grow()

    def expire(self, now: float) -> None:
        """Abort whatever is past its due time + timeout."""
        limit = now - self.spec.timeout
        while self.waiting and self.waiting[0].due <= limit:
            request = self.waiting.popleft()
            request.error = "timeout"
            self.finished(request, None, now)
        for conn in list(self.busy):
            running = conn.request
            if running is not None and running.due <= limit:
                conn.request = None
                running.error = "timeout"
                conn.abort()
                self.finished(running, conn, now)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in [*self.idle, *self.busy]:
            conn.abort()
        self.idle.clear()
        self.busy.clear()


# ---------------------------------------------------------------- runs


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc; nan if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return _NAN
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


async def _sweep(pool: _Pool, stop: asyncio.Event) -> None:
    period = min(0.02, pool.spec.timeout / 4)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)
        pool.expire(time.monotonic())


async def run_async(spec: LoadSpec) -> LoadResult:
    """Run `spec` on the running event loop and return what it measured.

    Safe to await from tests; the process-level choices (CPU pinning, which
    event loop) belong to ``run`` and ``LoadGenerator``.
    """
    loop = asyncio.get_running_loop()
    pool = _Pool(spec, loop)
    try:
        await pool.open(spec.initial_connections())
    except BaseException:
        await pool.close()
        raise
    stop = asyncio.Event()
    sweeper = loop.create_task(_sweep(pool, stop))
    cpu_gen = time.process_time()
    watch_start: dict[int, float] = {}
    t0 = time.monotonic() + 0.005
    start, end = t0 + spec.warmup, t0 + spec.warmup + spec.duration
    try:
        if spec.mode == "open":
            watch_start = await _open_loop(pool, spec, t0, start, end)
        else:
            watch_start = await _closed_loop(pool, spec, t0, start, end)
        watch_end = {pid: _cpu_seconds(pid) for pid in spec.watch_pids}
        gen_cpu = time.process_time() - cpu_gen
        # Whatever is still open ends by itself or at its due time + timeout.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(pool.all_done.wait(), spec.timeout + 1.0)
        pool.expire(math.inf)
    finally:
        stop.set()
        await sweeper
        await pool.close()
        await asyncio.sleep(0)  # let aborted transports run connection_lost
    if spec.mode == "open":
        measured = [r for r in pool.requests if start <= r.due < end]
    else:
        measured = [
            r for r in pool.requests if start <= r.done < end or (r.error and start <= r.due < end)
        ]
    result = LoadResult(
        spec=spec,
        window=(start - t0, end - t0),
        connections_opened=pool.opened,
        gen_cpu_s=gen_cpu,
        watched_cpu_s={pid: watch_end[pid] - watch_start.get(pid, _NAN) for pid in spec.watch_pids},
    )
    for r in measured:
        result.due.append(r.due - t0)
        result.sent.append(r.sent - t0)
        result.first.append(r.first - t0)
        result.done.append(r.done - t0)
        result.status.append(r.status if not r.error else 0)
        result.error.append(r.error)
    return result


async def _open_loop(
    pool: _Pool, spec: LoadSpec, t0: float, start: float, end: float
) -> dict[int, float]:
    total = math.ceil((end - t0) * spec.rate - 1e-9)
    measured_from = math.ceil((start - t0) * spec.rate - 1e-9)
    watch: dict[int, float] = {}
    i = 0
    while i < total:
        now = time.monotonic()
        while i < total and t0 + i / spec.rate <= now:
            if i == measured_from:
                watch = {pid: _cpu_seconds(pid) for pid in spec.watch_pids}
            pool.submit(_Request(i, t0 + i / spec.rate))
            i += 1
        if i < total:
            await asyncio.sleep(t0 + i / spec.rate - time.monotonic())
    if not watch:
        watch = {pid: _cpu_seconds(pid) for pid in spec.watch_pids}
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    return watch


async def _closed_loop(
    pool: _Pool, spec: LoadSpec, t0: float, start: float, end: float
) -> dict[int, float]:
    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    pool.closed_loop_until = end
    for _ in range(spec.connections):
        pool.submit(_Request(len(pool.requests), time.monotonic()))
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    watch = {pid: _cpu_seconds(pid) for pid in spec.watch_pids}
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    return watch


def _new_loop(spec: LoadSpec) -> asyncio.AbstractEventLoop:
    if spec.mode == "open":
        # select() takes a timeval: microsecond timers (see the module docstring).
        return asyncio.SelectorEventLoop(selectors.SelectSelector())
    return uvloop.new_event_loop()


def _tight_timers() -> None:
    """Ask Linux for 1 ns timer slack (default 50 us): sends leave closer to their due time."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK


def run(spec: LoadSpec) -> LoadResult:
    """Run `spec` in this process on a fresh event loop; pins to spec.cpu if set."""
    if spec.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {spec.cpu})
    if sys.platform == "linux":
        _tight_timers()
    loop = _new_loop(spec)
    try:
        return loop.run_until_complete(run_async(spec))
    finally:
        loop.close()


class LoadGenerator:
    """Runs specs in one long-lived worker process (spawned, not forked).

    Use as a context manager; ``run`` blocks until the spec is done. The worker
    is spawned so that it inherits none of the caller's threads (gRPC).
    """

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx)

    def run(self, spec: LoadSpec) -> LoadResult:
        bound = spec.warmup + spec.duration + 2 * spec.timeout + 60
        return self._pool.submit(run, spec).result(timeout=bound)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- summaries


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; nan for no values."""
    if not values:
        return _NAN
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


QUANTILES = (50.0, 90.0, 99.0, 99.9)


def quantiles_ms(
    values: Iterable[float], qs: Sequence[float] = QUANTILES
) -> dict[str, float | None]:
    """Percentiles, max and mean in milliseconds; None for each when there are no values."""
    ordered = sorted(values)
    if not ordered:
        return {**{f"p{q:g}": None for q in qs}, "max": None, "mean": None}
    out: dict[str, float | None] = {f"p{q:g}": round(percentile(ordered, q) * 1e3, 4) for q in qs}
    out["max"] = round(ordered[-1] * 1e3, 4)
    out["mean"] = round(sum(ordered) / len(ordered) * 1e3, 4)
    return out


def summarize(result: LoadResult) -> dict[str, object]:
    """JSON-ready figures of one run (milliseconds for times)."""
    spec = result.spec
    elapsed = result.elapsed
    cpu = {
        str(pid): round(s / elapsed, 3) if elapsed > 0 and not math.isnan(s) else None
        for pid, s in result.watched_cpu_s.items()
    }
    return {
        "mode": spec.mode,
        "rate": spec.rate if spec.mode == "open" else None,
        "connections": spec.connections if spec.mode == "closed" else result.connections_opened,
        "stream": spec.stream,
        "duration_s": round(elapsed, 3),
        "requests": result.requests,
        "ok": result.ok,
        "errors": result.errors(),
        "error_ratio": round(result.error_ratio(), 5),
        "throughput": round(result.throughput(), 1),
        "latency_ms": quantiles_ms(result.latency()),
        "ttfb_ms": quantiles_ms(result.ttfb()),
        "service_ms": quantiles_ms(result.service()),
        "lateness_ms": quantiles_ms(result.lateness()),
        "generator_cpu": round(result.gen_cpu_s / elapsed, 3) if elapsed > 0 else None,
        "watched_cpu": cpu,
    }


def _ms(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "-"


def _print(summary: dict[str, object]) -> None:
    lat = summary["latency_ms"]
    assert isinstance(lat, dict)
    print(
        f"{summary['mode']} rate={summary['rate']} requests={summary['requests']} "
        f"ok={summary['ok']} errors={summary['errors']} throughput={summary['throughput']}/s"
    )
    print("  latency ms: " + "  ".join(f"{k} {_ms(v)}" for k, v in lat.items()))
    for key in ("ttfb_ms", "lateness_ms"):
        q = summary[key]
        assert isinstance(q, dict)
        print(f"  {key}: p50 {_ms(q['p50'])}  p99 {_ms(q['p99'])}")
    print(f"  generator CPU {summary['generator_cpu']}, watched {summary['watched_cpu']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("url")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--rate", type=float, default=100.0, help="open loop, requests/s")
    group.add_argument("--closed", type=int, default=0, metavar="CONNECTIONS", help="closed loop")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--body", default="", help="POST body; {i} is replaced by the request index")
    p.add_argument("--stream", action="store_true", help="expect SSE ending in data: [DONE]")
    p.add_argument("-H", "--header", action="append", default=[], metavar="NAME:VALUE")
    p.add_argument("--cpu", type=int, default=None, help="pin the generator to this CPU")
    a = p.parse_args(argv)
    headers = tuple((k.strip(), v.strip()) for k, _, v in (h.partition(":") for h in a.header))
    spec = LoadSpec(
        url=a.url,
        body=a.body.encode(),
        headers=headers,
        mode="closed" if a.closed else "open",
        rate=a.rate,
        connections=a.closed,
        duration=a.duration,
        warmup=a.warmup,
        timeout=a.timeout,
        stream=a.stream,
        cpu=a.cpu,
    )
    _print(summarize(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
