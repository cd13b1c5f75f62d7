"""Proxies connected to this replica, kept in the store under the replica's lease.

One lease per replica, not per proxy: a proxy's key is deleted when its stream
ends, and if the replica itself dies its lease expires and every key it wrote
goes with it. The proxies then reconnect to another replica and re-register.
If the lease is lost (etcd was away longer than the TTL) a new one is granted
and every live registration is written again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import replace

from controlplane.catalog import Catalog
from controlplane.errors import Unavailable
from controlplane.model import ProxyRecord
from controlplane.store import LeaseExpired, StoreUnavailable

log = logging.getLogger(__name__)


class ProxyRegistry:
    def __init__(self, catalog: Catalog, replica_id: str, *, lease_ttl: int = 10) -> None:
        self._catalog = catalog
        self.replica_id = replica_id
        self._ttl = lease_ttl
        self._lease = 0
        self._lease_lock = asyncio.Lock()
        self.sessions: dict[str, ProxyRecord] = {}

    async def _ensure_lease(self) -> int:
        async with self._lease_lock:
            if not self._lease:
                try:
                    self._lease = await self._catalog.store.grant_lease(self._ttl)
                except StoreUnavailable as exc:
                    raise Unavailable(f"state store unavailable: {exc}") from exc
                log.info("replica lease %x granted (ttl %ds)", self._lease, self._ttl)
            return self._lease

    async def register(self, name: str, region: str, address: str, version: str) -> ProxyRecord:
        lease = await self._ensure_lease()
        record = ProxyRecord(
            name=name,
            region=region,
            address=address,
            version=version,
            session_id=uuid.uuid4().hex,
            control_plane_id=self.replica_id,
            connected_at=time.time(),
        )
        await self._catalog.put_proxy(record, lease)
        # A re-registration of the same name supersedes older sessions here.
        for sid, old in list(self.sessions.items()):
            if old.name == name:
                del self.sessions[sid]
        self.sessions[record.session_id] = record
        return record

    async def acked(self, session_id: str, version: int, error: str) -> None:
        """Record an ACK (error empty) or a NACK; the store write is best effort."""
        record = self.sessions.get(session_id)
        if record is None:
            return
        if error:
            record = replace(record, last_error=error)
        else:
            record = replace(record, acked_version=version, last_error="")
        self.sessions[session_id] = record
        try:
            await self._catalog.put_proxy(record, await self._ensure_lease())
        except (Unavailable, LeaseExpired) as exc:
            log.warning("could not record ack of %s: %s", record.name, exc)

    async def unregister(self, session_id: str) -> None:
        record = self.sessions.pop(session_id, None)
        if record is None:
            return
        try:
            await self._catalog.remove_proxy(record.name, session_id)
        except Unavailable as exc:
            log.warning(
                "could not remove %s (its key expires with the lease): %s", record.name, exc
            )

    async def keepalive(self) -> None:
        """Refresh the lease until cancelled; re-grant and rewrite records if it was lost."""
        while True:
            await asyncio.sleep(max(self._ttl / 3, 0.2))
            if not self._lease:
                if self.sessions:
                    await self._rewrite()
                continue
            try:
                await self._catalog.store.refresh_lease(self._lease)
            except LeaseExpired:
                log.warning(
                    "replica lease %x expired; re-registering %d proxies",
                    self._lease,
                    len(self.sessions),
                )
                self._lease = 0
                await self._rewrite()
            except StoreUnavailable as exc:
                log.warning("lease keepalive failed: %s", exc)

    async def _rewrite(self) -> None:
        try:
            lease = await self._ensure_lease()
            for record in list(self.sessions.values()):
                await self._catalog.put_proxy(record, lease)
        except (Unavailable, LeaseExpired) as exc:
            log.warning("re-registration failed, will retry: %s", exc)
            self._lease = 0

    async def close(self) -> None:
        if self._lease:
            with contextlib.suppress(StoreUnavailable):
                await self._catalog.store.revoke_lease(self._lease)
            self._lease = 0
