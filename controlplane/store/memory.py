"""In-memory StateStore for unit tests; keeps the same contract as EtcdStore.

Leases expire against an injected clock, checked on every call, so tests can
move time without sleeping.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from controlplane.store.base import (
    MAX_REQUEST_BYTES,
    MAX_TXN_OPS,
    Conflict,
    Fence,
    KeyValue,
    LeaseExpired,
    Listing,
    StoreUnavailable,
    Write,
    request_bytes,
    txn_size,
)


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    data: dict[str, KeyValue]
    keys: list[str]
    revision: int
    history: list[tuple[int, str]]


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._data: dict[str, KeyValue] = {}
        self._keys: list[str] = []  # sorted, for prefix listing
        self._revision = 1
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, deadline)
        self._lease_ids = itertools.count(0x1000)
        self._changed = asyncio.Event()
        # (revision, key) of each change, for watchers that fall behind.
        self._history: list[tuple[int, str]] = []
        self._compacted = 0  # history up to here is gone (compact)
        # Each key's last change dropped by a compaction: a watch that had
        # not read it yet still learns of it.
        self._dropped: dict[str, int] = {}
        self.available = True  # tests flip this to simulate an outage

    def _check(self) -> None:
        if not self.available:
            raise StoreUnavailable("memory store marked unavailable")
        now = self._clock()
        expired = [lid for lid, (_, deadline) in self._leases.items() if deadline <= now]
        for lid in expired:
            self._drop_lease(lid)

    def _drop_lease(self, lease_id: int) -> None:
        del self._leases[lease_id]
        doomed = [k for k, kv in self._data.items() if kv.lease == lease_id]
        if doomed:
            self._revision += 1
            for key in doomed:
                self._remove(key)
            self._notify()

    def _remove(self, key: str) -> None:
        del self._data[key]
        self._keys.pop(bisect.bisect_left(self._keys, key))
        self._history.append((self._revision, key))

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def get(self, key: str) -> KeyValue | None:
        self._check()
        return self._data.get(key)

    async def list(self, prefix: str) -> Listing:
        self._check()
        start = bisect.bisect_left(self._keys, prefix)
        items = []
        for key in itertools.islice(self._keys, start, None):
            if not key.startswith(prefix):
                break
            items.append(self._data[key])
        return Listing(self._revision, tuple(items))

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        self._check()
        keys = self._keys[
            bisect.bisect_left(self._keys, start) : bisect.bisect_left(self._keys, end)
        ]
        if limit:
            keys = keys[:limit]
        return Listing(self._revision, tuple(self._data[k] for k in keys))

    async def count(self, start: str, end: str) -> int:
        return len((await self.scan(start, end)).items)

    async def delete_range(self, start: str, end: str) -> int:
        self._check()
        doomed = self._keys[
            bisect.bisect_left(self._keys, start) : bisect.bisect_left(self._keys, end)
        ]
        if doomed:
            self._revision += 1
            for key in doomed:
                self._remove(key)
            self._notify()
        return len(doomed)

    def _condition(self, key: str, if_absent: bool, if_mod_revision: int | None) -> None:
        current = self._data.get(key)
        if if_absent and current is not None:
            raise Conflict(f"{key} exists")
        if if_mod_revision is not None:
            have = current.mod_revision if current else 0
            if have != if_mod_revision:
                raise Conflict(f"{key} is at revision {have}, not {if_mod_revision}")

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
        self._check()
        _fits([Write(key, value)])
        self._condition(key, if_absent, if_mod_revision)
        if fence is not None:
            self._condition(fence.key, False, fence.mod_revision)
        if lease and lease not in self._leases:
            raise LeaseExpired(f"lease {lease:x} not found")
        self._revision += 1
        if key not in self._data:
            bisect.insort(self._keys, key)
        self._data[key] = KeyValue(key, value, self._revision, lease, self._created(key))
        self._history.append((self._revision, key))
        self._notify()
        return self._revision

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        self._check()
        self._condition(key, False, if_mod_revision)
        if key not in self._data:
            return False
        self._revision += 1
        self._remove(key)
        self._notify()
        return True

    async def commit(self, writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
        self._check()
        if len({w.key for w in writes}) != len(writes):
            raise ValueError("a transaction names a key twice")
        if txn_size(writes, checks) > MAX_TXN_OPS:
            raise ValueError(f"a transaction has more than {MAX_TXN_OPS} writes or conditions")
        _fits(writes)
        for w in writes:
            self._condition(w.key, False, w.if_mod_revision)
        for c in checks:
            self._condition(c.key, False, c.mod_revision)
        if not writes:
            return self._revision
        self._revision += 1
        for w in writes:
            if w.value is None:
                if w.key in self._data:
                    self._remove(w.key)
                continue
            if w.key not in self._data:
                bisect.insort(self._keys, w.key)
            self._data[w.key] = KeyValue(w.key, w.value, self._revision, 0, self._created(w.key))
            self._history.append((self._revision, w.key))
        self._notify()
        return self._revision

    def _created(self, key: str) -> int:
        """The create revision of key written at the current revision."""
        held = self._data.get(key)
        return held.create_revision if held is not None else self._revision

    async def grant_lease(self, ttl: int) -> int:
        self._check()
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = (ttl, self._clock() + ttl)
        return lease_id

    async def refresh_lease(self, lease_id: int) -> int:
        self._check()
        if lease_id not in self._leases:
            raise LeaseExpired(f"lease {lease_id:x} not found")
        ttl, _ = self._leases[lease_id]
        self._leases[lease_id] = (ttl, self._clock() + ttl)
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        self._check()
        if lease_id in self._leases:
            self._drop_lease(lease_id)

    def snapshot(self) -> MemorySnapshot:
        """The keys and revision now, for restore() (a backup, as etcdctl's)."""
        return MemorySnapshot(
            dict(self._data), list(self._keys), self._revision, list(self._history)
        )

    def restore(self, snapshot: MemorySnapshot) -> None:
        """Go back to `snapshot`, as etcd restored from a backup does: keys and
        revision as they were then (leases are kept). Each watch yields the
        revision, now lower than what it saw, as EtcdStore's do."""
        self._data = dict(snapshot.data)
        self._keys = list(snapshot.keys)
        self._revision = snapshot.revision
        self._history = list(snapshot.history)
        self._compacted = 0  # the restored store's history is the snapshot's
        self._dropped = {}
        self._notify()

    async def compact(self, revision: int) -> None:
        self._check()
        if revision > self._revision:
            raise StoreUnavailable(f"revision {revision} is a future revision")
        self._compacted = max(self._compacted, revision)
        kept = []
        for r, k in self._history:
            if r > self._compacted:
                kept.append((r, k))
            else:
                self._dropped[k] = max(r, self._dropped.get(k, 0))
        self._history = kept

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        # 0 means from now on, as in etcd.
        seen = start_revision or self._revision
        if seen < self._compacted:
            # From a revision compacted away: told so at once, as etcd's
            # compact_revision does, and watched from now.
            seen = self._revision
            yield seen
        while True:
            # Restored (the revision went back): said once, then watched from
            # there. A change under the prefix since `seen` is in the history,
            # or compacted out of it before this watch read it (_dropped).
            went_back = self._revision < seen
            history = reversed(self._history)
            if (
                went_back
                or any(r > seen and k.startswith(prefix) for r, k in history)
                or any(r > seen and k.startswith(prefix) for k, r in self._dropped.items())
            ):
                seen = self._revision
                yield seen
            else:
                # Nothing under the prefix up to now: up to date, as a
                # running etcd watch is, whatever is compacted after this.
                seen = self._revision
                await self._changed.wait()

    async def close(self) -> None:
        return None


def _fits(writes: Sequence[Write]) -> None:
    """Refuse what etcd refuses at its default --max-request-bytes."""
    if request_bytes(writes) > MAX_REQUEST_BYTES:
        raise StoreUnavailable("request is too large")
