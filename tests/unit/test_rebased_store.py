"""RebasedStore: revisions handed out never go back, though the store's do.

Trial 34 left this: etcd restored from a backup (or started again with its
data lost) counts from an older revision, and every proxy refused every
table, quota and load push that followed as older than what it held, until
restarted. MemoryStore.restore() is the backup here, as etcdutl's restore is
in tests/integration/test_etcd_restore.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from controlplane.catalog import STATE_PREFIX
from controlplane.store import Conflict, Fence, Write
from controlplane.store.base import KeyValue, Listing, StoreUnavailable
from controlplane.store.memory import MemoryStore
from controlplane.store.rebased import BASE_KEY, MARGIN, MAX_BASE, RebasedStore

K = STATE_PREFIX + "regions/"


async def fill(store: RebasedStore, n: int, prefix: str = K) -> int:
    """Write n keys; the revision of the last."""
    revision = 0
    for i in range(n):
        revision = await store.put(f"{prefix}{i}", b"x")
    return revision


class Watch:
    """What a watch yields, queued by a task of its own."""

    def __init__(self, store: RebasedStore, prefix: str, start: int) -> None:
        self.got: asyncio.Queue[int] = asyncio.Queue()
        self._iter = store.watch(prefix, start)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for revision in self._iter:
            self.got.put_nowait(revision)

    async def next(self) -> int:
        return await asyncio.wait_for(self.got.get(), 5.0)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture
async def watches() -> AsyncIterator[list[Watch]]:
    made: list[Watch] = []
    yield made
    for watch in made:
        await watch.close()


async def test_after_a_restore_every_revision_is_above_all_handed_out_before(
    caplog: pytest.LogCaptureFixture, watches: list[Watch]
) -> None:
    memory = MemoryStore()
    store = RebasedStore(memory)
    await fill(store, 3)
    backup = memory.snapshot()
    highest = await fill(store, 20, K + "later/")
    watches.append(Watch(store, STATE_PREFIX, highest))
    memory.restore(backup)  # etcd's revision is back at 4
    with caplog.at_level(logging.WARNING, "controlplane.store.rebased"):
        woke = await watches[0].next()
    # The watch wakes its consumer with a revision above everything before,
    # and what is read and written from then on is numbered above it too.
    assert woke > highest
    listing = await store.list(STATE_PREFIX)
    assert listing.revision >= woke
    assert [kv.key for kv in listing.items] == [K + "0", K + "1", K + "2"]
    assert all(kv.mod_revision > 0 for kv in listing.items)
    assert await store.put(K + "new", b"x") > listing.revision
    # Said once, with the figures.
    [told] = [r for r in caplog.records if r.name == "controlplane.store.rebased"]
    assert told.levelno == logging.WARNING
    assert told.getMessage().startswith(f"etcd's revision 4 is behind {highest}, handed out")
    # The base is the store's: another replica reading it numbers alike.
    other = RebasedStore(memory)
    assert (await other.list(STATE_PREFIX)).revision == (await store.list(STATE_PREFIX)).revision


async def test_the_base_key_is_hidden_and_kept(watches: list[Watch]) -> None:
    memory = MemoryStore()
    store = RebasedStore(memory)
    await store.ensure_above(50)
    assert await memory.get(BASE_KEY) is not None
    for listing in (
        await store.list(STATE_PREFIX),
        await store.list("/ponto/"),
        await store.scan("/", "\xff"),
    ):
        assert BASE_KEY not in [kv.key for kv in listing.items]
    assert await store.count(STATE_PREFIX, STATE_PREFIX + "\xff") == 0
    with pytest.raises(ValueError, match="cannot be deleted"):
        await store.delete_range(STATE_PREFIX, STATE_PREFIX + "\xff")
    assert await memory.get(BASE_KEY) is not None


async def test_a_proxy_ahead_raises_the_base_and_a_lagging_replica_does_not() -> None:
    """A control plane started after the restore has handed out nothing: it
    learns how far the numbers went from a proxy (RoutingService._held). A
    proxy merely ahead of a lagging replica is no cause: etcd is ahead too."""
    memory = MemoryStore()
    store = RebasedStore(memory)
    now = await fill(store, 5)
    await store.ensure_above(now - 2)  # etcd is past it: nothing written
    assert await memory.get(BASE_KEY) is None and store.base == 0
    await store.ensure_above(now + 500)  # a proxy held 500 more than etcd has
    assert store.base > 0
    assert (await store.list(STATE_PREFIX)).revision > now + 500
    assert await store.put(K + "x", b"y") > now + 500


async def test_conditions_read_before_a_raise_still_hold_after_it() -> None:
    """A replica's fence and a read-modify-write read before the raise carry
    revisions of the old base: they are mapped back with it, not with the new."""
    memory = MemoryStore()
    store = RebasedStore(memory)
    await fill(store, 3)
    fence_at = await store.put("/ponto/leader", b"cp-1")
    kv = await store.get(K + "1")
    assert kv is not None
    await store.ensure_above(fence_at + 10_000)
    fence = Fence("/ponto/leader", fence_at)
    written = await store.put(K + "1", b"z", if_mod_revision=kv.mod_revision, fence=fence)
    assert written > fence_at + 10_000
    await store.commit([Write(K + "2", b"z")], [fence])
    # The same numbers again are stale now, as they would be without a raise.
    with pytest.raises(Conflict):
        await store.put(K + "1", b"w", if_mod_revision=kv.mod_revision)
    now = await store.get(K + "1")
    assert now is not None and now.mod_revision == written
    assert await store.delete(K + "1", if_mod_revision=now.mod_revision)
    # A revision from before any store revision matches no key.
    with pytest.raises(Conflict):
        await store.put(K + "0", b"w", if_mod_revision=1)


async def test_conditions_read_after_a_raise_hold_on_keys_kept_from_the_backup() -> None:
    """A key etcd kept is numbered again with the new base; its number must
    not be one the old base handed out, which would be mapped back with that
    base: its compare-and-swap would fail for good (review of 009c829: every
    edit of a tenant, region or key made before the backup conflicted)."""
    memory = MemoryStore()
    store = RebasedStore(memory)
    await fill(store, 3)
    fence_at = await store.put("/ponto/leader", b"cp-1")
    backup = memory.snapshot()
    await fill(store, 20, K + "later/")
    memory.restore(backup)
    assert await store.ensure_above(store.highest)
    for key in (K + "0", K + "1", K + "2"):
        kv = await store.get(key)
        assert kv is not None
        assert await store.put(key, b"edited", if_mod_revision=kv.mod_revision) > kv.mod_revision
    [kept] = [kv for kv in (await store.list("/ponto/leader")).items]
    await store.commit([Write(K + "0", b"again")], [Fence(kept.key, kept.mod_revision)])
    # The fence read before the raise holds too: the key is as it was then.
    await store.commit([Write(K + "1", b"again")], [Fence("/ponto/leader", fence_at)])


async def test_replicas_that_numbered_under_the_old_base_take_the_new_one() -> None:
    """Both replicas hand out numbers under the stored base while one of them
    raises it: the other takes the raise rather than raising again in turn
    (each raising above the other's last numbers would go on for ever)."""
    memory = MemoryStore()
    one, two = RebasedStore(memory), RebasedStore(memory)
    await fill(one, 3)
    backup = memory.snapshot()
    await fill(one, 10, K + "a/")
    await two.list(STATE_PREFIX)
    memory.restore(backup)
    assert await one.ensure_above(one.highest)
    raised = one.base
    await fill(two, 50, K + "b/")  # `two` goes on under the old base meanwhile
    await two.list(STATE_PREFIX)
    assert two.base == raised == one.base
    assert (await one.list(STATE_PREFIX)).revision == (await two.list(STATE_PREFIX)).revision


async def test_a_replica_learns_another_ones_raise_from_the_state_listing() -> None:
    memory = MemoryStore()
    one, two = RebasedStore(memory), RebasedStore(memory)
    await fill(one, 3)
    await two.list(STATE_PREFIX)
    await one.ensure_above(900)
    # The write of the base is a change of the state: `two`'s builder lists it.
    a, b = await one.list(STATE_PREFIX), await two.list(STATE_PREFIX)
    assert a.revision == b.revision > 900
    assert two.base == one.base


async def test_a_replica_whose_numbers_were_higher_raises_further() -> None:
    """`one` raised the base for what it saw; `two` had handed out more (it
    read the store later before it went back): it raises the base again."""
    memory = MemoryStore()
    one, two = RebasedStore(memory), RebasedStore(memory)
    await fill(one, 3)
    backup = memory.snapshot()
    first = await fill(one, 10, K + "a/")
    second = await fill(two, MARGIN + 30, K + "b/")
    memory.restore(backup)
    one.highest = first  # `one` saw only its own writes
    await one.ensure_above(first)
    assert first < (await one.list(STATE_PREFIX)).revision <= second
    listing = await two.list(STATE_PREFIX)
    assert listing.revision > second
    assert (await one.list(STATE_PREFIX)).revision == (await two.list(STATE_PREFIX)).revision


async def test_a_report_beyond_reason_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    memory = MemoryStore()
    store = RebasedStore(memory)
    with caplog.at_level(logging.ERROR, "controlplane.store.rebased"):
        await store.ensure_above(MAX_BASE + 10)
    assert store.base == 0 and await memory.get(BASE_KEY) is None
    [told] = caplog.records
    assert "was reported, but etcd is at" in told.getMessage()


async def test_a_base_that_is_not_a_number_counts_as_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    memory = MemoryStore()
    await memory.put(BASE_KEY, b"many")
    store = RebasedStore(memory)
    with caplog.at_level(logging.ERROR, "controlplane.store.rebased"):
        listing = await store.list(STATE_PREFIX)
    assert listing.revision == 2 and store.base == 0
    assert any("is not a number" in r.getMessage() for r in caplog.records)


class Away(MemoryStore):
    """A store whose reads of the base wait at `gate` and then fail while
    `down`: etcd away, each read taking its whole timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True
        self.gate = asyncio.Event()
        self.base_reads = 0

    async def list(self, prefix: str) -> Listing:
        if prefix == BASE_KEY:
            self.base_reads += 1
            await self.gate.wait()
            if self.down:
                raise StoreUnavailable("etcd list failed: UNAVAILABLE")
        return await super().list(prefix)


async def test_callers_before_the_base_is_loaded_share_one_read_and_its_failure() -> None:
    """A replica started with etcd away: its callers (builder, election,
    registry, quotas, loads) each waited their turn for a read of their own,
    the fifth failing after five store timeouts (15 s)."""
    inner = Away()
    store = RebasedStore(inner)
    calls = [asyncio.create_task(store.get(f"{K}{i}")) for i in range(5)]
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(store.get(f"{K}x"))
    await asyncio.sleep(0)
    cancelled.cancel()  # one caller leaves: the read goes on for the others
    await asyncio.sleep(0)
    assert inner.base_reads == 1
    inner.gate.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, StoreUnavailable) for r in results), results
    assert inner.base_reads == 1
    inner.down = False  # etcd back: the next caller reads again
    assert await store.get(f"{K}0") is None
    assert inner.base_reads == 2
    await store.put(f"{K}0", b"x")
    assert await store.get(f"{K}0") is not None
    assert inner.base_reads == 2  # loaded once and for all
    await store.close()


class _Kept(MemoryStore):
    """A MemoryStore that keeps the records of its last listing."""

    last: tuple[KeyValue, ...] = ()

    async def list(self, prefix: str) -> Listing:
        listing = await super().list(prefix)
        self.last = listing.items
        return listing

    async def scan(self, start: str, end: str, *, limit: int = 0) -> Listing:
        listing = await super().scan(start, end, limit=limit)
        self.last = listing.items
        return listing


async def test_under_base_0_listings_are_the_stores_own_records() -> None:
    """Records made again for nothing, 20,000 of them, held the event loop
    up to 0.7 s a listing of the state during a bulk key load (a get's one
    record is the store's own too); once a base is raised, every record is
    numbered again."""
    memory = _Kept()
    store = RebasedStore(memory)
    await fill(store, 3)
    await memory.put("/ponto/other", b"o")
    reads: list[Callable[[], Awaitable[Listing]]] = [
        lambda: store.list(STATE_PREFIX),  # holds BASE_KEY's place: _learn
        lambda: store.list(K),
        lambda: store.scan("/", "\xff"),
    ]
    for read in reads:
        listing = await read()
        assert listing.items and all(
            mine is theirs for mine, theirs in zip(listing.items, memory.last, strict=True)
        )
    assert await store.get(f"{K}0") is await memory.get(f"{K}0")
    before = {kv.key: kv.mod_revision for kv in (await store.list(K)).items}
    await store.ensure_above(max(before.values()) + 500)
    after = await store.list(K)
    assert all(kv.mod_revision == before[kv.key] + store.base for kv in after.items)
    got = await store.get(f"{K}0")
    assert got is not None and got.mod_revision == before[f"{K}0"] + store.base
