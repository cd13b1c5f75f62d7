"""Request content codings (dataplane.http.body) and the connection caps and
parser-error mapping of the HTTP edge (dataplane.http.edge), without a server."""

from __future__ import annotations

import gzip
import hashlib
import inspect
import logging
import re
import zlib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web, web_protocol
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, BadStatusLine, LineTooLong
from aiohttp.http_parser import HttpResponseParser
from aiohttp.test_utils import make_mocked_request

from dataplane.http import edge
from dataplane.http.body import MAX_CODINGS, MAX_GZIP_MEMBERS, decode_body
from dataplane.http.edge import (
    ConnectionCaps,
    EdgeLimits,
    EdgeProtocol,
    EdgeRunner,
    HeadTooLarge,
    WholeAnswer,
    _has_prepare_hooks,
    default_max_connections,
    descriptors_short,
    parser_error,
)
from dataplane.http.errors import ApiError
from dataplane.settings import parse
from ponto.peers import client_of

DOC = b'{"model": "m", "messages": []}'


def gz(data: bytes) -> bytes:
    """gzip with a fixed time in its header: the bodies are parameters, so in the
    tests' ids, which must be the same in each pytest-xdist worker."""
    return gzip.compress(data, mtime=0)


# ---------------------------------------------------------------- codings


@pytest.mark.parametrize("encoding", [None, "", "identity", "IDENTITY", " identity "])
def test_identity_is_the_body_as_sent(encoding: str | None) -> None:
    assert decode_body(DOC, encoding, 1024) == DOC


@pytest.mark.parametrize(
    ("encoding", "data"),
    [
        ("gzip", gz(DOC)),
        ("x-gzip", gz(DOC)),
        ("deflate", zlib.compress(DOC)),
        ("deflate", zlib.compress(DOC, wbits=-15)),  # raw deflate, as some clients send
        ("gzip", gz(DOC[:10]) + gz(DOC[10:])),  # two members
        ("identity, gzip", gz(DOC)),
        ("gzip, gzip", gz(gz(DOC))),
    ],
)
def test_gzip_and_deflate_are_decoded(encoding: str, data: bytes) -> None:
    assert decode_body(data, encoding, 1024) == DOC


@pytest.mark.parametrize(
    "encoding",
    ["br", "zstd", "compress", "gzip, br", "x-custom", ", ".join(["gzip"] * (MAX_CODINGS + 1))],
)
def test_other_codings_are_415(encoding: str) -> None:
    with pytest.raises(ApiError) as caught:
        decode_body(DOC, encoding, 1024)
    assert (caught.value.status, caught.value.code) == (415, "unsupported_content_encoding")


@pytest.mark.parametrize(
    ("encoding", "data"),
    [
        ("gzip", DOC),
        ("gzip", gz(DOC)[:-4]),  # truncated
        ("gzip", gz(DOC) + b"junk"),
        ("deflate", zlib.compress(DOC)[:-3]),
        ("deflate", zlib.compress(DOC) + b"junk"),
        ("deflate", b"\x00\x01\x02"),
    ],
)
def test_a_body_that_is_not_its_coding_is_400(encoding: str, data: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        decode_body(data, encoding, 1024)
    assert (caught.value.status, caught.value.code) == (400, "invalid_content_encoding")


@pytest.mark.parametrize(
    "data",
    [
        gz(b"a" * 1025),
        gz(b"\0" * 50_000_000),  # a bomb: 50 MB in about 50 KB
        gz(b"a" * 600) + gz(b"a" * 600),  # members add up
    ],
)
def test_decoding_stops_at_the_limit(data: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        decode_body(data, "gzip", 1024)
    assert (caught.value.status, caught.value.code) == (413, "body_too_large")


def test_gzip_members_are_bounded() -> None:
    """A body of many (empty) members is refused, not decoded member by member
    at a cost quadratic in its size."""
    members = [gz(DOC[i : i + 1]) for i in range(MAX_GZIP_MEMBERS)]
    assert decode_body(b"".join(members), "gzip", 1024) == DOC[:MAX_GZIP_MEMBERS]
    for data in (
        b"".join(members) + gz(b""),
        gz(b"") * 400_000,  # 8 MB, the default body limit
    ):
        with pytest.raises(ApiError) as caught:
            decode_body(data, "gzip", 1024)
        assert (caught.value.status, caught.value.code) == (400, "invalid_content_encoding")


def test_a_body_of_exactly_the_limit_passes() -> None:
    assert decode_body(gz(b"a" * 1024), "gzip", 1024) == b"a" * 1024


# ---------------------------------------------------------------- caps


class Conn:
    """Stands in for an EdgeProtocol: ConnectionCaps calls only `evict`."""

    def __init__(self, caps: ConnectionCaps, address: str) -> None:
        self.caps = caps
        self.address = address
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True
        self.caps.release(self, self.address)  # type: ignore[arg-type]


def connect(caps: ConnectionCaps, address: str, *, waiting: bool) -> Conn | None:
    conn = Conn(caps, address)
    if not caps.admit(conn, address):  # type: ignore[arg-type]
        return None
    if waiting:
        caps.waiting(conn, address)  # type: ignore[arg-type]
    return conn


def test_at_the_cap_the_oldest_waiting_connection_is_evicted() -> None:
    caps = ConnectionCaps(total=3, per_client=3)
    a, b, c = (connect(caps, "1.1.1.1", waiting=True) for _ in range(3))
    assert a and b and c
    caps.busy(a, "1.1.1.1")  # type: ignore[arg-type]  # a request arrived on a
    d = connect(caps, "2.2.2.2", waiting=False)
    assert d is not None
    assert (a.evicted, b.evicted, c.evicted) == (False, True, False)
    assert caps.open == 3


def test_at_the_cap_with_every_connection_busy_a_new_one_is_refused() -> None:
    caps = ConnectionCaps(total=2, per_client=2)
    busy = [connect(caps, "1.1.1.1", waiting=False) for _ in range(2)]
    assert all(busy)
    assert connect(caps, "2.2.2.2", waiting=False) is None
    assert caps.open == 2
    assert busy[0] is not None
    caps.release(busy[0], "1.1.1.1")  # type: ignore[arg-type]
    assert connect(caps, "2.2.2.2", waiting=False) is not None


def test_the_per_address_cap_evicts_only_that_address() -> None:
    caps = ConnectionCaps(total=10, per_client=2)
    other = connect(caps, "9.9.9.9", waiting=True)
    mine = [connect(caps, "1.1.1.1", waiting=True) for _ in range(2)]
    assert other and all(mine)
    assert connect(caps, "1.1.1.1", waiting=False) is not None
    assert not other.evicted
    assert [m.evicted for m in mine if m] == [True, False]
    # Both of this address's connections now busy: the next one is refused.
    assert mine[1] is not None
    caps.busy(mine[1], "1.1.1.1")  # type: ignore[arg-type]
    assert connect(caps, "1.1.1.1", waiting=False) is None
    assert connect(caps, "2.2.2.2", waiting=False) is not None


@pytest.mark.parametrize(
    ("peer", "client"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("::ffff:10.1.2.3", "10.1.2.3"),  # an IPv4 client of a dual-stack "::" socket
        ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "2001:db8:1:2::/64"),
        ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::1", "::/64"),
        ("unix", "unix"),
        # Review 323: IPv4 clients through a NAT46/SIIT gateway (RFC 7755) are
        # each an address of 64:ff9b::/96, all of one /64: one IPv4 client
        # held the cap of every other and closed their idle connections.
        ("64:ff9b::c000:207", "192.0.2.7"),
        ("64:ff9b::c000:208", "192.0.2.8"),
        # A local-use prefix (RFC 8215) may be any length from /48 to /96, so
        # where its IPv4 address lies is not known: each address its own.
        ("64:ff9b:1:abcd::c000:207", "64:ff9b:1:abcd::c000:207"),
        ("64:ff9b:1:abcd::c000:208", "64:ff9b:1:abcd::c000:208"),
    ],
)
def test_a_client_is_its_ipv4_address_or_its_ipv6_64(peer: str, client: str) -> None:
    assert client_of(peer) == client


def test_the_default_cap_leaves_headroom_under_the_descriptor_limit() -> None:
    for nofile in (1024, 20_000, 1 << 20):
        cap = default_max_connections(nofile)
        assert cap > 0 and 2 * cap < nofile
    assert default_max_connections(100) == 64  # a floor, whatever the limit


class FakeLimits:
    """resource's RLIMIT_NOFILE calls, over a soft and a hard limit of its own."""

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.soft, self.hard

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        assert which == self.RLIMIT_NOFILE and limits[1] == self.hard
        self.soft = limits[0]


@pytest.mark.parametrize("max_connections", [0, 2000])
async def test_the_soft_descriptor_limit_is_raised_whether_or_not_the_cap_is_given(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, max_connections: int
) -> None:
    # Trial 74: under `prlimit --nofile=1024:20000`, --max-connections 2000
    # left the soft limit at 1024, and clients past ~500 streams got resets.
    limits = FakeLimits(1024, 20_000)
    monkeypatch.setattr(edge, "resource", limits)
    runner = EdgeRunner(web.Application(), EdgeLimits(max_connections=max_connections))
    with caplog.at_level(logging.WARNING, logger=edge.__name__):
        await runner.setup()
    try:
        assert limits.soft == 20_000
        assert runner.caps is not None
        assert runner.caps.total == (max_connections or default_max_connections(20_000))
        assert not caplog.records  # 20,000 descriptors hold 2,000 streams
    finally:
        await runner.cleanup()


async def test_a_cap_the_descriptor_limit_cannot_hold_is_warned_about_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(edge, "resource", FakeLimits(1024, 1024))
    runner = EdgeRunner(web.Application(), EdgeLimits(max_connections=2000))
    with caplog.at_level(logging.WARNING, logger=edge.__name__):
        await runner.setup()
    await runner.cleanup()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "--max-connections 2000" in record.getMessage()
    assert f"lower --max-connections to {default_max_connections(1024)}" in record.getMessage()
    assert "the limit is 1024" in record.getMessage()


async def test_a_cap_sized_from_a_tiny_limit_is_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Review 308: the floor of 64 under a limit of 300 told the operator to
    # lower a --max-connections never given.
    monkeypatch.setattr(edge, "resource", FakeLimits(300, 300))
    runner = EdgeRunner(web.Application(), EdgeLimits())
    with caplog.at_level(logging.WARNING, logger=edge.__name__):
        await runner.setup()
    await runner.cleanup()
    assert runner.caps is not None and runner.caps.total == 64
    assert not caplog.records


def test_descriptors_short_counts_an_origin_connection_per_client_connection() -> None:
    assert descriptors_short(default_max_connections(20_000), 20_000) == ""
    assert descriptors_short(1000, 2 * 1000 + 256) == ""
    assert descriptors_short(1000, 2 * 1000 + 255) != ""


# ---------------------------------------------------------------- parser errors


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (LineTooLong(b"aaa", 8190), 431, "request_header_fields_too_large"),
        (BadHttpMessage("Too many headers received"), 431, "request_header_fields_too_large"),
        (HeadTooLarge("head"), 431, "request_header_fields_too_large"),
        (BadStatusLine("\x16\x03\x01"), 400, "invalid_http_request"),
        (BadHttpMethod("G\x00T"), 400, "invalid_http_request"),
        (BadHttpMessage("Invalid header value char"), 400, "invalid_http_request"),
    ],
)
def test_parser_errors_get_fixed_messages(exc: BadHttpMessage, status: int, code: str) -> None:
    error = parser_error(exc)
    assert (error.status, error.code) == (status, code)
    assert "aaa" not in error.message and "\x16" not in error.message


def test_the_protocol_relies_on_aiohttp_internals_that_exist() -> None:
    # EdgeProtocol reads these (see its docstring); an aiohttp upgrade that
    # renames one must fail here, not in production.
    slots = {s for cls in EdgeProtocol.__mro__ for s in getattr(cls, "__slots__", ())}
    used = {"_messages", "_request_count", "_request_in_progress", "_waiter", "_manager"}
    assert used | {"_close", "_force_close", "_paused"} <= slots
    # The send timeout wraps the base protocol's wait for a drain.
    assert callable(web_protocol.RequestHandler._drain_helper)
    assert web_protocol._ErrInfo(status=400, exc=BadHttpMessage("x"), message="x").status == 400
    # EdgeProtocol.start is aiohttp 3.14's loop without the task per request:
    # what it reads of the protocol, and the module names it uses.
    loop_state = {
        "_parser", "_buffer_paused", "_msg_queue_resume_size", "_keepalive_timeout",
        "_keepalive_handle", "_next_keepalive_close_time", "_lingering_time", "_keepalive",
        "_request_factory", "_request_handler", "_task_handler", "_logging_enabled",
        "_current_request", "_handler_waiter",
    }  # fmt: skip
    assert loop_state <= slots
    for method in ("_make_error_handler", "_resume_reading_if_drained"):
        assert callable(getattr(web_protocol.RequestHandler, method)), method
    assert web_protocol.ERROR.method == "UNKNOWN"
    assert isinstance(web_protocol._PAYLOAD_ACCESS_ERROR, Exception)
    # The loop copied is aiohttp 3.14.5's: an aiohttp whose loop differs must
    # be compared with the copy before it is used.
    source = inspect.getsource(web_protocol.RequestHandler.start)
    assert hashlib.sha256(source.encode()).hexdigest() == START_SHA256, aiohttp.__version__
    # So is the request's handling around its handler (EdgeProtocol._handle).
    source = inspect.getsource(web_protocol.RequestHandler._handle_request)
    assert hashlib.sha256(source.encode()).hexdigest() == HANDLE_SHA256, aiohttp.__version__
    # So is its shutdown, which EdgeProtocol.shutdown copies but for the cancel.
    source = inspect.getsource(web_protocol.RequestHandler.shutdown)
    assert hashlib.sha256(source.encode()).hexdigest() == SHUTDOWN_SHA256, aiohttp.__version__


# sha256 of aiohttp 3.14.5's RequestHandler.start, which EdgeProtocol.start copies.
START_SHA256 = "2e565fd40c8e04fb3afb481d5ba52691a61d28396573b4b8a4cf3b168782288e"
# ... of its RequestHandler._handle_request (EdgeProtocol._handle).
HANDLE_SHA256 = "a88a34ee65a2714c6b392d23963ba9a80e7d50d4889905cd949a94d479102d8f"
# ... and of its RequestHandler.shutdown (EdgeProtocol.shutdown).
SHUTDOWN_SHA256 = "5eb4bd473db61e84c485dfec4b411c0fd40f0694920de2a955b5f46fde2438fa"


def test_no_request_state_lives_in_context_variables() -> None:
    # EdgeProtocol.start runs every request of a connection in one task, so in
    # one context: a context variable set for one request would be seen by the
    # next. Request state travels in the Exchange and explicit trace contexts.
    root = Path(__file__).resolve().parents[2] / "dataplane"
    setters = re.compile(
        r"ContextVar\(|contextvars|context\.attach\(|use_span\(|set_value\(|as_current_span"
    )
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if setters.search(line)
    ]
    assert found == []


def test_the_one_write_answer_and_the_lazy_timers_rely_on_aiohttp_internals_that_exist() -> None:
    # EdgeProtocol._fits and _put_whole (tests/functional/test_edge_answers.py checks
    # what it writes) read or override these.
    response = web.Response(body=b"x")
    for name in ("_body", "_headers", "_payload_writer", "_eof_sent", "_compression",
                 "_chunked", "_cookies", "_keep_alive", "_body_length"):  # fmt: skip
        assert hasattr(response, name), name
    request = make_mocked_request("POST", "/v1/chat/completions")
    for name in ("_finish", "_prepare_hook", "_read_bytes", "_match_info", "_payload_writer"):
        assert hasattr(request, name), name
    for name in ("_writelines", "_on_headers_sent", "_on_chunk_sent", "on_body_write", "drain"):
        assert hasattr(request._payload_writer, name), name
    # OriginWire opens connections with the connector's own method and factory,
    # and its OriginConnection reads the base protocol's flow-control state.
    connector = aiohttp.TCPConnector
    assert callable(connector._create_connection)
    assert "_factory" in inspect.getsource(connector.__init__)
    for name in ("_reading_paused", "_parser", "pause_reading", "resume_reading"):
        assert name in BaseProtocol.__slots__ or hasattr(BaseProtocol, name), name
    for name in ("feed_data", "feed_eof", "pause_reading"):
        assert hasattr(HttpResponseParser, name), name


async def test_the_fields_read_for_aiohttp_properties_are_what_the_properties_give() -> None:
    # The edge, the pipeline's sent_now and the error boundary read these
    # fields in place of aiohttp's properties (each a Python call on 3.11):
    # status and reason (the status line, the metrics' and access log's
    # status), keep_alive (whether the connection stays open), prepared (who
    # writes the answer, whether the boundary still sets its headers) and
    # the request's protocol. hasattr alone would pass an aiohttp whose
    # property came to compute something else; each getter must still be
    # the field, for the answers that reach the edge (web.Response, ours).
    getters = (
        (web.StreamResponse, "status", "return self._status"),
        (web.StreamResponse, "reason", "return self._reason"),
        (web.StreamResponse, "keep_alive", "return self._keep_alive"),
        (
            web.StreamResponse,
            "prepared",
            "return self._eof_sent or self._payload_writer is not None",
        ),
        (web.BaseRequest, "protocol", "return self._protocol"),
    )
    for owner, name, body in getters:
        prop = vars(owner)[name]
        assert isinstance(prop, property), name
        assert prop.fget is not None, name
        source = inspect.getsource(prop.fget).strip().splitlines()
        assert source[-1].strip() == body, (aiohttp.__version__, source)
    for cls in (web.Response, WholeAnswer, web.HTTPException):
        for name in ("status", "reason", "keep_alive", "prepared"):
            assert inspect.getattr_static(cls, name) is vars(web.StreamResponse)[name], (cls, name)
    assert inspect.getattr_static(web.Request, "protocol") is vars(web.BaseRequest)["protocol"]
    # And as they behave: set, forced, prepared.
    response = web.Response(body=b"x")
    response.set_status(418, "Short and stout")
    assert (response._status, response._reason) == (418, "Short and stout")
    assert (response.status, response.reason) == (418, "Short and stout")
    assert (response._keep_alive, response.keep_alive) == (None, None)
    response.force_close()
    assert (response._keep_alive, response.keep_alive) == (False, False)
    request = make_mocked_request("GET", "/")
    assert request._protocol is request.protocol
    assert (response._payload_writer, response._eof_sent, response.prepared) == (None, False, False)
    await response.prepare(request)
    w = request._payload_writer
    assert (response._payload_writer, response._eof_sent, response.prepared) == (w, False, True)


def test_the_request_fields_read_for_aiohttp_reified_properties_are_what_they_give() -> None:
    # FixedRoutes, the error boundary, the edge and the pipeline read these
    # fields in place of aiohttp's reified request properties (each a Python
    # call on its first read): method, rel_url, headers, version, content,
    # keep_alive, match_info. The getter's source, then the values.
    getters = {
        "method": "return self._method",
        "rel_url": "return self._rel_url",
        "headers": "return self._headers",
        "version": "return self._version",
        "content": "return self._payload",
        "keep_alive": "return not self._message.should_close",
        "match_info": "return match_info",  # self._match_info, asserted set
    }
    for name, body in getters.items():
        getter = inspect.getattr_static(web.Request, name).wrapped
        source = inspect.getsource(getter).strip().splitlines()
        assert source[-1].strip() == body, (aiohttp.__version__, name, source)
    assert "match_info = self._match_info" in inspect.getsource(
        inspect.getattr_static(web.Request, "match_info").wrapped
    )
    for closing in (False, True):
        request = make_mocked_request(
            "POST", "/v1/chat/completions?x=1", {"X-A": "b"}, closing=closing
        )
        assert (request._method, request._rel_url, request._version) == (
            request.method, request.rel_url, request.version,
        )  # fmt: skip
        assert request._headers is request.headers and request._payload is request.content
        assert request._rel_url.raw_path == "/v1/chat/completions"
        assert (not request._message.should_close, request.keep_alive) == (not closing,) * 2
        assert request._match_info is request.match_info


# ---------------------------------------------------------------- flags


def test_edge_flags_are_parsed_and_checked() -> None:
    s = parse(
        [
            "--region=r",
            "--header-timeout=2",
            "--body-timeout=3",
            "--keepalive-timeout=4",
            "--send-timeout=5",
            "--max-connections=100",
            "--max-connections-per-client=10",
        ]
    )
    e = s.edge
    assert (e.header_timeout, e.body_timeout, e.keepalive_timeout, e.send_timeout) == (2, 3, 4, 5)
    assert (e.max_connections, e.max_connections_per_client) == (100, 10)
    for bad in (
        ["--header-timeout=0"],
        ["--body-timeout=-1"],
        ["--send-timeout=0"],
        ["--max-connections=-1"],
        ["--max-connections=5", "--max-connections-per-client=6"],
    ):
        with pytest.raises(SystemExit) as exit_:
            parse(["--region=r", *bad])
        assert exit_.value.code == 2


async def _hook(request: web.Request, response: web.StreamResponse) -> None:
    pass


def test_prepare_hooks_are_found_in_the_app_and_every_application_under_it() -> None:
    # EdgeProtocol writes whole answers itself only when no application has
    # on_response_prepare hooks: a hook anywhere must be found.
    def tree(where: str) -> web.Application:
        root, sub, deeper, domain = (web.Application() for _ in range(4))
        hooked = {"root": root, "sub": sub, "deeper": deeper, "domain": domain}.get(where)
        if hooked is not None:  # before it is added: a sub-application is frozen then
            hooked.on_response_prepare.append(_hook)
        sub.add_subapp("/deeper", deeper)
        root.add_subapp("/sub", sub)
        root.add_domain("example.com", domain)
        return root

    assert not _has_prepare_hooks(tree("nowhere"))
    for where in ("root", "sub", "deeper", "domain"):
        assert _has_prepare_hooks(tree(where)), where
