"""An origin's `usage` is believed only when it can be true (trial 65): a
hostile origin's 10**12 tokens held a tenant's day budget until midnight,
and its negative counts gave tokens back. The real proxy app before a
hand-written origin that answers with the usage it is told to; what the
tenant is charged is read from ponto_tenant_tokens_total, which settlement,
budgets and the access log share (Pipeline.believe).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dataplane.http.state import HOLDER, METRICS, PIPELINE
from dataplane.ratelimit import estimate_prompt_tokens
from ponto.apikeys import issue_key
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import KEY, Stack, chat, read_sse, start_stack, table

BUDGETED = issue_key()
ANSWER = "four words of text"


@dataclass
class Liar:
    """Answers every chat request with ANSWER and `usage`, whole or streamed."""

    usage: dict[str, Any] = field(default_factory=dict)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": ANSWER},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": self.usage,
                }
            )
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        head = {"id": "c", "object": "chat.completion.chunk", "model": body["model"]}
        for word in ANSWER.split():
            chunk = {**head, "choices": [{"index": 0, "delta": {"content": word}}]}
            await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        end = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await out.write(b"data: " + json.dumps(end).encode() + b"\n\n")
        last = {**head, "choices": [], "usage": self.usage}
        await out.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        await out.write_eof()
        return out


@dataclass
class Rig:
    stack: Stack
    origin: Liar

    def tokens(self, kind: str) -> float:
        labels = {"tenant": "acme", "key": KEY.key_id, "kind": kind}
        value = self.stack.app[METRICS].registry.get_sample_value(
            "ponto_tenant_tokens_total", labels
        )
        return value or 0.0

    def rejected(self, reason: str) -> float:
        value = self.stack.app[METRICS].registry.get_sample_value(
            "ponto_origin_usage_rejected_total", {"origin": "o1", "reason": reason}
        )
        return value or 0.0

    def budget(self, limits: pb.Limits) -> None:
        t = table([("o1", self.url)], version=4)
        t.keys.add(id=BUDGETED.key_id, hash=BUDGETED.key_hash, tenant="acme", limits=limits)
        t.etag = content_etag(t)
        self.stack.app[HOLDER].apply(t, "control-plane")

    url: str = ""
    asked: int = 0


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    origin = Liar()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", origin.handle)
    server = TestServer(app)
    await server.start_server()
    s = await start_stack(tmp_path, [])
    s.others.append(server)
    url = str(server.make_url("/v1"))
    s.app[HOLDER].apply(table([("o1", url)], version=3), "control-plane")
    yield Rig(s, origin, url)
    await s.close()


async def ask(rig: Rig, stream: bool, key: str = KEY.key, **fields: Any) -> int:
    rig.asked += 1  # a new question each time: no cache hit
    text = f"how many tokens? {rig.asked}"
    resp = await rig.stack.post(chat(text, stream=stream, **fields), key=key)
    if stream:
        await read_sse(resp)
    else:
        await resp.read()
    return int(resp.status)


@pytest.mark.parametrize("stream", [False, True])
async def test_an_absurd_count_is_not_charged_and_is_counted(
    rig: Rig, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    rig.origin.usage = {"prompt_tokens": 10**12, "completion_tokens": 10**12}
    caplog.set_level(logging.WARNING)
    assert await ask(rig, stream) == 200
    # The proxy's own figures: a prompt estimate of a few tokens, and the
    # answer's (at most its bytes).
    assert 0 < rig.tokens("prompt") < 1000
    assert 0 < rig.tokens("completion") < 1000
    assert rig.rejected("past_answer") == 1
    assert sum("does not believe" in r.message for r in caplog.records) == 1
    # Told once a minute per origin, counted every time.
    assert await ask(rig, stream) == 200
    assert rig.rejected("past_answer") == 2
    assert sum("does not believe" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_negative_count_gives_no_tokens_back(rig: Rig, stream: bool) -> None:
    rig.origin.usage = {"prompt_tokens": 10, "completion_tokens": -5000}
    assert await ask(rig, stream) == 200
    # The proxy's own count stood for the whole usage: nothing subtracted.
    assert rig.tokens("prompt") > 0 and rig.tokens("completion") > 0
    assert rig.rejected("invalid") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_past_max_tokens_is_clamped_to_it(rig: Rig, stream: bool) -> None:
    rig.origin.usage = {"prompt_tokens": 12, "completion_tokens": 90}
    assert await ask(rig, stream, max_tokens=4, n=2) == 200
    assert (rig.tokens("prompt"), rig.tokens("completion")) == (12, 8)
    assert rig.rejected("past_max_tokens") == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("limited", [True, False], ids=["some-limited", "none-limited"])
async def test_a_prompt_counted_as_none_is_charged_its_estimate(
    rig: Rig, stream: bool, limited: bool
) -> None:
    """Old llama.cpp's "TODO: fill" usage. With no scope limited the
    estimate is not made at admission, but when the usage needs it."""
    rig.stack.app[HOLDER].apply(table([("o1", rig.url)], version=5, limited=limited), "test")
    assert rig.stack.app[PIPELINE].limiter.limiting is limited
    rig.origin.usage = {"prompt_tokens": 0, "completion_tokens": 3}
    assert await ask(rig, stream) == 200
    body = chat(f"how many tokens? {rig.asked}", stream=stream)
    assert rig.tokens("prompt") == estimate_prompt_tokens("chat.completions", body) > 0
    assert rig.rejected("no_prompt") == 1


async def test_an_honest_count_past_the_answers_text_is_believed(rig: Rig) -> None:
    # A reasoning model's hidden tokens: far more than the text it shows.
    rig.origin.usage = {"prompt_tokens": 12, "completion_tokens": 30_000}
    assert await ask(rig, False) == 200
    assert (rig.tokens("prompt"), rig.tokens("completion")) == (12, 30_000)
    assert sum(rig.rejected(r) for r in ("invalid", "past_answer", "past_request")) == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "limits", [pb.Limits(tpm=5000), pb.Limits(tokens_per_day=5000)], ids=["tpm", "day"]
)
async def test_an_absurd_count_does_not_spend_a_limit(
    rig: Rig, limits: pb.Limits, stream: bool
) -> None:
    # Trial 65: the next request was told to retry in 19 years (TPM), or
    # refused until midnight (a day budget).
    rig.budget(limits)
    rig.origin.usage = {"prompt_tokens": 10**12, "completion_tokens": 3}
    assert await ask(rig, stream, key=BUDGETED.key, max_tokens=20) == 200
    assert rig.rejected("past_request") == 1
    assert await ask(rig, stream, key=BUDGETED.key, max_tokens=20) == 200
