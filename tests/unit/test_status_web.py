"""The control plane's HTTP port (controlplane/web.py) over a MemoryStore:
the page, /api/status, drains with and without the admin token, refusals,
writes another site tries to make through a browser."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from controlplane.app import ControlPlane
from controlplane.builder import TableBuilder
from controlplane.catalog import REGIONS, STATE_PREFIX, Catalog, Limited, Served, Traffic
from controlplane.compile import compile_table
from controlplane.distribute import Publisher
from controlplane.ejections import STALE_S
from controlplane.errors import Unavailable
from controlplane.fleetid import FleetWatch
from controlplane.loadsync import stale_after
from controlplane.metrics import ControlMetrics
from controlplane.model import Limits, Origin, OriginHealth, ProxyRecord, Region, State, Tenant
from controlplane.registry import TRAFFIC_EVERY
from controlplane.settings import parse
from controlplane.store import Listing, StoreUnavailable
from controlplane.store.memory import MemoryStore
from controlplane.suspensions import LISTED
from controlplane.web import (
    TOKEN_MISS_ADDRESSES,
    TOKEN_MISS_WINDOW_S,
    TOKEN_MISSES,
    UNAVAILABLE_LOG_EVERY_S,
    Departures,
    StatusWeb,
    TokenMisses,
    departed_rows,
)
from dataplane.http.state import SERVER_NAME
from ponto.pki import make_bundle
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb

TOKEN = "s3cret-admin-token"
# What the page sends with every change.
WRITE = {"X-Ponto-Request": "1"}
AUTH = {**WRITE, "Authorization": f"Bearer {TOKEN}"}


@dataclass
class Clock:
    now: float = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Recorder:
    """An Auditor that keeps what it was given."""

    calls: list[dict[str, object]] = field(default_factory=list)

    async def record(
        self,
        *,
        actor: str,
        action: str,
        target: str,
        detail: dict[str, str] | None = None,
        source: str,
        result: str = "ok",
        message: str = "",
    ) -> None:
        self.calls.append(
            {
                "actor": actor,
                "action": action,
                "target": target,
                "detail": detail,
                "source": source,
                "result": result,
            }
        )


class CountingStore(MemoryStore):
    """A MemoryStore that counts range reads by prefix and, while `gate` is
    set, holds them until it is released."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: Counter[str] = Counter()
        self.gate: asyncio.Event | None = None
        self.failing = False  # range reads raise StoreUnavailable

    async def list(self, prefix: str) -> Listing:
        if self.failing:
            raise StoreUnavailable("etcd is away")
        self.lists[prefix] += 1
        if self.gate is not None:
            await self.gate.wait()
        return await super().list(prefix)


@dataclass
class Plane:
    catalog: Catalog
    publisher: Publisher
    clock: Clock
    audit: Recorder
    lease: int


async def seeded() -> Plane:
    store = CountingStore()
    catalog = Catalog(store)
    await catalog.put_region(Region("eu-west", 53.3, -6.3), allow_update=False)
    await catalog.put_region(Region("us-east", 38.9, -77.4), allow_update=False)
    await catalog.put_origin(
        Origin("o-eu", "http://o-eu:8000/v1", "eu-west", ("m",), capacity=10),
        allow_update=False,
    )
    await catalog.put_origin(
        Origin("o-us", "http://o-us:8000/v1", "us-east", ("m",)), allow_update=False
    )
    await catalog.put_health(OriginHealth("o-eu", healthy=True, inflight=4.0))
    await catalog.put_health(OriginHealth("o-us", healthy=False, detail="connection refused"))
    publisher = Publisher("r1")
    table = compile_table(await catalog.snapshot())
    table.version, table.etag = 7, "e7"
    publisher.publish(table)
    lease = await store.grant_lease(10)
    for name, region in (("p-eu", "eu-west"), ("p-us", "us-east")):
        record = ProxyRecord(name, region, f"{name}:8080", "1.0", f"s-{name}", "r1", 900.0)
        await catalog.register_proxy(record, lease)
    await catalog.put_acks("r1", {"p-eu": (7, ""), "p-us": (6, "")}, lease, version=7)
    return Plane(catalog, publisher, Clock(), Recorder(), lease)


@pytest.fixture
async def plane() -> Plane:
    return await seeded()


def web_of(plane: Plane, **kwargs: object) -> StatusWeb:
    options: dict[str, object] = {"admin_token": TOKEN, "audit": plane.audit, **kwargs}
    return StatusWeb(
        plane.catalog,
        plane.publisher,
        "r1",
        clock=plane.clock,
        **options,  # type: ignore[arg-type]
    )


# The leader's scrape of o-eu: 4 requests of its capacity 10.
EU_SCRAPE = pb.OriginLoads(generation=1, loads=[pb.OriginLoad(origin="o-eu", running=4)])


@pytest.fixture
async def client(plane: Plane) -> AsyncIterator[TestClient]:  # type: ignore[type-arg]
    async with TestClient(TestServer(web_of(plane, loads=lambda: EU_SCRAPE).app())) as c:
        yield c


async def test_the_page_and_its_files_are_served_with_a_strict_policy(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    page = await client.get("/")
    assert page.status == 200
    html = await page.text()
    assert "/static/status.js" in html and "<script>" not in html  # no inline script
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    for path, kind in (
        ("/static/status.js", "javascript"),
        ("/static/world.svg", "svg"),
        ("/static/status.css", "css"),
    ):
        resp = await client.get(path)
        assert resp.status == 200, path
        assert kind in resp.headers["Content-Type"], path


async def test_status_shows_regions_origins_and_proxies(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    status = await (await client.get("/api/status")).json()
    assert status["replica"] == "r1"
    assert status["latest_version"] == 7
    assert status["writes"] == "token"
    regions = {r["name"]: r for r in status["regions"]}
    assert regions["eu-west"]["latitude"] == 53.3
    assert regions["eu-west"]["load"] == pytest.approx(0.4)
    (eu_origin,) = regions["eu-west"]["origins"]
    assert eu_origin["name"] == "o-eu" and eu_origin["healthy"] and eu_origin["inflight"] == 4.0
    (us_origin,) = regions["us-east"]["origins"]
    assert not us_origin["healthy"] and us_origin["detail"] == "connection refused"
    proxies = {p["name"]: p for p in status["proxies"]}
    assert proxies["p-eu"]["latest"] and proxies["p-eu"]["acked_version"] == 7
    assert not proxies["p-us"]["latest"] and proxies["p-us"]["acked_version"] == 6
    assert proxies["p-us"]["current_version"] == 7
    assert proxies["p-eu"]["age_s"] == pytest.approx(100.0)  # since it connected: never heard
    assert proxies["p-eu"]["quiet"]  # nothing heard for three report writes
    assert not proxies["p-eu"]["stale"]  # listed, its replica renewing: connected
    # Never heard from: it counted nothing (a rate of 0, not unknown).
    assert regions["eu-west"]["requests_per_s"] == 0.0
    assert regions["eu-west"]["proxies"] == regions["us-east"]["proxies"] == 1


async def test_a_proxys_problems_show_with_it_and_as_the_fleets_warnings(
    plane: Plane,
) -> None:
    """A refused table and what a proxy cannot use of its own: on its row,
    and summed up as the warnings every Admin write carries."""
    jwt = "tenant acme: JWT config unusable: jwks file /etc/ponto/acme.json is missing"
    await plane.catalog.put_acks(
        "r1",
        {"p-eu": (7, ""), "p-us": (6, "tenant acme: jwks file missing")},
        plane.lease,
        version=7,
        warnings={"p-eu": [jwt]},
    )
    async with TestClient(TestServer(web_of(plane).app())) as c:
        status = await (await c.get("/api/status")).json()
    proxies = {p["name"]: p for p in status["proxies"]}
    assert (proxies["p-eu"]["last_error"], proxies["p-eu"]["warnings"]) == ("", [jwt])
    assert (proxies["p-us"]["last_error"], proxies["p-us"]["warnings"]) == (
        "tenant acme: jwks file missing",
        [],
    )
    assert status["fleet_warnings"] == [
        "proxy p-us refused the last route table it was sent (nack: tenant acme: jwks file "
        "missing) and keeps serving its last good one: a change reaches it only once it "
        "accepts a table (`pontoctl get proxies`)",
        f"proxy p-eu reports: {jwt}",
    ]


async def test_a_fleet_that_took_its_table_whole_has_no_warnings(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    status = await (await client.get("/api/status")).json()
    assert status["fleet_warnings"] == []
    assert all(p["warnings"] == [] for p in status["proxies"])


async def test_region_rates_come_from_the_reported_counters(plane: Plane) -> None:
    web = web_of(plane)

    async def report(at: float, eu: tuple[int, int, int], us: tuple[int, int, int]) -> None:
        plane.clock.now = at
        traffic: dict[str, Traffic] = {"p-eu": (*eu, at, {}, {}, {}), "p-us": (*us, at, {}, {}, {})}
        await plane.catalog.put_traffic("r1", traffic, plane.lease)

    await report(1_000.0, (100, 1, 5), (0, 0, 0))
    first = {r["name"]: r for r in (await web.status(plane.clock.now))["regions"]}
    assert first["eu-west"]["requests_per_s"] is None  # one sample: no rate yet
    await report(1_005.0, (200, 6, 15), (25, 0, 0))
    status = await web.status(plane.clock.now)
    regions = {r["name"]: r for r in status["regions"]}
    assert regions["eu-west"]["requests_per_s"] == 20.0
    assert regions["eu-west"]["server_errors_per_s"] == 1.0
    assert regions["eu-west"]["client_errors_per_s"] == 2.0
    assert regions["us-east"]["requests_per_s"] == 5.0
    assert {p["name"]: p["age_s"] for p in status["proxies"]} == {"p-eu": 0.0, "p-us": 0.0}
    assert not any(p["quiet"] or p["stale"] for p in status["proxies"])
    # p-eu restarted: its counters start again from zero.
    await report(1_010.0, (4, 0, 0), (50, 0, 0))
    regions = {r["name"]: r for r in (await web.status(plane.clock.now))["regions"]}
    assert regions["eu-west"]["requests_per_s"] is None
    assert regions["us-east"]["requests_per_s"] == 5.0
    # Nothing heard for longer than the window: the proxy sends nothing.
    plane.clock.now = 1_100.0
    regions = {r["name"]: r for r in (await web.status(plane.clock.now))["regions"]}
    assert regions["us-east"]["requests_per_s"] == 0.0


def region_rates(region: dict[str, Any]) -> tuple[float | None, ...]:
    """A region row's rates: arrived (requests, 5xx, 4xx), served (requests, errors)."""
    names = ("requests", "server_errors", "client_errors", "served", "served_errors")
    return tuple(region[f"{name}_per_s"] for name in names)


def eu_west_after(plane: Plane) -> Callable[[float, dict[str, Traffic]], Awaitable[dict[str, Any]]]:
    """report(at, traffic): eu-west's row of the status page once replica r1
    wrote `traffic` at `at`."""
    web = web_of(plane)

    async def report(at: float, traffic: dict[str, Traffic]) -> dict[str, Any]:
        plane.clock.now = at
        await plane.catalog.put_traffic("r1", traffic, plane.lease)
        regions = {r["name"]: r for r in (await web.status(plane.clock.now))["regions"]}
        eu: dict[str, Any] = regions["eu-west"]
        return eu

    return report


async def test_a_region_rate_is_unknown_while_one_of_its_proxies_rates_is(
    plane: Plane,
) -> None:
    """p-eu2 joins eu-west beside p-eu, having answered requests before this
    replica first read its reports: the region's rates are unknown (a dash),
    not p-eu's alone passed off as the region's, until its next report."""
    report = eu_west_after(plane)

    def p_eu(at: float, n: int) -> Traffic:
        return (n, 0, 0, at, {"eu-west": (n, 0)}, {}, {})

    await report(1_000.0, {"p-eu": p_eu(1_000.0, 100)})
    # Registered but not heard from yet: it counted nothing, the rate is p-eu's.
    record = ProxyRecord("p-eu2", "eu-west", "p-eu2:8080", "1.0", "s-p-eu2", "r1", 1_004.0)
    await plane.catalog.register_proxy(record, plane.lease)
    eu = await report(1_005.0, {"p-eu": p_eu(1_005.0, 150)})
    assert region_rates(eu) == (10.0, 0.0, 0.0, 10.0, 0.0)
    assert eu["proxies"] == 2
    # Its first report read: 40 requests (2 of them 4xx, none 5xx) served by
    # eu-west, when is not known. Unknown where it counted some, p-eu's
    # (known) plus 0 where it counted none.
    p_eu2: Traffic = (40, 0, 2, 1_010.0, {"eu-west": (40, 0)}, {}, {})
    eu = await report(1_010.0, {"p-eu": p_eu(1_010.0, 200), "p-eu2": p_eu2})
    assert region_rates(eu) == (None, 0.0, None, None, 0.0)
    # Its next report: both known, summed.
    p_eu2 = (60, 0, 2, 1_015.0, {"eu-west": (60, 0)}, {}, {})
    eu = await report(1_015.0, {"p-eu": p_eu(1_015.0, 250), "p-eu2": p_eu2})
    assert region_rates(eu) == (14.0, 0.0, 0.0, 14.0, 0.0)


async def test_a_proxy_started_within_the_window_has_rates_from_its_first_report(
    plane: Plane,
) -> None:
    """Trial 22: `make demo-check` sent its burst in the proxies' first
    seconds, their first reports held all of it, and the page showed no
    rate: a first report was only where the rates started. A proxy's
    counters were 0 when its process started, which it says at Register."""
    report = eu_west_after(plane)

    # Registered at 1,001.5 by its replica's clock, 1.5 s after its start
    # by its own: its counters were 0 at 1,000 by the replica's.
    record = ProxyRecord(
        "p-eu", "eu-west", "p-eu:8080", "1.0", "s-p-eu", "r1", 1_001.5, counting_from=1_000.0
    )
    await plane.catalog.register_proxy(record, plane.lease)
    eu = await report(1_004.0, {"p-eu": (40, 0, 4, 1_004.0, {"eu-west": (40, 0)}, {}, {})})
    assert region_rates(eu) == (10.0, 0.0, 1.0, 10.0, 0.0)
    # A process that had run a while when it registered (connecting again,
    # to this replica): counted since before the window, unknown until its
    # next report.
    record = ProxyRecord(
        "p-eu2", "eu-west", "p-eu2:8080", "1.0", "s-p-eu2", "r1", 1_000.0, counting_from=400.0
    )
    await plane.catalog.register_proxy(record, plane.lease)
    traffic: dict[str, Traffic] = {
        "p-eu": (80, 0, 8, 1_008.0, {"eu-west": (80, 0)}, {}, {}),
        "p-eu2": (900, 0, 0, 1_008.0, {"eu-west": (900, 0)}, {}, {}),
    }
    assert region_rates(await report(1_008.0, traffic))[0] is None


async def test_regions_show_what_they_served_wherever_clients_arrived(plane: Plane) -> None:
    """All calls arrive at p-us; origins of three regions serve them, one of
    which (ap-southeast) has no proxy."""
    await plane.catalog.put_region(Region("ap-southeast", 1.4, 103.8), allow_update=False)
    plane.publisher.publish(compile_table(await plane.catalog.snapshot()))
    web = web_of(plane)

    async def report(at: float, requests: int, served: Served) -> dict[str, dict[str, Any]]:
        plane.clock.now = at
        traffic: dict[str, Traffic] = {"p-us": (requests, 0, 0, at, served, {}, {})}
        await plane.catalog.put_traffic("r1", traffic, plane.lease)
        return {r["name"]: r for r in (await web.status(at))["regions"]}

    regions = await report(1_000.0, 10, {"us-east": (10, 0)})
    # One sample: unknown where p-us counted some, 0 where it counted none.
    assert regions["us-east"]["served_per_s"] is None
    assert regions["us-east"]["served_errors_per_s"] == 0.0
    assert regions["ap-southeast"]["served_per_s"] == 0.0
    # ap-southeast was first reported now: it counts from 0, not from here.
    served = {"us-east": (20, 1), "eu-west": (5, 0), "ap-southeast": (10, 5)}
    regions = await report(1_005.0, 35, served)
    rates = {n: (r["served_per_s"], r["served_errors_per_s"]) for n, r in regions.items()}
    assert rates == {
        "eu-west": (1.0, 0.0),
        "us-east": (2.0, 0.2),
        "ap-southeast": (2.0, 1.0),
    }
    assert regions["ap-southeast"]["proxies"] == 0
    assert regions["ap-southeast"]["requests_per_s"] is None  # no client arrived there
    assert regions["us-east"]["requests_per_s"] == 5.0
    # Counters of a region that fell (counted afresh): from 0, as a tenant's;
    # over the window ap-southeast served 10, then 3, then 2 more.
    regions = await report(1_010.0, 3, {"ap-southeast": (3, 0)})
    assert regions["ap-southeast"]["served_per_s"] == 13 / 10
    regions = await report(1_012.0, 5, {"ap-southeast": (5, 0)})
    assert regions["ap-southeast"]["served_per_s"] == 15 / 12
    # Nothing heard for longer than the window: nothing served.
    regions = {r["name"]: r for r in (await web.status(1_100.0))["regions"]}
    assert regions["ap-southeast"]["served_per_s"] == 0.0


async def test_drain_with_the_token_writes_the_catalog_and_the_audit(
    plane: Plane,
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    auth = AUTH
    resp = await client.post("/api/regions/eu-west/drain", headers=auth)
    assert resp.status == 200
    assert await resp.json() == {
        "name": "eu-west",
        "drained": True,
        "changed": True,
        "warnings": [],
    }
    assert (await plane.catalog.get_region("eu-west")).drained
    assert plane.audit.calls == [
        {
            "actor": "admin-token",
            "action": "DrainRegion",
            "target": "region/eu-west",
            "detail": {"drained": "true", "changes": "drained false -> true"},
            "source": "http:127.0.0.1",
            "result": "ok",
        }
    ]
    # The page shows the table the builder compiles from the change.
    plane.publisher.publish(compile_table(await plane.catalog.snapshot()))
    plane.clock.now += 1  # past the cached answer
    status = await (await client.get("/api/status")).json()
    assert [r["drained"] for r in status["regions"] if r["name"] == "eu-west"] == [True]
    resp = await client.post("/api/regions/eu-west/undrain", headers=auth)
    assert (await resp.json())["changed"] is True
    assert not (await plane.catalog.get_region("eu-west")).drained
    resp = await client.post("/api/origins/o-us/drain", headers=auth)
    assert await resp.json() == {"name": "o-us", "drained": True, "changed": True, "warnings": []}
    assert plane.audit.calls[-1]["target"] == "origin/o-us"
    await client.post("/api/origins/o-us/undrain", headers=auth)
    actions = [call["action"] for call in plane.audit.calls]
    assert actions == ["DrainRegion", "UndrainRegion", "DrainOrigin", "UndrainOrigin"]


async def test_a_drain_answers_with_the_warnings_the_admin_api_sends(
    plane: Plane,
    client: TestClient,  # type: ignore[type-arg]
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def change(path: str) -> dict[str, object]:
        resp = await client.post(path, headers=AUTH)
        assert resp.status == 200
        body: dict[str, object] = await resp.json()
        return body

    # Model m is served in both regions: draining one leaves it the other.
    assert (await change("/api/regions/eu-west/drain"))["warnings"] == []
    assert await change("/api/regions/us-east/drain") == {
        "name": "us-east",
        "drained": True,
        "changed": True,
        "warnings": [
            "no undrained origin serves model 'm' now (region 'us-east' was the last): "
            "proxies answer requests for it 503 no_healthy_origin until one is undrained"
        ],
    }
    # A click on a stale page (a second tab, say): nothing changes, nothing is
    # its doing, nothing is written.
    stored = await plane.catalog.store.get(REGIONS + "us-east")
    assert stored is not None
    assert await change("/api/regions/us-east/drain") == {
        "name": "us-east",
        "drained": True,
        "changed": False,
        "warnings": [],
    }
    again = await plane.catalog.store.get(REGIONS + "us-east")
    assert again is not None and again.mod_revision == stored.mod_revision
    # The trail says so (trial 27: it read as a second drain).
    assert plane.audit.calls[-1]["detail"] == {"drained": "true", "changes": "nothing"}
    # An origin undrained while its region is drained still gets nothing: said
    # whether the undrain changed anything (o-us was never drained) or not.
    unrouted = [
        "origin o-us is undrained, but its region us-east is drained: it gets no traffic "
        "until `pontoctl undrain region us-east`"
    ]
    assert await change("/api/origins/o-us/undrain") == {
        "name": "o-us",
        "drained": False,
        "changed": False,
        "warnings": unrouted,
    }
    assert (await change("/api/origins/o-us/drain"))["warnings"] == []
    assert (await change("/api/origins/o-us/undrain"))["warnings"] == unrouted
    assert (await change("/api/regions/us-east/undrain"))["warnings"] == []
    # etcd failing the read the warnings need: the drain is done, said, and logged.
    store = plane.catalog.store
    assert isinstance(store, CountingStore)
    store.failing = True
    assert await change("/api/regions/us-east/drain") == {
        "name": "us-east",
        "drained": True,
        "changed": True,
        "warnings": [],
    }
    store.failing = False
    assert (await plane.catalog.get_region("us-east")).drained
    [line] = [r for r in caplog.records if "were not checked" in r.getMessage()]
    assert line.getMessage().startswith("region us-east drained; the models it leaves")
    assert line.exc_info is None


async def test_a_region_undrained_with_all_its_origins_drained_is_warned_of(
    plane: Plane,
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    await client.post("/api/origins/o-us/drain", headers=AUTH)
    await client.post("/api/regions/us-east/drain", headers=AUTH)
    warning = (
        "region us-east is undrained, but all its origins are drained (o-us): it gets no "
        "traffic until one is undrained (`pontoctl undrain origin o-us`)"
    )
    for changed in (True, False):  # a click on a stale page is told the same
        resp = await client.post("/api/regions/us-east/undrain", headers=AUTH)
        assert await resp.json() == {
            "name": "us-east",
            "drained": False,
            "changed": changed,
            "warnings": [warning],
        }


async def test_page_writes_are_counted_as_admin_calls(plane: Plane) -> None:
    metrics = ControlMetrics(replica="r1")
    web = web_of(plane, metrics=metrics)
    async with TestClient(TestServer(web.app())) as client:
        await client.post("/api/regions/eu-west/drain", headers=AUTH)
        await client.post("/api/regions/eu-west/undrain", headers=AUTH)
        await client.post("/api/regions/eu-west/drain", headers=WRITE)
        await client.post(
            "/api/regions/eu-west/drain", headers={**WRITE, "Authorization": "Bearer x"}
        )
        await client.post("/api/origins/nowhere/drain", headers=AUTH)
    calls = {
        (s.labels["method"], s.labels["code"]): s.value
        for family in metrics.admin_calls.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }
    # Undrains are DrainRegion calls with drained=false, as in the Admin API.
    assert calls == {
        ("DrainRegion", "OK"): 2.0,
        ("DrainRegion", "UNAUTHENTICATED"): 2.0,  # none, and a wrong one (trial 48)
        ("DrainOrigin", "NOT_FOUND"): 1.0,
    }


def assert_error(body: dict[str, object], code: str) -> None:
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "missing_admin_token"),
        ({"Authorization": "Basic abc"}, 401, "missing_admin_token"),
        ({"Authorization": "Bearer "}, 401, "missing_admin_token"),
        # 401 as the Admin API's UNAUTHENTICATED (trial 48: a 403).
        ({"Authorization": "Bearer wrong"}, 401, "invalid_admin_token"),
        ({"Authorization": f"Bearer {TOKEN}x"}, 401, "invalid_admin_token"),
    ],
)
async def test_drain_without_the_right_token_changes_nothing(
    plane: Plane,
    client: TestClient,  # type: ignore[type-arg]
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    resp = await client.post("/api/regions/eu-west/drain", headers={**WRITE, **headers})
    assert resp.status == status
    assert_error(await resp.json(), code)
    assert not (await plane.catalog.get_region("eu-west")).drained
    assert plane.audit.calls == []


async def test_a_drain_with_two_authorization_headers_is_refused(
    plane: Plane,
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    """Trial 23: the first of two counted, where a proxy in front of the page
    may read the other; refused, as the proxies refuse such a request."""
    headers = CIMultiDict(WRITE)
    headers.add("Authorization", f"Bearer {TOKEN}")
    headers.add("Authorization", "Bearer another")
    resp = await client.post("/api/regions/eu-west/drain", headers=headers)
    assert resp.status == 400
    assert_error(await resp.json(), "multiple_authorization_headers")
    assert not (await plane.catalog.get_region("eu-west")).drained


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/api/regions/nowhere/drain", 404, "not_found"),
        ("POST", "/api/origins/nothing/undrain", 404, "not_found"),
        ("POST", "/api/regions/Bad%20Name/drain", 400, "invalid_argument"),
        ("GET", "/api/regions/eu-west/drain", 405, "method_not_allowed"),
        ("DELETE", "/api/status", 405, "method_not_allowed"),
        ("GET", "/nope", 404, "not_found"),
        ("GET", "/static/../web.py", 404, "not_found"),
    ],
)
async def test_bad_requests_get_openai_style_errors(
    client: TestClient,  # type: ignore[type-arg]
    method: str,
    path: str,
    status: int,
    code: str,
) -> None:
    resp = await client.request(method, path, headers=AUTH)
    assert resp.status == status
    assert resp.headers["Content-Type"].startswith("application/json")
    assert_error(await resp.json(), code)


async def test_a_refusal_is_logged_once_at_info_without_a_traceback(
    client: TestClient,  # type: ignore[type-arg]
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        await client.post("/api/regions/eu-west/drain", headers=WRITE)
    lines = [r for r in caplog.records if r.name == "ponto.refusals"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.INFO and lines[0].exc_info is None
    assert "401" in lines[0].getMessage() and "/api/regions/eu-west/drain" in lines[0].getMessage()


async def test_without_an_admin_token_writes_are_open_like_the_admin_api(plane: Plane) -> None:
    async with TestClient(TestServer(web_of(plane, admin_token="").app())) as c:
        assert (await (await c.get("/api/status")).json())["writes"] == "open"
        resp = await c.post("/api/regions/us-east/drain", headers=WRITE)
        assert resp.status == 200
    assert (await plane.catalog.get_region("us-east")).drained
    assert plane.audit.calls[0]["actor"] == "anonymous"


async def test_writes_off_refuses_every_write_and_the_page_says_why(plane: Plane) -> None:
    why = "changes from this page are off (--http-writes off); use pontoctl"
    async with TestClient(TestServer(web_of(plane, writes_off=why).app())) as c:
        status = await (await c.get("/api/status")).json()
        assert (status["writes"], status["writes_off"]) == ("off", why)
        resp = await c.post("/api/regions/us-east/drain", headers=AUTH)  # the right token
        assert resp.status == 403
        body = await resp.json()
        assert_error(body, "writes_off")
        assert body["error"]["message"] == why
    assert not (await plane.catalog.get_region("us-east")).drained
    assert plane.audit.calls == []


async def test_every_admin_token_of_a_rotation_may_drain(plane: Plane) -> None:
    web = web_of(plane, admin_token=("new-admin-token-0123", TOKEN))
    async with TestClient(TestServer(web.app())) as c:
        for token, status in (("new-admin-token-0123", 200), (TOKEN, 200), ("other", 401)):
            headers = {**WRITE, "Authorization": f"Bearer {token}"}
            assert (await c.post("/api/regions/us-east/drain", headers=headers)).status == status


async def test_without_an_audit_log_a_drain_still_works(plane: Plane) -> None:
    web = StatusWeb(plane.catalog, plane.publisher, "r1", admin_token="")
    async with TestClient(TestServer(web.app())) as c:
        assert (await c.post("/api/regions/us-east/drain", headers=WRITE)).status == 200
    assert (await plane.catalog.get_region("us-east")).drained


async def test_origins_show_the_leaders_latest_vllm_figures(plane: Plane) -> None:
    scraped = pb.OriginLoads(
        generation=1,
        loads=[
            pb.OriginLoad(
                origin="o-eu", running=3, waiting=2, kv_cache_usage=0.5, prefix_hit_rate=0.75
            ),
            pb.OriginLoad(
                origin="o-us", running=1, waiting=0, kv_cache_usage=-1, prefix_hit_rate=-1
            ),
        ],
    )
    web = web_of(plane, loads=lambda: scraped)
    regions = {r["name"]: r for r in (await web.status(plane.clock.now))["regions"]}
    (eu,) = regions["eu-west"]["origins"]
    assert (eu["running"], eu["waiting"], eu["kv_cache_usage"]) == (3, 2, 0.5)
    assert eu["prefix_hit_rate"] == 0.75
    # Its requests are the scrape's, not the table's older figure (trial 33:
    # one row said 2 in flight and 4 running, 12 waiting).
    assert eu["inflight"] == 5
    assert regions["eu-west"]["load"] == pytest.approx(0.5)  # 5 of its 10
    (us,) = regions["us-east"]["origins"]
    assert (us["running"], us["kv_cache_usage"]) == (1, None)  # -1: the gauge is missing
    assert us["prefix_hit_rate"] is None
    regions = {r["name"]: r for r in (await web_of(plane).status(0.0))["regions"]}
    assert regions["eu-west"]["origins"][0]["running"] is None  # nothing scraped yet


async def republish(plane: Plane) -> None:
    """Publish the table of the catalog now, as the next version."""
    latest = plane.publisher.latest
    version = latest.table.version + 1 if latest else 1
    table = compile_table(await plane.catalog.snapshot())
    table.version, table.etag = version, f"e{version}"
    plane.publisher.publish(table)


async def test_an_origin_whose_load_is_not_read_says_so_not_zero(plane: Plane) -> None:
    """Trial 66: a llama.cpp origin with 8 in flight read "0 / 4 (0%)" and
    `inflight 0.0 load 0.0`, as a scraped idle one does."""
    await plane.catalog.put_health(
        OriginHealth("o-eu", healthy=True, server_kind="unknown", inflight_unknown=True)
    )
    await republish(plane)
    async with TestClient(TestServer(web_of(plane).app())) as c:
        status = await (await c.get("/api/status")).json()
    regions = {r["name"]: r for r in status["regions"]}
    (eu,) = regions["eu-west"]["origins"]
    assert (eu["inflight"], eu["load"], eu["server"]) == (None, None, "unknown")
    assert eu["capacity"] == 10
    assert regions["eu-west"]["load"] is None  # no origin there whose load is read
    # A live scrape of it is its load again.
    live = pb.OriginLoads(generation=1, loads=[pb.OriginLoad(origin="o-eu", running=2)])
    regions = {
        r["name"]: r for r in (await web_of(plane, loads=lambda: live).status(0.0))["regions"]
    }
    assert regions["eu-west"]["origins"][0]["inflight"] == 2


async def test_an_origin_that_cannot_continue_with_continuation_on_is_warned_of(
    plane: Plane,
) -> None:
    await plane.catalog.put_health(OriginHealth("o-eu", healthy=True, server_kind="tgi"))
    await republish(plane)
    status = await web_of(plane).status(plane.clock.now)
    (eu,) = {r["name"]: r for r in status["regions"]}["eu-west"]["origins"]
    assert eu["server"] == "tgi"
    assert "garbled" in eu["continuation_warning"]
    (warning,) = status["fleet_warnings"]
    assert warning.startswith("origin o-eu is a TGI, which cannot continue a partial answer")
    assert "pontoctl origin add o-eu --update --continuation off" in warning
    # Off: nothing to warn of.
    await plane.catalog.put_origin(
        Origin("o-eu", "http://o-eu:8000/v1", "eu-west", ("m",), capacity=10, continuation=False),
        allow_update=True,
    )
    await republish(plane)
    status = await web_of(plane).status(plane.clock.now)
    (eu,) = {r["name"]: r for r in status["regions"]}["eu-west"]["origins"]
    assert eu["continuation_warning"] == "" and status["fleet_warnings"] == []


def test_http_listen_is_off_by_default_and_checked() -> None:
    assert parse([]).http_listen == ""
    assert parse(["--http-listen", "0.0.0.0:8080"]).http_listen == "0.0.0.0:8080"
    assert parse(["--http-listen", "[::1]:0"]).http_listen == "[::1]:0"
    # An empty host is every interface, as for every other listen flag.
    assert parse(["--http-listen", ":8080"]).http_listen == "0.0.0.0:8080"
    for bad in ("8080", "host:", "host:http", "host:70000"):
        with pytest.raises(SystemExit):
            parse(["--http-listen", bad])


async def test_a_store_outage_is_a_503_and_a_bug_a_500_both_in_json(
    plane: Plane,
    client: TestClient,  # type: ignore[type-arg]
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A drain while etcd is away is a 503 (the status itself still answers,
    from the latest table: test_with_the_store_away_...)."""

    async def away(*_: object, **__: object) -> None:
        raise Unavailable("state store unavailable: etcd is away")

    async def broken() -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(plane.catalog, "drain_region", away)
    caplog.set_level(logging.WARNING)
    resp = await client.post("/api/regions/eu-west/drain", headers=AUTH)
    assert resp.status == 503
    assert_error(await resp.json(), "unavailable")
    monkeypatch.setattr(plane.catalog, "list_proxies", broken)
    plane.clock.now += 1  # past the cached answer
    resp = await client.get("/api/status")
    assert resp.status == 500
    body = await resp.json()
    assert_error(body, "internal_error")
    assert "a bug" not in str(body)
    # The outage a WARNING line, the bug an ERROR with its traceback.
    logged = [(r.levelno, bool(r.exc_info)) for r in caplog.records]
    assert [entry for entry in logged if entry[0] >= logging.WARNING] == [
        (logging.WARNING, False),
        (logging.ERROR, True),
    ]


async def test_the_port_lives_and_dies_with_the_control_plane() -> None:
    settings = parse(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--id", "r1"])
    store = MemoryStore()
    await Catalog(store).put_region(Region("eu-west", 53.3, -6.3), allow_update=False)
    plane = ControlPlane(settings, store)
    await plane.start()
    url = f"http://127.0.0.1:{plane.http_port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/api/status") as resp:
                status = await resp.json()
            assert status["replica"] == "r1" and status["writes"] == "open"
            async with session.post(url + "/api/regions/eu-west/drain", headers=WRITE) as resp:
                assert resp.status == 200
            # The replica's own metrics, on the same port.
            async with session.get(url + "/metrics") as resp:
                assert resp.status == 200
                exposition = await resp.text()
        assert 'ponto_control_info{replica="r1"' in exposition
        assert "# TYPE ponto_control_admin_calls_total counter" in exposition
        # The drain is in the replica's own audit trail.
        [entry] = await plane.audit.read()
        assert (entry.action, entry.target, entry.actor) == (
            "DrainRegion",
            "region/eu-west",
            "anonymous",
        )
        assert entry.source.startswith("http:127.0.0.1")
    finally:
        await plane.stop(grace=0)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(url + "/api/status")


async def test_without_http_listen_there_is_no_port() -> None:
    plane = ControlPlane(parse(["--listen", "127.0.0.1:0", "--id", "r1"]), MemoryStore())
    await plane.start()
    try:
        assert plane.http_port == 0 and plane.web_runner is None
    finally:
        await plane.stop(grace=0)


# ---------------------------------------------------------------- another site


@pytest.mark.parametrize("token", [TOKEN, ""], ids=["token", "open"])
@pytest.mark.parametrize(
    ("headers", "data", "code"),
    [
        # A form posted from another site: no custom header is possible.
        (
            {"Content-Type": "application/x-www-form-urlencoded", "Origin": "http://evil.example"},
            "a=b",
            "missing_request_header",
        ),
        ({"Content-Type": "text/plain"}, "x", "missing_request_header"),
        ({}, None, "missing_request_header"),
        ({"X-Ponto-Request": "yes"}, None, "missing_request_header"),
        ({**WRITE, "Sec-Fetch-Site": "cross-site"}, None, "cross_site_request"),
        ({**WRITE, "Sec-Fetch-Site": "same-site"}, None, "cross_site_request"),
        ({**WRITE, "Origin": "http://evil.example"}, None, "cross_site_request"),
        ({**WRITE, "Origin": "null"}, None, "cross_site_request"),
    ],
)
async def test_a_write_another_site_could_send_is_refused(
    plane: Plane, token: str, headers: dict[str, str], data: str | None, code: str
) -> None:
    async with TestClient(TestServer(web_of(plane, admin_token=token).app())) as c:
        auth = {"Authorization": f"Bearer {TOKEN}"} if token else {}
        resp = await c.post("/api/regions/eu-west/drain", headers={**auth, **headers}, data=data)
        assert resp.status == 403
        assert_error(await resp.json(), code)
    assert not (await plane.catalog.get_region("eu-west")).drained
    assert plane.audit.calls == []


@pytest.mark.parametrize("token", [TOKEN, ""], ids=["token", "open"])
async def test_the_pages_own_request_is_taken(plane: Plane, token: str) -> None:
    async with TestClient(TestServer(web_of(plane, admin_token=token).app())) as c:
        host = f"127.0.0.1:{c.port}"
        headers = {
            **WRITE,
            "Host": host,
            "Origin": f"http://{host}",
            "Sec-Fetch-Site": "same-origin",
        }
        if token:
            headers["Authorization"] = f"Bearer {TOKEN}"
        resp = await c.post("/api/regions/eu-west/drain", headers=headers)
        assert resp.status == 200, await resp.text()
    assert (await plane.catalog.get_region("eu-west")).drained


@pytest.mark.parametrize("host", ["evil.example:8080", "ponto.internal", "x@127.0.0.1:8080"])
async def test_open_writes_are_refused_at_a_name_dns_rebinding_could_point_here(
    plane: Plane, host: str
) -> None:
    async with TestClient(TestServer(web_of(plane, admin_token="").app())) as c:
        headers = {**WRITE, "Host": host, "Origin": f"http://{host}"}
        resp = await c.post("/api/regions/eu-west/drain", headers=headers)
        assert resp.status == 403
        assert_error(await resp.json(), "host_not_allowed")
        resp = await c.post("/api/regions/eu-west/drain", headers={**WRITE, "Host": "[::1"})
        assert_error(await resp.json(), "host_not_allowed")  # malformed: no 500
        for allowed in ("localhost:8080", "[::1]:8080", "10.0.0.7"):
            resp = await c.post("/api/regions/eu-west/drain", headers={**WRITE, "Host": allowed})
            assert resp.status == 200, allowed
    # With a token, a name is fine: the rebound page has no token.
    async with TestClient(TestServer(web_of(plane).app())) as c:
        resp = await c.post("/api/regions/eu-west/undrain", headers={**AUTH, "Host": host})
        assert resp.status == 200


def test_page_writes_are_off_under_mutual_tls_unless_asked_for(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "pki")
    assert parse([]).http_writes
    assert not parse(["--http-writes", "off"]).http_writes
    assert not parse(bundle.control_args()).http_writes
    assert parse([*bundle.control_args(), "--http-writes", "on"]).http_writes
    without_token = bundle.control_args()[:6]  # TLS flags, no tokens
    assert "--admin-token-file" not in without_token
    assert not parse(without_token).http_writes
    with pytest.raises(SystemExit):
        parse([*without_token, "--http-writes", "on"])
    with pytest.raises(SystemExit):
        parse(["--http-writes", "maybe"])


async def test_a_plane_under_mutual_tls_shows_its_writes_off(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path / "pki")
    argv = ["--listen", "127.0.0.1:0", "--id", "r1", *bundle.control_args()]
    plane = ControlPlane(parse(argv), MemoryStore())
    status = await plane.web.status(0.0)
    assert status["writes"] == "off"
    assert "--http-writes on" in status["writes_off"]
    plane = ControlPlane(parse([*argv, "--http-writes", "on"]), MemoryStore())
    status = await plane.web.status(0.0)
    assert (status["writes"], status["writes_off"]) == ("token", "")


async def test_a_planes_page_shows_load_figures_only_while_a_leader_scrapes() -> None:
    """The plane gives its page the hub's fresh loads (LoadHub.fresh): figures
    frozen since the leader stopped scraping read as none, not as live."""
    plane = ControlPlane(parse(["--listen", "127.0.0.1:0", "--id", "r1"]), MemoryStore())
    origin = Origin("a", "http://a.test:8000/v1", "east", ("m",))
    plane.publisher.publish(
        compile_table(State(1, regions=(Region("east", 40.0, -74.0),), origins=(origin,)))
    )

    async def running(scraped_at: float) -> Any:
        plane.loads.loads = pb.OriginLoads(
            scraped_at=scraped_at, loads=[pb.OriginLoad(origin="a", running=3.0)]
        )
        status = await plane.web.status(time.time())
        return status["regions"][0]["origins"][0]["running"]

    assert await running(time.time()) == 3.0
    assert await running(time.time() - stale_after(plane.settings.probe) - 1) is None


async def test_a_planes_list_origins_gives_load_figures_only_while_a_leader_scrapes() -> None:
    """pontoctl get origins agrees with the page (LoadHub.fresh)."""
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.put_region(Region("east", 40.0, -74.0), allow_update=False)
    await catalog.put_origin(
        Origin("a", "http://a.test:8000/v1", "east", ("m",), capacity=8), allow_update=False
    )
    plane = ControlPlane(parse(["--listen", "127.0.0.1:0", "--id", "r1"]), store)
    await plane.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{plane.port}")
    try:
        stub = admin_pb2_grpc.AdminStub(channel)

        async def inflight(scraped_at: float) -> tuple[float, bool]:
            plane.loads.loads = pb.OriginLoads(
                scraped_at=scraped_at, loads=[pb.OriginLoad(origin="a", running=3.0)]
            )
            (origin,) = (await stub.ListOrigins(apb.ListRequest())).origins
            return origin.inflight, origin.inflight_unknown

        assert await inflight(time.time()) == (3.0, False)
        stale = time.time() - stale_after(plane.settings.probe) - 1
        assert await inflight(stale) == (0.0, True)  # as before any scrape
    finally:
        await channel.close()
        await plane.stop(grace=0)


# ---------------------------------------------------------------- correctness


async def test_tenants_show_the_limit_refusals_and_slot_waits_proxies_reported(
    plane: Plane,
) -> None:
    await plane.catalog.put_tenant(
        Tenant("acme", limits=Limits(rpm=600, concurrency=4)), allow_update=False
    )
    plane.publisher.publish(compile_table(await plane.catalog.snapshot()))
    web = web_of(plane)

    async def report(at: float, eu: Limited, us: Limited) -> list[dict[str, Any]]:
        plane.clock.now = at
        traffic: dict[str, Traffic] = {
            "p-eu": (0, 0, 0, at, {}, eu, {}),
            "p-us": (0, 0, 0, at, {}, us, {}),
        }
        await plane.catalog.put_traffic("r1", traffic, plane.lease)
        tenants: list[dict[str, Any]] = (await web.status(at))["tenants"]
        return tenants

    # One sample: p-us's 2 refusals have no rate yet, which the page says
    # (a dash), not that nobody was refused; it counted no slot wait at all.
    assert [
        (t["name"], t["refused_per_s"], t["slot_waits_per_s"])
        for t in await report(1_000.0, {}, {"acme": (2, 0)})
    ] == [("acme", None, 0.0)]
    # Both proxies held acme back; beta (no longer in the table) first at p-eu,
    # so counted from the report before, when p-eu had nothing of it.
    tenants = await report(1_005.0, {"acme": (5, 5), "beta": (1, 0)}, {"acme": (12, 5)})
    assert tenants == [
        {
            "name": "acme",
            "refused_per_s": 3.0,  # (5 + 10) / 5 s
            "slot_waits_per_s": 2.0,
            "rpm": 600,
            "tpm": 0,
            "concurrency": 4,
            "tokens_per_day": 0,
            "tokens_per_month": 0,
        },
        {
            "name": "beta",
            "refused_per_s": 0.2,
            "slot_waits_per_s": 0.0,
            "rpm": 0,
            "tpm": 0,
            "concurrency": 0,
            "tokens_per_day": 0,
            "tokens_per_month": 0,
        },
    ]
    # p-us's counts of acme went down (forgotten, then limited again): its 10
    # refusals and 5 waits before, then 1 refusal from 0, beside p-eu's 5 and 5.
    tenants = await report(1_010.0, {"acme": (5, 5), "beta": (1, 0)}, {"acme": (1, 0)})
    assert [(t["name"], t["refused_per_s"], t["slot_waits_per_s"]) for t in tenants] == [
        ("acme", 1.6, 1.0),
        ("beta", 0.1, 0.0),
    ]
    # Nothing heard for longer than the window: nobody is held back now.
    assert (await web.status(1_100.0))["tenants"] == []


async def test_each_proxy_is_compared_with_its_own_replicas_table(plane: Plane) -> None:
    lease = plane.lease
    record = ProxyRecord("p-r2", "eu-west", "p-r2:8080", "1.0", "s-p-r2", "r2", 900.0)
    await plane.catalog.register_proxy(record, lease)
    # r2's revisions are its own: it serves 30 and its proxy ACKed it.
    await plane.catalog.put_acks("r2", {"p-r2": (30, "")}, lease, version=30)
    # r3 serves 40, its proxy is at 39.
    record = ProxyRecord("p-r3", "eu-west", "p-r3:8080", "1.0", "s-p-r3", "r3", 900.0)
    await plane.catalog.register_proxy(record, lease)
    await plane.catalog.put_acks("r3", {"p-r3": (39, "")}, lease, version=40)
    proxies = {p["name"]: p for p in (await web_of(plane).status(1_000.0))["proxies"]}
    assert proxies["p-r2"]["latest"] and proxies["p-r2"]["current_version"] == 30
    assert not proxies["p-r3"]["latest"] and proxies["p-r3"]["current_version"] == 40
    assert proxies["p-eu"]["latest"]  # r1's, at r1's 7


async def test_a_restarted_proxy_starts_its_rates_afresh(plane: Plane) -> None:
    web = web_of(plane)

    async def report(session: str, at: float, requests: int) -> list[Any]:
        record = ProxyRecord("p-eu", "eu-west", "p-eu:8080", "1.0", session, "r1", 900.0)
        await plane.catalog.register_proxy(record, plane.lease)
        traffic: dict[str, Traffic] = {"p-eu": (requests, 0, 0, at, {}, {}, {})}
        await plane.catalog.put_traffic("r1", traffic, plane.lease)
        return [
            r["requests_per_s"] for r in (await web.status(at))["regions"] if r["name"] == "eu-west"
        ]

    await report("s-1", 1_000.0, 1_000)
    assert await report("s-1", 1_005.0, 1_500) == [100.0]
    # It restarted under the same name and, before anyone looked, passed the old count.
    assert await report("s-2", 1_010.0, 2_000) == [None]
    assert await report("s-2", 1_015.0, 2_050) == [10.0]


async def test_a_burst_after_a_quiet_spell_shows_a_rate(plane: Plane) -> None:
    web = web_of(plane)

    async def view(at: float) -> list[Any]:
        return [
            r["requests_per_s"] for r in (await web.status(at))["regions"] if r["name"] == "eu-west"
        ]

    await plane.catalog.put_traffic("r1", {"p-eu": (100, 0, 0, 1_000.0, {}, {}, {})}, plane.lease)
    for second in range(1_016, 1_060, 2):  # quiet: nothing written, the page polls
        assert await view(float(second)) == [0.0]
    # 90 requests, heard and written at once; nothing after.
    await plane.catalog.put_traffic("r1", {"p-eu": (190, 0, 0, 1_060.0, {}, {}, {})}, plane.lease)
    (rate,) = await view(1_061.0)
    assert rate is not None and rate > 0


async def unviewed(
    plane: Plane,
    reports: dict[float, Limited],
    until: float,
    *,
    written_after: float = 0.0,
    traffic_every: float = TRAFFIC_EVERY,
) -> StatusWeb:
    """A StatusWeb whose sampler (sample_forever) ran from the clock's time
    to `until`, nobody viewing the page, while p-eu's replica wrote `reports`
    (heard at -> p-eu's tenant counts) `written_after` seconds after hearing
    them. Time passes in the sampler's sleeps: nothing sleeps."""
    assert max(reports) + written_after <= until
    due = sorted((at + written_after, (at, limited)) for at, limited in reports.items())
    stopped = asyncio.Event()

    async def written_until(now: float) -> None:
        plane.clock.now = now
        while due and due[0][0] <= now:
            _, (at, limited) = due.pop(0)
            await plane.catalog.put_traffic(
                "r1", {"p-eu": (0, 0, 0, at, {}, limited, {})}, plane.lease
            )

    async def sleep(seconds: float) -> None:
        if plane.clock.now + seconds > until:
            stopped.set()
            await asyncio.Event().wait()  # until cancelled
        await written_until(plane.clock.now + seconds)

    web = web_of(plane, sleep=sleep, traffic_every=traffic_every)
    sampler = asyncio.create_task(web.sample_forever())
    await stopped.wait()
    sampler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sampler
    await written_until(until)
    return web


def limits_of(status: dict[str, Any]) -> dict[str, tuple[float | None, float | None]]:
    return {t["name"]: (t["refused_per_s"], t["slot_waits_per_s"]) for t in status["tenants"]}


async def test_a_burst_nobody_viewed_shows_when_the_page_is_opened_after_it(
    plane: Plane,
) -> None:
    """The operator's trial: 39 refusals of acme, reported in two writes; the
    page opened 6 s after the last. Every report was a sample, viewed or not."""
    await plane.catalog.put_traffic("r1", {"p-eu": (0, 0, 0, 1_000.0, {}, {}, {})}, plane.lease)
    burst: dict[float, Limited] = {1_031.0: {"acme": (20, 0)}, 1_035.0: {"acme": (39, 0)}}
    web = await unviewed(plane, burst, until=1_041.0)
    # From the quiet sample at the window's start (1_020.0) to the last report.
    assert limits_of(await web.status(1_041.0)) == {"acme": (39 / 15, 0.0)}
    # A replica that had not sampled them (just started) cannot tell when they
    # came: it says the rate is unknown, not that nobody was refused.
    assert limits_of(await web_of(plane).status(1_041.0)) == {"acme": (None, 0.0)}


@pytest.mark.parametrize(
    ("written_after", "seconds"), [(0.0, 6), (2.0, 6), (4.5, 6), (5.0, 6), (6.0, 5)]
)
async def test_a_burst_written_late_after_a_quiet_spell_still_shows(
    plane: Plane, written_after: float, seconds: int
) -> None:
    """Reports written every 2 s (a 6 s window); a quiet proxy's 20 refusals
    heard at 1_031 but written up to 6 s later (a loaded replica, a slow
    etcd), the page opened then. Meanwhile each sample took the quiet counts
    as still held 4 s before it, up to 1_032: the burst, heard at 1_031, is
    counted all the same, over the window before it as of the last of those
    (from 1_025, or 1_026 when the last was 1_032)."""
    await plane.catalog.put_traffic("r1", {"p-eu": (0, 0, 0, 1_000.0, {}, {}, {})}, plane.lease)
    burst: dict[float, Limited] = {1_031.0: {"acme": (20, 0)}}
    opened = 1_031.0 + written_after
    web = await unviewed(plane, burst, opened, written_after=written_after, traffic_every=2.0)
    assert limits_of(await web.status(opened)) == {"acme": (20 / seconds, 0.0)}


async def test_a_page_opened_at_the_end_of_a_burst_counts_all_of_it(plane: Plane) -> None:
    await plane.catalog.put_traffic("r1", {"p-eu": (0, 0, 0, 1_000.0, {}, {}, {})}, plane.lease)
    burst: dict[float, Limited] = {
        1_031.0: {"acme": (10, 2)},
        1_036.0: {"acme": (25, 4)},
        1_041.0: {"acme": (39, 6)},
    }
    web = await unviewed(plane, burst, until=1_041.0)
    # The first view sees the last report: all 39 refusals and 6 waits since
    # the quiet sample kept at the window's start (1_020.0), none as a baseline.
    assert limits_of(await web.status(1_041.0)) == {"acme": (39 / 21, 6 / 21)}


async def test_a_tenant_a_known_proxy_first_reports_counts_from_zero(plane: Plane) -> None:
    """A proxy's first report to a running replica is its baseline (it may have
    reconnected here with counts from before, see
    test_a_restarted_proxy_starts_its_rates_afresh); a tenant it first
    reports later was limited since its report before."""
    await plane.catalog.put_traffic(
        "r1", {"p-eu": (0, 0, 0, 1_000.0, {}, {"old": (7, 0)}, {})}, plane.lease
    )
    web = await unviewed(plane, {1_004.0: {"old": (7, 0), "new": (8, 0)}}, until=1_005.0)
    assert limits_of(await web.status(1_005.0)) == {"new": (2.0, 0.0)}


async def sample_until(web: StatusWeb, done: asyncio.Event) -> None:
    """Run web's sampler until `done` is set, then stop it."""
    sampler = asyncio.create_task(web.sample_forever())
    await done.wait()
    sampler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sampler


async def test_the_sampler_says_once_that_it_cannot_read_and_once_that_it_can(
    plane: Plane, caplog: pytest.LogCaptureFixture
) -> None:
    store = plane.catalog.store
    assert isinstance(store, CountingStore)
    outcomes = iter([False, True, True, False, True, True, False])
    done = asyncio.Event()

    async def sleep(seconds: float) -> None:
        try:
            store.failing = next(outcomes)
        except StopIteration:
            done.set()
            await asyncio.Event().wait()

    web = web_of(plane, sleep=sleep)
    caplog.set_level(logging.DEBUG, logger="controlplane.web")
    await sample_until(web, done)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "INFO", "WARNING", "INFO"]
    assert "cannot read the proxies' reports: state store unavailable" in lines[0][1]
    assert not any(r.exc_info for r in caplog.records)


async def test_a_sampler_bug_is_logged_once_with_its_traceback_not_every_round(
    plane: Plane, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = iter([RuntimeError("bug"), RuntimeError("bug"), None, RuntimeError("bug")])
    done = asyncio.Event()

    async def sample(now: float) -> None:
        try:
            failure = next(rounds)
        except StopIteration:
            done.set()
            await asyncio.Event().wait()
            return
        if failure is not None:
            raise failure

    async def sleep(seconds: float) -> None:
        pass

    web = web_of(plane, sleep=sleep)
    monkeypatch.setattr(web, "sample", sample)
    caplog.set_level(logging.DEBUG, logger="controlplane.web")
    await sample_until(web, done)
    lines = [(r.levelname, bool(r.exc_info)) for r in caplog.records]
    assert lines == [("ERROR", True), ("INFO", False), ("ERROR", True)]


async def test_with_the_page_on_the_replica_samples_whether_or_not_anyone_views_it() -> None:
    settings = parse(["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--id", "r1"])
    plane = ControlPlane(settings, MemoryStore())
    await plane.start()
    try:
        assert "status-page-rates" in {task.get_name() for task in plane._tasks}
    finally:
        await plane.stop(grace=0)
    plane = ControlPlane(parse(["--listen", "127.0.0.1:0", "--id", "r1"]), MemoryStore())
    await plane.start()
    try:
        assert "status-page-rates" not in {task.get_name() for task in plane._tasks}
    finally:
        await plane.stop(grace=0)


@pytest.mark.parametrize(
    ("path", "result"),
    [
        ("/api/regions/nowhere/drain", "NOT_FOUND"),
        ("/api/origins/Bad%20Name/undrain", "INVALID_ARGUMENT"),
    ],
)
async def test_a_drain_the_catalog_refuses_is_audited_with_its_result(
    plane: Plane,
    client: TestClient,  # type: ignore[type-arg]
    path: str,
    result: str,
) -> None:
    resp = await client.post(path, headers=AUTH)
    assert resp.status in (400, 404)
    [call] = plane.audit.calls
    assert call["result"] == result and call["actor"] == "admin-token"


async def test_concurrent_viewers_share_one_build_that_reads_no_state(plane: Plane) -> None:
    web = web_of(plane)
    store = plane.catalog.store
    assert isinstance(store, CountingStore)
    store.lists.clear()
    store.gate = asyncio.Event()
    viewers = [asyncio.create_task(web.status_body()) for _ in range(8)]
    await asyncio.sleep(0)  # every viewer has asked; the build waits at the gate
    store.gate.set()
    bodies = await asyncio.gather(*viewers)
    assert len(set(bodies)) == 1
    assert store.lists["/ponto/proxies/"] == 1
    assert not [prefix for prefix in store.lists if prefix.startswith(STATE_PREFIX)]


@pytest.fixture
async def port(plane: Plane) -> AsyncIterator[int]:
    """The port served as ponto-control serves it (StatusWeb.runner), on loopback."""
    runner = web_of(plane).runner()
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield runner.addresses[0][1]
    await runner.cleanup()


# One request of each kind of answer the status port gives: the page, a
# static file, the API, a 404, and a refused action (no header, no token: 403).
ANSWER_KINDS = (
    ("GET", "/"),
    ("GET", "/static/status.js"),
    ("GET", "/api/status"),
    ("GET", "/nowhere"),
    ("POST", "/api/regions/eu-west/drain"),
)


async def test_every_answer_names_the_product_not_python_and_aiohttp(port: int) -> None:
    """Trial: the status port said `Server: Python/3.11 aiohttp/3.x` where the
    proxy says `ponto` (no versions to look up flaws of)."""
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for method, path in (*ANSWER_KINDS, ("DELETE", "/api/status")):  # and a 405
            async with session.request(method, base + path) as resp:
                await resp.read()
                assert resp.headers.getall("Server") == [SERVER_NAME], (method, path)
    # As the edge's own refusals do.
    _, headers, _ = await exchange(port, b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n")
    assert headers["server"] == SERVER_NAME


async def exchange(port: int, data: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Send raw bytes, read until the server closes: (status line, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status.encode(), headers, body


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (b"X-Long: " + b"a" * 20_000 + b"\r\n", b"431", "request_header_fields_too_large"),
        (
            b"".join(b"X-H%d: v\r\n" % i for i in range(200)),
            b"431",
            "request_header_fields_too_large",
        ),
        (b"Content-Length: 1\r\nContent-Length: 2\r\n", b"400", "invalid_http_request"),
    ],
    ids=["long-header-line", "too-many-headers", "bad-framing"],
)
async def test_parser_refusals_are_json_with_a_request_id_logged_once_at_info(
    port: int, caplog: pytest.LogCaptureFixture, head: bytes, status: bytes, code: str
) -> None:
    caplog.set_level(logging.INFO)
    request = b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head + b"\r\n"
    line, headers, body = await exchange(port, request)
    assert line.split()[1] == status
    assert headers["content-type"].startswith("application/json")
    assert_error(orjson.loads(body), code)
    request_id = headers["x-request-id"]
    assert len(request_id) == 32
    refusals_logged = [r for r in caplog.records if r.name == "ponto.refusals"]
    assert len(refusals_logged) == 1 and refusals_logged[0].levelno == logging.INFO
    assert request_id in refusals_logged[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_every_answer_has_a_request_id_and_a_405_says_what_is_allowed(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    base = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for method, path in ANSWER_KINDS:
            async with session.request(method, base + path) as resp:
                assert len(resp.headers.get("x-request-id", "")) == 32, (method, path)
        # A plain id the client brings is kept, as the proxy keeps it.
        async with session.get(base + "/api/status", headers={"x-request-id": "abc-1"}) as resp:
            assert resp.headers["x-request-id"] == "abc-1"
        async with session.delete(base + "/api/status") as resp:
            assert resp.status == 405
            assert resp.headers["Allow"] == "GET,HEAD"
            assert_error(await resp.json(), "method_not_allowed")
            request_id = resp.headers["x-request-id"]
    (line,) = [r.getMessage() for r in caplog.records if "method_not_allowed" in r.getMessage()]
    assert request_id in line


async def test_a_region_added_to_the_table_leaves_the_served_rates_known(plane: Plane) -> None:
    # What each region served is measured by name: a new region in the table
    # changes no proxy's sample, so no rate becomes unknown (a dash).
    web = web_of(plane)

    async def at(t: float, n: int) -> dict[str, Any]:
        plane.clock.now = t
        traffic: dict[str, Traffic] = {"p-eu": (n, 0, 0, t, {"eu-west": (n, 0)}, {}, {})}
        await plane.catalog.put_traffic("r1", traffic, plane.lease)
        return {r["name"]: r for r in (await web.status(t))["regions"]}

    await at(1_000.0, 100)
    assert (await at(1_005.0, 150))["eu-west"]["served_per_s"] == 10.0
    await plane.catalog.put_region(Region("ap-south", 1.0, 1.0), allow_update=False)
    table = compile_table(await plane.catalog.snapshot())
    table.version, table.etag = 8, "e8"
    plane.publisher.publish(table)
    regions = await at(1_006.0, 160)
    assert regions["eu-west"]["served_per_s"] == 60 / 6
    assert regions["ap-south"]["served_per_s"] == 0.0


def test_a_proxy_whose_registration_went_is_departed_for_a_while() -> None:
    """Trial 49: a proxy whose replica stopped vanished from the page, which
    then said its region had no proxy, though it served on. The page lists
    it as departed from when it was first missed, until it registers again
    or DEPARTED_KEEP_S has passed."""

    def record(name: str) -> ProxyRecord:
        return ProxyRecord(name, "eu-west", f"{name}:8080", "1.0", f"s-{name}", "r1", 900.0)

    a, b = record("p-a"), record("p-b")
    departures = Departures(keep_s=60.0)
    departures.see([a, b], 0.0)
    assert departures.gone() == []
    departures.see([a], 10.0)
    departures.see([a], 20.0)
    assert departures.gone() == [(b, 10.0)]  # missed first at 10
    departures.see([a, b], 30.0)  # registered again (a reload's successor keeps it)
    assert departures.gone() == []
    departures.see([a], 40.0)
    departures.see([a], 99.0)
    assert departures.gone() == [(b, 40.0)]
    departures.see([], 100.0)  # b's 60 s are over; a goes now
    assert departures.gone() == [(a, 100.0)]


def test_only_a_departed_proxy_whose_replica_is_gone_too_is_listed() -> None:
    """Review (helper-191): every pod a rollout replaced was listed for 15
    minutes as "may still serve". A proxy whose replica lives ended its own
    stream; one whose replica went may still serve."""
    cut_off = ProxyRecord("p-a", "eu-west", "p-a:8080", "1.0", "s-a", "cp-1", 900.0)
    stopped = ProxyRecord("p-b", "eu-west", "p-b:8080", "1.0", "s-b", "cp-2", 900.0)
    rows = departed_rows([(cut_off, 100.0), (stopped, 100.0)], {"cp-2"}, 160.0)
    assert rows == [
        {"name": "p-a", "region": "eu-west", "address": "p-a:8080", "replica": "cp-1",
         "left_s": 60.0}
    ]  # fmt: skip


async def test_an_origin_the_proxies_eject_shows_so_beside_its_probes(plane: Plane) -> None:
    """Trial 49: an origin that answered /health but failed every request
    showed healthy. The proxies' reports of their ejections show on its row:
    by whom, since when, its last failure."""
    web = web_of(plane)
    now = 2_000.0
    eu_failing = {"o-eu": (now - 40, 3, "answered 500", now - 2, now + 4)}
    ended = {"o-eu": (now - 100, 5, "timed out before the response started", now - 10, now - 10)}
    traffic: dict[str, Traffic] = {
        "p-eu": (0, 0, 0, now, {}, {}, eu_failing),
        "p-us": (0, 0, 0, now, {}, {}, ended),
    }
    await plane.catalog.put_traffic("r1", traffic, plane.lease)
    regions = {r["name"]: r for r in (await web.status(now))["regions"]}
    (eu,) = regions["eu-west"]["origins"]
    assert eu["healthy"] is True
    assert eu["ejected"] == (
        "ejected by p-eu, p-us (2 proxies, 1 ejecting now) for 100 s; "
        "last failure 2 s ago: answered 500"
    )
    (us,) = regions["us-east"]["origins"]
    assert us["ejected"] == ""
    # Reports whose last failure is older than STALE_S are not shown (a
    # replica that stopped writing its proxies' reports).
    regions = {r["name"]: r for r in (await web.status(now + STALE_S - 5))["regions"]}
    assert regions["eu-west"]["origins"][0]["ejected"] == (
        "ejected by p-eu (ejection over, not answered since) for 2 min; "
        "last failure 87 s ago: answered 500"
    )


async def test_an_address_that_keeps_sending_wrong_tokens_is_held_off(plane: Plane) -> None:
    """Trial 48: nothing kept a script from trying admin tokens one after
    another. Past TOKEN_MISSES wrong ones in TOKEN_MISS_WINDOW_S its wrong
    tokens are refused (429 with Retry-After) for the rest of the window,
    unchecked; the right token always passes (review 205: behind one
    port-forward a guesser locked every operator out)."""
    web = web_of(plane, monotonic=plane.clock)
    async with TestClient(TestServer(web.app())) as c:
        wrong = {**WRITE, "Authorization": "Bearer guess"}
        for _ in range(TOKEN_MISSES):
            assert (await c.post("/api/regions/us-east/drain", headers=wrong)).status == 401
        plane.clock.now += 10
        resp = await c.post("/api/regions/us-east/drain", headers=wrong)
        assert resp.status == 429
        assert resp.headers["Retry-After"] == str(int(TOKEN_MISS_WINDOW_S - 10))
        assert_error(await resp.json(), "too_many_wrong_tokens")
        assert (await c.post("/api/regions/us-east/drain", headers=AUTH)).status == 200
        plane.clock.now += TOKEN_MISS_WINDOW_S - 10
        assert (await c.post("/api/regions/us-east/drain", headers=wrong)).status == 401


def test_wrong_tokens_are_counted_per_address_and_forgotten() -> None:
    misses = TokenMisses()
    for i in range(TOKEN_MISSES):
        misses.missed("10.0.0.1", float(i))
    assert misses.wait("10.0.0.1", 9.0) == TOKEN_MISS_WINDOW_S - 9.0
    assert misses.wait("10.0.0.2", 9.0) == 0.0
    assert misses.wait("10.0.0.1", TOKEN_MISS_WINDOW_S) == 0.0  # the first fell out
    for i in range(TOKEN_MISS_ADDRESSES + 5):
        misses.missed(f"10.1.{i // 256}.{i % 256}", 100.0)
    assert len(misses._times) == TOKEN_MISS_ADDRESSES


def test_wrong_tokens_from_one_ipv6_64_are_one_clients() -> None:
    # An IPv6 host may send from any address of its /64: counted per address,
    # it had a throttle for each it made up (review 323). Another /64 is
    # another client; an IPv4 client on a dual-stack socket is its IPv4 address.
    misses = TokenMisses()
    for i in range(TOKEN_MISSES):
        misses.missed(f"2001:db8:7::{i + 1:x}", float(i))
    assert misses.wait("2001:db8:7::ffff", 9.0) == TOKEN_MISS_WINDOW_S - 9.0
    assert misses.wait("2001:db8:7:1::1", 9.0) == 0.0
    for i in range(TOKEN_MISSES):
        misses.missed("::ffff:10.0.0.9", float(i))
    assert misses.wait("10.0.0.9", 9.0) == TOKEN_MISS_WINDOW_S - 9.0


async def test_a_store_outage_is_logged_once_per_interval_however_often_the_page_polls(
    plane: Plane, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial: each poll of the page during a store outage logged a WARNING,
    one per poll per viewer. One line per UNAVAILABLE_LOG_EVERY_S, the next
    saying how many were not logged; one when the store answers again."""

    async def away() -> None:
        raise Unavailable("state store unavailable: etcd is away")

    monkeypatch.setattr(plane.catalog, "list_proxies", away)
    ticks = Clock(0.0)
    caplog.set_level(logging.INFO, "controlplane.web")
    async with TestClient(TestServer(web_of(plane, monotonic=ticks).app())) as client:
        for _ in range(5):
            assert (await client.get("/api/status")).status == 200
            ticks.now += 1.0
            plane.clock.now += 1.0  # past the status's cache
        ticks.now = UNAVAILABLE_LOG_EVERY_S + 0.5
        assert (await client.get("/api/status")).status == 200
        monkeypatch.undo()
        plane.clock.now += 1.0
        assert (await client.get("/api/status")).status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "controlplane.web"]
    said = (
        "status page: state store unavailable: etcd is away; showing the latest table's "
        "regions, origins and suspensions, proxies and replicas unknown"
    )
    assert lines == [
        said,
        f"{said} (4 more not logged)",
        "status page: the state store answers again",
    ]


async def test_with_the_store_away_the_status_shows_the_latest_table(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trial 73: during an etcd outage /api/status answered 503 and the page
    showed nothing, though the replica held its latest table. It shows the
    table's regions, origins, health and suspensions, says the store is
    unavailable since when, and has null (not known, not none) for what
    etcd alone holds: proxies, replicas, the leader, rates."""
    suspended = {"tenants": [{"name": "acme", "reason": "unpaid", "since": 5.0}]}
    fresh: list[pb.OriginLoads | None] = [EU_SCRAPE]
    web = web_of(
        plane, suspensions=lambda: None, loads=lambda: fresh[0], last_loads=lambda: EU_SCRAPE
    )
    monkeypatch.setattr("controlplane.web.status_rows", lambda _s, _now: suspended)
    before = await web.status(1_000.0)
    assert before["state_store"] == {"available": True, "error": "", "since": None}

    async def away() -> None:
        raise Unavailable("state store unavailable: etcd is away")

    monkeypatch.setattr(plane.catalog, "list_replicas", away)
    fresh[0] = None  # no leader writes loads without the store: they grow old
    status = await web.status(1_010.0)
    assert status["state_store"] == {
        "available": False,
        "error": "state store unavailable: etcd is away",
        "since": 1_010.0,
    }
    assert (await web.status(1_020.0))["state_store"]["since"] == 1_010.0
    assert status["latest_version"] == 7 and status["suspended"] == suspended
    assert status["proxies"] is status["replicas"] is status["leader"] is None
    assert status["tenants"] is None
    regions = {r["name"]: r for r in status["regions"]}
    assert regions.keys() == {"eu-west", "us-east"}
    for region in regions.values():
        assert region["proxies"] is None
        assert region["requests_per_s"] is region["served_per_s"] is None
    # The table's regions and origins as before the outage, and the load
    # last read (the banner says so).
    known = {r["name"]: r for r in before["regions"]}
    assert regions["eu-west"]["origins"] == known["eu-west"]["origins"]
    assert regions["eu-west"]["load"] == pytest.approx(0.4)
    (us_origin,) = regions["us-east"]["origins"]
    assert not us_origin["healthy"] and us_origin["detail"] == "connection refused"
    monkeypatch.undo()
    after = await web.status(1_030.0)
    assert after["state_store"]["available"] and len(after["proxies"]) == 2


async def test_the_store_is_said_away_since_its_reads_failed_not_since_a_view(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 291: `since` was the first page build that failed, so a page
    opened a while into an outage said it began then, and one opened in a
    second outage (none between) said the first one's time. The sampler,
    which reads etcd whether or not anyone views the page, says when."""
    plane.clock.now = 1_000.0
    away = [(1_010.0, 1_030.0), (1_050.0, 1_100.0)]
    read_proxies = plane.catalog.list_proxies

    async def proxies() -> list[ProxyRecord]:
        if any(start <= plane.clock.now < end for start, end in away):
            raise Unavailable("state store unavailable: etcd is away")
        return await read_proxies()

    reached = asyncio.Event()

    async def sleep(seconds: float) -> None:
        if plane.clock.now + seconds > 1_070.0:
            reached.set()
            await asyncio.Event().wait()  # until cancelled
        plane.clock.now += seconds

    monkeypatch.setattr(plane.catalog, "list_proxies", proxies)
    web = web_of(plane, sleep=sleep)
    sampler = asyncio.create_task(web.sample_forever())
    await reached.wait()
    sampler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sampler
    status = await web.status(plane.clock.now)
    assert status["state_store"]["available"] is False
    assert status["state_store"]["since"] == 1_050.0  # the second outage's first read


@pytest.mark.parametrize(("traffic_every", "quiet"), [(30.0, True), (40.0, False)])
async def test_a_proxy_is_quiet_after_three_report_writes_of_its_replica(
    plane: Plane, traffic_every: float, quiet: bool
) -> None:
    """--traffic-interval-ms: the replicas write reports that often, and a
    proxy not heard for three of them (here 100 s) is shown quiet."""
    server = TestServer(web_of(plane, traffic_every=traffic_every).app())
    async with TestClient(server) as c:
        status = await (await c.get("/api/status")).json()
    assert {p["name"]: p["quiet"] for p in status["proxies"]} == {"p-eu": quiet, "p-us": quiet}
    assert status["rates_window_s"] == 3 * traffic_every  # the page says so


def test_the_traffic_interval_is_a_setting() -> None:
    assert parse(["--traffic-interval-ms", "2000"]).traffic_interval == 2.0
    assert parse([]).traffic_interval == 5.0
    with pytest.raises(SystemExit):
        parse(["--traffic-interval-ms", "999"])


# ---------------------------------------------------------------- suspensions


NOTHING_SUSPENDED = {"tenants": [], "more_tenants": 0, "keys": [], "more_keys": 0}


async def suspend(catalog: Catalog, clock: Clock, tenant: str, at: float, reason: str = "") -> str:
    """A new key of `tenant`, suspended at `at` (`clock`: the catalog's) with `reason`."""
    clock.now = at
    key = (await catalog.create_key(tenant)).record.id
    await catalog.set_key_suspended(key, True, reason)
    return key


async def test_suspended_tenants_and_keys_show_with_reason_since_and_expiry(
    plane: Plane,
) -> None:
    """What an operator needs in an incident without pontoctl: whose callers
    are refused, since when and why; read from what the builder keeps, no
    read of the state per build."""
    clock = Clock(500.0)
    catalog = Catalog(plane.catalog.store, clock=clock)
    await catalog.put_tenant(
        Tenant("acme", suspended=True, suspended_reason="invoice unpaid"), allow_update=False
    )
    await catalog.put_tenant(Tenant("beta"), allow_update=False)
    leaked = await suspend(catalog, clock, "beta", 500.0, "leaked in a CI log <b>")
    # No reason given; its tenant is suspended too.
    quiet = await suspend(catalog, clock, "acme", 600.0)
    clock.now = 650.0
    expiring = (await catalog.create_key("beta", expires_in=100)).record.id
    await catalog.set_key_suspended(expiring, True, "abuse")
    await catalog.create_key("beta")  # served: not listed
    revoked = await suspend(catalog, clock, "beta", 700.0, "gone anyway")
    await catalog.revoke_key(revoked)  # refused for good: no suspension to undo
    builder = TableBuilder(catalog, plane.publisher)
    await builder.build_once()
    web = web_of(plane, suspensions=lambda: builder.suspensions)
    store = plane.catalog.store
    assert isinstance(store, CountingStore)
    store.lists.clear()
    status = await web.status(1_000.0)
    assert not [prefix for prefix in store.lists if prefix.startswith(STATE_PREFIX)]
    assert status["suspended"] == {
        "tenants": [{"name": "acme", "reason": "invoice unpaid", "since": 500.0}],
        "more_tenants": 0,
        "keys": [  # the most recent first
            {
                "id": expiring,
                "tenant": "beta",
                "tenant_suspended": False,
                "since": 650.0,
                "reason": "abuse",
                "expired": True,  # at 750: both must be undone
            },
            {
                "id": quiet,
                "tenant": "acme",
                "tenant_suspended": True,
                "since": 600.0,
                "reason": "",
                "expired": False,
            },
            {
                "id": leaked,
                "tenant": "beta",
                "tenant_suspended": False,
                "since": 500.0,
                "reason": "leaked in a CI log <b>",  # as given: the page shows it as text
                "expired": False,
            },
        ],
        "more_keys": 0,
    }
    # Before its expiry the key is suspended only.
    assert [k["expired"] for k in (await web.status(700.0))["suspended"]["keys"]] == [
        False,
        False,
        False,
    ]


async def test_a_reason_changed_alone_shows_though_no_table_is_published(plane: Plane) -> None:
    """The table has no reasons: a new one publishes nothing, and the page
    still shows it (and the resumed key goes)."""
    clock = Clock(500.0)
    catalog = Catalog(plane.catalog.store, clock=clock)
    await catalog.put_tenant(Tenant("beta"), allow_update=False)
    key = await suspend(catalog, clock, "beta", 500.0, "leaked")
    builder = TableBuilder(catalog, plane.publisher)
    await builder.build_once()
    web = web_of(plane, suspensions=lambda: builder.suspensions)
    await catalog.set_key_suspended(key, True, "leaked in a CI log")
    assert not await builder.build_once()  # the same table: nothing published
    [row] = (await web.status(1_000.0))["suspended"]["keys"]
    assert (row["reason"], row["since"]) == ("leaked in a CI log", 500.0)
    await catalog.set_key_suspended(key, False)
    await builder.build_once()
    assert (await web.status(1_000.0))["suspended"] == NOTHING_SUSPENDED


async def test_the_suspended_lists_are_capped_and_say_how_many_more(plane: Plane) -> None:
    clock = Clock(500.0)
    catalog = Catalog(plane.catalog.store, clock=clock)
    for i in range(LISTED + 2):
        await catalog.put_tenant(Tenant(f"t{i:03d}", suspended=True), allow_update=False)
    await catalog.put_tenant(Tenant("beta"), allow_update=False)
    keys = [await suspend(catalog, clock, "beta", 100.0 + i) for i in range(LISTED + 3)]
    builder = TableBuilder(catalog, plane.publisher)
    await builder.build_once()
    suspended = (await web_of(plane, suspensions=lambda: builder.suspensions).status(1_000.0))[
        "suspended"
    ]
    assert [t["name"] for t in suspended["tenants"]] == [f"t{i:03d}" for i in range(LISTED)]
    assert suspended["more_tenants"] == 2
    # The 50 most recently suspended, the latest first; the 3 oldest counted.
    assert [k["id"] for k in suspended["keys"]] == keys[::-1][:LISTED]
    assert suspended["more_keys"] == 3


async def test_the_replicas_page_shows_what_its_builder_read_as_suspended() -> None:
    """The wiring of ponto-control: the page reads the table builder's."""
    settings = parse(["--listen", "127.0.0.1:0", "--id", "r1"])
    store = MemoryStore()
    await Catalog(store).put_tenant(Tenant("acme", suspended=True), allow_update=False)
    plane = ControlPlane(settings, store)
    assert (await plane.web.status(1_000.0))["suspended"] == NOTHING_SUSPENDED  # no table yet
    await plane.builder.build_once()
    [acme] = (await plane.web.status(1_000.0))["suspended"]["tenants"]
    assert (acme["name"], acme["reason"]) == ("acme", "")
    assert acme["since"] is not None  # the catalog's clock when it was suspended


async def test_a_lost_fleet_id_is_the_first_fleet_warning(plane: Plane) -> None:
    """A replica that made a new fleet id after serving another (its etcd came
    back empty), and proxies refusing its tables: said first, with the fleet
    id of its tables (docs/operations.md, "etcd came back empty")."""
    watch = FleetWatch()
    watch.published("aaaaaaaaaaaaaaaa")
    watch.made("bbbbbbbbbbbbbbbb", "aaaaaaaaaaaaaaaa")
    watch.published("bbbbbbbbbbbbbbbb")
    watch.answered("p-eu", "aaaaaaaaaaaaaaaa", refused=True)
    assert plane.publisher.latest is not None
    table = pb.RouteTable()
    table.CopyFrom(plane.publisher.latest.table)
    table.version, table.etag, table.fleet_id = 8, "e8", "bbbbbbbbbbbbbbbb"
    plane.publisher.publish(table)
    web = web_of(plane, fleet_problem=watch.problem)
    async with TestClient(TestServer(web.app())) as c:
        status = await (await c.get("/api/status")).json()
    first = status["fleet_warnings"][0]
    assert first.startswith("this replica made fleet id bbbbbbbbbbbbbbbb for a store without one")
    assert "1 proxies refuse its route tables" in first and "pontoctl fleet adopt" in first
    assert status["fleet_id"] == "bbbbbbbbbbbbbbbb"
