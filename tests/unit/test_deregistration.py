"""A proxy that stops deregisters (Routing.Deregister): its registration goes
at once, not STREAM_GRACE after its Register when it never opened its route
stream; only its own process's, whichever replica holds it; and a Register
or a route stream of that process that comes after is not listed.

The registry over the in-memory store (two registries over one store are
two replicas), and the proxy's link against a Routing server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from controlplane.api.routing import RoutingService
from controlplane.catalog import Catalog
from controlplane.distribute import Publisher
from controlplane.errors import Departed
from controlplane.registry import ProxyRegistry
from controlplane.store.memory import MemoryStore
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.v1 import routing_pb2 as pb
from ponto.v1 import routing_pb2_grpc
from tests.unit.test_link_loads import ScriptedRouting
from tests.unit.test_registration_deadline import (
    HeldPutStore,
    RefusingStream,
    SlowStore,
    fleet,
    lose_lease,
    two_replicas,
)

STARTED = 100.5


async def test_a_registration_deregistered_goes_at_once_and_once() -> None:
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    gone = await registry.register("p-gone", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    kept = await registry.register("p-kept", "eu", "127.0.0.1:2", "1", started_at=STARTED)
    await registry.flush(0.0)  # its grace starts: it has not ended
    assert await registry.deregister("p-gone", gone.session_id, STARTED)
    assert await fleet(catalog) == ["p-kept"]
    assert registry.ended(gone.session_id).is_set()
    # Its stream, arriving after all, is refused (the proxy was stopping).
    assert not registry.streaming(gone.session_id)
    # Asked again (a retry), nothing more goes.
    assert not await registry.deregister("p-gone", gone.session_id, STARTED)
    assert set(registry.sessions) == {kept.session_id}


async def test_only_the_deregistering_process_registration_goes() -> None:
    """A session or a start that is not the registration's names another
    process of the name (a group worker's successor): it stays."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    successor = await registry.register("g-w0", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    assert not await registry.deregister("g-w0", "the-worker's-session", STARTED - 50)
    assert not await registry.deregister("g-w0", "", STARTED - 50)
    assert await fleet(catalog) == ["g-w0"]
    assert set(registry.sessions) == {successor.session_id}
    # Its own start, with no session said (its Register unanswered), names it.
    assert await registry.deregister("g-w0", "", STARTED)
    assert await fleet(catalog) == []


async def test_a_session_of_another_replica_is_dropped_there_not_written_back() -> None:
    """Review's HA case: the proxy registered on one replica and its
    Deregister reached another. The holder finds its key missing at its
    next read, as after a lease lost, and would write it back: the
    departure noted tells it to drop the session, and its stream ends."""
    catalog, here, there = two_replicas()
    held = await there.register("p1", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    assert there.streaming(held.session_id)  # the stream is open there
    assert await here.deregister("p1", held.session_id, STARTED)
    assert await fleet(catalog) == []
    assert await there.drop_superseded()
    assert there.sessions == {}
    assert there.ended(held.session_id).is_set()
    assert await there.self_check()
    assert await fleet(catalog) == []


async def test_a_self_check_drops_a_session_deregistered_elsewhere() -> None:
    catalog, here, there = two_replicas()
    held = await there.register("p1", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    assert await here.deregister("p1", "", STARTED)
    assert await there.self_check()  # the watch's read missed it
    assert there.sessions == {}
    assert there.ended(held.session_id).is_set()
    assert await fleet(catalog) == []


async def test_a_rewrite_after_a_lost_lease_skips_a_session_deregistered_meanwhile() -> None:
    catalog, here, there = two_replicas()
    held = await there.register("p1", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    kept = await there.register("p2", "eu", "127.0.0.1:2", "1", started_at=STARTED)
    await lose_lease(catalog, there)
    # No key to remove: the process is named by its start, as a proxy
    # stopped in its Register names itself.
    assert not await here.deregister("p1", "", STARTED)
    await there._rewrite()
    assert await fleet(catalog) == ["p2"]
    assert set(there.sessions) == {kept.session_id}
    assert there.ended(held.session_id).is_set()


async def test_a_register_under_way_when_its_process_deregisters_leaves_nothing() -> None:
    """The proxy stopped before its Register was answered: its Deregister
    names its start, and may be handled before the Register's write. The
    Register, reading the departure after its write, removes its key."""
    store = HeldPutStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    await registry.lease()
    store.hold = True
    registering = asyncio.create_task(
        registry.register("p1", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    )
    await store.held.wait()  # it has read the name's key: its write comes next
    assert not await registry.deregister("p1", "", STARTED)
    store.release.set()
    with pytest.raises(Departed):
        await registering
    assert await fleet(catalog) == []
    assert registry.sessions == {}
    assert registry._unstreamed == {}
    # A later process of the name registers as ever.
    later = await registry.register("p1", "eu", "127.0.0.1:1", "1", started_at=STARTED + 1)
    assert registry.streaming(later.session_id)
    assert await fleet(catalog) == ["p1"]


async def test_a_register_cut_by_its_proxys_stop_goes_with_its_deregistration_unwarned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxy stopped during its Register: gRPC cancelled the call after
    its write, and the proxy's Deregister, naming its start, removes the key
    at once; the grace's sweep then finds nothing to remove and warns of no
    route stream never opened."""
    store = SlowStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp", stream_grace=10.0)
    await registry.lease()
    await registry.flush(0.0)
    call = asyncio.create_task(
        registry.register("p-cut", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    )
    while not await fleet(catalog):
        await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    store.release.set()
    assert await registry.deregister("p-cut", "", STARTED)
    assert await fleet(catalog) == []
    caplog.set_level(logging.DEBUG, "controlplane.registry")
    await registry.flush(1.0)
    await registry.flush(11.0)
    assert registry._unstreamed == {}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_the_routing_service_refuses_a_deregistration_that_names_nothing() -> None:
    registry = ProxyRegistry(Catalog(MemoryStore()), "cp", stream_grace=10.0)
    routing = RoutingService(registry, Publisher("cp"))
    for request in (
        pb.DeregisterRequest(name="p1"),
        pb.DeregisterRequest(name="p1", started_at=float("nan")),
        pb.DeregisterRequest(name="bad name", session_id="s"),
        pb.DeregisterRequest(name="p1", session_id="s" * 1000),
    ):
        with pytest.raises(Exception) as refused:
            await routing.deregister(request, RefusingStream())
        assert getattr(refused.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT, request
    record = await registry.register("p1", "eu", "127.0.0.1:1", "1", started_at=STARTED)
    reply = await routing.deregister(
        pb.DeregisterRequest(name="p1", session_id=record.session_id), RefusingStream()
    )
    assert reply.removed


# ---------------------------------------------------------------- the proxy's link


class Routing(ScriptedRouting):
    """Registers anyone as session s-1 (or, with `answer` clear, holds each
    Register unanswered); each route stream stays open, sending nothing;
    Deregister calls are kept."""

    def __init__(self, script: list[pb.RouteUpdate] | None = None) -> None:
        super().__init__(script or [])
        self.answer = asyncio.Event()
        self.answer.set()
        self.registers = 0
        self.deregistered: list[pb.DeregisterRequest] = []

    async def register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        self.registers += 1
        await self.answer.wait()
        return await super().register(request, context)

    async def deregister(
        self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeregisterResponse:
        self.deregistered.append(request)
        return pb.DeregisterResponse(removed=True)

    def handler(self) -> grpc.GenericRpcHandler:
        older = super().handler()
        deregister = grpc.unary_unary_rpc_method_handler(
            self.deregister,
            request_deserializer=pb.DeregisterRequest.FromString,
            response_serializer=pb.DeregisterResponse.SerializeToString,
        )

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> Any:
                if details.method == "/ponto.v1.Routing/Deregister":
                    return deregister
                return older.service(details)

        return Handler()


@contextlib.asynccontextmanager
async def serving(service: ScriptedRouting) -> AsyncIterator[int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


def link_to(port: int) -> ControlPlaneClient:
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:9", started_at=STARTED)
    return ControlPlaneClient(TableHolder("eu-west", None), [f"127.0.0.1:{port}"], info)


async def until(check: Any) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_proxy_stopped_once_registered_deregisters_its_session() -> None:
    service = Routing()
    async with serving(service) as port:
        task = asyncio.create_task(link_to(port).run())
        await until(lambda: service.first is not None)  # its stream subscribed
        await stopped(task)
    assert service.deregistered == [
        pb.DeregisterRequest(name="p1", session_id="s-1", started_at=STARTED)
    ]


async def test_a_proxy_whose_stream_answered_leaves_its_removal_to_the_streams_end() -> None:
    """Review 290: a Deregister sent after a stream that had answered raced
    the stream's end at the control plane, and wrote a departure note for
    nothing (or held the stop up to its deadline at a replica that hangs)."""
    service = Routing([pb.RouteUpdate(loads=pb.OriginLoads(generation=1))])
    async with serving(service) as port:
        link = link_to(port)
        task = asyncio.create_task(link.run())
        await until(lambda: link.loads_generation == 1)
        await stopped(task)
    assert service.deregistered == []


async def test_a_proxy_stopped_in_its_register_deregisters_its_process() -> None:
    service = Routing()
    service.answer.clear()
    async with serving(service) as port:
        task = asyncio.create_task(link_to(port).run())
        await until(lambda: service.registers == 1)
        await stopped(task)
    assert service.deregistered == [pb.DeregisterRequest(name="p1", started_at=STARTED)]


async def test_an_older_control_plane_without_deregister_is_left_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = ScriptedRouting([])  # Register and RouteStream only
    caplog.set_level(logging.DEBUG, "dataplane.sync.link")
    async with serving(service) as port:
        task = asyncio.create_task(link_to(port).run())
        await until(lambda: service.first is not None)
        await stopped(task)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "Deregister" in r.getMessage()]
    assert said == [
        (logging.DEBUG, f"control plane at 127.0.0.1:{port} predates Deregister: its grace applies")
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "regist" in r.msg]


async def test_a_stop_grpc_takes_for_the_registers_end_deregisters_and_warns_of_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop landing as the Register completes is taken by grpc.aio for the
    call's end: the call raises its status, OK (the control plane registered
    the process), and the stop is read from the task after. The link had
    forgotten the registration (none to deregister: listed until the
    control plane's grace) and warned of a failure `[OK]; retrying`."""
    service = Routing()
    link = link_to(0)

    made = routing_pb2_grpc.RoutingStub

    def stub(channel: grpc.aio.Channel) -> Any:
        routing: Any = made(channel)
        register = routing.Register

        async def taken(request: pb.RegisterRequest, **options: Any) -> pb.RegisterResponse:
            await register(request, **options)  # registered at the control plane
            link.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)  # the stop lands here, taken for the call's end
            raise grpc.aio.AioRpcError(grpc.StatusCode.OK, grpc.aio.Metadata(), grpc.aio.Metadata())

        routing.Register = taken
        return routing

    monkeypatch.setattr(routing_pb2_grpc, "RoutingStub", stub)
    async with serving(service) as port:
        link._addresses = [f"127.0.0.1:{port}"]
        with (
            caplog.at_level(logging.INFO, logger="dataplane.sync.link"),
            pytest.raises(asyncio.CancelledError),
        ):
            await asyncio.wait_for(link.run(), 10)
    assert service.registers == 1
    assert service.deregistered == [pb.DeregisterRequest(name="p1", started_at=STARTED)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
