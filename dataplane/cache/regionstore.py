"""The regional exact cache: this proxy's LRU in front of the region's Redis.

    lookup: local LRU ----hit----> tier local (sub-millisecond, no I/O)
              | miss
            Redis GET (50 ms deadline) --hit--> copied into the LRU, tier region
              | miss, error, breaker open, value that does not decode
            miss
    put:    local LRU now; Redis SET PX ttl in the background (bounded)

Every proxy of a region reads and writes the same Redis, so an answer one proxy
got from an origin is a hit on every other: the region's hit rate no longer
falls as replicas are added. Redis is optional at every step: a failure, a
timeout or an open breaker (dataplane.cache.regional.RegionLink) is a miss, and
writes are dropped, never waited for by a client. The store reaches Redis
through a `RegionSide` (dataplane.cache.regionside): `RedisSide` in the proxy,
`MemorySide` in unit tests.

Redis keys (names escaped so that `:` and glob characters cannot collide):

    ponto:x:<epoch>:<tenant>:<model>:<key>     an entry (SET PX ttl)
    ponto:lock:<epoch>:<tenant>:<model>:<key>  the cross-proxy flight lock
    ponto:purging:<tenant>:<model>             one proxy cleans up after a purge

The value is the entry's absolute expiry (f64, wall clock) and then the entry in
dataplane.cache.codec's form; a proxy that finds the expiry passed treats it as
a miss, and copies a live entry into its LRU for the time that is left. Clocks
of the proxies of a region are assumed to agree to well under a TTL (NTP).

Purges: `<epoch>` is the highest revision of the route table's purges that
cover the entry's tenant and model (`set_purges`). A purge therefore moves
every proxy of the region to a new key space at once, with no SCAN on the hot
path; the old entries are unreachable and age out under their TTL and Redis's
own eviction (run Redis with `maxmemory` and `maxmemory-policy allkeys-lru`:
that bound, not the proxies', caps what the region keeps). `purge()` also drops
the old keys in the background, once per region (the proxy that wins
`ponto:purging:...`), by a bounded SCAN. Epochs only grow: a proxy remembers
every purge it has seen, even after the table drops old ones (it keeps the
newest 64, and each tenant's birth: its record's create revision, as a purge
of it). A proxy started after a purge fell out of the table may compute an
older epoch for that scope; it then misses what the others keep, and could
read entries older than that purge only if they are still within their TTL
after 64 newer purges, and never a deleted tenant's as those of a tenant made
again under its name (whose birth is above them).

Cross-proxy coalescing: see `claim` and `follow`; dataplane.cache.step uses them
after the local Coalescer has made a request the leader of its flight.

One per proxy worker (owned by the app, used from its event loop; not
thread-safe). Writes run as tasks: `flush()` waits for them, `close()` ends them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import re
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

from dataplane.cache.codec import EntryDecodeError, from_bytes, to_bytes
from dataplane.cache.entry import CachedResponse
from dataplane.cache.regionside import RegionSide
from dataplane.cache.store import (
    UNANSWERED,
    EvictListener,
    ExactStore,
    Found,
    StoreStats,
    Unanswered,
)
from ponto.logs import Throttled

log = logging.getLogger(__name__)

ENTRY_PREFIX = "ponto:x:"
LOCK_PREFIX = "ponto:lock:"
PURGING_PREFIX = "ponto:purging:"

# Background writes in flight at most; more are dropped (and counted): a slow
# Redis must not pile up tasks and memory in the proxy, nor take every
# connection from lookups (dataplane.cache.regional.MAX_CONNECTIONS).
MAX_WRITES = 64
# The flight lock's life without a refresh: how long other proxies wait for a
# leader that died. Refreshed every third of it while the origin call runs.
LOCK_TTL_S = 5.0
# How often a proxy waiting for another's flight looks at Redis for the entry.
FOLLOW_POLL_S = 0.02
# At most this many keys dropped per purge; the rest age out (see the docstring).
PURGE_MAX_KEYS = 100_000
# How long one proxy's claim on a purge's cleanup holds if it dies doing it.
PURGE_CLAIM_TTL_MS = 60_000
# Decode failures are logged at most this often (they are all counted).
DECODE_WARNING_EVERY_S = 60.0

_EXPIRY = struct.Struct(">d")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def escape(name: str) -> str:
    """`name` with every character but [A-Za-z0-9._-] percent-encoded (UTF-8)."""
    return _UNSAFE.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), name)


def covers(purge_tenant: str, purge_model: str, tenant: str, model: str) -> bool:
    """Whether a purge of (purge_tenant, purge_model) covers an entry of (tenant,
    model): "" in a purge is every tenant or every model, as the route table says."""
    return purge_tenant in ("", tenant) and purge_model in ("", model)


class PurgeEpochs:
    """The epoch of each (tenant, model): the highest revision of the purges seen
    that cover it (a purge of tenant "" covers every tenant, of model "" every
    model); 0 without one. Pure; only grows."""

    def __init__(self) -> None:
        self._marks: set[tuple[int, str, str]] = set()
        self._cache: dict[tuple[str, str], int] = {}

    def update(self, purges: Iterable[tuple[int, str, str]]) -> bool:
        """Remember these purges; whether any was new."""
        before = len(self._marks)
        self._marks.update(purges)
        if len(self._marks) == before:
            return False
        self._cache.clear()
        return True

    def epoch(self, tenant: str, model: str) -> int:
        found = self._cache.get((tenant, model))
        if found is None:
            found = max(
                (rev for rev, t, m in self._marks if covers(t, m, tenant, model)), default=0
            )
            self._cache[(tenant, model)] = found
        return found


class RegionLock:
    """This proxy's claim on a flight across the region (`RegionalStore.claim`).

    Owned by the leading request; `release` must run however the request ends
    (CachePlan.abandon and settle do it). Refreshed in the background until then.
    """

    def __init__(self, store: RegionalStore, rkey: str, token: str) -> None:
        self._store = store
        self.rkey = rkey
        self._token = token
        self.released = False
        self._refresher = asyncio.ensure_future(self._refresh())
        store._refreshers.add(self._refresher)
        self._refresher.add_done_callback(store._refreshers.discard)

    async def _refresh(self) -> None:
        side = self._store.side
        ttl_ms = int(self._store.lock_ttl_s * 1000)
        lock = LOCK_PREFIX + self.rkey
        while True:
            await asyncio.sleep(self._store.lock_ttl_s / 3)
            if not await side.refresh(lock, self._token, ttl_ms):
                return  # lost (expired, or Redis failed): others may lead now

    def release(self) -> None:
        """Drop the lock once this flight's entry (if any) is written. Idempotent."""
        if self.released:
            return
        self.released = True
        self._refresher.cancel()
        self._store._spawn(self._release(), droppable=False)

    async def _release(self) -> None:
        pending = self._store._writing.get(self.rkey)
        if pending is not None:
            await asyncio.wait([pending])
        lock = LOCK_PREFIX + self.rkey
        await self._store.side.release(lock, self._token)


class RegionalStore:
    """A CacheStore: `local` (the proxy's byte-bounded LRU) in front of the
    region's Redis through `side`. See the module docstring.

    `clock` is the wall clock (entries' expiry is shared between proxies); the
    local store must use the same clock. `name` tells lock holders apart.
    """

    def __init__(
        self,
        local: ExactStore,
        side: RegionSide,
        *,
        name: str,
        clock: Callable[[], float] = time.time,
        max_writes: int = MAX_WRITES,
        lock_ttl_s: float = LOCK_TTL_S,
        follow_poll_s: float = FOLLOW_POLL_S,
        purge_max_keys: int = PURGE_MAX_KEYS,
    ) -> None:
        self.local = local
        self.side = side
        self.name = name
        self.lock_ttl_s = lock_ttl_s
        self._clock = clock
        self._max_writes = max_writes
        self._poll_s = follow_poll_s
        self._purge_max_keys = purge_max_keys
        self._epochs = PurgeEpochs()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refreshers: set[asyncio.Task[None]] = set()
        # Region key -> its write in flight, which a lock release waits for.
        self._writing: dict[str, asyncio.Task[Any]] = {}
        self._tokens = itertools.count()
        self._hits = self._misses = 0
        self._decode_log = Throttled(log, every_s=DECODE_WARNING_EVERY_S)

    # ------------------------------------------------------------ the local tier

    @property
    def on_evict(self) -> EvictListener | None:
        return self.local.on_evict

    @on_evict.setter
    def on_evict(self, listener: EvictListener | None) -> None:
        self.local.on_evict = listener

    @property
    def stats(self) -> StoreStats:
        """The local tier's figures; hits and misses count both tiers."""
        return replace(self.local.stats, hits=self._hits, misses=self._misses)

    def sweep(self) -> int:
        return self.local.sweep()

    def set_purges(self, purges: Iterable[tuple[int, str, str]]) -> None:
        """The route table's purges: they set each scope's epoch (module docstring)."""
        self._epochs.update(purges)

    def region_key(self, key: str, tenant: str, model: str) -> str:
        return _region_key(self._epochs.epoch(tenant, model), key, tenant, model)

    # ------------------------------------------------------------ CacheStore

    async def get(self, key: str, *, tenant: str = "", model: str = "") -> CachedResponse | None:
        if tenant or model:
            found = await self.lookup(key, tenant=tenant, model=model)
            return found.entry if isinstance(found, Found) else None
        entry = await self.local.get(key)
        self._count(entry is not None)
        return entry

    async def lookup(self, key: str, *, tenant: str, model: str) -> Found | Unanswered | None:
        entry = await self.local.get(key)
        if entry is not None:
            self._count(True)
            return Found(entry, "local", self.local.fresh_for(key))
        epoch = self._epochs.epoch(tenant, model)
        raw = await self.side.get(ENTRY_PREFIX + _region_key(epoch, key, tenant, model))
        if raw is UNANSWERED:
            self._count(False)
            return UNANSWERED
        # A purge applied while the GET was out moved the scope to a new key
        # space: what came back is from before it.
        if self._epochs.epoch(tenant, model) != epoch:
            raw = None
        entry = await self._adopt(raw, key, tenant, model)
        self._count(entry is not None)
        # The local copy was given the time the entry has left (unless the
        # local tier refused it: then the step reckons from the tenant's TTL).
        return Found(entry, "region", self.local.fresh_for(key)) if entry is not None else None

    async def put(
        self, key: str, entry: CachedResponse, *, tenant: str, model: str, ttl_s: float
    ) -> bool:
        if not await self.local.put(key, entry, tenant=tenant, model=model, ttl_s=ttl_s):
            return False
        rkey = self.region_key(key, tenant, model)
        value = _EXPIRY.pack(self._clock() + ttl_s) + to_bytes(entry)
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        task = self._spawn(self._write(rkey, value, ttl_ms, self._writing.get(rkey)), op="set")
        if task is not None:
            self._writing[rkey] = task
            task.add_done_callback(lambda done: self._written(rkey, done))
        return True

    async def delete(self, key: str, *, tenant: str = "", model: str = "") -> bool:
        held = await self.local.delete(key)
        if tenant or model:
            rkey = self.region_key(key, tenant, model)
            pending = self._writing.get(rkey)
            if pending is not None:  # so that it does not land after the delete
                await asyncio.wait([pending])
            await self.side.unlink(ENTRY_PREFIX + rkey)
        return held

    async def purge(self, *, tenant: str | None = None, model: str | None = None) -> int:
        """Drop the scope's local entries (the count returned) and, from one proxy
        of the region at a time, its keys in Redis (every epoch), bounded."""
        dropped = await self.local.purge(tenant=tenant, model=model)
        await self.flush()  # no write in flight lands after the purge
        scope = (_escaped(tenant), _escaped(model))
        claim = PURGING_PREFIX + ":".join(name or "*" for name in scope)
        token = f"{self.name}:{next(self._tokens)}"
        # Not op "lock": held back with the writes while Redis was full, the
        # claim skipped the UNLINKs that would free its memory (review finding 2).
        won = await self.side.set_nx(claim, token, PURGE_CLAIM_TTL_MS, op="purge_claim")
        if won:
            try:
                await self._unlink_matching(*scope)
            finally:
                await self.side.release(claim, token)
        return dropped

    # ------------------------------------------------------------ flights

    async def claim(self, key: str, tenant: str, model: str) -> RegionLock | bool | None:
        """Try to lead the region's flight for key: a RegionLock when this proxy
        leads, False when another proxy does, None when Redis cannot say (then
        the caller calls the origin: it never waits on a dead Redis)."""
        rkey = self.region_key(key, tenant, model)
        token = f"{self.name}:{next(self._tokens)}"
        ttl_ms = int(self.lock_ttl_s * 1000)
        got = await self.side.set_nx(LOCK_PREFIX + rkey, token, ttl_ms)
        if got is None:
            return None
        return RegionLock(self, rkey, token) if got else False

    async def follow(
        self, key: str, tenant: str, model: str, *, max_wait_s: float
    ) -> CachedResponse | None:
        """Wait for another proxy's flight on key; its entry, or None when the
        lock went away without one (the leader failed, or the answer was not
        cacheable), Redis failed, or max_wait_s passed."""
        epoch = self._epochs.epoch(tenant, model)
        rkey = _region_key(epoch, key, tenant, model)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + max_wait_s
        while loop.time() < give_up:
            await asyncio.sleep(self._poll_s)
            got = await self.side.get_and_exists(ENTRY_PREFIX + rkey, LOCK_PREFIX + rkey)
            if got is None:
                return None
            raw, held = got
            if self._epochs.epoch(tenant, model) != epoch:
                return None  # purged meanwhile: that flight's answer is from before
            if raw is not None:
                return await self._adopt(raw, key, tenant, model)
            if not held:
                return None
        return None

    # ------------------------------------------------------------ lifetime

    async def flush(self) -> None:
        """Wait for the writes and lock releases in flight now (not later ones)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    async def close(self) -> None:
        """Stop refreshing locks (they expire) and finish the writes in flight
        (each bounded by its deadline)."""
        for task in list(self._refreshers):
            task.cancel()
        await self.flush()

    # ------------------------------------------------------------ internals

    def _spawn(
        self, work: Awaitable[Any], *, op: str = "", droppable: bool = True
    ) -> asyncio.Task[Any] | None:
        if droppable and len(self._tasks) >= self._max_writes:
            if asyncio.iscoroutine(work):
                work.close()
            self.side.count(op, "dropped")
            return None
        task: asyncio.Task[Any] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _adopt(self, raw: object, key: str, tenant: str, model: str) -> CachedResponse | None:
        """The live entry in a Redis value, also put in the local tier; None for
        no value, an expired one, or one that does not decode (counted)."""
        if raw is None:
            return None
        try:
            if not isinstance(raw, bytes) or len(raw) < _EXPIRY.size:
                raise EntryDecodeError("not an entry value")
            (expires_at,) = _EXPIRY.unpack_from(raw)
            entry = from_bytes(raw[_EXPIRY.size :])
        except EntryDecodeError as exc:
            self.side.error("decode")
            self._decode_log.log(
                logging.WARNING, "regional cache: a value that does not decode (%s), a miss", exc
            )
            return None
        left = expires_at - self._clock()
        if not left > 0:
            return None
        await self.local.put(key, entry, tenant=tenant, model=model, ttl_s=left)
        return entry

    async def _unlink_matching(self, tenant: str | None, model: str | None) -> None:
        """UNLINK the entries of a scope (None: any), in every epoch, up to the bound."""
        # The glob narrows the scan; `*` also matches `:`, so the parts are checked.
        pattern = f"{ENTRY_PREFIX}*:{tenant or '*'}:{model or '*'}:*"
        cursor = 0
        dropped = 0
        while dropped < self._purge_max_keys:
            page = await self.side.scan(cursor, pattern)
            if page is None:
                return
            cursor, found = page
            keys = [k for k in found if _in_scope(k, tenant, model)]
            if keys:
                await self.side.unlink(*keys)
                dropped += len(keys)
            if cursor == 0:
                return

    async def _write(
        self, rkey: str, value: bytes, ttl_ms: int, previous: asyncio.Task[Any] | None
    ) -> None:
        if previous is not None:  # writes of one key land in order
            await asyncio.wait([previous])
        await self.side.set(ENTRY_PREFIX + rkey, value, ttl_ms)

    def _written(self, rkey: str, task: asyncio.Task[Any]) -> None:
        if self._writing.get(rkey) is task:
            del self._writing[rkey]

    def _count(self, hit: bool) -> None:
        if hit:
            self._hits += 1
        else:
            self._misses += 1


def _region_key(epoch: int, key: str, tenant: str, model: str) -> str:
    return f"{epoch}:{escape(tenant)}:{escape(model)}:{key}"


def _escaped(name: str | None) -> str | None:
    return None if name is None else escape(name)


def _in_scope(rkey: str, tenant: str | None, model: str | None) -> bool:
    # ponto:x:<epoch>:<tenant>:<model>:<key>; escaped names hold no ':'.
    parts = rkey.split(":")
    return (
        len(parts) == 6
        and (tenant is None or parts[3] == tenant)
        and (model is None or parts[4] == model)
    )
