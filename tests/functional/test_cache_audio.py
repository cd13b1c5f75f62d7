"""A streamed audio answer through the whole proxy before a hand-written origin
that streams it as OpenAI's audio models do: kept, it answers a non-streaming
repeat with the whole audio (a trial with openai 3.x: the repeat got the last
piece alone, without its id, its transcript and the first half of its data);
a stream with an object member the cache cannot join is not kept."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from dataplane.http.state import METRICS
from tests.functional.test_answer_shapes import two_origins
from tests.functional.test_pipeline import Stack, chat

AUDIO = {"id": "audio_1", "data": "UklGRg==AAAA", "expires_at": 1729234747, "transcript": "hello"}


def chunk(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-a",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o-audio-preview",
        "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}],
    }


# The usage chunk the proxy asks origins for (docs/streams.md).
USAGE = {
    "id": "chatcmpl-a",
    "object": "chat.completion.chunk",
    "created": 1700000000,
    "model": "gpt-4o-audio-preview",
    "choices": [],
    "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12},
}
AUDIO_STREAM = [
    chunk({"role": "assistant", "content": None, "refusal": None}),
    chunk({"audio": {"id": "audio_1", "transcript": "hel"}}),
    chunk({"audio": {"data": "UklGRg==", "transcript": "lo"}}),
    chunk({"audio": {"data": "AAAA", "expires_at": 1729234747}}),
    chunk({}, "stop"),
    USAGE,
]
# An object member this proxy has no rule to join, in two deltas.
WIDGET_STREAM = [
    chunk({"role": "assistant", "content": "hi"}),
    chunk({"widget": {"part": "a"}}),
    chunk({"widget": {"part": "b"}}),
    chunk({}, "stop"),
    USAGE,
]


@dataclass
class Origin:
    """Streams `chunks` to every call, counted."""

    chunks: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for c in self.chunks:
            await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclass
class Rig:
    stack: Stack
    origin: Origin


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    origin = Origin()
    s = await two_origins(tmp_path, origin.handle, ["/v1/chat/completions"])
    yield Rig(s, origin)
    await s.close()


QUESTION = "say hello"
AUDIO_FIELDS = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}


async def test_a_streamed_audio_answer_answers_a_whole_request_with_all_of_it(rig: Rig) -> None:
    rig.origin.chunks = AUDIO_STREAM
    streamed = await rig.stack.post(chat(QUESTION, stream=True, **AUDIO_FIELDS))
    assert streamed.status == 200 and streamed.headers["x-ponto-cache"] == "miss"
    await streamed.read()
    whole = await rig.stack.post(chat(QUESTION, **AUDIO_FIELDS))
    assert whole.status == 200 and whole.headers["x-ponto-cache"] == "hit"
    message = (await whole.json())["choices"][0]["message"]
    assert message["audio"] == AUDIO and message["content"] is None
    assert rig.origin.calls == 1


async def test_a_stream_with_an_object_it_cannot_join_is_not_kept(rig: Rig) -> None:
    rig.origin.chunks = WIDGET_STREAM
    for _ in range(2):
        resp = await rig.stack.post(chat(QUESTION, stream=True))
        assert resp.status == 200 and resp.headers["x-ponto-cache"] == "miss"
        await resp.read()
    assert rig.origin.calls == 2
    registry = rig.stack.app[METRICS].registry
    assert registry.get_sample_value("ponto_cache_unkept_total", {"reason": "incomplete"}) == 2
