"""A proxy that stops leaves ListProxies at once (Routing.Deregister), not
after the control plane's stream grace (15 s), whichever replica it asks.

Two control plane replicas over the session etcd, behind their token guard
(the Routing service's bootstrap token, as Register's), and a proxy's own
link. Each replica's route streams are held before they subscribe, as for a
proxy stopped between its Register and its RouteStream: nothing but a
deregistration removes the registration within the grace, which no test
here waits for (the registries' flushes are not given a time past it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from controlplane.app import ControlPlane
from controlplane.settings import parse
from controlplane.store.etcd import EtcdStore
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.grpcconn import ClientOptions
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc, routing_pb2_grpc
from ponto.v1 import routing_pb2 as pb
from tests.conftest import EtcdEndpoint
from tests.integration.test_etcd_restore import until
from tests.unit.test_quotasync import running

pytestmark = pytest.mark.integration

BOOTSTRAP = "bootstrap-secret"
ADMIN = "admin-secret"
STARTED_AT = 1_700_000_000.25


class Replicas:
    def __init__(self, planes: list[ControlPlane]) -> None:
        self.planes = planes
        # Route streams that reached a replica and are held there.
        self.held = 0

    async def listed(self) -> list[str]:
        """ListProxies, as pontoctl calls it (the admin token), of replica 0."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.planes[0].port}") as channel:
            reply = await admin_pb2_grpc.AdminStub(channel).ListProxies(
                apb.ListRequest(), metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=5
            )
        return [p.info.name for p in reply.proxies]

    def sessions(self, index: int) -> set[str]:
        return {r.name for r in self.planes[index].registry.sessions.values()}


@pytest.fixture
async def replicas(etcd_endpoint: EtcdEndpoint, tmp_path: Path) -> AsyncIterator[Replicas]:
    (tmp_path / "bootstrap").write_text(BOOTSTRAP)
    (tmp_path / "admin").write_text(ADMIN)
    planes: list[ControlPlane] = []
    stores: list[EtcdStore] = []
    out = Replicas(planes)

    async def held(requests: Any, context: Any) -> None:
        out.held += 1
        await asyncio.Event().wait()  # until the proxy goes: its stream never subscribes

    try:
        for index in range(2):
            settings = parse(
                [
                    "--etcd", etcd_endpoint.url,
                    "--listen", "127.0.0.1:0",
                    "--id", f"cp-{index}",
                    "--probe-interval-ms", "60000",
                    "--bootstrap-token-file", str(tmp_path / "bootstrap"),
                    "--admin-token-file", str(tmp_path / "admin"),
                ]
            )  # fmt: skip
            store = EtcdStore(settings.etcd)
            await store.connect()
            stores.append(store)
            plane = ControlPlane(settings, store)
            plane.routing.route_stream = held  # type: ignore[method-assign]
            await plane.start()
            planes.append(plane)
        yield out
    finally:
        for plane in planes:
            await plane.stop(grace=0)
        for store in stores:
            await store.close()


@contextlib.asynccontextmanager
async def running_proxy(port: int) -> AsyncIterator[asyncio.Task[None]]:
    """A proxy's link to the replica on `port`, cancelled (the proxy stopping)
    by the caller or at the end."""
    link = ControlPlaneClient(
        TableHolder("east", None),
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", started_at=STARTED_AT),
        credentials=ClientOptions(token=BOOTSTRAP),
    )
    async with running(link.run()) as task:
        yield task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_proxy_stopped_before_its_stream_opened_leaves_the_list_at_once(
    replicas: Replicas,
) -> None:
    async with running_proxy(replicas.planes[0].port) as proxy:
        await until(lambda: replicas.held == 1, "the proxy's route stream reached the replica")
        assert await replicas.listed() == ["p1"]
        await stop(proxy)
        # Its Deregister was answered before the link's task ended.
        assert await replicas.listed() == []
        assert replicas.sessions(0) == set()


async def deregister(port: int, request: pb.DeregisterRequest) -> pb.DeregisterResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply: pb.DeregisterResponse = await routing_pb2_grpc.RoutingStub(channel).Deregister(
            request, metadata=(("authorization", f"Bearer {BOOTSTRAP}"),), timeout=5
        )
    return reply


async def test_a_deregistration_through_another_replica_is_not_written_back(
    replicas: Replicas, caplog: pytest.LogCaptureFixture
) -> None:
    """The proxy registered on replica 0 (which holds its session, and
    writes its key back when it finds it missing: a lease lost, etcd
    restored); its deregistration reached replica 1. Replica 0 drops the
    session at its next read of the registrations, with no warning of a key
    missing, and its self-check writes nothing back."""
    caplog.set_level(logging.INFO, "controlplane.registry")
    async with running_proxy(replicas.planes[0].port):
        await until(lambda: replicas.held == 1, "the proxy's route stream reached the replica")
        [session_id] = replicas.planes[0].registry.sessions
        request = pb.DeregisterRequest(name="p1", session_id=session_id, started_at=STARTED_AT)
        assert (await deregister(replicas.planes[1].port, request)).removed
        assert await replicas.listed() == []
        await until(lambda: replicas.sessions(0) == set(), "replica 0 dropped the session")
        assert await replicas.planes[0].registry.self_check()
        assert await replicas.listed() == []
        assert "not in the state store" not in caplog.text
        # Again, as a retry would: nothing more is removed.
        assert not (await deregister(replicas.planes[1].port, request)).removed


async def test_a_deregistration_needs_the_bootstrap_token(replicas: Replicas) -> None:
    async with running_proxy(replicas.planes[0].port):
        await until(lambda: replicas.held == 1, "the proxy's route stream reached the replica")
        [session_id] = replicas.planes[0].registry.sessions
        async with grpc.aio.insecure_channel(f"127.0.0.1:{replicas.planes[1].port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await routing_pb2_grpc.RoutingStub(channel).Deregister(
                    pb.DeregisterRequest(name="p1", session_id=session_id), timeout=5
                )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert await replicas.listed() == ["p1"]
