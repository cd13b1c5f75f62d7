"""A stream's head goes out while its origin thinks (--stream-hold-seconds).

Trial: behind nginx (proxy_read_timeout 10 s) a reasoning model that thought
12 s before its first token got nginx's 504, though its origin pinged every
2 s: the proxy held the whole stream, head and comments, until the first
event. Past the hold (0 here: at once, so no test waits on a clock), the
client has `200 text/event-stream` and keep-alive comments; failover goes on
behind them, and a failure before any event is the stream's error event.
The proxy's app before scripted aiohttp origins (tests/functional/test_continuation.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dataplane.http.hold import KEEP_ALIVE, HeldHead
from dataplane.http.reply import NOT_A_STREAM
from dataplane.http.state import ACCESS_LOG, DRAINING, METRICS, PIPELINE
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_continuation import (
    MODEL,
    Origin,
    Proxy,
    operations,
    proxy,
    second_origin,
    sse,
    text_of,
    whole_chat,
)
from tests.functional.test_pipeline import KEY, chat
from tests.functional.test_tracing import last_tree, tracing

__all__ = ["proxy"]  # fixture

HOLD_AT_ONCE = ["--stream-hold-seconds=0", "--access-log=on"]
ASK = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 50,
}


# A whole answer's one event and [DONE], as an origin streams it.
HI_AND_DONE = (
    b'data: {"id": "x", "object": "chat.completion.chunk", "created": 1, '
    b'"model": "m", "choices": [{"index": 0, "delta": {"content": "hi"}, '
    b'"finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
)


def pings_forever() -> Origin:
    """An origin that sends its head and comments, and no event."""

    async def pings(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        for _ in range(600):
            await out.write(b": ping\n\n")
            await asyncio.sleep(0.05)
        return out

    return Origin(pings)


def frames_of(raw: str) -> list[str]:
    return [f for f in raw.split("\n\n") if f]


async def access_line(
    p: Proxy, capfd: pytest.CaptureFixture[str], endpoint: str = "chat.completions"
) -> dict[str, Any]:
    registry = p.app[METRICS].registry
    labels = {"endpoint": endpoint, "code": "200"}
    for _ in range(500):  # the line is written once the handler has returned
        if registry.get_sample_value("ponto_requests_total", labels):
            break
        await asyncio.sleep(0.01)
    p.app[ACCESS_LOG].flush()
    lines = capfd.readouterr().out.splitlines()
    [line] = [json.loads(x) for x in lines if x.startswith("{")]
    assert isinstance(line, dict)
    return line


async def test_the_head_and_keep_alives_reach_the_client_before_the_first_event(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    thinking = asyncio.Event()

    async def thinks(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(b": ping\n\n")
        await thinking.wait()  # until the client has had the head
        await out.write(HI_AND_DONE)
        await out.write_eof()
        return out

    p = await proxy([(Origin(thinks), False)], idle="30", extra=HOLD_AT_ONCE)
    async with asyncio.timeout(10):  # a bound on a broken test: the head never comes
        resp = await p.client.post("/v1/chat/completions", json=ASK)
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/event-stream"
        assert resp.headers["x-accel-buffering"] == "no"
        assert "x-request-id" in resp.headers
        assert await resp.content.readuntil(b"\n\n") == KEEP_ALIVE
    thinking.set()
    raw = (await resp.read()).decode()
    events = [f for f in frames_of(raw) if not f.startswith(":")]
    assert "ping" not in raw  # the origin's own comments are not passed on
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "hi"


async def test_failover_goes_on_behind_a_sent_head(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    a, b = pings_forever(), await second_origin()
    p = await proxy([(a, False), (b, False)], idle="0.3", extra=HOLD_AT_ONCE)
    resp = await p.client.post("/v1/chat/completions", json=ASK)
    assert resp.status == 200
    raw = (await resp.read()).decode()
    frames = frames_of(raw)
    assert frames[0] == KEEP_ALIVE.decode().strip()
    events = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    assert text_of(events) == " world" and "error" not in raw
    assert (len(a.bodies), len(b.bodies)) == (1, 1)


async def test_a_failure_after_the_head_is_the_streams_error_event(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    """Every origin pinged past the first-chunk timeout: the client, which
    has a 200, reads the 502's error as the stream's event, then [DONE] (the
    openai SDK raises APIError for it), as a cut stream ends; the access log
    and the metrics record the 200 with the error's code."""
    p = await proxy([(pings_forever(), False)], idle="0.3", extra=HOLD_AT_ONCE)
    capfd.readouterr()
    resp = await p.client.post("/v1/chat/completions", json=ASK)
    assert resp.status == 200
    frames = frames_of((await resp.read()).decode())
    assert frames[0] == KEEP_ALIVE.decode().strip()
    assert frames[-1] == "data: [DONE]"
    error = json.loads(frames[-2][6:])["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_unavailable")
    line = await access_line(p, capfd)
    assert (line["status"], line["error"]) == (200, "upstream_unavailable")
    assert operations(p).get(("upstream_unavailable", "r0")) == 1
    # No chunk of an answer went out: no time to a first one (review 314).
    assert line["ttft_ms"] is None


@pytest.mark.parametrize(("status", "text"), [(400, ""), (200, "world"), (200, "w" * (1 << 20))])
async def test_a_whole_answer_after_the_head_follows_it_as_the_stream(
    proxy: Callable[..., Awaitable[Proxy]], status: int, text: str
) -> None:
    """An origin that answers whole once the head is out: its error (400) is
    the stream's error event, its answer (an origin that ignored `stream`)
    the stream's events, a large one too (review 314: one over 1 MiB, not
    parsed before sending, was an error event)."""
    thinking = asyncio.Event()

    async def whole(request: web.Request) -> web.StreamResponse:
        await thinking.wait()
        if status == 400:
            return web.json_response(
                {"error": {"message": "bad temperature", "type": "invalid_request_error"}},
                status=400,
            )
        return web.json_response({
            "id": "w", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })  # fmt: skip

    p = await proxy([(Origin(whole), False)], idle="30", extra=HOLD_AT_ONCE)
    async with asyncio.timeout(10):  # a bound on a broken test: the head never comes
        resp = await p.client.post("/v1/chat/completions", json=ASK)
        assert resp.status == 200
        assert await resp.content.readuntil(b"\n\n") == KEEP_ALIVE
    thinking.set()
    frames = frames_of((await resp.read()).decode())
    assert frames[-1] == "data: [DONE]"
    events = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    if status == 400:
        [only] = events
        assert only["error"]["message"] == "bad temperature"
    else:
        assert text_of(events) == text and not any("error" in e for e in events)


async def test_an_origins_error_code_after_the_head_is_logged_and_its_status_is_the_metric(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    """An origin's error answer to a stream whose head went out: its code is
    the access line's error, as for any origin's error answer, and the GenAI
    metrics' error_type is its status (trial 96: each held stream an origin
    refused with a code of its own, one per request, made a duration
    histogram's 20 series), excused as that status is (review 413: its 400
    read as its region failing); its span's error is that status too. The
    status goes along as a number (Exchange.held_status), not as digits in
    the stream's error read back."""

    async def refuses(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "no", "type": "invalid_request_error", "code": "req_1f2e3d"}},
            status=400,
        )

    p = await proxy([(Origin(refuses), False)], idle="30", extra=HOLD_AT_ONCE)
    exporter = InMemorySpanExporter()
    p.app[PIPELINE].tracer = tracing(exporter).tracer
    capfd.readouterr()
    resp = await p.client.post("/v1/chat/completions", json=ASK)
    assert resp.status == 200
    frames = frames_of((await resp.read()).decode())
    assert json.loads(frames[-2][6:])["error"]["code"] == "req_1f2e3d"
    span = last_tree(exporter).attrs
    assert (span["http.response.status_code"], span["error.type"]) == (200, "400")
    line = await access_line(p, capfd)
    assert (line["status"], line["error"]) == (200, "req_1f2e3d")
    assert operations(p) == {("400", "r0"): 1}
    # The client's bad request, not its region's failure, as when not held.
    assert p.app[METRICS].excused == {"r0": 1}


async def test_a_2xx_answer_no_stream_can_be_made_of_after_the_head_is_recorded_as_its_status(
    proxy: Callable[..., Awaitable[Proxy]], capfd: pytest.CaptureFixture[str]
) -> None:
    """An origin's 200 to a held Responses stream that no stream can be made
    of (a response without its output): the stream's error event
    (reply.NOT_A_STREAM), recorded as a failure by its status, 200, in the
    metrics, the access line and the span alike. 27a430a4 had the metrics
    and the line count it a success while the span still named it."""

    async def odd(request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "resp_1", "object": "response"})

    p = await proxy([(Origin(odd), False)], idle="30", extra=HOLD_AT_ONCE)
    exporter = InMemorySpanExporter()
    p.app[PIPELINE].tracer = tracing(exporter).tracer
    capfd.readouterr()
    ask = {"model": MODEL, "input": "hi", "stream": True}
    resp = await p.client.post("/v1/responses", json=ask)
    assert resp.status == 200
    frames = frames_of((await resp.read()).decode())
    assert NOT_A_STREAM in frames[-1]
    span = last_tree(exporter).attrs
    assert (span["http.response.status_code"], span["error.type"]) == (200, "200")
    line = await access_line(p, capfd, "responses")
    assert (line["status"], line["error"]) == (200, "200")
    assert operations(p) == {("200", "r0"): 1}


async def test_a_stream_answered_within_the_hold_has_its_origins_head(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Not held: the origin's head, which names it, and nginx told not to buffer."""
    p = await proxy([(await second_origin(), False)])
    resp = await p.client.post("/v1/chat/completions", json=ASK)
    assert (resp.status, resp.headers["x-ponto-origin"]) == (200, "o0")
    assert resp.headers["x-accel-buffering"] == "no"
    raw = (await resp.read()).decode()
    assert not raw.startswith(":")


async def test_a_coalesced_follower_gets_its_head_too_and_the_same_stream(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Two identical requests fly together (one origin call); the follower,
    which waits for the leader's first event, is sent its head as the leader
    is, and then the same events. The keep-alives are no part of the answer
    the cache keeps: a third request replays the events alone."""
    thinking = asyncio.Event()
    calls = 0

    async def thinks(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        out = await sse(request)
        await thinking.wait()
        await out.write(HI_AND_DONE)
        await out.write_eof()
        return out

    p = await proxy([(Origin(thinks), False)], idle="30", extra=HOLD_AT_ONCE)
    ask = {**ASK, "temperature": 0}
    async with asyncio.timeout(10):  # a bound on a broken test: a head never comes
        first = await p.client.post("/v1/chat/completions", json=ask)
        second = await p.client.post("/v1/chat/completions", json=ask)
        for resp in (first, second):
            assert resp.status == 200
            assert await resp.content.readuntil(b"\n\n") == KEEP_ALIVE
    assert second.headers.get("x-ponto-coalesced") == "1"
    thinking.set()
    raws = [(await r.read()).decode() for r in (first, second)]
    assert raws[0] == raws[1] and "hi" in raws[0]
    assert calls == 1
    replayed = await p.client.post("/v1/chat/completions", json=ask)
    raw = (await replayed.read()).decode()
    assert replayed.headers["x-ponto-cache"] == "hit" and "hi" in raw
    assert "keep-alive" not in raw and calls == 1


async def test_a_query_string_on_an_api_path_is_accepted_and_not_sent_on(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """What docs/operations.md says for proxies in front that add one (an
    Azure-style `api-version`): the proxy answers, and the origin's path has
    none, so an origin is never sent what the client put there."""
    queries: list[str] = []

    async def records(request: web.Request) -> web.StreamResponse:
        queries.append(request.query_string)
        return await whole_chat("w")(request)

    p = await proxy([(Origin(records), False)])
    resp = await p.client.post(
        "/v1/chat/completions?api-version=2024-06-01&x=1", json={**ASK, "stream": False}
    )
    assert resp.status == 200 and queries == [""]


@pytest.mark.parametrize("temperature", [0, 1], ids=["a-flights-leader", "uncached"])
async def test_a_held_stream_the_stop_cancels_ends_with_the_stopping_event(
    tmp_path: Path, temperature: int
) -> None:
    """As a relayed stream the stopping proxy cancels (test_stop_cancel): the
    client, which has the head, reads `proxy_stopping` and [DONE], not a
    stream cut in its body. The proxy on its production listener."""
    taken = asyncio.Event()

    async def never(request: web.Request) -> web.StreamResponse:
        await request.read()
        taken.set()
        await asyncio.sleep(3600)  # thinks past the stop
        raise AssertionError("not cut")

    origin_app = web.Application()
    origin_app.router.add_post("/v1/chat/completions", never)
    origin = TestServer(origin_app)
    await origin.start_server()
    served = await serve_on_edge(
        tmp_path, str(origin.make_url("/v1")), "--stream-hold-seconds=0", shutdown_timeout=0.5
    )
    try:
        url = f"http://127.0.0.1:{served.port}/v1/chat/completions"
        headers = {"authorization": f"Bearer {KEY.key}"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                url, json=chat("go on", stream=True, temperature=temperature), headers=headers
            ) as resp,
        ):
            assert resp.status == 200
            async with asyncio.timeout(10):  # a bound on a broken test
                assert await resp.content.readuntil(b"\n\n") == KEEP_ALIVE
                await taken.wait()
                served.app[DRAINING].active = True
                stop = asyncio.create_task(served.runner.cleanup())
                rest = (await resp.content.read()).decode()
                await stop
        events = [f for f in frames_of(rest) if not f.startswith(":")]
        assert json.loads(events[0][6:])["error"]["code"] == "proxy_stopping", rest
        assert events[1:] == ["data: [DONE]"]
    finally:
        await served.runner.cleanup()
        await origin.close()


async def test_a_client_leaving_as_the_comments_end_lets_its_origins_answer_go(
    proxy: Callable[..., Awaitable[Proxy]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The origin's first event came, and the client left while the held
    head's comments were being stopped: the answer the forward had opened
    was never released (its origin's count of calls under way, and the
    tenant's place in its connections, kept for good)."""
    stopping = asyncio.Event()
    stop = HeldHead.stop
    calls = 0

    async def slow_stop(self: HeldHead) -> web.StreamResponse | None:
        nonlocal calls
        calls += 1
        out = await stop(self)
        if calls == 1:  # the stop after the origin's answer: the client leaves here
            stopping.set()
            await asyncio.Event().wait()
        return out

    monkeypatch.setattr(HeldHead, "stop", slow_stop)

    async def answers(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(HI_AND_DONE[: HI_AND_DONE.index(b"data: [DONE]")])
        await asyncio.Event().wait()  # until the proxy ends the call
        return out

    p = await proxy([(Origin(answers), True)], extra=HOLD_AT_ONCE)
    resp = await p.client.post("/v1/chat/completions", json=ASK)
    assert resp.status == 200  # the head, held at once
    async with asyncio.timeout(10):
        await stopping.wait()
    loads = p.app[PIPELINE].forwarder.loads
    assert loads.outstanding("o0") == 1
    resp.close()  # the client leaves
    registry = p.app[METRICS].registry
    gone = {"endpoint": "chat.completions", "code": "499"}
    async with asyncio.timeout(10):
        while registry.get_sample_value("ponto_requests_total", gone) != 1:
            await asyncio.sleep(0.01)
    assert loads.outstanding("o0") == 0
    # Its call is counted as ended so, as a relay's is when its client leaves.
    cancelled = {"origin": "o0", "outcome": "cancelled"}
    assert registry.get_sample_value("ponto_upstream_attempts_total", cancelled) == 1
