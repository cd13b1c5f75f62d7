"""The client's `Cache-Control: only-if-cached` (RFC 9111 5.2.1.7) and
`min-fresh` (5.2.1.3): a miss under only-if-cached calls no origin and joins no
flight (the pipeline answers 504); min-fresh refuses an entry about to expire.
`max-stale` is not honoured: nothing stale is kept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dataplane.assemble import NO_RULES
from dataplane.cache.keys import CHAT
from dataplane.cache.policy import CacheMode, RequestCacheControl, TenantCachePolicy
from dataplane.cache.step import CacheRequest, EdgeCache
from dataplane.cache.store import ExactStore
from dataplane.metrics import Metrics
from dataplane.policy import TenantRules
from tests.cachesteps import settle_whole

BODY: dict[str, Any] = {
    "model": "m",
    "temperature": 0,
    "messages": [{"role": "user", "content": "what is the capital of portugal"}],
}
ANSWER = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Lisbon"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1_900_000_000.0

    def __call__(self) -> float:
        return self.now


def edge(clock: Clock) -> EdgeCache:
    return EdgeCache(ExactStore(max_bytes=1 << 20, clock=clock), Metrics(), clock=clock)


def request(
    cache_control: str = "", *, ttl_s: float = 600, mode: CacheMode = CacheMode.EXACT
) -> CacheRequest:
    rules = TenantRules("acme", NO_RULES, TenantCachePolicy(mode=mode, ttl_s=ttl_s))
    return CacheRequest(CHAT, dict(BODY), rules, stream=False, cache_control=cache_control)


@pytest.mark.parametrize(
    ("header", "only", "min_fresh"),
    [
        ("only-if-cached", True, None),
        ("Only-If-Cached, max-age=60", True, None),
        ("min-fresh=30", False, 30),
        ("min-fresh=30, min-fresh=10", False, 30),  # the stricter
        ("min-fresh=soon", False, None),  # malformed: ignored
        ("min-fresh=0", False, None),
        ("max-stale=600", False, None),  # not honoured
    ],
)
def test_the_directives_are_read(header: str, only: bool, min_fresh: int | None) -> None:
    cc = RequestCacheControl.parse(header)
    assert (cc.only_if_cached, cc.min_fresh) == (only, min_fresh)


def test_min_fresh_asks_for_time_left() -> None:
    cc = RequestCacheControl.parse("min-fresh=30")
    assert cc.accepts(age_s=500, fresh_s=30)
    assert not cc.accepts(age_s=500, fresh_s=29.9)


async def test_only_if_cached_on_a_miss_is_not_cached_and_leads_no_flight() -> None:
    clock = Clock()
    cache = edge(clock)
    plan = await cache.plan(request("only-if-cached"))
    assert plan.not_cached
    assert (plan.outcome, plan.reason) == ("miss", "only-if-cached")
    assert plan.leader is None and plan.follower is None and not plan.key
    # An identical request in flight is not waited for either.
    leading = await cache.plan(request())
    assert leading.leader is not None
    again = await cache.plan(request("only-if-cached"))
    assert again.not_cached and again.follower is None
    leading.abandon()


async def test_only_if_cached_on_a_hit_is_the_hit() -> None:
    clock = Clock()
    cache = edge(clock)
    miss = await cache.plan(request())
    await settle_whole(cache, request(), miss, ANSWER)
    hit = await cache.plan(request("only-if-cached"))
    assert hit.outcome == "hit" and hit.entry is not None and not hit.not_cached


@pytest.mark.parametrize("header", ["only-if-cached, no-cache", "only-if-cached, max-age=0"])
async def test_only_if_cached_with_no_cache_is_not_cached(header: str) -> None:
    cache = edge(Clock())
    miss = await cache.plan(request())
    await settle_whole(cache, request(), miss, ANSWER)
    plan = await cache.plan(request(header))
    assert plan.not_cached and plan.leader is None


async def test_only_if_cached_with_a_bypass_keeps_the_bypass_reason() -> None:
    plan = await edge(Clock()).plan(request("only-if-cached", mode=CacheMode.OFF))
    assert plan.not_cached
    assert (plan.outcome, plan.reason) == ("bypass", "disabled")


async def test_min_fresh_refuses_an_entry_about_to_expire() -> None:
    clock = Clock()
    cache = edge(clock)
    miss = await cache.plan(request(ttl_s=100))
    await settle_whole(cache, request(ttl_s=100), miss, ANSWER)
    clock.now += 60  # 40 s left
    assert (await cache.plan(request("min-fresh=40", ttl_s=100))).outcome == "hit"
    late = await cache.plan(request("min-fresh=41", ttl_s=100))
    assert late.outcome == "miss" and late.leader is not None
    late.abandon()
    # With only-if-cached, an entry not fresh enough is no answer: 504.
    assert (await cache.plan(request("min-fresh=41, only-if-cached", ttl_s=100))).not_cached
