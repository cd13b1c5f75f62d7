"""What a client gets of a request the stopping proxy cancels: the proxy's
app on its production listener (EdgeRunner, handler cancellation on) before
an origin that never ends its answer, stopped as dataplane.run stops it
(Draining active, then runner.cleanup()) with a short shutdown timeout.

Trial 16: a stream still running at the end of a stop's grace was cut in its
body (curl: "transfer closed with outstanding read data"; the openai SDK: a
connection error, as for a network fault). It ends with an error event of
code `proxy_stopping` and `data: [DONE]`, as a stream its origin breaks
does; an answer not begun yet is a 503 `proxy_stopping`. A client that left
is sent nothing.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer, make_mocked_request

from dataplane.cache.coalesce import Coalescer, Follower, Leader
from dataplane.http.edge import EdgeRunner
from dataplane.http.pipeline import ENDPOINTS, Exchange
from dataplane.http.reply import follow
from dataplane.http.state import DRAINING, HOLDER, METRICS, PIPELINE, Draining, stopping
from dataplane.policy import build_policy
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from dataplane.routes import build_routes
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import COMPLETION, FIRST_CHUNK, KEY, chat, table
from tests.functional.test_whole_answers import until
from tests.unit.test_placement import two_region_table

WAIT = 10.0
GRACE = 0.5  # the server's shutdown timeout here (production: 60 s)


@dataclass
class Stopping:
    app: web.Application
    runner: EdgeRunner
    url: str
    origin_calls: list[bool]  # one per origin call: whether it streamed
    first_sent: asyncio.Event  # the origin sent its first chunk, or took the call
    taken: asyncio.Event  # the origin has the call
    head: asyncio.Event  # set to let the origin send its head
    origin_url: str  # the origin's base URL, for a table of the test's own

    async def stop(self) -> None:
        """As dataplane.run: Draining active, then the runner's cleanup."""
        self.app[DRAINING].active = True
        await self.runner.cleanup()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Stopping]:
    calls: list[bool] = []
    first = asyncio.Event()
    taken = asyncio.Event()
    head = asyncio.Event()
    head.set()

    async def endless(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        calls.append(bool(body.get("stream")))
        taken.set()
        await head.wait()
        if not body.get("stream"):
            first.set()
            await asyncio.sleep(3600)  # an answer that never comes
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: " + json.dumps(FIRST_CHUNK).encode() + b"\n\n")
        first.set()
        await asyncio.sleep(3600)  # a generation that never ends
        return out

    origin_app = web.Application()
    origin_app.router.add_post("/v1/chat/completions", endless)
    origin = TestServer(origin_app)
    await origin.start_server()
    served = await serve_on_edge(tmp_path, str(origin.make_url("/v1")), shutdown_timeout=GRACE)
    app, runner = served.app, served.runner
    port = served.port
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        yield Stopping(app, runner, url, calls, first, taken, head, str(origin.make_url("/v1")))
    finally:
        await runner.cleanup()
        await origin.close()


HEADERS = {"authorization": f"Bearer {KEY.key}"}


@pytest.mark.parametrize("temperature", [0, 1], ids=["a-flights-leader", "uncached"])
async def test_a_stream_cancelled_by_the_stop_ends_with_an_error_event(
    proxy: Stopping, temperature: int
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.url, json=chat("go on", stream=True, temperature=temperature), headers=HEADERS
        ) as resp,
    ):
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT)
        assert json.loads(first[len(b"data: ") :])["choices"][0]["delta"]["content"] == "par"
        stop = asyncio.create_task(proxy.stop())
        rest = await asyncio.wait_for(resp.content.read(), WAIT)  # to the stream's end
        await asyncio.wait_for(stop, WAIT)
    events = [e for e in rest.decode().split("\n\n") if e]
    assert len(events) == 2, rest
    error = json.loads(events[0][len("data: ") :])["error"]
    assert error["code"] == "proxy_stopping"
    assert error["type"] == "server_error"
    assert "retry the request" in error["message"]
    assert events[1] == "data: [DONE]"
    assert resp.headers.get("connection", "").lower() != "keep-alive"


async def test_a_stream_begun_while_stopping_says_its_connection_closes(proxy: Stopping) -> None:
    """Review 35: a stream asked for before the stop began, whose head went
    out after, said nothing of the connection's end (it still closed after
    the stream), so a client's pool could pick the connection for its next
    request."""
    proxy.head.clear()
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(
            session.post(proxy.url, json=chat("late", stream=True, temperature=1), headers=HEADERS)
        )
        await asyncio.wait_for(proxy.taken.wait(), WAIT)
        proxy.app[DRAINING].active = True
        proxy.head.set()
        resp = await asyncio.wait_for(call, WAIT)
        assert resp.status == 200
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT)
        assert resp.headers["connection"].lower() == "close"
        stop = asyncio.create_task(proxy.runner.cleanup())
        rest = await asyncio.wait_for(resp.content.read(), WAIT)
        resp.release()
        await asyncio.wait_for(stop, WAIT)
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_a_whole_answer_sent_while_stopping_says_its_connection_closes(
    tmp_path: Path,
) -> None:
    """The stream test's twin for a whole answer, which the pipeline hands to
    the transport before its handler returns (boundary.hand_over, with the
    pipeline's DRAINING): a stop begun while its origin worked closes the
    connection after it, as the error boundary would decide after the handler."""
    taken = asyncio.Event()
    answer = asyncio.Event()

    async def whole(request: web.Request) -> web.Response:
        await request.read()
        taken.set()
        await answer.wait()
        return web.json_response(COMPLETION)

    origin_app = web.Application()
    origin_app.router.add_post("/v1/chat/completions", whole)
    origin = TestServer(origin_app)
    await origin.start_server()
    served = await serve_on_edge(tmp_path, str(origin.make_url("/v1")))
    url = f"http://127.0.0.1:{served.port}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(
                session.post(url, json=chat("late", temperature=1), headers=HEADERS)
            )
            await asyncio.wait_for(taken.wait(), WAIT)
            served.app[DRAINING].active = True
            answer.set()
            resp = await asyncio.wait_for(call, WAIT)
            assert resp.status == 200
            assert (await resp.json())["choices"] == COMPLETION["choices"]
            assert resp.headers["connection"].lower() == "close"
    finally:
        await served.runner.cleanup()
        await origin.close()


@pytest.mark.parametrize("expect100", [False, True], ids=["plain", "expect-100-continue"])
async def test_an_answer_not_begun_when_the_stop_cancels_it_is_a_503(
    proxy: Stopping, expect100: bool
) -> None:
    """(Review 36 asked whether a client that was sent `100 Continue` gets
    it: aiohttp counts that interim answer as no output, so it does.)"""
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(
            session.post(
                proxy.url,
                json=chat("whole", temperature=1),
                headers=HEADERS,
                expect100=expect100,
            )
        )
        await asyncio.wait_for(proxy.first_sent.wait(), WAIT)
        stop = asyncio.create_task(proxy.stop())
        resp = await asyncio.wait_for(call, WAIT)
        body = await resp.json()
        await asyncio.wait_for(stop, WAIT)
    assert resp.status == 503
    assert body["error"]["code"] == "proxy_stopping"
    assert resp.headers["connection"].lower() == "close"
    assert resp.headers["x-request-id"]
    # Review 36: as every error answer, what the cache step decided.
    assert resp.headers["x-ponto-cache"] == "bypass"
    assert proxy.origin_calls == [False]  # not retried on another origin
    # Review 36: counted as the 503 the client got, not as a 499.
    registry = proxy.app[METRICS].registry
    counts = {
        code: registry.get_sample_value(
            "ponto_requests_total", {"endpoint": "chat.completions", "code": code}
        )
        for code in ("499", "503")
    }
    assert counts == {"499": None, "503": 1.0}


async def test_a_client_that_left_is_sent_nothing(
    proxy: Stopping, caplog: pytest.LogCaptureFixture
) -> None:
    """A client whose connection closed during the drain: its handler's
    cancellation is its leaving, and the stop neither writes to it nor logs
    anything of it. (Whether a write is tried is not seen on the wire, its
    transport being closed: `stopping` is tested on its own.)"""
    port = int(proxy.url.rsplit(":", 1)[1].split("/")[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = json.dumps(chat("gone", stream=True, temperature=1)).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY.key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    await writer.drain()
    await asyncio.wait_for(reader.readuntil(b"par"), WAIT)
    proxy.app[DRAINING].active = True
    writer.close()  # the client leaves
    server = proxy.runner.server
    assert server is not None
    while server.connections:  # until the server saw it go
        await asyncio.sleep(0.01)
    await asyncio.wait_for(proxy.runner.cleanup(), WAIT)
    # (The control plane here, 127.0.0.1:9, never answers: its link's warning.)
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in problems if not r.name.startswith("dataplane.sync")] == []


@pytest.mark.parametrize("temperature", [0, 1], ids=["a-flights-leader", "uncached"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_request_whose_client_left_mid_answer_is_freed_without_a_collection(
    proxy: Stopping, stream: bool, temperature: int
) -> None:
    """With the garbage collector off, a request whose client closed its
    connection mid-answer (a stream after its head, a whole answer before
    it) is freed once its connection's task ends: its body (megabytes for
    a document) is not held until a full collection. A flight's leader with
    no follower: its flight ends with it."""
    gc.collect()
    gc.disable()
    try:
        port = int(proxy.url.rsplit(":", 1)[1].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = json.dumps(chat("x " * 50_000, stream=stream, temperature=temperature)).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY.key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        await asyncio.wait_for(proxy.first_sent.wait(), WAIT)
        if stream:
            await asyncio.wait_for(reader.readuntil(b"par"), WAIT)
        server = proxy.runner.server
        assert server is not None
        [conn] = server.connections
        request, task = conn._current_request, conn._task_handler
        assert request is not None and task is not None
        freed = weakref.ref(request)
        ended = asyncio.Event()
        task.add_done_callback(lambda _: ended.set())
        del request, task, conn
        writer.close()  # the client leaves
        await asyncio.wait_for(ended.wait(), WAIT)
        assert freed() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("temperature", [0, 1], ids=["a-flights-leader", "uncached"])
async def test_a_whole_answer_whose_client_left_before_it_is_shown_at_its_estimate(
    proxy: Stopping, temperature: int
) -> None:
    """Trial 98: a phone's SDK timed out waiting for an answer the origin
    had the prompt of, as each of its retries did. The limits and budgets
    keep the prompt's estimate (no count: Admission.release(None)), and the
    metrics show it too, the proxy's; they showed nothing."""
    with_day_budget(proxy)
    body = chat("left waiting", temperature=temperature)
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(session.post(proxy.url, json=body, headers=HEADERS))
        await asyncio.wait_for(proxy.first_sent.wait(), WAIT)  # the origin has the prompt
        call.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await call
    get = proxy.app[METRICS].registry.get_sample_value
    left = {"endpoint": "chat.completions", "code": "499"}
    await until(lambda: get("ponto_requests_total", left) == 1)
    who = {"tenant": "acme"}  # no key label: metrics on the public port
    estimate = estimate_prompt_tokens("chat.completions", body)
    for name in ("ponto_tenant_tokens_total", "ponto_tenant_estimated_tokens_total"):
        assert get(name, {**who, "kind": "prompt"}) == estimate > 0
        assert get(name, {**who, "kind": "completion"}) is None
    [spent] = proxy.app[PIPELINE].limiter.counts().values()
    assert spent.day_tokens == estimate


def with_day_budget(proxy: Stopping) -> None:
    """The proxy's table again, its key with a day budget (counted from 0)."""
    t = table([("o1", proxy.origin_url)], version=2, limited=False)
    t.keys[0].limits.CopyFrom(pb.Limits(tokens_per_day=100_000))
    t.etag = content_etag(t)
    proxy.app[HOLDER].apply(t, "control-plane")


class WaitingRegion:
    """A region where another proxy leads every flight and never answers: a
    whole answer's request waits for it (EdgeCache._lead) as long as its
    client does, and no origin is called."""

    def __init__(self) -> None:
        self.waiting = asyncio.Event()

    async def claim(self, key: str, tenant: str, model: str) -> bool:
        return False

    async def follow(self, key: str, tenant: str, model: str, *, max_wait_s: float) -> None:
        self.waiting.set()
        await asyncio.sleep(3600)


async def test_a_request_whose_client_left_before_any_origin_call_is_charged_nothing(
    proxy: Stopping, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its client left while it followed another proxy's flight (a region's
    follower), before any origin had its prompt: charged 0, as a follower
    of this proxy's flight and a cache hit are. It kept the prompt's
    estimate against its key's budgets and limits, which neither its access
    line nor the metrics showed (review 424)."""
    with_day_budget(proxy)
    region = WaitingRegion()
    monkeypatch.setattr(proxy.app[PIPELINE].cache, "region", region)
    body = chat("word " * 200)  # a whole answer, keyed: it claims the region's flight
    async with aiohttp.ClientSession() as session:
        call = asyncio.create_task(session.post(proxy.url, json=body, headers=HEADERS))
        await asyncio.wait_for(region.waiting.wait(), WAIT)
        call.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await call
    get = proxy.app[METRICS].registry.get_sample_value
    await until(
        lambda: get("ponto_requests_total", {"endpoint": "chat.completions", "code": "499"}) == 1
    )
    assert proxy.origin_calls == []
    # Only scopes charged tokens this month are counted: none.
    assert proxy.app[PIPELINE].limiter.counts() == {}
    assert get("ponto_tenant_tokens_total", {"tenant": "acme", "kind": "prompt"}) is None


async def test_a_follower_whose_client_left_is_charged_nothing(proxy: Stopping) -> None:
    """A follower is a hit, charged 0 (README, "Identical requests in
    flight"), also when its client leaves before the flight's end (trial 98:
    a phone that asks again while the answer is under way and drops again).
    It kept the prompt's estimate against its key, which no metric showed.
    The key's day budget is read before it came and after it left: a count,
    not a bucket that refills meanwhile."""
    with_day_budget(proxy)
    body = chat("word " * 2000, stream=True)  # estimated at thousands of tokens
    limiter = proxy.app[PIPELINE].limiter
    async with (
        aiohttp.ClientSession() as a,
        aiohttp.ClientSession() as b,
        a.post(proxy.url, json=body, headers=HEADERS) as leader,
    ):
        await asyncio.wait_for(leader.content.readuntil(b"\n\n"), WAIT)
        [before] = limiter.counts().values()  # the leader's charge, its stream under way
        async with b.post(proxy.url, json=body, headers=HEADERS) as follower:
            assert follower.headers.get("x-ponto-coalesced") == "1"
            await asyncio.wait_for(follower.content.readuntil(b"\n\n"), WAIT)
        # Its client left: settled once its handler ends.
        get = proxy.app[METRICS].registry.get_sample_value
        await until(
            lambda: (
                get("ponto_requests_total", {"endpoint": "chat.completions", "code": "499"}) == 1
            )
        )
        [after] = limiter.counts().values()
    assert before.day_tokens > 0
    assert after.day_tokens == before.day_tokens


async def test_a_flights_leader_and_follower_cancelled_by_the_stop_are_told_so(
    proxy: Stopping,
) -> None:
    """Two clients of one flight (one origin call), both still reading when
    the stop cancels them: each stream ends with `proxy_stopping`. Here the
    stop cancels the follower's own handler first (reply.follow's
    cancellation path); the other order, its leader first, comes in no set
    order from a real stop and is tested on reply.follow below."""
    body = chat("followed", stream=True, temperature=0)
    async with (
        aiohttp.ClientSession() as a,
        aiohttp.ClientSession() as b,
        a.post(proxy.url, json=body, headers=HEADERS) as leader,
        b.post(proxy.url, json=body, headers=HEADERS) as follower,
    ):
        for resp in (leader, follower):
            assert resp.status == 200
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT)
        assert follower.headers.get("x-ponto-coalesced") == "1"
        stop = asyncio.create_task(proxy.stop())
        rests = [await asyncio.wait_for(r.content.read(), WAIT) for r in (leader, follower)]
        await asyncio.wait_for(stop, WAIT)
    assert proxy.origin_calls == [True]
    for rest in rests:
        events = [e for e in rest.decode().split("\n\n") if e]
        assert json.loads(events[0][len("data: ") :])["error"]["code"] == "proxy_stopping", rest
        assert events[-1] == "data: [DONE]"


@dataclass
class Flight:
    """A flight's follower answered by reply.follow on its own (aiohttp's
    test server), its leader driven by the test."""

    app: web.Application
    leader: Leader
    response: aiohttp.ClientResponse
    following: asyncio.Task[tuple[web.StreamResponse, bool] | None]

    def stop(self) -> None:
        self.app[DRAINING].active = True


@pytest.fixture
async def flight() -> AsyncIterator[Flight]:
    table = two_region_table(home_healthy=True)
    coalescer = Coalescer()
    leader = coalescer.join("k")
    assert isinstance(leader, Leader)
    tasks: list[asyncio.Task[tuple[web.StreamResponse, bool] | None]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        ex = Exchange(
            ENDPOINTS["chat.completions"],
            request.headers,
            None,
            "id",
            build_routes(table, "near"),
            build_policy(table),
        )
        ex.stream = True
        follower = coalescer.join("k")
        assert isinstance(follower, Follower)
        # A task of its own, which the test may cancel as the stop would.
        tasks.append(asyncio.create_task(follow(request, ex, follower)))
        answered = await tasks[0]
        assert answered is not None
        return answered[0]

    app = web.Application()
    app[DRAINING] = Draining()
    app.router.add_post("/", handler)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        call = asyncio.create_task(session.post(server.make_url("/")))
        while not coalescer.stats.followers:
            await asyncio.sleep(0.01)
        leader.chunk(b"data: " + json.dumps(FIRST_CHUNK).encode() + b"\n\n")
        resp = await asyncio.wait_for(call, WAIT)
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT)
        yield Flight(app, leader, resp, tasks[0])
        resp.release()


async def test_a_follower_whose_leader_the_stop_cancelled_first_is_told_so(
    flight: Flight,
) -> None:
    """The flight's leader cancelled while this follower's handler still runs
    (the stop's cancellations come in no set order): its flight failed, and it
    ended `upstream_stream_broken`, as if the origin had broken the stream.
    The proxy stopping, it is told so."""
    flight.stop()
    flight.leader.finish(None, asyncio.CancelledError())  # the stop cancelled the leader
    rest = await asyncio.wait_for(flight.response.content.read(), WAIT)
    events = [e for e in rest.decode().split("\n\n") if e]
    assert json.loads(events[0][len("data: ") :])["error"]["code"] == "proxy_stopping", rest
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize("how", ["leader-cancelled", "follower-cancelled"])
async def test_a_follower_that_has_the_whole_answer_is_sent_nothing_more(
    flight: Flight, how: str
) -> None:
    """Review 36: a follower that had written `[DONE]`, waiting for the
    flight's outcome (its leader storing the answer), was sent an error
    event and a second `[DONE]` when the stop cancelled it or its leader."""
    flight.leader.chunk(b"data: [DONE]\n\n")
    await asyncio.wait_for(flight.response.content.readuntil(b"data: [DONE]\n\n"), WAIT)
    flight.stop()
    if how == "leader-cancelled":
        flight.leader.finish(None, asyncio.CancelledError())
    else:
        flight.following.cancel()
    assert await asyncio.wait_for(flight.response.content.read(), WAIT) == b""


def test_stopping_is_the_servers_cancellation_of_a_client_still_there() -> None:
    """`stopping` decides whether a cancelled stream is written its
    `proxy_stopping` ending: only while draining, to a transport still open."""
    app = web.Application()
    app[DRAINING] = Draining()
    transport = mock.Mock()
    transport.is_closing.return_value = False
    request = make_mocked_request("POST", "/", app=app, transport=transport)
    assert not stopping(request)  # not draining: a cancellation is the client's
    app[DRAINING].active = True
    assert stopping(request)
    transport.is_closing.return_value = True  # the client left
    assert not stopping(request)


async def test_a_followers_error_event_the_stop_cuts_still_ends_the_stream(
    flight: Flight, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 38: the stop's cancellation, landing while the client took a
    follower's error event (its flight failed), left the chunked body
    without its last chunk (curl rc=18, aiohttp's ClientPayloadError)."""
    real = web.StreamResponse.write
    taking = asyncio.Event()

    async def slowly(self: web.StreamResponse, data: bytes) -> None:
        await real(self, data)
        if b"upstream_stream_broken" in data:
            taking.set()
            await asyncio.Event().wait()  # the client takes the ending slowly

    monkeypatch.setattr(web.StreamResponse, "write", slowly)
    flight.leader.finish(None, RuntimeError("the origin broke the stream"))
    await asyncio.wait_for(taking.wait(), WAIT)
    flight.stop()
    flight.following.cancel()
    rest = await asyncio.wait_for(flight.response.content.read(), WAIT)
    assert b"upstream_stream_broken" in rest and rest.endswith(b"data: [DONE]\n\n")
