"""ExactStore against a plain model of its contract, over random operations:
puts, replacements, lookups, deletes, purges (sliced or not), TTL expiry on an
injected clock, evictions by the byte bound and by what the semantic index
reserves. The model keeps a list of live entries and scans it for everything
(expiry, purges, the least recently used), so that the store's own indexes
(the LRU order, the expiry heap, the purge's slices) are checked by what they
must give, not by how."""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.cache import store as store_module
from dataplane.cache.entry import CachedResponse, ResponseKind
from dataplane.cache.store import SLOT_OVERHEAD, EvictReason, ExactStore, StoreStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Held:
    key: str
    entry: CachedResponse
    tenant: str
    model: str
    expires_at: float


@dataclass
class Model:
    """What ExactStore must do, written as scans over a list in LRU order."""

    max_bytes: int
    max_entry: int
    clock: Clock
    reserved: int = 0
    held: list[Held] = field(default_factory=list)
    told: list[tuple[str, EvictReason]] = field(default_factory=list)
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expired: int = 0
    purged: int = 0
    rejected: int = 0

    def _find(self, key: str) -> Held | None:
        return next((h for h in self.held if h.key == key), None)

    def _bytes(self) -> int:
        return sum(h.entry.size + len(h.key) + SLOT_OVERHEAD for h in self.held)

    def _expire(self, now: float) -> list[str]:
        gone = sorted(
            (h for h in self.held if h.expires_at <= now), key=lambda h: (h.expires_at, h.key)
        )
        for h in gone:
            self.held.remove(h)
        self.expired += len(gone)
        return [h.key for h in gone]

    def _shrink(self, keep: str | None) -> list[str]:
        evicted = []
        while self.held and self._bytes() + self.reserved > self.max_bytes:
            if self.held[0].key == keep:
                break
            evicted.append(self.held.pop(0).key)
        self.evictions += len(evicted)
        return evicted

    def _tell(self, keys: list[str], reason: EvictReason) -> None:
        self.told += [(k, reason) for k in keys]

    def put(self, key: str, e: CachedResponse, tenant: str, model: str, ttl_s: float) -> bool:
        if e.size + len(key) + SLOT_OVERHEAD > self.max_entry or not ttl_s > 0:
            self.rejected += 1
            return False
        now = self.clock()
        expired = self._expire(now)
        old = self._find(key)
        if old is not None:
            self.held.remove(old)
        self.held.append(Held(key, e, tenant, model, now + ttl_s))
        evicted = self._shrink(keep=key)
        fits = self._bytes() + self.reserved <= self.max_bytes
        if not fits:
            self.held.pop()
            self.rejected += 1
        self._tell(expired, EvictReason.EXPIRED)
        self._tell(evicted, EvictReason.LRU)
        return fits

    def get(self, key: str) -> CachedResponse | None:
        h = self._find(key)
        if h is None:
            self.misses += 1
            return None
        self.held.remove(h)
        if h.expires_at <= self.clock():
            self.expired += 1
            self.misses += 1
            self._tell([key], EvictReason.EXPIRED)
            return None
        self.held.append(h)
        self.hits += 1
        return h.entry

    def delete(self, key: str) -> bool:
        h = self._find(key)
        if h is None:
            return False
        self.held.remove(h)
        self._tell([key], EvictReason.DELETED)
        return True

    def purge(self, tenant: str | None, model: str | None) -> int:
        gone = [
            h
            for h in self.held
            if (tenant is None or h.tenant == tenant) and (model is None or h.model == model)
        ]
        for h in gone:
            self.held.remove(h)
        self.purged += len(gone)
        self._tell([h.key for h in gone], EvictReason.PURGED)
        return len(gone)

    def sweep(self) -> int:
        expired = self._expire(self.clock())
        self._tell(expired, EvictReason.EXPIRED)
        return len(expired)

    def fit(self) -> int:
        evicted = self._shrink(keep=None)
        self._tell(evicted, EvictReason.LRU)
        return len(evicted)

    def stats(self) -> StoreStats:
        return StoreStats(
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            expired=self.expired,
            purged=self.purged,
            rejected=self.rejected,
            entries=len(self.held),
            bytes=self._bytes(),
            max_bytes=self.max_bytes,
        )


def run(coro: Coroutine[Any, Any, int]) -> tuple[int, int]:
    """Run a store's coroutine without a loop: its result and how often it let
    the loop run (a bare `asyncio.sleep(0)` yields None)."""
    pauses = 0
    while True:
        try:
            assert coro.send(None) is None
        except StopIteration as done:
            return done.value, pauses
        pauses += 1


_ENTRIES = st.integers(0, 1500).map(
    lambda n: CachedResponse(ResponseKind.CHAT, 0, "m", body=b"x" * n)
)
_KEYS = st.sampled_from(["a", "bb", "ccc", "dddd", "e" * 9, "f" * 17])
_SCOPES = st.sampled_from(
    [
        {},
        {"tenant": "t"},
        {"tenant": "u"},
        {"model": "m"},
        {"model": "n"},
        {"tenant": "t", "model": "n"},
    ]
)


@settings(max_examples=400)
@given(
    data=st.data(),
    max_bytes=st.sampled_from([0, 3000, 8000, 30_000]),
    purge_slice=st.sampled_from([1, 2, 8192]),
)
def test_the_store_does_what_the_model_does(
    data: st.DataObject, max_bytes: int, purge_slice: int
) -> None:
    clock = Clock()
    store = ExactStore(max_bytes=max_bytes, clock=clock, max_entry_bytes=2500)
    model = Model(max_bytes, min(2500, max_bytes), clock)
    told: list[tuple[str, EvictReason]] = []
    store.on_evict = lambda key, why: told.append((key, why))
    store.reserved = lambda: model.reserved
    with mock.patch.object(store_module, "PURGE_SLICE", purge_slice):
        for _ in range(data.draw(st.integers(1, 60))):
            key = data.draw(_KEYS)
            op = data.draw(
                st.sampled_from(["put", "put", "get", "delete", "purge", "time", "sweep", "fit"])
            )
            if op == "put":
                e = data.draw(_ENTRIES)
                tenant = data.draw(st.sampled_from("tu"))
                name = data.draw(st.sampled_from("mn"))
                ttl = data.draw(st.sampled_from([0, 1, 2.5, 5, 60]))
                assert store.put_now(key, e, tenant=tenant, model=name, ttl_s=ttl) == model.put(
                    key, e, tenant, name, ttl
                )
            elif op == "get":
                assert store.get_now(key) is model.get(key)
            elif op == "delete":
                assert run(store.delete(key))[0] == model.delete(key)
            elif op == "purge":
                scope = data.draw(_SCOPES)
                before = len(store)
                dropped, pauses = run(store.purge(**scope))
                assert dropped == model.purge(scope.get("tenant"), scope.get("model"))
                # A purge tells what it dropped in no order of its contract.
                told[len(told) - dropped :] = sorted(told[len(told) - dropped :])
                model.told[len(model.told) - dropped :] = sorted(
                    model.told[len(model.told) - dropped :]
                )
                # A purge (of a scope, or of all) pauses once between slices
                # of what it held.
                assert pauses == max(0, (before - 1) // purge_slice)
            elif op == "time":
                clock.now += data.draw(st.sampled_from([0.5, 1, 2.5, 10]))
            elif op == "sweep":
                assert store.sweep() == model.sweep()
            else:
                model.reserved = data.draw(st.sampled_from([0, 1000, 5000]))
                assert store.fit() == model.fit()
            assert store.stats == model.stats()
            assert [(k, s[0], s[1], s[2], s[3]) for k, s in store._entries.items()] == [
                (h.key, h.entry, h.tenant, h.model, h.expires_at) for h in model.held
            ]
            assert told == model.told
            for h in model.held:
                assert store.fresh_for(h.key) == h.expires_at - clock.now


async def test_a_sliced_purge_drops_what_it_held_and_leaves_the_store_whole_at_each_pause() -> None:
    clock = Clock()
    told: list[tuple[str, EvictReason]] = []
    store = ExactStore(max_bytes=1 << 30, clock=clock, on_evict=lambda k, w: told.append((k, w)))
    e = CachedResponse(ResponseKind.CHAT, 0, "m", body=b"x" * 10)
    for i in range(10):
        store.put_now(f"k{i}", e, tenant="t" if i % 2 else "u", model="m", ttl_s=60)
    with mock.patch.object(store_module, "PURGE_SLICE", 4):
        purge = store.purge(tenant="t")
        assert purge.send(None) is None  # k1, k3 gone; the loop runs
        assert store.stats.purged == 2 and told == [
            ("k1", EvictReason.PURGED),
            ("k3", EvictReason.PURGED),
        ]
        assert store.stats.bytes == sum(
            s[0].size + len(k) + SLOT_OVERHEAD for k, s in store._entries.items()
        )
        # Meanwhile: a new key of the tenant's, a key it held replaced, one deleted.
        store.put_now("new", e, tenant="t", model="m", ttl_s=60)
        store.put_now("k5", e, tenant="t", model="m", ttl_s=60)
        await store.delete("k7")
        assert purge.send(None) is None
        try:
            purge.send(None)
        except StopIteration as done:
            assert done.value == 4  # k1, k3, then k5 (replaced) and k9; k7 was deleted
        else:
            raise AssertionError("the purge went on past what it held")
    assert sorted(store._entries) == ["k0", "k2", "k4", "k6", "k8", "new"]
    assert store.stats.purged == 4
