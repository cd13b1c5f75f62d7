"""Geo-proximity routing, health and failover with real processes.

Three regions on three continents, an origin in each, a proxy that believes
X-Forwarded-For only from loopback, and a generated GeoIP City database that
places the documentation ranges in Ashburn, Dublin and Singapore.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ponto.fleet import Fleet, RegionDef
from ponto.geodb import write_city_db
from ponto.v1 import admin_pb2 as apb
from tests.e2e.load import BODY, SteadyLoad
from tests.geodb import DOC_RANGES

pytestmark = pytest.mark.e2e

REGIONS = [
    RegionDef("us-east", 38.9, -77.4),
    RegionDef("eu-west", 53.3, -6.3),
    RegionDef("ap-southeast", 1.35, 103.8),
]
CLIENTS = {"us-east": "192.0.2.10", "eu-west": "198.51.100.10", "ap-southeast": "203.0.113.10"}


@contextlib.contextmanager
def started(workdir: Path) -> Iterator[Fleet]:
    db = write_city_db(workdir / "city.mmdb", DOC_RANGES)
    with Fleet(workdir) as f:
        f.start_etcd()
        f.start_control(extra=["--probe-interval-ms", "200", "--rise", "1", "--fall", "1"])
        for region in REGIONS:
            f.add_region(region)
            f.start_origin(f"o-{region.name}", region.name)
            f.add_origin(f"o-{region.name}", region.name, f.origin_url(f"o-{region.name}"))
        version = f.table_version(origins=3)
        geo = ["--geoip-db", str(db)]
        f.start_proxy("p-trusting", "eu-west", extra=[*geo, "--trusted-proxies", "127.0.0.0/8"])
        f.start_proxy("p-wary", "eu-west", extra=[*geo, "--trusted-proxies", "10.0.0.0/8"])
        f.wait_proxies_at(version)
        yield f


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A fleet of the test's own: the test kills a part of it, or drains a
    region it does not put back."""
    with started(tmp_path) as f:
        yield f


@pytest.fixture(scope="module")
def asked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fleet for the tests that leave it as they found it (about 3 s a start
    saved for each but the first): a test that drains a region or fails an
    origin puts it back, and waits until the proxies have it back, before it
    ends. They come last, so that it never runs beside a fleet of another
    test's."""
    with started(tmp_path_factory.mktemp("geo")) as f:
        yield f


def served_by(fleet: Fleet, proxy: str, client_ip: str) -> str:
    r = httpx.post(
        fleet.proxy_url(proxy) + "/chat/completions",
        json=BODY,
        headers={"x-forwarded-for": f"6.6.6.6, {client_ip}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-ponto-region"]


def test_killing_nearest_origin_loses_no_request_and_moves_traffic(fleet: Fleet) -> None:
    url = fleet.proxy_url("p-trusting") + "/chat/completions"
    with SteadyLoad(url, {"x-forwarded-for": CLIENTS["us-east"]}) as load:
        time.sleep(0.5)
        killed_at = time.monotonic()
        fleet.origins["o-us-east"].kill()
        time.sleep(2.0)
    codes = Counter(code for _, code, _ in load.results)
    assert codes == Counter({200: len(load.results)}), codes
    before = {region for t, _, region in load.results if t < killed_at}
    after = [region for t, _, region in load.results if t > killed_at + 0.5]
    assert before == {"us-east"}
    assert after and set(after) == {"eu-west"}  # the next nearest to Ashburn
    # The control plane's probes notice too, and push it out of the tables.
    deadline = time.monotonic() + 10
    while True:
        origins = {o.name: o for o in fleet.admin().ListOrigins(apb.ListRequest()).origins}
        if not origins["o-us-east"].healthy:
            break
        assert time.monotonic() < deadline, "control plane never marked the dead origin"
        time.sleep(0.1)
    assert origins["o-us-east"].health_detail


def test_drained_region_lets_in_flight_streams_finish(fleet: Fleet) -> None:
    sim = f"http://{fleet.origins['o-us-east'].address}/sim"
    httpx.post(sim + "/config", json={"tokens_per_s": 20})
    body = {**BODY, "stream": True, "max_tokens": 30}
    with httpx.stream(
        "POST",
        fleet.proxy_url("p-trusting") + "/chat/completions",
        json=body,
        headers={"x-forwarded-for": CLIENTS["us-east"]},
        timeout=20,
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        fleet.admin().DrainRegion(apb.DrainRequest(name="us-east", drained=True))
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert r.headers["x-ponto-region"] == "us-east"


# Last in the module: their fleet, started for them, is stopped with the module.
def test_draining_a_region_stops_new_requests_there(asked: Fleet) -> None:
    asked.admin().DrainRegion(apb.DrainRequest(name="us-east", drained=True))
    # Put back however the test ends: the module's later tests share the fleet,
    # and a region left drained would fail them for this test's failure.
    try:
        asked.wait_proxies_at(asked.wait_table(lambda t: any(r.drained for r in t.regions)))
        sim = f"http://{asked.origins['o-us-east'].address}/sim"
        httpx.post(sim + "/reset")
        regions = {served_by(asked, "p-trusting", CLIENTS["us-east"]) for _ in range(20)}
        assert regions == {"eu-west"}
        assert httpx.get(sim + "/stats").json()["requests"] == 0
    finally:
        asked.admin().DrainRegion(apb.DrainRequest(name="us-east", drained=False))
        asked.wait_proxies_at(asked.wait_table(lambda t: not any(r.drained for r in t.regions)))
    assert served_by(asked, "p-trusting", CLIENTS["us-east"]) == "us-east"


def test_unhealthy_origin_is_routed_around_after_probes(asked: Fleet) -> None:
    sim = f"http://{asked.origins['o-us-east'].address}/sim"
    httpx.post(sim + "/config", json={"mode": "fail"})
    try:  # healed however the test ends, as a drain is put back above
        version = asked.wait_table(
            lambda t: any(o.name == "o-us-east" and not o.healthy for o in t.origins)
        )
        asked.wait_proxies_at(version)
        httpx.post(sim + "/reset")
        assert served_by(asked, "p-trusting", CLIENTS["us-east"]) == "eu-west"
        r = httpx.post(
            asked.proxy_url("p-trusting") + "/chat/completions",
            json=BODY,
            headers={"x-forwarded-for": CLIENTS["us-east"]},
        )
        assert r.headers["x-ponto-attempts"] == "1"  # not even tried: out of the table
        assert httpx.get(sim + "/stats").json()["requests"] == 0
    finally:
        httpx.post(sim + "/config", json={"mode": "ok"})
        asked.wait_proxies_at(
            asked.wait_table(lambda t: all(o.healthy for o in t.origins)), timeout=20
        )
    assert served_by(asked, "p-trusting", CLIENTS["us-east"]) == "us-east"


def test_clients_land_on_their_nearest_region(asked: Fleet) -> None:
    for region, ip in CLIENTS.items():
        assert served_by(asked, "p-trusting", ip) == region


def test_spoofed_forwarded_for_from_untrusted_peer_changes_nothing(asked: Fleet) -> None:
    for ip in CLIENTS.values():
        assert served_by(asked, "p-wary", ip) == "eu-west"


def test_unlocatable_client_uses_proxy_region(asked: Fleet) -> None:
    assert served_by(asked, "p-trusting", "10.1.2.3") == "eu-west"
