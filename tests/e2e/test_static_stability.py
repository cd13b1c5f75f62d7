"""Static stability with real processes: the proxies keep serving whatever fails.

Each test builds its own fleet because each one breaks it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from tests.e2e.load import BODY, SteadyLoad

pytestmark = pytest.mark.e2e


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o-us", "us-east")
        f.add_origin("o-us", "us-east", f.origin_url("o-us"))
        version = f.table_version(origins=1)
        f.start_proxy("p-us", "us-east")
        f.wait_proxies_at(version)
        yield f


def chat(fleet: Fleet, proxy: str = "p-us") -> httpx.Response:
    return httpx.post(fleet.proxy_url(proxy) + "/chat/completions", json=BODY, timeout=10)


def test_killing_the_control_plane_changes_nothing_for_clients(fleet: Fleet) -> None:
    with SteadyLoad(fleet.proxy_url("p-us") + "/chat/completions") as load:
        time.sleep(0.3)
        fleet.controls["control-1"].kill()
        time.sleep(1.0)
    assert len(load.codes) > 20
    assert set(load.codes) == {200}, [c for c in load.codes if c != 200][:5]
    status = fleet.proxy_status("p-us")
    assert status["control_plane_connected"] is False
    metrics = httpx.get(fleet.metrics_url("p-us")).text
    assert "ponto_control_plane_connected 0.0" in metrics


def test_restart_without_control_plane_serves_saved_table(fleet: Fleet) -> None:
    fleet.controls["control-1"].kill()
    fleet.proxies["p-us"].stop()
    fleet.start_proxy("p-us", "us-east")
    assert fleet.proxy_status("p-us")["route_table_source"] == "disk"
    r = chat(fleet)
    assert r.status_code == 200 and r.headers["x-ponto-origin"] == "o-us"


def test_control_plane_back_pushes_changes_made_meanwhile(fleet: Fleet) -> None:
    fleet.controls["control-1"].kill()
    fleet.start_control()  # same address, as a restarted pod behind a Service
    fleet.add_region(RegionDef("eu-west", 53.3, -6.3))
    fleet.start_origin("o-eu", "eu-west", models=("sim-eu",))
    fleet.add_origin("o-eu", "eu-west", fleet.origin_url("o-eu"), ("sim-eu",))
    fleet.wait_proxies_at(fleet.table_version(origins=2), timeout=20)
    r = httpx.post(
        fleet.proxy_url("p-us") + "/chat/completions", json={**BODY, "model": "sim-eu"}, timeout=10
    )
    assert r.status_code == 200 and r.headers["x-ponto-region"] == "eu-west"


def test_etcd_down_proxies_serve_admin_says_unavailable_then_converges(fleet: Fleet) -> None:
    assert fleet.etcd is not None
    fleet.etcd.stop()
    with SteadyLoad(fleet.proxy_url("p-us") + "/chat/completions") as load:
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as info:
            fleet.admin().ListRegions(apb.ListRequest(), timeout=15)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "state store unavailable" in (info.value.details() or "")
    assert set(load.codes) == {200}
    fleet.start_etcd()
    # Without restarting anything, a change reaches the proxy again.
    fleet.add_region(RegionDef("eu-west", 53.3, -6.3))
    fleet.start_origin("o-eu", "eu-west", models=("sim-eu",))
    fleet.add_origin("o-eu", "eu-west", fleet.origin_url("o-eu"), ("sim-eu",))
    fleet.wait_proxies_at(fleet.table_version(origins=2), timeout=20)


def test_vanished_proxy_disappears_from_the_registry(fleet: Fleet) -> None:
    names = [p.info.name for p in fleet.admin().ListProxies(apb.ListRequest()).proxies]
    assert names == ["p-us"]
    fleet.proxies["p-us"].kill()
    deadline = time.monotonic() + 20
    while fleet.admin().ListProxies(apb.ListRequest()).proxies:
        assert time.monotonic() < deadline, "killed proxy still registered"
        time.sleep(0.1)


def test_dead_replicas_registrations_expire_with_its_lease(tmp_path: Path) -> None:
    """A replica that dies takes its proxies' registrations with it (its lease
    expires); the proxies re-register wherever they reconnect."""
    with Fleet(tmp_path) as f:
        f.start_etcd()
        f.start_control("control-1", extra=["--lease-ttl", "2"])
        f.start_control("control-2", extra=["--lease-ttl", "2"])
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        only_1 = [f.controls["control-1"].address]
        f.start_proxy("p-stuck", "us-east", control_planes=only_1)
        both = [f.controls["control-1"].address, f.controls["control-2"].address]
        f.start_proxy("p-mobile", "us-east", control_planes=both)
        deadline = time.monotonic() + 20
        while len(f.admin().ListProxies(apb.ListRequest()).proxies) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        f.controls["control-1"].kill()
        deadline = time.monotonic() + 20
        while True:
            found = {p.info.name: p.control_plane_id
                     for p in f.admin().ListProxies(apb.ListRequest()).proxies}  # fmt: skip
            if found == {"p-mobile": "control-2"}:
                break
            assert time.monotonic() < deadline, found
            time.sleep(0.2)
