"""One origin call on raw asyncio: aiohttp's C response parser over the wire's own pool.

A call's shape never changes (a POST of bytes already in memory to an origin
of the route table), and aiohttp's client layers cost more than they give for
it: `ClientSession.post` builds a request and a response object per call, some
six times the CPU of a bare raw client (bench.wire_micro), and even its
connector and client protocol, which the wire used until it replaced them,
cost some 11 us a call more than the wire's own pool and protocol (a fifth of
the wire's cost). So the wire keeps aiohttp's pieces that carry no per-call
weight and does the rest:

- **opening** a connection is aiohttp's connector's (`TCPConnector`, its
  `_create_connection`): DNS with a cache, happy eyeballs over the addresses,
  TLS verified against the system's trust store (`SSL_CERT_FILE` and
  `SSL_CERT_DIR` name another), and aiohttp's errors for each failure. The
  connector pools nothing: its connections are handed to the wire at once;
- **the pool** is the wire's (`_Pool`, one per host, port and scheme): idle
  connections, the most recently used reused first, at most `limit_per_host`
  open (a call past it waits: a busy origin is not a failing one; the calls
  waiting are served first come, first served, each handed the next
  connection freed), an idle one closed after `keepalive_timeout`. The wait
  is bounded (`queue_timeout`), and one caller's share (a tenant's, say) of
  the calls to one pool is bounded (`share_limit`) while another caller has
  calls to it, and a caller alone keeps an eighth of the pool free for the
  others: past any of these the call
  fails with `OriginFull`, reaching no origin. A trial found why: one tenant's
  1,024 streams held every connection, and another tenant's call waited
  behind them, untimed, past its client's timeout;
- **the request head** is aiohttp's own serialisation (`_serialize_headers`,
  which refuses CR and LF in names and values), written with the body in one
  `writelines`;
- **the answer** is parsed by aiohttp's C parser (llhttp) in `OriginConnection`,
  a bare `asyncio.Protocol`: gzip and deflate bodies come decompressed, a body
  without a length ends with the connection, interim (1xx) answers are
  skipped, and the call fails unless its head and its body's first byte come
  within `read_timeout` seconds of sending it (one deadline: an origin that
  drips its head is not given it again at each byte), and then its body's read
  once `read_timeout` seconds pass without a byte of it. A redirect is not
  followed: an origin's 3xx is its answer (the Forwarder refuses it as a
  misconfigured base URL).

Errors are aiohttp's, as under a ClientSession: `aiohttp.ClientError`
subclasses for connection and protocol failures (`ClientPayloadError` for an
unparsable answer or a body cut short), `TimeoutError` subclasses for the
connect and read timeouts; and ValueError for a URL that is not http(s) or a
header with CR, LF or NUL, which the route table's checks (dataplane.routes,
the control plane) and aiohttp's request parser keep from getting here. A
call cancelled or failed before it returns closes its connection (an origin
generating for nobody stops).

The body is written whole, not streamed under flow control: it is already in
memory, bounded by the proxy's --max-body-bytes. A connection goes back to the
pool only when its answer ended, the origin keeps it open, and its request
has all left the proxy (an origin may answer early, a 413 say: the next
request would wait behind the rest of this one's body); a stream released
once its client had the answer's last event, before the body's end came, waits
LINGER for it (`OriginResponse.release(ended=True)`). Bytes an origin sends
when no call asked for them close the connection, unless they came in the
same read as the end of an answer: llhttp then takes them as the start of the
next answer, which fails to parse (and the call is tried on the next origin).
Only an origin that breaks HTTP/1.1 sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections import deque
from collections.abc import Coroutine, Mapping
from typing import Any, Final, cast

import aiohttp
from aiohttp import hdrs
from aiohttp.base_protocol import BaseProtocol
from aiohttp.client_exceptions import SocketTimeoutError
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest, ConnectionKey
from aiohttp.helpers import EMPTY_BODY_STATUS_CODES
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpResponseParser, RawResponseMessage
from aiohttp.http_writer import _serialize_headers
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from dataplane.timer import LazyTimer

__all__ = [
    "DEFAULT_HEADERS",
    "DEFAULT_MAX_ANSWER_BYTES",
    "USER_AGENT",
    "AnswerTooLarge",
    "OriginConnection",
    "OriginFull",
    "OriginResponse",
    "OriginWire",
    "media_type",
]

# What the proxy calls itself to origins and JWKS servers when its client
# says nothing: no versions of Python and aiohttp (aiohttp's default told
# them, and a hosted API, what an attacker would want to know).
USER_AGENT: Final = "ponto-proxy"
# What a ClientSession adds to every request unless the caller set it: the
# origins saw these before this module existed, and gzip answers stay cheap to
# accept (the parser decompresses them).
DEFAULT_HEADERS: Final = (
    (hdrs.ACCEPT, "*/*"),
    (hdrs.ACCEPT_ENCODING, "gzip, deflate"),
    (hdrs.USER_AGENT, USER_AGENT),
)
# Origin URLs remembered (each with its ClientRequest); a table names a few.
MAX_ENDPOINTS: Final = 4096
# An answer's body buffered before reading from the origin pauses (twice this).
READ_BUFSIZE: Final = 2**16
MAX_LINE: Final = 8190
MAX_HEADERS: Final = 128
# The most of one origin answer the proxy holds at once (--max-answer-bytes): a
# whole (non-streamed) answer, or one event of a stream. A chat or completions
# answer stays far under it, and so does the largest embeddings batch (2,048 of
# 3,072 floats) as the base64 the openai SDK asks for, 34 MB; not the same batch
# as JSON numbers (94-135 MB as OpenAI or vLLM write them), which needs a larger
# bound. What passes it is otherwise a broken origin, and holding that would
# take the memory of every request.
DEFAULT_MAX_ANSWER_BYTES: Final = 64 << 20
# Per origin at most this many connections: past that, bursts wait for a free
# keep-alive connection instead of opening (and tearing down) new ones.
LIMIT_PER_HOST: Final = 1024
# The longest a call waits for a connection of a pool at its cap before it
# fails (OriginFull), to be tried on the next origin: a stream holds its
# connection for minutes, so a wait behind streams may not end in any time a
# client waits (--origin-queue-timeout).
QUEUE_TIMEOUT: Final = 5.0
KEEPALIVE_TIMEOUT: Final = 30.0
# How long a connection whose answer the caller has whole waits for the end of
# its body (OriginResponse.release): an origin writes it at once.
LINGER: Final = 1.0
DNS_CACHE_TTL: Final = 60

Head = tuple[RawResponseMessage, StreamReader]


class OriginConnection(BaseProtocol):
    """One connection to an origin, answering one call at a time.

    `expect` readies it for a call's answer and returns the future of its
    final head (message and body); `start_timeout` starts the read timeout
    once the request is on its way. The body's StreamReader is the call's;
    the connection is free for the next call once the body has ended
    (`reusable` says whether it may have one).
    """

    __slots__ = (
        "_deadline",
        "_head",
        "_lingering",
        "_parser_paused",
        "_payload",
        "_read_timeout",
        "idle_since",
        "pool",
        "reusable",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._deadline = LazyTimer(loop)
        self._head: asyncio.Future[Head] | None = None  # the call's, until its final head
        self._payload: StreamReader | None = None  # the call's body, until its end
        self._read_timeout: float | None = None
        # The body's size when its caller left it to end (linger); None: not left.
        self._lingering: int | None = None
        self._parser_paused = False  # a new parser for the next answer (see expect)
        self.reusable = True  # no answer said Connection: close, nothing failed
        self.idle_since = 0.0
        self.pool: _Pool | None = None

    def expect(self, read_timeout: float | None) -> asyncio.Future[Head]:
        """An answer is due from now: the future of its final head."""
        if self._parser is None or self._parser_paused:
            # One per connection: llhttp parses a connection's answers one after
            # another, as it parses pipelined ones. But not past a pause: one
            # taken at a chunk's end (a reader far behind on many small chunks)
            # is consumed only by a later body byte, and at an answer's last
            # chunk it would stop the next answer at its first (aiohttp makes
            # a parser per answer).
            self._parser_paused = False
            self._parser = HttpResponseParser(
                self,
                self._loop,
                READ_BUFSIZE,
                payload_exception=aiohttp.ClientPayloadError,
                read_until_eof=True,  # a body without a length ends with the connection
                max_line_size=MAX_LINE,
                max_field_size=MAX_LINE,
                max_headers=MAX_HEADERS,
            )
        self._read_timeout = read_timeout
        head = self._head = self._loop.create_future()
        return head

    def start_timeout(self) -> None:
        """The read timeout runs from now (the request handed to the socket):
        one deadline for the whole head and the body's first byte, which the
        head's bytes do not move; from the body's first byte on, each byte
        starts it over."""
        self._time_the_origin()

    def time_reads(self, read_timeout: float | None) -> None:
        """The call's read timeout is `read_timeout` (None: none), from now."""
        self._read_timeout = read_timeout
        if read_timeout:
            self._time_the_origin()
        else:
            self._deadline.disarm()

    def is_idle(self) -> bool:
        """Free for another call: its answer ended, nothing failed or said close,
        and its request has all left (the transport holds no unsent byte).
        A method, not a property: asked twice a call, and a property is a
        Python call dearer than a method's on 3.11 (some 640 instructions
        against 370)."""
        transport = self.transport
        return (
            self.reusable
            and self._head is None
            and self._payload is None
            and transport is not None
            and not transport.is_closing()
            and not transport.get_write_buffer_size()
        )

    def rest(self) -> None:
        """To the first call waiting for a connection of its pool, or back to
        the pool, idle, if it is free for another call; else closed."""
        pool = self.pool
        if pool is None or pool.closed or not self.is_idle():
            self.close()
        elif not (pool.waiters and pool.hand(self)):  # hand's call only for a call waiting
            self.idle_since = self._loop.time()
            pool.idle[self] = None

    def linger(self, grace: float) -> None:
        """Its caller is done with an answer whose body has not ended (a
        stream's last event came before a chunked body's last chunk): back to
        the pool (`rest`) if that end comes within `grace` seconds with no more
        of the body, else closed (an origin still generating for nobody stops)."""
        payload = self._payload
        if payload is None:
            self.rest()
            return
        pool = self.pool
        if pool is None or pool.closed:
            self.close()  # a closed wire pools nothing: no reason to wait
            return
        self._lingering = payload.total_bytes
        pool.lingering.add(self)
        self._deadline.arm(grace, self.close)

    def close(self) -> None:
        """Close the connection (after what is queued to send); never reused."""
        self.reusable = False
        pool = self.pool
        if pool is not None:
            pool.idle.pop(self, None)
            pool.lingering.discard(self)
        transport = self.transport
        if transport is not None:
            transport.close()

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None or (data and self._head is None and self._payload is None):
            # Bytes no call asked for (an origin answering twice, or before being
            # asked): whatever follows on this connection cannot be trusted.
            self.close()
            return
        lingering = self._lingering
        if data and lingering is None and self._head is None:
            # A byte of the body: the timeout starts over. Not one of the head,
            # which is due whole within the timeout of the request's sending,
            # one deadline (trial 65: an origin that dripped its head a byte a
            # second held a stream's first-chunk failover to 84.7 s of 60).
            self._time_the_origin()
        try:
            messages, _, _ = parser.feed_data(data)
        except Exception as exc:  # the parser's refusal of what the origin sent
            reason = exc.message if isinstance(exc, HttpProcessingError) else repr(exc)
            self._fail(aiohttp.ClientPayloadError(f"unparsable answer: {reason}"))
            return
        if lingering is not None:
            payload = self._payload
            if messages or (payload is not None and payload.total_bytes != lingering):
                self.close()  # more of a body no one reads (or another answer): not its end
            return
        for message, body in messages:
            payload = body
            if message.should_close:
                self.reusable = False
            head = self._head
            code = message.code
            if head is None:  # a second final answer to one request
                self.close()
                return
            if code in EMPTY_BODY_STATUS_CODES:
                if 100 <= code < 200:
                    if code != 101:
                        continue  # interim: the final head is still awaited, and timed
                    self.reusable = False  # switched protocols: no more HTTP here
                payload = EMPTY_PAYLOAD
            self._head = None
            if payload.is_eof():
                self._deadline.disarm()
            else:
                self._payload = payload
                payload.on_eof(self._answered)
                if payload.total_bytes:
                    # Its first bytes came with the head: the gaps of the rest
                    # are timed from here. Else the first is due by the head's
                    # deadline (a stream's first chunk, --first-chunk-timeout).
                    self._time_the_origin()
            if not head.done():  # else the call was cancelled, and closes this
                head.set_result((message, payload))

    def _answered(self) -> None:
        payload, self._payload = self._payload, None
        self._deadline.disarm()
        lingering, self._lingering = self._lingering, None
        if lingering is not None:  # its caller left it to end: see linger
            if self.pool is not None:
                self.pool.lingering.discard(self)
            if payload is not None and payload.total_bytes == lingering:
                self.rest()
            else:
                self.close()

    def _timed_out(self) -> None:
        self._fail(SocketTimeoutError("Timeout on reading data from socket"))

    def _fail(self, exc: BaseException) -> None:
        """The call's answer fails with `exc` (its head's wait or its body's
        read), and the connection closes."""
        self._deadline.disarm()
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(exc)
        payload, self._payload = self._payload, None
        if payload is not None:
            payload.set_exception(exc)
        self.close()

    def pause_reading(self) -> None:
        self._parser_paused = True
        super().pause_reading()
        self._deadline.disarm()  # the read timeout measures the origin, not this wait

    def resume_reading(self, resume_parser: bool = True) -> None:
        # A body's reader asks for this on every read below its low-water mark;
        # aiohttp then feeds the parser an empty chunk, needed only after a pause.
        if not self._reading_paused:
            return
        super().resume_reading(resume_parser)
        self._time_the_origin()

    def _time_the_origin(self) -> None:
        """The read timeout runs again, unless no answer is due or reading is
        paused (feeding the parser what it held, a resume may pause again for
        a reader still behind: then the wait is the reader's, not the origin's)."""
        if (
            self._read_timeout
            and not self._reading_paused
            and (self._head is not None or self._payload is not None)
        ):
            self._deadline.arm(self._read_timeout, self._timed_out)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._deadline.close()
        self.reusable = False
        pool = self.pool
        if pool is not None:
            pool.lost(self)
        payload = self._payload
        if payload is not None and self._parser is not None:
            try:
                self._parser.feed_eof()  # a body read to the connection's end ends here
            except Exception as cut:
                reason = f"Response payload is not completed: {cut!r}"
                if exc is not None:
                    reason += f". {exc!r}"
                self._payload = None
                payload.set_exception(aiohttp.ClientPayloadError(reason))
        head, self._head = self._head, None
        if head is not None and not head.done():
            if isinstance(exc, OSError):
                head.set_exception(aiohttp.ClientOSError(*exc.args))
            else:
                head.set_exception(aiohttp.ServerDisconnectedError())
        super().connection_lost(exc)


def _pop_idle(pool: _Pool) -> OriginConnection | None:
    """The most recently freed of `pool`'s idle connections, taken from it;
    those no longer fit for a call (closing, or the origin closed) are closed
    on the way. None when none is idle."""
    idle = pool.idle
    while idle:
        conn, _ = idle.popitem()
        if conn.is_idle():
            return conn
        conn.close()
    return None


class _Pool:
    """The connections to one origin (host, port and scheme): the idle ones
    (insertion order: the most recently freed last, reused first) and a count
    of all that are open or opening, with the calls waiting for one at the cap.
    Once `closed` (its wire closed), a connection its call ends is closed."""

    __slots__ = ("closed", "idle", "lingering", "open", "shares", "waiters")

    def __init__(self) -> None:
        self.closed = False
        self.idle: dict[OriginConnection, None] = {}
        # Released before their body's end, waiting for it (OriginConnection.linger).
        self.lingering: set[OriginConnection] = set()
        self.open = 0
        # First come, first served: a call waiting is handed a connection as
        # one is freed (or a free place, None, to open one), so a call arriving
        # meanwhile cannot take it first. Only calls still waiting are here.
        self.waiters: deque[asyncio.Future[OriginConnection | None]] = deque()
        # Each tenant's calls under way (waiting, opening, or holding a
        # connection until their answer is released); a tenant with none has
        # no entry.
        self.shares: dict[str, int] = {}

    def leave(self, tenant: str) -> None:
        """A call of `tenant` counted in `shares` has ended."""
        shares = self.shares
        left = shares[tenant] - 1
        if left:
            shares[tenant] = left
        else:
            del shares[tenant]

    def lost(self, conn: OriginConnection) -> None:
        """`conn` is closed: its place is free."""
        self.idle.pop(conn, None)
        self.lingering.discard(conn)
        self.open -= 1
        conn.pool = None
        self.hand(None)

    def hand(self, conn: OriginConnection | None) -> bool:
        """Hand `conn` (None: a free place) to the first call waiting; False if none waits."""
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # else cancelled, and about to leave
                waiter.set_result(conn)
                return True
        return False


def request_head(
    endpoint: _Endpoint,
    line: str,
    headers: CIMultiDict[str],
    length: int,
    lines: bytes | None = None,
) -> bytes:
    """The head of a call of `line` to `endpoint` with `headers` and a body of
    `length` bytes: `headers`, then Host, Content-Length and the
    DEFAULT_HEADERS they lack, in that order (the endpoint's basic auth
    before them, when it has one and `headers` no Authorization).

    The usual head (no Host nor Content-Length in `headers`, no basic auth
    to add) has those lines written as bytes after aiohttp's serialisation of
    `headers`, not set in `headers` first: the same bytes, without five
    multidict writes and their serialisation (some 1,300 instructions a
    header serialised: callgrind). `headers` is left as it came. Any other head has them set in
    `headers` (a copy, for the basic auth) as before: the bytes are the same,
    as a header set again keeps its place. `lines`: `headers`' own lines
    (`post`), written as they are after the endpoint's request line."""
    authorization = endpoint.authorization
    if (
        hdrs.HOST not in headers
        and hdrs.CONTENT_LENGTH not in headers
        and (authorization is None or hdrs.AUTHORIZATION in headers)
    ):
        tail = [endpoint.host_line, b"Content-Length: ", str(length).encode(), b"\r\n"]
        for name, header_line in _DEFAULT_LINES:
            if name not in headers:
                tail.append(header_line)
        tail.append(b"\r\n")
        if lines is not None and line is endpoint.line and endpoint.head_line is not None:
            return b"".join((endpoint.head_line, lines, *tail))
        return _serialize_headers(line, headers)[:-2] + b"".join(tail)
    if authorization is not None and hdrs.AUTHORIZATION not in headers:
        # This origin's own: not left in a dict the next attempt reuses.
        headers = headers.copy()
        headers[hdrs.AUTHORIZATION] = authorization
    headers[hdrs.HOST] = endpoint.host
    headers[hdrs.CONTENT_LENGTH] = str(length)
    for name, value in DEFAULT_HEADERS:
        headers.setdefault(name, value)
    return _serialize_headers(line, headers)


# DEFAULT_HEADERS as the lines `request_head` writes.
_DEFAULT_LINES: Final = tuple(
    (name, f"{name}: {value}\r\n".encode()) for name, value in DEFAULT_HEADERS
)


class _Endpoint:
    """An origin URL as the wire calls it: what opens its connections (a
    ClientRequest, the connector's key), its pool, and the request line and
    Host header, built once."""

    __slots__ = ("authorization", "head_line", "host", "host_line", "key", "line", "pool")

    def __init__(
        self, url: URL, loop: asyncio.AbstractEventLoop, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ValueError(f"not an origin URL: {url}")
        # Only the connector reads it: what it needs to open (and for https,
        # verify) a new connection.
        self.key = ClientRequest("POST", url, loop=loop, ssl=ssl_context or True)
        self.pool = _Pool()  # the wire gives it the one of its host, port and scheme
        self.line = f"POST {url.raw_path_qs} HTTP/1.1"
        # As aiohttp's serialisation writes it (None: it is left to that).
        self.head_line = head_line(self.line)
        default_port = url.is_default_port()
        self.host = url.raw_host if default_port else f"{url.raw_host}:{url.port}"
        if ":" in url.raw_host and not url.raw_host.startswith("["):
            self.host = f"[{url.raw_host}]" + ("" if default_port else f":{url.port}")
        self.host_line = f"{hdrs.HOST}: {self.host}\r\n".encode()
        # Credentials written into the URL are sent as basic auth, as a
        # ClientSession sends them, unless the call carries its own.
        self.authorization = (
            aiohttp.encode_basic_auth(url.user or "", url.password or "")
            if url.user is not None or url.password is not None
            else None
        )


def head_line(text: str) -> bytes | None:
    """A line of an HTTP head (a request line, or "name: value"), as bytes
    aiohttp's serialisation writes it: None unless it is printable ASCII
    (what aiohttp writes as UTF-8, or refuses, is left to it)."""
    return f"{text}\r\n".encode() if text.isascii() and text.isprintable() else None


def media_type(headers: Mapping[str, str]) -> str:
    """The Content-Type's media type, lower case, without parameters ("" when absent)."""
    return headers.get(hdrs.CONTENT_TYPE, "").partition(";")[0].strip().lower()


class OriginResponse:
    """An origin's answer once its head has arrived: `status`, `headers`, and
    `content`, the body as aiohttp's StreamReader (decompressed).

    The caller ends it with `release()`: the connection goes back to the pool
    when the body was read to its end and the origin keeps the connection
    open, and is closed otherwise. `close()` always closes it. Both are
    idempotent.
    """

    __slots__ = ("_conn", "_pool", "_tenant", "content", "content_type", "headers", "status")

    def __init__(
        self,
        status: int,
        headers: CIMultiDictProxy[str],
        content: StreamReader,
        conn: OriginConnection,
        pool: _Pool | None = None,
        tenant: str = "",
    ) -> None:
        """`pool`: the pool whose `shares` count this call of `tenant` until
        it is released or closed (None: counted nowhere)."""
        self.status = status
        self.headers = headers
        # The media type, lower case, without parameters ("" when absent): a
        # slot, not a property (a Python call each read, some 640 instructions).
        self.content_type = media_type(headers)
        self.content = content
        self._conn: OriginConnection | None = conn
        self._pool = pool
        self._tenant = tenant

    def time_reads(self, read_timeout: float | None) -> None:
        """From now, `read_timeout` seconds without a byte of the body fail
        its read (None: no limit): a stream's first chunk may be timed
        shorter than the rest."""
        if self._conn is not None:
            self._conn.time_reads(read_timeout)

    async def read(self, limit: int = DEFAULT_MAX_ANSWER_BYTES) -> bytes:
        """The whole body; then the connection is released. AnswerTooLarge
        (the connection closed) when it is longer than `limit` bytes: as soon
        as its Content-Length says so (when not compressed), else once that
        much has come (decompressed, so a small gzip bomb is caught too)."""
        body = self.read_now(limit)
        if body is not None:
            return body
        try:
            body = await _read_up_to(self.content, limit, self.headers)
        except BaseException:
            self.close()
            raise
        self.release()
        return body

    def read_now(self, limit: int = DEFAULT_MAX_ANSWER_BYTES) -> bytes | None:
        """`read`'s answer (or its AnswerTooLarge) without a wait, when the
        whole body is in: usually it came with the head. None when more is
        to come: await `read` then. A plain call: a coroutine that never
        waits costs some 1,000 instructions more."""
        content = self.content
        if not content.is_eof():
            return None
        try:
            # Taken as it is, without a loop of readany() calls. Bounded by the
            # StreamReader's pause at twice READ_BUFSIZE plus one read of the socket.
            body = content.read_nowait()
            if len(body) > limit:
                raise AnswerTooLarge(len(body), limit)
        except BaseException:
            self.close()
            raise
        # release()'s steps for a body known ended, without asking is_eof
        # again (a Python call, some 400 instructions).
        conn, self._conn = self._conn, None
        if conn is not None:
            self._leave()
            conn.rest()
        return body

    def release(self, *, ended: bool = False) -> None:
        """`ended`: the caller has the whole answer though the body has not
        ended (a stream's last event came before a chunked body's last
        chunk); the connection then waits LINGER seconds for that end."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._leave()
        if self.content.is_eof():
            conn.rest()
        elif ended:
            conn.linger(LINGER)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._leave()
            conn.close()

    def _leave(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.leave(self._tenant)


class OriginFull(aiohttp.ClientConnectionError):
    """A call that got no connection to an origin and was never sent: the
    pool was at its cap for `queue_timeout` seconds (`why` "queue"), or the
    call's tenant had its share of the pool's calls under way already (`why`
    "share"). The origin is busy, not failing."""

    def __init__(self, host: str, why: str, detail: str) -> None:
        super().__init__(f"{host}: {detail}")
        self.why = why


class AnswerTooLarge(Exception):
    """An origin's whole answer is longer than the caller holds: `size` is
    what was known of it when the read stopped (its Content-Length, or the
    bytes read so far), `limit` the caller's bound."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a body of more than {limit} bytes ({size} or more)")
        self.size = size
        self.limit = limit


async def _read_up_to(content: StreamReader, limit: int, headers: Mapping[str, str]) -> bytes:
    if hdrs.CONTENT_ENCODING not in headers:
        declared = headers.get(hdrs.CONTENT_LENGTH, "")
        if declared.isdigit() and int(declared) > limit:
            raise AnswerTooLarge(int(declared), limit)
    # StreamReader.read()'s loop, counted: what is held never passes `limit`
    # by more than one chunk.
    chunks: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _opener(ttl_dns_cache: int) -> aiohttp.TCPConnector:
    """aiohttp's connector, for opening OriginConnections only. On the running loop."""
    connector = aiohttp.TCPConnector(ttl_dns_cache=ttl_dns_cache)
    # aiohttp's connectors make their protocols with this factory, and take no argument for it.
    factory = functools.partial(OriginConnection, loop=asyncio.get_running_loop())
    connector._factory = cast("functools.partial[ResponseHandler]", factory)
    return connector


class OriginWire:
    """POSTs to origins over its own keep-alive pools. One per app; safe for
    concurrent use on its event loop; `close` at the end."""

    def __init__(
        self,
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
        limit_per_host: int = LIMIT_PER_HOST,
        share_limit: int = 0,
        queue_timeout: float | None = QUEUE_TIMEOUT,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
        ttl_dns_cache: int = DNS_CACHE_TTL,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """`ssl_context` verifies https origins (None: aiohttp's default, the
        system's trust store). `share_limit`: the most calls of one tenant
        under way to one pool, waiting for a connection or holding one,
        while another tenant has calls to it (0: no bound; past
        `limit_per_host` calls wait, in turn);
        `queue_timeout`: the longest a call waits for a connection of a pool
        at its cap (None: untimed)."""
        self._ssl_context = ssl_context
        self._timeout = aiohttp.ClientTimeout(
            # The socket's connect only: a call that waits for a free connection
            # of a busy origin (at limit_per_host) waits in its turn, up to
            # queue_timeout, and then fails as OriginFull, which no caller
            # counts against the origin (a connect timeout would count a
            # saturated origin as failing and eject it).
            total=None,
            sock_connect=connect_timeout,
        )
        self._read_timeout = read_timeout
        self._limit = limit_per_host
        self._share_limit = share_limit or None
        # A tenant alone on a pool takes all but a reserve (an eighth) for
        # the tenants that come after it: a share binds only once another
        # tenant has calls, and one that comes after the first took every
        # connection would wait for one to be freed, past its queue timeout,
        # behind streams of minutes (a review of the shares: the trial's own
        # order). A share of the whole pool or more keeps no reserve.
        self._alone_limit = (
            None
            if self._share_limit is None or self._share_limit >= limit_per_host
            else max(self._share_limit, limit_per_host - max(1, limit_per_host // 8))
        )
        self._queue_timeout = queue_timeout
        self._keepalive = keepalive_timeout
        self._ttl_dns_cache = ttl_dns_cache
        self._endpoints: dict[URL, _Endpoint] = {}
        # The last endpoint looked up, with its URL (see _endpoint).
        self._last: tuple[URL, _Endpoint] | None = None
        self._pools: dict[ConnectionKey, _Pool] = {}
        self._connector: aiohttp.TCPConnector | None = None  # made on the loop of the first call
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    def _endpoint(self, url: URL) -> _Endpoint:
        # The last call's URL first, by identity: a table's URLs are made once
        # (routes.Target.url), and a dict lookup by a URL calls its Python
        # __hash__ (some 1,300 instructions, callgrind on a loop).
        last = self._last
        if last is not None and last[0] is url:
            return last[1]
        found = self._endpoints.get(url)
        if found is None:
            if len(self._endpoints) >= MAX_ENDPOINTS:
                # Tables changed many times: start over, keeping the pools in use.
                self._endpoints.clear()
                self._pools = {k: p for k, p in self._pools.items() if p.open or p.waiters}
            found = _Endpoint(url, asyncio.get_running_loop(), self._ssl_context)
            found.pool = self._pools.setdefault(found.key.connection_key, found.pool)
            self._endpoints[url] = found
        self._last = (url, found)
        return found

    def post(
        self,
        url: URL,
        body: bytes,
        headers: CIMultiDict[str],
        read_timeout: float | None = None,
        tenant: str = "",
        lines: bytes | None = None,
    ) -> Coroutine[Any, Any, OriginResponse]:
        """Send `body` to `url` with `headers`, to which Host, Content-Length
        and the DEFAULT_HEADERS it lacks are added (set again on every call, so
        one dict serves a request's attempts on several origins); return once
        the answer's head has arrived. `read_timeout` replaces the wire's for
        this call, until `OriginResponse.time_reads` changes it. The call is
        counted in `tenant`'s share of the pool until its answer is released
        or closed; OriginFull, sending nothing, when the share is taken or no
        connection came free within the queue timeout. `lines`: the lines
        `headers` make in a request head, when the caller has them (made as
        aiohttp's serialisation would: printable ASCII), written as they are.

        Not a coroutine of its own: it returns `_send`'s, so that the call's
        chain of awaits has no frame here (each frame an await passes
        through costs some 900 instructions a wait: bench/instructions.py).
        Await what it returns."""
        endpoint = self._endpoint(url)
        return self._send(endpoint, endpoint.line, body, headers, read_timeout, tenant, lines)

    def call(
        self,
        method: str,
        base: URL,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        read_timeout: float | None = None,
        tenant: str = "",
    ) -> Coroutine[Any, Any, OriginResponse]:
        """`post`, with `method`, to `path` (its query included, already
        encoded) under the origin's `base` URL: for a path made for one
        request (a stored response's), which no endpoint is kept for (the
        pool is the base's host's, as for every call to it). As `post`,
        returns `_send`'s coroutine."""
        endpoint = self._endpoint(base)
        line = f"{method} {base.raw_path.rstrip('/')}{path} HTTP/1.1"
        return self._send(endpoint, line, body, headers, read_timeout, tenant, None)

    async def _send(
        self,
        endpoint: _Endpoint,
        line: str,
        body: bytes,
        headers: CIMultiDict[str],
        read_timeout: float | None,
        tenant: str,
        lines: bytes | None,
    ) -> OriginResponse:
        pool = endpoint.pool
        # The common path's whole cost of the shares: a lookup and a store.
        shares = pool.shares
        calls = shares.get(tenant, 0)
        share = self._share_limit
        # The share binds while another tenant has calls to it; alone (an
        # open fleet's `default`, a deployment of one tenant) a tenant may
        # use all but the reserve (_alone_limit).
        if share is not None and calls >= share:
            alone = len(shares) == 1
            reserve_from = self._alone_limit
            if not alone or (reserve_from is not None and calls >= reserve_from):
                raise OriginFull(
                    endpoint.host,
                    "share",
                    f"its tenant has {calls} calls under way to this origin, "
                    + (
                        "all of this proxy's connections to it but those kept for other tenants"
                        if alone
                        else "its share of this proxy's connections to it"
                    )
                    + " (--max-origin-connections-per-tenant)",
                )
        shares[tenant] = calls + 1
        try:
            # A plain call when a connection is idle (nearly always): a
            # coroutine that never waits costs some 700 instructions more.
            conn = self._idle_now(endpoint)
            if conn is None:
                conn = await self._take(endpoint)
        except BaseException:
            pool.leave(tenant)
            raise
        try:
            transport = conn.transport
            if transport is None:
                raise aiohttp.ServerDisconnectedError()
            head = conn.expect(self._read_timeout if read_timeout is None else read_timeout)
            transport.writelines((request_head(endpoint, line, headers, len(body), lines), body))
            # The read timeout runs from here: the request handed to the socket
            # (a large body may still be leaving; aiohttp's session started it
            # once the body was written).
            conn.start_timeout()
            message, payload = await head
        except BaseException:
            pool.leave(tenant)
            conn.close()
            raise
        return OriginResponse(message.code, message.headers, payload, conn, pool, tenant)

    def _idle_now(self, endpoint: _Endpoint) -> OriginConnection | None:
        """`_take` where it waits for nothing: an idle connection of the
        endpoint's pool, unless calls wait for one (they go first); None
        when there is none to take now (await `_take` then)."""
        if self._closed:
            raise aiohttp.ClientConnectionError("the origin wire is closed")
        pool = endpoint.pool
        return None if pool.waiters else _pop_idle(pool)

    async def _take(self, endpoint: _Endpoint) -> OriginConnection:
        """Once `_idle_now` has taken no idle connection (nothing changed
        since: no wait between): a new one while the endpoint's pool is under
        its cap; past it, the first one freed, in turn, if one is within the
        queue timeout (else OriginFull)."""
        pool = endpoint.pool
        if not pool.waiters and pool.open < self._limit:  # else they go first
            return await self._open(pool, endpoint)
        first = False  # a call that waited already and must wait again keeps its turn
        loop = asyncio.get_running_loop()
        # One bound for the whole wait, however often the call waits again.
        until = None if self._queue_timeout is None else loop.time() + self._queue_timeout
        while True:
            waiter: asyncio.Future[OriginConnection | None] = loop.create_future()
            if first:
                pool.waiters.appendleft(waiter)
            else:
                pool.waiters.append(waiter)
            bound = asyncio.timeout_at(until)
            try:
                async with bound:
                    handed = await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():  # handed over, then cancelled
                    self._pass_on(pool, waiter.result())
                else:
                    with contextlib.suppress(ValueError):
                        pool.waiters.remove(waiter)
                    self._serve(pool)  # what it kept others from is theirs now
                if isinstance(exc, TimeoutError) and bound.expired():
                    raise OriginFull(
                        endpoint.host,
                        "queue",
                        f"no connection to it came free within {self._queue_timeout:g} s "
                        f"(all {self._limit} in use; --origin-queue-timeout)",
                    ) from None
                raise
            first = True
            if pool.closed:  # the wire closed meanwhile
                if handed is not None:
                    handed.close()
                raise aiohttp.ClientConnectionError("the origin wire is closed")
            if handed is not None:
                if handed.is_idle():
                    return handed
                handed.close()  # lost since: its place comes free with it
            # Its turn: a connection freed between its waking and its running
            # went idle (no call was waiting), and is this call's before a new
            # one. Else, at the cap, it would wait again beside it, and calls
            # arriving after it would queue behind it (_idle_now). The place
            # it was handed, if any, stays free for the next call to open.
            conn = _pop_idle(pool)
            if conn is not None:
                return conn
            if handed is None and pool.open < self._limit:
                return await self._open(pool, endpoint)

    @staticmethod
    def _pass_on(pool: _Pool, handed: OriginConnection | None) -> None:
        if handed is not None:
            handed.rest()
        else:
            pool.hand(None)

    def _serve(self, pool: _Pool) -> None:
        """Hand what is free (idle connections, places under the cap) to the
        calls waiting: new calls queue behind any call waiting, so once one
        leaves, the ones behind it may be owed what is free."""
        idle = pool.idle
        while pool.waiters and idle:
            conn, _ = idle.popitem()
            if not conn.is_idle():
                conn.close()
            elif not pool.hand(conn):
                idle[conn] = None
        if pool.waiters and pool.open < self._limit:
            pool.hand(None)

    async def _open(self, pool: _Pool, endpoint: _Endpoint) -> OriginConnection:
        """A new connection of `pool` (counted in it while it opens)."""
        pool.open += 1
        try:
            conn = cast(OriginConnection, await self._connect(endpoint))
        except BaseException as exc:
            pool.open -= 1
            pool.hand(None)
            if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ClientError):
                # The connector's bare one, as a ClientSession would raise it:
                # the caller tells an origin not reached from one slow to answer.
                raise aiohttp.ConnectionTimeoutError(
                    f"no connection to {endpoint.host} within {self._timeout.sock_connect} s"
                ) from exc
            raise
        if conn.transport is None:  # lost before it could be counted
            pool.open -= 1
            pool.hand(None)
            raise aiohttp.ServerDisconnectedError()
        conn.pool = pool
        self._sweep_later()
        return conn

    async def _connect(self, endpoint: _Endpoint) -> ResponseHandler:
        connector = self._connector
        if connector is None:
            connector = self._connector = _opener(self._ttl_dns_cache)
        return await connector._create_connection(endpoint.key, [], self._timeout)

    def _sweep_later(self) -> None:
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self._keepalive / 2, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for keepalive_timeout; look again in half
        of it while any connection is open."""
        self._sweeper = None
        if not self._pools:
            return
        now = asyncio.get_running_loop().time()
        stale = now - self._keepalive
        busy = False
        for pool in self._pools.values():
            for conn in list(pool.idle):  # oldest first
                if conn.idle_since > stale:
                    break
                conn.close()
            busy = busy or pool.open > 0
        if busy:
            self._sweep_later()

    async def close(self) -> None:
        """Close every idle or lingering connection and the opener; calls still under way
        keep theirs until they end it, which closes it, and calls waiting
        for a connection, or made from now on, fail (ClientConnectionError)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in self._pools.values():
            pool.closed = True
            for conn in [*pool.idle, *pool.lingering]:
                conn.close()
            while pool.waiters:  # each fails, seeing the wire closed
                pool.hand(None)
        connector, self._connector = self._connector, None
        if connector is not None:
            await connector.close()
