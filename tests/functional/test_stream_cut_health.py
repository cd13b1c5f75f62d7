"""An origin that breaks its streams partway fails its passive health as one
that answers 500 does (trial 65: an origin that cut every stream was never
ejected, since each stream that opened counted as a success). The proxy's
app before scripted origins on aiohttp test servers
(tests/functional/test_continuation.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from dataplane.http.state import METRICS, PIPELINE
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_continuation import (
    Origin,
    Proxy,
    event,
    first_origin,
    proxy,
    second_origin,
    sse,
)

__all__ = ["proxy"]  # fixture

STREAMS = 3  # the outlier detector's consecutive failures (its default)


def ejections(p: Proxy, origin: str) -> float:
    return p.app[METRICS].ejections.labels(origin).value


async def stream_raw(p: Proxy) -> str:
    """A stream's bytes, however it ended."""
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "say hello world"}],
        "stream": True,
        "max_tokens": 50,
    }
    resp = await p.client.post("/v1/chat/completions", json=request)
    assert resp.status == 200
    return (await resp.read()).decode()


@pytest.mark.parametrize("how", ["cut", "stall"])
@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_an_origin_that_breaks_every_stream_is_ejected(
    proxy: Callable[..., Awaitable[Proxy]], how: str, continuation: str
) -> None:
    a, b = await first_origin(how), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(continuation=continuation))
    for _ in range(STREAMS):
        await stream_raw(p)
    assert len(a.bodies) == STREAMS
    assert ejections(p, "o0") == 1
    assert ejections(p, "o1") == 0
    assert p.app[PIPELINE].forwarder.outliers.ejected("o0")
    # The next stream goes to the other origin first, whole.
    before = len(b.bodies)
    raw = await stream_raw(p)
    assert len(a.bodies) == STREAMS
    assert len(b.bodies) == before + 1
    assert "continue_final_message" not in b.bodies[-1]
    assert "error" not in raw and raw.endswith("data: [DONE]\n\n")


async def test_a_whole_stream_clears_the_failures_of_its_origin(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    # Two cuts, a whole stream, two cuts: never `consecutive` in a row. A
    # whole stream is a success once it has ended, not when it opens.
    cutting, whole = await first_origin("cut"), await second_origin()
    calls = 0

    async def sometimes(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        return await (whole if calls == STREAMS else cutting)._handler(request)

    a = Origin(sometimes)
    p = await proxy([(a, True)], pb.StreamPolicy(continuation="off"))
    for _ in range(2 * STREAMS - 1):
        await stream_raw(p)
    assert calls == 2 * STREAMS - 1
    assert ejections(p, "o0") == 0


async def test_in_band_error_events_are_not_held_against_the_origin(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    # Its error may be the request's doing: a client must not eject origins.
    a, b = await first_origin("error"), await second_origin()
    p = await proxy([(a, True), (b, True)])
    for _ in range(STREAMS):
        raw = await stream_raw(p)
        assert "engine died" not in raw
    assert len(a.bodies) == STREAMS
    assert ejections(p, "o0") == 0
    # The streams continued on o1 ended whole: each a success of o1's.
    assert ejections(p, "o1") == 0
    assert len(b.bodies) == STREAMS


async def test_an_error_event_ending_a_stream_not_continued_is_not_held_against_it(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Review: with continuation off (and for every Responses stream) an
    origin's error event and the body's end after it counted as a cut, and
    three such streams ejected the origin; a request may cause the error."""

    async def errs(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "", role=True) + event("first", "Hel"))
        await out.write(b'data: {"error": {"message": "bad prompt"}}\n\n')
        await out.write_eof()
        return out

    a, b = Origin(errs), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(continuation="off"))
    for _ in range(STREAMS):
        await stream_raw(p)
    assert len(a.bodies) == STREAMS
    assert ejections(p, "o0") == 0


async def test_a_continuations_error_event_is_not_held_against_it(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Review: the first origin's error event was exempt, a continuation's
    was not (its ValueError was another cut)."""

    async def errs(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("second", "", role=True) + event("second", " wor"))
        await out.write(b'data: {"error": {"message": "bad prompt"}}\n\n')
        await out.write_eof()
        return out

    a, b = await first_origin("cut"), Origin(errs)
    p = await proxy([(a, True), (b, True)])
    for _ in range(STREAMS):
        await stream_raw(p)
    assert len(b.bodies) == STREAMS  # each cut stream was continued there
    assert ejections(p, "o1") == 0


async def test_a_stall_past_a_tenants_own_shorter_bound_is_not_held_against_it(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    """Review: a tenant that chose a tight idle bound for fast failover
    ejected an origin every tenant shares, for gaps the proxy's own bound
    lets through."""
    a, b = await first_origin("stall"), await second_origin()
    tight = pb.StreamPolicy(continuation="off", stream_idle_timeout_s=0.2)
    p = await proxy([(a, True), (b, True)], tight, idle="30")
    for _ in range(STREAMS):
        await stream_raw(p)
    assert len(a.bodies) == STREAMS
    assert ejections(p, "o0") == 0
