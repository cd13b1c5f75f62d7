"""Trial 73 with real processes: etcd killed, its data deleted, an empty etcd
started on the same address (a StatefulSet whose volume claims were lost).
The proxy keeps serving its table, and its keys, and refuses the empty
fleet's tables; the runbook (apply, keys made again, `pontoctl fleet adopt`)
brings it the new state, and at no point does it serve a caller without a
key (docs/operations.md, "etcd came back empty")."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.cli import main as pontoctl
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.e2e.load import BODY

pytestmark = pytest.mark.e2e

WAIT = 30.0  # generous: a shared 2-core machine


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path) as f:
        f.start_etcd()
        f.start_control()
        f.start_origin("o-us", "us-east")
        yield f


def configure(fleet: Fleet) -> None:
    """What an operator applies (`pontoctl apply -f export.yaml`): no keys."""
    fleet.add_region(RegionDef("us-east", 38.9, -77.4))
    fleet.add_origin("o-us", "us-east", fleet.origin_url("o-us"))


def make_key(fleet: Fleet) -> str:
    admin = fleet.admin()
    admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="acme")), timeout=10)
    return str(admin.CreateKey(apb.CreateKeyRequest(tenant="acme"), timeout=10).secret)


def chat(fleet: Fleet, key: str | None) -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    url = fleet.proxy_url("p-us") + "/chat/completions"
    return httpx.post(url, json=BODY, headers=headers, timeout=10).status_code


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {WAIT}s: {what}")
        time.sleep(0.1)


def refused(fleet: Fleet, reason: str) -> int:
    counts = fleet.proxy_status("p-us")["route_tables_refused"]
    assert isinstance(counts, dict)
    return int(counts.get(reason, 0))


def test_a_closed_fleet_whose_etcd_came_back_empty_serves_on_until_adopted(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    configure(fleet)
    old_key = make_key(fleet)
    version = fleet.wait_table(lambda t: len(t.keys) == 1 and len(t.origins) == 1)
    fleet.start_proxy("p-us", "us-east")
    fleet.wait_proxies_at(version)
    served = fleet.proxy_status("p-us")["fleet_id"]
    assert isinstance(served, str) and served
    assert (chat(fleet, old_key), chat(fleet, None)) == (200, 401)

    # kill -9, data deleted, an empty etcd on the same address.
    assert fleet.etcd is not None
    fleet.etcd.managed.kill()
    shutil.rmtree(fleet.etcd.data_dir)
    fleet.start_etcd()
    until(lambda: refused(fleet, "another_fleet") > 0, "the empty fleet's table refused")
    assert (chat(fleet, old_key), chat(fleet, None)) == (200, 401)
    metrics = httpx.get(fleet.metrics_url("p-us"), timeout=5).text
    assert f'ponto_fleet_info{{fleet_id="{served}"}} 1.0' in metrics

    # The runbook: the configuration, then adopt: the table is open, refused.
    configure(fleet)
    address = next(iter(fleet.controls.values())).address
    argv = ["--control-plane", address, "fleet", "adopt", served]
    assert pontoctl(argv) == 0
    assert f"the fleet id is {served} now" in capsys.readouterr().out
    until(lambda: refused(fleet, "would_open") > 0, "the open table refused")
    assert (chat(fleet, old_key), chat(fleet, None)) == (200, 401)

    # Keys made again: the table closes, and the proxy takes it.
    new_key = make_key(fleet)
    until(lambda: chat(fleet, new_key) == 200, "the new key works")
    assert (chat(fleet, old_key), chat(fleet, None)) == (401, 401)
    assert fleet.proxy_status("p-us")["fleet_id"] == served
