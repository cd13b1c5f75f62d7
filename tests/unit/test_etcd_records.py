"""EtcdStore makes the records of a large range answer in a worker thread:
at 20,000 keys, making those of /ponto/state held the event loop 0.1 s a
read (up to 0.8 s on a busy machine) at every table build and health round."""

from __future__ import annotations

import threading
from typing import Any

from controlplane.store.base import KeyValue
from controlplane.store.etcd import _RECORDS_ON_LOOP, EtcdStore


class _Kv:
    """One etcd key as etcd3aio gives it; notes the thread that reads it."""

    def __init__(self, key: str, read_in: set[int]) -> None:
        self._key = key.encode()
        self._read_in = read_in
        self.value = b"v:" + self._key
        self.mod_revision = 7
        self.lease = 0
        self.create_revision = 3

    @property
    def key(self) -> bytes:
        self._read_in.add(threading.get_ident())
        return self._key


class _Range:
    """etcd's KV service answering every range with `count` keys, in
    etcd's key order (descending here for the listing's sort to show)."""

    def __init__(self, count: int) -> None:
        self.read_in: set[int] = set()
        self.count = count

    async def get(self, key: str, **_: Any) -> Any:
        kvs = [_Kv(f"{key}{i:05d}", self.read_in) for i in reversed(range(self.count))]
        return type("Resp", (), {"kvs": kvs, "header": type("H", (), {"revision": 9})()})()


def _store(kv: _Range) -> EtcdStore:
    store = EtcdStore(["127.0.0.1:1"], timeout=3.0)
    client: Any = store._client  # its KV service replaced by the fake above
    client.kv = kv
    return store


async def test_a_large_listing_is_made_off_the_event_loop() -> None:
    kv = _Range(_RECORDS_ON_LOOP)
    listing = await _store(kv).list("/p/")
    assert threading.get_ident() not in kv.read_in
    assert listing.revision == 9
    assert len(listing.items) == _RECORDS_ON_LOOP
    assert listing.items[0] == KeyValue("/p/00000", b"v:/p/00000", 7, 0, 3)
    assert [i.key for i in listing.items] == sorted(i.key for i in listing.items)


async def test_a_large_scan_is_made_off_the_event_loop() -> None:
    kv = _Range(_RECORDS_ON_LOOP)
    listing = await _store(kv).scan("/p/", "/p0")
    assert threading.get_ident() not in kv.read_in
    # A scan's order is etcd's (the fake's, descending): not sorted again.
    assert listing.items[0].key == f"/p/{_RECORDS_ON_LOOP - 1:05d}"
    assert len(listing.items) == _RECORDS_ON_LOOP


async def test_a_small_listing_is_made_on_the_event_loop() -> None:
    kv = _Range(3)
    listing = await _store(kv).list("/p/")
    assert kv.read_in == {threading.get_ident()}
    assert [i.key for i in listing.items] == ["/p/00000", "/p/00001", "/p/00002"]
