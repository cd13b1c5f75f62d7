"""A StateStore that times every call of the store it wraps.

ControlPlane wraps its store once, so every etcd call of the replica (catalog,
election, registry, probes, quotas) is measured without timing call sites.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from controlplane.metrics import ControlMetrics
from controlplane.store.base import (
    Fence,
    KeyValue,
    Listing,
    StateStore,
    StoreError,
    StoreUnavailable,
    Write,
)

T = TypeVar("T")


class InstrumentedStore:
    """Forwards to `store`, recording each call's duration and failures.

    A call that raises StoreUnavailable is a failure (etcd gave no answer);
    Conflict and LeaseExpired are answers, timed but not failures. A call
    cancelled by its caller is not recorded. The watch is not timed (it lives
    as long as its consumer); an exception out of it is counted as a failure
    of op "watch".
    """

    def __init__(self, store: StateStore, metrics: ControlMetrics) -> None:
        self.inner = store
        self._metrics = metrics

    async def _timed(self, op: str, call: Awaitable[T]) -> T:
        clock = self._metrics.clock
        started = clock()
        try:
            result = await call
        except StoreError as exc:
            failed = isinstance(exc, StoreUnavailable)
            self._metrics.etcd_call(op, clock() - started, failed=failed)
            raise
        self._metrics.etcd_call(op, clock() - started, failed=False)
        return result

    async def get(self, key: str) -> KeyValue | None:
        return await self._timed("get", self.inner.get(key))

    async def list(self, prefix: str) -> Listing:
        return await self._timed("list", self.inner.list(prefix))

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        return await self._timed("scan", self.inner.scan(start, end, limit=limit))

    async def count(self, start: str, end: str) -> int:
        return await self._timed("count", self.inner.count(start, end))

    async def delete_range(self, start: str, end: str) -> int:
        return await self._timed("delete_range", self.inner.delete_range(start, end))

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
        return await self._timed(
            "put",
            self.inner.put(
                key,
                value,
                lease=lease,
                if_absent=if_absent,
                if_mod_revision=if_mod_revision,
                fence=fence,
            ),
        )

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        return await self._timed("delete", self.inner.delete(key, if_mod_revision=if_mod_revision))

    async def commit(self, writes: Sequence[Write], checks: Sequence[Fence] = ()) -> int:
        return await self._timed("commit", self.inner.commit(writes, checks))

    async def grant_lease(self, ttl: int) -> int:
        return await self._timed("grant_lease", self.inner.grant_lease(ttl))

    async def refresh_lease(self, lease_id: int) -> int:
        return await self._timed("refresh_lease", self.inner.refresh_lease(lease_id))

    async def revoke_lease(self, lease_id: int) -> None:
        await self._timed("revoke_lease", self.inner.revoke_lease(lease_id))

    async def compact(self, revision: int) -> None:
        await self._timed("compact", self.inner.compact(revision))

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        revisions = self.inner.watch(prefix, start_revision)
        try:
            async for revision in revisions:
                yield revision
        except Exception:
            self._metrics.etcd_error("watch")
            raise
        finally:
            # A consumer that stops iterating closes this generator, not the
            # inner one: close it here rather than leave it to the collector.
            aclose = getattr(revisions, "aclose", None)
            if aclose is not None:
                await aclose()

    async def close(self) -> None:
        await self.inner.close()
