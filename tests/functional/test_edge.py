"""The HTTP edge (dataplane.http.edge): deadlines, connection caps, parser
refusals and request content codings, against the real proxy app served by
EdgeRunner on loopback, driven with raw sockets.

Deadlines are set short (fractions of a second) so no test sleeps long; waits
are bounded by generous timeouts, never asserted on. Every refusal is checked
to have reached no origin (the simulator's request counter).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.test_utils import TestServer

from dataplane.http.dispatch import FixedRoutes
from dataplane.http.edge import MAX_HEAD, EdgeRunner, parser_error
from dataplane.http.pipeline import ENDPOINTS
from dataplane.http.state import ACCESS_LOG, HOLDER, METRICS
from dataplane.run import serve_metrics
from dataplane.settings import Settings
from dataplane.settings import parse as parse_proxy
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.originsim.app import build_app as sim_app
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import KEY, MODEL

REFUSALS = "ponto.refusals"
CHAT = b"/v1/chat/completions"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()


@dataclass
class Edge:
    host: str
    port: int
    runner: EdgeRunner
    origin: TestServer

    def origin_requests(self) -> int:
        return int(self.origin.app[SIM_STATE].stats.requests)

    async def connect(self, source: str | None = None) -> tuple[Any, Any]:
        return await asyncio.open_connection(
            self.host, self.port, local_addr=(source, 0) if source else None
        )

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"


Start = Callable[..., Awaitable[Edge]]


@pytest.fixture
async def start_edge(tmp_path: Path) -> AsyncIterator[Start]:
    started: list[Edge] = []

    async def start(*flags: str) -> Edge:
        origin = TestServer(sim_app(SimConfig(name="o1", answer_tokens=3, seed=1)))
        await origin.start_server()
        served = await serve_on_edge(
            tmp_path, str(origin.make_url("/v1")), "--max-body-bytes=65536", *flags
        )
        edge = Edge("127.0.0.1", served.port, served.runner, origin)
        started.append(edge)
        return edge

    yield start
    for edge in started:
        await edge.runner.cleanup()
        await edge.origin.close()


def head(path: bytes = CHAT, *extra: bytes, length: int | None = len(BODY)) -> bytes:
    lines = [
        b"POST " + path + b" HTTP/1.1",
        b"Host: proxy",
        b"Authorization: Bearer " + KEY.key.encode(),
        b"Content-Type: application/json",
    ]
    if length is not None:
        lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join([*lines, *extra]) + b"\r\n\r\n"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    status_line: bytes = b""

    def error(self) -> dict[str, Any]:
        assert self.headers["content-type"].startswith("application/json")
        doc = json.loads(self.body)
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}
        return dict(doc["error"])


async def read_answer(reader: Any) -> Answer:
    """One HTTP/1.x answer with a Content-Length (all of the proxy's errors have one)."""
    status_line = await asyncio.wait_for(reader.readline(), 10)
    assert status_line.startswith(b"HTTP/1."), status_line
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Answer(int(status_line.split()[1]), headers, body, status_line)


async def answer_or_reset(reader: Any) -> Answer | None:
    """`read_answer`'s, or None when the proxy reset the connection first: it
    closed with bytes of the client's unread (a client still sending a body
    the proxy refused to read), and the reset may overtake its answer."""
    try:
        return await read_answer(reader)
    except ConnectionResetError:
        return None


async def closed(reader: Any) -> bool:
    """True once the proxy has closed the connection (bounded wait)."""
    rest: bytes = await asyncio.wait_for(reader.read(), 10)
    return rest == b""


def _poller_eagain(record: logging.LogRecord) -> bool:
    """grpc's aio poller, left on the loop by another test of the process,
    may log a callback's EAGAIN under load: no record of the proxy's. Only
    that one (a late completion's RuntimeError is tests/loops.py's to name)."""
    error = record.exc_info[1] if record.exc_info else None
    return "PollerCompletionQueue" in record.getMessage() and isinstance(error, BlockingIOError)


def refusal_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and not _poller_eagain(r)]
    assert not errors, [(r.name, r.getMessage(), r.exc_info) for r in errors]
    records = [r for r in caplog.records if r.name == REFUSALS]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    return records


@pytest.fixture(autouse=True)
def _refusals_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=REFUSALS)


# ---------------------------------------------------------------- dispatch


async def test_the_proxys_fixed_routes_skip_the_router_and_answer_as_through_it(
    start_edge: Start,
) -> None:
    edge = await start_edge()
    server = edge.runner.server
    assert server is not None and isinstance(server.request_handler, FixedRoutes)
    assert len(server.request_handler) >= len(ENDPOINTS)  # every proxied endpoint
    reader, writer = await edge.connect()
    writer.write(head() + BODY)
    answer = await read_answer(reader)
    assert answer.status == 200 and answer.headers["x-request-id"]  # the boundary ran
    writer.write(head(b"/v1/nothing", length=0))  # not a fixed route: the router's 404
    missing = await read_answer(reader)
    assert missing.status == 404 and missing.error()["code"] == "not_found"
    writer.close()
    assert edge.origin_requests() == 1
    # Counted under their routes' names: a fixed route's as FixedRoutes read it.
    registry = edge.runner.app[METRICS].registry
    assert [
        registry.get_sample_value("ponto_requests_total", {"endpoint": name, "code": code})
        for name, code in (("chat.completions", "200"), ("other", "404"))
    ] == [1, 1]


# ---------------------------------------------------------------- deadlines


async def test_a_head_not_finished_by_the_deadline_is_closed(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await start_edge("--header-timeout=0.3")
    reader, writer = await edge.connect()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n")
    assert await closed(reader)
    writer.close()
    [record] = refusal_records(caplog)
    assert "header_timeout" in record.getMessage()
    assert edge.origin_requests() == 0


async def test_the_head_deadline_applies_to_each_request_on_a_kept_alive_connection(
    start_edge: Start,
) -> None:
    edge = await start_edge("--header-timeout=0.3", "--keepalive-timeout=30")
    reader, writer = await edge.connect()
    writer.write(head() + BODY)
    assert (await read_answer(reader)).status == 200
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")  # and no more
    assert await closed(reader)
    writer.close()
    assert edge.origin_requests() == 1


async def test_an_idle_kept_alive_connection_is_closed(start_edge: Start) -> None:
    edge = await start_edge("--keepalive-timeout=0.3")
    reader, writer = await edge.connect()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
    assert (await read_answer(reader)).status == 200
    assert await closed(reader)
    writer.close()


async def test_a_body_not_received_by_the_deadline_gets_a_408(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await start_edge("--body-timeout=0.3")
    reader, writer = await edge.connect()
    writer.write(head() + BODY[:10])
    answer = await read_answer(reader)
    assert answer.status == 408
    assert answer.error()["code"] == "body_timeout"
    assert answer.headers["x-request-id"]
    assert answer.headers["connection"] == "close"
    assert await closed(reader)
    writer.close()
    assert edge.origin_requests() == 0
    refusal_records(caplog)


# ---------------------------------------------------------------- parser errors


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (head(CHAT, b"X-Long: " + b"a" * 9000), 431, "request_header_fields_too_large"),
        (
            head(CHAT, *(b"X-H%d: v" % i for i in range(80))),
            431,
            "request_header_fields_too_large",
        ),
        (
            head(CHAT, *(b"X-H%d: " % i + b"v" * 8000 for i in range(5))),
            431,
            "request_header_fields_too_large",
        ),
        (
            b"POST /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: p\r\n\r\n",
            431,
            "request_header_fields_too_large",
        ),
        (head(CHAT, b"Content-Length: 7"), 400, "invalid_http_request"),  # two lengths
        (head(CHAT, b"Transfer-Encoding: chunked"), 400, "invalid_http_request"),
        (head(CHAT, b"X-Ctl: a\x01b"), 400, "invalid_http_request"),
        (head(CHAT, length=None)[:-2] + b"Content-Length: -5\r\n\r\n", 400, "invalid_http_request"),
        (b"P\x00ST / HTTP/1.1\r\n\r\n", 400, "invalid_http_request"),
        (b"POST / HTTP/9.9\r\nHost: p\r\n\r\n", 400, "invalid_http_request"),
        # Trial 28: taken by the parser, served, and the version repeated.
        (head(CHAT).replace(b"HTTP/1.1", b"HTTP/2.0") + BODY, 400, "http_version_not_supported"),
        (b"GET /v1/models HTTP/0.9\r\nHost: p\r\n\r\n", 400, "http_version_not_supported"),
        # HTTP/2 with prior knowledge (curl --http2-prior-knowledge): llhttp
        # stops at the preface, which read as a malformed request.
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, "http_version_not_supported"),
        # HTTP/1.0 has no chunked coding (RFC 9112 6.1: faulty framing, a
        # smuggling risk behind a proxy that reads it otherwise).
        (
            head(CHAT, b"Transfer-Encoding: chunked", length=None).replace(
                b"HTTP/1.1", b"HTTP/1.0", 1
            )
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
            400,
            "unsupported_transfer_encoding",
        ),
        # Trial 28: read as chunked alone, the gzip ignored.
        (
            head(CHAT, b"Transfer-Encoding: gzip, chunked", length=None)
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
            400,
            "unsupported_transfer_encoding",
        ),
    ],
    ids=[
        "long-header",
        "many-headers",
        "big-head",
        "long-request-line",
        "two-lengths",
        "length-and-chunked",
        "control-character",
        "negative-length",
        "bad-method",
        "bad-version",
        "http-2.0",
        "http-0.9",
        "h2-prior-knowledge",
        "http-1.0-chunked",
        "gzip-chunked",
    ],
)
async def test_a_message_the_parser_refuses_gets_a_json_error_logged_once(
    start_edge: Start,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    request_bytes: bytes,
    status: int,
    code: str,
) -> None:
    edge = await start_edge("--access-log=on")
    reader, writer = await edge.connect()
    writer.write(request_bytes)
    answer = await read_answer(reader)
    assert (answer.status, answer.error()["code"]) == (status, code)
    assert answer.status_line.startswith(b"HTTP/1.1 ")
    assert len(answer.headers["x-request-id"]) == 32
    assert answer.headers["connection"] == "close"
    writer.close()
    await writer.wait_closed()
    [record] = refusal_records(caplog)
    assert code in record.getMessage()
    assert edge.origin_requests() == 0
    # Counted and in the access log like any other answer.
    app = edge.runner.app
    assert (
        app[METRICS].registry.get_sample_value(
            "ponto_requests_total", {"endpoint": "other", "code": str(status)}
        )
        == 1
    )
    app[ACCESS_LOG].flush()
    [line] = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    assert (line["status"], line["error"], line["request_id"]) == (
        status,
        code,
        answer.headers["x-request-id"],
    )
    assert (line["method"], line["path"], line["endpoint"]) == ("UNKNOWN", "", "other")
    assert line["client"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (head(CHAT, b"Content-Length: 7"), "Duplicate Content-Length"),
        (
            head(CHAT, b"Transfer-Encoding: chunked"),
            "Transfer-Encoding can't be present with Content-Length",
        ),
        (head(CHAT, b"X-Ctl: a\x01b"), "Invalid header value char"),
        (b"POST / HTTP/9.9\r\nHost: p\r\n\r\n", "Bad status line: Invalid HTTP version"),
        (b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", "Missing 'Host' header in request."),
        (
            b"POST http:///v1/chat/completions?api_key=sk-live-123 HTTP/1.1\r\nHost: p\r\n\r\n",
            "invalid request target",
        ),
    ],
    ids=[
        "two-lengths",
        "length-and-chunked",
        "control-character",
        "bad-version",
        "no-host",
        "absolute-target",
    ],
)
async def test_a_refused_message_is_told_why_without_its_bytes(
    start_edge: Start, caplog: pytest.LogCaptureFixture, request_bytes: bytes, reason: str
) -> None:
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(request_bytes)
    answer = await read_answer(reader)
    writer.close()
    await writer.wait_closed()
    assert answer.error()["message"] == f"malformed HTTP request: {reason}"
    [record] = refusal_records(caplog)
    assert "sk-live" not in record.getMessage() and "x01" not in record.getMessage()


@pytest.mark.parametrize(
    "message",
    [
        "Bad status line 'POST /v1/x?key=sk-live-123 junk'",  # the pure-Python parser's
        'Invalid HTTP header: b"Bearer it\'s-sk-123\\x00"',
        "http:///v1/chat/completions?api_key=sk-live-123",
        "Duplicate 'Bearer sk-live-123' header found.",
    ],
)
def test_a_parser_message_that_quotes_the_client_gives_no_reason(message: str) -> None:
    assert parser_error(BadHttpMessage(message)).message == "malformed HTTP request"


async def test_expect_100_continue_works_and_any_other_expectation_is_a_json_417(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(head(CHAT, b"Expect: 100-continue"))
    assert (await reader.readline()).startswith(b"HTTP/1.1 100")
    assert await reader.readline() == b"\r\n"
    writer.write(BODY)
    assert (await read_answer(reader)).status == 200
    writer.close()

    reader, writer = await edge.connect()
    writer.write(head(CHAT, b"Expect: teapot") + BODY)
    answer = await read_answer(reader)
    writer.close()
    assert answer.status == 417
    assert answer.error()["code"] == "expectation_failed"
    assert answer.headers["x-request-id"]
    assert ["expectation_failed" in r.getMessage() for r in refusal_records(caplog)] == [True]
    assert edge.origin_requests() == 1


async def test_expect_100_continue_with_a_body_past_the_limit_gets_the_413_at_once(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await start_edge()
    reader, writer = await edge.connect()
    # The body is never sent: the client waits for 100 Continue.
    writer.write(head(CHAT, b"Expect: 100-continue", length=65537))
    answer = await read_answer(reader)
    assert answer.status_line.startswith(b"HTTP/1.1 413")
    assert answer.error()["code"] == "body_too_large"
    assert answer.headers["connection"] == "close"
    assert answer.headers["x-request-id"]
    assert await closed(reader)
    writer.close()
    await writer.wait_closed()
    assert ["body_too_large" in r.getMessage() for r in refusal_records(caplog)] == [True]
    assert (
        edge.runner.app[METRICS].registry.get_sample_value(
            "ponto_requests_total", {"endpoint": "chat.completions", "code": "413"}
        )
        == 1
    )
    assert edge.origin_requests() == 0


@pytest.mark.parametrize(
    ("swap", "status", "code"),
    [
        ((b"Content-Type: application/json", b"Content-Type: text/plain"), 415, None),
        ((b"Authorization: Bearer " + KEY.key.encode(), b"X-No: auth"), 401, "missing_api_key"),
        ((b"Content-Length: %d" % len(BODY), b"Content-Length: 65537"), 413, "body_too_large"),
    ],
)
async def test_expect_100_continue_refused_by_its_head_gets_no_100(
    start_edge: Start, swap: tuple[bytes, bytes], status: int, code: str | None
) -> None:
    # The 100 goes out when the body is read, after auth and the head's
    # checks: a refusal is the only answer, and the client sends no body.
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(head(CHAT, b"Expect: 100-continue").replace(*swap))
    answer = await read_answer(reader)
    assert answer.status == status, answer.status_line
    if code is not None:
        assert answer.error()["code"] == code
    else:
        answer.error()
    assert answer.headers["server"] == "ponto"
    assert answer.headers["x-request-id"]
    assert answer.headers["connection"] == "close"
    assert await closed(reader)
    writer.close()
    await writer.wait_closed()
    assert edge.origin_requests() == 0


@pytest.mark.parametrize(
    "request_line", [b"GET /v1/models", b"GET /healthz", b"POST /nope", b"DELETE /v1/models"]
)
async def test_an_unknown_expectation_is_a_json_417_on_every_path(
    start_edge: Start, capfd: pytest.CaptureFixture[str], request_line: bytes
) -> None:
    edge = await start_edge("--access-log=on")
    reader, writer = await edge.connect()
    writer.write(
        request_line + b" HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer "
        + KEY.key.encode() + b"\r\nExpect: bogus\r\n\r\n"
    )  # fmt: skip
    answer = await read_answer(reader)
    writer.close()
    await writer.wait_closed()
    assert (answer.status, answer.error()["code"]) == (417, "expectation_failed")
    assert answer.headers["server"] == "ponto"
    request_id = answer.headers["x-request-id"]
    edge.runner.app[ACCESS_LOG].flush()
    lines = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    assert [(x["status"], x["request_id"]) for x in lines] == [(417, request_id)]


async def test_expect_100_continue_past_the_limit_with_the_body_already_sent_still_gets_the_413(
    start_edge: Start,
) -> None:
    """A client that did not wait for the 100 (RFC 9110 allows it): its bytes
    are read and dropped, so the 413 is not lost to a reset connection."""
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(head(CHAT, b"Expect: 100-continue", length=65537) + b"x" * 4096)
    answer = await read_answer(reader)
    writer.close()
    await writer.wait_closed()
    assert (answer.status, answer.error()["code"]) == (413, "body_too_large")
    assert edge.origin_requests() == 0


async def test_chunk_extensions_past_the_framing_bound_get_a_413_and_reach_no_origin(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 91: aiohttp's parser skips a chunk's extensions unbounded and
    counts them in no body, so 500 MB of them before a 65-byte body reached
    the origin (Node's CVE-2024-22019). They are framing: cut once it passes
    the body's own size and 64 KB."""
    edge = await start_edge()
    reader, writer = await edge.connect()
    # With the 100 the handler is reading the body when the chunks come.
    writer.write(head(CHAT, b"Transfer-Encoding: chunked", b"Expect: 100-continue", length=None))
    assert (
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        == b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    chunks = b"1;" + b"x" * (1 << 20) + b"\r\n" + BODY[:1] + b"\r\n"
    chunks += b"%x\r\n" % (len(BODY) - 1) + BODY[1:] + b"\r\n0\r\n\r\n"
    writer.write(chunks)
    answer = await answer_or_reset(reader)
    writer.close()
    if answer is not None:
        assert (answer.status, answer.error()["code"]) == (413, "body_too_large")
        assert answer.headers["connection"] == "close"
        assert answer.headers["x-request-id"]
    assert ["body_too_large" in r.getMessage() for r in refusal_records(caplog)] == [True]
    assert edge.origin_requests() == 0


@pytest.mark.parametrize(("size", "status"), [(9_000, 200), (30_000, 413)])
async def test_a_body_framed_past_its_own_size_gets_a_413(
    start_edge: Start, caplog: pytest.LogCaptureFixture, size: int, status: int
) -> None:
    """Trial 91: each chunk costs a pass through Python, so 15.6 MB of 1-byte
    chunks held a worker for 1.7 s of CPU (read and dropped after a 401).
    Framing may take the body's own size again and 64 KB: a small body
    passes however chunked, 30 KB in 1-byte chunks (180 KB as sent, within
    the bound on all of it) does not."""
    edge = await start_edge()
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * (size - 60)}]}
    ).encode()
    reader, writer = await edge.connect()
    writer.write(head(CHAT, b"Transfer-Encoding: chunked", b"Expect: 100-continue", length=None))
    assert (
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        == b"HTTP/1.1 100 Continue\r\n\r\n"
    )
    writer.write(b"".join(b"1\r\n%c\r\n" % byte for byte in body) + b"0\r\n\r\n")
    answer = await answer_or_reset(reader)
    writer.close()
    if status == 200:
        assert answer is not None and answer.status == 200
    else:
        if answer is not None:
            assert (answer.status, answer.error()["code"]) == (413, "body_too_large")
            assert "framing" in answer.error()["message"]
            assert answer.headers["connection"] == "close"
        assert ["body_too_large" in r.getMessage() for r in refusal_records(caplog)] == [True]
    assert edge.origin_requests() == (status == 200)


@pytest.mark.parametrize(("key", "status"), [(True, 413), (False, 401)])
async def test_a_client_still_sending_a_body_framed_past_its_size_gets_its_answer(
    start_edge: Start, caplog: pytest.LogCaptureFixture, key: bool, status: int
) -> None:
    """A client that writes its whole body before it reads (httpx, and so
    the openai SDK, given a generator of small pieces) got a connection
    error where its 413, or its 401, was: the connection closed under it,
    still sending, and the reset took the answer. The rest is read and
    dropped unparsed, as the 413 of a body past --max-body-bytes waits."""
    edge = await start_edge()
    lines = [CHAT.join([b"POST ", b" HTTP/1.1"]), b"Host: proxy", b"Content-Type: application/json"]
    lines.append(b"Transfer-Encoding: chunked")
    if key:
        lines.append(b"Authorization: Bearer " + KEY.key.encode())
    reader, writer = await edge.connect()
    # 24 MB as sent (a 4 MB body), far past the sockets' buffers.
    writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + b"1\r\nx\r\n" * (1 << 22) + b"0\r\n\r\n")
    await writer.drain()
    answer = await read_answer(reader)
    assert await closed(reader)
    writer.close()
    assert answer.status == status
    assert [r.getMessage().count(f" {status} ") for r in refusal_records(caplog)] == [1]
    assert edge.origin_requests() == 0


async def test_a_declared_body_past_the_limit_sent_whole_still_gets_its_413(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """An SDK writes its whole body before it reads: the 413, answered at the
    head, waits while the rest is read and dropped, and is not lost to a
    reset (as when, in trial 91, a bound on the bytes as sent closed the
    connection under such a client)."""
    edge = await start_edge()  # --max-body-bytes=65536
    reader, writer = await edge.connect()
    body = b"x" * (32 << 20)  # far past the sockets' buffers: still sending when answered
    writer.write(head(CHAT, length=len(body)) + body)
    await writer.drain()
    answer = await read_answer(reader)
    writer.close()
    assert (answer.status, answer.error()["code"]) == (413, "body_too_large")
    assert ["body_too_large" in r.getMessage() for r in refusal_records(caplog)] == [True]
    assert edge.origin_requests() == 0


async def test_a_connect_is_a_404_naming_its_target_and_saying_this_is_no_forward_proxy(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 91: a CONNECT was answered "CONNECT : Not Found" (its target is
    no path) and logged so; the connection serves on, as after any 404."""
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n")
    answer = await read_answer(reader)
    assert (answer.status, answer.error()["code"]) == (404, "not_found")
    message = answer.error()["message"]
    assert message.startswith("CONNECT evil.example:443: Not Found; ")
    assert "not a forward proxy" in message
    writer.write(head() + BODY)
    assert (await read_answer(reader)).status == 200
    writer.close()
    assert ["CONNECT evil.example:443 " in r.getMessage() for r in refusal_records(caplog)] == [
        True
    ]
    assert edge.origin_requests() == 1


async def test_a_bad_chunk_gets_a_json_400(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(head(CHAT, b"Transfer-Encoding: chunked", length=None) + b'5\r\n{"mod\r\n')
    await writer.drain()
    # Apart, so the handler is reading the body when the bad chunk comes (in
    # one packet with the head the parser refuses the message as a whole).
    await asyncio.sleep(0.1)
    writer.write(b"zz\r\nabc\r\n")
    answer = await read_answer(reader)
    assert (answer.status, answer.error()["code"]) == (400, "invalid_body")
    assert answer.headers["x-request-id"]
    assert answer.headers["connection"] == "close"
    assert await closed(reader)
    writer.close()
    refusal_records(caplog)
    assert edge.origin_requests() == 0


async def test_pipelined_requests_are_answered_in_order_and_garbage_after_them_refused(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(head() + BODY + head() + BODY)
    first, second = [await read_answer(reader) for _ in range(2)]
    assert (first.status, second.status) == (200, 200)
    # (In one write with the requests, garbage makes aiohttp's parser drop them all.)
    writer.write(b"NOT HTTP\x00\r\n\r\n")
    third = await read_answer(reader)
    assert third.status == 400 and third.error()["code"] == "invalid_http_request"
    assert await closed(reader)
    writer.close()
    assert len(refusal_records(caplog)) == 1
    assert edge.origin_requests() == 2


EMPTY = "request body is empty; expected a JSON object"
UNFRAMED = (
    EMPTY + " (the request has neither Content-Length nor Transfer-Encoding, so HTTP/1.1 "
    "reads no body after its head)"
)
UNTYPED = b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer %s\r\n" % (
    KEY.key.encode()
)


@pytest.mark.parametrize(
    ("sent", "later", "message"),
    [
        (head(length=0), b"", EMPTY),
        (head(length=None), b"", UNFRAMED),
        (head(length=None) + BODY, b"", UNFRAMED),
        (head(length=None), BODY, UNFRAMED),
        (UNTYPED + b"Content-Length: 0\r\n\r\n", b"", EMPTY),
        (UNTYPED + b"\r\n", b"", UNFRAMED),
        (UNTYPED + b"\r\n" + BODY, b"", UNFRAMED),
    ],
    ids=[
        "length-0",
        "unframed",
        "unframed-body-in-the-read",
        "unframed-body-in-a-later-read",
        "untyped-length-0",
        "untyped-unframed",
        "untyped-unframed-body-in-the-read",
    ],
)
async def test_a_post_without_a_body_gets_the_empty_bodys_400_whatever_follows_its_head(
    start_edge: Start, caplog: pytest.LogCaptureFixture, sent: bytes, later: bytes, message: str
) -> None:
    """HTTP/1.1 reads no body after a head with neither Content-Length nor
    Transfer-Encoding: such a POST (curl -X POST's, which sends no
    Content-Type either) is refused as one with Content-Length: 0, not as a
    415, nor as the next head its body's bytes would be (the parser's
    'invalid method', which dropped the request). Unframed, the connection
    closes after the answer: whatever was sent after the head is not read as
    a request."""
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(sent)
    answer = await read_answer(reader)
    assert answer.status == 400
    assert answer.error() == {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }
    if message == UNFRAMED:
        if later:
            writer.write(later)
        assert await closed(reader)
    else:
        writer.write(head() + BODY)  # the connection serves on
        assert (await read_answer(reader)).status == 200
    writer.close()
    await writer.wait_closed()
    [record] = refusal_records(caplog)
    assert "POST /v1/chat/completions" in record.getMessage()
    assert edge.origin_requests() == (0 if message == UNFRAMED else 1)


@pytest.mark.parametrize(
    ("sent", "status", "code"),
    [
        # Trial 28's head: served, its version repeated in the status line.
        (
            head(length=None).replace(b"HTTP/1.1", b"HTTP/2.0", 1) + BODY,
            400,
            "http_version_not_supported",
        ),
        (
            head(CHAT, *(b"X-Big-%d: " % i + b"a" * 7000 for i in range(5)), length=None) + BODY,
            431,
            "request_header_fields_too_large",
        ),
    ],
    ids=["http-2.0", "big-head"],
)
async def test_an_unframed_head_the_edge_refuses_is_refused_whatever_follows_it(
    start_edge: Start, caplog: pytest.LogCaptureFixture, sent: bytes, status: int, code: str
) -> None:
    """An unframed POST answered as itself (not as the bytes after it) is
    held to the edge's bounds on heads, as any head the parser takes."""
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(sent)
    answer = await read_answer(reader)
    assert answer.status_line.startswith(b"HTTP/1.1 ")
    assert (answer.status, answer.error()["code"]) == (status, code)
    assert await closed(reader)
    writer.close()
    await writer.wait_closed()
    [record] = refusal_records(caplog)
    assert code in record.getMessage()
    assert edge.origin_requests() == 0


async def test_a_read_that_begins_post_inside_a_head_is_not_answered_as_a_post(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    """A head begun in an earlier read is still the parser's: a read that
    begins 'POST ...' in one of its header values, and ends in bytes the
    parser refuses, is that refusal. Taken for an unframed POST's head, it
    was answered as a request the client never sent (a GET's header value,
    its later headers the POST's)."""
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: p\r\nX-Note: ")
    await wait_open(edge, 1)
    caps = edge.runner.caps
    assert caps is not None
    [conn] = caps._waiting
    async with asyncio.timeout(10):  # until the edge has read the first part
        while not conn._head_bytes:
            await asyncio.sleep(0.01)
    writer.write(head(length=None) + BODY)
    answer = await read_answer(reader)
    assert (answer.status, answer.error()["code"]) == (400, "invalid_http_request")
    assert await closed(reader)
    writer.close()
    await writer.wait_closed()
    [record] = refusal_records(caplog)
    assert "POST" not in record.getMessage()
    assert edge.origin_requests() == 0


async def test_a_big_body_leaves_its_kept_alive_connection_serving(start_edge: Start) -> None:
    """A body read over many reads is no part of the next request's head (the
    head's byte count once ran on across it, and aiohttp's empty re-parse call
    then refused a head that did not exist, closing the connection silently)."""
    edge = await start_edge("--max-body-bytes=4000000")
    reader, writer = await edge.connect()

    def sized(n: int) -> bytes:
        return json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * n}]}
        ).encode()

    # 3 MB is far past the body reader's buffer: reading pauses and resumes.
    big, huge = sized(200_000), sized(3_000_000)
    for body in (BODY, big, BODY, huge, BODY):
        writer.write(head(length=len(body)) + body)
        await writer.drain()
        answer = await read_answer(reader)
        assert answer.status == 200, answer.body
        assert "close" not in answer.headers.get("connection", "")
    writer.close()
    assert edge.origin_requests() == 5


async def test_a_stream_to_an_http_1_0_client_ends_with_the_connection(start_edge: Start) -> None:
    """HTTP/1.0 has no chunked coding: however the client asks for keep-alive,
    the stream's end must be the connection's or the client waits forever."""
    edge = await start_edge()
    reader, writer = await edge.connect()
    body = json.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    request = head(length=len(body)).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    writer.write(request.replace(b"\r\n\r\n", b"\r\nConnection: keep-alive\r\n\r\n") + body)
    answer = await asyncio.wait_for(reader.read(), 10)  # to EOF
    writer.close()
    assert answer.startswith(b"HTTP/1.")
    assert b"data: [DONE]" in answer


async def test_a_header_line_of_8_kb_passes(start_edge: Start) -> None:
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(head(CHAT, b"X-Big: " + b"a" * 8000) + BODY)
    assert (await read_answer(reader)).status == 200
    writer.close()


async def test_a_head_too_large_behind_a_request_in_the_same_read_gets_a_431(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    # The big head's first bytes arrive with the end of the request before it:
    # they count toward its size as much as those that come later.
    edge = await start_edge()
    reader, writer = await edge.connect()
    big = head(CHAT, *(b"X-Big-%d: " % i + b"a" * 7000 for i in range(5)))
    assert len(big) > MAX_HEAD
    writer.write(head() + BODY + big[:30_000])
    assert (await read_answer(reader)).status == 200
    writer.write(big[30_000:] + BODY)
    answer = await read_answer(reader)
    assert answer.status == 431
    assert answer.error()["code"] == "request_header_fields_too_large"
    writer.close()
    assert edge.origin_requests() == 1


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: p\r\n\r\n"
GZIP_CHUNKED = head(CHAT, b"Transfer-Encoding: gzip, chunked", length=None) + (
    b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
)
BIG_HEAD = head(CHAT, *(b"X-Big-%d: " % i + b"a" * 7000 for i in range(5))) + BODY


@pytest.mark.parametrize(
    ("sent", "statuses"),
    [
        # Review 46: only the last head of a read was checked; the first
        # went through (its gzip ignored, its size past the bound).
        (GZIP_CHUNKED + HEALTHZ, [400]),
        (BIG_HEAD + HEALTHZ, [431]),
        # And an error queued behind a request was never answered.
        (HEALTHZ + HEALTHZ.replace(b"HTTP/1.1", b"HTTP/2.0"), [200, 400]),
        (HEALTHZ + GZIP_CHUNKED + HEALTHZ, [200, 400]),
    ],
    ids=["refused-first", "big-first", "refused-second", "refused-between"],
)
async def test_each_pipelined_head_is_checked_and_its_refusal_answered(
    start_edge: Start, sent: bytes, statuses: list[int]
) -> None:
    edge = await start_edge()
    reader, writer = await edge.connect()
    writer.write(sent)
    answers = [await read_answer(reader) for _ in statuses]
    assert [a.status for a in answers] == statuses
    assert answers[-1].headers["connection"] == "close"
    assert await closed(reader)
    writer.close()
    assert edge.origin_requests() == 0


# ---------------------------------------------------------------- content codings


@pytest.mark.parametrize(
    ("encoding", "body", "status", "code"),
    [
        ("gzip", gzip.compress(BODY), 200, None),
        ("deflate", zlib.compress(BODY), 200, None),
        ("identity", BODY, 200, None),
        ("gzip", BODY, 400, "invalid_content_encoding"),
        ("gzip", gzip.compress(BODY)[:-9], 400, "invalid_content_encoding"),
        ("deflate", b"\x78\x9c not deflate", 400, "invalid_content_encoding"),
        ("br", BODY, 415, "unsupported_content_encoding"),
        ("zstd", BODY, 415, "unsupported_content_encoding"),
        ("compress", BODY, 415, "unsupported_content_encoding"),
        ("gzip", gzip.compress(b"{" + b" " * 200_000 + b"}"), 413, "body_too_large"),
    ],
    ids=[
        "gzip",
        "deflate",
        "identity",
        "not-gzip",
        "truncated-gzip",
        "not-deflate",
        "br",
        "zstd",
        "compress",
        "bomb",
    ],
)
async def test_request_content_codings(
    start_edge: Start, encoding: str, body: bytes, status: int, code: str | None
) -> None:
    edge = await start_edge()
    async with aiohttp.ClientSession() as session:
        answer = await session.post(
            edge.url("/v1/chat/completions"),
            data=body,
            headers={
                "authorization": f"Bearer {KEY.key}",
                "content-type": "application/json",
                "content-encoding": encoding,
            },
        )
        assert answer.status == status
        assert answer.headers["x-request-id"]
        if code is not None:
            doc = await answer.json()
            assert doc["error"]["code"] == code
    assert edge.origin_requests() == (1 if status == 200 else 0)


# ---------------------------------------------------------------- connection caps


async def busy_connection(edge: Edge, source: str | None = None) -> tuple[Any, Any]:
    """A connection with a request under way (its body still coming)."""
    reader, writer = await edge.connect(source)
    writer.write(head() + BODY[:5])
    await writer.drain()
    return reader, writer


async def wait_open(edge: Edge, count: int) -> None:
    caps = edge.runner.caps
    assert caps is not None
    async with asyncio.timeout(10):
        while caps.open != count:
            await asyncio.sleep(0.01)


async def test_at_the_cap_with_every_connection_busy_a_new_one_gets_a_503(
    start_edge: Start, caplog: pytest.LogCaptureFixture
) -> None:
    edge = await start_edge("--max-connections=3", "--max-connections-per-client=3")
    busy = [await busy_connection(edge) for _ in range(3)]
    await wait_open(edge, 3)
    reader, writer = await edge.connect()
    writer.write(head() + BODY)
    answer = await read_answer(reader)
    assert answer.status == 503
    assert answer.error()["code"] == "too_many_connections"
    assert answer.headers["connection"] == "close"
    assert answer.headers["x-request-id"]
    assert answer.headers["retry-after"] == "1"
    assert await closed(reader)
    writer.close()
    for _, w in busy:
        w.close()
    [record] = refusal_records(caplog)
    assert "too_many_connections" in record.getMessage()
    assert edge.origin_requests() == 0


async def metrics_listener(app: web.Application, settings: Settings) -> tuple[web.AppRunner, int]:
    """`app`'s --metrics-listen as the proxy serves it (dataplane.run): its
    runner, which the caller cleans up, and its port."""
    served = await serve_metrics(app, settings)
    assert served is not None
    runner, site = served
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_at_the_cap_liveness_is_answered_on_the_metrics_listener(
    start_edge: Start, tmp_path: Path
) -> None:
    # Trial 74: with every connection held by a stream, /healthz on the public
    # port got the cap's 503 (a kubelet would restart a full, healthy proxy);
    # the metrics listener has no client cap and answers it.
    flags = (
        "--max-connections=2",
        "--max-connections-per-client=2",
        "--metrics-listen=127.0.0.1:0",
    )
    edge = await start_edge(*flags)
    busy = [await busy_connection(edge) for _ in range(2)]
    await wait_open(edge, 2)
    reader, writer = await edge.connect()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: proxy\r\n\r\n")
    assert (await read_answer(reader)).error()["code"] == "too_many_connections"
    writer.close()
    settings = parse_proxy(["--region=r1", f"--state-dir={tmp_path}", *flags])
    runner, port = await metrics_listener(edge.runner.app, settings)
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/healthz", "/health"):
                async with session.get(f"http://127.0.0.1:{port}{path}") as answer:
                    assert answer.status == 200, path
                    doc = await answer.json()
                    assert doc["status"] == "ok" and doc["route_table_version"] == 1
                    # The details the public port does not give: the table by
                    # number and by content (replicas number one content apart).
                    routes = edge.runner.app[HOLDER].routes
                    assert routes is not None
                    assert doc["route_table_etag"] == routes.etag
                    assert len(doc["route_table_etag"]) == 64
                    assert doc.keys() >= {
                        "route_table_source",
                        "fleet_id",
                        "route_tables_refused",
                        "control_plane_connected",
                        "quota_generation",
                        "quota_source",
                    }
    finally:
        await runner.cleanup()
        for _, w in busy:
            w.close()


async def test_a_404_on_the_metrics_listener_says_which_port_it_is(
    start_edge: Start, tmp_path: Path
) -> None:
    # Trial 99: an SDK pointed at the metrics port got "this gateway does not
    # serve that endpoint (it serves )", an empty list of the API's paths.
    edge = await start_edge("--metrics-listen=127.0.0.1:0")
    settings = parse_proxy(
        ["--region=r1", f"--state-dir={tmp_path}", "--metrics-listen=127.0.0.1:0"]
    )
    runner, port = await metrics_listener(edge.runner.app, settings)
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/v1/models", "/v1/moderations", "/key/generate", "/"):
                async with session.get(f"http://127.0.0.1:{port}{path}") as answer:
                    assert answer.status == 404, path
                    error = (await answer.json())["error"]
                    assert error["message"] == (
                        f"GET {path}: Not Found; this is the proxy's metrics port,"
                        " which serves /health, /healthz, /metrics only"
                    ), path
    finally:
        await runner.cleanup()
    assert edge.origin_requests() == 0


async def test_at_the_cap_the_longest_waiting_connection_makes_room(start_edge: Start) -> None:
    edge = await start_edge("--max-connections=3", "--max-connections-per-client=3")
    idle = [await edge.connect() for _ in range(3)]
    await wait_open(edge, 3)
    reader, writer = await edge.connect()
    writer.write(head() + BODY)
    assert (await read_answer(reader)).status == 200
    assert await closed(idle[0][0])  # the oldest went
    assert not any(r.at_eof() for r, _ in idle[1:])
    for _, w in idle:
        w.close()
    writer.close()


async def test_one_address_cannot_hold_every_connection(start_edge: Start) -> None:
    edge = await start_edge("--max-connections=10", "--max-connections-per-client=2")
    busy = [await busy_connection(edge, "127.0.0.1") for _ in range(2)]
    await wait_open(edge, 2)
    reader, writer = await edge.connect("127.0.0.1")
    writer.write(head() + BODY)
    assert (await read_answer(reader)).status == 503
    writer.close()
    # Another address is served.
    reader, writer = await edge.connect("127.0.0.2")
    writer.write(head() + BODY)
    assert (await read_answer(reader)).status == 200
    writer.close()
    for _, w in busy:
        w.close()


class PeerTransport(asyncio.Transport):
    """A connection from `peer` (no socket: the test has one IPv6 address,
    ::1), keeping what the proxy writes to it."""

    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer = peer
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return (self.peer, 4711, 0, 0) if name == "peername" else default

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


async def test_an_ipv6_client_is_its_64_under_the_per_client_cap(start_edge: Start) -> None:
    # Trial 78: 40 connections from 40 addresses of one /64 all passed a cap
    # of 4 per client; an IPv6 host may send from any address of its /64.
    edge = await start_edge("--max-connections=10", "--max-connections-per-client=2")
    server = edge.runner.server
    assert server is not None
    opened = []
    try:
        for peer in ("2001:db8:7::1", "2001:db8:7::2", "2001:db8:7::3", "2001:db8:8::1"):
            transport = PeerTransport(peer)
            protocol = server()
            protocol.connection_made(transport)
            opened.append((protocol, transport))
        # Idle, so the /64's third connection makes room at its cap by
        # closing the /64's oldest (as one IPv4 address's third would).
        assert [t.peer for _, t in opened if t.closed] == ["2001:db8:7::1"]
        caps = edge.runner.caps
        assert caps is not None and caps.open == 3
    finally:
        for protocol, _ in opened:
            protocol.connection_lost(None)


async def test_slow_loris_connections_do_not_starve_a_normal_client(start_edge: Start) -> None:
    edge = await start_edge("--max-connections=64", "--header-timeout=5")
    loris: list[socket.socket] = []
    loop = asyncio.get_running_loop()
    try:
        for _ in range(300):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, (edge.host, edge.port))
            await loop.sock_sendall(s, b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n")
            loris.append(s)
        async with aiohttp.ClientSession() as session:
            for i in range(20):
                answer = await session.post(
                    edge.url("/v1/chat/completions"),
                    json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]},
                    headers={"authorization": f"Bearer {KEY.key}"},
                )
                assert answer.status == 200
                await answer.read()
        caps = edge.runner.caps
        assert caps is not None and caps.open <= 64
    finally:
        for s in loris:
            s.close()
    assert edge.origin_requests() == 20
