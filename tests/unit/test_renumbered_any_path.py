"""The state is published again under the new numbers whenever the store's
numbering base changes, whichever path changed it: not only when a proxy's
report had this replica's ensure_above raise it. A raise seen first by
another watch of the replica, or in a listing holding another replica's,
had the rebuild of the same content dropped as a duplicate, and the proxy
(which refused the table numbered before the raise) kept its table of
before the etcd restore until the config next changed."""

from __future__ import annotations

import asyncio

from controlplane.app import ControlPlane
from controlplane.catalog import ROOT
from controlplane.model import Region
from controlplane.settings import parse
from controlplane.store.memory import MemoryStore
from controlplane.store.rebased import RebasedStore


async def restored_plane() -> tuple[ControlPlane, MemoryStore, int]:
    """A replica that published a table, over a store then restored from a
    backup of before its later writes; the version it published."""
    memory = MemoryStore()
    plane = ControlPlane(parse(["--id", "cp-1", "--listen", "127.0.0.1:0"]), memory)
    assert await plane.builder.build_once()
    latest = plane.publisher.latest
    assert latest is not None
    backup = memory.snapshot()
    for i in range(20):  # written after the backup, outside the table's state
        await plane.store.put(f"{ROOT}elsewhere/{i}", b"x")
    memory.restore(backup)
    return plane, memory, latest.version


async def test_a_raise_by_another_watch_of_the_replica_publishes_again() -> None:
    plane, _, before = await restored_plane()
    watch = plane.store.watch(ROOT + "elsewhere/", plane.store.highest)
    woke = await asyncio.wait_for(anext(watch), 5.0)  # the watch raises the base
    await watch.aclose()  # type: ignore[attr-defined]
    assert woke > before
    assert plane.builder._dirty.is_set()  # woken to build again
    assert await plane.builder.build_once()
    latest = plane.publisher.latest
    assert latest is not None and latest.version >= woke


async def test_a_raise_by_another_replica_seen_in_a_listing_publishes_again() -> None:
    plane, memory, before = await restored_plane()
    other = RebasedStore(memory)
    assert await other.ensure_above(plane.store.highest)
    # This replica learns of the raise from the builder's own listing.
    assert await plane.builder.build_once()
    latest = plane.publisher.latest
    assert latest is not None and latest.version > before
    assert latest.version > other.base
    # The same content, numbered under the same base, is not pushed again.
    assert not await plane.builder.build_once()


async def test_a_restore_no_watch_saw_is_numbered_above_by_the_next_build() -> None:
    """A restore only a few writes old, which no watch of the replica saw
    (docs/operations.md's limit): the operator's change after it read at a
    revision below the table the proxies hold. The build numbers above it
    and the next publishes the change; the publisher dropped it, nothing
    renumbered, and no proxy got the change (review of 21fde0b)."""
    memory = MemoryStore()
    plane = ControlPlane(parse(["--id", "cp-1", "--listen", "127.0.0.1:0"]), memory)
    assert await plane.builder.build_once()
    backup = memory.snapshot()
    await plane.catalog.put_region(Region("us-east", 38.9, -77.4), allow_update=False)
    for i in range(20):
        await plane.store.put(f"{ROOT}elsewhere/{i}", b"x")
    assert await plane.builder.build_once()
    latest = plane.publisher.latest
    assert latest is not None
    held = latest.version
    memory.restore(backup)
    await plane.catalog.put_region(Region("eu-west", 53.3, -6.3), allow_update=False)
    plane.builder._dirty.clear()
    assert not await plane.builder.build_once()  # below: numbered above first
    assert plane.builder._dirty.is_set()  # and woken to build again
    assert await plane.builder.build_once()
    latest = plane.publisher.latest
    assert latest is not None and latest.version > held
    assert [r.name for r in latest.table.regions] == ["eu-west"]
