"""A registration restored from an etcd snapshot for a proxy gone since is
removed by the replica whose lease holds it (trial 73: the key sat under the
lease of a replica still alive, so it never expired; the proxy was listed for
good and counted in every proxy's fleet size, so in its share of each global
limit). Only keys under the replica's own lease, and only those that hold no
session of it: not a Register's under way, not another replica's.

The registry over the in-memory store, restored as etcdutl restores etcd
(MemoryStore.restore), behind RebasedStore as every replica's store is."""

from __future__ import annotations

import asyncio
import logging

import pytest

from controlplane.catalog import PROXIES, Catalog
from controlplane.registry import ProxyRegistry
from controlplane.store.memory import MemorySnapshot, MemoryStore
from controlplane.store.rebased import RebasedStore
from tests.unit.test_registration_deadline import SlowStore, fleet

STARTED = 100.5
GHOST = "with no session here"


def ghost_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if GHOST in r.getMessage()]


async def streamed(registry: ProxyRegistry, name: str, started_at: float = STARTED) -> str:
    """Register proxy `name` and open its route stream; its session id."""
    record = await registry.register(name, "eu", "127.0.0.1:1", "1", started_at=started_at)
    assert registry.streaming(record.session_id)
    return record.session_id


async def restored(memory: MemoryStore, store: RebasedStore, backup: MemorySnapshot) -> None:
    """etcd restored from `backup`, and a replica's watch having noticed."""
    memory.restore(backup)
    await store.ensure_above(store.highest)


async def test_a_registration_restored_for_a_proxy_gone_since_is_removed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = MemoryStore()
    store = RebasedStore(memory)
    catalog = Catalog(store)
    here = ProxyRegistry(catalog, "cp1", stream_grace=10.0)
    there = ProxyRegistry(catalog, "cp2", stream_grace=10.0)
    await here.announce("127.0.0.1:7000")
    gone = await streamed(here, "p-x")
    await streamed(here, "p-kept")
    elsewhere = await streamed(there, "p-there")
    backup = memory.snapshot()
    # Both proxies' streams end after the snapshot: their keys go.
    await here.unregister(gone)
    await there.unregister(elsewhere)
    assert await fleet(catalog) == ["p-kept"]
    await restored(memory, store, backup)
    assert await fleet(catalog) == ["p-kept", "p-there", "p-x"]
    # Each replica removes the ghost under its own lease, and only that.
    assert await here.self_check()
    assert await fleet(catalog) == ["p-kept", "p-there"]
    assert await there.self_check()
    assert await fleet(catalog) == ["p-kept"]
    assert not here._rewrite_due  # p-kept's key is its own, left as it was
    [said, _] = ghost_lines(caplog)
    assert said.startswith(f"proxy p-x was registered under this replica's lease {here._lease:x}")
    assert f"session {gone}" in said
    assert [r.levelname for r in caplog.records if GHOST in r.getMessage()] == ["WARNING"] * 2
    # Nothing more is said of it at the next read.
    assert await here.self_check()
    assert len(ghost_lines(caplog)) == 2


async def test_a_ghost_is_removed_by_the_watch_read_too() -> None:
    """A replica with proxies reads the registrations at each change it
    watches (drop_superseded): a restore is one, the ghost goes then."""
    memory = MemoryStore()
    store = RebasedStore(memory)
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp1", stream_grace=10.0)
    gone = await streamed(registry, "p-x")
    await streamed(registry, "p-kept")
    backup = memory.snapshot()
    await registry.unregister(gone)
    await restored(memory, store, backup)
    assert await registry.drop_superseded()
    assert await fleet(catalog) == ["p-kept"]


async def test_a_ghost_of_a_session_of_the_same_process_leaves_the_live_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxy registered again on the same replica after the snapshot (its
    link dropped and came back): the restored key holds its older session,
    of its own process. That is no registration made elsewhere: the live
    session stays, its key written back over the ghost."""
    memory = MemoryStore()
    store = RebasedStore(memory)
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp1", stream_grace=10.0)
    old = await streamed(registry, "p1")
    backup = memory.snapshot()
    await registry.unregister(old)
    live = await streamed(registry, "p1")
    await restored(memory, store, backup)
    assert await registry.drop_superseded()
    assert set(registry.sessions) == {live}
    assert not registry.ended(live).is_set()
    # Its key, now missing, is written again by the keepalive's rewrite.
    assert registry._rewrite_due
    assert await registry._rewrite()
    kv = await store.get(PROXIES + "p1")
    assert kv is not None and live.encode() in kv.value
    assert len(ghost_lines(caplog)) == 1


async def test_a_register_under_way_keeps_the_key_it_wrote() -> None:
    """A Register writes its key before its session is the replica's (then it
    reads whether its process deregistered meanwhile): a read of the
    registrations in between must not take the key for a ghost; nor a call
    cut after its write, which the stream grace removes. A ghost read at the
    same time goes."""
    store = SlowStore()
    store.release.set()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp1", stream_grace=10.0)
    gone = await streamed(registry, "p-x")
    backup = store.snapshot()
    await registry.unregister(gone)
    store.restore(backup)  # revisions went back; a name nobody holds here
    store.release.clear()
    call = asyncio.create_task(
        registry.register("p-new", "eu", "127.0.0.1:2", "1", started_at=STARTED)
    )
    while "p-new" not in await fleet(catalog):
        await asyncio.sleep(0)
    assert await registry.self_check()
    assert await fleet(catalog) == ["p-new"]
    store.release.set()
    record = await call
    assert registry.streaming(record.session_id)
    assert await registry.self_check()
    assert await fleet(catalog) == ["p-new"]


async def test_a_key_whose_removal_failed_goes_at_the_next_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream that ended while etcd did not answer left its key under the
    replica's lease, which lives as long as the replica: the next read of
    the registrations removes it."""
    store = MemoryStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp1", stream_grace=10.0)
    gone = await streamed(registry, "p-x")
    store.available = False
    with caplog.at_level(logging.WARNING, "controlplane.registry"):
        await registry.unregister(gone)
    store.available = True
    assert await fleet(catalog) == ["p-x"]
    assert await registry.self_check()
    assert await fleet(catalog) == []


class HeldDeleteStore(MemoryStore):
    """A store whose next delete waits for `release` once `hold` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    async def delete(self, key: str, *, if_mod_revision: int | None = None) -> bool:
        if self.hold:
            self.hold = False
            self.held.set()
            await self.release.wait()
        return await super().delete(key, if_mod_revision=if_mod_revision)


async def test_a_key_being_removed_is_no_ghost(caplog: pytest.LogCaptureFixture) -> None:
    """A stream that ends has its session dropped, then its key removed: a
    read of the registrations in between does not say it found a ghost."""
    store = HeldDeleteStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp1", stream_grace=10.0)
    ending = await streamed(registry, "p-x")
    store.hold = True
    removal = asyncio.create_task(registry.unregister(ending))
    await store.held.wait()
    assert await registry.self_check()
    store.release.set()
    await removal
    assert await fleet(catalog) == []
    assert ghost_lines(caplog) == []
