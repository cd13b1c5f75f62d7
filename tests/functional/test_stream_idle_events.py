"""After a stream's first event, its idle timeout counts from the last event,
not from the last byte: an origin's SSE comments keep no stalled stream open
(trial 65: one event, then `:` every second, held a stream 11 minutes, while
the proxy sent the client keep-alives of its own). The proxy's app before
scripted origins on aiohttp test servers (tests/functional/test_continuation.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from ponto.v1 import routing_pb2 as pb
from tests.functional.test_continuation import (
    MODEL,
    Origin,
    Proxy,
    event,
    proxy,
    second_origin,
    sse,
    text_of,
)

__all__ = ["proxy"]  # fixture

PINGS = 200  # what the pinging origin sends at most, PING_EVERY apart: far past the timeout
PING_EVERY = 0.02


async def stream(p: Proxy) -> tuple[list[dict[str, Any]], str]:
    """A stream's chunks (its comments left out), and its text."""
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "say hello world"}],
        "stream": True,
        "max_tokens": 50,
    }
    resp = await p.client.post("/v1/chat/completions", json=request)
    assert resp.status == 200
    raw = (await resp.read()).decode()
    frames = [f for f in raw.split("\n\n") if f and not f.startswith(":")]
    assert frames[-1] == "data: [DONE]", raw
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]], raw


def pinging(left: asyncio.Event) -> Origin:
    """One event of its answer, then comments only; `left` set once the
    proxy has closed the stream while it still pinged."""

    async def handler(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "", role=True) + event("first", "Hel"))
        try:
            for _ in range(PINGS):
                await asyncio.sleep(PING_EVERY)
                await out.write(b": ping\n\n")
        except (ConnectionError, asyncio.CancelledError):
            left.set()
            raise
        return out  # ends its body without [DONE]: a cut all the same

    return Origin(handler)


@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_comments_after_the_first_event_do_not_hold_a_stalled_stream_open(
    proxy: Callable[..., Awaitable[Proxy]],
    caplog: pytest.LogCaptureFixture,
    continuation: str,
) -> None:
    left = asyncio.Event()
    a, b = pinging(left), await second_origin()
    p = await proxy([(a, True), (b, True)], pb.StreamPolicy(continuation=continuation))
    with caplog.at_level(logging.INFO):
        chunks, _ = await stream(p)
    async with asyncio.timeout(5):  # a bound on a broken test, not a timing
        await left.wait()  # cut while the origin still pinged
    said = [r.getMessage() for r in caplog.records if "cut" in r.getMessage()]
    assert any("no event, only comments, for 0.3 s" in line for line in said), said
    if continuation == "on":
        assert text_of(chunks) == "Hel world"
        assert b.bodies
    else:
        assert chunks[-1]["error"]["code"] == "upstream_stream_broken"
        assert not b.bodies


async def test_events_between_comments_keep_a_stream_going(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    # Each event starts the bound over: a stream longer than it in all, its
    # events well within it of each other, comments between them, is whole.
    words = [f"w{i} " for i in range(30)]

    async def handler(request: web.Request) -> web.StreamResponse:
        out = await sse(request)
        await out.write(event("first", "", role=True))
        for word in words:
            await asyncio.sleep(0.05)
            await out.write(b": ping\n\n" + event("first", word))
        await out.write(event("first", finish="stop") + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    p = await proxy([(Origin(handler), True)], pb.StreamPolicy(continuation="off"), idle="1")
    chunks, raw = await stream(p)
    assert "error" not in raw
    assert text_of(chunks) == "".join(words)
