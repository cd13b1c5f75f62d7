"""dataplane.sync.link: pushed origin loads reach `on_loads`, newest generation only.

A scripted Routing server on loopback (real gRPC) sends the pushes, so the
link is exercised as it runs against a control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import grpc
import pytest

from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto import linkadvice
from ponto.grpcconn import ClientOptions, CredentialError
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_table_holder import table

WAIT = 5.0


def loads(generation: int, running: float) -> pb.RouteUpdate:
    return pb.RouteUpdate(
        loads=pb.OriginLoads(
            generation=generation,
            scraped_at=1_700_000_000.0 + generation,
            loads=[pb.OriginLoad(origin="gpu-1", running=running, waiting=0.0)],
        )
    )


class ScriptedRouting:
    """Registers anyone; each RouteStream sends `script` and then stays open."""

    def __init__(self, script: list[pb.RouteUpdate]) -> None:
        self.script = script
        self.first: pb.RouteRequest | None = None  # the stream's subscription

    async def register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        return pb.RegisterResponse(session_id="s-1", control_plane_id="scripted", fleet_size=1)

    async def route_stream(
        self, requests: AsyncIterator[pb.RouteRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.RouteUpdate]:
        self.first = await anext(requests)
        for update in self.script:
            yield update
        await asyncio.Event().wait()  # until the client goes

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "ponto.v1.Routing",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self.register,
                    request_deserializer=pb.RegisterRequest.FromString,
                    response_serializer=pb.RegisterResponse.SerializeToString,
                ),
                "RouteStream": grpc.stream_stream_rpc_method_handler(
                    self.route_stream,
                    request_deserializer=pb.RouteRequest.FromString,
                    response_serializer=pb.RouteUpdate.SerializeToString,
                ),
            },
        )


async def test_on_loads_gets_every_push_except_older_generations() -> None:
    # A lagging replica's view (generation 3) after a newer one (5) is dropped;
    # the same generation again (another replica after a reconnect) is not older.
    script = [loads(5, 1.0), loads(3, 9.0), loads(7, 2.0), loads(7, 3.0)]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((ScriptedRouting(script).handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    got: list[pb.OriginLoads] = []
    arrived = asyncio.Event()

    def on_loads(pushed: pb.OriginLoads) -> None:
        got.append(pushed)
        arrived.set()

    link = ControlPlaneClient(
        TableHolder("east", None),
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test"),
        on_loads=on_loads,
    )
    task = asyncio.create_task(link.run())
    try:
        async with asyncio.timeout(WAIT):
            while len(got) < 3:
                arrived.clear()
                await arrived.wait()
        await asyncio.sleep(0.05)  # nothing more comes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(0)
    assert [(p.generation, p.loads[0].running) for p in got] == [(5, 1.0), (7, 2.0), (7, 3.0)]
    assert link.loads_generation == 7
    assert link.quota_generation == 0  # loads are not quota shares


async def test_without_on_loads_pushes_are_only_counted_by_generation() -> None:
    server = grpc.aio.server()
    routing = ScriptedRouting([loads(4, 1.0)])
    server.add_generic_rpc_handlers((routing.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    link = ControlPlaneClient(
        TableHolder("east", None),
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test"),
    )
    task = asyncio.create_task(link.run())
    try:
        async with asyncio.timeout(WAIT):
            while link.loads_generation != 4:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(0)
    # The subscription says this proxy takes `unchanged` quota messages
    # (controlplane.quotasync sends them only to proxies that do).
    assert routing.first is not None and routing.first.takes_unchanged


class TakenRouting(ScriptedRouting):
    """Each RouteStream ends ABORTED, as a control plane ends the stream of a
    proxy whose name another process registered since."""

    def __init__(self) -> None:
        super().__init__([])
        self.registers = 0
        self.sent_at: list[float] = []

    async def register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        self.registers += 1
        self.sent_at.append(request.proxy.sent_at)
        return await super().register(request, context)

    async def route_stream(
        self, requests: AsyncIterator[pb.RouteRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.RouteUpdate]:
        self.first = await anext(requests)
        if self.first.session_id:  # always: the yield makes this a generator
            await context.abort(
                grpc.StatusCode.ABORTED, "proxy p1 registered again on another stream"
            )
        yield pb.RouteUpdate()


@pytest.mark.parametrize("in_group", [False, True])
async def test_a_link_whose_name_was_taken_waits_before_taking_it_back(
    caplog: pytest.LogCaptureFixture, in_group: bool
) -> None:
    """Rather than register again at once (a group's worker and its successor,
    or two proxies of one --name, would take turns), it waits `superseded_wait`
    and says why, once: a warning for a proxy alone (another has its --name),
    INFO in a group, where every reload's retired worker sees it (trial 16);
    other ends of a stream are retried after the short backoff."""
    caplog.set_level(logging.INFO)
    server = grpc.aio.server()
    routing = TakenRouting()
    server.add_generic_rpc_handlers((routing.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    waits: list[float] = []
    # Each wait holds the link until the test ends it: the link is always
    # where the test expects it (a gate left open had it register again as
    # fast as it could, and the stop land anywhere in that).
    gates: list[asyncio.Event] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        gates.append(asyncio.Event())
        await gates[-1].wait()

    link = ControlPlaneClient(
        TableHolder("east", None),
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test"),
        superseded_wait=30.0,
        in_group=in_group,
        sleep=sleep,
    )
    before = time.time()
    task = asyncio.create_task(link.run())
    try:
        async with asyncio.timeout(WAIT):
            while not waits:
                await asyncio.sleep(0.01)
        assert waits == [30.0]
        assert routing.registers == 1
        (said,) = [r for r in caplog.records if "another process registered" in r.message]
        assert said.levelno == (logging.INFO if in_group else logging.WARNING)
        assert said.message.startswith(
            f"another process registered as proxy p1 (this process is pid {os.getpid()}); "
            "it serves on with its last table and asks again in 30 s"
        )
        assert "retrying" not in said.message
        gates[0].set()  # the wait is over: it registers again, and waits again
        async with asyncio.timeout(WAIT):
            while len(waits) < 2:
                await asyncio.sleep(0.01)
        assert (waits, routing.registers) == ([30.0, 30.0], 2)
        # Each Register says the proxy's clock as it is sent (check_start).
        first, second = routing.sent_at
        assert before <= first <= second <= time.time()
        # stop() ends the link (a worker leaving to its successor).
        link.stop()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(0)


async def test_a_stop_that_grpc_takes_for_a_calls_end_still_ends_the_link() -> None:
    """A cancellation that lands as a gRPC call completes can reach the link
    as the call's end (its status), not as a CancelledError (3 and 4 stops
    in 600 were lost so, against a name taken again and again; this test's
    [False] case failed so, rarely): the link reads the
    request to stop before it waits, rather than register its name again for
    ever. Here the link's wait takes the cancellation, as gRPC can."""
    server = grpc.aio.server()
    routing = TakenRouting()
    server.add_generic_rpc_handlers((routing.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def sleep(seconds: float) -> None:
        link.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)  # the stop lands here, and is taken

    link = ControlPlaneClient(
        TableHolder("east", None),
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test"),
        superseded_wait=30.0,
        sleep=sleep,
    )
    task = asyncio.create_task(link.run())
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT)
        assert routing.registers == 2  # the session after the stop was taken, no more
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(0)


class StoppingRouting(ScriptedRouting):
    """Each RouteStream ends UNAVAILABLE as a replica that stops ends it."""

    async def route_stream(
        self, requests: AsyncIterator[pb.RouteRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.RouteUpdate]:
        if (await anext(requests)).session_id:  # always: the yield makes this a generator
            await context.abort(grpc.StatusCode.UNAVAILABLE, linkadvice.stopping("cp-2"))
        yield pb.RouteUpdate()


async def test_a_replica_stopping_is_said_at_info_without_tls_advice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica restarted in turn (a rolling upgrade) ends its proxies'
    streams in its own words: the proxy says so once, at INFO, and moves on,
    without the advice for a control plane it could not reach (trial 93: a
    WARNING telling a plaintext fleet to give TLS flags, on every restart)."""
    caplog.set_level(logging.DEBUG, logger="dataplane.sync.link")
    await waits_against(StoppingRouting([]), 2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    said = [r for r in caplog.records if "shutting down" in r.getMessage()]
    assert said[0].levelno == logging.INFO
    message = said[0].getMessage()
    assert message.startswith("control plane at 127.0.0.1:")
    assert message.endswith(": control plane cp-2 is shutting down; connecting to it again")


class CutRouting(ScriptedRouting):
    """Each RouteStream brings a table, then is cut as a replica stopped past
    its grace cuts it (gRPC's words for a server's cancelled calls)."""

    async def route_stream(
        self, requests: AsyncIterator[pb.RouteRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.RouteUpdate]:
        await anext(requests)
        yield pb.RouteUpdate(table=table(1))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")


class Middle(random.Random):
    """Jitter at the middle of its range, so that the range shows."""

    def uniform(self, a: float, b: float) -> float:
        return (a + b) / 2


class Ticks:
    """A monotonic clock 10 s further on at each reading: every session
    lasts past the longest backoff, as one that served does."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0
        return self.now


async def waits_against(routing: ScriptedRouting, count: int, **options: Any) -> list[float]:
    """The first `count` waits of a link to a replica serving `routing`, the
    link made with `options` (backoff, clock, credentials) and jitter at the
    middle of its range."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((routing.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)

    link = ControlPlaneClient(
        TableHolder("east", None),
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test"),
        backoff_min=1.0,
        sleep=sleep,
        rng=Middle(),
        **options,
    )
    task = asyncio.create_task(link.run())
    try:
        async with asyncio.timeout(WAIT):
            while len(waits) < count:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(0)
    return waits[:count]


async def test_a_session_cut_after_its_table_is_no_tls_mistake_and_comes_back_soon(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica killed, lost or stopped past its grace cuts a session under
    way: the control plane was reached, so a plaintext proxy is not told to
    give TLS flags, and a session that brought a table (and lasted the
    longest backoff) comes back after the short spread (0 to 5
    backoff-minimums), not the failures' backoff."""
    caplog.set_level(logging.INFO, logger="dataplane.sync.link")
    assert await waits_against(CutRouting([]), 2, backoff_max=1.0, monotonic=Ticks()) == [
        2.5,
        2.5,
    ]
    said = [r for r in caplog.records if "Cancelling all calls" in r.getMessage()]
    assert said[0].levelno == logging.WARNING
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    message = said[0].getMessage()
    assert message.startswith("control plane at 127.0.0.1:")
    assert message.endswith(
        " cut the session under way (Cancelling all calls): "
        "its replica stopped or was lost [UNAVAILABLE]; retrying"
    )


class FilesGone(ClientOptions):
    """Plaintext credentials whose TLS files are readable at the first
    session's check alone (a file removed since), as check_files says it."""

    checks: ClassVar[list[int]] = []

    def check_files(self, now: datetime.datetime) -> None:
        self.checks.append(1)
        if len(self.checks) > 1:
            raise CredentialError("cannot read TLS CA file /gone: No such file or directory")


async def test_a_session_failing_before_its_register_is_not_the_last_ones_table() -> None:
    """A session that brought a table, then sessions refused before their
    Register (a TLS file removed): those are failures, retried over the
    growing backoff, not at the short spread of the session before them."""
    waits = await waits_against(
        CutRouting([]), 3, backoff_max=8.0, credentials=FilesGone(), monotonic=Ticks()
    )
    # The cut session's spread (0 to 5 minimums), then full jitter over a
    # backoff doubling from the minimum: (1 + 2) / 2, then (1 + 4) / 2.
    assert waits == [2.5, 1.5, 2.5]


async def test_sessions_cut_just_after_their_table_back_off() -> None:
    """A replica that cuts every stream just after its table (crash-looping,
    a bug of the stream's) is a failing one: its proxies back off as from
    any failure, not back within the short spread each time."""
    # Each session ends as it starts (a clock that stands still).
    waits = await waits_against(CutRouting([]), 5, backoff_max=8.0, monotonic=lambda: 0.0)
    # Full jitter over a backoff doubling from the minimum to the maximum.
    assert waits == [1.0, 1.5, 2.5, 4.5, 4.5]


async def test_the_link_has_tried_once_its_first_table_is_applied_or_first_session_ended() -> None:
    """`tried` (the proxy then drops the file pages its start touched): set by
    the first table while its stream stays open, and by a session that ends
    without one (no control plane listening)."""
    server = grpc.aio.server()
    routing = ScriptedRouting([loads(1, 1.0), pb.RouteUpdate(table=table(3), nonce="n1")])
    server.add_generic_rpc_handlers((routing.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    holder = TableHolder("east", None)
    info = pb.ProxyInfo(name="p1", region="east", address="127.0.0.1:9", version="test")
    link = ControlPlaneClient(holder, [f"127.0.0.1:{port}"], info)
    alone = ControlPlaneClient(TableHolder("east", None), ["127.0.0.1:9"], info)
    assert not link.tried.is_set()
    tasks = [asyncio.create_task(link.run()), asyncio.create_task(alone.run())]
    try:
        async with asyncio.timeout(WAIT):
            await link.tried.wait()
            assert holder.routes is not None  # applied, not merely received
            assert link.loads_generation == 1
            assert link.connected  # the stream is open yet
            await alone.tried.wait()
            assert not alone.connected
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(0)
