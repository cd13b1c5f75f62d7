"""The state store protocol: the only way the control plane touches etcd.

Two implementations keep one contract (tests/contract runs the same suite on
both): `EtcdStore` for production and `MemoryStore` for unit tests. Keys are
strings under a prefix; values are opaque bytes (the catalog encodes JSON).
Every mutation returns the store revision it produced, and revisions increase
strictly across the whole store, as in etcd.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class StoreError(Exception):
    """Base class of store failures."""


class StoreUnavailable(StoreError):
    """The store cannot be reached now; the caller may retry later."""


class OutcomeUnknown(StoreUnavailable):
    """A write was sent, but its answer did not come in time (or its
    connection broke before it came): it may have been applied, or may yet
    be (a member stalled with the request in its socket applies it when it
    runs again). Not to be reported as refused, nor sent again blindly: read
    the key first. A StoreUnavailable, so that loops which retry on their
    next round (and re-read first) treat it as a failure too."""


class Conflict(StoreError):
    """A conditional write found the key in another state than required."""


class LeaseExpired(StoreError):
    """The lease no longer exists; keys attached to it are gone."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    lease: int = 0
    # The revision the key was created at: the same across its updates, a
    # new one once it was deleted and put again (0: not known).
    create_revision: int = 0


@dataclass(frozen=True, slots=True)
class Fence:
    """A write condition on another key: it must be at mod_revision."""

    key: str
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Write:
    """One operation of a transaction: put value at key, or delete key (value None).

    if_mod_revision: the key's mod_revision must equal it (0: absent); None: no condition.
    """

    key: str
    value: bytes | None
    if_mod_revision: int | None = None


# etcd refuses a transaction of more operations, or of more conditions, than
# its --max-txn-ops (128 by default).
MAX_TXN_OPS = 128
# etcd refuses a request larger than its --max-request-bytes (1.5 MiB by
# default) as "request is too large", which reaches callers as
# StoreUnavailable; MemoryStore refuses the same.
MAX_REQUEST_BYTES = 1536 * 1024


def request_bytes(writes: Sequence[Write]) -> int:
    """About what a transaction of `writes` weighs against --max-request-bytes
    (its keys and values; etcd's framing adds tens of bytes a write)."""
    return sum(len(w.key) + len(w.value or b"") + 16 for w in writes)


def txn_size(writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
    """What etcd holds against --max-txn-ops: the writes, or the conditions
    (one per write with if_mod_revision, one per check) if there are more."""
    conditions = len(checks) + sum(w.if_mod_revision is not None for w in writes)
    return max(len(writes), conditions)


@dataclass(frozen=True, slots=True)
class Listing:
    """All keys under a prefix as of one store revision (a consistent read)."""

    revision: int
    items: tuple[KeyValue, ...]


class StateStore(Protocol):
    """Key-value state with revisions, conditional writes, leases and watches.

    Implementations must be safe to call from many tasks on one event loop.
    Every method may raise StoreUnavailable; a write (put, delete,
    delete_range, commit) raises OutcomeUnknown, a StoreUnavailable, when it
    may have been applied all the same.
    """

    async def get(self, key: str) -> KeyValue | None: ...

    async def list(self, prefix: str) -> Listing:
        """Keys under prefix, sorted by key, read at one revision."""
        ...

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        """The first limit (0: all) keys in [start, end) at one revision, sorted by
        key; the store reads no more of the range than it returns."""
        ...

    async def count(self, start: str, end: str) -> int:
        """How many keys are in [start, end), without reading their values."""
        ...

    async def delete_range(self, start: str, end: str) -> int:
        """Delete every key in [start, end) at one revision; return how many there were."""
        ...

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
        """Write key; with a condition, raise Conflict when it does not hold.

        if_absent: the key must not exist. if_mod_revision: the key's current
        mod_revision must equal it (0 means absent). fence: another key (the
        leader key) must still be at the given mod_revision, so a replica that
        lost leadership cannot write. Returns the new revision.
        """
        ...

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        """Delete key; return whether it existed. Conditional like put."""
        ...

    async def commit(self, writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
        """Apply all writes at one new revision, or none of them.

        Raise Conflict, writing nothing, when a write's if_mod_revision or a
        check (a key that must still be at mod_revision, 0: absent) does not
        hold. Keys must be distinct; txn_size at most MAX_TXN_OPS. Returns the
        revision (the current one when writes is empty).
        """
        ...

    async def grant_lease(self, ttl: int) -> int:
        """Create a lease of ttl seconds; keys put with it vanish when it expires."""
        ...

    async def refresh_lease(self, lease_id: int) -> int:
        """Renew the lease; return its TTL; raise LeaseExpired if it is gone."""
        ...

    async def revoke_lease(self, lease_id: int) -> None: ...

    async def compact(self, revision: int) -> None:
        """Drop the store's history up to `revision` (etcd's compaction),
        which a revision handed out by this store names: a watch from before
        it is told so and its consumer re-lists. One at or below what is
        compacted already is no error."""
        ...

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        """Yield a store revision each time keys under prefix change.

        Starts after start_revision (0: from now on). It yields revisions, not events: callers
        re-list, which also covers history lost to compaction. The iterator
        survives store restarts (it waits and resumes); it ends only when the
        consumer stops iterating.
        """
        ...

    async def close(self) -> None: ...


# A first read that failed is made again this often before the key is
# watched (follow).
UNREAD_RETRY_S = 0.5


async def follow(store: StateStore, key: str, load: Callable[[], Awaitable[int]]) -> None:
    """Run `load` (which reads `key` and returns the store revision it read
    at, 0 when it could not read) until it reads, then again at each change
    of the key, until cancelled. The watch starts at the revision read: one
    "from now", made after a read that failed (the store away), would miss
    what was written before it was made (a replica started with its etcd)."""
    revision = await load()
    while not revision:
        await asyncio.sleep(UNREAD_RETRY_S)
        revision = await load()
    async for _ in store.watch(key, revision):
        await load()
