"""The client's Cache-Control on the wire (tests/functional/test_pipeline.py's
stack): `only-if-cached` on a miss is a 504 in OpenAI's error shape that
reaches no origin; `min-fresh` refuses an entry about to expire; a stream that
asks for usage in every chunk (vLLM's continuous_usage_stats) is keyed apart."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dataplane.http.pipeline import ENDPOINTS
from dataplane.http.state import METRICS
from dataplane.sync.link import traffic_of
from ponto.originsim.app import SimConfig
from tests.functional.test_pipeline import KEY, Stack, chat, read_sse, start_stack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=4, seed=1)])
    yield s
    await s.close()


async def post(stack: Stack, body: dict[str, Any], cache_control: str = "") -> Any:
    headers = {"authorization": f"Bearer {KEY.key}"}
    if cache_control:
        headers["cache-control"] = cache_control
    return await stack.client.post("/v1/chat/completions", json=body, headers=headers)


async def test_every_proxied_endpoint_counts_not_cached_answers_from_zero(stack: Stack) -> None:
    # So that rate() sees the first one, as it sees its 504 (the alerts take
    # the one from the other).
    get = stack.app[METRICS].registry.get_sample_value
    name = "ponto_requests_not_cached_total"
    counts = {endpoint: get(name, {"endpoint": endpoint}) for endpoint in ENDPOINTS}
    assert counts == dict.fromkeys(ENDPOINTS, 0.0)


async def test_only_if_cached_on_a_miss_is_a_504_that_reaches_no_origin(stack: Stack) -> None:
    resp = await post(stack, chat("what is two and two"), "only-if-cached")
    assert resp.status == 504
    assert resp.headers["x-ponto-cache"] == "miss"
    assert resp.headers["x-ponto-cache-reason"] == "only-if-cached"
    error = (await resp.json())["error"]
    assert error["code"] == "not_cached"
    assert error["type"] == "invalid_request_error"
    assert "only-if-cached" in error["message"]
    # OpenAI's SDKs retry a 5xx (twice) unless told not to.
    assert resp.headers["x-should-retry"] == "false"
    assert stack.origin_requests() == 0
    # Counted as what it is (a 504), but reported as the client's error.
    m = stack.app[METRICS]
    assert (
        m.registry.get_sample_value(
            "ponto_requests_total", {"endpoint": "chat.completions", "code": "504"}
        )
        == 1
    )
    assert (
        m.registry.get_sample_value(
            "ponto_requests_not_cached_total", {"endpoint": "chat.completions"}
        )
        == 1
    )
    traffic = traffic_of(m.requests, m.genai_duration, m.limited, m.not_cached)
    assert (traffic.server_errors, traffic.client_errors) == (0, 1)
    # Once cached, the same header is a hit.
    assert (await post(stack, chat("what is two and two"))).status == 200
    hit = await post(stack, chat("what is two and two"), "only-if-cached")
    assert (hit.status, hit.headers["x-ponto-cache"]) == (200, "hit")
    assert stack.origin_requests() == 1


async def test_only_if_cached_with_a_bypass_says_why(stack: Stack) -> None:
    resp = await post(stack, chat("a sample", temperature=0.7), "only-if-cached")
    assert resp.status == 504
    assert resp.headers["x-ponto-cache"] == "bypass"
    assert resp.headers["x-ponto-cache-reason"] == "nondeterministic"
    assert "nondeterministic" in (await resp.json())["error"]["message"]
    assert stack.origin_requests() == 0


async def test_min_fresh_past_the_ttl_is_a_miss(stack: Stack) -> None:
    assert (await post(stack, chat("what is three and three"))).status == 200
    # The default TTL is an hour: an entry cannot stay fresh two more.
    late = await post(stack, chat("what is three and three"), "min-fresh=7200")
    assert late.headers["x-ponto-cache"] == "miss"
    fresh = await post(stack, chat("what is three and three"), "min-fresh=60")
    assert fresh.headers["x-ponto-cache"] == "hit"
    assert stack.origin_requests() == 2


async def test_a_stream_asking_usage_in_every_chunk_is_not_a_plain_streams_replay(
    stack: Stack,
) -> None:
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    plain = await post(stack, chat("count to four", **usage))
    await read_sse(plain)
    continuous = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    resp = await post(stack, chat("count to four", **continuous))
    await read_sse(resp)
    assert resp.headers["x-ponto-cache"] == "miss"
    again = await post(stack, chat("count to four", **continuous))
    await read_sse(again)
    assert again.headers["x-ponto-cache"] == "hit"
    assert stack.origin_requests() == 2


async def test_usage_in_every_chunk_without_include_usage_is_not_given_the_recorded_usage(
    stack: Stack,
) -> None:
    """An entry recorded with include_usage and continuous_usage_stats has
    usage in every chunk: a request that asks continuous_usage_stats without
    include_usage (no usage at all, as vLLM answers it) is not its replay."""
    both = {"include_usage": True, "continuous_usage_stats": True}
    recorded = await post(stack, chat("count to five", stream=True, stream_options=both))
    await read_sse(recorded)
    alone = {"include_usage": False, "continuous_usage_stats": True}
    resp = await post(stack, chat("count to five", stream=True, stream_options=alone))
    events = await read_sse(resp)
    assert resp.headers["x-ponto-cache"] == "miss"
    assert not [e for e in events if e != "[DONE]" and json.loads(e).get("usage")]
    # It is keyed as a stream without stream_options, which it answers.
    plain = await post(stack, chat("count to five", stream=True))
    await read_sse(plain)
    assert plain.headers["x-ponto-cache"] == "hit"
    assert stack.origin_requests() == 2
