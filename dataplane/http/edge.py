"""The proxy's HTTP edge: read deadlines, connection caps, and parser refusals.

aiohttp's parser is kept; its protocol (`web_protocol.RequestHandler`) is
subclassed at these points:

- `start`: aiohttp's request loop, with each request's handler awaited in the
  connection's task rather than in a task of its own (`EdgeProtocol.start`),
  and around it aiohttp's `_handle_request` as `EdgeProtocol._handle`.
- `data_received`: a request's head must arrive within `header_timeout` of its
  first byte (of the connection's opening, for the first request) and its body
  within `body_timeout` of the head. A late head closes the connection (there
  is no request to answer); a late body fails the handler's read, which
  answers 408 (dataplane.http.pipeline.read_body), or closes the connection
  when no handler is reading. A connection with no request under way is
  closed after `keepalive_timeout` (aiohttp's keep-alive timer).
- `_drain_helper`: a write that waits for the client to take what was sent
  (the transport's buffer full) is cut once the client has taken no byte for
  `send_timeout` (looked at every quarter of it; a slow reader that keeps
  reading is kept, as under nginx's send_timeout): the connection is aborted
  and the request's handler cancelled, as when a client leaves
  (`send_stalled` says why). Nothing is armed for a write that does not wait.
  `release_drain` ends such a wait early, its bytes kept (a flight's leader
  once a follower joins: dataplane.http.reply.LeaderStream).
- `connection_made`: connections are capped, in total and per client address.
  At a cap, the connection that has waited longest for a request (idle or
  with an unfinished head) is closed to make room; only when every
  connection is busy with a request is the new one refused. Refused with a
  canned 503 JSON answer and `Connection: close`, written before any byte is
  read: one write, no parsing, and a client that reads it knows why (a bare
  close looks like a network fault and is retried at once).
- `finish_response`: a whole answer (a `web.Response` with its body in
  bytes, the proxy's usual answer; or a `WholeAnswer`, whose header lines
  its maker wrote) is written as one head-and-body write, with the head
  aiohttp's `prepare` would give it; anything else (streams,
  compression, cookies, HEAD, 1xx/204/304, access logging) goes through
  aiohttp's own `prepare` and `write_eof`.
- `handle_error`: a message the parser refuses (a line or head too long, too
  many headers, bad framing, control characters) is answered as an OpenAI
  error (400 or 431) with an `x-request-id`, and logged once through the
  refusal log, without a traceback.

Every refusal here goes to `dataplane.http.refusals.refusals`. A deadline or
eviction that closes a connection without an answer is logged there too, with
the status it would have had (408, 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any, Final, cast

from aiohttp import HttpVersion10, HttpVersion11, hdrs, web, web_protocol
from aiohttp.abc import AbstractStreamWriter
from aiohttp.compression_utils import MAX_SYNC_CHUNK_SIZE
from aiohttp.helpers import ceil_timeout, must_be_empty_body, rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    HttpProcessingError,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.http_parser import HttpRequestParser, RawRequestMessage
from aiohttp.http_writer import StreamWriter, _serialize_headers
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_exceptions import HTTPException
from aiohttp.web_response import REASON_PHRASES
from multidict import CIMultiDict

from dataplane import jsonio
from dataplane.http.body import BodyTimeout, OverFramed
from dataplane.http.dispatch import FixedRoutes
from dataplane.http.errors import ApiError
from dataplane.http.refusals import refusals
from dataplane.http.requestid import RequestIds
from dataplane.http.state import SERVER_NAME, UNPARSED
from dataplane.timer import LazyTimer
from ponto.peers import client_of

__all__ = [
    "LISTEN_BACKLOG",
    "ConnectionCaps",
    "EdgeLimits",
    "EdgeRunner",
    "WholeAnswer",
    "default_max_connections",
    "descriptors_short",
    "raise_nofile_limit",
]

# Origins refuse header lines over 8 KB, so a longer one could never be
# forwarded; a JWT bearer token fits easily. aiohttp checks the request line
# against MAX_LINE and each header against MAX_FIELD.
MAX_LINE: Final = 8190
MAX_FIELD: Final = 8190
# An OpenAI SDK sends about 15 headers.
MAX_HEADERS: Final = 64
# A whole head: room for a JWT and the usual headers. Without it a slow client
# could hold MAX_HEADERS * MAX_FIELD (512 KB) per connection.
MAX_HEAD: Final = 32 * 1024

# Connections the kernel queues before the proxy accepts them (capped by
# net.core.somaxconn). A burst of reconnects (slow clients closed together at
# their head deadline) must not overflow it: a dropped SYN costs a normal
# client a 1 s retransmission.
LISTEN_BACKLOG: Final = 4096

# What a chunked body's framing (sizes, extensions, line ends) may take as
# sent beyond the body's own bytes (see EdgeProtocol._over_framed).
FRAMING_SLACK: Final = 64 << 10

# SO_LINGER on, for 0 s: close() resets the connection and drops its unsent
# bytes (struct linger: two C ints).
_RESET: Final = struct.pack("ii", 1, 0)

log = logging.getLogger(__name__)

# Descriptors kept for the rest of the process (origin pools beyond the
# clients' half, the control-plane link, the GeoIP database, logs).
RESERVED_FDS: Final = 256


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """Deadlines and connection caps of the proxy's HTTP listener (seconds, counts)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 15.0
    # How long a client may take no byte while a write waits (nginx's send_timeout).
    send_timeout: float = 30.0
    # 0: sized from the descriptor limit at start (default_max_connections).
    max_connections: int = 0
    # 0: a quarter of max_connections.
    max_connections_per_client: int = 0


def raise_nofile_limit() -> int:
    """Raise the soft descriptor limit to the hard one; return the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a sandbox may refuse; keep the old limit
            pass
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections(nofile: int) -> int:
    """The client connection cap for a descriptor limit: half of what is left
    after RESERVED_FDS, since each client request may hold an origin connection."""
    return max(64, (nofile - RESERVED_FDS) // 2)


def descriptors_short(max_connections: int, nofile: int) -> str:
    """Why a descriptor limit of `nofile` cannot hold `max_connections` busy
    client connections (each with its origin connection, plus RESERVED_FDS),
    for a warning at start; "" when it can.

    Past the limit, accept() fails with EMFILE and libuv (uvloop) closes the
    waiting connections unanswered, logging nothing: clients see resets, not
    the 503 of the connection cap (trial 74)."""
    need = 2 * max_connections + RESERVED_FDS
    if need <= nofile:
        return ""
    return (
        f"--max-connections {max_connections} needs about {need} file descriptors "
        f"(each client stream also holds an origin connection, plus {RESERVED_FDS} for "
        f"the rest of the process) but the limit is {nofile}: past it new connections "
        f"are reset without an answer; lower --max-connections to "
        f"{default_max_connections(nofile)} (or leave it out to size it from the limit) "
        "or raise the hard limit (ulimit -Hn, systemd's LimitNOFILE, the container "
        "runtime's nofile)"
    )


class ConnectionCaps:
    """Open client connections, counted in total and per client (client_of), and the ones
    waiting for a request, oldest first (the ones to evict at a cap).

    One per listener; used from the event loop's thread only.
    """

    __slots__ = ("_count", "_per_address", "_waiting", "_waiting_at", "per_client", "total")

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self._count = 0
        self._per_address: dict[str, int] = {}
        self._waiting: dict[EdgeProtocol, None] = {}  # insertion order: oldest first
        self._waiting_at: dict[str, dict[EdgeProtocol, None]] = {}

    @property
    def open(self) -> int:
        return self._count

    def admit(self, conn: EdgeProtocol, address: str) -> bool:
        """Count `conn` in, evicting a waiting connection at a cap; False if it
        must be refused (at a cap, and every connection there is busy)."""
        if self._per_address.get(address, 0) >= self.per_client and not self._evict(
            self._waiting_at.get(address)
        ):
            return False
        if self._count >= self.total and not self._evict(self._waiting):
            return False
        self._count += 1
        self._per_address[address] = self._per_address.get(address, 0) + 1
        return True

    def release(self, conn: EdgeProtocol, address: str) -> None:
        self.busy(conn, address)
        self._count -= 1
        left = self._per_address[address] - 1
        if left:
            self._per_address[address] = left
        else:
            del self._per_address[address]

    def waiting(self, conn: EdgeProtocol, address: str) -> None:
        """`conn` waits for a request from now: the newest to evict."""
        if conn in self._waiting:  # rare: `busy`'s call spared the usual answer
            self.busy(conn, address)
        self._waiting[conn] = None
        self._waiting_at.setdefault(address, {})[conn] = None

    def busy(self, conn: EdgeProtocol, address: str) -> None:
        """`conn` has a request under way (or is gone): not to be evicted."""
        if conn in self._waiting:
            del self._waiting[conn]
            mine = self._waiting_at[address]
            del mine[conn]
            if not mine:
                del self._waiting_at[address]

    def _evict(self, waiting: dict[EdgeProtocol, None] | None) -> bool:
        if not waiting:
            return False
        victim = next(iter(waiting))
        victim.evict()  # releases it, so its count is free now
        return True


class WholeAnswer(web.Response):
    """A whole answer (status, bytes body) whose header lines its maker wrote
    as bytes: `lines`, each "Name: value\r\n" in printable ASCII, are the
    serialisation of the headers it stands for, `origin` then each of `ours`
    set in turn (a name set again keeps its place) and a Server line, as a
    web.Response with them would write them. `typed`: a Content-Type is
    among them. On the edge (`EdgeProtocol._put_whole`) the lines are
    written as they are, with the lines aiohttp's prepare adds: the answer
    costs no CIMultiDict writes, no serialisation and no web.Response
    __init__ (which copies its headers): some 8,000 to 12,000 instructions
    a proxied answer (bench/instructions.py).

    Anything that reads its headers (`headers`, or aiohttp's own methods
    through `_headers`) gets them made then, whole, and the lines are not
    used from then on (`lines` None): the answer is a web.Response like
    any other (aiohttp's own server, in tests, prepares it so)."""

    def __init__(
        self,
        status: int,
        body: bytes,
        lines: bytes,
        typed: bool,
        origin: CIMultiDict[str],
        ours: list[tuple[str, str]],
    ) -> None:
        # StreamResponse's and Response's own __init__ state, but the headers;
        # the rest are their classes' defaults.
        self._state = {}
        self._status = status
        self._reason = REASON_PHRASES.get(status, "")
        self._body = body
        self._compressed_body = None
        self._zlib_executor_size = MAX_SYNC_CHUNK_SIZE
        self._zlib_executor = None
        self.lines: bytes | None = lines
        self.typed = typed
        self._made: CIMultiDict[str] | None = None
        self._origin = origin
        self._ours = ours

    @property  # type: ignore[override]
    def _headers(self) -> CIMultiDict[str]:
        headers = self._made
        if headers is None:
            headers = self._origin
            for name, value in self._ours:
                headers[name] = value
            headers.setdefault(hdrs.SERVER, SERVER_NAME)
            self._made = headers
            self.lines = None
        return headers

    @_headers.setter
    def _headers(self, headers: CIMultiDict[str]) -> None:
        self._made = headers
        self.lines = None


class EdgeProtocol(web_protocol.RequestHandler):
    """aiohttp's HTTP/1 protocol with deadlines, caps and JSON parser errors.

    Relies on these aiohttp internals (tests/unit/test_edge_limits.py checks
    they exist, tests/functional/test_edge.py what they do): those of the
    request loop copied into `start` and `_handle` (aiohttp 3.14.5's, the
    pinned version); `_messages`
    (parsed requests not yet handled, with their payloads) and `_ErrInfo`,
    `_request_count`, `_request_in_progress`, `_waiter`, `_manager`, `_close`,
    `_force_close`, and `data_received` feeding the parser synchronously; and,
    for the one-write answer, the response's, request's and StreamWriter's
    private state named in `_fits` and `_put_whole` (tests/unit/test_edge_limits.py
    lists them; tests/functional/test_edge_answers.py checks the bytes).
    """

    __slots__ = (
        "_address",
        "_body_bytes",
        "_caps",
        "_client",
        "_counted",
        "_deadline",
        "_head_bytes",
        "_hooks",
        "_ids",
        "_last",
        "_limits",
        "_lingers",
        "_payload",
        "_refusing",
        "_sent",
        "_unparsed",
        "send_stalled",
    )

    def __init__(self, manager: EdgeServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = manager.limits
        self._caps = manager.caps
        self._ids = manager.ids
        self._unparsed = manager.unparsed
        self._hooks = manager.prepare_hooks
        self._address = ""
        self._client = ""  # client_of(self._address): whose connection it is, for the caps
        self._head_bytes = 0  # of the head being received
        self._body_bytes = 0  # of the body being received, as sent
        self._counted = False
        # The head's or the body's deadline, whichever is running.
        self._deadline = LazyTimer(self._loop)
        # The body being received; None once it is complete (or before any).
        self._payload: StreamReader | None = None
        # A head was refused (_refuse_head): nothing more is read; the
        # requests queued before it are answered, then its error, which
        # closes the connection.
        self._refusing = False
        # A body is left unread (_refuse_framing): the connection lingers as
        # it closes (_linger).
        self._lingers = False
        # The answer its handler handed to the transport (send_whole), whose
        # drain finish_response waits for.
        self._sent: web.Response | None = None
        # The connection was cut because the client took no byte for send_timeout.
        self.send_stalled = False
        # The server stops: this connection serves the request begun on it, if
        # any, and no other (see stop_taking).
        self._last = False

    # ------------------------------------------------------------ connections

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):  # TCP; a worker's private Unix socket is not capped
            self._address = str(peer[0])
            self._client = client_of(self._address)
            if not self._caps.admit(self, self._client):
                self._refuse(transport)
                return
            self._counted = True
        super().connection_made(transport)
        self._head_begins()
        if self._counted:
            self._caps.waiting(self, self._client)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._deadline.close()
        self._uncount()
        super().connection_lost(exc)

    def resume_reading(self, resume_parser: bool = True) -> None:
        # A request body's reader asks for this on every read below its
        # low-water mark, and aiohttp then feeds the parser an empty chunk (a
        # pass through data_received) to go on with what a pause left unparsed:
        # there is none unless reading was paused. A full queue of pipelined
        # requests pauses otherwise (_buffer_paused), and start() resumes it.
        if self._reading_paused:
            super().resume_reading(resume_parser)

    async def _drain_helper(self) -> None:
        """aiohttp's wait for a paused transport to drain, cut once the client
        has taken no byte for the limits' `send_timeout` (see the module
        docstring)."""
        if self.transport is None or not self._paused:
            await super()._drain_helper()  # raises if gone, else returns at once
            return
        # nginx's send_timeout: the time since the client last took bytes, not
        # for the whole drain (a big answer read slowly but steadily is kept).
        # Looked at every quarter of it: the cut comes 1 to 1.5 timeouts after
        # the client's last take.
        transport = self.transport
        loop = self._loop
        timeout = self._limits.send_timeout
        left = transport.get_write_buffer_size()
        taken_at = loop.time()
        timer: asyncio.TimerHandle

        def check() -> None:
            nonlocal timer, left, taken_at
            now, size = loop.time(), transport.get_write_buffer_size()
            if size < left:  # the client took bytes since the last look
                left, taken_at = size, now
            if now - taken_at >= timeout:
                self._send_stalled()
            else:
                timer = loop.call_later(timeout / 4, check)

        timer = loop.call_later(timeout / 4, check)
        try:
            await super()._drain_helper()
        finally:
            timer.cancel()

    def release_drain(self) -> None:
        """End the wait of a write waiting for the client to take what was
        sent (its bytes stay in the transport's buffer); the next write that
        finds the transport paused waits as before. For a flight's leader
        whose relay must stop waiting for its client once followed
        (dataplane.http.reply.LeaderStream)."""
        # As aiohttp's resume_writing wakes it, but writing stays paused:
        # the transport resumes it once its buffer drains.
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            self._drain_waiter = None
            waiter.set_result(None)

    def _send_stalled(self) -> None:
        # Aborting runs connection_lost, which cancels the handler
        # (handler_cancellation) and wakes the write with the connection gone.
        # abort() drops only the transport's own buffer: the socket's, full
        # (the kernel grows it to tcp_wmem's maximum, 4 MB by default, for a
        # fast answer), would stay with the kernel in FIN-WAIT-1 for minutes,
        # probing a zero window; a reset (SO_LINGER of 0) frees it at once
        # and tells the client it was cut, not that its answer ended.
        self.send_stalled = True
        transport = self.transport
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            transport.abort()

    def evict(self) -> None:
        """Close this waiting connection to make room for a new one."""
        refusals.refused(
            503,
            "connection_evicted",
            "closed a connection waiting for a request: the proxy is at its connection cap",
            remote=self._address,
            what="connection",
        )
        self._uncount()
        self.force_close()

    @property
    def busy(self) -> bool:
        """Whether a request of this connection is being handled, waits its
        turn (pipelined), or is coming in (its head or body begun)."""
        return (
            self._request_in_progress
            or bool(self._messages)
            or self._payload is not None
            or self._head_bytes > 0
        )

    def stop_taking(self) -> None:
        """The server stops (in place of aiohttp's close() of every connection
        as it shuts down): a connection with a request begun finishes it,
        still reading its head and body, and closes after its answer; one
        with none is closed now.

        aiohttp's close() reads nothing more, so a body half received waited
        out the body timeout (30 s, then a 408 though the client had sent
        it), and a connection whose task had not started yet (accepted just
        before) went on waiting for a request it no longer read, until the
        header timeout closed it without an answer."""
        self._last = True
        if not self.busy:
            self.force_close()

    def hang_up(self) -> None:
        """Close this connection, which is not busy, as evict() does: a worker
        leaving its group closes those its clients keep idle."""
        self._uncount()
        self.force_close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self._caps.release(self, self._client)

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        request_id = self._ids.next()
        refusals.refused(
            503,
            "too_many_connections",
            "refused a connection: the proxy is at its connection cap",
            request_id=request_id,
            remote=self._address,
            what="connection",
        )
        self._manager = None  # so that connection_lost has nothing to undo
        self._force_close = True  # and data_received ignores what the client sends
        # A cast, not an isinstance check: uvloop's transports write but are
        # no instances of asyncio's transport classes.
        writer = cast(asyncio.WriteTransport, transport)
        writer.write(_REFUSAL_HEAD + request_id.encode() + _REFUSAL_TAIL)
        transport.close()  # after the write is flushed

    # ------------------------------------------------------------ requests

    async def start(self) -> None:
        """aiohttp 3.14's request loop (`RequestHandler.start`), with one change:
        each request's handler runs in this connection's task instead of a new
        task per request.

        aiohttp makes that task so that each request has its own context
        variables (aiohttp #3406); the proxy keeps no request state in context
        variables, and on Python 3.11 (no eager tasks) the task costs a loop
        iteration and about 3 us per request. Cancellation is unchanged: a lost
        connection cancels this task, which was awaiting the handler's.
        """
        loop = self._loop
        manager = self._manager
        assert manager is not None
        keepalive_timeout = self._keepalive_timeout
        resp = None
        assert self._request_factory is not None
        assert self._request_handler is not None
        # This task serves every request of the connection (aiohttp's looks its
        # task up per request, a getpid system call each on Python 3.11).
        task = asyncio.current_task(loop)

        try:
            while not self._force_close:
                if not self._messages:
                    try:
                        # wait for next request
                        self._waiter = loop.create_future()
                        await self._waiter
                    finally:
                        self._waiter = None

                message, payload = self._messages.popleft()

                # Free a parser slot; resume reading once drained to low water so
                # pipelining keeps flowing while this request is handled.
                if self._parser is not None:  # pragma: no branch
                    self._parser.message_consumed()
                if self._buffer_paused and len(self._messages) <= self._msg_queue_resume_size:
                    self._resume_reading_if_drained()

                start = loop.time() if self._logging_enabled else None

                manager.requests_count += 1
                writer = StreamWriter(self, loop)
                if isinstance(message, web_protocol._ErrInfo):
                    request_handler = self._make_error_handler(message)
                    message = web_protocol.ERROR
                else:
                    request_handler = self._request_handler

                request = self._request_factory(
                    message,
                    payload,
                    self,
                    writer,
                    self._task_handler or task,  # type: ignore[arg-type]
                )
                try:
                    try:
                        resp, reset = await self._handle(request, start, request_handler)
                    except ConnectionError:
                        self.log_debug("Ignored premature client disconnection")
                        break

                    if reset:
                        self.log_debug("Ignored premature client disconnection 2")
                        break

                    # notify server about keep-alive (the field behind the
                    # property, a Python call on 3.11)
                    self._keepalive = bool(resp._keep_alive)

                    # check payload
                    if not payload.is_eof():
                        lingering_time = self._lingering_time
                        if not self._force_close and lingering_time:
                            self.log_debug(
                                "Start lingering close timer for %s sec.", lingering_time
                            )

                            now = loop.time()
                            end_t = now + lingering_time
                            # This task serves every request of the connection: only
                            # a cancellation arriving now stops it (aiohttp asks for
                            # any, which a per-request task could only have now).
                            cancels = task.cancelling() if task is not None else 0

                            try:
                                while not payload.is_eof() and now < end_t:
                                    async with ceil_timeout(end_t - now):
                                        # read and ignore
                                        await payload.readany()
                                    now = loop.time()
                            except (asyncio.CancelledError, TimeoutError):
                                if task is not None and task.cancelling() > cancels:
                                    raise

                        # if payload still uncompleted
                        if not payload.is_eof() and not self._force_close:
                            self.log_debug("Uncompleted request.")
                            self.close()

                    payload.set_exception(web_protocol._PAYLOAD_ACCESS_ERROR)

                except asyncio.CancelledError as exc:
                    self.log_debug("Ignored premature client disconnection")
                    self.force_close()
                    raise bare(exc) from None
                except Exception as exc:
                    self.log_exception("Unhandled exception", exc_info=exc)
                    self.force_close()
                except BaseException:
                    self.force_close()
                    raise
                finally:
                    request._task = None  # type: ignore[assignment]  # a reference cycle otherwise
                    if self.transport is None and resp is not None:
                        self.log_debug("Ignored premature client disconnection.")
                # Nothing of an answered request is kept while the connection
                # waits for its next one: a pooled client's idle connection held
                # its last body (megabytes for a document or an image) for up to
                # the keep-alive timeout.
                del request, message, payload
                resp = None

                if self._keepalive and not (self._close or self._force_close or self._last):
                    # start keep-alive timer
                    close_time = loop.time() + keepalive_timeout
                    self._next_keepalive_close_time = close_time
                    if self._keepalive_handle is None:
                        self._keepalive_handle = loop.call_at(close_time, self._process_keepalive)
                else:
                    break
        finally:
            # Not held by its own frame: a cancellation (the client left, under
            # handler_cancellation) ends this task with the frame in the
            # exception's traceback, which the task keeps, a cycle that only
            # the garbage collector frees, and with it the last request and
            # its body (trial 89: 10 MB more RSS for every 5 MB request whose
            # client then closed its connection, until a full collection).
            # Nor does the frame hold the request it was cancelled in: the
            # handler's objects that hold the task (a stream's IdleTimeout, an
            # origin call's watch) can keep it, and so the frame, until then.
            del task
            request = message = payload = resp = None  # type: ignore[assignment]

        # remove handler, close transport if no handlers left
        if not self._force_close:
            self._task_handler = None
            if self.transport is not None:
                if self._lingers:
                    self._linger(self.transport)
                else:
                    self.transport.close()

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close a connection whose client may still be sending a body left
        unread (_refuse_framing): its answers end now (write_eof, after what
        is buffered), what the client still sends is dropped unparsed (this
        connection is closing: data_received parses nothing), and the socket
        closes once the client ends its side, or after aiohttp's lingering
        time. Closed at once with the client's bytes unread, the kernel would
        reset it, and the reset takes the answer from a client that writes its
        whole body before it reads (httpx, so the openai SDK, given a
        generator): it saw a connection error where its 413 or 401 was."""
        if transport.can_write_eof():
            transport.write_eof()
        # The deadline connection_lost cancels; none is running once closing.
        self._deadline.arm(self._lingering_time, transport.close)

    async def _handle(
        self,
        request: web.BaseRequest,
        start_time: float | None,
        request_handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        """In place of aiohttp 3.14's `_handle_request`: its steps, with one
        `finish_response` call after the handler's answer or error rather than
        one in each branch, and without its warning for a returned HTTPException
        (deprecated; no handler of the proxy does it)."""
        self._request_in_progress = True
        try:
            try:
                try:
                    self._current_request = request
                    resp = await request_handler(request)
                finally:
                    self._current_request = None
            except HTTPException as exc:
                resp = exc
            except asyncio.CancelledError:
                raise
            except TimeoutError as exc:
                self.log_debug("Request handler timed out.", exc_info=exc)
                resp = self.handle_error(request, 504)
            except Exception as exc:
                resp = self.handle_error(request, 500, exc)
            # finish_response's usual case in plain calls: a whole answer out,
            # on a transport not paused, whose drain (StreamWriter.drain) would
            # return at once: three coroutines that never wait fewer (some 700
            # instructions each against a plain call, callgrind on a loop).
            out = self._whole_out(request, resp)
            if out is None or (out and self._paused and self.transport is not None):
                return await self._finished(request, resp, start_time, out)
            self._answered()
            return resp, not out
        finally:
            self._request_in_progress = False
            if self._handler_waiter is not None:
                self._handler_waiter.set_result(None)

    # ------------------------------------------------------------ deadlines

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            return
        if self._force_close or self._close or self._upgraded:
            super().data_received(data)
            return
        if data and self._deadline.due is None and self._payload is None:
            self._head_begins()  # the first byte of the next request
        heading = self._payload is None
        if heading:
            self._head_bytes += len(data)
        else:
            # A read may end the body and begin the next head: counted whole,
            # the bound is one read less strict.
            self._body_bytes += len(data)
        count = self._request_count
        super().data_received(data)
        if self._request_count == count and heading and data and self._head_bytes > MAX_HEAD:
            self._refuse_head()
            return
        if self._request_count != count:
            # The head is done: what comes next is its body, or the next head
            # (aiohttp also calls with no data, to parse requests it buffered).
            head_bytes, self._head_bytes = self._head_bytes, 0
            message, payload = self._messages[-1]
            new = self._request_count - count
            if new > 1:  # pipelined heads in one read: each is checked
                if self._refused_one(new):
                    return
            elif not isinstance(message, web_protocol._ErrInfo):
                if refusal := _refusal(message):
                    self._messages.pop()
                    self._refuse_head(refusal)
                    return
            elif (
                heading
                and head_bytes == len(data)
                and (unframed := _unframed_request(data)) is not None
            ):
                # The parser refused the bytes after a head that declared no
                # body, and dropped that head's request with them: the
                # request is answered instead (an API route's answer is its
                # empty body's 400), and its connection closed, which answers
                # nothing for the bytes (as when they come in a later read,
                # after that answer: pipeline.empty_body). Only a head that
                # began this read: bytes of one begun in an earlier read are
                # still in the parser, and a read that begins 'POST ' in a
                # header's value would be answered as a request never sent.
                # The edge's own bounds refuse it as any head they refuse
                # (trial 28: an HTTP/2.0 head served, its version repeated).
                if refusal := _refusal(unframed):
                    self._messages.pop()
                    self._refuse_head(refusal)
                    return
                self._messages[-1] = (unframed, payload)
            if (
                isinstance(message, web_protocol._ErrInfo)
                and self._payload is not None
                and not self._payload.is_eof()
            ):
                self._refuse_body(message)
                return
            self._deadline.disarm()
            if self._counted:
                self._caps.busy(self, self._client)
            self._payload = None if payload.is_eof() else payload
            if self._payload is not None:
                self._body_bytes = 0
                self._deadline.arm(self._limits.body_timeout, self._body_late)
        elif (receiving := self._payload) is not None:
            if receiving.is_eof():
                self._payload = None
                self._deadline.disarm()
            elif not heading and self._over_framed(receiving):
                self._refuse_framing()

    def _over_framed(self, payload: StreamReader) -> bool:
        """True when the body's bytes as sent (since the read that ended its
        head) pass twice what it holds and FRAMING_SLACK: its framing is
        larger than the body. Each chunk costs a pass through Python (the
        parser's callback, the reader's): 15.6 MB of 1-byte chunks held a
        worker for 1.7 s of CPU, read and dropped after a 401 (trial 91), and
        chunk extensions, which aiohttp's parser skips unbounded, count in
        no body. Chunks of 5 bytes and more pass, as any body of up to
        10 KB however chunked; a read's bytes are parsed before the check."""
        return self._body_bytes > 2 * payload.total_bytes + FRAMING_SLACK

    def _refused_one(self, new: int) -> bool:
        """Refuse the first of the `new` heads just parsed that the edge does
        not take: one past MAX_HEAD (it came whole, in one read), of another
        HTTP version, or with a transfer coding besides chunked. It and the
        requests pipelined after it leave the queue for its error (review
        46: only the last head of a read was looked at). True if one was."""
        messages = self._messages
        for index in range(len(messages) - new, len(messages)):
            message = messages[index][0]
            if isinstance(message, web_protocol._ErrInfo):
                return False  # the parser's own refusal, its last message
            refusal = _refusal(message)
            if refusal is not None:
                while len(messages) > index:
                    messages.pop()
                self._refuse_head(refusal)
                return True
        return False

    def _head_begins(self) -> None:
        self._head_bytes = 0
        self._deadline.arm(self._limits.header_timeout, self._head_late)

    def _refuse_head(self, exc: BadHttpMessage | None = None) -> None:
        """Answer a head past MAX_HEAD (or one `exc` refuses) as aiohttp answers
        one its parser refuses (an error message in the queue), and read no
        more of the connection."""
        self._deadline.disarm()
        exc = exc or HeadTooLarge(_TOO_LARGE)
        self._messages.append(
            (web_protocol._ErrInfo(status=exc.code, exc=exc, message=exc.message), EMPTY_PAYLOAD)
        )
        self._request_count += 1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        # Not close(): that cancels the waiter, and with it the answer; nor
        # _close, with which the request loop would stop before the answer
        # when requests were queued before it (review 46). Its answer closes
        # the connection (handle_error).
        self._refusing = True

    def _refuse_body(self, error: web_protocol._ErrInfo) -> None:
        """The parser refused the rest of a body it had begun to pass on (bad
        chunking): the handler reading that body gets the error, and its
        answer is the only one; the connection closes after it."""
        payload, self._payload = self._payload, None
        assert payload is not None
        self._messages.pop()
        self._deadline.disarm()
        self._fail_body(payload, web.RequestPayloadError(error.message))

    def _refuse_framing(self) -> None:
        """A body framed past `_over_framed`'s bound: its handler, running or
        still to run, answers 413 (dataplane.http.pipeline.read_body) and the
        connection closes after it; a request already answered (a 401, a 415),
        whose rest aiohttp reads and drops, has its connection closed,
        unlogged: its answer was. Either way the rest is not parsed, and the
        connection lingers as it closes (_linger): closed at once, its
        client, still sending, would see a reset where its answer was, and an
        SDK would retry. (A body past --max-body-bytes whose framing is in
        bounds is read and dropped after its 413, parsed, for aiohttp's
        lingering time.)"""
        payload, self._payload = self._payload, None
        assert payload is not None
        self._deadline.disarm()
        self._lingers = True
        if self._request_in_progress or any(queued is payload for _, queued in self._messages):
            self._fail_body(payload, OverFramed())
            return
        # Ended, so that the lingering read stops without an error (which
        # aiohttp would log as a bug, with a traceback).
        payload.feed_eof()
        self.close()

    def _fail_body(self, payload: StreamReader, exc: Exception) -> None:
        # Ended as well as failed: aiohttp's lingering read after the answer
        # would take the error for a bug (an ERROR with a traceback). Closed
        # after the answer, since the rest of the body is still to come.
        payload.set_exception(exc)
        payload.feed_eof()
        self.close()

    async def shutdown(self, timeout: float | None = 15.0) -> None:  # noqa: ASYNC109 - aiohttp's signature
        """aiohttp 3.14's `RequestHandler.shutdown`, with two changes.

        The request begun on the connection is finished as any other, its
        head and body still read (stop_taking), where aiohttp stops reading
        at once and waits only for a handler already running.

        A request still running after `timeout` is cancelled then (its
        handler runs in this connection's task, see `start`), so that its
        boundary records it as cancelled and the stop takes `timeout`.
        aiohttp only fails the request's body and waits `timeout` again for
        this task, which a handler that reads no more of its body (a relayed
        stream) outlives: a stop took twice the timeout, past the worker
        supervisor's grace (dataplane.supervisor.SHUTDOWN_GRACE_S), whose kill
        lost the request's access-log line.
        """
        self.stop_taking()
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
        task = self._task_handler
        if task is not None and not task.done():
            await self._wait_for(task, timeout)
            if not task.done():  # past the timeout: stop it now
                if self._current_request is not None:
                    self._current_request._cancel(asyncio.CancelledError())
                task.cancel()
                await self._wait_for(task, timeout)
        self.force_close()

    @staticmethod
    async def _wait_for(task: asyncio.Task[None], timeout: float | None) -> None:  # noqa: ASYNC109
        try:
            async with ceil_timeout(timeout):
                await asyncio.shield(task)
        except (asyncio.CancelledError, TimeoutError):
            if (current := asyncio.current_task()) and current.cancelling():
                raise

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        return await self._finished(request, resp, start_time, self._whole_out(request, resp))

    async def _finished(
        self,
        request: web.BaseRequest,
        resp: web.StreamResponse,
        start_time: float | None,
        out: bool | None,
    ) -> tuple[web.StreamResponse, bool]:
        """`resp` written and drained, once `_whole_out` said `out` of it: by
        aiohttp's finish_response (None), else the drain of a whole answer
        that went out (True). Returns `resp` and whether the client is gone."""
        if out is None:
            answered = await super().finish_response(request, resp, start_time)
        else:
            answered = resp, not (out and await _drained(request._payload_writer))
        self._answered()
        return answered

    def _whole_out(self, request: web.BaseRequest, resp: web.StreamResponse) -> bool | None:
        """`resp` out as a whole answer: handed to the transport by its handler
        (`send_whole`) or now (`_put_whole`, when it `_fits`); whether the
        client was there to take it. None when it is no answer these write
        (aiohttp's `finish_response` writes it); the drain is the caller's."""
        sent, self._sent = self._sent, None
        if self._last and not resp.prepared:
            resp.force_close()  # the server stops: this answer is the last
        # A handler that returns None (a bug) sent nothing: aiohttp answers it 500.
        if resp is sent and sent is not None:
            return True
        if self._fits(request, resp):
            return self._put_whole(request, cast(web.Response, resp))
        return None

    def _answered(self) -> None:
        """A request answered: a connection with no other queued waits for its next."""
        if self._counted and not self._messages:
            self._caps.waiting(self, self._client)

    def send_whole(self, request: web.BaseRequest, resp: web.Response) -> bool:
        """Hand `resp` to the transport now, from inside its handler (see
        dataplane.http.boundary.send_whole), without waiting for the client
        to take it: the handler's work after it is neither held by a client
        that reads slowly nor cut short by one that leaves. `finish_response`
        waits for the drain once the handler returns. False when `resp` is
        not one `_fits` covers (`finish_response` writes it then, as usual)
        or the client is gone."""
        if self._last:
            resp.force_close()  # the server stops: this answer is the last
        if not (self._fits(request, resp) and self._put_whole(request, resp)):
            return False
        self._sent = resp
        return True

    def _fits(self, request: web.BaseRequest, resp: web.StreamResponse) -> bool:
        """Whether `_put_whole` writes `resp` as aiohttp would: a whole
        web.Response (or WholeAnswer) on a connection with no aiohttp access
        logger and no upgrade. Answers it does not cover go to aiohttp's
        `finish_response`."""
        kind = type(resp)
        if (
            (kind is not web.Response and kind is not WholeAnswer)
            or self.access_logger is not None
            or self._upgraded
        ):
            return False
        writer = request._payload_writer
        # The fields behind aiohttp's version and method (each a Python call
        # on its first read), as _put_whole reads keep_alive's.
        version = request._version
        body = resp._body
        return not (
            resp._payload_writer is not None
            or resp._eof_sent
            or not (body is None or type(body) is bytes)
            or resp._compression
            or resp._chunked
            or resp._cookies
            or version not in (HttpVersion11, HttpVersion10)
            or must_be_empty_body(request._method, resp._status)
            or not isinstance(writer, StreamWriter)
            or writer._on_headers_sent is not None
            or writer._on_chunk_sent is not None
            or writer.on_body_write is not None
            or writer.output_size
            # A handler's own framing, which aiohttp checks and uses as it is
            # (a WholeAnswer's lines have none: its headers are not made).
            or (_lines_of(resp) is None and _framed(resp._headers))
            # app.on_response_prepare hooks see (and may change) the prepared
            # head, which aiohttp's order of steps gives them.
            or (self._hooks and _prepare_hooks(request))
        )

    def _put_whole(self, request: web.BaseRequest, resp: web.Response) -> bool:
        """`resp`, which `_fits`, handed to the transport in one write: the
        head `prepare` would write (the same Content-Length, Content-Type,
        Date, Server and Connection rules), then its body. aiohttp's `prepare`
        and `write_eof` build the same bytes through some ten calls; this is
        the path of nearly every answer. A WholeAnswer's head is its lines
        as they are, with the same lines added. False if the client is gone;
        the caller waits for the drain."""
        body = resp._body
        writer = request._payload_writer
        assert isinstance(writer, StreamWriter) and (body is None or type(body) is bytes)
        version = request._version
        request._finish()
        size = len(body) if body else 0
        # _lines_of's test in place, where it narrows `resp` for its `typed`.
        if type(resp) is WholeAnswer and (lines := resp.lines) is not None:
            # Its maker's lines: the origin's headers (never a Date nor a
            # Connection: forwarder.DROP_RESPONSE_HEADERS), ours and Server.
            typed = resp.typed
            dated = connection = False
            served = True
        else:
            lines = None
            headers = resp._headers
            typed = hdrs.CONTENT_TYPE in headers
            dated = hdrs.DATE in headers
            served = hdrs.SERVER in headers
            connection = hdrs.CONNECTION in headers
        # The headers prepare() would add (none of them is in `headers`, which
        # _fits saw without a Content-Length) come after the handler's, in
        # prepare's order: written as lines after aiohttp's serialisation of
        # the handler's, not set in `headers` first, they cost no multidict
        # writes and no serialisation (some 3,000 instructions an answer).
        added = [b"Content-Length: ", str(size).encode(), b"\r\n"]
        if size and not typed:
            added.append(b"Content-Type: application/octet-stream\r\n")
        if not dated:
            added += (b"Date: ", rfc822_formatted_time().encode(), b"\r\n")
        if not served:
            added.append(_SERVER_LINE)
        keep_alive = resp._keep_alive
        if keep_alive is None:
            keep_alive = resp._keep_alive = not request._message.should_close
        if not connection:
            if keep_alive:
                if version == HttpVersion10:
                    added.append(b"Connection: keep-alive\r\n")
            elif version == HttpVersion11:
                added.append(b"Connection: close\r\n")
        added.append(b"\r\n")
        # The fields behind aiohttp's status and reason properties (each a
        # Python call on 3.11, some 640 instructions), as _fits reads its others.
        status_line = f"HTTP/{version.major}.{version.minor} {resp._status} {resp._reason}"
        if lines is None:
            head = _serialize_headers(status_line, headers)[:-2] + b"".join(added)
        else:
            # The status line's reason is aiohttp's own (WholeAnswer).
            head = b"".join((status_line.encode(), b"\r\n", lines, *added))
        try:
            # StreamWriter's own accounting (output and buffered sizes), and
            # its refusal to write to a closing transport (a ConnectionError).
            writer._writelines((head, body) if body else (head,))
        except ConnectionError:
            return False
        writer._eof = True
        resp._eof_sent = True
        resp._body_length = writer.output_size
        return True

    def _head_late(self) -> None:
        refusals.refused(
            408,
            "header_timeout",
            "closed a connection: no complete request head within "
            f"{self._limits.header_timeout:g} s",
            remote=self._address,
            what="connection",
        )
        self.force_close()

    def _body_late(self) -> None:
        payload, self._payload = self._payload, None
        if payload is None or payload.is_eof():  # pragma: no cover - disarmed at the end
            return
        if self._request_in_progress:
            # The handler answers 408 (or, already answering, ignores it).
            self._fail_body(payload, BodyTimeout(self._limits.body_timeout))
            return
        refusals.refused(
            408,
            "body_timeout",
            f"closed a connection: request body not received within "
            f"{self._limits.body_timeout:g} s",
            remote=self._address,
            what="connection",
        )
        self.force_close()

    # ------------------------------------------------------------ parser errors

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The answer to a message aiohttp could not parse (or, for a bug in
        the handler chain, a generic 500), as an OpenAI error."""
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already started")
        request_id = self._ids.next()
        if isinstance(exc, HttpProcessingError):
            # aiohttp hands an unparsed message's answer a stand-in request of
            # HTTP/1.0, whose version the status line would repeat (`version`
            # is cached on first read).
            request._version = HttpVersion11
            request._cache.pop("version", None)
            error = parser_error(exc)
            refusals.refused(
                error.status,
                error.code,
                f"{error.message} ({type(exc).__name__})",
                request_id=request_id,
                remote=request.remote,
                what="HTTP request",
            )
            if self._unparsed is not None:
                self._unparsed(request, request_id, error.status, error.code or "")
        elif status == 504 and exc is None:
            # A handler's TimeoutError, which _handle answers 504: an app
            # without the proxy's error boundary (the control plane's pages).
            self.logger.error("Request from %s timed out in its handler", request.remote)
            error = ApiError(
                504, "the request timed out in the proxy", type="server_error", code="timeout"
            )
        else:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            error = ApiError(
                status,
                "internal error in the proxy",
                type="server_error",
                code="internal_error",
            )
        response = error.response(
            {"x-request-id": request_id, "connection": "close", hdrs.SERVER: SERVER_NAME}
        )
        response.force_close()
        return response


async def _drained(writer: AbstractStreamWriter) -> bool:
    """Wait until the transport takes what was written (pausing while the
    client reads slowly); False if the client is gone."""
    try:
        await writer.drain()
    except ConnectionError:
        return False
    return True


def bare(exc: BaseException) -> BaseException:
    """`exc` without its traceback and the exceptions it came from, to end a
    task with (a connection's, a flight's): the task keeps the exception it
    ended with, and a traceback holds every frame it went through, each with
    its locals (the request, its body). A frame holding the task as well (a
    timeout, a watch on an origin call, a flight's leader) makes a cycle only
    a full garbage collection frees, and a client leaving mid-answer would
    keep its request's body until then (two 5 MB bodies a stream stopped by
    its client)."""
    exc.__cause__ = exc.__context__ = None
    return exc.with_traceback(None)


def _lines_of(resp: web.StreamResponse) -> bytes | None:
    """A WholeAnswer's lines, while its headers are not made; else None."""
    return resp.lines if type(resp) is WholeAnswer else None


def _framed(headers: CIMultiDict[str]) -> bool:
    """Whether a handler set its answer's own framing (Transfer-Encoding or
    Content-Length), which aiohttp checks and uses as it is."""
    return hdrs.TRANSFER_ENCODING in headers or hdrs.CONTENT_LENGTH in headers


def _prepare_hooks(request: web.BaseRequest) -> bool:
    """Whether an app that routed `request` has on_response_prepare hooks."""
    if not isinstance(request, web.Request):  # a bare server's: no app, no hooks
        return False
    match_info = request._match_info
    return match_info is not None and any(app.on_response_prepare for app in match_info.apps)


def _has_prepare_hooks(app: web.Application) -> bool:
    """Whether `app` or any application under it has on_response_prepare
    hooks. Final once `app` is frozen (its hooks and sub-applications are)."""
    if app.on_response_prepare:
        return True
    return any(
        _has_prepare_hooks(resource._app)
        for resource in app.router.resources()
        if isinstance(resource, web.PrefixedSubAppResource)  # MatchedSubAppResource too
    )


def _head_size(message: RawRequestMessage) -> int:
    # Every request's: counted in C, with no Python step per header.
    raw = message.raw_headers
    return len(message.path) + sum(map(len, chain.from_iterable(raw))) + 4 * len(raw)


class HeadTooLarge(BadHttpMessage):
    """A request head past MAX_HEAD bytes (aiohttp bounds only its lines)."""

    code = 431


class VersionNotSupported(BadHttpMessage):
    """A request of an HTTP version other than 1.0 and 1.1 (trial 28: llhttp
    takes `HTTP/2.0` and `HTTP/0.9` request lines, and the answer's status
    line repeated them). A 400, not RFC 9110's 505: the client's fault is
    no server error, which error-rate alerts would count (so bench/fuzz.py
    holds)."""


class CodingNotSupported(BadHttpMessage):
    """A body whose Transfer-Encoding names a coding besides `chunked` (trial
    28: `gzip, chunked` was read as chunked alone, its gzip ignored). A 400,
    not RFC 9112's 501, as for the version."""


class ChunkedInHttp10(BadHttpMessage):
    """An HTTP/1.0 request with Transfer-Encoding, which HTTP/1.0 does not
    have: RFC 9112 section 6.1 calls it faulty framing, to be answered and
    the connection closed (a proxy before this one may have framed the body
    otherwise: request smuggling). A 400, as the coding's."""


# llhttp's error at a `PRI * HTTP/2.0` request line (only that method: an
# Upgrade request is parsed as such).
_H2_PREFACE: Final = "Pause on PRI/Upgrade"
_TOO_LARGE = f"request head over {MAX_HEAD} bytes"
# The Server line of an answer without one (_put_whole), as prepare() writes it.
_SERVER_LINE: Final = f"{hdrs.SERVER}: {SERVER_SOFTWARE}\r\n".encode()


def _refusal(message: RawRequestMessage) -> BadHttpMessage | None:
    """What refuses a head the parser took: its size past MAX_HEAD (it came
    whole, in one read), its version, or a transfer coding besides
    `chunked`; None for the usual request, after two comparisons and the
    size."""
    if _head_size(message) > MAX_HEAD:
        return HeadTooLarge(_TOO_LARGE)
    if message.version is HttpVersion11 and not message.chunked:
        return None
    if message.version not in (HttpVersion11, HttpVersion10):
        return VersionNotSupported("HTTP version not supported")
    if message.chunked and message.version == HttpVersion10:
        return ChunkedInHttp10("Transfer-Encoding in HTTP/1.0")
    # One header at most: the parser refuses a second.
    if message.chunked and message.headers[hdrs.TRANSFER_ENCODING].strip().lower() != "chunked":
        return CodingNotSupported("transfer coding not supported")
    return None


def _unframed_request(data: bytes) -> RawRequestMessage | None:
    """The request of the POST head `data` begins with, when that head is
    whole, the parser takes it alone, it declares no body (neither
    Content-Length nor Transfer-Encoding) and bytes follow it in `data` (a
    body sent unframed, most likely); marked to close its connection. None
    for anything else. Parses the head again: called only for a read the
    parser refused."""
    end = data.find(b"\r\n\r\n") + 4
    if end < 4 or end == len(data) or not data.startswith(b"POST "):
        return None
    loop = asyncio.get_running_loop()
    parser = HttpRequestParser(
        None, loop, 2**16, max_line_size=MAX_LINE, max_field_size=MAX_FIELD, max_headers=MAX_HEADERS
    )
    try:
        messages, _, _ = parser.feed_data(data[:end])
    except HttpProcessingError:
        return None
    if len(messages) != 1:
        return None
    message: RawRequestMessage = messages[0][0]
    headers = message.headers
    if hdrs.CONTENT_LENGTH in headers or hdrs.TRANSFER_ENCODING in headers:
        return None
    return message._replace(should_close=True)


def parser_error(exc: HttpProcessingError) -> ApiError:
    """The client's answer to a message aiohttp's parser refused: a fixed message
    per kind (the parser's own text may quote the client's bytes)."""
    text = str(exc)
    if isinstance(exc, LineTooLong | HeadTooLarge) or "Too many headers" in text:
        # The parser's error does not say whether the request line or a header
        # was too long, so both are a 431 (not 414).
        return ApiError(
            431,
            f"request head too large: at most {MAX_HEADERS} headers and {MAX_HEAD} "
            f"bytes, and at most {MAX_FIELD} bytes in the request line and in each header",
            code="request_header_fields_too_large",
        )
    if isinstance(exc, VersionNotSupported) or exc.message.startswith(_H2_PREFACE):
        # The preface of HTTP/2 with prior knowledge: llhttp pauses at it.
        return ApiError(
            400, "HTTP version not supported: send HTTP/1.1", code="http_version_not_supported"
        )
    if isinstance(exc, CodingNotSupported):
        return ApiError(
            400,
            "Transfer-Encoding not supported: send 'chunked' alone (a content coding goes in "
            "Content-Encoding)",
            code="unsupported_transfer_encoding",
        )
    if isinstance(exc, ChunkedInHttp10):
        return ApiError(
            400,
            "Transfer-Encoding in an HTTP/1.0 request: send HTTP/1.1, or a Content-Length",
            code="unsupported_transfer_encoding",
        )
    if isinstance(exc, BadHttpMethod):
        return ApiError(400, "malformed HTTP request: invalid method", code="invalid_http_request")
    if isinstance(exc, InvalidURLError):  # its message is the target as sent
        return ApiError(
            400, "malformed HTTP request: invalid request target", code="invalid_http_request"
        )
    reason = _parser_reason(exc.message)
    message = f"malformed HTTP request: {reason}" if reason else "malformed HTTP request"
    return ApiError(400, message, code="invalid_http_request")


# Messages of aiohttp's own checks that quote nothing the client chose but a
# singleton header's name.
_FIXED_REASONS: Final = re.compile(
    r"Missing 'Host' header in request\.|Duplicate '[A-Za-z-]{1,40}' header found\."
)


def _parser_reason(text: str) -> str:
    """The parser's reason, never the client's bytes: llhttp's fixed reason,
    which it puts before a blank line and the quoted request bytes
    (`Duplicate Content-Length:` then the line), or one of aiohttp's fixed
    messages (_FIXED_REASONS). Empty for anything else (the pure-Python
    parser's messages quote the request line or a header)."""
    if _FIXED_REASONS.fullmatch(text):
        return text
    if "\n\n" not in text:
        return ""
    head = text.split("\n\n", 1)[0]
    reason = ": ".join(part.strip().rstrip(":") for part in head.splitlines() if part.strip())
    if len(reason) > 120 or not (reason.isascii() and reason.isprintable()):
        return ""
    return reason


def _refusal_parts() -> tuple[bytes, bytes]:
    body = jsonio.dumps(
        {
            "error": {
                "message": "the proxy is at its connection limit; retry shortly",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "Retry-After: 1\r\n"
        "x-request-id: "
    ).encode()
    return head, b"\r\n\r\n" + body


_REFUSAL_HEAD, _REFUSAL_TAIL = _refusal_parts()


class EdgeServer(web.Server):
    """aiohttp's protocol factory, making EdgeProtocols. One per listener set."""

    def __init__(
        self,
        base: web.Server,
        limits: EdgeLimits,
        caps: ConnectionCaps,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]] | None = None,
        unparsed: Callable[[web.BaseRequest, str, int, str], None] | None = None,
        *,
        prepare_hooks: bool = True,
    ) -> None:
        # aiohttp keeps the protocol's arguments in `_kwargs` only.
        super().__init__(
            handler or base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            **base._kwargs,
        )
        self.limits = limits
        self.caps = caps
        self.ids = RequestIds()
        # Counts and logs a message the parser refused (dataplane.http.state.UNPARSED).
        self.unparsed = unparsed
        # False: no application served here has on_response_prepare hooks, so
        # no answer's request needs looking at for them.
        self.prepare_hooks = prepare_hooks

    def __call__(self) -> EdgeProtocol:
        return EdgeProtocol(self, loop=self._loop, **self._kwargs)

    def pre_shutdown(self) -> None:
        """The listeners are closed: each connection finishes the request
        begun on it and takes no other (EdgeProtocol.stop_taking)."""
        for conn in list(self._connections):
            if isinstance(conn, EdgeProtocol):
                conn.stop_taking()
            else:  # pragma: no cover - this server makes EdgeProtocols only
                conn.close()


class EdgeRunner(web.AppRunner):
    """An AppRunner whose listeners apply `limits` (see the module docstring).

    The soft descriptor limit is raised to the hard one at setup (a
    process-wide side effect), and `max_connections` of 0 is sized from it; a
    given `max_connections` the limit cannot hold is warned about, once.
    """

    __slots__ = ("_limits", "caps")

    def __init__(self, app: web.Application, limits: EdgeLimits, **kwargs: Any) -> None:
        super().__init__(
            app,
            keepalive_timeout=limits.keepalive_timeout,
            max_line_size=MAX_LINE,
            max_field_size=MAX_FIELD,
            max_headers=MAX_HEADERS,
            auto_decompress=False,  # dataplane.http.body decodes, bounded
            **kwargs,
        )
        self._limits = limits
        self.caps: ConnectionCaps | None = None

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        limits = self._limits
        # Raised whether or not the cap is given (trial 74: an explicit
        # --max-connections left the soft limit at 1024).
        nofile = raise_nofile_limit()
        total = limits.max_connections or default_max_connections(nofile)
        # Only a cap given: one sized from the limit fits it but for its
        # floor of 64, which a limit under 384 cannot hold (review 308: the
        # warning then told to lower a flag never set).
        if limits.max_connections and (short := descriptors_short(total, nofile)):
            log.warning("%s", short)
        per_client = limits.max_connections_per_client or max(1, total // 4)
        self.caps = ConnectionCaps(total, per_client)
        # The app is frozen by now: its fixed routes are dispatched without the router.
        fixed = FixedRoutes(self.app, base.request_handler)
        return EdgeServer(
            base, limits, self.caps, fixed, self.app.get(UNPARSED),
            prepare_hooks=_has_prepare_hooks(self.app),
        )  # fmt: skip
