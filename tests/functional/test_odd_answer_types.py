"""An origin's 200 whose JSON has fields of the wrong types or shapes
(`choices` an object, `usage` a string, `prompt_tokens` a bool, a top level
that is a list...), whole and streamed: Ponto's own code never fails on it
(no 500 `internal_error`, no traceback): the answer is passed on, or refused
with a 502 when it holds no answer of its endpoint. The real proxy app before
two hand-written origins that answer with the body they are told to.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from dataplane.http.state import HOLDER, METRICS, PIPELINE
from ponto.apikeys import issue_key
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_answer_shapes import GOOD, REQUESTS, two_origins
from tests.functional.test_pipeline import KEY, MODEL, Stack, table


@dataclass
class Odd:
    """Both origins answer `body` (any JSON value) whole, or as one `data:`
    chunk then `[DONE]` when the request asks for a stream."""

    body: Any = None
    calls: int = field(default=0)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        sent = await request.json()
        self.calls += 1
        if not sent.get("stream"):
            return web.Response(
                body=json.dumps(self.body).encode(), content_type="application/json"
            )
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(self.body).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


CHOICE = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
DELTA = {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [CHOICE], **fields}


def choice(**fields: Any) -> dict[str, Any]:
    return chat(choices=[{**CHOICE, **fields}])


def message(**fields: Any) -> dict[str, Any]:
    return choice(message={"role": "assistant", "content": "hi", **fields})


USAGES = ["x", [1], -5, 1.5, 10**30, {"prompt_tokens": "3"}, {"prompt_tokens": True},
          {"prompt_tokens": -1, "completion_tokens": 2.5, "total_tokens": None},
          {"prompt_tokens": 10**30, "completion_tokens": 10**30}, {"completion_tokens": []},
          {"prompt_tokens_details": "x", "completion_tokens_details": [1]},
          {"prompt_tokens_details": {"cached_tokens": "5"}}, {"total_tokens": {"a": 1}},
]  # fmt: skip

CHAT_BODIES: list[Any] = [
    None, [], [chat()], "hi", 5, True,
    chat(choices={"0": CHOICE}), chat(choices=None), chat(choices="hi"), chat(choices=5),
    chat(choices=[None]), chat(choices=[5]), chat(choices=[[CHOICE]]),
    choice(message="hi"), choice(message=5), choice(message=[]),
    message(content=5), message(content=["hi"]), message(content={"a": 1}), message(content=None),
    message(content=[{"type": "text", "text": 5}]), message(role=5),
    message(tool_calls={"a": 1}), message(tool_calls="x"), message(tool_calls=[5]),
    message(tool_calls=[{"function": "x"}]), message(tool_calls=[{"function": {"arguments": 5}}]),
    message(refusal=5), message(function_call="x"),
    choice(index="0"), choice(index=None), choice(index=-1), choice(index=10**30),
    choice(logprobs="x"), choice(logprobs=[1]), choice(logprobs={"content": "x"}),
    choice(logprobs={"content": [5]}), choice(finish_reason=5), choice(finish_reason=None),
    choice(finish_reason=[]),
    chat(model=5), chat(model=None), chat(model=["m"]), chat(id=None), chat(id=5), chat(id=[]),
    chat(object=5), chat(created="x"), chat(system_fingerprint=5), chat(service_tier=[]),
    *[chat(usage=u) for u in USAGES],
]  # fmt: skip
DELTAS: list[Any] = [
    None, [], "hi", 5, chat(choices={"0": DELTA}), chat(choices=None), chat(choices="x"),
    chat(choices=[None]), chat(choices=[5]), chat(choices=[{**DELTA, "delta": None}]),
    chat(choices=[{**DELTA, "delta": "hi"}]), chat(choices=[{**DELTA, "delta": {"content": 5}}]),
    chat(choices=[{**DELTA, "delta": {"content": ["x"]}}]),
    chat(choices=[{**DELTA, "delta": {"tool_calls": {"a": 1}}}]),
    chat(choices=[{**DELTA, "delta": {"tool_calls": [5]}}]),
    chat(choices=[{**DELTA, "delta": {"tool_calls": [{"index": "x", "function": 5}]}}]),
    chat(choices=[{**DELTA, "index": "0"}]), chat(choices=[{**DELTA, "finish_reason": 5}]),
    chat(choices=[{**DELTA, "finish_reason": []}]),
    chat(choices=[{**DELTA, "logprobs": "x"}]), chat(model=5), chat(id=None),
    *[chat(choices=[DELTA], usage=u) for u in USAGES],
    *[chat(choices=[], usage=u) for u in USAGES],
]  # fmt: skip
COMPLETIONS: list[Any] = [
    None, [], {"choices": {"a": 1}}, {"choices": [None]}, {"choices": [{"text": 5}]},
    {"choices": [{"text": ["x"]}]}, {"choices": [{"text": "hi", "logprobs": "x"}]},
    {"choices": [{"text": "hi", "finish_reason": []}]},
    *[{"choices": [{"text": "hi", "finish_reason": "stop"}], "usage": u} for u in USAGES],
]  # fmt: skip
EMBEDDINGS: list[Any] = [
    None, [], {"data": {"a": 1}}, {"data": None}, {"data": "x"}, {"data": [None]}, {"data": [5]},
    {"data": [{"embedding": "x"}]}, {"data": [{"embedding": None}]},
    {"data": [{"embedding": [0.5, "x"]}]}, {"data": [{"embedding": {"a": 1}}]},
    {"data": [{"embedding": [0.5], "index": "0"}]},
    *[{"data": [{"index": 0, "embedding": [0.5]}], "usage": u} for u in USAGES],
]  # fmt: skip
RESPONSES: list[Any] = [
    None, [], {"output": {"a": 1}}, {"output": None}, {"output": "x"}, {"output": [None]},
    {"output": [5]}, {"output": [{"type": 5}]},
    {"output": [{"type": "message", "content": "x"}]},
    {"output": [{"type": "message", "content": [5]}]},
    {"output": [{"type": "message", "content": [{"type": "output_text", "text": 5}]}]},
    {"id": None, "output": []}, {"id": 5, "output": []}, {"id": [], "output": []},
    {"output": [], "status": 5}, {"output": [], "status": None}, {"output": [], "model": 5},
    *[{"id": "resp_x", "output": [], "status": "completed", "usage": u} for u in USAGES],
    *[{"id": "resp_x", "output": [], "status": "completed", "usage": {"input_tokens": u}}
      for u in ["3", True, -1, 1.5, 10**30, None]],
]  # fmt: skip

CASES = (
    [("/v1/chat/completions", False, b) for b in CHAT_BODIES]
    + [("/v1/chat/completions", True, b) for b in DELTAS]
    + [("/v1/completions", False, b) for b in COMPLETIONS]
    + [("/v1/completions", True, b) for b in COMPLETIONS]
    + [("/v1/embeddings", False, b) for b in EMBEDDINGS]
    + [("/v1/responses", False, b) for b in RESPONSES]
)


BUDGETED = issue_key()


@pytest.fixture(params=["defaults", "features"])
async def odd(
    tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Stack, Odd, str]]:
    shared = Odd()
    features = request.param == "features"
    args = ["--origin-stream-usage=client"] if features else None
    s = await two_origins(tmp_path, shared.handle, GOOD, args)
    key = KEY.key
    if features:
        t = table(
            [(f"o{i + 1}", str(o.make_url("/v1"))) for i, o in enumerate(s.others)], version=4
        )
        limits = pb.Limits(rpm=10**4, tpm=10**8, tokens_per_day=10**9, tokens_per_month=10**10)
        t.keys.add(id=BUDGETED.key_id, hash=BUDGETED.key_hash, tenant="acme", limits=limits)
        t.etag = content_etag(t)
        s.app[HOLDER].apply(t, "control-plane")
        key = BUDGETED.key
    yield s, shared, key
    await s.close()


@pytest.mark.parametrize(("path", "stream", "body"), CASES)
async def test_an_answer_of_odd_types_is_passed_on_or_refused_never_a_500(
    odd: tuple[Stack, Odd, str],
    path: str,
    stream: bool,
    body: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Passed on (200) or refused (502), twice; what the cache kept of it, if
    anything, is what the origin sent; the budget and token counts charged
    stay small (an estimate where the usage is unusable)."""
    s, shared, key = odd
    shared.body = body
    req = {"model": MODEL, **REQUESTS[path]}
    if stream:
        req["stream"] = True
    headers = {"authorization": f"Bearer {key}"}
    texts = []
    for _ in range(2):
        resp = await s.client.post(path, json=req, headers=headers)
        text = await resp.text()
        assert resp.status != 500, text
        assert "internal_error" not in text
        assert resp.status in (200, 502), text
        texts.append((resp.status, text))
    # What the cache kept, if anything, is the origin's answer as it came.
    shared.body, calls = {"id": "x", "model": MODEL, **GOOD[path]}, shared.calls
    again = await s.client.post(path, json=req, headers=headers)
    assert again.status == 200, await again.text()
    if shared.calls == calls:
        assert (again.status, await again.text()) == texts[0]
    for spent in s.app[PIPELINE].limiter.counts().values():
        assert 0 <= spent.day_tokens <= 10**5 and 0 <= spent.month_tokens <= 10**5, spent
    samples = [
        x for m in s.app[METRICS].registry.collect() if "tokens" in m.name for x in m.samples
    ]
    assert all(0 <= x.value <= 10**5 for x in samples), [
        x for x in samples if not 0 <= x.value <= 10**5
    ]
    assert not [r for r in caplog.records if r.exc_info], [
        r.getMessage() for r in caplog.records if r.exc_info
    ]


BROKEN = [
    ("/v1/chat/completions", choice(message=5)),
    ("/v1/chat/completions", choice(message=[])),
    ("/v1/chat/completions", choice(message="hi")),
    ("/v1/completions", {"choices": [{"text": 5, "finish_reason": "stop"}]}),
    ("/v1/completions", {"choices": [{"text": ["x"], "finish_reason": "stop"}]}),
]


@pytest.mark.parametrize(("path", "body"), BROKEN)
async def test_a_choice_without_its_message_or_text_is_passed_on_not_kept(
    odd: tuple[Stack, Odd, str], path: str, body: Any
) -> None:
    """A choice with a finish_reason is passed on as the origin's (it may say
    why there is no answer), but one with no message object or text string
    is kept by no cache: the next client asks the origin again."""
    s, shared, key = odd
    shared.body = body
    req = {"model": MODEL, **REQUESTS[path]}
    for calls in (1, 2):
        resp = await s.client.post(path, json=req, headers={"authorization": f"Bearer {key}"})
        assert resp.status == 200
        assert await resp.json() == body
        assert shared.calls == calls
