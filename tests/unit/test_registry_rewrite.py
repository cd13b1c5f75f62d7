"""A replica's keys (its own and its proxies') are written again under its
live lease whoever granted it, retried until they are, and read back now and
then (trial: after an etcd stall the leader and its proxies were gone from
the fleet view, and from the rate-limit shares, until it restarted)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest

from controlplane.catalog import PROXIES, REPLICAS, Catalog
from controlplane.registry import ProxyRegistry, replica_silence
from controlplane.store import StoreUnavailable
from controlplane.store.memory import MemoryStore


class StallingStore(MemoryStore):
    """Its next `fail` writes of a replica's key time out."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = 0
        self.failed = asyncio.Event()

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        if self.fail and key.startswith(REPLICAS):
            self.fail -= 1
            self.failed.set()
            raise StoreUnavailable("etcdserver: request timed out")
        return await super().put(key, value, **kwargs)


async def under_lease(store: MemoryStore, registry: ProxyRegistry, names: list[str]) -> bool:
    """Whether the replica's key and proxies `names`' are all under its live lease."""
    lease = registry._lease
    if not lease:
        return False
    keys = [REPLICAS + registry.replica_id] + [PROXIES + n for n in names]
    found = [await store.get(k) for k in keys]
    return all(kv is not None and kv.lease == lease for kv in found)


async def fleet_of(store: StallingStore) -> tuple[ProxyRegistry, list[str]]:
    registry = ProxyRegistry(Catalog(store), "cp1", lease_ttl=1)
    await registry.announce("127.0.0.1:7000")
    for name in ("eu-1", "eu-2"):
        record = await registry.register(name, "eu-west", f"127.0.0.1:{len(name)}", "1")
        registry.streaming(record.session_id)
    return registry, ["eu-1", "eu-2"]


async def test_a_rewrite_that_times_out_is_made_again_under_the_lease_a_flush_took(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "controlplane.registry")
    store = StallingStore()
    registry, names = await fleet_of(store)
    await store.revoke_lease(registry._lease)  # the stall outlived the lease
    store.fail = 3
    keeping = asyncio.create_task(registry.keepalive())
    try:
        async with asyncio.timeout(10):
            registry._lease_suspect.set()
            await store.failed.wait()
            # The ACK flush asks for the lease between two beats.
            await registry.flush(0.0)
            while not await under_lease(store, registry, names):
                await asyncio.sleep(0.02)
    finally:
        keeping.cancel()
    assert await store.refresh_lease(registry._lease)  # alive
    replicas, _ = await registry._catalog.list_replicas()
    assert [r["id"] for r in replicas] == ["cp1"]
    assert sorted(await registry._catalog.proxy_names()) == names
    failures = [r for r in caplog.records if "re-registration failed" in r.getMessage()]
    # Said once at WARNING, then at DEBUG; the keepalive's heartbeat, written
    # during a failed rewrite's back-off, may take one of the three failures.
    levels = [r.levelname for r in failures]
    assert levels[0] == "WARNING"
    assert set(levels[1:]) <= {"DEBUG"}
    assert all(r.exc_info is None for r in failures)
    assert "timed out" in failures[0].getMessage()
    back = [r.getMessage() for r in caplog.records if "registered again under" in r.getMessage()]
    assert back == [
        f"replica cp1 and its 2 proxies registered again under lease {registry._lease:x}"
    ]


async def test_a_key_gone_from_under_a_live_lease_is_found_and_written_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = StallingStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp1", lease_ttl=1, self_check_every=0.0)
    await registry.announce("127.0.0.1:7000")
    record = await registry.register("eu-1", "eu-west", "127.0.0.1:1", "1")
    registry.streaming(record.session_id)
    assert await registry.self_check()
    assert not registry._rewrite_due  # all there: nothing to write
    await store.delete(PROXIES + "eu-1")
    await store.delete(REPLICAS + "cp1")
    keeping = asyncio.create_task(registry.keepalive())
    try:
        async with asyncio.timeout(10):
            while not await under_lease(store, registry, ["eu-1"]):
                await asyncio.sleep(0.02)
    finally:
        keeping.cancel()
    # The replica's key comes back with its next beat; the proxy's is found
    # missing by the self-check.
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == [
        f"proxy eu-1 not in the state store under this replica's lease "
        f"{registry._lease:x}; writing them again"
    ]


async def test_a_proxy_of_another_session_is_left_to_that_one() -> None:
    store = StallingStore()
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp1", lease_ttl=1)
    there = ProxyRegistry(catalog, "cp2", lease_ttl=1)
    mine = await here.register("eu-1", "eu-west", "127.0.0.1:1", "1")
    here.streaming(mine.session_id)
    await there.register("eu-1", "eu-west", "127.0.0.1:1", "1")  # it moved
    assert await here.self_check()
    assert not here._rewrite_due


async def test_the_replica_key_says_when_it_was_renewed() -> None:
    now = [1000.0]
    store = MemoryStore()
    registry = ProxyRegistry(Catalog(store), "cp1", lease_ttl=9, clock=lambda: now[0])
    await registry.announce("127.0.0.1:7000")
    kv = await store.get(REPLICAS + "cp1")
    assert kv is not None
    value = orjson.loads(kv.value)
    assert (value["renewed_at"], value["renew_every"], value["lease_ttl"]) == (1000.0, 3.0, 9)
    assert replica_silence(value, 7.4) is None  # two beats and half of one
    assert replica_silence(value, 7.6) == pytest.approx(7.6)
    assert replica_silence({"id": "cp0"}, 5000.0) is None  # a replica from before


async def test_keys_are_read_back_at_once_when_the_store_went_back() -> None:
    """etcd restored from a snapshot that holds the replica's lease but not
    a proxy registered since: nothing else tells (docs/operations.md); a
    change of the store's numbering (RebasedStore.base) has the replica read
    its keys back at once rather than at its next self-check."""
    epoch = [0]
    store = StallingStore()
    registry = ProxyRegistry(
        Catalog(store), "cp1", lease_ttl=1, self_check_every=3600.0, store_epoch=lambda: epoch[0]
    )
    await registry.announce("127.0.0.1:7000")
    record = await registry.register("eu-1", "eu-west", "127.0.0.1:1", "1")
    registry.streaming(record.session_id)
    keeping = asyncio.create_task(registry.keepalive())
    await asyncio.sleep(0)  # it runs, and reads the store's numbering
    try:
        await store.delete(PROXIES + "eu-1")  # not in the snapshot
        epoch[0] = 1013  # the store's numbering raised; no self-check due
        async with asyncio.timeout(10):
            while not await under_lease(store, registry, ["eu-1"]):
                await asyncio.sleep(0.02)
    finally:
        keeping.cancel()


async def test_a_first_announcement_made_by_the_keepalive_is_said_as_such(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "controlplane.registry")
    store = StallingStore()
    store.fail = 1  # etcd not ready as the replica starts
    registry = ProxyRegistry(Catalog(store), "cp1", lease_ttl=1)
    await registry.announce("127.0.0.1:7000")
    await registry._rewrite()
    said = [r.getMessage() for r in caplog.records if "cp1" in r.getMessage()]
    assert said[-1] == f"replica cp1 announced under lease {registry._lease:x}"
