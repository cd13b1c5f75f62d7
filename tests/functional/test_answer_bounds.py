"""How much of an origin's answer the proxy holds (--max-answer-bytes): a
whole answer past the bound is refused with a 502 in the OpenAI shape, the
call's connection closed and no other origin tried; a stream's event past it
cuts the stream, with an error event that says so, and is not continued
elsewhere. Within the bound, answers and
long events pass whole. The real proxy app before hand-written origins that
answer as much as they are told to, the official openai client for the 502.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dataplane.http.state import HOLDER, METRICS
from dataplane.settings import parse as parse_proxy
from tests.functional.test_pipeline import (
    KEY,
    MODEL,
    Stack,
    chat,
    error_of,
    read_sse,
    start_stack,
    table,
)

BOUND = 1 << 20  # the proxy's --max-answer-bytes in these tests


@dataclass
class Sizable:
    """An origin that answers `size` bytes of content (in 64 KiB chunks,
    chunked encoding): a chat completion, or a stream whose one content event
    holds them all. Counts its calls."""

    size: int = 0
    calls: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls += 1
        stream = bool(body.get("stream"))
        out = web.StreamResponse(
            headers={"content-type": "text/event-stream" if stream else "application/json"}
        )
        out.enable_chunked_encoding()
        await out.prepare(request)
        if stream:
            await out.write(b'data: {"id":"c","object":"chat.completion.chunk","model":"')
        else:
            await out.write(b'{"id":"c","object":"chat.completion","model":"')
        await out.write(MODEL.encode() + b'","created":1,"choices":[{"index":0,')
        await out.write(b'"delta":{"content":"' if stream else b'"message":{"content":"')
        for at in range(0, self.size, 65536):
            await out.write(b"a" * min(65536, self.size - at))
        if stream:
            await out.write(b'"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        else:
            await out.write(b'","role":"assistant"},"finish_reason":"stop"}]}')
        await out.write_eof()
        return out


@dataclass
class Rig:
    stack: Stack
    origins: dict[str, Sizable]

    @property
    def calls(self) -> int:
        return sum(o.calls for o in self.origins.values())

    def attempts(self, outcome: str) -> float:
        registry = self.stack.app[METRICS].registry
        return sum(
            registry.get_sample_value(
                "ponto_upstream_attempts_total", {"origin": name, "outcome": outcome}
            )
            or 0.0
            for name in self.origins
        )

    def sample(self, name: str) -> float:
        return self.stack.app[METRICS].registry.get_sample_value(name) or 0.0


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    """The proxy (--max-answer-bytes BOUND) before two origins that answer alike."""
    origins = {"o1": Sizable(), "o2": Sizable()}
    servers = []
    for origin in origins.values():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", origin.handle)
        server = TestServer(app)
        await server.start_server()
        servers.append(server)
    s = await start_stack(tmp_path, [], [f"--max-answer-bytes={BOUND}"])
    s.others.extend(servers)
    s.app[HOLDER].apply(
        table(
            [
                (name, str(server.make_url("/v1")))
                for name, server in zip(origins, servers, strict=True)
            ],
            version=3,
        ),
        "control-plane",
    )
    yield Rig(s, origins)
    await s.close()


def set_size(rig: Rig, size: int) -> None:
    for origin in rig.origins.values():
        origin.size = size


async def test_a_whole_answer_within_the_bound_is_answered(rig: Rig) -> None:
    set_size(rig, BOUND - 1000)
    resp = await rig.stack.post(chat("within"))
    assert resp.status == 200
    answer = await resp.json()
    assert len(answer["choices"][0]["message"]["content"]) == BOUND - 1000
    assert (rig.calls, rig.attempts("ok")) == (1, 1)


async def test_a_whole_answer_past_the_bound_is_a_502_from_one_origin(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    set_size(rig, 3 * BOUND)
    caplog.set_level(logging.INFO)
    client = openai.AsyncOpenAI(
        base_url=str(rig.stack.client.make_url("/v1")), api_key=KEY.key, max_retries=0
    )
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "past"}]
            )
    finally:
        await client.close()
    assert caught.value.status_code == 502
    err = error_of(caught.value.response.json())
    assert (err["type"], err["code"]) == ("upstream_error", "upstream_answer_too_large")
    assert str(BOUND) in err["message"]
    # One origin made the answer; the next was not asked to make it again,
    # and the one that did is not held against its health.
    assert rig.calls == 1
    assert rig.attempts("too_large") == 1
    assert rig.sample("ponto_origin_ejections_total") == 0
    # Told once, in one line without a traceback, naming the bound.
    told = [r for r in caplog.records if "--max-answer-bytes" in r.getMessage()]
    assert len(told) == 1
    assert f"more than {BOUND} bytes" in told[0].getMessage()
    assert told[0].exc_info is None
    # The proxy went on serving.
    set_size(rig, 10)
    resp = await rig.stack.post(chat("after"))
    assert resp.status == 200
    await resp.read()


async def test_a_streams_event_within_the_bound_is_relayed_whole(rig: Rig) -> None:
    set_size(rig, BOUND - 1000)
    resp = await rig.stack.post(chat("long event", stream=True))
    assert resp.status == 200
    events = await read_sse(resp)
    assert len(json.loads(events[0])["choices"][0]["delta"]["content"]) == BOUND - 1000
    assert events[-1] == "[DONE]"


async def test_a_streams_event_past_the_bound_cuts_the_stream(rig: Rig) -> None:
    set_size(rig, 3 * BOUND)
    resp = await rig.stack.post(chat("endless event", stream=True))
    assert resp.status == 200
    events = await read_sse(resp)
    # None of the event: the error event, then the stream's end. It says the
    # bound cut the stream, not that the origin broke it: a retry would be cut too.
    error = json.loads(events[0])["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_event_too_large")
    assert f"({BOUND} bytes)" in error["message"] and "retry" not in error["message"]
    assert events[1:] == ["[DONE]"]
    # Not continued on the other origin (continuation is on by default), as
    # a whole answer past the bound is not asked again: it would make as
    # long an event.
    assert sorted(o.calls for o in rig.origins.values()) == [0, 1]
    assert rig.attempts("cut_after_start") == 1
    registry = rig.stack.app[METRICS].registry
    assert (
        registry.get_sample_value("ponto_stream_continuations_total", {"outcome": "refused"}) == 1
    )
    # Cut, it is not kept: the same request goes to an origin again.
    set_size(rig, 10)
    again = await rig.stack.post(chat("endless event", stream=True))
    assert again.headers["x-ponto-cache"] == "miss"
    await again.read()


def test_the_bound_is_a_flag_of_at_least_64_kib() -> None:
    flags = ["--region=r1", "--control-plane=127.0.0.1:9"]
    assert parse_proxy(flags).upstream.max_answer_bytes == 64 << 20
    assert parse_proxy([*flags, "--max-answer-bytes=65536"]).upstream.max_answer_bytes == 65536
    with pytest.raises(SystemExit) as exit_:
        parse_proxy([*flags, "--max-answer-bytes=65535"])
    assert exit_.value.code == 2
