"""Readiness that tells the truth: a replica without a table is not ready; a proxy neither.

The control plane runs for real on loopback (both gRPC ports) over the
in-memory store, whose outages the tests switch on and off. The same with a
real etcd, and with something that is not etcd, is in
tests/e2e/test_control_plane_health.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.api.routing import SERVICE as ROUTING_SERVICE
from controlplane.app import ControlPlane
from controlplane.readiness import LIVENESS, READINESS, STORE, Condition, statuses
from controlplane.settings import parse
from controlplane.store.memory import MemoryStore
from dataplane.http.server import build_app
from dataplane.http.state import DRAINING, HOLDER
from dataplane.settings import parse as parse_proxy
from ponto.devenv import free_port
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEADLINE = 10.0  # upper bound for a status to follow (probe period 1 s, builder backoff 2 s)


def test_statuses_tell_readiness_liveness_and_the_store_apart() -> None:
    assert statuses(Condition(has_table=False, store_ok=False)) == {
        READINESS: NOT_SERVING,
        ROUTING_SERVICE: NOT_SERVING,
        LIVENESS: SERVING,
        STORE: NOT_SERVING,
    }
    assert statuses(Condition(has_table=False, store_ok=True))[READINESS] == NOT_SERVING
    # A table and no store: serve it (static stability), and say the store is away.
    away = statuses(Condition(has_table=True, store_ok=False))
    assert (away[READINESS], away[ROUTING_SERVICE], away[STORE]) == (
        SERVING,
        SERVING,
        NOT_SERVING,
    )


class Probes:
    """Health checks on both of a replica's ports."""

    def __init__(self, plane: ControlPlane) -> None:
        self._channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            for port in (plane.port, plane.health_port)
        ]

    async def statuses(self, service: str) -> set[int]:
        """The status of service as each port reports it."""
        got = set()
        for channel in self._channels:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            got.add(reply.status)
        return got

    async def wait(self, service: str, status: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while (now := await self.statuses(service)) != {status}:
            assert loop.time() < deadline, f"{service!r} is {now}, not {status}"
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


@pytest.fixture
async def outage() -> MemoryStore:
    store = MemoryStore()
    store.available = False
    return store


@pytest.fixture
async def probes(outage: MemoryStore) -> AsyncIterator[Probes]:
    """A replica started while its store is down; it has never read its state."""
    settings = parse(["--listen", "127.0.0.1:0", "--health-listen", "127.0.0.1:0", "--id", "r1"])
    plane = ControlPlane(settings, outage)
    await plane.start()
    probes = Probes(plane)
    try:
        yield probes
    finally:
        await probes.close()
        await plane.stop(grace=0)


async def test_replica_that_never_read_the_store_is_alive_but_not_ready(
    probes: Probes, outage: MemoryStore
) -> None:
    assert await probes.statuses(READINESS) == {NOT_SERVING}
    assert await probes.statuses(ROUTING_SERVICE) == {NOT_SERVING}
    assert await probes.statuses(STORE) == {NOT_SERVING}
    assert await probes.statuses(LIVENESS) == {SERVING}
    outage.available = True
    await probes.wait(READINESS, SERVING)
    assert await probes.statuses(ROUTING_SERVICE) == {SERVING}
    await probes.wait(STORE, SERVING)


async def test_store_outage_after_the_first_table_keeps_readiness(
    probes: Probes, outage: MemoryStore
) -> None:
    outage.available = True
    await probes.wait(READINESS, SERVING)
    await probes.wait(STORE, SERVING)
    outage.available = False
    await probes.wait(STORE, NOT_SERVING)
    assert await probes.statuses(READINESS) == {SERVING}
    assert await probes.statuses(LIVENESS) == {SERVING}
    outage.available = True
    await probes.wait(STORE, SERVING)


# ---------------------------------------------------------------- the proxy


async def test_the_model_list_without_a_route_table_is_a_503_as_a_call_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trial 17: `GET /v1/models` answered 200 with no model (a client reads
    "this gateway serves none") where a chat call got 503 no_route_table.
    Both wait for a first table, then refuse alike."""
    monkeypatch.setattr("dataplane.sync.holder.FIRST_TABLE_WAIT_S", 0.05)
    settings = parse_proxy(["--region", "us-east", "--control-plane", f"127.0.0.1:{free_port()}"])
    app = build_app(settings)
    async with TestClient(TestServer(app)) as client:
        for path, body in (
            ("/v1/models", None),
            ("/v1/models/m", None),  # trial 18: a 404 model_not_found
            ("/v1/chat/completions", {"model": "m"}),
        ):
            resp = await (client.get(path) if body is None else client.post(path, json=body))
            assert resp.status == 503, path
            assert resp.headers["retry-after"] == "1"
            assert (await resp.json())["error"]["code"] == "no_route_table"
        # One that comes while it waits gets the table's models.
        monkeypatch.setattr("dataplane.sync.holder.FIRST_TABLE_WAIT_S", 10.0)
        holder = app[HOLDER]
        waiting = asyncio.Event()
        wait_first = holder.wait_first

        async def noted(within: float | None = None) -> bool:
            waiting.set()
            return await wait_first(within)

        monkeypatch.setattr(holder, "wait_first", noted)
        listing = asyncio.create_task(client.get("/v1/models"))
        await asyncio.wait_for(waiting.wait(), 10)  # the request waits for a table
        holder.apply(one_model_table(), "control-plane")
        resp = await listing
        assert resp.status == 200
        assert [m["id"] for m in (await resp.json())["data"]] == ["m"]


def one_model_table() -> pb.RouteTable:
    table = pb.RouteTable(
        version=7,
        regions=[pb.Region(name="us-east", latitude=39.0, longitude=-77.0)],
        origins=[
            pb.Origin(name="o", base_url="http://o.example/v1", region="us-east",
                      models=["m"], weight=100, healthy=True)
        ],
    )  # fmt: skip
    table.etag = content_etag(table)
    return table


async def test_proxy_is_not_ready_until_it_holds_a_route_table() -> None:
    # Nothing listens on the control plane address: no table arrives.
    control = f"127.0.0.1:{free_port()}"
    settings = parse_proxy(["--region", "us-east", "--control-plane", control])
    app = build_app(settings)
    client: TestClient[web.Request, web.Application] = TestClient(TestServer(app))
    await client.start_server()
    try:
        resp = await client.get("/readyz")
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "no_route_table"
        assert (await client.get("/healthz")).status == 200  # alive all the same
        app[HOLDER].apply(one_model_table(), "control-plane")
        resp = await client.get("/readyz")
        assert resp.status == 200, await resp.text()
        # A worker leaving its group to a successor in a reload: the group
        # is as ready as it was (its successor listens on the port).
        app[DRAINING].active = app[DRAINING].leaving = True
        resp = await client.get("/readyz")
        assert resp.status == 200, await resp.text()
        assert resp.headers["connection"] == "close"  # the next probe goes to another
        # Draining: no longer ready, so a load balancer sends it nothing new.
        app[DRAINING].leaving = False
        resp = await client.get("/readyz")
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "draining"
        assert (await client.get("/healthz")).status == 200
    finally:
        await client.close()


async def test_a_request_before_the_first_table_waits_for_it() -> None:
    # A worker that has just started is reachable before its table arrives (it
    # shares the port with siblings that are ready): the request waits for the
    # table instead of answering 503, and is refused only if none comes.
    control = f"127.0.0.1:{free_port()}"
    app = build_app(parse_proxy(["--region", "us-east", "--control-plane", control]))
    client: TestClient[web.Request, web.Application] = TestClient(TestServer(app))
    await client.start_server()
    try:
        request = asyncio.ensure_future(
            client.post("/v1/chat/completions", json={"model": "nope", "messages": []})
        )
        await asyncio.sleep(0.1)  # the request is in, waiting on the holder
        assert not request.done()
        table = pb.RouteTable(
            version=7, regions=[pb.Region(name="us-east", latitude=39.0, longitude=-77.0)]
        )
        table.etag = content_etag(table)
        app[HOLDER].apply(table, "control-plane")
        resp = await request
        # Answered on the table (no such model), not refused for want of one.
        body = await resp.json()
        assert body["error"]["code"] != "no_route_table", body
    finally:
        await client.close()
