"""Typed operations on the fleet's state, over any StateStore.

Layout in the store (one JSON object per key):
  /ponto/state/regions/NAME     Region       compiled into route tables
  /ponto/state/origins/NAME     Origin       compiled into route tables
  /ponto/state/health/NAME      OriginHealth written by the leader's probes
  /ponto/proxies/NAME           ProxyRecord  under a replica's lease; not compiled

Everything under STATE_PREFIX is read in one range read, so a route table is
compiled from one consistent revision. Read-modify-write operations (drain) use
compare-and-swap on the key's revision and retry on conflict.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from controlplane.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from controlplane.model import (
    Origin,
    OriginHealth,
    ProxyRecord,
    Region,
    State,
    check_name,
    decode_health,
    decode_origin,
    decode_proxy,
    decode_region,
    encode,
)
from controlplane.store import Conflict, StateStore, StoreUnavailable

log = logging.getLogger(__name__)

ROOT = "/ponto/"
STATE_PREFIX = ROOT + "state/"
REGIONS = STATE_PREFIX + "regions/"
ORIGINS = STATE_PREFIX + "origins/"
HEALTH = STATE_PREFIX + "health/"
PROXIES = ROOT + "proxies/"
CAS_ATTEMPTS = 8

T = TypeVar("T")
R = TypeVar("R", Region, Origin)


async def _guard(aw: Awaitable[T]) -> T:
    try:
        return await aw
    except StoreUnavailable as exc:
        raise Unavailable(f"state store unavailable: {exc}") from exc


class Catalog:
    """The control plane's view of desired state. Safe for concurrent use."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    # ------------------------------------------------------------ snapshot

    async def snapshot(self) -> State:
        """Regions and origins at one revision; undecodable keys are skipped and logged."""
        listing = await _guard(self.store.list(STATE_PREFIX))
        regions: list[Region] = []
        origins: list[Origin] = []
        health: dict[str, OriginHealth] = {}
        for kv in listing.items:
            try:
                if kv.key.startswith(REGIONS):
                    regions.append(decode_region(kv.value))
                elif kv.key.startswith(ORIGINS):
                    origins.append(decode_origin(kv.value))
                elif kv.key.startswith(HEALTH):
                    h = decode_health(kv.value)
                    health[h.origin] = h
            except (ValueError, TypeError) as exc:
                log.error("ignoring undecodable key %s: %s", kv.key, exc)
        return State(listing.revision, tuple(regions), tuple(origins), health)

    async def put_health(self, health: OriginHealth) -> None:
        await _guard(self.store.put(HEALTH + health.origin, encode(health)))

    # ------------------------------------------------------------ regions

    async def put_region(self, region: Region, *, allow_update: bool) -> Region:
        region = region.validated()
        return await self._put("region", REGIONS, region, decode_region, allow_update)

    async def get_region(self, name: str) -> Region:
        kv = await _guard(self.store.get(REGIONS + check_name("region", name)))
        if kv is None:
            raise NotFound(f"region {name!r} not found")
        return decode_region(kv.value)

    async def list_regions(self) -> list[Region]:
        return list((await self.snapshot()).regions)

    async def delete_region(self, name: str) -> None:
        check_name("region", name)
        users = [o.name for o in (await self.snapshot()).origins if o.region == name]
        if users:
            raise FailedPrecondition(
                f"region {name!r} still has origins: {', '.join(users)}; delete or move them first"
            )
        if not await _guard(self.store.delete(REGIONS + name)):
            raise NotFound(f"region {name!r} not found")

    async def set_region_drained(self, name: str, drained: bool) -> Region:
        return await self._update(
            REGIONS + check_name("region", name),
            decode_region,
            lambda r: replace(r, drained=drained),
            f"region {name!r} not found",
        )

    # ------------------------------------------------------------ origins

    async def put_origin(self, origin: Origin, *, allow_update: bool) -> Origin:
        origin = origin.validated()
        if await _guard(self.store.get(REGIONS + origin.region)) is None:
            raise NotFound(
                f"region {origin.region!r} of origin {origin.name!r} not found; "
                "add the region first"
            )
        return await self._put("origin", ORIGINS, origin, decode_origin, allow_update)

    async def list_origins(self) -> list[Origin]:
        return list((await self.snapshot()).origins)

    async def delete_origin(self, name: str) -> None:
        if not await _guard(self.store.delete(ORIGINS + check_name("origin", name))):
            raise NotFound(f"origin {name!r} not found")
        await _guard(self.store.delete(HEALTH + name))

    async def set_origin_drained(self, name: str, drained: bool) -> Origin:
        return await self._update(
            ORIGINS + check_name("origin", name),
            decode_origin,
            lambda o: replace(o, drained=drained),
            f"origin {name!r} not found",
        )

    async def _put(
        self,
        kind: str,
        prefix: str,
        value: R,
        decode: Callable[[bytes], R],
        allow_update: bool,
    ) -> R:
        """Create value, or replace it when allow_update; an update keeps the
        drain flag, because draining is its own operation."""
        key = prefix + value.name
        current = await _guard(self.store.get(key))
        if current is not None:
            if not allow_update:
                raise AlreadyExists(f"{kind} {value.name!r} already exists")
            value = replace(value, drained=decode(current.value).drained)
        try:
            await _guard(
                self.store.put(
                    key, encode(value), if_mod_revision=current.mod_revision if current else 0
                )
            )
        except Conflict as exc:
            raise AlreadyExists(f"{kind} {value.name!r} was changed concurrently") from exc
        return value

    async def _update(
        self,
        key: str,
        decode: Callable[[bytes], T],
        change: Callable[[T], T],
        missing: str,
    ) -> T:
        for _ in range(CAS_ATTEMPTS):
            current = await _guard(self.store.get(key))
            if current is None:
                raise NotFound(missing)
            updated = change(decode(current.value))
            try:
                await _guard(
                    self.store.put(key, encode(updated), if_mod_revision=current.mod_revision)  # type: ignore[arg-type]
                )
            except Conflict:
                continue
            return updated
        raise Unavailable(f"{key} kept changing; try again")

    # ------------------------------------------------------------ proxies

    async def put_proxy(self, record: ProxyRecord, lease: int) -> None:
        await _guard(self.store.put(PROXIES + record.name, encode(record), lease=lease))

    async def remove_proxy(self, name: str, session_id: str) -> None:
        """Remove the registration only if it is still this session's."""
        kv = await _guard(self.store.get(PROXIES + name))
        if kv is None or decode_proxy(kv.value).session_id != session_id:
            return
        # A conflict means it re-registered meanwhile: the new session owns the key.
        with contextlib.suppress(Conflict):
            await _guard(self.store.delete(kv.key, if_mod_revision=kv.mod_revision))

    async def list_proxies(self) -> list[ProxyRecord]:
        listing = await _guard(self.store.list(PROXIES))
        out = []
        for kv in listing.items:
            try:
                out.append(decode_proxy(kv.value))
            except (ValueError, TypeError) as exc:
                log.error("ignoring undecodable key %s: %s", kv.key, exc)
        return out
