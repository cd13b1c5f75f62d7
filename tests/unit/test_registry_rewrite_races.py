"""The keepalive and the rewrite it runs as a task of its own, racing with
each other and with the flushes, Registers and reads that share the lease
(a review of 079cdd4: a lease granted by a flush was thrown away by the
keepalive, and a key found missing during a rewrite forgotten)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import controlplane.registry as registry_module
from controlplane.catalog import PROXIES, REPLICAS, Catalog
from controlplane.registry import REWRITE_CONCURRENCY, ProxyRegistry
from controlplane.store import StoreUnavailable
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


async def fleet_of(store: MemoryStore, names: list[str]) -> tuple[ProxyRegistry, list[str]]:
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


async def test_a_key_found_missing_while_a_rewrite_of_others_runs_is_written_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "controlplane.registry")
    store = GatedStore()
    registry, _ = await fleet_of(store, ["a", "b"])
    lease = registry._lease
    await MemoryStore.delete(store, PROXIES + "a")
    assert await registry.self_check()  # a found missing: its rewrite due
    store.hold_puts = True
    keeping = asyncio.create_task(registry.keepalive())
    try:
        async with asyncio.timeout(10):
            await store.put_entered.wait()  # the rewrite of a writes
            await MemoryStore.delete(store, PROXIES + "b")  # b lost meanwhile
            assert await registry.drop_superseded()  # b found missing; a is being written
            store.hold_puts = False
            store.put_gate.set()
            while registry._rewrite_due:
                await asyncio.sleep(0.01)
            assert await under(store, lease, ["a", "b"])
    finally:
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [
        f"proxy {name} not in the state store under this replica's lease {lease:x}; "
        "writing them again"
        for name in ("a", "b")
    ]


class LosingStore(MemoryStore):
    """Drops the lease at the first proxy write (`lose`); notes the proxy
    keys written, each write letting the others run."""

    def __init__(self) -> None:
        super().__init__()
        self.lose = False
        self.proxies_written: set[str] = set()

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        if key.startswith(PROXIES):
            self.proxies_written.add(key)
            if self.lose:
                self.lose = False
                await self.revoke_lease(kwargs["lease"])
            await asyncio.sleep(0)  # as a write over the network would
        return await super().put(key, value, **kwargs)


async def test_a_rewrite_that_finds_the_lease_lost_starts_no_more_writes() -> None:
    store = LosingStore()
    names = [f"p-{i:02d}" for i in range(3 * REWRITE_CONCURRENCY)]
    registry, _ = await fleet_of(store, names)
    store.proxies_written.clear()
    registry._rewrite_due = True  # every key (a lease granted after the first)
    store.lose = True
    await registry._rewrite()
    assert registry._lease == 0
    assert registry._rewrite_due and registry._rewrite_only is None
    # The writes under way when the lease went; none queued after them.
    assert len(store.proxies_written) <= REWRITE_CONCURRENCY


async def test_a_failed_rewrite_is_tried_again_after_its_back_off_not_a_beat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry_module, "REWRITE_RETRY_MIN", 0.01)
    store = FailingStore()
    registry = ProxyRegistry(Catalog(store), "cp1", lease_ttl=60)  # a beat of 20 s
    await registry.announce("127.0.0.1:7000")
    record = await registry.register("p1", "eu-west", "10.0.0.1:1", "1")
    registry.streaming(record.session_id)
    first = registry._lease
    await MemoryStore.revoke_lease(store, first)
    store.fail = 3
    keeping = asyncio.create_task(registry.keepalive())
    try:
        # Tried again after 0.01, 0.02 and 0.04 s; the keepalive's next beat
        # would be 20 s away (it was then that a failed rewrite was retried).
        async with asyncio.timeout(10):
            registry._lease_suspect.set()
            while registry._lease in (0, first) or registry._rewrite_due:
                await asyncio.sleep(0.01)
    finally:
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
    assert store.fail == 0
    assert await under(store, registry._lease, ["p1"])


class FailingStore(GatedStore):
    """Its next `fail` writes of a replica's key time out."""

    fail = 0

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        if self.fail and key.startswith(REPLICAS):
            self.fail -= 1
            raise StoreUnavailable("etcdserver: request timed out")
        return await super().put(key, value, **kwargs)


async def test_a_rewrite_of_the_replica_key_alone_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "controlplane.registry")
    store = GatedStore()
    registry, _ = await fleet_of(store, ["p1"])
    lease = registry._lease
    await MemoryStore.delete(store, REPLICAS + "cp1")
    assert await registry.self_check()
    assert registry._rewrite_only == set()
    await registry._rewrite()
    assert await under(store, lease, ["p1"])
    said = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert said[-1] == f"replica cp1 wrote its key again under lease {lease:x}"
