"""Where exact-cache entries live: a `CacheStore` protocol and its in-memory form.

The protocol is async so that a shared store (dataplane.cache.regionstore, on
Redis) sits behind it without changing callers; `ExactStore` suspends only in a
purge of more than PURGE_SLICE entries, between its slices.
Any implementation must pass tests/unit/test_cache_store.py::TestContract.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from dataplane.cache.entry import CachedResponse

# What the process holds for each entry beyond the entry's own size: the key
# string, the slot tuple, the index entries (LRU order, expiry heap), the
# allocator's and the tables' slack, and the fragmentation that evicting and
# replacing entries leaves. Set from RSS, not from tracemalloc (which sees
# about 480 B of it), so that `--cache-max-mb` bounds what the cache adds to
# the process (issue 17). bench/entry_rss.py measures it, a full store that
# evicted five times its entries for new keys, each answer and request naming
# its model in a string of its own, as under load: RSS 1,254 / 1,777 / 2,988 B
# per entry for answers of 300 / 900 / 2,200 characters, counted with this
# 1,779 / 2,378 / 3,678 B (23-42 % over: room for the fragmentation a longer
# load adds, and for what the load itself holds beside a full cache;
# bench/memory.py: peak RSS within bound + base).
SLOT_OVERHEAD = 900
# Stale expiry pairs (of entries evicted, deleted or replaced) the heap may hold
# beyond a quarter of the live entries before it is rebuilt. A stale pair keeps
# its key alive and is not counted against the bound (about 150 bytes with the
# key): allowing as many as there are entries let a store at its bound, evicting
# on every put, hold up to its entry count in uncounted pairs (0.16 MB per
# thousand puts, 1 MB at 6,600 entries, in the semantic soak). A rebuild costs
# O(entries) once per entries/4 puts, still amortised O(1) per put.
STALE_EXPIRY_SLACK = 64
# Entries a purge (all, or by tenant or model) looks at before it lets the
# event loop run. It reads each slot's scope rather than keep per-tenant and
# per-model key sets at every put (some 1,900 instructions a put, and two set entries an
# entry): on a store of 600,000 entries a slice held the loop 15 ms at most
# (the first, which lists the keys: 8 B an entry, for the purge's time).
PURGE_SLICE = 8192


class EvictReason(enum.StrEnum):
    LRU = "lru"  # pushed out by the byte bound
    EXPIRED = "expired"  # its TTL ran out
    PURGED = "purged"  # purge() by tenant, model or everything
    DELETED = "deleted"  # delete()


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of a store's counters (monotonic since start) and gauges."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0  # by the byte bound only
    expired: int = 0
    purged: int = 0
    # put() refused: larger than the store's per-entry bound, or a TTL <= 0.
    rejected: int = 0
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0


# Where a hit came from: this proxy's memory, or the region's shared store.
Tier = Literal["local", "region"]


@dataclass(frozen=True, slots=True)
class Found:
    entry: CachedResponse
    tier: Tier
    # Seconds the entry has left before it expires, as its store reckons them
    # (a request's `Cache-Control: min-fresh`); None when the store cannot say.
    fresh_s: float | None = None


class Unanswered(enum.Enum):
    """A lookup whose shared tier could not answer (down, slow, breaker open): a
    miss that proves nothing, unlike None (absent). Callers serve it as a miss
    but must not conclude the entry is gone (e.g. drop a semantic pointer)."""

    UNANSWERED = "unanswered"


UNANSWERED = Unanswered.UNANSWERED


class CacheStore(Protocol):
    """A key -> entry map with TTLs, scoped by tenant and model for purges.

    Keys come from dataplane.cache.keys.cache_key and already hold the tenant and
    the model; the `tenant`/`model` given to put() index the entry for purge(),
    and a shared store also files the entry under them. Lookups give the same
    scope, so that a shared store finds an entry another proxy stored; without
    one (the defaults) a store looks only at what it holds itself.
    Implementations are safe for concurrent use by the tasks of one event loop.
    """

    async def get(self, key: str, *, tenant: str = "", model: str = "") -> CachedResponse | None:
        """The live entry under key, or None (absent or expired). Counts a hit or a miss."""
        ...

    async def lookup(self, key: str, *, tenant: str, model: str) -> Found | Unanswered | None:
        """As get(), saying which tier the entry came from; UNANSWERED when this
        proxy does not hold it and a shared tier could not say."""
        ...

    async def put(
        self, key: str, entry: CachedResponse, *, tenant: str, model: str, ttl_s: float
    ) -> bool:
        """Keep entry for ttl_s seconds, replacing any entry under key; False when
        the store refuses it (too large, ttl_s <= 0)."""
        ...

    async def delete(self, key: str, *, tenant: str = "", model: str = "") -> bool:
        """Drop one entry (from every tier, given its scope); whether this store held one."""
        ...

    async def purge(self, *, tenant: str | None = None, model: str | None = None) -> int:
        """Drop the entries of a tenant, of a model, of both (when both are given:
        that tenant's entries for that model), or all (neither); how many."""
        ...

    @property
    def stats(self) -> StoreStats: ...


# What the store holds of an entry: (entry, tenant, model, expires_at). A
# tuple, not a slotted class: one is made at every put, and a class's
# __init__ (a Python frame) cost some 2,300 instructions more. Its bytes are
# not kept either (an int object of its own): an entry's size never changes,
# so they are counted again when it leaves.
_Slot = tuple[CachedResponse, str, str, float]
_EXPIRES_AT: Final = 3


EvictListener = Callable[[str, EvictReason], None]


class ExactStore:
    """In-memory CacheStore: LRU bounded by bytes, a TTL per entry.

    One per proxy process, owned by the app. Every method but purge() runs
    without suspending, so it is atomic for the tasks of the event loop it is
    used from; it is not thread-safe. A purge of a store of more than
    PURGE_SLICE entries (all of them, or by tenant or model) lets the loop
    run between slices: it drops the scope's entries held when it began
    (and an entry put meanwhile under one of their keys, if its slice is yet
    to come), and the store is consistent, counted and told at each pause.
    `clock` gives seconds on any fixed origin (inject time.monotonic, or a
    fake in tests); TTLs are measured on it.

    `on_evict(key, reason)` is called after an entry has left the store for any
    reason (not when it is replaced under the same key), once the store is
    consistent again; the semantic index uses it to drop its pointer. It must be
    quick, must not raise and must not call back into the store.

    `reserved()` is the memory other parts of the cache hold against the same
    bound (the semantic index's `nbytes`): the store keeps its own bytes plus
    that under `max_bytes`, evicting at put() and when told with fit(). A put
    that cannot fit beside it is refused.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        clock: Callable[[], float],
        max_entry_bytes: int | None = None,
        on_evict: EvictListener | None = None,
    ) -> None:
        # 0 keeps nothing (`ponto-proxy --cache-max-mb 0`): every put is refused.
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, not {max_bytes}")
        self._max_bytes = max_bytes
        self._max_entry = min(max_entry_bytes or max_bytes, max_bytes)
        self._clock = clock
        self.on_evict = on_evict
        self.reserved: Callable[[], int] = _nothing_reserved
        self._entries: OrderedDict[str, _Slot] = OrderedDict()
        # (expires_at, key) of every put; stale pairs (entry replaced or gone)
        # are skipped when popped, and the heap is rebuilt when they outnumber a
        # quarter of the entries (STALE_EXPIRY_SLACK).
        self._expiry: list[tuple[float, str]] = []
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._expired = self._purged = self._rejected = 0

    @property
    def stats(self) -> StoreStats:
        return StoreStats(
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            expired=self._expired,
            purged=self._purged,
            rejected=self._rejected,
            entries=len(self._entries),
            bytes=self._bytes,
            max_bytes=self._max_bytes,
        )

    def __len__(self) -> int:
        return len(self._entries)

    # get, lookup and put are the protocol's coroutines; the step calls their
    # plain twins (`*_now`) when this store is the only tier: a coroutine that
    # never waits costs some 900 instructions more than a call (issue 17).

    async def get(self, key: str, *, tenant: str = "", model: str = "") -> CachedResponse | None:
        return self.get_now(key)

    def get_now(self, key: str) -> CachedResponse | None:
        """`get`, as a plain call."""
        slot = self._entries.get(key)
        if slot is None:
            self._misses += 1
            return None
        entry, _, _, expires_at = slot
        if expires_at <= self._clock():
            self._remove(key)
            self._expired += 1
            self._misses += 1
            self._notify([key], EvictReason.EXPIRED)
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        return entry

    async def lookup(self, key: str, *, tenant: str, model: str) -> Found | None:
        return self.lookup_now(key)

    def lookup_now(self, key: str) -> Found | None:
        """`lookup`, as a plain call."""
        entry = self.get_now(key)
        return Found(entry, "local", self.fresh_for(key)) if entry is not None else None

    def fresh_for(self, key: str) -> float | None:
        """Seconds the entry under key has left; None when there is none."""
        slot = self._entries.get(key)
        return None if slot is None else slot[_EXPIRES_AT] - self._clock()

    async def put(
        self, key: str, entry: CachedResponse, *, tenant: str, model: str, ttl_s: float
    ) -> bool:
        return self.put_now(key, entry, tenant=tenant, model=model, ttl_s=ttl_s)

    def put_now(
        self, key: str, entry: CachedResponse, *, tenant: str, model: str, ttl_s: float
    ) -> bool:
        """`put`, as a plain call."""
        cost = entry.size + len(key) + SLOT_OVERHEAD  # _remove's too
        if cost > self._max_entry or not ttl_s > 0:
            self._rejected += 1
            return False
        now = self._clock()
        heap = self._expiry
        entries = self._entries
        # The calls only when there is something to drop (the usual put has
        # neither an entry expired nor one to evict): a call and its empty
        # list cost more than the checks (bench/instructions.py's features).
        expired = self._sweep(now) if heap and heap[0][0] <= now else None
        if key in entries:
            self._remove(key)
        # A float made here (whatever the clock's type): _drop_stale_expiry
        # tells a live pair by this very object.
        expires_at = float(now) + ttl_s
        # The model as each request named it, a string parsed from its body:
        # one a name, as for the entry's own model (CachedResponse). The
        # tenant's name is the route table's, already one a tenant.
        entries[key] = (entry, tenant, sys.intern(model), expires_at)
        self._bytes += cost
        heapq.heappush(heap, (expires_at, key))
        reserved = self.reserved()  # nothing between here and the check changes it
        evicted = (
            self._shrink(keep=key, reserved=reserved)
            if self._bytes + reserved > self._max_bytes
            else None
        )
        fits = self._bytes + reserved <= self._max_bytes
        if not fits:  # only the new entry is left, and it does not fit beside the rest
            self._remove(key)
            self._rejected += 1
        live = len(entries)
        if len(heap) > live + live // 4 + STALE_EXPIRY_SLACK:
            self._drop_stale_expiry()
        if expired:
            self._notify(expired, EvictReason.EXPIRED)
        if evicted:
            self._notify(evicted, EvictReason.LRU)
        return fits

    def fit(self) -> int:
        """Evict least recently used entries until the store and `reserved()` are
        within the bound again; how many. Call it when `reserved()` has grown."""
        evicted = self._shrink(keep=None)
        self._notify(evicted, EvictReason.LRU)
        return len(evicted)

    def _shrink(self, keep: str | None, reserved: int | None = None) -> list[str]:
        evicted: list[str] = []
        if reserved is None:
            reserved = self.reserved()
        while self._entries and self._bytes + reserved > self._max_bytes:
            oldest = next(iter(self._entries))
            if oldest == keep:
                break
            self._remove(oldest)
            evicted.append(oldest)
        self._evictions += len(evicted)
        return evicted

    async def delete(self, key: str, *, tenant: str = "", model: str = "") -> bool:
        if key not in self._entries:
            return False
        self._remove(key)
        self._notify([key], EvictReason.DELETED)
        return True

    async def purge(self, *, tenant: str | None = None, model: str | None = None) -> int:
        entries = self._entries
        # All of them (neither given) in slices too: on a large store one
        # step held the loop 0.1-0.9 s at 600,000 entries (helper-372).
        # The dict's own keys, in the order they were first put: an
        # OrderedDict's iterator finds each key's node by a lookup of its own,
        # some 0.2-1.5 us a key on a large store, ten times this. A purge
        # tells its keys in no order of its contract.
        held = list(dict.keys(entries))
        dropped = 0
        for start in range(0, len(held), PURGE_SLICE):
            if start:
                await asyncio.sleep(0)
            gone: list[str] = []
            for key in held[start : start + PURGE_SLICE]:
                slot = entries.get(key)
                if (
                    slot is not None
                    and (tenant is None or slot[1] == tenant)
                    and (model is None or slot[2] == model)
                ):
                    self._remove(key)
                    gone.append(key)
            # Counted and told at each slice, so that a scrape or a lookup
            # between two sees a store consistent with its listener.
            self._purged += len(gone)
            dropped += len(gone)
            self._notify(gone, EvictReason.PURGED)
        return dropped

    def sweep(self) -> int:
        """Drop every expired entry now; how many. put() does this too, so an
        expired entry holds memory at most until the next put() or get() of it;
        call this on a timer if puts can stop for long."""
        expired = self._sweep(self._clock())
        self._notify(expired, EvictReason.EXPIRED)
        return len(expired)

    def _sweep(self, now: float) -> list[str]:
        gone: list[str] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            expires_at, key = heapq.heappop(heap)
            slot = self._entries.get(key)
            if slot is not None and slot[_EXPIRES_AT] == expires_at:
                self._remove(key)
                gone.append(key)
        self._expired += len(gone)
        return gone

    def _drop_stale_expiry(self) -> None:
        """Keep only the live entries' pairs in the expiry heap. The pairs kept
        are the heap's own, not copies: a copy of every pair would be a peak
        of about 60 bytes an entry, outside the bound, each time.

        A live pair holds its slot's very `expires_at` object (put pushes
        exactly that), so identity tells it from a stale pair of a replaced
        entry even when the two times are equal."""
        entries = self._entries
        heap = self._expiry
        heap[:] = [
            pair
            for pair in heap
            if (slot := entries.get(pair[1])) is not None and slot[_EXPIRES_AT] is pair[0]
        ]
        heapq.heapify(heap)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)[0]
        self._bytes -= entry.size + len(key) + SLOT_OVERHEAD  # as put_now counted it

    def _notify(self, keys: list[str], reason: EvictReason) -> None:
        listener = self.on_evict
        if listener is not None:
            for key in keys:
                listener(key, reason)


def _nothing_reserved() -> int:
    return 0
