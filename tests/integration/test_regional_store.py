"""RegionalStore against a real redis-server: the CacheStore contract (with Redis
up and with it down), two proxies sharing one Redis, TTLs, purge epochs, values
that do not decode, and cross-proxy coalescing through the cache step."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import orjson
import pytest
import redis

from dataplane.assemble import NO_RULES
from dataplane.cache.entry import CachedResponse, ResponseKind, to_completion
from dataplane.cache.keys import CHAT
from dataplane.cache.policy import TenantCachePolicy
from dataplane.cache.regional import RegionLink
from dataplane.cache.regionside import RedisSide
from dataplane.cache.regionstore import RegionalStore, RegionLock
from dataplane.cache.step import CachePlan, CacheRequest, EdgeCache
from dataplane.cache.store import CacheStore, ExactStore, Found
from dataplane.metrics import Metrics
from dataplane.policy import EdgePolicy, TenantRules
from ponto.devenv import Redis, free_port
from tests.cachesteps import settle_whole
from tests.unit.test_cache_entry import CUSTOM_CALL, custom_tool_stream, recorded, sse
from tests.unit.test_cache_store import FakeClock, StoreFactory, entry
from tests.unit.test_cache_store import TestContract as _Contract
from tests.unit.test_cache_tenancy import ANSWER, BODY, NOW
from tests.unit.test_region_side import SideCase
from tests.unit.test_region_side import TestDownSideContract as _DownSideContract
from tests.unit.test_region_side import TestSideContract as _SideContract


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


class Region:
    """Proxies of one region: RegionalStores on one Redis URL, closed at the end."""

    def __init__(self, url: str, clock: FakeClock) -> None:
        self.url = url
        self.clock = clock
        self.stores: list[RegionalStore] = []
        self.links: list[RegionLink] = []

    def proxy(self, name: str = "p", **kw: Any) -> RegionalStore:
        link = RegionLink(self.url, Metrics())
        local = ExactStore(max_bytes=1 << 20, clock=self.clock)
        store = RegionalStore(local, RedisSide(link), name=name, clock=self.clock, **kw)
        self.stores.append(store)
        self.links.append(link)
        return store

    def metrics(self, store: RegionalStore) -> Metrics:
        return self.links[self.stores.index(store)]._metrics

    async def close(self) -> None:
        for store, link in zip(self.stores, self.links, strict=True):
            await store.close()
            await link.close()


def flushall(server: Redis) -> None:
    with redis.Redis.from_url(server.url) as client:
        client.flushall()


@pytest.fixture
async def region(redis_server: Redis) -> AsyncIterator[Region]:
    flushall(redis_server)
    shared = Region(redis_server.url, FakeClock())
    yield shared
    await shared.close()


@pytest.fixture(params=["redis", "redis-down"])
async def make_store(
    request: pytest.FixtureRequest, redis_server: Redis
) -> AsyncIterator[StoreFactory]:
    if request.param == "redis":
        flushall(redis_server)
        url = redis_server.url
    else:
        url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens
    regions: list[Region] = []

    def factory(clock: FakeClock) -> CacheStore:
        regions.append(Region(url, clock))
        return regions[-1].proxy()

    yield factory
    for r in regions:
        await r.close()


class TestContract(_Contract):
    """The CacheStore contract, run on RegionalStore with Redis up and down."""


async def _real_time(seconds: float) -> None:
    await asyncio.sleep(seconds)


@pytest.fixture
async def up_side(redis_server: Redis) -> AsyncIterator[SideCase]:
    flushall(redis_server)
    link = RegionLink(redis_server.url, Metrics())
    yield SideCase(RedisSide(link), _real_time)
    await link.close()


@pytest.fixture
async def down_side() -> AsyncIterator[SideCase]:
    link = RegionLink(f"redis://127.0.0.1:{free_port()}/0", Metrics())
    yield SideCase(RedisSide(link), _real_time)
    await link.close()


class TestSideContract(_SideContract):
    """The RegionSide contract on a real Redis (MemorySide runs it in tests/unit)."""


class TestDownSideContract(_DownSideContract):
    """... and on a Redis that is not there."""


@pytest.fixture
def raw(redis_server: Redis) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


S = {"tenant": "t", "model": "m"}


async def test_a_put_on_one_proxy_is_a_region_hit_on_another(region: Region) -> None:
    a, b = region.proxy("a"), region.proxy("b")
    e = entry(50)
    assert await a.put("k", e, tenant="t", model="m", ttl_s=60)
    await a.flush()
    found = await b.lookup("k", **S)
    assert isinstance(found, Found) and found.entry == e and found.tier == "region"
    again = await b.lookup("k", **S)
    assert isinstance(again, Found) and again.tier == "local"  # copied into b's LRU
    c = region.proxy("c")
    assert await c.lookup("k", tenant="other", model="m") is None  # another tenant's space


async def test_a_custom_tool_call_stream_from_the_region_is_whole_once_assembled(
    region: Region,
) -> None:
    # Trial 64: a streamed custom tool call, stored, was served to a
    # non-streamed repeat as a nameless `function` call. The region tier
    # carries the chunks through its codec and assembles them the same way.
    a, b = region.proxy("a"), region.proxy("b")
    e = recorded(sse(custom_tool_stream()))
    assert await a.put("k", e, tenant="t", model="m", ttl_s=60)
    await a.flush()
    found = await b.lookup("k", **S)
    assert isinstance(found, Found) and found.tier == "region"
    body = orjson.loads(to_completion(found.entry))
    assert body["choices"][0]["message"]["tool_calls"] == [CUSTOM_CALL]


async def test_ttl_is_kept_in_redis_and_in_the_copy(region: Region, raw: redis.Redis) -> None:
    a, b = region.proxy("a"), region.proxy("b")
    await a.put("k", entry(), tenant="t", model="m", ttl_s=10)
    await a.flush()
    [key] = raw.keys("ponto:x:*")
    assert key == b"ponto:x:0:t:m:k"
    assert 0 < raw.pttl(key) <= 10_000
    region.clock.advance(4)
    assert (await b.lookup("k", **S)) is not None
    region.clock.advance(5.9)
    assert await b.local.get("k") is not None  # the copy lives for what was left: 6 s
    region.clock.advance(0.1)
    assert await b.local.get("k") is None
    assert await b.lookup("k", **S) is None  # expired in the value too


async def test_names_are_escaped_in_keys(region: Region, raw: redis.Redis) -> None:
    a = region.proxy()
    await a.put("k", entry(), tenant="ac:me*", model="org/m 1", ttl_s=60)
    await a.flush()
    assert raw.keys("ponto:x:*") == [b"ponto:x:0:ac%3Ame%2A:org%2Fm%201:k"]


async def test_a_purge_moves_every_proxy_to_a_new_epoch(region: Region) -> None:
    a, b = region.proxy("a"), region.proxy("b")
    # Real keys hold the tenant: "k" and "k-u" stand for two tenants' keys.
    await a.put("k", entry(), tenant="t", model="m", ttl_s=60)
    await a.put("k-u", entry(), tenant="u", model="m", ttl_s=60)
    await a.flush()
    purges = [(7, "t", "")]  # tenant t, every model
    b.set_purges(purges)
    assert await b.lookup("k", **S) is None  # unreachable without a delete
    found = await b.lookup("k-u", tenant="u", model="m")
    assert isinstance(found, Found) and found.tier == "region"  # another tenant keeps its space
    a.set_purges(purges)
    await a.local.purge(tenant="t")
    await a.put("k", entry(7), tenant="t", model="m", ttl_s=60)
    await a.flush()
    found = await b.lookup("k", **S)
    assert isinstance(found, Found) and found.entry == entry(7)
    b.set_purges([(3, "", "")])  # an older purge of everything changes nothing
    assert b.region_key("k", "t", "m").startswith("7:")


async def test_purge_drops_the_scopes_keys_in_redis(region: Region, raw: redis.Redis) -> None:
    a, b = region.proxy("a"), region.proxy("b")
    await a.put("k1", entry(), tenant="t", model="m", ttl_s=60)
    await a.put("k2", entry(), tenant="t", model="m2", ttl_s=60)
    await a.put("k3", entry(), tenant="tt", model="m", ttl_s=60)
    await a.flush()
    assert await b.purge(tenant="t", model="m") == 0  # b held none of them itself
    assert sorted(raw.keys("ponto:x:*")) == [b"ponto:x:0:t:m2:k2", b"ponto:x:0:tt:m:k3"]
    await b.purge(model="m")
    assert raw.keys("ponto:x:*") == [b"ponto:x:0:t:m2:k2"]
    assert raw.keys("ponto:purging:*") == []  # the claim is given back


async def test_a_value_that_does_not_decode_is_a_counted_miss(
    region: Region, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    b = region.proxy()
    raw.set("ponto:x:0:t:m:k", b"\x00garbage")
    raw.set("ponto:x:0:t:m:k2", b"")
    assert await b.lookup("k", **S) is None
    assert await b.lookup("k2", **S) is None
    metrics = region.metrics(b)
    assert sample(metrics, "ponto_cache_region_errors_total", op="decode") == 2
    assert region.links[0].available  # Redis answered: no reason to skip it
    assert len([r for r in caplog.records if "does not decode" in r.getMessage()]) == 1


async def test_writes_past_the_bound_are_dropped_and_counted(region: Region) -> None:
    a, b = region.proxy("a", max_writes=0), region.proxy("b")
    assert await a.put("k", entry(), tenant="t", model="m", ttl_s=60)  # locally kept
    await a.flush()
    assert await b.lookup("k", **S) is None
    metrics = region.metrics(a)
    assert sample(metrics, "ponto_cache_region_requests_total", op="set", result="dropped") == 1


async def test_one_lock_per_region_and_followers_get_the_entry(region: Region) -> None:
    a, b = region.proxy("a"), region.proxy("b")
    lock = await a.claim("k", "t", "m")
    assert isinstance(lock, RegionLock)
    assert await b.claim("k", "t", "m") is False
    waiting = asyncio.create_task(b.follow("k", "t", "m", max_wait_s=10))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    e = entry(30)
    await a.put("k", e, tenant="t", model="m", ttl_s=60)
    lock.release()  # after the write: the follower finds the entry, not a gap
    assert await waiting == e
    await a.flush()
    assert isinstance(await b.claim("k", "t", "m"), RegionLock)


async def test_a_lock_released_without_an_entry_sends_followers_to_the_origin(
    region: Region,
) -> None:
    a, b = region.proxy("a"), region.proxy("b")
    lock = await a.claim("k", "t", "m")
    assert isinstance(lock, RegionLock)
    waiting = asyncio.create_task(b.follow("k", "t", "m", max_wait_s=10))
    await asyncio.sleep(0.05)
    lock.release()
    assert await waiting is None


async def test_a_lock_of_a_dead_leader_expires(region: Region) -> None:
    a, b = region.proxy("a", lock_ttl_s=0.2), region.proxy("b")
    lock = await a.claim("k", "t", "m")
    assert isinstance(lock, RegionLock)
    lock._refresher.cancel()  # the leader's proxy died: nobody refreshes it
    assert await b.follow("k", "t", "m", max_wait_s=10) is None


async def test_a_held_lock_is_refreshed(region: Region) -> None:
    a, b = region.proxy("a", lock_ttl_s=0.15), region.proxy("b")
    lock = await a.claim("k", "t", "m")
    assert isinstance(lock, RegionLock)
    await asyncio.sleep(0.4)  # more than twice the lock's life
    assert await b.claim("k", "t", "m") is False
    lock.release()


# ---------------------------------------------------------------------------
# Cross-proxy coalescing through the cache step


def request(stream: bool = False) -> CacheRequest:
    rules = TenantRules("acme", NO_RULES, TenantCachePolicy())
    return CacheRequest(CHAT, dict(BODY), rules, stream=stream)


def edge(store: RegionalStore) -> EdgeCache:
    return EdgeCache(store, Metrics(), clock=lambda: NOW, region_wait_s=10)


async def test_identical_misses_on_two_proxies_make_one_origin_call(region: Region) -> None:
    a, b = edge(region.proxy("a")), edge(region.proxy("b"))
    lead = await a.plan(request())
    assert lead.outcome == "miss" and lead.region_lock is not None
    waiting = asyncio.create_task(b.plan(request()))
    await asyncio.sleep(0.05)
    # Another request to b joins b's local flight, which waits on a's.
    local_follower = await b.plan(request())
    assert local_follower.follower is not None
    assert not waiting.done()  # b waits for a's origin call instead of making its own
    await settle_whole(a, request(), lead, ANSWER)
    plan = await waiting
    assert (plan.outcome, plan.kind, plan.tier) == ("hit", "coalesced", "region")
    assert plan.entry is not None and plan.entry.body == ANSWER
    assert (await local_follower.follower.result()).body == ANSWER
    hits = sample(b._metrics, "ponto_cache_hits_total", tier="region")
    assert hits == 1


async def b_waits_for_a(
    region: Region,
) -> tuple[EdgeCache, EdgeCache, CachePlan, asyncio.Task[CachePlan]]:
    """Proxies a and b; a leads the region's flight (its lock held), and a
    whole request to b waits for a's origin call (a task)."""
    a, b = edge(region.proxy("a")), edge(region.proxy("b"))
    lead = await a.plan(request())
    assert lead.region_lock is not None
    waiting = asyncio.create_task(b.plan(request()))
    await asyncio.sleep(0.05)
    return a, b, lead, waiting


async def test_a_stream_without_usage_from_another_proxy_is_no_whole_answer(
    region: Region,
) -> None:
    # b's whole request waits for a's flight, which stores a stream recorded
    # without usage: no answer for b, whose whole answer must have its usage;
    # b calls the origin itself (a miss, no-usage).
    a, _, lead, waiting = await b_waits_for_a(region)
    streamed = CachedResponse(
        ResponseKind.CHAT, NOW, "m", chunks=(b'{"choices":[]}',), usage_missing=True
    )
    key = lead.key
    await a.store.put(key, streamed, tenant="acme", model=BODY["model"], ttl_s=60)
    lead.abandon()  # its lock goes after the entry: b finds the entry
    plan = await waiting
    assert (plan.outcome, plan.reason) == ("miss", "no-usage")
    assert plan.leader is not None
    plan.abandon()


async def test_a_streaming_request_does_not_wait_for_another_proxy(region: Region) -> None:
    a, b = edge(region.proxy("a")), edge(region.proxy("b"))
    lead = await a.plan(request())
    plan = await b.plan(request(stream=True))
    assert plan.outcome == "miss" and plan.region_lock is None  # its own origin call
    lead.abandon()
    plan.abandon()


async def test_a_failed_leader_sends_the_waiting_proxy_to_the_origin(region: Region) -> None:
    a, b = edge(region.proxy("a")), edge(region.proxy("b"))
    lead = await a.plan(request())
    waiting = asyncio.create_task(b.plan(request()))
    await asyncio.sleep(0.05)
    lead.abandon(RuntimeError("the origin failed"))
    plan = await waiting
    assert plan.outcome == "miss" and plan.leader is not None
    plan.abandon()


async def test_route_table_purges_set_the_epoch(region: Region) -> None:
    store = region.proxy()
    cache = edge(store)
    # on_policy reads the tenants and the purges only.
    authenticator = cast(Any, None)
    cache.on_policy(EdgePolicy(authenticator, {}, {}, purges=((4, "acme", "m"),)))
    assert store.region_key("k", "acme", "m").startswith("4:")
    assert store.region_key("k", "acme", "other").startswith("0:")


async def test_a_follower_whose_leader_left_waits_for_another_proxys_flight(
    region: Region,
) -> None:
    # b's local leader waits for a's origin call; its client leaves. b's local
    # follower, handing off, leads b's flight as its leader did: it waits for
    # a's call too, rather than making a second one.
    a, b, lead, waiting = await b_waits_for_a(region)
    local = await b.plan(request())
    assert local.follower is not None
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    handed = asyncio.create_task(b.own_call(request(), local))
    await asyncio.sleep(0.05)
    assert not handed.done()
    await settle_whole(a, request(), lead, ANSWER)
    plan = await handed
    assert (plan.outcome, plan.kind, plan.tier) == ("hit", "coalesced", "region")
    assert plan.entry is not None and plan.entry.body == ANSWER
