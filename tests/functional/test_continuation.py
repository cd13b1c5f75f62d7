"""Mid-stream continuation in one process: the proxy's app and scripted origins
on aiohttp test servers.

An origin that breaks a stream after the client had bytes (a cut, a stall past
the idle timeout, an in-band error) is replaced by the next origin that accepts
continuations; the client reads one stream with the first origin's identity,
the whole text once, one finish reason and usage that adds both calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from dataplane.http.errors import UPSTREAM_SLOW, UPSTREAM_UNANSWERED
from dataplane.http.server import build_app
from dataplane.http.state import ACCESS_LOG, HOLDER, METRICS, PIPELINE, QUOTA
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from dataplane.settings import parse as parse_proxy
from dataplane.upstream.forwarder import MAX_HELD_BEFORE_EVENT
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

MODEL = "m"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def event(ident: str, content: str | None = None, *, role: bool = False,
          finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:  # fmt: skip
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    body: dict[str, Any] = {
        "id": ident,
        "object": "chat.completion.chunk",
        "created": 1000 if ident == "first" else 2000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        body = {**body, "choices": [], "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Origin:
    """A scripted origin: records request bodies, answers with `handler`."""

    def __init__(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._handler = handler
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/responses", self._handle)
        self.server = TestServer(app)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        return await self._handler(request)


def hangs(started: asyncio.Event) -> Handler:
    """An origin that sets `started` and answers nothing until it is cut."""

    async def hang(request: web.Request) -> web.StreamResponse:
        started.set()
        await asyncio.sleep(30)
        raise AssertionError("not cut")

    return hang


def whole_chat(ident: str) -> Handler:
    """An origin answering a whole chat completion of id `ident`, "world"."""

    async def whole(request: web.Request) -> web.StreamResponse:
        return web.json_response({
            "id": ident, "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "world"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })  # fmt: skip

    return whole


async def sse(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await out.prepare(request)
    return out


async def first_origin(how: str) -> Origin:
    async def handler(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "", role=True) + event("first", "Hel"))
        await out.write(event("first", "lo"))
        if how != "error":  # half an event, then the failure: the client must never see it
            await out.write(event("first", " wo")[:20])
        if how == "cut":
            assert request.transport is not None
            request.transport.close()
        elif how == "stall":
            await asyncio.sleep(30)
        elif how == "error":
            await out.write(b'data: {"error": {"message": "engine died"}}\n\n')
            await asyncio.sleep(30)
        return out

    return Origin(handler)


async def second_origin() -> Origin:
    async def handler(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        body = await request.json()
        usage = {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
        wants_usage = (body.get("stream_options") or {}).get("include_usage")
        await out.write(
            event("second", "", role=True)
            + event("second", " wor")
            + event("second", "ld")
            + event("second", finish="stop")
            + (event("second", usage=usage) if wants_usage else b"")
            + b"data: [DONE]\n\n"
        )
        await out.write_eof()
        return out

    return Origin(handler)


def table(origins: list[tuple[str, str, bool]], streams: pb.StreamPolicy) -> pb.RouteTable:
    """Each origin in a region of its own, farther from the proxy's (r0) the
    later it is listed: the order of candidates is the order given."""
    t = pb.RouteTable(
        version=5,
        regions=[pb.Region(name=f"r{i}", latitude=0, longitude=i) for i in range(len(origins))],
        origins=[
            pb.Origin(
                name=n,
                base_url=u,
                region=f"r{i}",
                models=[MODEL],
                weight=100,
                healthy=True,
                no_continuation=not c,
            )
            for i, (n, u, c) in enumerate(origins)
        ],
        tenants=[pb.Tenant(name="default", streams=streams)],
    )
    t.etag = content_etag(t)
    return t


class Proxy:
    def __init__(
        self, client: TestClient[web.Request, web.Application], table: pb.RouteTable
    ) -> None:
        self.client = client
        self.table = table  # the one applied

    def mark_unhealthy(self, name: str) -> None:
        """Apply the table again with origin `name` unhealthy, as the leader's probes mark it."""
        t = pb.RouteTable()
        t.CopyFrom(self.table)
        t.version += 1
        for o in t.origins:
            if o.name == name:
                o.healthy, o.health_detail = False, "probe timed out"
        t.etag = content_etag(t)
        self.app[HOLDER].apply(t, "control-plane")
        self.table = t

    @property
    def app(self) -> web.Application:
        return self.client.app

    async def stream(self, **body: Any) -> tuple[list[dict[str, Any]], str]:
        request = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "say hello world"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 50,
            **body,
        }
        resp = await self.client.post("/v1/chat/completions", json=request)
        assert resp.status == 200
        raw = (await resp.read()).decode()
        frames = [f for f in raw.split("\n\n") if f]
        assert all(f.startswith("data: ") for f in frames), raw
        assert frames[-1] == "data: [DONE]"
        return [json.loads(f[6:]) for f in frames[:-1]], raw


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    servers: list[TestServer] = []
    clients: list[TestClient[web.Request, web.Application]] = []

    async def make(
        origins: list[tuple[Origin, bool]],
        streams: pb.StreamPolicy | None = None,
        idle: str = "0.3",
        extra: Sequence[str] = (),
    ) -> Proxy:
        rows = []
        for i, (origin, continuation) in enumerate(origins):
            await origin.server.start_server()
            servers.append(origin.server)
            rows.append((f"o{i}", str(origin.server.make_url("/v1")), continuation))
        settings = parse_proxy([
            "--region=r0", "--name=p", "--control-plane=127.0.0.1:9",
            f"--state-dir={tmp_path}", f"--stream-idle-timeout={idle}",
            "--metrics-key-labels=on",  # token accounting is read per key below
            *extra,
        ])  # fmt: skip
        client = TestClient(TestServer(build_app(settings)))
        await client.start_server()
        clients.append(client)
        app = client.app
        applied = table(rows, streams or pb.StreamPolicy())
        app[HOLDER].apply(applied, "control-plane")
        app[QUOTA].on_quota(pb.QuotaShares(generation=1, default_fraction=1.0))
        return Proxy(client, applied)

    yield make
    for client in clients:
        await client.close()
    for server in servers:
        await server.close()


def operations(p: Proxy) -> dict[tuple[str, str], float]:
    """gen_ai_client_operation_duration_seconds counts by (error_type, ponto_region)."""
    registry = p.app[METRICS].registry
    return {
        (s.labels["error_type"], s.labels["ponto_region"]): s.value
        for family in registry.collect()
        if family.name == "gen_ai_client_operation_duration_seconds"
        for s in family.samples
        if s.name.endswith("_count")
    }


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("how", ["cut", "stall", "error"])
async def test_a_broken_stream_goes_on_at_the_next_origin_as_one_stream(
    proxy: Callable[..., Awaitable[Proxy]], how: str
) -> None:
    a, b = await first_origin(how), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(hedge_ms=0))
    chunks, raw = await p.stream()
    assert "error" not in raw
    assert text_of(chunks) == "Hello world"
    assert {c["id"] for c in chunks} == {"first"}
    assert {c["created"] for c in chunks} == {1000}
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 1
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finishes] == ["stop"]
    assert finishes[0]["ponto"] == {"continued": 1}
    # Usage adds both calls: the continuation's prompt (12) held the original
    # prompt (12 - 2 tokens sent) and the text so far.
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 12 + 10,
        "completion_tokens": 2 + 2,
        "total_tokens": 26,
    }
    # What the second origin was asked.
    asked = b.bodies[0]
    assert asked["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert asked["continue_final_message"] is True
    assert asked["add_generation_prompt"] is False
    assert asked["max_tokens"] == 48
    metrics = p.app[METRICS]
    assert metrics.continuations.labels("ok").value == 1
    # The GenAI metrics name the region of the origin that finished the stream.
    assert operations(p) == {("", "r1"): 1.0}


async def test_continuation_off_ends_with_the_error_event(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(continuation="off"))
    chunks, _ = await p.stream()
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert not b.bodies
    assert operations(p) == {("stream_cut", "r0"): 1.0}


async def test_a_stall_without_continuation_ends_with_the_error_event_after_the_idle_timeout(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    # The relay that passes the origin's bytes through (no continuation) has
    # its own read loop; its idle timeout cuts the stall too.
    a, b = await first_origin("stall"), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(continuation="off"), idle="0.2")
    with caplog.at_level(logging.WARNING):
        chunks, raw = await p.stream()
    assert text_of(chunks[:-1]) == "Hello"  # the half event never reached the client
    assert " wo" not in raw
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert not b.bodies
    cuts = [r.getMessage() for r in caplog.records if "cut a stream" in r.getMessage()]
    assert len(cuts) == 1 and "no chunk for 0.2 s" in cuts[0], cuts
    assert "not continued: the tenant turned continuation off" in cuts[0]
    assert operations(p) == {("stream_cut", "r0"): 1.0}


async def test_only_origins_that_accept_continuations_are_asked(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, False)])
    chunks, _ = await p.stream()
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert not b.bodies
    metrics = p.app[METRICS]
    assert metrics.continuations.labels("refused").value == 1


async def test_a_tool_call_cut_mid_argument_ends_cleanly_with_an_error_event(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    async def tool(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": '{"ci'}}  # fmt: skip
        chunk = {"id": "first", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"tool_calls": [call]},
                              "finish_reason": None}]}  # fmt: skip
        await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        assert request.transport is not None
        request.transport.close()
        return out

    b = await second_origin()
    p = await proxy([(Origin(tool), True), (b, True)])
    chunks, _ = await p.stream()
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"ci'
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert not b.bodies


def transcripts(p: Proxy) -> tuple[float | None, float | None]:
    """What streams' transcripts hold, and how many the proxy's bound dropped."""
    registry = p.app[METRICS].registry
    return (
        registry.get_sample_value("ponto_stream_transcript_bytes"),
        registry.get_sample_value("ponto_stream_transcripts_dropped_total", {"bound": "proxy"}),
    )


async def test_a_stream_past_the_proxys_transcript_bound_is_not_continued(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    # Trial 74: memory for continuations grew with the streams held; past
    # --max-transcripts-mb a stream keeps no transcript, as past its own 4 MiB.
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)], extra=["--max-transcripts-mb=0"])
    with caplog.at_level(logging.WARNING):
        chunks, _ = await p.stream()
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert not b.bodies
    assert p.app[METRICS].continuations.labels("refused").value == 1
    assert transcripts(p) == (0.0, 1.0)
    assert any("--max-transcripts-mb" in r.getMessage() for r in caplog.records)


async def test_a_streams_transcript_is_given_back_however_the_stream_ends(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)])
    chunks, _ = await p.stream()
    assert text_of(chunks) == "Hello world"  # continued: its transcript was read
    assert transcripts(p) == (0.0, 0.0)
    # A client that leaves mid-stream: its handler is cancelled.
    sent = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "", role=True) + event("first", "Hel"))
        sent.set()
        await asyncio.sleep(30)
        return out

    p = await proxy([(Origin(held), True), (await second_origin(), True)], idle="30")
    resp = await p.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert resp.status == 200
    await asyncio.wait_for(sent.wait(), 10)
    await resp.content.readuntil(b"Hel")
    assert (transcripts(p)[0] or 0) > 0  # the events relayed so far
    resp.close()
    async with asyncio.timeout(10):
        while transcripts(p)[0] != 0:
            await asyncio.sleep(0.01)


async def test_the_limit_of_continuations_holds(proxy: Callable[..., Awaitable[Proxy]]) -> None:
    origins = [await first_origin("cut") for _ in range(3)]
    p = await proxy([(o, True) for o in origins], pb.StreamPolicy(max_continuations=1))
    chunks, _ = await p.stream()
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert sum(len(o.bodies) for o in origins) == 2  # the first call and one continuation


async def test_without_a_usage_chunk_the_continuation_prompt_is_still_charged(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = await first_origin("cut"), await second_origin()
    # Origins asked for usage only when the client asks: none is sent here.
    p = await proxy([(a, True), (b, True)], extra=["--origin-stream-usage=client"])
    chunks, _ = await p.stream(stream_options=None)
    assert b.bodies[0]["stream_options"] is None  # as the client sent it
    assert text_of(chunks) == "Hello world"
    assert all(c.get("usage") is None for c in chunks)
    estimate = estimate_prompt_tokens("chat.completions", a.bodies[0])
    metrics = p.app[METRICS]
    # The first call's prompt, and the continuation's: that prompt plus the
    # two tokens already sent; completion: the events that carried text.
    assert metrics.tenant_tokens.labels("default", "-", "prompt").value == 2 * estimate + 2
    assert metrics.tenant_tokens.labels("default", "-", "completion").value == 4


async def test_a_continued_stream_is_counted_by_the_usage_its_client_did_not_ask_for(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """--origin-stream-usage always (the default): the continuation is asked
    for its usage too, which the proxy sums with the first call's prompt
    and counts; the client, which did not ask, is shown none of it."""
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)])
    chunks, raw = await p.stream(stream_options=None)
    assert text_of(chunks) == "Hello world"
    assert '"usage"' not in raw
    assert a.bodies[0]["stream_options"] == b.bodies[0]["stream_options"] == {"include_usage": True}
    metrics = p.app[METRICS]
    # As the summed usage a client that asked gets (see the first test).
    assert metrics.tenant_tokens.labels("default", "-", "prompt").value == 12 + 10
    assert metrics.tenant_tokens.labels("default", "-", "completion").value == 2 + 2


@pytest.mark.parametrize("usage", [True, False], ids=["include-usage", "no-usage"])
async def test_a_budget_spent_at_the_cut_ends_the_stream_with_its_usage_if_asked(
    proxy: Callable[..., Awaitable[Proxy]], usage: bool
) -> None:
    """Trial 28: when the tokens sent were the whole max_tokens, the proxy
    ends the stream itself (no origin is asked), and a client that asked for
    include_usage got no usage chunk: the SDK's `usage` stayed None. The
    answer, which the proxy ended, is not kept, as one cut by its max_tokens
    (note 28: it was counted as "incomplete")."""
    a, b = await first_origin("cut"), await second_origin()
    p = await proxy([(a, True), (b, True)])
    options = {"include_usage": True} if usage else None
    chunks, _ = await p.stream(max_tokens=2, stream_options=options, temperature=0)
    assert b.bodies == []
    unkept = p.app[METRICS].cache_unkept
    assert (unkept.labels("truncated").value, unkept.labels("incomplete").value) == (1, 0)
    assert text_of(chunks) == "Hello"
    finishes = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finishes] == ["length"]
    assert {c["id"] for c in chunks} == {"first"}
    if not usage:
        assert all("usage" not in c for c in chunks)
        return
    assert finishes[0]["usage"] is None
    estimate = estimate_prompt_tokens("chat.completions", a.bodies[0])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": estimate,
        "completion_tokens": 2,
        "total_tokens": estimate + 2,
    }
    assert last["ponto"] == {"usage": "estimated"}


async def test_a_connection_dropped_after_done_is_a_whole_answer(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    async def done_then_drop(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "", role=True) + event("first", "Hi") + b"data: [DONE]\n\n")
        assert request.transport is not None
        request.transport.close()  # no chunked terminator
        return out

    b = await second_origin()
    p = await proxy([(Origin(done_then_drop), True), (b, True)])
    chunks, raw = await p.stream(stream_options=None)
    assert raw.count("[DONE]") == 1 and "error" not in raw
    assert text_of(chunks) == "Hi"
    assert not b.bodies


async def test_a_continuation_that_sends_garbage_ends_with_the_error_event(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(b'data: {"choices": [null]}\n\ndata: [DONE]\n\n')
        await out.write_eof()
        return out

    a = await first_origin("cut")
    p = await proxy([(a, True), (Origin(garbage), True)])
    chunks, _ = await p.stream()
    assert text_of(chunks[:-1]) == "Hello"
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"


async def test_a_client_that_leaves_during_a_continuation_call_has_it_on_its_line(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    """The continuation's call was sent (the origin counts it, and the proxy
    counts it `cancelled`): the request's 499 line counts it among its
    attempts, as it counts a first call cut short (Forwarder.forward's Sent)."""
    a = await first_origin("cut")

    async def slow(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)  # no headers before the client leaves
        return web.Response()

    b = Origin(slow)
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(hedge_ms=0), extra=["--access-log=on"])
    capfd.readouterr()
    resp = await p.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert resp.status == 200
    for _ in range(500):
        if b.bodies:
            break
        await asyncio.sleep(0.01)
    assert b.bodies, "the continuation was not sent"
    resp.close()
    registry = p.app[METRICS].registry
    labels = {"endpoint": "chat.completions", "code": "499"}
    for _ in range(500):
        if registry.get_sample_value("ponto_requests_total", labels):
            break
        await asyncio.sleep(0.01)
    p.app[ACCESS_LOG].flush()
    [line] = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith("{")]
    assert (line["status"], line["attempts"]) == (499, 2)
    cancelled = {"origin": "o1", "outcome": "cancelled"}
    assert registry.get_sample_value("ponto_upstream_attempts_total", cancelled) == 1


@pytest.mark.parametrize("head", [True, False], ids=["head-then-nothing", "nothing"])
async def test_an_origin_silent_before_its_first_chunk_is_left_after_the_idle_timeout(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture, head: bool
) -> None:
    """Trial 21: an origin that sent its head and then nothing held the client
    for its whole stall (up to --read-timeout, 300 s), the idle timeout
    applying only once a first chunk had come. Before that first chunk the
    client has nothing, so the next origin is simply asked."""

    async def silent(request: web.Request) -> web.StreamResponse:
        if head:
            out = await sse(request)
            await asyncio.sleep(30)
            return out
        await asyncio.sleep(30)
        raise AssertionError("the proxy waited")

    a, b = Origin(silent), await second_origin()
    p = await proxy([(a, True), (b, True)], idle="0.2")
    with caplog.at_level(logging.WARNING):
        chunks, raw = await p.stream()
    assert text_of(chunks) == " world"  # the second origin's whole answer
    assert {c["id"] for c in chunks} == {"second"}
    assert "continued" not in raw
    assert (len(a.bodies), len(b.bodies)) == (1, 1)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "sent no first chunk within 0.2 s (the stream idle timeout)" in said, said


async def test_an_origin_that_sends_only_comments_before_its_first_event_is_left(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Trial 51: an origin that sent a comment (`: ping`, a keep-alive while
    it queues) and then stalled had committed the stream with its first
    bytes, and the stall cut it with an error event. Comments are not the
    answer: the next origin is asked, and the client sees none of them."""

    async def ping_then_stall(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(b": ping\n\n")
        await asyncio.sleep(0.1)
        await out.write(b": ping\r\n\r\n")
        await asyncio.sleep(30)
        return out

    a, b = Origin(ping_then_stall), await second_origin()
    p = await proxy([(a, False), (b, False)], idle="0.3")
    chunks, raw = await p.stream()
    assert text_of(chunks) == " world" and "ping" not in raw
    assert (len(a.bodies), len(b.bodies)) == (1, 1)


async def test_an_origin_that_pings_past_the_first_chunk_timeout_is_left(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    """Review 199: each comment started the first chunk's timeout again (it
    is per read), so an origin that kept pinging and sent no event was held
    to the request's deadline. Comments do not make an answer: past the
    first-chunk timeout, counted from the call, the next origin is asked."""

    async def pings(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        for _ in range(300):
            await out.write(b": ping\n\n")
            await asyncio.sleep(0.05)
        return out

    a, b = Origin(pings), await second_origin()
    p = await proxy([(a, False), (b, False)], idle="0.4")
    with caplog.at_level(logging.WARNING):
        chunks, raw = await p.stream()
    assert text_of(chunks) == " world" and "ping" not in raw
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "sent no event of its answer within 0.4 s (only comments" in said, said


async def test_an_error_labelled_an_event_stream_is_passed_on_as_it_comes(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Review 199: a 400 whose body (no event) came as text/event-stream was
    held for an event, and became a 502 counted against its origin."""

    async def refuses(request: web.Request) -> web.StreamResponse:
        body = b'{"error": {"message": "bad temperature", "type": "invalid_request_error"}}'
        return web.Response(status=400, body=body, content_type="text/event-stream")

    a, b = Origin(refuses), await second_origin()
    p = await proxy([(a, False), (b, False)])
    resp = await p.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert resp.status == 400
    assert (len(a.bodies), len(b.bodies)) == (1, 0)


@pytest.mark.parametrize("continuation", [True, False])
async def test_a_stream_whose_first_event_is_an_error_is_asked_of_the_next_origin(
    proxy: Callable[..., Awaitable[Proxy]], continuation: bool
) -> None:
    """Review 201: a whole answer that is an error is a failed attempt; a
    stream whose first event is one was relayed (without continuations, the
    origin's error text reached the client as it came)."""

    async def fails(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(
            b'data: {"error": {"message": "engine died at gpu-17", "type": "server_error"}}\n\n'
        )
        await asyncio.sleep(30)
        return out

    a, b = Origin(fails), await second_origin()
    p = await proxy([(a, continuation), (b, continuation)])
    chunks, raw = await p.stream()
    assert text_of(chunks) == " world" and "gpu-17" not in raw
    assert (len(a.bodies), len(b.bodies)) == (1, 1)


async def test_an_origin_that_sends_half_its_first_event_and_stalls_is_left(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    """The first event is held until whole (what it says is read: an error
    may be): an origin that stops inside it is as late as a silent one, and
    the next origin is asked (it committed the stream, which the stall then
    cut)."""

    async def half(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("a", "", role=True)[:30])
        await asyncio.sleep(30)
        return out

    a, b = Origin(half), await second_origin()
    p = await proxy([(a, False), (b, False)], idle="0.3")
    with caplog.at_level(logging.WARNING):
        chunks, raw = await p.stream()
    assert text_of(chunks) == " world" and '"a"' not in raw
    assert (len(a.bodies), len(b.bodies)) == (1, 1)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "or an event not yet whole)" in said, said


async def test_a_first_event_past_the_hold_bound_commits_the_stream(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Past MAX_HELD_BEFORE_EVENT the origin is taken to answer: its stream
    is relayed, and its slow first event is not timed as a first chunk."""
    content = "x" * (MAX_HELD_BEFORE_EVENT + 1024)

    async def long_first(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        whole = event("a", content, role=True)
        await out.write(whole[:-10])
        await asyncio.sleep(0.5)  # past the first-chunk timeout, within the idle one
        await out.write(whole[-10:] + event("a", finish="stop") + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    a, b = Origin(long_first), await second_origin()
    p = await proxy([(a, False), (b, False)], idle="2", extra=["--first-chunk-timeout", "0.2"])
    chunks, _ = await p.stream()
    assert text_of(chunks) == content
    assert (len(a.bodies), len(b.bodies)) == (1, 0)


async def test_a_first_event_error_is_read_as_the_relay_reads_events(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """The first event is read by the relay's SSE parser: after a byte order
    mark and a keep-alive, split across writes, its JSON over two data lines
    (one value, joined with LF), it is still the error it says (it was read
    from its first data line alone, and taken for an answer)."""

    async def fails(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(b"\xef\xbb")
        await asyncio.sleep(0.02)
        await out.write(b'\xbf: queued\r\n\r\ndata: {"error":\r\n')
        await asyncio.sleep(0.02)
        await out.write(b'data: {"message": "engine died at gpu-17", "type": "server_error"}}\r\n')
        await asyncio.sleep(0.02)
        await out.write(b"\r\n")
        await asyncio.sleep(30)
        return out

    a, b = Origin(fails), await second_origin()
    p = await proxy([(a, False), (b, False)])
    chunks, raw = await p.stream()
    assert text_of(chunks) == " world" and "gpu-17" not in raw
    assert (len(a.bodies), len(b.bodies)) == (1, 1)


async def test_a_responses_stream_whose_first_event_is_an_error_is_asked_of_the_next_origin(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    async def fails(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(responses_event("created", response={"id": "resp_a"}))
        await out.write(b'event: error\ndata: {"type": "error", "message": "boom at gpu-17"}\n\n')
        await asyncio.sleep(30)
        return out

    async def answers(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        done = {"id": "resp_b", "object": "response", "status": "completed", "output": []}
        await out.write(
            responses_event("created", response={"id": "resp_b"})
            + responses_event("output_text.delta", item_id="m", output_index=0, delta="Hi")
            + responses_event("completed", response=done)
        )
        await out.write_eof()
        return out

    a, b = Origin(fails), Origin(answers)
    p = await proxy([(a, False), (b, False)])
    resp = await p.client.post(
        "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}
    )
    raw = (await resp.read()).decode()
    assert resp.status == 200 and "gpu-17" not in raw and "resp_b" in raw, raw


async def test_an_origin_that_answers_after_comments_is_relayed_whole(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    async def ping_then_answer(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(b": queued\n\n")
        await asyncio.sleep(0.05)
        await out.write(event("a", "", role=True) + event("a", "Hi") + event("a", finish="stop"))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    a = Origin(ping_then_answer)
    p = await proxy([(a, False)])
    resp = await p.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert resp.status == 200
    raw = (await resp.read()).decode()
    assert raw.startswith("data: ") and raw.endswith("data: [DONE]\n\n"), raw
    assert '"content": "Hi"' in raw and ": queued" not in raw  # the relay passes no comment
    assert len(a.bodies) == 1


def responses_event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": f"response.{kind}", **fields})
    return f"event: response.{kind}\ndata: {data}\n\n".encode()


async def test_a_responses_stream_stalled_after_its_preamble_is_asked_of_the_next_origin(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Trial 51: a Responses stream sends response.created (and in_progress)
    before the model has run; a stall before its first output then ended
    the stream with an error event, where a chat stream went to the next
    origin."""

    def preamble(ident: str) -> bytes:
        response = {"id": ident, "object": "response", "status": "in_progress", "output": []}
        return responses_event("created", response=response) + responses_event(
            "in_progress", response=response
        )

    async def stalls(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(preamble("resp_a"))
        await asyncio.sleep(30)
        return out

    async def answers(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        done = {
            "id": "resp_b",
            "object": "response",
            "status": "completed",
            "output": [],
            "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4},
        }
        await out.write(
            preamble("resp_b")
            + responses_event("output_text.delta", item_id="m", output_index=0, delta="Hi")
            + responses_event("completed", response=done)
        )
        await out.write_eof()
        return out

    a, b = Origin(stalls), Origin(answers)
    p = await proxy([(a, False), (b, False)], idle="0.3")
    resp = await p.client.post(
        "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}
    )
    assert resp.status == 200
    raw = (await resp.read()).decode()
    assert "resp_a" not in raw and "error" not in raw, raw
    assert '"delta": "Hi"' in raw and "response.completed" in raw
    assert (len(a.bodies), len(b.bodies)) == (1, 1)


async def test_a_stream_no_origin_started_in_time_says_so(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Trial 32: a stream whose every origin sent no first chunk in time was
    told the origins "could not be reached"; they were, and did not answer."""
    p = await proxy(
        [(slow_first_origin(5.0), True)], idle="30", extra=["--first-chunk-timeout", "0.2"]
    )
    resp = await p.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["message"] == UPSTREAM_SLOW and error["code"] == "upstream_unavailable"


# ------------------------------------------- streams stalled on an unhealthy origin


def hanging_origin(started: asyncio.Event, *, trickle: int = 0, gap: float = 0.03) -> Origin:
    """Sends "Hello", then hangs (as a wedged GPU); with `trickle`, sends that
    many more chunks `gap` seconds apart instead and ends the answer itself."""

    async def handler(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "", role=True) + event("first", "Hel"))
        await out.write(event("first", "lo"))
        started.set()
        if not trickle:
            await asyncio.sleep(30)
        for _ in range(trickle):
            await asyncio.sleep(gap)
            await out.write(event("first", "."))
        await out.write(event("first", finish="stop") + b"data: [DONE]\n\n")
        return out

    return Origin(handler)


async def stream_while(p: Proxy, started: asyncio.Event, unhealthy: str) -> tuple[Any, str]:
    """A stream, with `unhealthy` marked so once its origin has sent a chunk;
    within 10 s (the idle timeout the tests set is 60 s)."""
    async with asyncio.timeout(10):
        streaming = asyncio.ensure_future(p.stream())
        await started.wait()
        p.mark_unhealthy(unhealthy)
        return await streaming


async def test_a_stream_stalled_on_an_origin_marked_unhealthy_goes_on_without_the_idle_wait(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 27: a hung origin's streams waited out --stream-idle-timeout (60
    s), though the leader marked it unhealthy within seconds. Once the table
    marks it so, a stream waiting on it is continued as soon as its wait
    passes --unhealthy-stream-idle-timeout."""
    started = asyncio.Event()
    a, b = hanging_origin(started), await second_origin()
    p = await proxy(
        [(a, True), (b, True)], idle="60", extra=["--unhealthy-stream-idle-timeout=0.05"]
    )
    with caplog.at_level(logging.INFO):
        chunks, raw = await stream_while(p, started, "o0")
    assert "error" not in raw
    assert text_of(chunks) == "Hello world"
    assert chunks[-2]["ponto"] == {"continued": 1}
    said = [r.getMessage() for r in caplog.records if "continued on o1" in r.getMessage()]
    assert len(said) == 1
    assert "no chunk for 0.05 s from an origin the route table marks unhealthy" in said[0]
    assert p.app[PIPELINE].stalls.streams("o0") == 0  # forgotten once ended


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "first-chunk"])
async def test_a_call_unanswered_by_an_origin_marked_unhealthy_goes_to_the_next(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """Trial 49: a request whose origin hung before answering (a whole answer,
    or a stream's first chunk) waited out the read timeout (300 s) or the
    first-chunk timeout, though the table marked the origin unhealthy within
    seconds. Once it does, the call is cut after
    --unhealthy-stream-idle-timeout and the next origin answers."""
    started = asyncio.Event()
    hang, whole = hangs(started), whole_chat("second")

    a, b = Origin(hang), (await second_origin() if stream else Origin(whole))
    p = await proxy(
        [(a, True), (b, True)], idle="60", extra=["--unhealthy-stream-idle-timeout=0.05"]
    )
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with caplog.at_level(logging.WARNING):
        async with asyncio.timeout(10):
            asking = asyncio.ensure_future(p.client.post("/v1/chat/completions", json=request))
            await started.wait()
            p.mark_unhealthy("o0")
            resp = await asking
            assert resp.status == 200
            said = await resp.text()
    assert '"second"' in said and len(b.bodies) == 1  # the next origin's answer
    metrics = p.app[METRICS]
    assert metrics.attempt("o0", "timeout").value == 1
    assert p.app[PIPELINE].stalls.streams("o0") == 0  # forgotten once cut
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "no answer within 0.05 s of the route table marking it unhealthy" in logged


async def test_a_retry_passes_over_an_origin_the_table_marked_unhealthy_since(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 59: the candidates were fixed by the table the request began
    with, so its retry waited out a second origin the table had marked
    unhealthy meanwhile (12 s, two cut calls) where another region answered
    at once. An origin marked unhealthy since is tried after the others."""
    started = asyncio.Event()
    hang, whole = hangs(started), whole_chat("third")

    a, b, c = Origin(hang), Origin(hang), Origin(whole)
    p = await proxy(
        [(a, True), (b, True), (c, True)],
        idle="60",
        extra=["--unhealthy-stream-idle-timeout=0.05"],
    )
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with asyncio.timeout(10):
        asking = asyncio.ensure_future(p.client.post("/v1/chat/completions", json=request))
        await started.wait()
        p.mark_unhealthy("o0")
        p.mark_unhealthy("o1")  # the next candidate, before the first is cut
        resp = await asking
        assert resp.status == 200
        said = await resp.text()
    assert '"third"' in said
    assert (len(a.bodies), len(b.bodies), len(c.bodies)) == (1, 0, 1)


async def test_a_call_to_a_healthy_origin_is_not_cut(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Only the unhealthy origin's calls are cut: a slow first chunk from a
    healthy origin, while another is marked unhealthy, is waited for."""
    a, b = slow_first_origin(0.3), await second_origin()
    p = await proxy(
        [(a, True), (b, True)], idle="60", extra=["--unhealthy-stream-idle-timeout=0.05"]
    )
    asking = asyncio.ensure_future(p.stream())
    await asyncio.sleep(0.01)
    p.mark_unhealthy("o1")
    chunks, _ = await asking
    assert text_of(chunks) == "Hello" and not b.bodies


async def test_without_continuation_it_ends_with_the_error_event_as_soon(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    started = asyncio.Event()
    a, b = hanging_origin(started), await second_origin()
    p = await proxy(
        [(a, True), (b, True)],
        pb.StreamPolicy(continuation="off"),
        idle="60",
        extra=["--unhealthy-stream-idle-timeout=0.05"],
    )
    with caplog.at_level(logging.WARNING):
        chunks, _ = await stream_while(p, started, "o0")
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert not b.bodies
    cuts = [r.getMessage() for r in caplog.records if "cut a stream" in r.getMessage()]
    assert len(cuts) == 1 and "marks unhealthy" in cuts[0], cuts


async def test_a_stream_still_flowing_from_an_unhealthy_origin_is_left_alone(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Probes can be wrong: chunks 0.3 s apart under a cap of 3 s go on to the end.

    The cap is ten gaps long, not a few: origin, proxy and client share this
    process, and on a loaded machine the process can wait for the CPU longer
    than a tight cap, which then expires before the chunk already sent is read
    (and the stream is rightly cut). The stream (3.6 s from the mark) outlasts
    the cap, so a cap counted from the mark rather than from the last chunk
    cuts it."""
    started = asyncio.Event()
    a, b = hanging_origin(started, trickle=12, gap=0.3), await second_origin()
    p = await proxy([(a, True), (b, True)], idle="60", extra=["--unhealthy-stream-idle-timeout=3"])
    chunks, raw = await stream_while(p, started, "o0")
    assert text_of(chunks) == "Hello" + "." * 12
    assert "continued" not in raw and not b.bodies


@pytest.mark.parametrize("why", ["panic", "off"])
async def test_the_idle_timeout_holds_where_the_health_signal_is_not_used(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture, why: str
) -> None:
    """With every origin of the model unhealthy (panic routing: the probes
    are more likely wrong than every origin), or the cap off (0), a stall is
    cut by the stream idle timeout only."""
    started = asyncio.Event()
    a, b = hanging_origin(started), await second_origin()
    cap = "0" if why == "off" else "0.05"
    p = await proxy(
        [(a, True), (b, True)], idle="0.5", extra=[f"--unhealthy-stream-idle-timeout={cap}"]
    )
    if why == "panic":
        p.mark_unhealthy("o1")  # left out of the request's candidates: nowhere to go on
    with caplog.at_level(logging.INFO):
        await stream_while(p, started, "o0")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("origin o0 cut")]
    said += [r.getMessage() for r in caplog.records if "continued on o1" in r.getMessage()]
    assert len(said) == 1, said
    assert "no chunk for 0.5 s" in said[0] and "unhealthy" not in said[0]


def slow_first_origin(delay: float) -> Origin:
    """Its first chunk after `delay` s (a long prefill), then a whole answer."""

    async def handler(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await asyncio.sleep(delay)
        await out.write(
            event("first", "", role=True)
            + event("first", "Hello")
            + event("first", finish="stop")
            + b"data: [DONE]\n\n"
        )
        return out

    return Origin(handler)


async def test_the_first_chunk_may_take_longer_than_the_stream_idle_timeout(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """--first-chunk-timeout bounds the wait for a stream's first chunk apart
    from the wait between chunks: a long prefill (0.5 s here) no longer needs
    an idle timeout as long, which also bounds every stall."""
    a, b = slow_first_origin(0.5), await second_origin()
    p = await proxy([(a, True), (b, True)], idle="0.2", extra=["--first-chunk-timeout", "2"])
    chunks, _ = await p.stream()
    assert text_of(chunks) == "Hello"
    assert (len(a.bodies), len(b.bodies)) == (1, 0)


async def test_a_tenants_own_idle_timeout_wins_over_a_shorter_first_chunk_timeout(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Review 48: a tenant that allows its model's prefill a long idle
    timeout keeps it for the first chunk, as it does over the proxy's
    --stream-idle-timeout; --first-chunk-timeout cut it short."""
    a, b = slow_first_origin(0.5), await second_origin()
    streams = pb.StreamPolicy(stream_idle_timeout_s=2.0)
    p = await proxy(
        [(a, True), (b, True)], streams, idle="0.2", extra=["--first-chunk-timeout", "0.2"]
    )
    chunks, _ = await p.stream()
    assert text_of(chunks) == "Hello"
    assert (len(a.bodies), len(b.bodies)) == (1, 0)


async def test_a_continuation_keeps_the_tenants_own_idle_timeout_for_its_first_chunk(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Review 49: the continuation's call (the longest prompt, so the longest
    prefill) had the shorter --first-chunk-timeout, not the tenant's own."""
    a, b, c = await first_origin("cut"), slow_first_origin(0.5), await second_origin()
    streams = pb.StreamPolicy(stream_idle_timeout_s=2.0)
    p = await proxy(
        [(a, True), (b, True), (c, True)],
        streams,
        idle="0.2",
        extra=["--first-chunk-timeout", "0.2"],
    )
    _, raw = await p.stream()
    assert "error" not in raw
    assert (len(a.bodies), len(b.bodies), len(c.bodies)) == (1, 1, 0)


async def test_a_first_chunk_past_its_own_bound_is_asked_of_the_next_origin(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = slow_first_origin(5.0), await second_origin()
    p = await proxy([(a, True), (b, True)], idle="30", extra=["--first-chunk-timeout", "0.2"])
    with caplog.at_level(logging.WARNING):
        chunks, _ = await p.stream()
    assert text_of(chunks) == " world"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "sent no first chunk within 0.2 s (--first-chunk-timeout)" in said, said


@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_a_stream_whose_body_ends_cleanly_half_way_is_a_cut(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture, continuation: str
) -> None:
    """A new user's trial: two deltas, no finish, no [DONE], then the body's
    last chunk. The client had 'half way' and no error; the access log said
    200, the attempt counted "ok" and no cut. Now it is the cut a dropped
    connection is: continued, or ended with the error event, counted and
    logged once, and not kept."""

    async def half_way(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "half", role=True) + event("first", " way"))
        await out.write_eof()  # the chunked body's last chunk: a clean end
        return out

    a, b = Origin(half_way), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(continuation=continuation))
    with caplog.at_level(logging.INFO):
        chunks, raw = await p.stream(temperature=0)
    metrics = p.app[METRICS]
    assert metrics.stream_cuts.labels("o0").value == 1
    assert metrics.attempt("o0", "ok").value == 0
    said = [r.getMessage() for r in caplog.records if "o0" in r.getMessage()]
    cuts = [m for m in said if "the origin's body ended before the answer's last event" in m]
    assert len(cuts) == 1, said
    if continuation == "on":
        assert text_of(chunks) == "half way world" and "error" not in raw
        assert len(b.bodies) == 1
        assert b.bodies[0]["messages"][-1] == {"role": "assistant", "content": "half way"}
        assert "continued on o1" in cuts[0]
        return
    assert text_of(chunks[:-1]) == "half way"
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    assert not b.bodies
    assert "not continued: the tenant turned continuation off" in cuts[0]
    assert operations(p) == {("stream_cut", "r0"): 1.0}
    await p.stream(temperature=0)
    assert len(a.bodies) == 2  # not kept: asked of the origin again


@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_a_completions_stream_whose_body_ends_before_done_is_cut_or_ended(
    proxy: Callable[..., Awaitable[Proxy]], continuation: str
) -> None:
    """Completions streams share the chat relay and its ends: half an answer
    whose body ends cleanly is cut (no other origin here: the error event),
    a whole one without its [DONE] is ended with it, and kept."""

    def text(piece: str, finish: str | None = None) -> bytes:
        chunk = {"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                 "choices": [{"index": 0, "text": piece, "finish_reason": finish}]}  # fmt: skip
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def ends_early(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        whole = (await request.json())["prompt"] == "whole"
        await out.write(text("half") + text(" way") + (text("", "stop") if whole else b""))
        await out.write_eof()
        return out

    a = Origin(ends_early)
    p = await proxy([(a, True)], pb.StreamPolicy(continuation=continuation))

    async def ask(prompt: str) -> list[dict[str, Any]]:
        body = {"model": MODEL, "prompt": prompt, "stream": True, "temperature": 0}
        resp = await p.client.post("/v1/completions", json=body)
        frames = [f for f in (await resp.read()).decode().split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        return [json.loads(f[6:]) for f in frames[:-1]]

    half = await ask("half")
    assert half[-1]["error"]["code"] == "upstream_stream_broken"
    whole = await ask("whole")
    assert "".join(c["choices"][0]["text"] for c in whole) == "half way"
    assert whole[-1]["choices"][0]["finish_reason"] == "stop"
    await ask("whole")
    assert len(a.bodies) == 2  # the whole one was kept: the cache answered
    assert p.app[METRICS].stream_cuts.labels("o0").value == 2


@pytest.mark.parametrize("end", ["dropped", "ended"])
@pytest.mark.parametrize("continuation", ["on", "off"])
@pytest.mark.parametrize("how", ["usage-sent", "usage-missing", "usage-not-asked"])
async def test_a_stream_cut_after_its_finish_is_ended_with_what_the_client_asked(
    proxy: Callable[..., Awaitable[Proxy]], how: str, continuation: str, end: str
) -> None:
    """Trial 45: an origin that dropped after the finish chunk, before its
    usage chunk and [DONE], left the SDK's `usage` None, and was counted as a
    continued stream (not kept, labelled so, although none was made). Now
    the proxy ends it: with an estimated usage chunk when the client asked
    for usage and none came (not kept: not the origin's answer), else with
    [DONE] alone, and then the answer is the origin's, whole, and kept.
    With continuation off too (note 28's left item: the error event came
    after the whole answer). A body that ends cleanly there, with its last
    chunk, is ended the same (a new user's trial: the client had no [DONE])."""
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}

    async def finish_then_drop(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(
            event("first", "", role=True)
            + event("first", "Hi")
            + event("first", finish="stop")
            + (event("first", usage=usage) if how == "usage-sent" else b"")
        )
        if end == "ended":
            await out.write_eof()  # no [DONE], and the chunked terminator
            return out
        assert request.transport is not None
        request.transport.close()  # no [DONE], no chunked terminator
        return out

    a, b = Origin(finish_then_drop), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(continuation=continuation))
    options = None if how == "usage-not-asked" else {"include_usage": True}
    chunks, raw = await p.stream(temperature=0, stream_options=options)
    assert raw.count("[DONE]") == 1 and "error" not in raw
    # The call answered: counted once, "ok", not also cut (helper-188); its
    # stream was cut all the same.
    metrics = p.app[METRICS]
    assert metrics.attempt("o0", "ok").value == 1
    assert metrics.attempt("o0", "cut_after_start").value == 0
    assert metrics.stream_cuts.labels("o0").value == 1
    assert text_of(chunks) == "Hi"
    assert not b.bodies
    assert all("continued" not in c.get("ponto", {}) for c in chunks)
    unkept = p.app[METRICS].cache_unkept
    if how == "usage-missing":
        estimate = estimate_prompt_tokens("chat.completions", a.bodies[0])
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {
            "prompt_tokens": estimate, "completion_tokens": 1, "total_tokens": estimate + 1,
        }  # fmt: skip
        assert chunks[-1]["ponto"] == {"usage": "estimated"}
        assert unkept.labels("incomplete").value == 1
        assert unkept.labels("continued").value == 0
        await p.stream(temperature=0, stream_options=options)
        assert len(a.bodies) == 2  # not kept: asked of the origin again
        return
    assert all(c.get("usage") in (None, usage) for c in chunks)
    assert (chunks[-1].get("usage") == usage) is (how == "usage-sent")
    assert unkept.labels("incomplete").value == unkept.labels("continued").value == 0
    again, _ = await p.stream(temperature=0, stream_options=options)
    assert len(a.bodies) == 1  # kept whole: the cache answered
    assert text_of(again) == "Hi"


@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_a_stream_cut_inside_its_done_is_whole_and_kept(
    proxy: Callable[..., Awaitable[Proxy]], continuation: str
) -> None:
    """Helper-188: an origin that dropped in the middle of its `data: [DONE]`
    had its answer ended whole, but, with continuation off, not kept: the
    cut-off event was taken for an answer that ended inside an event."""

    async def half_done(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "Hi") + event("first", finish="stop") + b"data: [DO")
        assert request.transport is not None
        request.transport.close()
        return out

    a = Origin(half_done)
    p = await proxy([(a, True)], pb.StreamPolicy(continuation=continuation))
    for _ in range(2):
        chunks, raw = await p.stream(temperature=0, stream_options=None)
        assert text_of(chunks) == "Hi" and "error" not in raw
    assert len(a.bodies) == 1  # kept: the cache answered the second
    assert p.app[METRICS].cache_unkept.labels("incomplete").value == 0


async def test_a_continuation_call_that_fails_is_logged_by_its_code(
    proxy: Callable[..., Awaitable[Proxy]], caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 45: the log's reason was the client's sentence ("…; retry shortly.")."""
    a = await first_origin("cut")
    p = await proxy(
        [(a, True), (slow_first_origin(5.0), True)],
        idle="30",
        extra=["--first-chunk-timeout", "0.2"],
    )
    with caplog.at_level(logging.WARNING):
        chunks, _ = await p.stream()
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    cuts = [r.getMessage() for r in caplog.records if "cut a stream" in r.getMessage()]
    assert len(cuts) == 1, cuts
    assert "not continued: the continuation call failed (upstream_unavailable)" in cuts[0]
    assert "retry shortly" not in cuts[0]


async def test_a_stream_of_no_event_is_asked_of_the_next_origin(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Trial 45: an origin that answered 200 with `data: [DONE]` alone was
    passed on as an empty stream, which the SDK reads as no answer at all."""

    async def empty(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(b": ping\n\ndata: [DONE]\n\n")
        await out.write_eof()
        return out

    a, b = Origin(empty), await second_origin()
    p = await proxy([(a, True), (b, True)])
    chunks, _ = await p.stream()
    assert text_of(chunks) == " world" and len(a.bodies) == len(b.bodies) == 1
    metrics = p.app[METRICS]
    assert metrics.attempt("o0", "cut").value == 1
    # The only origin answering so: a 502 that says what happened, not a 200.
    only = await proxy([(Origin(empty), True)])
    resp = await only.client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["code"] == "upstream_unavailable"
    assert error["message"] == UPSTREAM_UNANSWERED


@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_a_tool_call_stream_cut_after_its_finish_counts_its_arguments(
    proxy: Callable[..., Awaitable[Proxy]], continuation: str
) -> None:
    """Review of trial 45's fix: the estimated usage counted text only, and
    was taken as the origin's own count: a tool call cut before its usage
    chunk was billed 0 completion tokens."""

    async def tool_then_drop(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        frames = b""
        for piece in ('{"ci', 'ty": ', '"Paris"}'):
            call = {"index": 0, "function": {"arguments": piece}}
            chunk = {"id": "first", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                     "choices": [{"index": 0, "delta": {"tool_calls": [call]},
                                  "finish_reason": None}]}  # fmt: skip
            frames += b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await out.write(frames + event("first", finish="tool_calls"))
        assert request.transport is not None
        request.transport.close()
        return out

    p = await proxy(
        [(Origin(tool_then_drop), True), (await second_origin(), True)],
        pb.StreamPolicy(continuation=continuation),
    )
    chunks, _ = await p.stream()
    assert chunks[-1]["ponto"] == {"usage": "estimated"}
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    completion = p.app[METRICS].tenant_tokens.labels("default", "-", "completion").value
    assert completion == 3


@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_a_stream_cut_after_one_of_its_choices_is_not_whole(
    proxy: Callable[..., Awaitable[Proxy]], continuation: str
) -> None:
    """Review of trial 45's fix: an origin that streams n=2 choices one after
    the other, cut after the first's finish, was ended as whole and cached
    with one choice (with continuation off, helper-188: when that choice's
    finish came twice). Cut after both, it is whole."""

    def choice(index: int, content: str | None, finish: str | None = None) -> bytes:
        chunk = {"id": "first", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                 "choices": [{"index": index, "delta": {"content": content} if content else {},
                              "finish_reason": finish}]}  # fmt: skip
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    async def first_choice_then_drop(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        both = (await request.json()).get("user") == "both"
        await out.write(
            choice(0, "Hi", "stop")  # a finish with the last text, and again after it
            + choice(0, None, "stop")
            + (choice(1, "Yo") + choice(1, None, "stop") if both else b"")
        )
        assert request.transport is not None
        request.transport.close()
        return out

    a = Origin(first_choice_then_drop)
    p = await proxy(
        [(a, True), (await second_origin(), True)], pb.StreamPolicy(continuation=continuation)
    )
    chunks, _ = await p.stream(n=2, temperature=0, stream_options=None)
    assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
    await p.stream(n=2, temperature=0, stream_options=None)
    assert len(a.bodies) == 2  # not kept
    # Both choices finished: whole, [DONE] added, and kept.
    chunks, raw = await p.stream(n=2, temperature=0, stream_options=None, user="both")
    assert "error" not in raw and raw.count("[DONE]") == 1
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    await p.stream(n=2, temperature=0, stream_options=None, user="both")
    assert len(a.bodies) == 3  # kept: the cache answered


@pytest.mark.parametrize(
    ("continuation", "ping"), [("on", b": keep-alive\n\n"), ("off", b": ping\n\n")]
)
async def test_an_origins_comments_keep_the_clients_stream_alive(
    proxy: Callable[..., Awaitable[Proxy]], continuation: str, ping: bytes
) -> None:
    """A new user's trial: an origin that pinged (`: ping`) every second
    while its model thought was heard as silence through the proxy with
    continuation on (its relay re-frames events, and dropped comments),
    which a load balancer's idle timeout closes. Once the stream has begun,
    the client gets a comment while the origin pings: the relay's own with
    continuation on, the origin's as it came without."""
    read, release = asyncio.Event(), asyncio.Event()

    async def pings(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "Hi", role=True))
        await read.wait()  # a read of its own: one with an event needs no keep-alive
        await out.write(b": ping\n\n")
        await release.wait()
        await out.write(event("first", finish="stop") + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    p = await proxy([(Origin(pings), True)], pb.StreamPolicy(continuation=continuation), idle="30")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    resp = await p.client.post("/v1/chat/completions", json=body)
    got = b""
    async with asyncio.timeout(10):  # a bound on a broken test, not a timing
        for wanted, then in ((b'"Hi"', read), (ping, release)):
            while wanted not in got:
                chunk = await resp.content.readany()
                assert chunk, got
                got += chunk
            then.set()
    got += await resp.read()
    assert got.endswith(b"data: [DONE]\n\n") and got.count(ping) == 1
