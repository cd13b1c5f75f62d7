"""The control plane's metrics move with a real fleet: etcd, an origin and a proxy
as processes, two replicas over that etcd.

The replicas run in this process and their metrics are read with
`ControlPlane.metrics.render()`, the body `ponto-control --http-listen` serves
at /metrics: everything else they do (etcd, gRPC to the proxy, probes, the
election) is real. Waits are bounded generously; nothing here is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.app import ControlPlane, over_etcd
from controlplane.settings import parse
from ponto.fleet import Fleet
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.version import software_version

pytestmark = pytest.mark.e2e

WAIT = 20.0  # a shared 2-core machine


def read(plane: ControlPlane, name: str, **labels: str) -> float:
    """One series of the replica's exposition; NaN (equal to nothing) when it is absent."""
    body, _ = plane.metrics.render()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return math.nan


async def until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not check():
        if loop.time() > deadline:
            pytest.fail(f"not within {WAIT}s: {what}")
        await asyncio.sleep(0.05)


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path) as f:
        f.start_etcd()
        f.start_origin("o1", "us-east")
        yield f


@contextlib.asynccontextmanager
async def replicas(fleet: Fleet, *names: str) -> AsyncIterator[list[ControlPlane]]:
    assert fleet.etcd is not None
    planes: list[ControlPlane] = []
    try:
        for name in names:
            settings = parse(
                ["--etcd", fleet.etcd.url, "--listen", "127.0.0.1:0", "--id", name,
                 "--probe-interval-ms", "200", "--probe-timeout-ms", "500"]
            )  # fmt: skip
            plane = await over_etcd(settings)
            await plane.start()
            planes.append(plane)
        yield planes
    finally:
        for plane in planes:
            await plane.stop(grace=0)


async def test_the_control_plane_metrics_follow_the_fleet(fleet: Fleet) -> None:
    async with (
        replicas(fleet, "cp-1", "cp-2") as (cp1, cp2),
        grpc.aio.insecure_channel(f"127.0.0.1:{cp1.port}") as channel,
    ):
        admin = admin_pb2_grpc.AdminStub(channel)
        for name, lat, lon in (("us-east", 38.9, -77.4), ("eu-west", 53.3, -6.3)):
            region = apb.RegionSpec(name=name, latitude=lat, longitude=lon)
            await admin.PutRegion(apb.PutRegionRequest(region=region), timeout=10)
        for name, home, url in (
            ("o1", "us-east", fleet.origin_url("o1")),
            ("dead", "eu-west", f"http://127.0.0.1:{closed_port()}/v1"),
        ):
            origin = apb.OriginSpec(name=name, base_url=url, region=home, models=["sim-small"])
            await admin.PutOrigin(apb.PutOriginRequest(origin=origin), timeout=10)

        # Only cp-1 has the proxy: its "latest" is the proxy, cp-2 has none.
        address = f"127.0.0.1:{cp1.port}"
        await asyncio.to_thread(fleet.start_proxy, "p1", "us-east", control_planes=[address])
        await until(
            lambda: read(cp1, "ponto_control_proxies", state="latest") == 1,
            "the proxy at the latest version on cp-1",
        )
        assert read(cp1, "ponto_control_proxies", state="behind") == 0
        assert read(cp2, "ponto_control_proxies", state="latest") == 0
        assert read(cp1, "ponto_control_pushes_total", result="sent") >= 1
        acked = read(cp1, "ponto_control_pushes_total", result="acked")
        assert acked >= 1
        assert read(cp1, "ponto_control_push_latency_seconds_count") >= 1
        assert read(cp1, "ponto_control_table_version") > 0

        # One leader of two.
        await until(
            lambda: read(cp1, "ponto_control_leader") + read(cp2, "ponto_control_leader") == 1,
            "one leader",
        )
        leader = cp1 if read(cp1, "ponto_control_leader") == 1 else cp2
        assert {read(cp1, "ponto_control_leader"), read(cp2, "ponto_control_leader")} == {0, 1}

        # The leader probes: the dead origin fails, goes unhealthy in every
        # replica's table; the live one passes.
        await until(
            lambda: (
                all(
                    read(p, "ponto_control_origin_healthy", origin="dead", region="eu-west") == 0
                    and read(p, "ponto_control_origin_drained", origin="dead", region="eu-west")
                    == 0
                    for p in (cp1, cp2)
                )
                and read(cp1, "ponto_control_origin_healthy", origin="o1", region="us-east") == 1
            ),
            "the dead origin unhealthy",
        )
        fails = read(
            leader, "ponto_control_probes_total", origin="dead", region="eu-west", result="fail"
        )
        assert fails >= 2  # fall=2
        assert (
            read(leader, "ponto_control_probes_total", origin="o1", region="us-east", result="ok")
            >= 1
        )

        # A drain: both replicas show it, the proxy ACKs the new table.
        acked = read(cp1, "ponto_control_pushes_total", result="acked")
        await admin.DrainRegion(apb.DrainRequest(name="eu-west", drained=True), timeout=10)
        await until(
            lambda: all(
                read(p, "ponto_control_region_drained", region="eu-west") == 1 for p in (cp1, cp2)
            ),
            "eu-west drained on both replicas",
        )
        assert read(cp1, "ponto_control_region_drained", region="us-east") == 0
        await until(
            lambda: (
                read(cp1, "ponto_control_pushes_total", result="acked") > acked
                and read(cp1, "ponto_control_proxies", state="latest") == 1
            ),
            "the drained table ACKed",
        )

        # Admin calls by method and code, failures included.
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await admin.DrainRegion(apb.DrainRequest(name="mars", drained=True), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        calls = "ponto_control_admin_calls_total"
        assert read(cp1, calls, method="PutRegion", code="OK") == 2
        assert read(cp1, calls, method="PutOrigin", code="OK") == 2
        assert read(cp1, calls, method="DrainRegion", code="OK") == 1
        # grpc's abort sends the status before it raises, so the client may
        # have it before the interceptor counts the call (CI saw NaN here).
        await until(
            lambda: read(cp1, calls, method="DrainRegion", code="NOT_FOUND") == 1,
            "the refused drain counted",
        )
        assert math.isnan(read(cp2, calls, method="DrainRegion", code="OK"))  # not cp-2's call

        # etcd calls are timed on every replica.
        for plane in (cp1, cp2):
            for op in ("get", "list", "put", "grant_lease"):
                count = read(plane, "ponto_control_etcd_request_duration_seconds_count", op=op)
                assert count > 0, (plane.settings.replica_id, op)
        assert read(cp2, "ponto_control_info", replica="cp-2", version=software_version()) == 1
