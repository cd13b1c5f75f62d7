"""A replica stopping with proxies' route streams open ends them and waits for
their handlers: nothing is left for asyncio.run to cancel, which gRPC logs as an
ERROR ("Exception not handled by _handle_exceptions") with CancelledError
tracebacks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from controlplane.app import ControlPlane
from controlplane.settings import parse
from controlplane.store.memory import MemoryStore
from ponto.v1 import routing_pb2 as pb
from ponto.v1 import routing_pb2_grpc
from tests.loops import SelectorLoop

PROXIES = 2  # a proxy's two workers, each with its own stream


async def until(check: Callable[[], bool], what: str) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def stop_with_open_streams(*, proxies_leave_too: bool) -> list[str]:
    """Start a replica, open PROXIES streams, stop it (the proxies cancelling
    their streams at the same moment when `proxies_leave_too`); the statuses
    the streams ended with."""
    plane = ControlPlane(parse(["--listen", "127.0.0.1:0", "--id", "cp-t"]), MemoryStore())
    await plane.start()
    ended: list[str] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}") as channel:
        stub = routing_pb2_grpc.RoutingStub(channel)
        calls = []
        for i in range(PROXIES):
            info = pb.ProxyInfo(name=f"p-w{i}", region="r", address="10.0.0.1:8080")
            reg = await stub.Register(pb.RegisterRequest(proxy=info), timeout=10)

            async def requests(session_id: str = reg.session_id) -> AsyncIterator[pb.RouteRequest]:
                yield pb.RouteRequest(session_id=session_id)
                await asyncio.Event().wait()  # a proxy sends nothing more unless pushed to

            calls.append(stub.RouteStream(requests()))
        await until(lambda: plane.routing.streams == PROXIES, "streams open")
        if proxies_leave_too:
            for call in calls:
                call.cancel()
        await plane.stop()
        assert plane.routing.streams == 0
        assert plane.registry.sessions == {}
        for call in calls:
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                ended.append(f"{exc.code().name} {exc.details()}")
            except asyncio.CancelledError:
                ended.append("CANCELLED by the proxy")
            else:
                ended.append("OK")
    return ended


@pytest.mark.parametrize("proxies_leave_too", [False, True], ids=["replica-stops", "all-stop"])
def test_stopping_with_open_streams_is_quiet(
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    proxies_leave_too: bool,
) -> None:
    # Its own loop, ended by a runner as the replica's main (asyncio.run) is;
    # one of tests/loops.py's, as the streams cancelled here may complete in
    # gRPC's core after it closed.
    with caplog.at_level(logging.WARNING), asyncio.Runner(loop_factory=SelectorLoop) as runner:
        ended = runner.run(stop_with_open_streams(proxies_leave_too=proxies_leave_too))
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    assert "CancelledError" not in capsys.readouterr().err
    if not proxies_leave_too:
        assert ended == ["UNAVAILABLE control plane cp-t is shutting down"] * PROXIES
