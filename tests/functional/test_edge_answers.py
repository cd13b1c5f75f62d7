"""The edge's one-write answers (EdgeProtocol._put_whole, after the handler or
from inside a handler) are byte for byte what aiohttp's own prepare and
write_eof send: the same answers, asked for by the same requests, from an
EdgeRunner and from aiohttp's AppRunner on loopback. Only the Date header may
differ (it is the second the answer left). A WholeAnswer (the pipeline's
whole answer, its header lines written by dataplane.http.reply) is what
aiohttp sends for the headers it stands for."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import hdrs, web
from multidict import CIMultiDict

from dataplane.http import reply
from dataplane.http.boundary import send_whole
from dataplane.http.edge import EdgeLimits, EdgeRunner, WholeAnswer
from dataplane.http.state import DRAINING, Draining

BOUND = 5.0  # what a wait that must end may take before the test fails


def closing() -> web.Response:
    response = web.Response(body=b"bye")
    response.force_close()
    return response


OURS = [
    ("x-ponto-origin", "o1"),
    ("x-ponto-attempts", "1"),
    ("x-request-id", "7ad6aac716e7e2f8"),
    ("x-ponto-cache", "miss"),
]


def whole(origin: list[tuple[str, str]], body: bytes = b"{}") -> WholeAnswer:
    """A WholeAnswer as reply.origin_body makes it, of an origin's `origin` headers."""
    headers = CIMultiDict(origin)
    lines = reply._lines(headers, OURS, b"")
    assert lines is not None
    return WholeAnswer(200, body, lines, hdrs.CONTENT_TYPE in headers, headers, list(OURS))


def whole_read() -> WholeAnswer:
    """One whose headers were read and changed before it went out."""
    response = whole([("Content-Type", "application/json")])
    response.headers["x-late"] = "1"
    return response


ANSWERS: dict[str, Callable[[], web.Response]] = {
    "/whole": lambda: whole([("Content-Type", "application/json"), ("x-o", "v")]),
    "/whole-untyped": lambda: whole([("x-o", "v")]),
    "/whole-empty": lambda: whole([("Content-Type", "application/json")], b""),
    "/whole-read": whole_read,
    "/json": lambda: web.json_response({"a": 1}),
    "/bytes": lambda: web.Response(body=b"abc", headers={"x-request-id": "r1"}),
    "/empty": web.Response,
    "/empty-bytes": lambda: web.Response(body=b""),
    "/text": lambda: web.Response(text="hi"),
    "/typed": lambda: web.Response(body=b"{}", content_type="application/json", charset="utf-8"),
    "/error": lambda: web.Response(
        status=429, body=b"{}", content_type="application/json", headers={"retry-after": "1"}
    ),
    "/reason": lambda: web.Response(status=599, reason="Odd", body=b"?"),
    "/no-content": lambda: web.Response(status=204),
    "/not-modified": lambda: web.Response(status=304),
    "/force-close": closing,
    "/says-close": lambda: web.Response(body=b"x", headers={"Connection": "close"}),
    "/says-keep-alive": lambda: web.Response(body=b"x", headers={"Connection": "keep-alive"}),
    "/own-length": lambda: web.Response(body=b"xyz", headers={"Content-Length": "3"}),
    "/own-date-server": lambda: web.Response(
        body=b"x", headers={"Date": "Tue, 01 Dec 2026 00:00:00 GMT", "Server": "s"}
    ),
    "/multi": lambda: web.Response(body=b"x", headers=[("x-a", "1"), ("x-a", "2")]),
    "/large": lambda: web.Response(body=b"z" * (4 << 20)),  # past the transport's high water
}

REQUESTS = [
    b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET %s HTTP/1.0\r\n\r\n",
    b"GET %s HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"HEAD %s HTTP/1.1\r\nHost: x\r\n\r\n",
]
NEXT = b"GET /bytes HTTP/1.1\r\nHost: x\r\n\r\n"

DATE = re.compile(rb"\r\nDate: [^\r]*\r\n")


async def hide_server(request: web.Request, response: web.StreamResponse) -> None:
    """An on_response_prepare hook that needs the prepared head: it takes the
    Server header out (KeyError if it is not there yet) and closes the connection."""
    del response.headers["Server"]
    response.force_close()


def app(*, hooked: bool = False, sent: bool = False) -> web.Application:
    """ANSWERS' handlers; with `sent`, each writes its answer itself
    (boundary.send_whole, as the pipeline does) before it returns it."""
    application = web.Application()
    application[DRAINING] = Draining()
    if hooked:
        application.on_response_prepare.append(hide_server)
    for path, make in ANSWERS.items():

        async def handle(
            request: web.Request, make: Callable[[], web.Response] = make
        ) -> web.Response:
            await request.read()
            response = make()
            if sent:
                await send_whole(request, response)
            return response

        application.router.add_route("*", path, handle)
    return application


@pytest.fixture(
    params=[(False, False), (True, False), (False, True), (True, True)],
    ids=["plain", "hooked", "plain-sent", "hooked-sent"],
)
async def servers(request: pytest.FixtureRequest) -> AsyncIterator[dict[str, int]]:
    """name -> port: "edge" (EdgeRunner) and "aiohttp" (AppRunner), the same app,
    with an on_response_prepare hook or without, answers returned or written by
    their handlers (against aiohttp's own server, which prepares and writes)."""
    hooked, sent = request.param
    runners: dict[str, web.AppRunner] = {
        "edge": EdgeRunner(app(hooked=hooked, sent=sent), EdgeLimits(), access_log=None),
        "aiohttp": web.AppRunner(app(hooked=hooked), access_log=None),
    }
    ports: dict[str, int] = {}
    for name, runner in runners.items():
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports[name] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield ports
    for runner in runners.values():
        await runner.cleanup()


async def read_answer(reader: asyncio.StreamReader, head_only: bool) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    match = re.search(rb"\r\ncontent-length: *(\d+)", head, re.IGNORECASE)
    length = int(match.group(1)) if match and not head_only else 0
    return head + await reader.readexactly(length)


async def exchange(port: int, request: bytes) -> tuple[bytes, bytes]:
    """The answer to `request` (Date masked), then what the connection does
    next: the answer to another request, or b"" once the server closed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(BOUND):
            writer.write(request)
            answer = DATE.sub(
                b"\r\nDate: -\r\n", await read_answer(reader, request.startswith(b"HEAD"))
            )
            writer.write(NEXT)
            try:
                after = DATE.sub(b"\r\nDate: -\r\n", await read_answer(reader, False))
            except (asyncio.IncompleteReadError, ConnectionResetError):
                after = b""
        return answer, after
    finally:
        writer.close()


@pytest.mark.parametrize(
    "request_line",
    REQUESTS,
    ids=lambda r: r.split(b"\r\n")[0][-8:].decode() + "-" + r[:4].decode().strip(),
)
@pytest.mark.parametrize("path", list(ANSWERS))
async def test_an_answer_is_what_aiohttp_sends(
    servers: dict[str, int], path: str, request_line: bytes
) -> None:
    request = request_line.replace(b"%s", path.encode())
    edge = await exchange(servers["edge"], request)
    aiohttp_ = await exchange(servers["aiohttp"], request)
    assert edge == aiohttp_


async def test_pipelined_requests_get_the_same_answers_in_order(servers: dict[str, int]) -> None:
    paths = ("/json", "/bytes", "/large", "/text")
    request = b"".join(r.replace(b"%s", p.encode()) for p in paths for r in REQUESTS[:2])
    answers: dict[str, list[bytes]] = {}
    for name, port in servers.items():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        got = answers[name] = []
        try:
            async with asyncio.timeout(BOUND):
                writer.write(request)
                while len(got) < 2 * len(paths):
                    try:
                        got.append(DATE.sub(b"", await read_answer(reader, False)))
                    except (asyncio.IncompleteReadError, ConnectionResetError):
                        break  # closed after an answer (the hooked app closes every one)
        finally:
            writer.close()
    assert answers["edge"] == answers["aiohttp"]
    assert answers["edge"]
