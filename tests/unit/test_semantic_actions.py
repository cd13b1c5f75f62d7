"""A semantic tenant's agent traffic is matched exactly only (trial 64): a
request that offers tools is neither looked up nor indexed semantically, an
answer that calls a tool is never indexed, and an indexed one (from an older
proxy of the region) is no neighbour. A near question's tool call is another
action, not a paraphrase of an answer."""

from __future__ import annotations

import json
from typing import Any

from dataplane.cache.entry import from_completion
from dataplane.cache.keys import CHAT
from dataplane.cache.step import CachePlan, CacheRequest
from dataplane.streaming.relay import RelayEnd
from tests.cachesteps import settle_whole
from tests.unit.test_cache_entry import sse
from tests.unit.test_cache_tenancy import ANSWER, BODY, NOW, semantic_edge, semantic_hit

TOOLS = [{"type": "function", "function": {"name": "cancel_order", "parameters": {}}}]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "cancel_order", "arguments": '{"which": "latest"}'},
}


def answer(**message: Any) -> bytes:
    """A whole chat answer whose message has these fields (a tool call's)."""
    body = json.loads(ANSWER)
    body["choices"][0]["message"] = {"role": "assistant", "content": None, **message}
    body["choices"][0]["finish_reason"] = "tool_calls"
    return json.dumps(body).encode()


def with_tools(req: CacheRequest, text: str, **offer: Any) -> CacheRequest:
    body = dict(BODY, messages=[{"role": "user", "content": text}], **offer)
    return CacheRequest(CHAT, body, req.tenant, stream=req.stream)


async def test_a_request_with_tools_is_looked_up_exactly_and_not_indexed() -> None:
    edge, index, req = semantic_edge()
    try:
        first = with_tools(req, "what is the capital of portugal", tools=TOOLS)
        plan = await edge.plan(first)
        assert (plan.outcome, plan.reason, plan.text) == ("miss", "tools", "")
        await settle_whole(edge, first, plan, answer(tool_calls=[CALL]))
        await edge.background_done()
        assert len(index) == 0 and index.stats.lookups == 0
        near = with_tools(req, "what is the capital of portugal please", tools=TOOLS)
        missed = await edge.plan(near)
        assert (missed.outcome, missed.reason) == ("miss", "tools")
        missed.abandon()
        assert index.stats.lookups == 0  # not even embedded
        again = await edge.plan(first)
        assert (again.outcome, again.kind) == ("hit", "exact")
        scrape = edge._metrics.registry.get_sample_value
        assert scrape("ponto_cache_requests_total", {"result": "miss", "kind": "tools"}) == 2
    finally:
        index.close()


async def test_legacy_functions_are_matched_exactly_only_too() -> None:
    edge, index, req = semantic_edge()
    try:
        plan = await edge.plan(with_tools(req, "cancel it", functions=[{"name": "cancel"}]))
        assert (plan.outcome, plan.reason) == ("miss", "tools")
        plan.abandon()
    finally:
        index.close()


async def test_an_answer_that_calls_a_tool_is_kept_but_not_indexed() -> None:
    # A request without tools can get a tool call (tools the origin adds, or a
    # legacy function call): an action all the same.
    edge, index, req = semantic_edge()
    try:
        for message in ({"tool_calls": [CALL]}, {"function_call": CALL["function"]}):
            plan = await edge.plan(req)
            assert (plan.outcome, plan.reason) == ("miss", "")
            await settle_whole(edge, req, plan, answer(**message))
            await edge.background_done()
            assert len(index) == 0
            assert not await semantic_hit(edge, req)
            assert (await edge.plan(req)).kind == "exact"  # the exact repeat hits
            await edge.purge("acme", None)
    finally:
        index.close()


async def test_a_streamed_tool_call_is_not_indexed() -> None:
    edge, index, req = semantic_edge()
    try:
        streaming = CacheRequest(CHAT, dict(BODY), req.tenant, stream=True)
        plan = await edge.plan(streaming)
        assert plan.recorder is not None
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        call = {"index": 0, **CALL}
        plan.recorder.feed(
            sse(
                [
                    {**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]},
                    {
                        **chunk,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                    },
                ]
            )
        )
        await edge.settle_stream(streaming, plan, 200, RelayEnd(complete=True))
        await edge.background_done()
        assert len(index) == 0
        assert (await edge.plan(streaming)).kind == "exact"
    finally:
        index.close()


async def test_an_indexed_tool_call_is_no_neighbour() -> None:
    # As a region's feed replays an older proxy's entry: indexed, and its
    # answer a tool call. The lookup drops the pointer rather than serve it.
    edge, index, req = semantic_edge()
    try:
        plan = await edge.plan(req)
        entry = from_completion(answer(tool_calls=[CALL]), now=NOW)
        assert entry is not None
        await edge.store.put(plan.key, entry, tenant="acme", model="m", ttl_s=60)
        await index.insert(
            "acme", "m", edge._context(req), "what is the capital of portugal", plan.key
        )
        plan.abandon()
        assert len(index) == 1
        assert not await semantic_hit(edge, req)
        assert len(index) == 0
    finally:
        index.close()


def test_an_answer_not_kept_says_so_over_tools() -> None:
    plan = CachePlan("miss", reason="tools")
    plan.unkept = "too_large"
    assert plan.said_reason == "answer-too-large"
    assert CachePlan("miss", reason="tools").said_reason == "tools"
    plan = CachePlan("miss", reason="no-usage")
    plan.unkept = "truncated"
    assert plan.said_reason == "no-usage"
