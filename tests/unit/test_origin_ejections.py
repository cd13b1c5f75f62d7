"""Origins the proxies ejected, across the fleet (controlplane.ejections):
gathered per origin from the proxies' reports, told by the Admin API's
ListOrigins and `pontoctl get origins`, and bounded as a report arrives.

Trial 49: an origin that answered its /health probes but failed every request
showed healthy everywhere while every proxy ejected it."""

from __future__ import annotations

import asyncio
import math
import time

import grpc

from controlplane.api.routing import MAX_EJECTED, MAX_FAILURE, MAX_FIELD, _ejected
from controlplane.catalog import Catalog, Traffic
from controlplane.cli import _parser, run
from controlplane.ejections import FleetEjection, describe, fleet_ejections
from controlplane.model import OriginEjected, ProxyRecord
from controlplane.store.memory import MemoryStore
from ponto.grpcconn import CallDefaults
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_admin_warnings import seed
from tests.unit.test_audit import Clock, admin_server


def proxy(name: str, *ejected: OriginEjected) -> ProxyRecord:
    return ProxyRecord(name, "us", f"{name}:8080", "1.0", f"s-{name}", "r1", 0.0, ejected=ejected)


def test_the_fleets_view_joins_each_origins_reports() -> None:
    now = 1_000.0
    fleet = fleet_ejections(
        [
            proxy("p-b", OriginEjected("o-us", 900.0, 2, "answered 502", 995.0, 1_001.0)),
            proxy(
                "p-a",
                OriginEjected("o-us", 950.0, 1, "answered 500", 999.0, 990.0),
                OriginEjected("o-eu", 980.0, 1, "", 985.0, 985.0),
            ),
            proxy("p-c"),
        ],
        now,
    )
    assert fleet == {
        "o-eu": FleetEjection("o-eu", ("p-a",), 0, 980.0, "", 985.0),
        # The latest failure, the earliest streak, ejected now at p-b only.
        "o-us": FleetEjection("o-us", ("p-a", "p-b"), 1, 900.0, "answered 500", 999.0),
    }
    assert describe(fleet["o-us"], now) == (
        "ejected by p-a, p-b (2 proxies, 1 ejecting now) for 100 s; "
        "last failure 1 s ago: answered 500"
    )
    assert (
        describe(fleet["o-eu"], now)
        == "ejected by p-a (ejection over, not answered since) for 20 s"
    )
    one_now = FleetEjection("o", ("p",), 1, now - 3 * 3600, "x", now - 150)
    assert describe(one_now, now) == "ejected by p (ejected now) for 3 h; last failure 2 min ago: x"


def test_a_report_is_bounded_as_it_arrives() -> None:
    """What a proxy reports is stored: bounded in number and length, and its
    numbers finite (orjson writes NaN as null, which would not read back)."""
    req = pb.RouteRequest(is_report=True)
    req.ejected.add(
        origin="o-us",
        for_s=math.nan,
        ejections=4,
        last_failure="x" * 5000,
        ejected_s=math.inf,
        failed_s=-3.0,
    )
    req.ejected.add(origin="", for_s=1.0)
    req.ejected.add(origin="o" * (MAX_FIELD + 1), for_s=1.0)
    for i in range(MAX_EJECTED + 5):
        req.ejected.add(origin=f"o-{i}", for_s=1e12, ejected_s=1e9)
    first, *rest = _ejected(req)
    assert (first.origin, first.ejections, len(first.last_failure)) == ("o-us", 4, MAX_FAILURE)
    assert (first.for_s, first.ejected_s, first.failed_s) == (0.0, 0.0, 0.0)
    assert len(rest) == MAX_EJECTED - 3  # the first MAX_EJECTED, less the two refused
    assert rest[0].for_s == 366 * 86400.0 and rest[0].ejected_s == 3600.0


async def test_list_origins_and_pontoctl_say_which_proxies_eject_an_origin() -> None:
    store = MemoryStore()
    async with admin_server(store, Clock(), admin_token="") as stub:
        await seed(stub)  # o-us and o-eu, healthy until probed
        catalog = Catalog(store)
        lease = await store.grant_lease(30)
        for name in ("p-1", "p-2"):
            record = ProxyRecord(name, "us", f"{name}:8080", "1.0", f"s-{name}", "r1", 0.0)
            await catalog.register_proxy(record, lease)
        now = time.time()
        failing = {"o-us": (now - 30, 2, "answered 500", now - 1, now + 5)}
        gone = {"o-gone": (now - 30, 1, "answered 500", now - 1, now + 5)}
        traffic: dict[str, Traffic] = {
            "p-1": (10, 0, 0, now, {}, {}, failing),
            "p-2": (10, 0, 0, now, {}, {}, gone),  # an origin deleted since
        }
        await catalog.put_traffic("r1", traffic, lease)
        listed = await stub.ListOrigins(apb.ListRequest())
        (e,) = listed.ejections
        assert (e.origin, list(e.proxies), e.ejected_now, e.last_failure) == (
            "o-us",
            ["p-1"],
            1,
            "answered 500",
        )
        assert 29 < e.for_s < 40 and 0 < e.failed_s < 10

        def table() -> str:
            with grpc.insecure_channel(stub.address) as channel:
                calls = CallDefaults(admin_pb2_grpc.AdminStub(channel), timeout=5)
                return run(_parser().parse_args(["get", "origins"]), calls)

        shown = {line.split()[0]: line for line in (await asyncio.to_thread(table)).splitlines()}
        assert "yes, but ejected by p-1 (ejected now) for 3" in shown["o-us"]
        assert "ago: answered 500" in shown["o-us"]
        assert "ejected" not in shown["o-eu"]
