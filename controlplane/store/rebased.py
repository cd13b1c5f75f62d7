"""A StateStore whose revisions never go back, even when etcd's do.

Everything proxies order by is a store revision: a table's version, the
generations of quota shares and of origin loads, a cache purge's revision.
Restored from a backup, or started again with its data lost, etcd counts from
an older (or the first) revision, and every proxy would refuse what follows
as older than what it holds, until restarted (trial 34).

RebasedStore adds a base to every revision it hands out, kept in the store
itself (BASE_KEY, hidden from listings) so that every replica adds the same.
When etcd's revision goes back, it raises the base to the highest revision
handed out, by itself or, reported by a proxy, by any replica before it
(`ensure_above`), so that proxies take the next table. Revisions passed in
(if_mod_revision, fences, a watch's start) are mapped back with the base they
were handed out under: a condition read before a raise still holds after it.

The new base is not the old numbering carried on (highest + 1 - etcd's
revision) but at least the highest number itself: every key etcd kept is
numbered again from it, and a key unchanged since the backup, read after the
raise, must not get a number the old base handed out (it would be mapped back
with that base, and its compare-and-swap fail for good). A restore costs the
numbering about etcd's revision at the backup; MAX_BASE is far.

The raise is written with compare-and-swap; a replica learns another's raise
from the listing of a prefix holding BASE_KEY (the builder's, which the
write wakes), and raises further if its own numbers were higher. A raise
clears what the stored base could have handed out by then, and MARGIN more,
so that a replica that went on numbering under it while the raise was
written takes the new base rather than raising again in turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

from controlplane.store.base import (
    Conflict,
    Fence,
    KeyValue,
    Listing,
    StateStore,
    StoreError,
    Write,
)

log = logging.getLogger(__name__)

# Under the state prefix, so that raising it wakes every replica's builder.
BASE_KEY = "/ponto/state/revision-base"
# Tries of the compare-and-swap before giving up until the next occasion.
RAISE_TRIES = 5
# A proxy's report is believed up to this far above etcd's revision (a number
# from elsewhere must not push the base towards uint64's end): 2^53.
MAX_BASE = 1 << 53
# Revisions another replica may number under the old base between reading
# etcd for a raise and learning of it (a few watch round trips).
MARGIN = 1000


class RebasedStore:
    """Forwards to `inner`, adding the base to every revision out and taking
    it off every revision in. See the module docstring."""

    def __init__(self, inner: StateStore) -> None:
        self.inner = inner
        self._base = 0
        self._loaded = False
        self._lock = asyncio.Lock()
        # The read of the stored base that callers share until it is loaded
        # (`_ready`); None when none is under way.
        self._loading: asyncio.Future[None] | None = None
        # The highest revision handed out.
        self.highest = 0
        # (highest handed out before, base from then on) of each change of
        # base, oldest first: a revision is mapped back with its own base.
        self._eras: list[tuple[int, int]] = []
        self._on_rebase: list[Callable[[int], None]] = []

    def on_rebase(self, callback: Callable[[int], None]) -> None:
        """Call `callback(upto)` whenever the base this replica numbers by
        changes, whichever path changed it (ensure_above, a watch that saw
        the revision go back, a listing holding another replica's raise):
        revisions up to `upto` were handed out under the base before. Called
        synchronously from within the store's call; it must not block."""
        self._on_rebase.append(callback)

    @property
    def base(self) -> int:
        return self._base

    # ------------------------------------------------------------ mapping

    def _out(self, raw: int) -> int:
        revision = raw + self._base
        self.highest = max(self.highest, revision)
        return revision

    def _kv(self, kv: KeyValue) -> KeyValue:
        if not self._base:
            return kv  # records are frozen: a store never restored hands out etcd's own
        created = kv.create_revision + self._base if kv.create_revision else 0
        return KeyValue(kv.key, kv.value, kv.mod_revision + self._base, kv.lease, created)

    def _in(self, revision: int) -> int:
        """The store's own revision of one handed out, with the base it was
        handed out under; 0 stays 0 (absent), and one that maps below 1 (no
        revision of the store's) becomes -1, which no key is at."""
        if not revision:
            return 0
        base = self._base
        for after, era_base in reversed(self._eras):
            if revision > after:
                break
            base = era_base
        raw = revision - base
        return raw if raw > 0 else -1

    # ------------------------------------------------------------ base

    async def _ready(self) -> None:
        """The stored base loaded, once. Callers meanwhile share one read:
        when it fails (etcd away) they all fail with it, at once. Each waiting
        its turn for a read of its own, a replica started with etcd away had
        its Nth caller fail after N store timeouts (the builder's first
        attempt took 15 s, five callers behind each other's 3 s)."""
        if self._loaded:
            return
        loading = self._loading
        if loading is None:
            loading = self._loading = asyncio.ensure_future(self._load())
            loading.add_done_callback(self._loaded_or_not)
        # Shielded: a caller cancelled leaves the read to the others.
        await asyncio.shield(loading)

    async def _load(self) -> None:
        async with self._lock:
            if not self._loaded:
                stored, _, _ = await self._read_base()
                self._adopt(stored)
                self._loaded = True

    def _loaded_or_not(self, loading: asyncio.Future[None]) -> None:
        """The shared read ended: the next caller after a failure reads again.
        Its failure is retrieved here too, for when every caller had left."""
        self._loading = None
        if not loading.cancelled():
            loading.exception()

    async def _read_base(self) -> tuple[int, KeyValue | None, int]:
        """(base stored, its key, the store's revision), in one linearizable read."""
        listing = await self.inner.list(BASE_KEY)
        kv = next((kv for kv in listing.items if kv.key == BASE_KEY), None)
        return _decode(kv), kv, listing.revision

    def _adopt(self, base: int) -> None:
        if base != self._base:
            self._eras.append((self.highest, self._base))
            self._base = base
            for callback in self._on_rebase:
                callback(self.highest)

    async def ensure_above(self, revision: int) -> bool:
        """Make every revision handed out from now on above `revision` and
        above every one this replica handed out, raising the stored base if
        etcd's revision plus it is not (etcd went back); return whether the
        base this replica uses changed. A report that would need a base above
        MAX_BASE is refused (logged). StoreUnavailable passes on."""
        await self._ready()
        async with self._lock:
            before = self._base
            revision = max(revision, self.highest)
            for _ in range(RAISE_TRIES):
                stored, kv, raw = await self._read_base()
                # Equal is no regression seen. Another replica's base is taken
                # only if everything numbered under it is above all this one
                # handed out (see _in).
                if raw + stored >= revision and (stored == self._base or stored >= self.highest):
                    self._adopt(stored)
                    return self._base != before  # raised by another replica
                base = max(revision, stored + raw) + MARGIN
                if base > MAX_BASE:
                    log.error(
                        "not numbering revisions from %d: %d was reported, but etcd is at %d",
                        base,
                        revision,
                        raw,
                    )
                    return False
                try:
                    await self.inner.put(
                        BASE_KEY,
                        str(base).encode(),
                        if_mod_revision=kv.mod_revision if kv is not None else 0,
                    )
                except Conflict:
                    continue  # another replica raised it: read again
                self._adopt(base)
                log.warning(
                    "etcd's revision %d is behind %d, handed out before (etcd restored "
                    "from a backup, or its data lost): revisions are numbered from %d "
                    "up now, so that proxies take the tables that follow",
                    raw,
                    revision,
                    base,
                )
                return True
            return False

    async def _learn(self, items: Sequence[KeyValue], raw: int) -> tuple[KeyValue, ...]:
        """A listing that covers BASE_KEY: take the base it holds (another
        replica raised it), raising it further if it is not above all this
        replica handed out; the key is left out of what is returned."""
        stored = _decode(next((kv for kv in items if kv.key == BASE_KEY), None))
        if stored != self._base:
            if stored >= self.highest:
                self._adopt(stored)
            else:
                await self.ensure_above(self.highest)
        return self._all(kv for kv in items if kv.key != BASE_KEY)

    def _all(self, items: Iterable[KeyValue]) -> tuple[KeyValue, ...]:
        """`items` with the base added. Under base 0 (no restore ever) they
        are the inner store's records as they are: at 20,000 keys, making
        each again held the event loop about 0.1 s a listing of the state
        (up to 0.7 s on a busy machine during a bulk key load)."""
        if not self._base:
            return tuple(items)
        return tuple(self._kv(kv) for kv in items)

    # ------------------------------------------------------------ StateStore

    async def get(self, key: str) -> KeyValue | None:
        await self._ready()
        kv = await self.inner.get(key)
        return None if kv is None else self._kv(kv)

    async def list(self, prefix: str) -> Listing:
        await self._ready()
        listing = await self.inner.list(prefix)
        if BASE_KEY.startswith(prefix):
            items = await self._learn(listing.items, listing.revision)
        else:
            items = self._all(listing.items)
        return Listing(self._out(listing.revision), items)

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        await self._ready()
        listing = await self.inner.scan(start, end, limit=limit)
        items = self._all(kv for kv in listing.items if kv.key != BASE_KEY)
        return Listing(self._out(listing.revision), items)

    async def count(self, start: str, end: str) -> int:
        counted = await self.inner.count(start, end)
        if start <= BASE_KEY < end and await self.inner.get(BASE_KEY) is not None:
            counted -= 1  # hidden, as from listings
        return counted

    async def delete_range(self, start: str, end: str) -> int:
        await self._ready()
        if start <= BASE_KEY < end:
            raise ValueError(f"a range holding {BASE_KEY} cannot be deleted")
        return await self.inner.delete_range(start, end)

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        lease: int = 0,
        if_absent: bool = False,
        if_mod_revision: int | None = None,
        fence: Fence | None = None,
    ) -> int:
        await self._ready()
        raw = await self.inner.put(
            key,
            value,
            lease=lease,
            if_absent=if_absent,
            if_mod_revision=None if if_mod_revision is None else self._in(if_mod_revision),
            fence=None if fence is None else Fence(fence.key, self._in(fence.mod_revision)),
        )
        return self._out(raw)

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        await self._ready()
        return await self.inner.delete(
            key, if_mod_revision=None if if_mod_revision is None else self._in(if_mod_revision)
        )

    async def commit(self, writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
        await self._ready()
        raw = await self.inner.commit(
            [
                Write(
                    w.key,
                    w.value,
                    None if w.if_mod_revision is None else self._in(w.if_mod_revision),
                )
                for w in writes
            ],
            [Fence(c.key, self._in(c.mod_revision)) for c in checks],
        )
        return self._out(raw)

    async def grant_lease(self, ttl: int) -> int:
        return await self.inner.grant_lease(ttl)

    async def refresh_lease(self, lease_id: int) -> int:
        return await self.inner.refresh_lease(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        await self.inner.revoke_lease(lease_id)

    async def compact(self, revision: int) -> None:
        """The inner store's compaction to the revision handed out as
        `revision`; one of no revision of the store's (below its base) is
        nothing to compact."""
        raw = self._in(revision)
        if raw > 0:
            await self.inner.compact(raw)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        """The inner watch's revisions with the base added. One lower than
        the last (the inner store yields etcd's revision once it went back)
        raises the base first, so that what the consumer reads next is
        numbered above everything handed out. Like the inner watch, it
        survives the store being away: a raise that fails is logged, and
        left to the next proxy that refuses a table as older than its own
        (RoutingService tells ensure_above of it)."""
        last = max(0, self._in(start_revision))
        revisions = self.inner.watch(prefix, last)
        try:
            async for raw in revisions:
                if raw < last:
                    try:
                        await self.ensure_above(self.highest)
                    except StoreError as exc:
                        log.warning("etcd's revision went back; not renumbered yet: %s", exc)
                last = raw
                yield self._out(raw)
        finally:
            aclose = getattr(revisions, "aclose", None)
            if aclose is not None:
                await aclose()

    async def close(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
        await self.inner.close()


def _decode(kv: KeyValue | None) -> int:
    """The base a BASE_KEY value holds (0: none, or not a number, logged)."""
    if kv is None:
        return 0
    try:
        base = int(kv.value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        log.error("ignoring %s: %r is not a number", BASE_KEY, kv.value[:40])
        return 0
    return max(0, base)
