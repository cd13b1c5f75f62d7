"""A proxy's report stays within what a replica takes (4 MiB a message:
controlplane.app). Past it the replica ended the stream (the proxy saw
INTERNAL), the proxy connected again and sent the next report, refused too,
its table and shares lost in between: `--workers 16 -> 1` carried 16 names'
rows (some 720 KB a 1,000 budgeted scopes), past the bound at about 5,800.
Carried rows go over successive reports in turn past CARRIED_REPORT_BYTES;
a report past the limit still (the proxy's own rows) is not sent, and said."""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from dataplane.ratelimit.limiter import CLOSED_REPORTS, RateLimiter
from dataplane.sync import link as link_module
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from dataplane.sync.quota import CARRIED_REPORT_BYTES, QuotaState, _carried_bytes
from ponto.quota_types import ScopeLimits, Spent
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_link_loads import ScriptedRouting

DAY = 20261205
NOON = float(calendar.timegm((2026, 12, 5, 12, 0, 0, 0, 0, 0)))
BUDGET = ScopeLimits(tokens_per_day=1000, tokens_per_month=5000)


def carrying(scopes: int, names: int) -> QuotaState:
    """A single process after `--workers names`: each scope carries each
    name's last counts."""
    limiter = RateLimiter(epoch=9.0)
    state = QuotaState(limiter, None, clock=lambda: 1.0, wall=lambda: NOON, proxy="edge")
    state.on_limits({f"tenant-{i:05d}/model": BUDGET for i in range(scopes)})
    limiter.carry(
        {
            f"tenant-{i:05d}/model": [
                Spent(2.0, DAY, 10.0 + w, 20.0 + w, f"edge-w{w}") for w in range(names)
            ]
            for i in range(scopes)
        }
    )
    return state


def closed_bytes(report: list[pb.ScopeDemand]) -> int:
    """What the report's carried rows add to its message (each with its tag
    and length)."""
    return sum(c.ByteSize() + 2 for row in report for c in row.closed)


def test_carried_rows_past_the_bound_go_in_turn_each_within_the_carry_window() -> None:
    state = carrying(2_000, 16)  # 32,000 rows, some 1.5 MB
    every = {(f"tenant-{i:05d}/model", f"edge-w{w}") for i in range(2_000) for w in range(16)}
    seen: set[tuple[str, str]] = set()
    reports = 0
    # In turn: as many reports as the bound takes (a slice may leave less than
    # a row unused), well within the window that carries them (CLOSED_REPORTS).
    rows = sum(
        _carried_bytes(Spent(2.0, DAY, 10.0 + w, 20.0 + w, f"edge-w{w}"))
        for _ in range(2_000)
        for w in range(16)
    )
    turn = -(-rows // CARRIED_REPORT_BYTES)
    assert turn > 1
    while seen != every and reports < 100:
        report = state.demand()
        reports += 1
        assert 0 < closed_bytes(report) <= CARRIED_REPORT_BYTES
        seen |= {(row.scope, c.proxy) for row in report for c in row.closed}
    assert seen == every
    assert turn <= reports <= turn + 1 < CLOSED_REPORTS
    # Every scope's row goes in every report, its counts with it: only the
    # carried rows take turns.
    assert len(report) == 2_000


def test_carried_rows_within_the_bound_all_go_in_each_report() -> None:
    state = carrying(100, 16)
    for _ in range(3):
        report = state.demand()
        assert sum(len(row.closed) for row in report) == 1_600


class Replica(ScriptedRouting):
    """Takes named rows and reads the reports; `heard` is set at the third."""

    def __init__(self) -> None:
        super().__init__([])
        self.reports: list[pb.RouteRequest] = []
        self.heard = asyncio.Event()

    async def register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterResponse:
        return pb.RegisterResponse(session_id="s-1", takes_named_counts=True)

    async def route_stream(  # type: ignore[override]
        self, requests: AsyncIterator[pb.RouteRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        self.first = await anext(requests)
        async for request in requests:
            self.reports.append(request)
            if len(self.reports) == 3:
                self.heard.set()


async def test_a_replica_hears_a_proxy_carrying_16_names_at_6000_scopes() -> None:
    """Unbounded, the first report (4.3 MB) ended the stream: INTERNAL, and
    no report read."""
    service = Replica()
    # As controlplane.app's server.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 * 1024 * 1024)])
    server.add_generic_rpc_handlers([service.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    state = carrying(6_000, 16)
    info = pb.ProxyInfo(name="edge", region="eu-west", address="127.0.0.1:1")
    link = ControlPlaneClient(
        TableHolder("eu-west", None),
        [f"127.0.0.1:{port}"],
        info,
        demand=state.demand,
        report_interval=0.0,
    )
    session = asyncio.create_task(link._session(f"127.0.0.1:{port}"))
    try:
        heard = asyncio.create_task(service.heard.wait())
        await asyncio.wait([session, heard], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert not session.done(), session.exception()
        assert service.heard.is_set()
    finally:
        session.cancel()
        heard.cancel()
        await asyncio.gather(session, heard, return_exceptions=True)
        await server.stop(None)
    assert all(m.ByteSize() < 4 * 1024 * 1024 for m in service.reports)
    assert {c.proxy for m in service.reports for row in m.demand for c in row.closed} == {
        f"edge-w{w}" for w in range(16)
    }


def big_report(scopes: int) -> list[pb.ScopeDemand]:
    return [pb.ScopeDemand(scope=f"tenant-{i:05d}/model", tokens_per_s=1.0) for i in range(scopes)]


async def test_a_report_past_what_a_replica_takes_is_not_sent_and_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(link_module, "MAX_REPORT_BYTES", 2_000)
    scopes = [100]
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    link = ControlPlaneClient(
        TableHolder("eu-west", None),
        ["127.0.0.1:1"],
        info,
        demand=lambda: big_report(scopes[0]),
        report_interval=0.0,
    )
    warnings = ("a warning",)
    monkeypatch.setattr(link, "warnings", lambda: warnings)
    outbox: asyncio.Queue[pb.RouteRequest] = asyncio.Queue()
    made = 0
    real = link.report

    def report(session_id: str) -> pb.RouteRequest:
        nonlocal made
        made += 1
        if made == 4:
            scopes[0] = 10  # fits again
        return real(session_id)

    monkeypatch.setattr(link, "report", report)
    with caplog.at_level(logging.INFO, logger="dataplane.sync.link"):
        task = asyncio.create_task(link._report("s-1", outbox))
        while made < 6:
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    sent = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert [len(m.demand) for m in sent] == [10] * (made - 3)
    # The warnings the reports not sent carried go with the first one sent.
    assert list(sent[0].warnings) == list(warnings) and sent[0].warnings_current
    assert not sent[1].warnings_current
    told = [r for r in caplog.records if r.name == "dataplane.sync.link"]
    assert [r.levelname for r in told] == ["ERROR", "INFO"]
    assert "not sent" in told[0].getMessage() and "100 scopes" in told[0].getMessage()
    assert told[0].exc_info is None
    assert "fit again" in told[1].getMessage()
