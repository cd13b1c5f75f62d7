"""A 2xx JSON object with no answer of its endpoint in it is a failed attempt
(trial 65): chat without choices, `"choices": []`, a `"message": null`,
completions without text, embeddings without `data` or with another number
of embeddings than the request has inputs (trial 79), a Responses object
without `output`, a rerank answer without `results`, each ranked. The next
origin answers; when none does, the client gets a 502 in OpenAI's shape, and
nothing is cached. The real proxy app before two hand-written origins that
answer with the body they are told to.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dataplane.http.state import HOLDER, METRICS
from tests.functional.test_pipeline import KEY, MODEL, Stack, error_of, start_stack, table

GOOD: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
    },
    "/v1/completions": {
        "object": "text_completion",
        "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
    },
    "/v1/embeddings": {"object": "list", "data": [{"index": 0, "embedding": [0.5, 0.5]}]},
    "/v1/responses": {"id": "resp_x", "object": "response", "output": [], "status": "completed"},
    "/v1/rerank": {
        "usage": {"total_tokens": 4},
        "results": [{"index": 0, "document": {"text": "a"}, "relevance_score": 0.5}],
    },
}

REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "temperature": 0},
    "/v1/completions": {"prompt": "hi", "temperature": 0},
    "/v1/embeddings": {"input": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/rerank": {"query": "hi", "documents": ["a"]},
}


@dataclass
class Shared:
    """What both origins answer: `bad` for the first `bad_calls` calls in all,
    the endpoint's good answer after that."""

    bad: dict[str, Any] = field(default_factory=dict)
    bad_calls: int = 0
    calls: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        if self.calls <= self.bad_calls:
            return web.json_response(self.bad)
        return web.json_response({"id": "x", "model": MODEL, **GOOD[request.path]})


@dataclass
class Rig:
    stack: Stack
    origins: Shared

    async def post(self, path: str, **fields: Any) -> Any:
        body = {"model": MODEL, **REQUESTS[path], **fields}
        headers = {"authorization": f"Bearer {KEY.key}"}
        return await self.stack.client.post(path, json=body, headers=headers)

    def bad_answers(self) -> float:
        registry = self.stack.app[METRICS].registry
        return sum(
            registry.get_sample_value(
                "ponto_upstream_attempts_total", {"origin": name, "outcome": "bad_answer"}
            )
            or 0.0
            for name in ("o1", "o2")
        )


async def two_origins(
    tmp_path: Path,
    handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
    paths: Iterable[str],
    args: list[str] | None = None,
) -> Stack:
    """The real proxy app (with `args`) before two origins, o1 and o2, each
    answering `paths` with `handle` (one handler: the test says what they
    answer)."""
    servers = []
    for _ in range(2):
        app = web.Application()
        for path in paths:
            app.router.add_post(path, handle)
        server = TestServer(app)
        await server.start_server()
        servers.append(server)
    s = await start_stack(tmp_path, [], args)
    s.others.extend(servers)
    urls = [(f"o{i + 1}", str(server.make_url("/v1"))) for i, server in enumerate(servers)]
    s.app[HOLDER].apply(table(urls, version=3), "control-plane")
    return s


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    shared = Shared()
    s = await two_origins(tmp_path, shared.handle, GOOD)
    yield Rig(s, shared)
    await s.close()


def chat_message(message: Any) -> dict[str, Any]:
    return {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}


NO_ANSWERS = [
    ("/v1/chat/completions", {"object": "chat.completion", "id": "x"}),
    ("/v1/chat/completions", {"object": "chat.completion", "choices": []}),
    ("/v1/chat/completions", chat_message(None)),
    ("/v1/chat/completions", {"choices": ["hi"]}),
    ("/v1/completions", {"choices": [{"index": 0, "message": {"content": "hi"}}]}),
    ("/v1/embeddings", GOOD["/v1/chat/completions"]),
    ("/v1/embeddings", {"object": "list", "data": []}),
    ("/v1/embeddings", {"object": "list", "data": GOOD["/v1/embeddings"]["data"] * 2}),
    ("/v1/responses", {"id": "resp_x", "status": "completed"}),
    # An origin that took /rerank for another endpoint, or ranked nothing.
    ("/v1/rerank", GOOD["/v1/embeddings"]),
    ("/v1/rerank", {"results": []}),
    ("/v1/rerank", {"results": [{"index": 0}]}),
    # The request has one document.
    ("/v1/rerank", {"results": [{"index": 1, "relevance_score": 0.5}]}),
]
IDS = [
    "no-choices",
    "empty-choices",
    "null-message",
    "str-choice",
    "no-text",
    "chat",
    "no-embeddings",
    "more-embeddings",
    "no-output",
    "rerank-embeddings",
    "no-results",
    "no-score",
    "another-document",
]


@pytest.mark.parametrize(("path", "bad"), NO_ANSWERS, ids=IDS)
async def test_an_answer_with_none_in_it_fails_over_to_the_next_origin(
    rig: Rig, path: str, bad: dict[str, Any]
) -> None:
    rig.origins.bad, rig.origins.bad_calls = bad, 1
    resp = await rig.post(path)
    assert resp.status == 200
    body = await resp.json()
    # (A Responses id is shown as the proxy's: test_response_ids.py.)
    assert {k: body[k] for k in GOOD[path] if k != "id"} == {
        k: v for k, v in GOOD[path].items() if k != "id"
    }
    assert (rig.origins.calls, rig.bad_answers()) == (2, 1)


@pytest.mark.parametrize(("path", "bad"), NO_ANSWERS, ids=IDS)
async def test_when_no_origin_answers_the_client_gets_a_502_and_nothing_is_cached(
    rig: Rig, path: str, bad: dict[str, Any]
) -> None:
    rig.origins.bad, rig.origins.bad_calls = bad, 4
    resp = await rig.post(path)
    assert resp.status == 502
    err = error_of(await resp.json())
    assert err["type"] == "upstream_error"
    assert rig.origins.calls == 2
    # Not kept: the same request goes to an origin again, and gets its answer.
    again = await rig.post(path)
    assert again.status == 502
    assert rig.origins.calls == 4
    assert (await rig.post(path)).status == 200


FILTERED = [
    # Azure OpenAI: the prompt filtered, no choice, and why.
    {"object": "chat.completion", "choices": [], "prompt_filter_results": [
        {"prompt_index": 0, "content_filter_results": {"hate": {"filtered": True}}}]},
    # Gemini's OpenAI endpoint: a choice with no message, and its reason.
    {"object": "chat.completion", "choices": [
        {"index": 0, "message": None, "finish_reason": "content_filter: PROHIBITED_CONTENT"}]},
    # A gateway's guardrail: no choice, and the usage of the refusal.
    {"object": "chat.completion", "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}},
]  # fmt: skip


@pytest.mark.parametrize("filtered", FILTERED, ids=["azure", "gemini", "guardrail"])
async def test_an_answer_that_says_why_it_has_nothing_is_the_clients(
    rig: Rig, filtered: dict[str, Any]
) -> None:
    """Review: a content filter's refusal was failed over as no answer: the
    prompt went to every origin, each was counted failing, and the client
    was told to retry."""
    rig.origins.bad, rig.origins.bad_calls = filtered, 4
    resp = await rig.post("/v1/chat/completions")
    assert resp.status == 200
    assert (await resp.json())["choices"] == filtered["choices"]
    assert (rig.origins.calls, rig.bad_answers()) == (1, 0)


async def test_a_stream_answered_with_no_answer_in_a_whole_body_fails_over(rig: Rig) -> None:
    # Asked for a stream, answered whole: the proxy makes the stream, but
    # only of an answer (trial 65: the raw JSON went out and the SDK yielded nothing).
    rig.origins.bad, rig.origins.bad_calls = {"object": "chat.completion", "choices": []}, 1
    resp = await rig.post("/v1/chat/completions", stream=True)
    assert resp.status == 200
    assert resp.content_type == "text/event-stream"
    text = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == "hi"
    assert rig.bad_answers() == 1


@pytest.mark.parametrize(
    "inputs",
    [
        ["a", "b"],  # GOOD's one embedding is one short of these two batches
        [[1, 2], [3]],
        "a",
        [1, 2, 3],  # one array of token ids: one input
    ],
    ids=["texts", "token-arrays", "text", "token-ids"],
)
async def test_an_embeddings_answer_holds_one_embedding_per_input(rig: Rig, inputs: Any) -> None:
    """Trial 79: an origin's answer one embedding short of its batch went to
    the client as a success, and was kept: a client pairing vectors with its
    texts by position paired them wrongly for the cache's TTL."""
    one = isinstance(inputs, str) or isinstance(inputs[0], int)
    resp = await rig.post("/v1/embeddings", input=inputs)
    if one:
        assert resp.status == 200
        assert len((await resp.json())["data"]) == 1
        assert (rig.origins.calls, rig.bad_answers()) == (1, 0)
        return
    assert resp.status == 502
    assert error_of(await resp.json())["type"] == "upstream_error"
    assert (rig.origins.calls, rig.bad_answers()) == (2, 2)
    # Not kept: asked again, it goes to the origins again.
    assert (await rig.post("/v1/embeddings", input=inputs)).status == 502
    assert rig.origins.calls == 4


async def test_an_embeddings_answer_too_large_to_check_first_is_not_kept_when_miscounted(
    tmp_path: Path,
) -> None:
    """An answer over 1 MiB is sent before it is parsed, so no other origin
    can be asked for it; one embedding short of its batch, it is relayed but
    never kept (with a --cache-max-entry-kb that keeps such answers)."""
    shared = Shared()
    s = await two_origins(tmp_path, shared.handle, GOOD, ["--cache-max-entry-kb", "4096"])
    try:
        rig = Rig(s, shared)
        big = {"object": "list", "data": [{"index": 0, "embedding": [0.25] * 250_000}]}
        shared.bad, shared.bad_calls = big, 4
        for calls in (1, 2):
            resp = await rig.post("/v1/embeddings", input=["a", "b"])
            assert resp.status == 200
            assert len(await resp.read()) > 1 << 20
            assert (resp.headers["x-ponto-cache"], shared.calls) == ("miss", calls)
        # The same answer to one input is kept: the repeat is a hit.
        for cache in ("miss", "hit"):
            resp = await rig.post("/v1/embeddings", input=["a"])
            assert (resp.status, resp.headers["x-ponto-cache"]) == (200, cache)
            await resp.read()
        assert shared.calls == 3
    finally:
        await s.close()


async def test_a_rerank_answer_too_large_to_check_first_is_not_kept_when_misranked(
    tmp_path: Path,
) -> None:
    """A ranking over 1 MiB (long documents returned) is sent before it is
    parsed; one that ranks a document past its request's, which a client's
    `documents[index]` fails on, is relayed but never kept."""
    shared = Shared()
    s = await two_origins(tmp_path, shared.handle, GOOD, ["--cache-max-entry-kb", "4096"])
    try:
        rig = Rig(s, shared)
        text = "x" * 1_100_000
        ranked = [{"index": 1, "relevance_score": 0.5, "document": {"text": text}}]
        shared.bad, shared.bad_calls = {"usage": {"total_tokens": 4}, "results": ranked}, 4
        for calls in (1, 2):
            resp = await rig.post("/v1/rerank", documents=["a"])
            assert resp.status == 200
            assert len(await resp.read()) > 1 << 20
            assert (resp.headers["x-ponto-cache"], shared.calls) == ("miss", calls)
        # The same answer to two documents ranks one of them: kept, then a hit.
        for cache in ("miss", "hit"):
            resp = await rig.post("/v1/rerank", documents=["a", "b"])
            assert (resp.status, resp.headers["x-ponto-cache"]) == (200, cache)
            await resp.read()
        assert shared.calls == 3
    finally:
        await s.close()
