"""Agent traffic on a tenant with semantic caching, through the whole proxy
(tests/functional/test_pipeline.py's stack, the origin simulator, the test
embedder): a request that offers tools is matched exactly only (trial 64: a
near question got the first one's tool call, an action it did not ask for)."""

from __future__ import annotations

import contextlib
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
from tests.functional.test_pipeline import Stack, chat, start_stack, table

TOOLS = [
    {"type": "function", "function": {"name": "cancel_order", "parameters": {"type": "object"}}},
    {"type": "custom", "custom": {"name": "run_sql"}},
]


@contextlib.asynccontextmanager
async def semantic_stack(tmp_path: Path) -> AsyncIterator[Stack]:
    """test_pipeline's stack with one origin and its tenant on semantic
    caching (threshold 0.8) over the test embedder."""
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=6, seed=1)])
    index = SemanticIndex(HashingEmbedder())
    s.app[PIPELINE].cache.semantic = index
    semantic = table([("o1", str(s.origins[0].make_url("/v1")))], version=3)
    semantic.tenants[0].cache.CopyFrom(pb.CachePolicy(mode="semantic", semantic_threshold=0.8))
    semantic.etag = content_etag(semantic)
    s.app[HOLDER].apply(semantic, "control-plane")
    try:
        yield s
    finally:
        index.close()
        await s.close()


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with semantic_stack(tmp_path) as s:
        yield s


async def ask(stack: Stack, text: str, **fields: Any) -> dict[str, str]:
    resp = await stack.post(chat(text, **fields))
    assert resp.status == 200
    await resp.read()
    await stack.app[PIPELINE].cache.background_done()  # indexed after the answer
    return dict(resp.headers)


async def test_a_near_request_with_tools_reaches_the_origin_and_a_repeat_hits(
    stack: Stack,
) -> None:
    # Without tools, the near question is a semantic hit: the test embedder
    # and the threshold would match these two.
    await ask(stack, "what is the status of my latest order")
    near = await ask(stack, "what is the status of my latest order please")
    assert "x-ponto-cache-similarity" in near and stack.origin_requests() == 1

    first = await ask(stack, "cancel my latest order", tools=TOOLS)
    assert first["x-ponto-cache"] == "miss" and stack.origin_requests() == 2
    other = await ask(stack, "cancel my latest order please", tools=TOOLS)
    assert other["x-ponto-cache"] == "miss" and "x-ponto-cache-similarity" not in other
    assert stack.origin_requests() == 3
    # A miss says why no semantic lookup was made.
    assert first["x-ponto-cache-reason"] == other["x-ponto-cache-reason"] == "tools"

    again = await ask(stack, "cancel my latest order", tools=TOOLS)
    assert again["x-ponto-cache"] == "hit" and "x-ponto-cache-similarity" not in again
    streamed = await ask(stack, "cancel my latest order", tools=TOOLS, stream=True)
    assert streamed["x-ponto-cache"] == "hit"
    assert stack.origin_requests() == 3

    scrape = stack.app[METRICS].registry.get_sample_value
    assert scrape("ponto_cache_requests_total", {"result": "miss", "kind": "tools"}) == 2
