"""ListOrigins (`pontoctl get origins`' INFLIGHT) reports an origin's requests
as the leader's latest load scrape read them, as the status page does, and
never the health record's figure, which is not kept current (trial 94: after
a request ended an origin of capacity 64 read 1/64 while its metrics said 0
running; since load left the tables the record's figure is only rewritten
with a flip of health)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from controlplane.api.admin import AdminService
from controlplane.audit import AuditLog
from controlplane.catalog import Catalog
from controlplane.distribute import Publisher
from controlplane.model import Origin, OriginHealth, Region
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb


@contextlib.asynccontextmanager
async def admin(
    catalog: Catalog, store: MemoryStore, loads: Callable[[], pb.OriginLoads | None]
) -> AsyncIterator[Any]:
    server = grpc.aio.server()
    service = AdminService(
        catalog,
        Publisher("cp-1"),
        AuditLog(store, replica="cp-1"),
        token_required=False,
        loads=loads,
    )
    admin_pb2_grpc.add_AdminServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield admin_pb2_grpc.AdminStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def seeded() -> tuple[Catalog, MemoryStore]:
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.put_region(Region("us-east", 38.9, -77.4), allow_update=False)
    for origin in (
        Origin("vllm-1", "http://vllm-1:8000/v1", "us-east", ("m",), capacity=64),
        Origin("vllm-2", "http://vllm-2:8000/v1", "us-east", ("m",), capacity=64),
        Origin("hosted", "https://api.example/v1", "us-east", ("m",), probe=False),
    ):
        await catalog.put_origin(origin, allow_update=False)
    # As the prober last wrote them: one request in flight on each.
    for name in ("vllm-1", "vllm-2", "hosted"):
        await catalog.put_health(OriginHealth(name, healthy=True, inflight=1.0))
    return catalog, store


async def inflight(loads: pb.OriginLoads | None) -> dict[str, tuple[float, bool]]:
    catalog, store = await seeded()
    async with admin(catalog, store, lambda: loads) as stub:
        answer = await stub.ListOrigins(apb.ListRequest())
    return {o.name: (o.inflight, o.inflight_unknown) for o in answer.origins}


async def test_an_origins_requests_are_the_latest_scrapes() -> None:
    scraped = pb.OriginLoads(
        generation=7,
        loads=[
            pb.OriginLoad(origin="vllm-1", running=0, waiting=0),
            # Not scraped: an origin probing is off for has no load to read.
            pb.OriginLoad(origin="hosted", running=5, waiting=0),
        ],
    )
    assert await inflight(scraped) == {
        "vllm-1": (0.0, False),  # idle now, as its metrics say
        "vllm-2": (0.0, True),  # no scrape of it: unknown, not the record's 1
        "hosted": (0.0, True),
    }


async def test_without_a_scrape_every_origins_load_is_unknown() -> None:
    """No leader scraping (LoadHub.fresh is None): the records' figures
    are as old as their last flip of health, and a 0 would look measured."""
    assert await inflight(None) == {
        "vllm-1": (0.0, True),
        "vllm-2": (0.0, True),
        "hosted": (0.0, True),
    }
