"""The exact cache and its coalescing flights are per tenant: one tenant's answer,
or an origin call it has under way, never serves another's identical request
(which would show in content, and in time: a hit or a follower answers sooner)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from dataplane.assemble import NO_RULES
from dataplane.cache.coalesce import Follower, Leader
from dataplane.cache.embed import Embedder, HashingEmbedder
from dataplane.cache.keys import CHAT
from dataplane.cache.policy import CacheMode, TenantCachePolicy
from dataplane.cache.semantic import SemanticIndex
from dataplane.cache.step import CacheRequest, EdgeCache
from dataplane.cache.store import ExactStore
from dataplane.metrics import Metrics
from dataplane.policy import EdgePolicy, TenantRules
from tests.cachesteps import settle_whole

NOW = 1_900_000_000.0
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
    }
).encode()


def cache() -> EdgeCache:
    return EdgeCache(ExactStore(max_bytes=1 << 20, clock=lambda: NOW), Metrics(), clock=lambda: NOW)


def request(tenant: str) -> CacheRequest:
    rules = TenantRules(tenant, NO_RULES, TenantCachePolicy())
    return CacheRequest(CHAT, dict(BODY), rules, stream=False)


async def test_another_tenants_flight_is_not_followed() -> None:
    edge = cache()
    a = await edge.plan(request("tenant-a"))
    assert isinstance(a.leader, Leader)
    b = await edge.plan(request("tenant-b"))
    assert b.outcome == "miss" and isinstance(b.leader, Leader) and b.follower is None
    again = await edge.plan(request("tenant-a"))
    assert again.outcome == "hit" and isinstance(again.follower, Follower)
    for plan in (a, b, again):
        plan.abandon()


async def test_another_tenants_answer_is_not_served() -> None:
    edge = cache()
    a = await edge.plan(request("tenant-a"))
    await settle_whole(edge, request("tenant-a"), a, ANSWER)
    hit = await edge.plan(request("tenant-a"))
    assert hit.outcome == "hit" and hit.entry is not None
    b = await edge.plan(request("tenant-b"))
    assert b.outcome == "miss" and b.entry is None
    b.abandon()


async def test_a_hit_says_its_entrys_age_in_whole_seconds() -> None:
    """Its Age header (RFC 9111 5.1), by the cache's clock: a client asking
    `max-age` can see how old what it got is (trial 24)."""
    now = [NOW]
    edge = EdgeCache(
        ExactStore(max_bytes=1 << 20, clock=lambda: now[0]), Metrics(), clock=lambda: now[0]
    )
    miss = await edge.plan(request("acme"))
    await settle_whole(edge, request("acme"), miss, ANSWER)
    assert (await edge.plan(request("acme"))).age_s == 0
    now[0] += 42.9
    hit = await edge.plan(request("acme"))
    assert (hit.outcome, hit.age_s) == ("hit", 42)


async def test_a_bypass_plan_carries_the_policys_reason() -> None:
    edge = cache()
    sampled = request("acme")
    sampled.body["temperature"] = 1
    assert (await edge.plan(sampled)).reason == "nondeterministic"
    unkeyable = request("acme")
    unkeyable.body["top_p"] = float("nan")  # no canonical form
    plan = await edge.plan(unkeyable)
    assert (plan.outcome, plan.reason) == ("bypass", "unkeyable")
    off = CacheRequest(CHAT, dict(BODY), TenantRules("t", NO_RULES, TenantCachePolicy(
        mode=CacheMode.OFF)), stream=False)  # fmt: skip
    assert (await edge.plan(off)).reason == "disabled"
    hit_or_miss = await edge.plan(request("acme"))
    assert (hit_or_miss.outcome, hit_or_miss.reason) == ("miss", "")


def policy(*revisions: int) -> EdgePolicy:
    """A table with these purges of tenant-a (on_policy reads the tenants and purges only)."""
    purges = tuple((rev, "tenant-a", "") for rev in revisions)
    return EdgePolicy(cast(Any, None), {}, {}, purges=purges)


async def test_an_answer_that_arrives_after_a_purge_is_served_but_not_kept() -> None:
    edge = cache()
    edge.on_policy(policy(3))  # the first table: nothing to purge
    a = await edge.plan(request("tenant-a"))
    # A purge arrives while the origin answers: the answer may be what it was for.
    edge.on_policy(policy(3, 4))
    for _ in range(3):  # the purge runs (a task) before the answer comes back
        await asyncio.sleep(0)
    await settle_whole(edge, request("tenant-a"), a, ANSWER)
    after = await edge.plan(request("tenant-a"))
    assert after.outcome == "miss"
    await settle_whole(edge, request("tenant-a"), after, ANSWER)
    assert (await edge.plan(request("tenant-a"))).outcome == "hit"  # kept from then on


def semantic_edge(
    embedder: Embedder | None = None,
) -> tuple[EdgeCache, SemanticIndex, CacheRequest]:
    """A cache step with a semantic index (of `embedder`, by default the
    hashing fake), and a request of a semantic tenant."""
    index = SemanticIndex(embedder or HashingEmbedder())
    edge = EdgeCache(
        ExactStore(max_bytes=1 << 20, clock=lambda: NOW),
        Metrics(),
        semantic=index,
        clock=lambda: NOW,
    )
    policy = TenantCachePolicy(mode=CacheMode.SEMANTIC, semantic_threshold=0.8)
    rules = TenantRules("acme", NO_RULES, policy)
    return edge, index, CacheRequest(CHAT, dict(BODY), rules, stream=False)


async def semantic_hit(edge: EdgeCache, req: CacheRequest) -> bool:
    """Whether a close paraphrase of `req`'s question is a semantic hit."""
    near = dict(
        BODY, messages=[{"role": "user", "content": "what is the capital of portugal please"}]
    )
    hit = await edge.plan(CacheRequest(CHAT, near, req.tenant, stream=False))
    return (hit.outcome, hit.kind) == ("hit", "semantic")


class EightWords(HashingEmbedder):
    """The fake with a window of eight words, that records the texts it is asked of."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def fits(self, text: str) -> bool:
        return len(text.split()) <= 8

    def may_fit(self, text: str) -> bool:
        self.asked.append(text)
        return self.fits(text)


async def test_a_text_past_the_window_is_matched_exactly_only_and_never_normalised() -> None:
    """A pasted document (trial 89: 8 MB in the last user message) is told
    too long for the embedder from its words as sent: its plan has no
    semantic text and no namespace, both of which cost a pass over the
    document on the event loop (0.4 s for 8 MB), and the index is neither
    searched nor grown. The exact cache still keeps and answers it."""
    embedder = EightWords()
    edge, index, req = semantic_edge(embedder)
    try:
        document = "  ".join(["\uff21word"] * 9)  # NFKC and folding would change it
        long = CacheRequest(CHAT, dict(BODY, messages=[{"role": "user", "content": document}]),
                            req.tenant, stream=False)  # fmt: skip
        plan = await edge.plan(long)
        assert (plan.outcome, plan.text, plan.context) == ("miss", "", "")
        assert embedder.asked == [document]  # as sent
        await settle_whole(edge, long, plan, ANSWER)
        await edge.background_done()
        assert len(index) == 0 and index.stats.lookups == 0 and index.stats.too_long == 1
        assert (await edge.plan(long)).outcome == "hit"
        short = await edge.plan(req)
        assert short.text == "what is the capital of portugal" and short.context
    finally:
        index.close()


async def test_a_follower_whose_leader_left_leads_as_the_leader_would_have() -> None:
    """Its flight's leader gone (its client left), the follower that hands
    off leads a new flight whose answer is stored and indexed semantically,
    as the first leader's would have been; the next follower follows it."""
    edge, index, req = semantic_edge()
    try:
        first = await edge.plan(req)
        followers = [await edge.plan(req) for _ in range(2)]
        assert first.leader is not None and all(f.follower for f in followers)
        first.abandon(asyncio.CancelledError())  # its client left before the answer
        handed = [await edge.own_call(req, f) for f in followers]
        assert handed[0].outcome == "miss" and handed[0].leader is not None
        assert handed[1].outcome == "hit" and handed[1].follower is not None
        await settle_whole(edge, req, handed[0], ANSWER)
        assert handed[1].follower is not None
        assert (await handed[1].follower.result()).body == ANSWER
        await edge.background_done()
        assert await semantic_hit(edge, req)
    finally:
        index.close()


async def test_followers_calling_on_their_own_leave_their_answer_indexed() -> None:
    """After an origin failure each follower calls on its own and stores the
    same key: indexing it twice at once must not take the entry out again
    (the second `_index` found no mark, the first having popped it, and
    removed the key as if the store had evicted it)."""
    edge, index, req = semantic_edge()
    try:
        first = await edge.plan(req)
        followers = [await edge.plan(req) for _ in range(2)]
        first.abandon(RuntimeError("the origin failed"))
        own = [await edge.own_call(req, f) for f in followers]
        assert all(p.outcome == "miss" and p.leader is None for p in own)
        for p in own:  # both answers arrive before either is indexed
            await settle_whole(edge, req, p, ANSWER)
        await edge.background_done()
        assert await semantic_hit(edge, req)
    finally:
        index.close()
