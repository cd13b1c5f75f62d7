"""Streams are counted by their origin's usage, whether or not the client asked
for it (--origin-stream-usage always, the default).

The origin here sends several tokens an event, as vLLM does with
`--stream-interval` or speculative decoding: the events that carried text
(the proxy's own count) are far fewer than its tokens. The proxy asks it for
the usage chunk on behalf of a client that did not ask, counts the stream by
it, and keeps it from that client, who gets the stream it would have had.
The proxy's app and a scripted origin on aiohttp test servers; both relays:
the one that re-frames events (continuation on, the default) and the one
that passes the origin's bytes (continuation off).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from dataplane.http.state import METRICS
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_continuation import MODEL, Origin, Proxy, event, proxy, sse
from tests.functional.test_flight_leader_gone import FRAMES as FLIGHT_FRAMES
from tests.functional.test_flight_leader_gone import WORDS, Client, clients, start
from tests.functional.test_flight_leader_gone import Origin as FlightOrigin
from tests.functional.test_pipeline import KEY
from tests.functional.test_whole_answers import Start, until

__all__ = ["clients", "proxy", "start"]  # fixtures

# Twelve tokens in three events of text, then the finish.
FRAMES = (
    event("s", "", role=True),
    event("s", "one two three four"),
    event("s", " five six seven eight"),
    event("s", " nine ten eleven twelve"),
    event("s", finish="stop"),
)
USAGE = {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
USAGE_FRAME = event("s", usage=USAGE)
DONE = b"data: [DONE]\n\n"


class Several(Origin):
    """An origin like vLLM: several tokens an event, and the usage chunk only
    when its request asks for it (no `"usage": null` in the other chunks).
    Keeps each request's bytes as they came. `apart`: each event in a write of
    its own (else all in one)."""

    def __init__(self, apart: bool = False) -> None:
        super().__init__(self._answer)
        self.raw: list[bytes] = []
        self._apart = apart

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.raw.append(raw)
        options = json.loads(raw).get("stream_options") or {}
        frames = [*FRAMES, *([USAGE_FRAME] if options.get("include_usage") else []), DONE]
        out = await sse(request)
        for write in frames if self._apart else [b"".join(frames)]:
            await out.write(write)
        await out.write_eof()
        return out


def request(**fields: Any) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to twelve"}],
        "stream": True,
        **fields,
    }
    return json.dumps(body).encode()


async def post(p: Proxy, raw: bytes) -> bytes:
    resp = await p.client.post(
        "/v1/chat/completions", data=raw, headers={"content-type": "application/json"}
    )
    assert resp.status == 200
    return bytes(await resp.read())


def tokens(p: Proxy) -> tuple[float, float]:
    """The tenant's prompt and completion tokens, as the proxy accounted them."""
    counter = p.app[METRICS].tenant_tokens
    return (
        counter.labels("default", "-", "prompt").value,
        counter.labels("default", "-", "completion").value,
    )


@pytest.mark.parametrize("apart", [False, True], ids=["one-write", "apart"])
@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_a_client_that_did_not_ask_gets_its_stream_and_is_counted_by_the_origins_usage(
    proxy: Callable[..., Awaitable[Proxy]], continuation: str, apart: bool
) -> None:
    origin = Several(apart)
    p = await proxy([(origin, True)], pb.StreamPolicy(continuation=continuation))

    got = await post(p, request())
    # The stream it would have had, byte for byte: no usage chunk.
    assert got == b"".join([*FRAMES, DONE])
    assert json.loads(origin.raw[0])["stream_options"] == {"include_usage": True}
    # Counted by the origin's usage: 12 tokens, not the 3 events of text.
    assert tokens(p) == (9, 12)

    # A client that asks gets the usage chunk, as before.
    assert await post(p, request(stream_options={"include_usage": True})) == b"".join(
        [*FRAMES, USAGE_FRAME, DONE]
    )
    assert tokens(p) == (18, 24)


async def test_the_clients_other_stream_options_reach_the_origin(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    origin = Several()
    p = await proxy([(origin, True)])
    options = {"include_usage": False, "include_obfuscation": True}
    assert await post(p, request(stream_options=options)) == b"".join([*FRAMES, DONE])
    asked = json.loads(origin.raw[0])
    assert asked["stream_options"] == {"include_usage": True, "include_obfuscation": True}
    assert tokens(p) == (9, 12)


async def test_with_origin_stream_usage_client_the_origin_gets_the_body_as_sent(
    proxy: Callable[..., Awaitable[Proxy]],
) -> None:
    origin = Several()
    p = await proxy([(origin, True)], extra=["--origin-stream-usage=client"])
    raw = request(temperature=0.5)
    assert await post(p, raw) == b"".join([*FRAMES, DONE])
    assert origin.raw == [raw]
    # Counted by the events that carried text, as before: short of the 12.
    assert tokens(p)[1] == 3


class Refuses(Several):
    """An origin that refuses `stream_options` with a 400, as older Azure
    OpenAI API versions do; else as Several."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if b"stream_options" in raw:
            self.raw.append(raw)
            error = {
                "message": "Unrecognized request argument supplied: stream_options",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
            return web.json_response({"error": error}, status=400)
        return await super()._answer(request)


@pytest.mark.parametrize("continuation", ["on", "off"])
async def test_an_origin_that_refuses_stream_options_is_asked_without_them(
    proxy: Callable[..., Awaitable[Proxy]],
    continuation: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review: every stream of a client that asked for no usage got the
    origin's 400 naming a member it never sent, and nothing said why. The
    call is made again without it, and from then on goes without it; said
    once. Such streams are counted by their events."""
    origin = Refuses()
    p = await proxy([(origin, True)], pb.StreamPolicy(continuation=continuation))
    raw = request(temperature=0.5)
    assert await post(p, raw) == b"".join([*FRAMES, DONE])
    assert len(origin.raw) == 2 and b"stream_options" in origin.raw[0]
    assert origin.raw[1] == raw
    assert await post(p, raw) == b"".join([*FRAMES, DONE])
    assert origin.raw[2:] == [raw]  # at once without them
    told = [r for r in caplog.records if "refuses stream_options" in r.getMessage()]
    assert len(told) == 1 and not told[0].exc_info
    assert tokens(p)[1] == 6  # the events that carried text, two streams' worth


class Held(FlightOrigin):
    """The flight tests' origin (each event once the test lets it out), with
    the usage chunk before `[DONE]` when asked, counting ten tokens a word."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        options = (await request.json()).get("stream_options") or {}
        self.calls += 1
        usage = {"prompt_tokens": 5, "completion_tokens": 10 * len(WORDS), "total_tokens": 65}
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        frames = list(FLIGHT_FRAMES)
        if options.get("include_usage"):
            frames.insert(-1, event("c", usage=usage))
        for frame in frames:
            await self.allowed.acquire()
            await out.write(frame)
        return out


async def test_a_flights_follower_gets_the_stream_its_leader_gets(
    start: Start, clients: list[Client]
) -> None:
    """Neither asked for usage (a flight's followers ask as its leader did:
    dataplane.cache.step's flight key): the origin's usage chunk, asked for
    by the proxy, reaches neither, and the leader is counted by it."""
    origin = Held()
    edge = await start(origin)
    leader, follower = Client(edge), Client(edge)
    clients.extend((leader, follower))
    origin.let(3)
    await leader.send()
    assert len(await leader.events(3)) == 3
    answer = await follower.send()
    assert answer.headers["x-ponto-coalesced"] == "1"
    origin.let(len(FLIGHT_FRAMES) + 1)
    led, followed = await leader.rest(), await follower.rest()
    assert b'"usage"' not in led and led.rstrip().endswith(b"data: [DONE]")
    assert b'"usage"' not in followed and followed.endswith(led)  # the leader's rest
    completion = {"tenant": "acme", "key": KEY.key_id, "kind": "completion"}
    await until(lambda: edge.sample("ponto_tenant_tokens_total", completion) is not None)
    assert edge.sample("ponto_tenant_tokens_total", completion) == 10 * len(WORDS)
