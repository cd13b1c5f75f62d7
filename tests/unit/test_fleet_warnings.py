"""What operators hear of proxies that refuse the route table or cannot use
part of it: with every Admin API write (trailing metadata `ponto-warning`, as
for drains in test_admin_warnings.py), and in `pontoctl get proxies`.

Before, a drain made while every proxy NACKed the table printed "region ...
drained" and nothing else, though it reached no proxy.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from controlplane.api import admin as admin_api
from controlplane.api.routing import RoutingService, peer_host
from controlplane.catalog import (
    ACKS,
    CONFLICT_SHOWN_S,
    CONFLICTS,
    MAX_SUMMARY_WARNINGS,
    PROXIES,
    Catalog,
)
from controlplane.cli import _rows_proxies
from controlplane.distribute import Publisher
from controlplane.errors import Superseded
from controlplane.fleetwarnings import MAX_NAMED_PROXIES, fleet_warnings, origin_warnings
from controlplane.model import ProxyRecord, encode
from controlplane.registry import ProxyRegistry
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_alias_warnings import ListFails, admin, warned

NACK = "JWT config of tenant 'badjwt': JWKS file '/nonexistent': cannot read"
AUTH = (
    "JWT config of tenant 'badjwt': JWKS file '/nonexistent': cannot read: No such file or "
    "directory; that tenant's JWTs are answered 503 auth_unavailable (its API keys still work)"
)


def proxy(name: str, error: str = "", warnings: tuple[str, ...] = ()) -> ProxyRecord:
    return ProxyRecord(
        name=name,
        region="eu-west",
        address="10.0.0.1:8080",
        version="1.0",
        session_id=f"s-{name}",
        control_plane_id="cp-1",
        connected_at=1.0,
        acked_version=4,
        last_error=error,
        warnings=warnings,
    )


# ---------------------------------------------------------------- the rule


def test_proxies_refusing_the_table_are_one_warning_per_reason() -> None:
    proxies = [proxy("p2", NACK), proxy("p1", NACK), proxy("p3"), proxy("p4", "other")]
    assert fleet_warnings(proxies) == (
        f"proxies p1, p2 refused the last route table they were sent (nack: {NACK}) and "
        "keep serving their last good one: a change reaches them only once they accept a "
        "table (`pontoctl get proxies`)",
        "proxy p4 refused the last route table it was sent (nack: other) and keeps serving "
        "its last good one: a change reaches it only once it accepts a table "
        "(`pontoctl get proxies`)",
    )


def test_what_proxies_cannot_use_of_the_table_is_warned_of() -> None:
    assert fleet_warnings([proxy("p1", warnings=(AUTH,)), proxy("p2", warnings=(AUTH,))]) == (
        f"proxies p1, p2 report: {AUTH}",
    )


def test_no_warning_when_every_proxy_took_the_table_whole() -> None:
    assert fleet_warnings([proxy("p1"), proxy("p2")]) == ()
    assert fleet_warnings([]) == ()


def test_many_proxies_are_named_by_the_first_few() -> None:
    names = [f"p{i:02d}" for i in range(MAX_NAMED_PROXIES + 3)]
    [warning] = fleet_warnings([proxy(n, "bad") for n in names])
    assert warning.startswith(f"proxies {', '.join(names[:MAX_NAMED_PROXIES])} and 3 more refuse")


# ---------------------------------------------------------------- recorded and listed


async def test_ack_warnings_are_recorded_listed_and_cleared() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp-1")
    record = await registry.register("p1", "eu-west", "10.0.0.1:8080", "1.0")
    await registry.acked(record.session_id, 7, "", (AUTH,))
    await registry.flush(0.0)
    [listed] = await catalog.list_proxies()
    assert (listed.acked_version, listed.last_error, listed.warnings) == (7, "", (AUTH,))
    # A NACK of the next table leaves those of the table still served.
    await registry.acked(record.session_id, 7, "bad table")
    await registry.flush(0.0)
    [listed] = await catalog.list_proxies()
    assert (listed.last_error, listed.warnings) == ("bad table", (AUTH,))
    # An ACK without warnings clears them.
    await registry.acked(record.session_id, 8, "")
    await registry.flush(0.0)
    [listed] = await catalog.list_proxies()
    assert (listed.acked_version, listed.last_error, listed.warnings) == (8, "", ())
    # A summary of a replica from before warnings still reads.
    await store.put(ACKS + "cp-1", orjson.dumps({"replica_version": 9, "acks": {"p1": [9, ""]}}))
    [listed] = await catalog.list_proxies()
    assert (listed.acked_version, listed.warnings) == (9, ())


async def test_warnings_reported_between_acks_replace_the_acks() -> None:
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp-1")
    record = await registry.register("p1", "eu-west", "10.0.0.1:8080", "1.0")
    await registry.acked(record.session_id, 7, "")
    await registry.flush(0.0)
    registry.warned(record.session_id, (AUTH,))
    await registry.flush(0.0)
    [listed] = await catalog.list_proxies()
    assert (listed.acked_version, listed.last_error, listed.warnings) == (7, "", (AUTH,))
    assert fleet_warnings([listed]) == (f"proxy p1 reports: {AUTH}",)
    registry.warned(record.session_id, ())
    await registry.flush(0.0)
    [listed] = await catalog.list_proxies()
    assert (listed.acked_version, listed.warnings) == (7, ())
    # A session this replica does not hold (gone since) is ignored.
    registry.warned("gone", (AUTH,))
    assert registry.ack_warnings() == {}


async def test_the_route_stream_takes_a_reports_warnings_only_when_it_says_they_are_current() -> (
    None
):
    """A report without RouteRequest.warnings_current (every report of a
    proxy whose warnings did not change, and every report of an older one)
    keeps what the last ACK said; one with it replaces that, even with none."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp-1")
    record = await registry.register("p1", "eu-west", "10.0.0.1:8080", "1.0")
    service = RoutingService(registry, Publisher("cp-1"))
    sid = record.session_id

    async def stream(*messages: pb.RouteRequest) -> tuple[str, ...]:
        async def requests() -> Any:
            for message in messages:
                yield message

        await service._read_acks(sid, "p1", requests(), {})
        [listed] = registry.sessions.values()
        return listed.warnings

    ack = pb.RouteRequest(session_id=sid, version_info=7, response_nonce="n7", warnings=[AUTH])
    assert await stream(ack, pb.RouteRequest(session_id=sid, is_report=True)) == (AUTH,)
    cleared = pb.RouteRequest(session_id=sid, is_report=True, warnings_current=True)
    assert await stream(cleared) == ()
    again = pb.RouteRequest(session_id=sid, is_report=True, warnings_current=True, warnings=[AUTH])
    assert await stream(again, pb.RouteRequest(session_id=sid, is_report=True)) == (AUTH,)


async def test_two_processes_given_one_name_are_named_beside_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trial 17: a proxy started with the --name of one still running took
    the name; the older one, refused, served its last table (a drain did not
    reach it), and neither `pontoctl get proxies`, the status page nor a
    write's reply said so."""
    catalog = Catalog(MemoryStore())
    here, there = ProxyRegistry(catalog, "cp-1"), ProxyRegistry(catalog, "cp-2")
    await there.register("proxy-b", "eu-west", "127.0.0.1:8403", "1.0", started_at=200.0)
    with pytest.raises(Superseded):
        await here.register("proxy-b", "eu-west", "127.0.0.1:8402", "1.0", started_at=100.0)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "proxy proxy-b at 127.0.0.1:8402 refused: a process started later holds the name, "
        "at 127.0.0.1:8403 (two proxies given one --name?)"
    ]
    [listed] = await catalog.list_proxies()
    assert (listed.address, listed.conflict) == ("127.0.0.1:8403", "127.0.0.1:8402")
    said = (
        "two processes run as proxy-b: the other, at 127.0.0.1:8402, serves its last route "
        "table, which no change reaches (this one, at 127.0.0.1:8403, started later and "
        "holds the name); give each proxy its own --name, or stop the other"
    )
    assert fleet_warnings([listed]) == (f"proxy proxy-b: {said}",)
    assert list(admin_api.proxy_pb(listed).warnings) == [said]
    # A write's reply says it too.
    assert await admin_api._fleet_warnings(catalog) == (f"proxy proxy-b: {said}",)


@pytest.mark.parametrize(
    ("address", "hosts", "conflict"),
    [
        # Review 37: two hosts that both advertise their --listen default
        # register the same address, and the conflict went unnoticed, as a
        # reload's would. The host a registration came from tells them apart.
        ("0.0.0.0:8080", ("10.0.0.5", "10.0.0.6"), "0.0.0.0:8080 on host 10.0.0.6"),
        # A group's retired worker, on the same host: no conflict.
        ("0.0.0.0:8080", ("10.0.0.5", "10.0.0.5"), ""),
        # Review 38: a host's own address, from two peers (a NAT with several
        # addresses): one group's workers, not a conflict.
        ("10.0.0.5:8080", ("192.0.2.1", "192.0.2.2"), ""),
    ],
    ids=["two-hosts", "one-host", "behind-a-nat"],
)
async def test_one_address_from_two_hosts(
    address: str, hosts: tuple[str, str], conflict: str
) -> None:
    catalog = Catalog(MemoryStore())
    here, there = ProxyRegistry(catalog, "cp-1"), ProxyRegistry(catalog, "cp-2")
    later, earlier = hosts
    await there.register("proxy-b", "eu-west", address, "1.0", started_at=200.0, host=later)
    with pytest.raises(Superseded):
        await here.register("proxy-b", "eu-west", address, "1.0", started_at=100.0, host=earlier)
    [listed] = await catalog.list_proxies()
    assert listed.conflict == conflict
    if conflict:
        assert f"the other, at {conflict}, serves" in fleet_warnings([listed])[0]


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.0.0.6:51234", "10.0.0.6"),
        ("ipv6:[::1]:51234", "::1"),
        ("ipv6:%5B::1%5D:53184", "::1"),  # as grpcio 1.85 writes it (review 38)
        ("ipv6:[fe80::1%eth0]:80", "fe80::1%eth0"),
        ("unix:/run/ponto.sock", ""),
        ("", ""),
    ],
)
def test_the_host_of_a_peer(peer: str, host: str) -> None:
    assert peer_host(peer) == host


async def test_a_refusal_stands_when_its_note_cannot_be_written() -> None:
    """Review 37: the note written under a lease lost meanwhile made the
    refusal an INTERNAL error, with a traceback in the log."""
    store = MemoryStore()
    catalog = Catalog(store)
    here, there = ProxyRegistry(catalog, "cp-1"), ProxyRegistry(catalog, "cp-2")
    await there.register("proxy-b", "eu-west", "127.0.0.1:8403", "1.0", started_at=200.0)
    await store.revoke_lease(await here.lease())  # lost, and not yet seen as lost
    with pytest.raises(Superseded):
        await here.register("proxy-b", "eu-west", "127.0.0.1:8402", "1.0", started_at=100.0)


@pytest.mark.parametrize("elsewhere", [False, True], ids=["same-replica", "other-replica"])
async def test_a_live_stream_superseded_from_elsewhere_is_named_at_once(elsewhere: bool) -> None:
    """Trial 18: the conflict was named only once the older process asked
    again, 30 s after its stream ended, and a drain made meanwhile said
    nothing. A stream still open when a registration from another place
    takes its name is named at once; one that had ended is a proxy that
    moved, not a conflict."""
    catalog = Catalog(MemoryStore())
    here, there = ProxyRegistry(catalog, "cp-1"), ProxyRegistry(catalog, "cp-2")
    old = await here.register("proxy-a", "eu-west", "127.0.0.1:18001", "1.0", started_at=100.0)
    gone = await here.register("proxy-m", "eu-west", "127.0.0.1:18001", "1.0", started_at=100.0)
    assert here.streaming(old.session_id) and here.streaming(gone.session_id)
    await here.unregister(gone.session_id)  # its stream ended: it moved
    newcomer = there if elsewhere else here
    for name in ("proxy-a", "proxy-m"):
        await newcomer.register(name, "eu-west", "127.0.0.1:18003", "1.0", started_at=200.0)
    if elsewhere:
        assert await here.drop_superseded()  # its watch saw the write
    assert here.ended(old.session_id).is_set()
    conflicts = {p.name: p.conflict for p in await catalog.list_proxies()}
    assert conflicts == {"proxy-a": "127.0.0.1:18001", "proxy-m": ""}


async def test_a_worker_a_reload_replaced_is_no_conflict() -> None:
    """Its successor has its address: refused, it is leaving, not lost."""
    catalog = Catalog(MemoryStore())
    registry = ProxyRegistry(catalog, "cp-1")
    await registry.register("g-w0", "eu-west", "127.0.0.1:8401", "1.0", started_at=200.0)
    with pytest.raises(Superseded):
        await registry.register("g-w0", "eu-west", "127.0.0.1:8401", "1.0", started_at=100.0)
    [listed] = await catalog.list_proxies()
    assert listed.conflict == ""
    assert fleet_warnings([listed]) == ()


async def test_a_conflict_is_named_while_the_refused_process_asks_again() -> None:
    """The refused process asks again every 30 s while it runs: a note 75 s
    old is of one that stopped."""
    store = MemoryStore()
    catalog = Catalog(store)
    registry = ProxyRegistry(catalog, "cp-1")
    await registry.register("proxy-b", "eu-west", "127.0.0.1:8403", "1.0", started_at=200.0)
    note = {"address": "127.0.0.1:8402", "refused_at": time.time() - CONFLICT_SHOWN_S + 5}
    await store.put(CONFLICTS + "proxy-b", orjson.dumps(note))
    [listed] = await catalog.list_proxies(traffic=False)
    assert listed.conflict == "127.0.0.1:8402"
    note["refused_at"] = time.time() - CONFLICT_SHOWN_S - 1
    await store.put(CONFLICTS + "proxy-b", orjson.dumps(note))
    [listed] = await catalog.list_proxies(traffic=False)
    assert listed.conflict == ""


def test_get_proxies_shows_the_warning() -> None:
    resp = apb.ListProxiesResponse(
        current_version=7,
        proxies=[
            apb.ProxyStatus(
                info=pb.ProxyInfo(name="p1"), acked_version=7, warnings=[AUTH, "another"]
            ),
            apb.ProxyStatus(info=pb.ProxyInfo(name="p2"), acked_version=7),
        ],
    )
    header, rows = _rows_proxies(resp)
    state = {row[0]: row[header.index("STATE")] for row in rows}
    assert state == {
        "p1": f"current; warning: {AUTH[:80]} (+1 more)",
        "p2": "current",
    }


# ---------------------------------------------------------------- the Admin API


async def nacking(store: MemoryStore) -> None:
    """Proxy p1 on cp-1 refused the latest table."""
    catalog = Catalog(store)
    await catalog.register_proxy(proxy("p1"), 0)
    await catalog.put_acks("cp-1", {"p1": (4, NACK)}, 0, version=5)


async def test_a_drain_while_proxies_refuse_the_table_warns_after_its_own() -> None:
    store = MemoryStore()
    await nacking(store)
    async with admin(store) as stub:
        await stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="eu-west")))
        await stub.PutOrigin(
            apb.PutOriginRequest(
                origin=apb.OriginSpec(
                    name="o1", base_url="http://10.0.0.2/v1", region="eu-west", models=["m"]
                )
            )
        )
        drain = stub.DrainRegion(apb.DrainRequest(name="eu-west", drained=True))
        [own, fleet] = await warned(drain)
        assert own.startswith("no undrained origin serves model 'm' now")
        assert fleet.startswith(f"proxy p1 refused the last route table it was sent (nack: {NACK})")
        assert "a change reaches it only once it accepts a table" in fleet
        # Any write: a key, a tenant, an apply.
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        key = stub.CreateKey(apb.CreateKeyRequest(tenant="acme"))
        assert [w[:16] for w in await warned(key)] == ["proxy p1 refused"]
        apply = stub.Apply(apb.ApplyRequest(document="{}"))
        assert [w[:16] for w in await warned(apply)] == ["proxy p1 refused"]
        # Reads do not warn.
        assert await warned(stub.ListProxies(apb.ListRequest())) == []


async def test_writes_do_not_warn_when_proxies_take_the_table() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.register_proxy(proxy("p1"), 0)
    await catalog.put_acks("cp-1", {"p1": (5, "")}, 0, version=5)
    async with admin(store) as stub:
        put = stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="eu-west")))
        assert await warned(put) == []


async def test_a_write_stands_when_the_proxies_cannot_be_read() -> None:
    store = ListFails()
    await nacking(store)
    async with admin(store) as stub:
        store.failing = True
        put = stub.PutRegion(apb.PutRegionRequest(region=apb.RegionSpec(name="eu-west")))
        assert await warned(put) == []
        store.failing = False
        assert [r.name for r in (await stub.ListRegions(apb.ListRequest())).regions] == ["eu-west"]


class HangingProxyReads(MemoryStore):
    """etcd that answers writes but never the read of the proxies' state."""

    hanging = False

    async def list(self, prefix: str) -> Any:
        if self.hanging and prefix in (ACKS, PROXIES):
            await asyncio.Event().wait()
        return await super().list(prefix)


async def test_a_write_is_answered_when_the_proxies_read_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A saved write answered past its caller's deadline is a lost write for
    # the caller (a created key's secret, which no one can read again).
    monkeypatch.setattr(admin_api, "WARNINGS_READ_S", 0.05)
    store = HangingProxyReads()
    async with admin(store) as stub:
        await stub.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")))
        store.hanging = True
        created = stub.CreateKey(apb.CreateKeyRequest(tenant="acme"), timeout=10)
        assert (await created).secret
        assert await warned(created) == []


async def test_a_warning_many_proxies_report_is_written_once() -> None:
    # A table's problem is every proxy's: the replica's summary keeps each
    # distinct warning once, and at most MAX_SUMMARY_WARNINGS of them.
    store = MemoryStore()
    catalog = Catalog(store)
    many = {f"p{i}": [AUTH, f"only p{i}'s"] for i in range(100)}
    await catalog.put_acks("cp-1", {name: (7, "") for name in many}, 0, warnings=many)
    summary = orjson.loads((await store.get(ACKS + "cp-1")).value)  # type: ignore[union-attr]
    texts = summary["warnings"]["texts"]
    assert texts.count(AUTH) == 1 and len(texts) == MAX_SUMMARY_WARNINGS
    for name in many:
        await store.put(PROXIES + name, encode(proxy(name)))
    listed = {p.name: p.warnings for p in await catalog.list_proxies()}
    assert listed["p0"] == (AUTH, "only p0's")
    assert listed["p99"] == (AUTH,)  # its own one is past the bound


def test_origins_whose_servers_cannot_continue_are_one_warning_each() -> None:
    """Only a known TGI with continuation on: vLLM, SGLang and the llama.cpp
    server continue (a review: llama.cpp has since April 2025); a server not
    known (no page read, or none Ponto reads) is not guessed at."""
    continuing = [
        ("tgi-1", "tgi"),
        ("gpu-1", "vllm"),
        ("llama-1", "llamacpp"),
        ("sg-1", "sglang"),
        ("x", "unknown"),
        ("y", ""),
    ]
    warnings = origin_warnings(continuing)
    assert [w.split(" ")[1] for w in warnings] == ["tgi-1"]
    assert all("--update --continuation off" in w for w in warnings)
    assert origin_warnings([]) == ()
