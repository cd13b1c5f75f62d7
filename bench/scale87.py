"""The control plane at a large fleet's size: one change's cost, the event
loop's worst stall meanwhile, and the Admin reads, on an in-memory store.

    PYTHONPATH=. .venv/bin/python -m bench.scale87 --keys 20000

Writes 25 regions, 300 origins, 500 tenants and `--keys` keys in the records
CreateKey stores, then times (a) a build after one key is added (its read,
decode, compile and publish) with a probe task measuring the loop's worst
stall, and (c) list_regions, list_origins, list_tenants and the reads a key
creation makes (CreateKey's key_model_warnings).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from controlplane.builder import TableBuilder
from controlplane.catalog import KEYS, ORIGINS, REGIONS, TENANTS, Catalog
from controlplane.distribute import Publisher
from controlplane.model import ApiKeyRecord, Limits, Origin, Region, Tenant, encode
from controlplane.store.base import StateStore, Write
from controlplane.store.etcd import EtcdStore
from controlplane.store.memory import MemoryStore
from ponto.apikeys import issue_key


def topology_writes() -> list[Write]:
    writes: list[Write] = []
    for r in range(25):
        writes.append(Write(REGIONS + f"r{r}", encode(Region(f"r{r}", r - 12.0, r * 7.0 - 90))))
    for o in range(300):
        models = (f"m{o % 60}", f"m{o % 60}-lora")
        origin = Origin(f"o{o}", f"http://127.0.0.1:{20000 + o}", f"r{o % 25}", models)
        writes.append(Write(ORIGINS + f"o{o}", encode(origin)))
    for t in range(500):
        limits = Limits(rpm=600) if t % 2 else Limits()
        writes.append(Write(TENANTS + f"t{t}", encode(Tenant(f"t{t}", limits=limits))))
    return writes


def key_writes(keys: int) -> list[Write]:
    writes: list[Write] = []
    for k in range(keys):
        issued = issue_key()
        record = ApiKeyRecord(
            id=issued.key_id,
            hash=issued.key_hash,
            tenant=f"t{k % 500}",
            description="x" * 40,
            created_at=1.8e9 + k,
        )
        writes.append(Write(KEYS + record.id, encode(record)))
    return writes


async def fill(store: StateStore, keys: int, *, batch: int = 100) -> None:
    """The topology and `keys` keys, written `batch` a transaction."""
    writes = topology_writes() + key_writes(keys)
    for i in range(0, len(writes), batch):
        await store.commit(writes[i : i + batch])


class Probe:
    """The event loop's worst lateness of a 5 ms sleep, in seconds."""

    def __init__(self) -> None:
        self.worst = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, loop.time() - before - 0.005)


async def timed(label: str, coro: object) -> None:
    probe = Probe()
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(0.02)
    probe.worst = 0.0
    start = time.perf_counter()
    await coro  # type: ignore[misc]
    took = time.perf_counter() - start
    await asyncio.sleep(0.02)  # the probe wakes, late by the last stall
    task.cancel()
    print(f"{label:<34} {took * 1000:8.0f} ms   loop's worst stall {probe.worst * 1000:6.0f} ms")


async def load_etcd(endpoint: str, keys: int, batch: int, pace: float) -> None:
    """Write `keys` keys to the etcd at `endpoint`, `batch` a transaction (the
    topology too when none is stored), `pace` seconds apart: a bulk load,
    as trial 83 made."""
    store = EtcdStore([endpoint])
    await store.connect()
    try:
        writes = key_writes(keys)
        if await store.get(REGIONS + "r0") is None:
            writes = topology_writes() + writes
        start = time.perf_counter()
        for i in range(0, len(writes), batch):
            await store.commit(writes[i : i + batch])
            await asyncio.sleep(pace)
        print(f"{len(writes)} records in {time.perf_counter() - start:.1f} s")
    finally:
        await store.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--etcd", default="", help="write the keys to this etcd, and no more")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds between writes (--etcd)")
    args = parser.parse_args()
    if args.etcd:
        await load_etcd(args.etcd, args.keys, args.batch, args.pace)
        return
    store = MemoryStore()
    await fill(store, args.keys)
    catalog = Catalog(store)
    builder = TableBuilder(catalog, Publisher("bench"))
    await timed("first build", builder.build_once())
    await catalog.create_key("t1")
    await timed("build after one key", builder.build_once())
    await catalog.create_key("t2")
    await timed("build after one more key", builder.build_once())
    await timed("list_regions", catalog.list_regions())
    await timed("list_origins", catalog.list_origins())
    await timed("list_tenants", catalog.list_tenants())
    key = (await catalog.create_key("t3")).record
    await timed("key_model_warnings (key create)", catalog.key_model_warnings(key))


if __name__ == "__main__":
    asyncio.run(main())
