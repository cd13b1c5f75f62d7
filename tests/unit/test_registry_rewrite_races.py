"""The keepalive and the rewrite it runs as a task of its own, racing with
each other and with the flushes, Registers and reads that share the lease
(a review of 079cdd4: a lease granted by a flush was thrown away by the
keepalive, and a key found missing during a rewrite forgotten)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from controlplane.catalog import PROXIES, REPLICAS, Catalog
from controlplane.registry import ProxyRegistry
from controlplane.store.memory import MemoryStore


class GatedStore(MemoryStore):
    """Proxy writes, and lease refreshes, wait at a gate while held; counts grants."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_puts = self.hold_refresh = False
        self.put_gate, self.refresh_gate = asyncio.Event(), asyncio.Event()
        self.put_entered, self.refresh_entered = asyncio.Event(), asyncio.Event()
        self.refreshed = asyncio.Event()
        self.grants = 0

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        if self.hold_puts and key.startswith(PROXIES):
            self.put_entered.set()
            await self.put_gate.wait()
        return await super().put(key, value, **kwargs)

    async def refresh_lease(self, lease_id: int) -> int:
        if self.hold_refresh:
            self.refresh_entered.set()
            await self.refresh_gate.wait()
        try:
            return await super().refresh_lease(lease_id)
        finally:
            self.refreshed.set()

    async def grant_lease(self, ttl: int) -> int:
        self.grants += 1
        return await super().grant_lease(ttl)


async def fleet_of(store: GatedStore, names: list[str]) -> tuple[ProxyRegistry, list[str]]:
    registry = ProxyRegistry(Catalog(store), "cp1", lease_ttl=3, self_check_every=3600.0)
    await registry.announce("127.0.0.1:7000")
    sessions = []
    for i, name in enumerate(names):
        record = await registry.register(name, "eu-west", f"10.0.0.1:{i + 1}", "1")
        registry.streaming(record.session_id)
        sessions.append(record.session_id)
    return registry, sessions


async def under(store: MemoryStore, lease: int, names: list[str]) -> bool:
    """Whether the replica's key and proxies `names`' are all under `lease`."""
    keys = [REPLICAS + "cp1"] + [PROXIES + n for n in names]
    found = [await MemoryStore.get(store, k) for k in keys]
    return all(kv is not None and kv.lease == lease for kv in found)


async def test_a_lease_granted_during_the_refresh_of_a_lost_one_is_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "controlplane.registry")
    store = GatedStore()
    registry, sessions = await fleet_of(store, ["p1"])
    first = registry._lease
    registry._write_missing({sessions[0]: "p1"}, first)  # a self-check's finding
    store.hold_puts = True
    keeping = asyncio.create_task(registry.keepalive())
    try:
        async with asyncio.timeout(10):
            await store.put_entered.wait()  # the rewrite task writes p1 under L1
            await MemoryStore.revoke_lease(store, first)  # L1 lost (etcd stalled)
            store.hold_refresh = True
            registry._lease_suspect.set()
            await store.refresh_entered.wait()  # the keepalive's refresh of L1
            store.put_gate.set()  # the rewrite: LeaseExpired, drops L1
            while registry._lease:
                await asyncio.sleep(0)
            second = await registry.lease()  # an ACK flush, a Register
            store.refreshed.clear()
            store.hold_refresh = False
            store.refresh_gate.set()  # the keepalive: LeaseExpired, of L1
            await store.refreshed.wait()
            assert registry._lease == second
            while registry._rewrite_due:
                await asyncio.sleep(0)
            assert registry._lease == second
            assert await under(store, second, ["p1"])
    finally:
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
    assert store.grants == 2  # the first, and the flush's
    said = [r.getMessage() for r in caplog.records if "expired" in r.getMessage()]
    assert said == [f"replica lease {first:x} expired, dropped already"]
