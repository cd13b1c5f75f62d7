"""A proxy whose replica hangs or died, or has not taken the table another
replica serves, is not shown current (trial: both proxies on cp3, `kill
-STOP cp3`, a drain through cp1; `pontoctl get proxies` said `current` and
/api/status `latest: true` at the old table for seconds). The reader judges
a replica's silence by when it saw its key change, on its own monotonic
clock, whatever the writer's wall clock says (a review: a writer's clock
behind by 4 s had its proxies unknown for good; ahead hid a hung one)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from controlplane import fleetstate
from controlplane.api.admin import AdminService
from controlplane.audit import AuditLog
from controlplane.catalog import Catalog
from controlplane.cli import _rows_proxies
from controlplane.distribute import Publisher
from controlplane.fleetstate import TABLE_GRACE_S, table_state
from controlplane.model import ProxyRecord
from controlplane.registry import ProxyRegistry, replica_silence, silent_after
from controlplane.store.memory import MemoryStore
from controlplane.web import StatusWeb
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def table(version: int, etag: str) -> pb.RouteTable:
    return pb.RouteTable(version=version, etag=etag)


class Fleet:
    """cp1 answers (reading with `catalog`, on its monotonic clock `mono`);
    cp3 holds both proxies, which ACKed its table 10 (e1); its wall clock is
    `cp3_skew_s` off cp1's."""

    def __init__(
        self, *, cp3_silent_s: float, published_s_ago: float, cp3_skew_s: float = 0.0
    ) -> None:
        self.store = MemoryStore()
        self.mono = 1000.0
        self.catalog = Catalog(self.store, monotonic=lambda: self.mono)
        self.cp3_table = table(10, "e1")
        self.cp3_silent_s = cp3_silent_s
        self.cp3 = ProxyRegistry(
            Catalog(self.store),
            "cp3",
            lease_ttl=9,  # a beat of 3 s: silent past 7.5 s
            current_version=lambda: self.cp3_table.version,
            current_etag=lambda: self.cp3_table.etag,
            clock=lambda: time.time() + cp3_skew_s,
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
        await self.catalog.list_replicas()  # cp1 sees cp3's last renewal
        self.mono += self.cp3_silent_s

    async def beat(self, after_s: float) -> None:
        """cp3 renews `after_s` seconds (cp1's clock) after its last renewal."""
        self.mono += after_s
        await self.cp3._put_announcement(self.cp3._lease)
        await self.catalog.list_replicas()

    async def cli_states(self) -> dict[str, str]:
        service = AdminService(
            self.catalog, self.cp1, AuditLog(self.store, replica="cp1"), token_required=False
        )
        resp = await service.ListProxies(apb.ListRequest(), None)
        header, rows = _rows_proxies(resp)
        return {row[0]: row[header.index("STATE")] for row in rows}

    async def page(self, later_s: float = 0.0) -> list[dict[str, Any]]:
        """The page's proxies as read `later_s` seconds from now (wall clock)."""
        web = StatusWeb(self.catalog, self.cp1, "cp1")
        proxies: list[dict[str, Any]] = (await web.status(time.time() + later_s))["proxies"]
        return proxies


async def test_the_proxies_of_a_replica_that_stopped_renewing_are_unknown() -> None:
    fleet = Fleet(cp3_silent_s=8.0, published_s_ago=1.0)
    await fleet.start()
    why = "its replica cp3 has not renewed for 8 s"
    assert await fleet.cli_states() == {"eu-1": f"unknown: {why}", "eu-2": f"unknown: {why}"}
    rows = await fleet.page()
    assert [(r["latest"], r["unknown"]) for r in rows] == [(False, why), (False, why)]


async def test_an_idle_proxy_of_a_renewing_replica_is_quiet_not_stale() -> None:
    """Trial 93: a connected proxy with no traffic read `stale` (its replica
    writes only changed reports, so its age grows). Stale now says its stream
    may be gone: its replica stopped renewing, its keys left to its lease."""
    renewing = Fleet(cp3_silent_s=0.0, published_s_ago=1.0)
    await renewing.start()
    rows = await renewing.page(later_s=600.0)  # ten minutes without a request
    assert {(r["quiet"], r["stale"]) for r in rows} == {(True, False)}
    silent = Fleet(cp3_silent_s=8.0, published_s_ago=1.0)
    await silent.start()
    assert {(r["quiet"], r["stale"]) for r in await silent.page()} == {(False, True)}
    await silent.beat(after_s=1.0)  # it renews again: its streams held
    assert {r["stale"] for r in await silent.page()} == {False}


async def test_a_status_row_reads_its_replicas_silence_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A proxy's `unknown` and `stale` say one reading of its replica's
    silence: it was read twice a row, once for each field."""
    reads: list[float] = []

    def counted(replica: dict[str, object], silent: float) -> float | None:
        reads.append(silent)
        return replica_silence(replica, silent)

    monkeypatch.setattr(fleetstate, "replica_silence", counted)
    fleet = Fleet(cp3_silent_s=8.0, published_s_ago=1.0)
    await fleet.start()
    rows = await fleet.page()
    why = "its replica cp3 has not renewed for 8 s"
    assert [(r["unknown"], r["stale"]) for r in rows] == [(why, True), (why, True)]
    assert len(reads) == len(rows)  # one reading a row


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


def test_table_state_reads_a_replica_from_before_the_heartbeat_as_live() -> None:
    p = ProxyRecord("eu-1", "eu-west", "a", "1", "s", "cp0", 0.0, replica_version=3)
    latest = Publisher("cp1", clock=lambda: 0.0).publish(table(9, "e9"))
    state = table_state(p, {"cp0": {"id": "cp0"}}, latest, 60.0, {"cp0": 600.0})
    assert state == ("", False)


@pytest.mark.parametrize("skew_s", [-3600.0, -5.0, 0.0, 5.0, 3600.0])
async def test_a_replica_is_judged_by_the_readers_clock_whatever_its_own(skew_s: float) -> None:
    renewing = Fleet(cp3_silent_s=0.0, published_s_ago=1.0, cp3_skew_s=skew_s)
    await renewing.start()
    for _ in range(5):  # renews every beat: never unknown
        await renewing.beat(3.0)
        assert set((await renewing.cli_states()).values()) == {"current"}
    hung = Fleet(cp3_silent_s=8.0, published_s_ago=1.0, cp3_skew_s=skew_s)
    await hung.start()
    why = "its replica cp3 has not renewed for 8 s"
    assert set((await hung.cli_states()).values()) == {f"unknown: {why}"}
    await hung.beat(0.0)  # it renews again
    assert set((await hung.cli_states()).values()) == {"current"}


async def test_one_failed_renewal_and_a_slow_write_leave_a_replica_believed() -> None:
    fleet = Fleet(cp3_silent_s=0.0, published_s_ago=1.0)
    await fleet.start()
    # A renewal lost, the next 1.2 s late: read just before it lands, 7.2 s
    # without one (silent past 7.5 s). A read right after a beat sees no
    # silence at all, and had made this assertion one that could not fail.
    fleet.mono += 2 * 3.0 + 1.2
    assert set((await fleet.cli_states()).values()) == {"current"}
    await fleet.beat(0.0)  # the late renewal
    assert set((await fleet.cli_states()).values()) == {"current"}
    fleet.mono += 2 * 3.0 + 1.2
    assert set((await fleet.cli_states()).values()) == {"current"}


def test_the_hung_threshold_is_tied_to_the_lease_ttl() -> None:
    # Beats of TTL/3: two beats and half of one, 5/6 of the TTL.
    for ttl in (2, 3, 9, 10, 30):
        every = max(ttl / 3, 0.2)
        key = {"id": "cp", "renew_every": every, "lease_ttl": ttl}
        after = silent_after(key)
        assert after is not None and after == pytest.approx(2.5 * every)
        assert 2 * every < after < ttl  # one renewal may fail; flagged before the lease ends
        assert replica_silence(key, after - 0.01) is None
        assert replica_silence(key, after + 0.01) == pytest.approx(after + 0.01)
    # Never below half the TTL, whatever the beat.
    assert silent_after({"renew_every": 0.5, "lease_ttl": 10}) == pytest.approx(5.25)
    # A key from before lease_ttl: beats of TTL/3; from before renew_every: not judged.
    assert silent_after({"renew_every": 3.0}) == pytest.approx(7.5)
    assert silent_after({"id": "cp0"}) is None
