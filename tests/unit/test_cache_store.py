"""The exact store: LRU by bytes, TTLs, purges, eviction callbacks, and the contract
every CacheStore must meet."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataplane.cache.entry import CachedResponse, ResponseKind
from dataplane.cache.store import (
    SLOT_OVERHEAD,
    STALE_EXPIRY_SLACK,
    UNANSWERED,
    CacheStore,
    EvictReason,
    ExactStore,
    Found,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def entry(payload: int = 100, model: str = "m") -> CachedResponse:
    return CachedResponse(kind=ResponseKind.CHAT, created_at=0, model=model, body=b"x" * payload)


def cost(e: CachedResponse, key: str) -> int:
    return e.size + len(key) + SLOT_OVERHEAD


# ---------------------------------------------------------------------------
# The contract: run against every implementation of CacheStore. Shared stores
# run it too (tests/integration/test_regional_store.py, against a real Redis
# and with Redis down) by giving their own `make_store`.

StoreFactory = Callable[[FakeClock], CacheStore]


def _exact(clock: FakeClock) -> CacheStore:
    return ExactStore(max_bytes=1 << 20, clock=clock)


@pytest.fixture(params=[_exact], ids=["exact"])
def make_store(request: pytest.FixtureRequest) -> StoreFactory:
    factory: StoreFactory = request.param
    return factory


# Every lookup names the entry's scope, as the cache step does.
T = {"tenant": "t", "model": "m"}


class TestContract:
    async def test_get_put_replace_delete(self, make_store: StoreFactory) -> None:
        store = make_store(FakeClock())
        assert await store.get("k", **T) is None
        a, b = entry(10), entry(20)
        assert await store.put("k", a, tenant="t", model="m", ttl_s=60)
        assert await store.get("k", **T) == a
        assert await store.put("k", b, tenant="t", model="m", ttl_s=60)
        assert await store.get("k", **T) == b
        assert await store.delete("k", **T)
        assert not await store.delete("k", **T)
        assert await store.get("k", **T) is None

    async def test_lookup_says_the_tier(self, make_store: StoreFactory) -> None:
        store = make_store(FakeClock())
        # Absent; or, from a store whose shared tier is down, not known.
        assert await store.lookup("k", **T) in (None, UNANSWERED)
        a = entry(10)
        await store.put("k", a, tenant="t", model="m", ttl_s=60)
        found = await store.lookup("k", **T)
        assert isinstance(found, Found) and found.entry == a and found.tier == "local"

    async def test_entries_expire_after_their_ttl(self, make_store: StoreFactory) -> None:
        clock = FakeClock()
        store = make_store(clock)
        await store.put("short", entry(), tenant="t", model="m", ttl_s=10)
        await store.put("long", entry(), tenant="t", model="m", ttl_s=100)
        clock.advance(9.9)
        assert await store.get("short", **T) is not None
        clock.advance(0.1)
        assert await store.get("short", **T) is None
        assert await store.get("long", **T) is not None
        assert not await store.put("zero", entry(), tenant="t", model="m", ttl_s=0)
        assert await store.get("zero", **T) is None

    async def test_purge_by_tenant_model_or_all(self, make_store: StoreFactory) -> None:
        store = make_store(FakeClock())

        async def get(tenant: str, model: str) -> CachedResponse | None:
            return await store.get(f"{tenant}/{model}", tenant=tenant, model=model)

        for tenant in ("t1", "t2"):
            for model in ("m1", "m2"):
                await store.put(f"{tenant}/{model}", entry(), tenant=tenant, model=model, ttl_s=60)
        assert await store.purge(tenant="t1", model="m1") == 1
        assert await get("t1", "m1") is None and await get("t1", "m2") is not None
        assert await store.purge(model="m2") == 2
        assert await get("t2", "m1") is not None
        assert await get("t2", "m2") is None
        assert await store.purge(tenant="nobody") == 0
        assert await store.purge(tenant="t2") == 1
        assert await get("t2", "m1") is None
        await store.put("x", entry(), tenant="t3", model="m3", ttl_s=60)
        assert await store.purge() == 1
        assert await store.get("x", tenant="t3", model="m3") is None
        assert store.stats.entries == 0 and store.stats.bytes == 0

    async def test_stats_count_hits_and_misses(self, make_store: StoreFactory) -> None:
        store = make_store(FakeClock())
        await store.put("k", entry(), tenant="t", model="m", ttl_s=60)
        await store.get("k", **T)
        await store.get("k", **T)
        await store.get("nope", **T)
        stats = store.stats
        assert (stats.hits, stats.misses, stats.entries) == (2, 1, 1)
        assert stats.bytes > 0


# ---------------------------------------------------------------------------
# ExactStore specifics


async def test_lru_eviction_is_by_bytes_and_by_recency() -> None:
    e = entry(1000)
    evicted: list[tuple[str, EvictReason]] = []
    store = ExactStore(
        max_bytes=3 * cost(e, "k0"),
        clock=FakeClock(),
        on_evict=lambda key, why: evicted.append((key, why)),
    )
    for i in range(3):
        await store.put(f"k{i}", e, tenant="t", model="m", ttl_s=60)
    assert await store.get("k0") is not None  # k0 is now the most recent
    await store.put("k3", e, tenant="t", model="m", ttl_s=60)
    assert evicted == [("k1", EvictReason.LRU)]
    assert await store.get("k1") is None
    # One big entry pushes out as many as it needs.
    big = entry(2000)
    await store.put("big", big, tenant="t", model="m", ttl_s=60)
    assert [k for k, _ in evicted] == ["k1", "k2", "k0"]
    assert store.stats.evictions == 3
    assert store.stats.bytes == cost(e, "k3") + cost(big, "big") <= store.stats.max_bytes
    assert len(store) == 2


async def test_too_large_entries_are_refused() -> None:
    store = ExactStore(max_bytes=10_000, clock=FakeClock(), max_entry_bytes=2000)
    assert not await store.put("k", entry(5000), tenant="t", model="m", ttl_s=60)
    assert not await store.put("k", entry(20_000), tenant="t", model="m", ttl_s=60)
    assert await store.put("k", entry(100), tenant="t", model="m", ttl_s=60)
    assert store.stats.rejected == 2


async def test_replacing_an_entry_adjusts_bytes_without_a_callback() -> None:
    calls: list[str] = []
    store = ExactStore(max_bytes=1 << 20, clock=FakeClock(), on_evict=lambda k, _: calls.append(k))
    small, large = entry(10), entry(5000)
    await store.put("k", large, tenant="t", model="m", ttl_s=60)
    await store.put("k", small, tenant="t", model="m", ttl_s=60)
    assert store.stats.bytes == cost(small, "k")
    assert calls == []


async def test_expired_entries_are_swept_on_put_and_reported() -> None:
    clock = FakeClock()
    calls: list[tuple[str, EvictReason]] = []
    store = ExactStore(max_bytes=1 << 20, clock=clock, on_evict=lambda k, w: calls.append((k, w)))
    await store.put("a", entry(), tenant="t", model="m", ttl_s=5)
    await store.put("b", entry(), tenant="t", model="m", ttl_s=50)
    clock.advance(10)
    await store.put("c", entry(), tenant="t", model="m", ttl_s=5)
    assert calls == [("a", EvictReason.EXPIRED)]
    assert store.stats.entries == 2 and store.stats.expired == 1
    clock.advance(10)
    assert store.sweep() == 1
    assert calls[-1] == ("c", EvictReason.EXPIRED)
    assert store.sweep() == 0


async def test_a_refreshed_entry_lives_for_its_new_ttl() -> None:
    clock = FakeClock()
    store = ExactStore(max_bytes=1 << 20, clock=clock)
    await store.put("k", entry(), tenant="t", model="m", ttl_s=10)
    clock.advance(8)
    await store.put("k", entry(), tenant="t", model="m", ttl_s=10)
    clock.advance(8)
    assert store.sweep() == 0
    assert await store.get("k") is not None


async def test_the_expiry_heap_stays_bounded_under_replacement() -> None:
    store = ExactStore(max_bytes=1 << 20, clock=FakeClock())
    for _ in range(1000):
        await store.put("k", entry(), tenant="t", model="m", ttl_s=60)
    assert len(store._expiry) <= len(store) + len(store) // 4 + STALE_EXPIRY_SLACK + 1


async def test_entries_still_expire_on_time_after_the_heap_drops_its_stale_pairs() -> None:
    clock = FakeClock()
    store = ExactStore(max_bytes=1 << 20, clock=clock)
    for n in range(40):
        await store.put(f"short-{n}", entry(), tenant="t", model="m", ttl_s=10)
    for n in range(40):
        await store.put(f"long-{n}", entry(), tenant="t", model="m", ttl_s=60)
    for _ in range(300):  # replaced again and again at one time: stale pairs, equal times
        await store.put("same", entry(), tenant="t", model="m", ttl_s=60)
    assert len(store._expiry) <= len(store) + len(store) // 4 + STALE_EXPIRY_SLACK + 1
    clock.advance(30)
    await store.put("trigger", entry(), tenant="t", model="m", ttl_s=60)  # sweeps
    assert store.stats.expired == 40
    assert {k for k in store._entries} == {f"long-{n}" for n in range(40)} | {"same", "trigger"}
    clock.advance(60)
    await store.put("last", entry(), tenant="t", model="m", ttl_s=60)
    assert list(store._entries) == ["last"]


class _Key(str):
    """A key whose lifetime a test can watch (str itself takes no weak references)."""

    __slots__ = ("__weakref__",)


async def test_a_store_at_its_bound_lets_evicted_keys_go() -> None:
    # Every put past the bound evicts one entry; what the store still holds of the
    # evicted ones (its expiry pairs keep their keys alive) is memory it does not
    # count, so it must stay a small share of what it does: at most a quarter of
    # the live entries, plus a constant.
    evicted: list[weakref.ref[str]] = []
    store = ExactStore(
        max_bytes=1 << 20,
        clock=FakeClock(),
        on_evict=lambda key, _: evicted.append(weakref.ref(key)),
    )
    most = 0
    for n in range(6000):
        await store.put(_Key(f"key-{n}"), entry(payload=200), tenant="t", model="m", ttl_s=600)
        if n % 50 == 0:
            most = max(most, sum(ref() is not None for ref in evicted))
    assert store.stats.evictions > 4000  # the store sat at its bound
    assert most <= len(store) // 4 + STALE_EXPIRY_SLACK + 1


async def test_entries_of_one_model_share_its_name() -> None:
    # Each request's model is a string parsed from its own body, as each
    # answer's is: kept per entry, they cost some 60 bytes each that
    # SLOT_OVERHEAD does not count (bench/entry_rss.py), so the store and the
    # entry keep one string a name.
    store = ExactStore(max_bytes=1 << 20, clock=FakeClock())
    for n in range(3):
        name = b"sim-small".decode()  # a new string each time, equal to the others
        made = entry(model=b"sim-small".decode())
        await store.put(f"key-{n}", made, tenant="t", model=name, ttl_s=600)
    slots = list(store._entries.values())  # (entry, tenant, model, expires_at)
    assert {id(slot[2]) for slot in slots} == {id(slots[0][2])}
    assert {id(slot[0].model) for slot in slots} == {id(slots[0][0].model)}
    assert slots[0][2] == slots[0][0].model == "sim-small"


async def test_purge_and_delete_report_to_the_callback() -> None:
    calls: list[tuple[str, EvictReason]] = []
    store = ExactStore(
        max_bytes=1 << 20, clock=FakeClock(), on_evict=lambda k, w: calls.append((k, w))
    )
    await store.put("a", entry(), tenant="t", model="m", ttl_s=60)
    await store.put("b", entry(), tenant="u", model="m", ttl_s=60)
    await store.delete("a")
    await store.purge(tenant="u")
    assert calls == [("a", EvictReason.DELETED), ("b", EvictReason.PURGED)]
    assert store.stats.purged == 1


def test_store_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ExactStore(max_bytes=-1, clock=FakeClock())


async def test_a_store_bounded_at_zero_keeps_nothing() -> None:
    # `ponto-proxy --cache-max-mb 0` turns the cache off; it once failed to start.
    store = ExactStore(max_bytes=0, clock=FakeClock())
    assert not await store.put("k", entry(), tenant="t", model="m", ttl_s=60)
    assert await store.get("k") is None
    assert (store.stats.entries, store.stats.bytes, store.stats.rejected) == (0, 0, 1)


def test_exact_store_satisfies_the_protocol() -> None:
    store: CacheStore = ExactStore(max_bytes=1, clock=FakeClock())
    assert store.stats.max_bytes == 1


async def test_reserved_bytes_share_the_bound_and_fit_evicts_for_them() -> None:
    """The semantic index's bytes count against the same bound: puts make room
    for them, fit() makes room when they grow, and a put that cannot fit beside
    them is refused."""
    e = entry(200)
    c = cost(e, "k0")
    evicted: list[tuple[str, EvictReason]] = []
    store = ExactStore(
        max_bytes=10 * c, clock=FakeClock(), on_evict=lambda k, r: evicted.append((k, r))
    )
    reserved = 0
    store.reserved = lambda: reserved
    for i in range(10):
        assert await store.put(f"k{i}", e, tenant="t", model="m", ttl_s=60)
    assert len(store) == 10
    reserved = 3 * c
    assert store.fit() == 3
    assert evicted == [(f"k{i}", EvictReason.LRU) for i in range(3)]
    assert store.stats.bytes + reserved <= store.stats.max_bytes
    assert await store.put("k10", e, tenant="t", model="m", ttl_s=60)
    assert store.stats.bytes + reserved <= store.stats.max_bytes
    assert await store.get("k3") is None  # the least recent went for the new one
    reserved = 10 * c  # nothing of the store's fits beside it
    assert not await store.put("k11", e, tenant="t", model="m", ttl_s=60)
    assert len(store) == 0 and store.stats.bytes == 0  # its cost taken off again
    assert store.stats.rejected == 1
    assert await store.get("k11") is None


def _at_once(step: Coroutine[Any, Any, Any]) -> Any:
    """The value of one of ExactStore's coroutines, which never suspend."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("ExactStore suspended")


_STORED = st.one_of(
    st.binary(max_size=400).map(lambda body: entry_of(body=body)),
    st.lists(st.binary(max_size=120), max_size=8).map(lambda c: entry_of(chunks=tuple(c))),
)


def entry_of(**payload: Any) -> CachedResponse:
    return CachedResponse(ResponseKind.CHAT, 0, "m", **payload)


@given(data=st.data(), max_bytes=st.sampled_from([0, 3000, 8000, 30_000]))
def test_the_bytes_counted_are_those_of_the_entries_held(
    data: st.DataObject, max_bytes: int
) -> None:
    """Whatever puts, replacements, expiries, evictions, deletes and purges
    came, the store's bytes are its live entries' costs counted afresh: a put
    charges an entry's cost and its leaving takes the same off (the slot keeps
    no cost of its own), or the bound drifts."""
    clock = FakeClock()
    store = ExactStore(max_bytes=max_bytes, clock=clock, max_entry_bytes=2500)
    reserved = 0
    store.reserved = lambda: reserved
    keys = st.sampled_from(["a", "bb", "ccc", "dddd", "e" * 9])
    for _ in range(data.draw(st.integers(1, 40))):
        key = data.draw(keys)
        op = data.draw(st.sampled_from(["put", "get", "delete", "purge", "time", "fit"]))
        if op == "put":
            store.put_now(
                key,
                data.draw(_STORED),
                tenant=data.draw(st.sampled_from("tu")),
                model=data.draw(st.sampled_from("mn")),
                ttl_s=data.draw(st.sampled_from([0, 1, 5, 60])),
            )
        elif op == "get":
            store.get_now(key)
        elif op == "delete":
            _at_once(store.delete(key))
        elif op == "purge":
            scope = data.draw(st.sampled_from([{}, {"tenant": "t"}, {"model": "m"}]))
            _at_once(store.purge(**scope))
        elif op == "time":
            clock.advance(data.draw(st.sampled_from([0.5, 2, 10])))
            store.sweep()
        else:
            reserved = data.draw(st.sampled_from([0, 1000, 5000]))
            store.fit()
        held = {k: slot[0] for k, slot in store._entries.items()}
        afresh = [entry_of(body=e.body, chunks=e.chunks) for e in held.values()]
        assert store.stats.bytes == sum(cost(e, k) for e, k in zip(afresh, held, strict=True))
        # Within the bound beside the reserved bytes, which alone may pass it.
        assert store.stats.bytes + reserved <= max_bytes or not store
    _at_once(store.purge())
    assert store.stats.bytes == 0 and len(store) == 0
