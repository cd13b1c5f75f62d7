"""A session with a control plane that ends its route stream leaves nothing
behind: trial 27 saw two asyncio ERRORs in a proxy's log ("Task was destroyed
but it is pending", "aclose(): asynchronous generator is already running")
when its hung replica's stream ended. The proxy's messages went through a
request iterator that gRPC consumed in a task of its own, which an ended call
left pending. A real gRPC server on loopback ends each stream at once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_link_loads import ScriptedRouting


class Ending(ScriptedRouting):
    """A replica that ends every route stream with UNAVAILABLE once it has
    read the proxy's subscription; it counts the subscriptions."""

    def __init__(self) -> None:
        super().__init__([])
        self.read = 0

    async def route_stream(  # type: ignore[override]
        self,
        requests: AsyncIterator[pb.RouteRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        await anext(requests)  # the subscription
        self.read += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")


async def test_a_stream_the_replica_ends_leaves_no_task_or_generator_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = Ending()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([service.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    link = ControlPlaneClient(TableHolder("eu-west", None), [f"127.0.0.1:{port}"], info)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(5):
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await link._session(f"127.0.0.1:{port}")
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                gc.collect()  # what a pending task's destruction waits for
                await asyncio.sleep(0)
    finally:
        await server.stop(None)
    assert service.read == 5  # each session's subscription was sent
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def test_a_report_that_fails_is_told_once_and_the_next_ones_go(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 46: a report that raised ended the reporting task, silently,
    and no report went for the rest of the session."""
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    # Reports as often as the loop turns: no time passes in the test.
    link = ControlPlaneClient(
        TableHolder("eu-west", None), ["127.0.0.1:1"], info, report_interval=0.0
    )
    made = 0
    real = link.report

    def report(session_id: str) -> pb.RouteRequest:
        nonlocal made
        made += 1
        if made in (2, 3):
            raise RuntimeError("a bug in a report")
        return real(session_id)

    monkeypatch.setattr(link, "report", report)
    outbox: asyncio.Queue[pb.RouteRequest] = asyncio.Queue()
    with caplog.at_level(logging.ERROR, logger="dataplane.sync.link"):
        task = asyncio.create_task(link._report("s-1", outbox))
        while made < 6 and not task.done():  # done: the task ended on the failure
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert outbox.qsize() == made - 2  # all but the two that failed
    [told] = caplog.records
    assert told.getMessage() == "could not make a report to the control plane"
    assert told.exc_info is not None
