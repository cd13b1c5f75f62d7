"""The RegionSide contract, run here on MemorySide and in
tests/integration/test_regional_store.py on RedisSide (a real redis-server),
so that the unit tests of RegionalStore on MemorySide say something about
RegionalStore on Redis.

The cache store's contract (tests/unit/test_cache_store.py::TestContract)
also runs here on a RegionalStore over MemorySide, up and down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

from dataplane.cache.regionside import MemorySide, RegionSide
from dataplane.cache.regionstore import RegionalStore
from dataplane.cache.store import UNANSWERED, CacheStore, ExactStore, Found, Unanswered
from tests.unit.test_cache_store import FakeClock, StoreFactory, entry
from tests.unit.test_cache_store import TestContract as _StoreContract


@dataclass
class SideCase:
    side: RegionSide
    # Let `seconds` pass for the side's TTLs (a fake clock, or real time).
    elapse: Callable[[float], Awaitable[None]]


def memory_case(*, up: bool = True) -> SideCase:
    clock = FakeClock()
    side = MemorySide(clock)
    side.up = up

    async def elapse(seconds: float) -> None:
        clock.advance(seconds)

    return SideCase(side, elapse)


@pytest.fixture
def up_side() -> SideCase:
    return memory_case()


@pytest.fixture
def down_side() -> SideCase:
    return memory_case(up=False)


class TestSideContract:
    async def test_values_round_trip(self, up_side: SideCase) -> None:
        side = up_side.side
        assert await side.get("ponto:test:a") is None
        await side.set("ponto:test:a", b"\x00\xff value", 10_000)
        assert await side.get("ponto:test:a") == b"\x00\xff value"
        await side.set("ponto:test:a", b"again", 10_000)
        assert await side.get("ponto:test:a") == b"again"
        await side.unlink("ponto:test:a", "ponto:test:absent")
        assert await side.get("ponto:test:a") is None

    async def test_values_expire(self, up_side: SideCase) -> None:
        side = up_side.side
        await side.set("ponto:test:short", b"v", 100)
        await side.set("ponto:test:long", b"v", 10_000)
        await up_side.elapse(0.2)
        assert await side.get("ponto:test:short") is None
        assert await side.get("ponto:test:long") == b"v"

    async def test_set_nx_holds_until_released_by_its_holder(self, up_side: SideCase) -> None:
        side = up_side.side
        assert await side.set_nx("ponto:test:lock", "me", 10_000) is True
        assert await side.set_nx("ponto:test:lock", "you", 10_000) is False
        await side.release("ponto:test:lock", "you")  # not the holder: nothing
        assert await side.set_nx("ponto:test:lock", "you", 10_000) is False
        await side.release("ponto:test:lock", "me")
        assert await side.set_nx("ponto:test:lock", "you", 10_000) is True

    async def test_a_lock_expires_unless_its_holder_refreshes_it(self, up_side: SideCase) -> None:
        side = up_side.side
        assert await side.set_nx("ponto:test:lock", "me", 150)
        assert not await side.refresh("ponto:test:lock", "you", 10_000)
        assert await side.refresh("ponto:test:lock", "me", 10_000)
        await up_side.elapse(0.3)
        assert await side.set_nx("ponto:test:lock", "you", 150) is False  # refreshed
        assert await side.set_nx("ponto:test:other", "me", 100)
        await up_side.elapse(0.2)
        assert await side.set_nx("ponto:test:other", "you", 100) is True  # expired
        assert not await side.refresh("ponto:test:gone", "me", 100)

    async def test_get_and_exists(self, up_side: SideCase) -> None:
        side = up_side.side
        assert await side.get_and_exists("ponto:test:v", "ponto:test:l") == (None, False)
        await side.set("ponto:test:v", b"v", 10_000)
        assert await side.set_nx("ponto:test:l", "me", 10_000)
        assert await side.get_and_exists("ponto:test:v", "ponto:test:l") == (b"v", True)

    async def test_scan_finds_every_match_and_only_matches(self, up_side: SideCase) -> None:
        side = up_side.side
        wanted = {f"ponto:test:x:{i}" for i in range(1200)}
        for key in wanted:
            await side.set(key, b"v", 10_000)
        await side.set("ponto:test:y:1", b"v", 10_000)
        found: set[str] = set()
        cursor = 0
        while True:
            page = await side.scan(cursor, "ponto:test:x:*")
            assert page is not None
            cursor, keys = page
            found.update(keys)
            if cursor == 0:
                break
        assert found == wanted


class TestDownSideContract:
    async def test_a_side_that_cannot_answer_says_so(self, down_side: SideCase) -> None:
        side = down_side.side
        await side.set("ponto:test:a", b"v", 10_000)  # no error
        await side.unlink("ponto:test:a")
        await side.release("ponto:test:a", "me")
        assert await side.get("ponto:test:a") is UNANSWERED
        assert await side.set_nx("ponto:test:a", "me", 10_000) is None
        assert await side.refresh("ponto:test:a", "me", 10_000) is False
        assert await side.get_and_exists("ponto:test:a", "ponto:test:b") is None
        assert await side.scan(0, "ponto:test:*") is None


# ---------------------------------------------------------------------------
# RegionalStore over MemorySide: the cache store's contract, up and down.


def _regional(up: bool) -> StoreFactory:
    def factory(clock: FakeClock) -> CacheStore:
        side = MemorySide(clock)
        side.up = up
        local = ExactStore(max_bytes=1 << 20, clock=clock)
        return RegionalStore(local, side, name="p", clock=clock)

    return factory


@pytest.fixture(params=[True, False], ids=["region-memory", "region-memory-down"])
def make_store(request: pytest.FixtureRequest) -> StoreFactory:
    return _regional(bool(request.param))


class TestContract(_StoreContract):
    """The CacheStore contract on RegionalStore over MemorySide."""


# ---------------------------------------------------------------------------
# RegionalStore's own rules over MemorySide.

T = {"tenant": "t", "model": "m"}


def _two_proxies(clock: FakeClock) -> tuple[MemorySide, RegionalStore, RegionalStore]:
    side = MemorySide(clock)
    a = RegionalStore(ExactStore(max_bytes=1 << 20, clock=clock), side, name="a", clock=clock)
    b = RegionalStore(ExactStore(max_bytes=1 << 20, clock=clock), side, name="b", clock=clock)
    return side, a, b


async def test_a_miss_the_region_could_not_answer_is_not_absent() -> None:
    clock = FakeClock()
    side, a, b = _two_proxies(clock)
    assert await b.lookup("k", **T) is None  # the region answered: absent
    side.up = False
    assert await b.lookup("k", **T) is UNANSWERED
    await a.put("k", entry(), ttl_s=60, **T)
    assert isinstance(await a.lookup("k", **T), Found)  # its own memory still answers


class _SlowGet(MemorySide):
    """A side whose GET suspends until released, so a purge can land meanwhile."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.gate = asyncio.Event()

    async def get(self, key: str) -> bytes | Unanswered | None:
        value = await super().get(key)
        await self.gate.wait()
        return value


async def test_a_purge_applied_while_a_get_is_out_makes_its_answer_a_miss() -> None:
    clock = FakeClock()
    side = _SlowGet(clock)
    side.gate.set()
    a = RegionalStore(ExactStore(max_bytes=1 << 20, clock=clock), side, name="a", clock=clock)
    b = RegionalStore(ExactStore(max_bytes=1 << 20, clock=clock), side, name="b", clock=clock)
    await a.put("k", entry(), ttl_s=60, **T)
    await a.flush()
    side.gate.clear()
    lookup = asyncio.ensure_future(b.lookup("k", **T))
    await asyncio.sleep(0)  # the GET is out
    b.set_purges([(7, "t", "")])
    side.gate.set()
    assert await lookup is None
    assert await b.local.get("k") is None  # not adopted either
