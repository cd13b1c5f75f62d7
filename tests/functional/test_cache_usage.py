"""A client that asks for usage (stream_options.include_usage) gets it from the
cache too, and one that did not ask gets none (tests/functional/test_pipeline.py's
stack, the origin simulator, which sends usage only when asked, as OpenAI).

The cache key leaves stream_options out, so one entry serves both kinds of
client. By default the proxy asks the origin for every stream's usage
(--origin-stream-usage always), so every stream is recorded with it; with
`client`, a stream recorded without usage cannot answer a client that asks, and
is replaced by the answer recorded for it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dataplane.cache.embed import HashingEmbedder
from dataplane.cache.semantic import SemanticIndex
from dataplane.http.state import HOLDER, METRICS, PIPELINE
from ponto.originsim.app import SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import KEY, MODEL, Stack, chat, read_sse, start_stack, table

USAGE = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    """Origins asked for usage only when the client asks: streams recorded without it."""
    s = await start_stack(
        tmp_path,
        [SimConfig(name="o1", answer_tokens=6, seed=1)],
        ["--origin-stream-usage=client"],
    )
    yield s
    await s.close()


@pytest.fixture
async def asking(tmp_path: Path) -> AsyncIterator[Stack]:
    """Every stream's usage asked of the origin (the default)."""
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=6, seed=1)])
    yield s
    await s.close()


async def post(stack: Stack, endpoint: str, body: dict[str, Any]) -> Any:
    headers = {"authorization": f"Bearer {KEY.key}"}
    return await stack.client.post(f"/v1/{endpoint}", json=body, headers=headers)


def request(endpoint: str, text: str, **fields: Any) -> dict[str, Any]:
    if endpoint == "chat/completions":
        return chat(text, **fields)
    return {"model": MODEL, "prompt": text, "temperature": 0, **fields}


async def chunks_of(resp: Any) -> list[dict[str, Any]]:
    events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def usage_of(chunks: list[dict[str, Any]]) -> Any:
    """The usage of a stream: its last chunk's, with no choices (as OpenAI)."""
    assert chunks[-1]["choices"] == []
    return chunks[-1]["usage"]


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
async def test_a_stream_cached_without_usage_is_refreshed_for_a_client_that_asks(
    stack: Stack, endpoint: str
) -> None:
    plain = await post(stack, endpoint, request(endpoint, "count to three", stream=True))
    assert plain.headers["x-ponto-cache"] == "miss"
    assert all("usage" not in c for c in await chunks_of(plain))

    asks = await post(stack, endpoint, request(endpoint, "count to three", **USAGE))
    assert asks.headers["x-ponto-cache"] == "miss"
    assert asks.headers["x-ponto-cache-reason"] == "no-usage"
    assert usage_of(await chunks_of(asks))["completion_tokens"] == 6
    assert stack.origin_requests() == 2

    # The answer recorded with usage replaced the entry: it answers both kinds.
    again = await post(stack, endpoint, request(endpoint, "count to three", **USAGE))
    assert again.headers["x-ponto-cache"] == "hit"
    assert usage_of(await chunks_of(again))["completion_tokens"] == 6
    plain_again = await post(stack, endpoint, request(endpoint, "count to three", stream=True))
    assert plain_again.headers["x-ponto-cache"] == "hit"
    assert all("usage" not in c and c["choices"] for c in await chunks_of(plain_again))
    assert stack.origin_requests() == 2
    requests = stack.app[METRICS].registry.get_sample_value(
        "ponto_cache_requests_total", {"result": "miss", "kind": "no-usage"}
    )
    assert requests == 1


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
async def test_a_stream_of_a_client_that_did_not_ask_is_recorded_with_the_origins_usage(
    asking: Stack, endpoint: str
) -> None:
    """The simulator, as OpenAI, marks every chunk of a stream asked for
    usage with `"usage": null`: the client that did not ask sees none of it,
    nor the usage chunk, as from the cache; the entry answers every client."""
    plain = await post(asking, endpoint, request(endpoint, "count to three", stream=True))
    assert plain.headers["x-ponto-cache"] == "miss"
    assert all("usage" not in c and c["choices"] for c in await chunks_of(plain))

    asks = await post(asking, endpoint, request(endpoint, "count to three", **USAGE))
    assert asks.headers["x-ponto-cache"] == "hit"
    assert usage_of(await chunks_of(asks))["completion_tokens"] == 6
    whole = await post(asking, endpoint, request(endpoint, "count to three"))
    assert whole.headers["x-ponto-cache"] == "hit"
    assert (await whole.json())["usage"]["completion_tokens"] == 6
    plain_again = await post(asking, endpoint, request(endpoint, "count to three", stream=True))
    assert plain_again.headers["x-ponto-cache"] == "hit"
    assert await plain_again.read() == await plain.read()
    assert asking.origin_requests() == 1


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
async def test_a_stream_cached_without_usage_is_no_hit_for_a_whole_answer(
    stack: Stack, endpoint: str
) -> None:
    # A whole answer always has its usage (the origin's does): a stream
    # recorded without any cannot give it; the whole answer replaces it.
    plain = await post(stack, endpoint, request(endpoint, "count to three", stream=True))
    assert all("usage" not in c for c in await chunks_of(plain))

    whole = await post(stack, endpoint, request(endpoint, "count to three"))
    assert whole.headers["x-ponto-cache"] == "miss"
    assert whole.headers["x-ponto-cache-reason"] == "no-usage"
    assert (await whole.json())["usage"]["completion_tokens"] == 6
    again = await post(stack, endpoint, request(endpoint, "count to three"))
    assert again.headers["x-ponto-cache"] == "hit"
    assert (await again.json())["usage"]["completion_tokens"] == 6
    assert stack.origin_requests() == 2


async def test_an_entry_stored_whole_answers_a_stream_that_asks_for_usage(stack: Stack) -> None:
    whole = await stack.post(chat("say hello"))
    usage = (await whole.json())["usage"]
    streamed = await stack.post(chat("say hello", **USAGE))
    assert streamed.headers["x-ponto-cache"] == "hit"
    assert usage_of(await chunks_of(streamed)) == usage
    assert stack.origin_requests() == 1


async def test_a_semantic_neighbour_without_usage_is_no_hit_for_a_client_that_asks(
    stack: Stack,
) -> None:
    cache = stack.app[PIPELINE].cache
    index = SemanticIndex(HashingEmbedder())
    cache.semantic = index
    semantic = table([("o1", str(stack.origins[0].make_url("/v1")))], version=3)
    semantic.tenants[0].cache.CopyFrom(pb.CachePolicy(mode="semantic", semantic_threshold=0.8))
    semantic.etag = content_etag(semantic)
    stack.app[HOLDER].apply(semantic, "control-plane")
    try:
        question = "how do i reset my password for the mobile app"
        near = "how do I reset my password for the mobile app please"
        await (await stack.post(chat(question, stream=True))).read()
        await cache.background_done()  # indexed after the answer
        hit = await stack.post(chat(near, stream=True))
        assert "x-ponto-cache-similarity" in hit.headers  # a semantic neighbour
        await hit.read()

        asks = await stack.post(chat(near, **USAGE))
        assert asks.headers["x-ponto-cache"] == "miss"
        assert asks.headers["x-ponto-cache-reason"] == "no-usage"
        assert usage_of(await chunks_of(asks))["prompt_tokens"] > 0
        assert stack.origin_requests() == 2
    finally:
        index.close()
