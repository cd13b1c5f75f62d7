"""A located client whose home region is drained goes to the region nearest
*it*, through the whole pipeline: a real GeoIP file (mmdb-writer), the
client's address in X-Forwarded-For from a trusted peer, real origins.

Trial 49: a client in Sydney is homed in ap-southeast (Singapore); with that
region drained it went to eu-west, the region nearest Singapore (17,223 km
from Sydney), not us-east (15,681 km).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dataplane.http.state import HOLDER
from ponto.geodb import write_city_db
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import KEY, MODEL, chat, start_stack

REGIONS = {
    "us-east": (38.9, -77.4),
    "eu-west": (53.3, -6.3),
    "ap-southeast": (1.35, 103.8),
}
SYDNEY_CLIENT = "203.0.113.10"  # a documentation address, placed in Sydney below
SYDNEY = {"203.0.113.0/24": (-33.87, 151.21, "AU", "Sydney")}


async def test_a_drained_home_fails_over_to_the_clients_nearest_region(tmp_path: Path) -> None:
    db = write_city_db(tmp_path / "city.mmdb", SYDNEY)
    configs = [SimConfig(name=f"o-{name}", answer_tokens=3, seed=1) for name in REGIONS]
    s = await start_stack(
        tmp_path, configs, ["--geoip-db", str(db), "--trusted-proxies", "127.0.0.0/8"]
    )
    try:
        t = pb.RouteTable(version=3, tenants=[pb.Tenant(name="acme")], auth_required=True)
        for name, (lat, lon) in REGIONS.items():
            t.regions.add(name=name, latitude=lat, longitude=lon, drained=name == "ap-southeast")
        for origin in s.origins:
            name = origin.app[SIM_STATE].config.name
            t.origins.add(
                name=name, base_url=str(origin.make_url("/v1")), models=[MODEL], weight=100,
                region=name.removeprefix("o-"), healthy=True,
            )  # fmt: skip
        t.keys.add(id=KEY.key_id, hash=KEY.key_hash, tenant="acme")
        t.etag = content_etag(t)
        s.app[HOLDER].apply(t, "control-plane")
        resp = await s.post(
            chat("where is the nearest region"),
            headers={"x-forwarded-for": SYDNEY_CLIENT},
        )
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-ponto-region"] == "us-east"
        assert resp.headers["x-ponto-route"] == "failover"
        await resp.read()
    finally:
        await s.close()


async def test_an_ipv4_only_database_is_warned_of_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 78: with one (ip-location-db ships a file per family), every
    IPv6 client was served from the proxy's own region without a word."""
    v4 = write_city_db(tmp_path / "v4.mmdb", SYDNEY, ip_version=4)
    both = write_city_db(tmp_path / "both.mmdb", SYDNEY)
    dual_stack, forwarded, ipv4 = "--listen=[::]:8080", "--trusted-proxies=10.0.0.0/8", ""
    for db, where, warned in (
        (v4, dual_stack, True),
        (v4, forwarded, True),  # a balancer in front may forward IPv6 clients
        # Review 323: no IPv6 client can reach a proxy on an IPv4 address
        # that trusts no hop, so it is not warned that it cannot place one.
        (v4, ipv4, False),
        (both, dual_stack, False),
    ):
        caplog.clear()
        flags = [f"--geoip-db={db}", *([where] if where else [])]
        with caplog.at_level(logging.WARNING, "dataplane.http.server"):
            served = await serve_on_edge(tmp_path, "http://127.0.0.1:9/v1", *flags)
            await served.runner.cleanup()
        lines = [r.getMessage() for r in caplog.records if "IPv4 addresses only" in r.getMessage()]
        assert lines == (
            [
                f"--geoip-db {db} holds IPv4 addresses only: IPv6 clients are not located and "
                "are served from this proxy's region (r1) first; give a database that holds "
                "IPv6 addresses too (MaxMind's GeoLite2 City and DB-IP's City Lite do)"
            ]
            if warned
            else []
        )
