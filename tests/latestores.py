"""MemoryStores that act as etcd does before it serves: a replica started
with its members, before their first election, finds its first reads failing
and its watches made late. What it writes or reads meanwhile must not be
lost to a watch made "from now" after it (a clean-clone run's flake). And
one that remembers what it was asked to list."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from controlplane.store import Listing, StoreUnavailable
from controlplane.store.memory import MemoryStore


class LateWatches(MemoryStore):
    """Watches are made only once `serving` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.serving = asyncio.Event()

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        await self.serving.wait()
        async for revision in super().watch(prefix, start_revision):
            yield revision


class FirstReadFails(MemoryStore):
    """The first list() fails (`failed` is then set); later ones answer."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = asyncio.Event()

    async def list(self, prefix: str) -> Listing:
        if not self.failed.is_set():
            self.failed.set()
            raise StoreUnavailable("etcd is not serving yet")
        return await super().list(prefix)


class NotServingYet(LateWatches, FirstReadFails):
    """Both: the first read fails, and watches are made once `serving` is
    set (etcd before its first election)."""


class ListingStore(MemoryStore):
    """Remembers each prefix listed (`listed`), in order: for reads that
    must list only the prefixes they need."""

    def __init__(self) -> None:
        super().__init__()
        self.listed: list[str] = []

    async def list(self, prefix: str) -> Listing:
        self.listed.append(prefix)
        return await super().list(prefix)
