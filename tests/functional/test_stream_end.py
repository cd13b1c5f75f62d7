"""A stream's answer ends with its last event, not with the origin's body.

uvicorn (vLLM's server) writes a chunked body's last chunk on its own, after
`data: [DONE]`, and the openai SDK closes its connection as soon as it reads
`[DONE]`: the client has had the whole answer, whichever reaches the proxy
first. The real proxy app on EdgeRunner (production's listener, handler
cancellation on) before a hand-written origin that holds its body's end.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
from aiohttp import web

from tests.functional.test_flight_leader_gone import FRAMES, Client, Origin, clients, start
from tests.functional.test_pipeline import (
    COMPLETION,
    KEY,
    LIMITED_KEY,
    MODEL,
    chat,
    stack_on,
)
from tests.functional.test_whole_answers import Start, until
from tests.unit.test_responses_events import answer as whole_response

__all__ = ["clients", "start"]  # fixtures


class LateEnd(Origin):
    """Streams every frame at once, then holds its body's last chunk until `end`."""

    def __init__(self) -> None:
        super().__init__()
        self.end = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.let(len(FRAMES))
        out = await super().handle(request)
        await self.end.wait()
        return out  # aiohttp writes the last chunk once this returns


async def test_a_client_that_closes_at_done_before_the_bodys_end_had_the_whole_answer(
    start: Start, clients: list[Client]
) -> None:
    origin = LateEnd()
    edge = await start(origin)
    client = Client(edge)
    clients.append(client)
    await client.send()
    got = await client.events(len(FRAMES))
    assert got[-1] == b"[DONE]"
    await client.leave()  # as the openai SDK does at [DONE]
    ok = {"endpoint": "chat.completions", "code": "200"}
    await until(lambda: edge.sample("ponto_requests_total", ok) == 1)
    assert not edge.sample("ponto_client_disconnects_total", {})
    assert edge.sample("ponto_upstream_attempts_total", {"origin": "o1", "outcome": "ok"}) == 1
    # Kept whole: the same question is answered from the cache.
    again = Client(edge)
    clients.append(again)
    answer = await again.send()
    assert answer.headers["x-ponto-cache"] == "hit"
    assert (await again.rest()).rstrip().endswith(b"data: [DONE]")
    assert origin.calls == 1
    # The origin's connection waited for its body's end and was not cut.
    origin.end.set()
    await until(lambda: origin.finished)
    assert not origin.gone


class Whole:
    """An origin that ignores `stream` and answers every request whole, in JSON."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response(COMPLETION)


async def test_a_stream_answered_whole_by_its_origin_reaches_the_client_as_a_stream(
    start: Start, clients: list[Client]
) -> None:
    edge = await start(Whole())
    client = Client(edge)
    clients.append(client)
    answer = await client.send()
    assert answer.status == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = (await client.rest()).decode().split("\n\n")
    data = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in data) == "hi"
    assert data[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2] == "data: [DONE]"
    ok = {"endpoint": "chat.completions", "code": "200"}
    await until(lambda: edge.sample("ponto_requests_total", ok) == 1)


async def test_a_stream_answered_whole_carries_its_limit_headers_once(tmp_path: Path) -> None:
    async def whole(request: web.Request) -> web.StreamResponse:
        await request.read()  # ignores `stream`
        return web.json_response(COMPLETION, headers={"cache-control": "no-store"})

    s = await stack_on(tmp_path, whole)
    try:
        resp = await s.post(chat("whole", stream=True), key=LIMITED_KEY.key)
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        await resp.read()
        assert resp.headers.getall("x-ratelimit-limit-requests") == ["2"]
        assert resp.headers.getall("cache-control") == ["no-cache"]
    finally:
        await s.close()


async def test_a_responses_stream_answered_whole_reaches_the_sdk_as_events(
    tmp_path: Path,
) -> None:
    async def ignores_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response(whole_response(model=MODEL))

    s = await stack_on(tmp_path, ignores_stream, "/v1/responses")
    client = openai.AsyncOpenAI(base_url=str(s.client.make_url("/v1")), api_key=KEY.key)
    try:
        stream = await client.responses.create(model=MODEL, input="hi", stream=True)
        kinds, text = [], ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        assert text == "Hello there"
        assert (kinds[0], kinds[-1]) == ("response.created", "response.completed")
    finally:
        await client.close()
        await s.close()


async def test_a_stream_answered_whole_has_its_usage_chunk_when_the_cache_is_bypassed(
    tmp_path: Path,
) -> None:
    """Trial 45: the usage chunk came only when the cache step kept the
    answer; a request the cache bypasses (no temperature: not deterministic)
    or no-store lost it, although the client asked for it."""

    async def whole(request: web.Request) -> web.StreamResponse:
        await request.read()  # ignores `stream`
        return web.json_response(COMPLETION)

    s = await stack_on(tmp_path, whole)
    client = openai.AsyncOpenAI(base_url=str(s.client.make_url("/v1")), api_key=KEY.key)
    try:
        for extra in ({}, {"temperature": 0}, {"extra_headers": {"cache-control": "no-store"}}):
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"whole {extra}"}],
                    stream=True,
                    stream_options={"include_usage": True},
                    **extra,
                )
            ]
            assert chunks[-1].usage is not None, extra
            assert chunks[-1].usage.total_tokens == 4
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi"
        # Not asked: none, as before.
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "no usage"}], stream=True
            )
        ]
        assert all(c.usage is None for c in chunks)
    finally:
        await client.close()
        await s.close()
