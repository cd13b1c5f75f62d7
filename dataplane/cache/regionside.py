"""The region's shared key space as the regional cache uses it: a small protocol,
its Redis form and an in-memory form.

`RegionSide` is every operation dataplane.cache.regionstore needs, named by
what it does (a compare-and-delete, not an EVAL). `RedisSide` runs them on the
region's Redis through a `RegionLink` (deadlines, breaker, metrics);
`MemorySide` keeps them in a dict on an injected clock, for unit tests and for
anything that wants a region without a server. Both pass
tests/unit/test_region_side.py::TestSideContract (the Redis one in
tests/integration/test_regional_store.py).

No method raises: a side that cannot answer (down, slow, its breaker open)
answers as stated for each method, which callers treat as "no region".
Used from one event loop; not thread-safe.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dataplane.cache.store import UNANSWERED, Unanswered

if TYPE_CHECKING:  # redis-py is imported only by a proxy that uses it
    from redis.asyncio import Redis

    from dataplane.cache.regional import RegionLink

# Delete or extend a key only while it holds the caller's value (a lock's token).
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)
_REFRESH = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
)
SCAN_COUNT = 500


class RegionSide(Protocol):
    async def get(self, key: str) -> bytes | Unanswered | None:
        """The value under key; None when absent, UNANSWERED when the side cannot answer."""
        ...

    async def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        """Store value under key for ttl_ms (best effort)."""
        ...

    async def unlink(self, *keys: str) -> None:
        """Drop keys (best effort)."""
        ...

    async def set_nx(self, key: str, value: str, ttl_ms: int, *, op: str = "lock") -> bool | None:
        """Set key to value for ttl_ms unless it exists: True when set, False
        when it exists, None when the side cannot answer. `op` names the call
        in metrics: "lock" (a flight lock, a write held back while Redis refuses
        writes) or "purge_claim" (a purge's cleanup, which frees memory: never
        held back)."""
        ...

    async def release(self, key: str, value: str) -> None:
        """Drop key if it still holds value (best effort)."""
        ...

    async def refresh(self, key: str, value: str, ttl_ms: int) -> bool:
        """Give key ttl_ms more if it still holds value; False when it does not
        (or the side cannot answer). Op "lock_refresh": never held back with
        the writes."""
        ...

    async def get_and_exists(self, key: str, other: str) -> tuple[bytes | None, bool] | None:
        """key's value and whether other exists, in one round trip; None when
        the side cannot answer."""
        ...

    async def scan(self, cursor: int, match: str) -> tuple[int, list[str]] | None:
        """One page of keys matching a glob, and the next cursor (0: done);
        None when the side cannot answer."""
        ...

    def count(self, op: str, result: str) -> None:
        """Count an outcome decided by the caller (a write dropped)."""
        ...

    def error(self, op: str) -> None:
        """Count a failure found by the caller (a value that does not decode)."""
        ...


class RedisSide:
    """RegionSide on the region's Redis, every call through `link`."""

    def __init__(self, link: RegionLink) -> None:
        self.link = link

    async def get(self, key: str) -> bytes | Unanswered | None:
        # Boxed: the link's None means "no answer", a GET's None "absent".
        boxed = await self.link.call("get", lambda r: _get_boxed(r, key))
        if boxed is None:
            return UNANSWERED
        (value,) = boxed
        return value if isinstance(value, bytes) or value is None else str(value).encode()

    async def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        await self.link.call("set", lambda r: r.set(key, value, px=ttl_ms))

    async def unlink(self, *keys: str) -> None:
        if keys:
            await self.link.call("delete", lambda r: r.unlink(*keys))

    async def set_nx(self, key: str, value: str, ttl_ms: int, *, op: str = "lock") -> bool | None:
        return await self.link.call(op, lambda r: _set_nx(r, key, value, ttl_ms))

    async def release(self, key: str, value: str) -> None:
        await self.link.call("unlock", lambda r: _eval(r, _RELEASE, key, value))

    async def refresh(self, key: str, value: str, ttl_ms: int) -> bool:
        # Its own op, not "lock": a PEXPIRE takes no memory, and held back with
        # the writes it made the refresher give up a lock it still held, so a
        # long generation's followers on other proxies called the origin too
        # (review finding 2).
        done = await self.link.call(
            "lock_refresh", lambda r: _eval(r, _REFRESH, key, value, str(ttl_ms))
        )
        return bool(done)

    async def get_and_exists(self, key: str, other: str) -> tuple[bytes | None, bool] | None:
        return await self.link.call("follow", lambda r: _get_and_exists(r, key, other))

    async def scan(self, cursor: int, match: str) -> tuple[int, list[str]] | None:
        return await self.link.call("purge", lambda r: _scan(r, cursor, match))

    def count(self, op: str, result: str) -> None:
        self.link.count(op, result)

    def error(self, op: str) -> None:
        self.link.error(op)


async def _get_boxed(r: Redis, key: str) -> tuple[object]:
    return (await r.get(key),)


async def _set_nx(r: Redis, key: str, value: str, ttl_ms: int) -> bool:
    return (await r.set(key, value, nx=True, px=ttl_ms)) is True


async def _eval(r: Redis, script: str, key: str, *args: str) -> int:
    return int(await r.eval(script, 1, key, *args))


async def _get_and_exists(r: Redis, key: str, other: str) -> tuple[bytes | None, bool]:
    async with r.pipeline(transaction=False) as pipe:
        pipe.get(key)
        pipe.exists(other)
        value, exists = await pipe.execute()
    return value, bool(exists)


async def _scan(r: Redis, cursor: int, match: str) -> tuple[int, list[str]]:
    after, keys = await r.scan(cursor=cursor, match=match, count=SCAN_COUNT)
    return after, [k.decode(errors="replace") if isinstance(k, bytes) else k for k in keys]


class MemorySide:
    """RegionSide in a dict, with TTLs on `clock` (seconds). `up = False` makes
    it answer as a side that cannot be reached. Counts go to `counts` and
    `errors`, as RedisSide's go to metrics."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._data: dict[str, tuple[bytes, float]] = {}
        self.up = True
        self.counts: dict[tuple[str, str], int] = {}
        self.errors: dict[str, int] = {}

    def _live(self, key: str) -> bytes | None:
        held = self._data.get(key)
        if held is None:
            return None
        if held[1] <= self._clock():
            del self._data[key]
            return None
        return held[0]

    def _put(self, key: str, value: bytes, ttl_ms: int) -> None:
        self._data[key] = (value, self._clock() + ttl_ms / 1000)

    async def get(self, key: str) -> bytes | Unanswered | None:
        return self._live(key) if self.up else UNANSWERED

    async def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        if self.up:
            self._put(key, value, ttl_ms)

    async def unlink(self, *keys: str) -> None:
        if self.up:
            for key in keys:
                self._data.pop(key, None)

    async def set_nx(self, key: str, value: str, ttl_ms: int, *, op: str = "lock") -> bool | None:
        if not self.up:
            return None
        if self._live(key) is not None:
            return False
        self._put(key, value.encode(), ttl_ms)
        return True

    async def release(self, key: str, value: str) -> None:
        if self.up and self._live(key) == value.encode():
            del self._data[key]

    async def refresh(self, key: str, value: str, ttl_ms: int) -> bool:
        if not self.up or self._live(key) != value.encode():
            return False
        self._put(key, value.encode(), ttl_ms)
        return True

    async def get_and_exists(self, key: str, other: str) -> tuple[bytes | None, bool] | None:
        if not self.up:
            return None
        return self._live(key), self._live(other) is not None

    async def scan(self, cursor: int, match: str) -> tuple[int, list[str]] | None:
        if not self.up:
            return None
        # One page of everything: a cursor is only a promise to finish.
        keys = [k for k in list(self._data) if self._live(k) is not None]
        return 0, [k for k in keys if fnmatch.fnmatchcase(k, match)]

    def count(self, op: str, result: str) -> None:
        self.counts[op, result] = self.counts.get((op, result), 0) + 1

    def error(self, op: str) -> None:
        self.errors[op] = self.errors.get(op, 0) + 1
