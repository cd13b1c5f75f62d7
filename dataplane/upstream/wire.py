"""One origin call on aiohttp's lower layers: its connection pool and its response parser.

`aiohttp.ClientSession.post` builds, per request, a `ClientRequest` (URL
checks, auto headers, cookie jar, payload registry, a writer task for the
body) and a `ClientResponse` (timers, trace hooks, cookies): a third of the
proxy's CPU per request went there, for a call whose shape never changes (a
POST of bytes already in memory to an origin of the route table). `OriginWire`
keeps what matters and nothing else:

- the connector (`aiohttp.TCPConnector`: keep-alive pool, per-host limit, DNS
  cache, TLS) hands out connections, keyed by a `ClientRequest` built once per
  origin URL and reused for every call to it;
- the request head is aiohttp's own serialisation (`_serialize_headers`, which
  refuses CR and LF in names and values), written with the body in one
  `writelines`;
- the connection's protocol (`aiohttp.client_proto.ResponseHandler`) parses
  the answer with aiohttp's C parser (llhttp), decompresses it, reads a body
  that ends with the connection to its end, and enforces the read timeout, as
  under a ClientSession. Unlike one, it follows no redirect: an origin's 3xx is
  its answer (the Forwarder refuses it as a misconfigured base URL).

Errors are aiohttp's: `aiohttp.ClientError` subclasses for connection and
protocol failures, `TimeoutError` subclasses for the connect and read
timeouts; and ValueError for a URL that is not http(s) or a header with CR,
LF or NUL, which the route table's checks (dataplane.routes, the control
plane) and aiohttp's request parser keep from getting here. The connect
timeout bounds the socket's connect, not a wait for a free connection of an
origin at the connector's per-host limit, as under the ClientSession before.
A call cancelled or failed before it returns closes its connection (an origin
generating for nobody stops).

The body is written whole, not streamed under flow control: it is already in
memory, bounded by the proxy's --max-body-bytes. A connection whose request
has not all left the proxy when the answer is done (an origin that answered
early, a 413 say) is closed, not pooled: the next request would wait behind
the rest of this one's body.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any, Final, cast

import aiohttp
from aiohttp import hdrs
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.helpers import DEFAULT_CHUNK_SIZE, BaseTimerContext
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_writer import _serialize_headers
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from dataplane.timer import LazyTimer

__all__ = ["OriginProtocol", "OriginResponse", "OriginWire", "media_type", "origin_connector"]

# What a ClientSession adds to every request unless the caller set it: the
# origins saw these before this module existed, and gzip answers stay cheap to
# accept (the parser decompresses them).
DEFAULT_HEADERS: Final = (
    (hdrs.ACCEPT, "*/*"),
    (hdrs.ACCEPT_ENCODING, "gzip, deflate"),
    (hdrs.USER_AGENT, SERVER_SOFTWARE),
)
# Origin URLs remembered (each with its ClientRequest); a table names a few.
MAX_ENDPOINTS: Final = 4096
READ_BUFSIZE: Final = 2**16
MAX_LINE: Final = 8190
MAX_HEADERS: Final = 128


class OriginProtocol(ResponseHandler):
    """aiohttp's client protocol, with its read timeout on a LazyTimer.

    aiohttp restarts its timer on every read and cancels it at the answer's
    end: two timers started and two cancelled per call (dataplane.timer says
    what that costs). The timeout itself is aiohttp's: `read_timeout` seconds
    without a byte of the answer fail the read with its SocketTimeoutError.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.read_deadline = LazyTimer(loop)
        # The parameters of the parser to keep for the next call; None: make a new one.
        self._parser_params: tuple[object, ...] | None = None
        self._previous: StreamReader | None = None  # the last call's answer body
        self._answered = False  # this call's answer has arrived whole

    def set_response_params(
        self,
        *,
        timer: BaseTimerContext | None = None,
        skip_payload: bool = False,
        read_until_eof: bool = False,
        auto_decompress: bool = True,
        read_timeout: float | None = None,
        read_bufsize: int = DEFAULT_CHUNK_SIZE,
        timeout_ceil_threshold: float = 5,
        max_line_size: int = 8190,
        max_field_size: int = 8190,
        max_headers: int = 128,
    ) -> None:
        """aiohttp's, but a kept-alive connection keeps its response parser when
        the parser's parameters have not changed: aiohttp makes a new C parser
        per call (some 5 us), and llhttp parses a connection's answers one after
        another as it does pipelined ones.

        A new one is made, as aiohttp would, after the parser was paused (a
        flood of chunks can leave it paused past its answer's end) and after
        bytes arrived that no call asked for. One case differs: such bytes in
        the same read as the end of an answer stay in the parser as the start
        of the next answer, so the next call on that connection fails to parse
        (and is tried on the next origin, which generates it again), where a
        new parser would have dropped them. Only an origin that breaks HTTP/1.1
        sends them."""
        self._previous, self._answered = self._payload, False
        params = (skip_payload, read_until_eof, auto_decompress, read_bufsize,
                  max_line_size, max_field_size, max_headers)  # fmt: skip
        if timer is not None or self._parser is None or params != self._parser_params:
            self._parser_params = params if timer is None else None
            super().set_response_params(
                timer=timer,
                skip_payload=skip_payload,
                read_until_eof=read_until_eof,
                auto_decompress=auto_decompress,
                read_timeout=read_timeout,
                read_bufsize=read_bufsize,
                timeout_ceil_threshold=timeout_ceil_threshold,
                max_line_size=max_line_size,
                max_field_size=max_field_size,
                max_headers=max_headers,
            )
            return
        self._skip_payload = skip_payload
        self._read_bufsize = read_bufsize
        self._read_timeout = read_timeout
        self._timeout_ceil_threshold = timeout_ceil_threshold
        self._drain_tail()

    def data_received(self, data: bytes) -> None:
        if data and self._answered:
            self._parser_params = None  # bytes after a whole answer: not a parser to keep
        super().data_received(data)
        payload = self._payload
        if payload is not None and payload is not self._previous and payload.is_eof():
            self._answered = True

    def pause_reading(self) -> None:
        self._parser_params = None  # llhttp may stay paused past the answer's end
        super().pause_reading()

    def _reschedule_timeout(self) -> None:
        timeout = self._read_timeout
        if timeout:
            self.read_deadline.arm(timeout, self._on_read_timeout)
        else:
            self.read_deadline.disarm()

    def _drop_timeout(self) -> None:
        self.read_deadline.disarm()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.read_deadline.close()
        super().connection_lost(exc)


def origin_connector(**kwargs: Any) -> aiohttp.TCPConnector:
    """`aiohttp.TCPConnector(**kwargs)` whose connections speak OriginProtocol.
    Call it on the event loop that will use it."""
    connector = aiohttp.TCPConnector(**kwargs)
    # aiohttp's connectors make their protocols with this factory, and take no argument for it.
    factory = functools.partial(OriginProtocol, loop=asyncio.get_running_loop())
    connector._factory = cast("functools.partial[ResponseHandler]", factory)
    return connector


class _Endpoint:
    """An origin URL as the wire calls it: the connector's key and the request
    line and Host header, built once."""

    __slots__ = ("authorization", "host", "key", "line")

    def __init__(self, url: URL, loop: asyncio.AbstractEventLoop) -> None:
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ValueError(f"not an origin URL: {url}")
        # Only the connector reads it: the key of its pool, and what it needs
        # to open (and for https, verify) a new connection.
        self.key = ClientRequest("POST", url, loop=loop)
        self.line = f"POST {url.raw_path_qs} HTTP/1.1"
        default_port = url.is_default_port()
        self.host = url.raw_host if default_port else f"{url.raw_host}:{url.port}"
        if ":" in url.raw_host and not url.raw_host.startswith("["):
            self.host = f"[{url.raw_host}]" + ("" if default_port else f":{url.port}")
        # Credentials written into the URL are sent as basic auth, as a
        # ClientSession sends them, unless the call carries its own.
        self.authorization = (
            aiohttp.encode_basic_auth(url.user or "", url.password or "")
            if url.user is not None or url.password is not None
            else None
        )


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

    __slots__ = ("_conn", "content", "headers", "status")

    def __init__(
        self,
        status: int,
        headers: CIMultiDictProxy[str],
        content: StreamReader,
        conn: Connection,
    ) -> None:
        self.status = status
        self.headers = headers
        self.content = content
        self._conn: Connection | None = conn

    @property
    def content_type(self) -> str:
        """The media type, lower case, without parameters ("" when absent)."""
        return media_type(self.headers)

    async def read(self) -> bytes:
        """The whole body; then the connection is released."""
        content = self.content
        try:
            # Usually the whole body came with the head: taken as it is, without
            # read()'s loop of readany() calls.
            body = content.read_nowait() if content.is_eof() else await content.read()
        except BaseException:
            self.close()
            raise
        self.release()
        return body

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        transport = conn.transport
        if transport is not None and transport.get_write_buffer_size():
            conn.close()  # the request is still going out: not reusable
        else:
            conn.release()  # pooled only when the body ended and keep-alive holds

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class OriginWire:
    """POSTs to origins over `connector`'s pool. One per app; safe for
    concurrent use on its event loop."""

    def __init__(
        self,
        connector: aiohttp.BaseConnector,
        *,
        connect_timeout: float | None,
        read_timeout: float | None,
    ) -> None:
        self._connector = connector
        self._timeout = aiohttp.ClientTimeout(
            # The socket's connect only: a call that waits for a free connection
            # of a busy origin (at the connector's per-host limit) waits in its
            # turn, under the request's deadline; timing it out would count a
            # saturated origin as failing and eject it.
            total=None,
            sock_connect=connect_timeout,
        )
        self._read_timeout = read_timeout
        self._endpoints: dict[URL, _Endpoint] = {}

    def _endpoint(self, url: URL) -> _Endpoint:
        found = self._endpoints.get(url)
        if found is None:
            if len(self._endpoints) >= MAX_ENDPOINTS:
                self._endpoints.clear()  # tables changed many times: start over
            found = self._endpoints[url] = _Endpoint(url, asyncio.get_running_loop())
        return found

    async def post(self, url: URL, body: bytes, headers: CIMultiDict[str]) -> OriginResponse:
        """Send `body` to `url` with `headers`, to which Host, Content-Length
        and the DEFAULT_HEADERS it lacks are added (set again on every call, so
        one dict serves a request's attempts on several origins); return once
        the answer's head has arrived."""
        endpoint = self._endpoint(url)
        conn = await self._connector.connect(endpoint.key, [], self._timeout)
        try:
            protocol = conn.protocol
            transport = conn.transport
            if protocol is None or transport is None:
                raise aiohttp.ServerDisconnectedError()
            protocol.set_response_params(
                read_until_eof=True,  # a body without a length ends with the connection
                read_timeout=self._read_timeout,
                read_bufsize=READ_BUFSIZE,
                max_line_size=MAX_LINE,
                max_field_size=MAX_LINE,
                max_headers=MAX_HEADERS,
            )
            if endpoint.authorization is not None and hdrs.AUTHORIZATION not in headers:
                # This origin's own: not left in a dict the next attempt reuses.
                headers = headers.copy()
                headers[hdrs.AUTHORIZATION] = endpoint.authorization
            headers[hdrs.HOST] = endpoint.host
            headers[hdrs.CONTENT_LENGTH] = str(len(body))
            for name, value in DEFAULT_HEADERS:
                headers.setdefault(name, value)
            transport.writelines((_serialize_headers(endpoint.line, headers), body))
            # The read timeout runs from here: the request handed to the socket
            # (a large body may still be leaving; aiohttp's session started it
            # once the body was written).
            protocol.start_timeout()
            return await _head(protocol, conn)
        except BaseException:
            conn.close()
            raise


async def _head(protocol: ResponseHandler, conn: Connection) -> OriginResponse:
    """The first final answer's head (1xx interim answers skipped)."""
    while True:
        try:
            message, payload = await protocol.read()
        except HttpProcessingError as exc:
            raise aiohttp.ClientPayloadError(f"unparsable answer: {exc.message}") from exc
        code = message.code
        if not 100 <= code < 200 or code == 101:
            return OriginResponse(code, message.headers, payload, conn)
        # The protocol stopped the read timeout at this interim head (its body
        # is empty); the final head is still awaited, so time it again, unless
        # it is already queued (a timer armed then would outlive the answer).
        if not len(protocol) and protocol.exception() is None:
            protocol.start_timeout()
