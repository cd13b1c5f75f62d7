"""A proxy whose replica hangs or died, or has not taken the table another
replica serves, is not shown current (trial: both proxies on cp3, `kill
-STOP cp3`, a drain through cp1; `pontoctl get proxies` said `current` and
/api/status `latest: true` at the old table for seconds)."""

from __future__ import annotations

import time
from typing import Any

from controlplane.api.admin import AdminService
from controlplane.audit import AuditLog
from controlplane.catalog import Catalog
from controlplane.cli import _rows_proxies
from controlplane.distribute import Publisher
from controlplane.fleetstate import TABLE_GRACE_S, unknown_why
from controlplane.model import ProxyRecord
from controlplane.registry import ProxyRegistry
from controlplane.store.memory import MemoryStore
from controlplane.web import StatusWeb
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def table(version: int, etag: str) -> pb.RouteTable:
    return pb.RouteTable(version=version, etag=etag)


class Fleet:
    """cp1 answers; cp3 holds both proxies, which ACKed its table 10 (e1)."""

    def __init__(self, *, cp3_silent_s: float, published_s_ago: float) -> None:
        self.store = MemoryStore()
        self.catalog = Catalog(self.store)
        self.cp3_table = table(10, "e1")
        self.cp3 = ProxyRegistry(
            self.catalog,
            "cp3",
            lease_ttl=9,  # a beat of 3 s: silent past 7 s
            current_version=lambda: self.cp3_table.version,
            current_etag=lambda: self.cp3_table.etag,
            clock=lambda: time.time() - cp3_silent_s,
        )
        self.cp1 = Publisher("cp1", clock=lambda: time.monotonic() - published_s_ago)

    async def start(self) -> None:
        await self.cp3.announce("127.0.0.1:7003")
        for name in ("eu-1", "eu-2"):
            record = await self.cp3.register(name, "eu-west", "127.0.0.1:1", "1")
            self.cp3.streaming(record.session_id)
            await self.cp3.acked(record.session_id, 10, "")
        await self.cp3.flush(0.0)
        self.cp1.publish(table(12, "e2"))  # the drain, through cp1

    async def cli_states(self) -> dict[str, str]:
        service = AdminService(
            self.catalog, self.cp1, AuditLog(self.store, replica="cp1"), token_required=False
        )
        resp = await service.ListProxies(apb.ListRequest(), None)
        header, rows = _rows_proxies(resp)
        return {row[0]: row[header.index("STATE")] for row in rows}

    async def page(self) -> list[dict[str, Any]]:
        web = StatusWeb(self.catalog, self.cp1, "cp1")
        proxies: list[dict[str, Any]] = (await web.status(time.time()))["proxies"]
        return proxies


async def test_the_proxies_of_a_replica_that_stopped_renewing_are_unknown() -> None:
    fleet = Fleet(cp3_silent_s=8.0, published_s_ago=1.0)
    await fleet.start()
    why = "its replica cp3 has not renewed for 8 s"
    assert await fleet.cli_states() == {"eu-1": f"unknown: {why}", "eu-2": f"unknown: {why}"}
    rows = await fleet.page()
    assert [(r["latest"], r["unknown"]) for r in rows] == [(False, why), (False, why)]


async def test_a_replica_behind_the_latest_table_past_the_push_time_is_unknown() -> None:
    fleet = Fleet(cp3_silent_s=0.0, published_s_ago=TABLE_GRACE_S + 5)
    await fleet.start()
    why = "its replica cp3 has not taken the latest table (published 10 s ago)"
    assert set((await fleet.cli_states()).values()) == {f"unknown: {why}"}
    assert {(r["latest"], r["unknown"]) for r in await fleet.page()} == {(False, why)}


async def test_a_replica_within_the_push_time_or_serving_the_latest_table_is_believed() -> None:
    fleet = Fleet(cp3_silent_s=0.0, published_s_ago=1.0)
    await fleet.start()
    assert set((await fleet.cli_states()).values()) == {"current"}  # still pushing
    late = Fleet(cp3_silent_s=0.0, published_s_ago=TABLE_GRACE_S + 5)
    await late.start()
    # cp3 took the same content (its own revision, 13); its proxies ACK it.
    late.cp3_table = table(13, "e2")
    for session_id in list(late.cp3.sessions):
        await late.cp3.acked(session_id, 13, "")
    await late.cp3.flush(1.0)
    assert set((await late.cli_states()).values()) == {"current"}
    assert {(r["latest"], r["unknown"]) for r in await late.page()} == {(True, "")}


async def test_a_replica_summary_follows_its_table_without_an_ack() -> None:
    """A replica writes its summary when the table it serves changes, not
    only on an ACK: a proxy that does not ACK reads behind, not unknown."""
    fleet = Fleet(cp3_silent_s=0.0, published_s_ago=TABLE_GRACE_S + 5)
    await fleet.start()
    fleet.cp3_table = table(13, "e2")
    await fleet.cp3.flush(1.0)
    assert set((await fleet.cli_states()).values()) == {"behind"}


def test_unknown_why_reads_a_replica_from_before_the_heartbeat_as_live() -> None:
    p = ProxyRecord("eu-1", "eu-west", "a", "1", "s", "cp0", 0.0, replica_version=3)
    latest = Publisher("cp1", clock=lambda: 0.0).publish(table(9, "e9"))
    assert unknown_why(p, {"cp0": {"id": "cp0"}}, latest, 60.0, time.time()) == ""
