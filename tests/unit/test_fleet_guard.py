"""The proxy's guard against a control plane that lost its state (trial 73):
a table of another fleet, or one that would open a closed proxy, is refused
and the table served stays; the refusal is logged once per fleet id, counted,
and NACKed with the fleet the proxy serves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from dataplane.metrics import Metrics
from dataplane.routes import TableError
from dataplane.sync.holder import ANOTHER_FLEET, WOULD_OPEN, TableHolder, TableRefused
from dataplane.sync.link import ControlPlaneClient
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_link_loads import ScriptedRouting, loads

CP = "control-plane"
OURS = "0123456789abcdef"
NEW = "fedcba9876543210"


def table(
    version: int, *, fleet: str = OURS, closed: bool = True, models: int = 1
) -> pb.RouteTable:
    t = pb.RouteTable(
        version=version,
        regions=[pb.Region(name="us-east", latitude=39.0, longitude=-77.0)],
        origins=[
            pb.Origin(
                name="o-us",
                base_url="http://o-us.example/v1",
                region="us-east",
                models=[f"m{i}" for i in range(models)],
                weight=100,
                healthy=True,
            )
        ],
        fleet_id=fleet,
        auth_required=closed,
    )
    t.etag = content_etag(t)
    return t


def refused(holder: TableHolder, t: pb.RouteTable) -> TableRefused:
    with pytest.raises(TableRefused) as caught:
        holder.apply(t, CP)
    return caught.value


def test_a_table_of_another_fleet_is_refused_and_the_table_served_stays(
    tmp_path: Path,
) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5, models=3), CP)
    holder.received_at = 1000.0
    # What a replica whose etcd came back empty publishes: a new fleet id,
    # numbered above what proxies hold (RebasedStore), open and empty.
    error = refused(holder, table(900, fleet=NEW, closed=False, models=0))
    # The served table's age goes on (ponto_route_table_age_seconds).
    assert holder.received_at == 1000.0
    assert error.reason == ANOTHER_FLEET
    assert isinstance(error, TableError)  # the link NACKs it
    assert str(error).startswith(f"another fleet's table (fleet {NEW}; this proxy serves")
    assert f"pontoctl fleet adopt {OURS}" in str(error)
    assert holder.routes is not None and holder.routes.version == 5
    assert len(holder.routes.models) == 3
    assert holder.fleet_id == OURS and holder.closed
    assert holder.refused == {ANOTHER_FLEET: 1, WOULD_OPEN: 0}
    # Closed or not, the fleet decides first.
    assert refused(holder, table(901, fleet=NEW, closed=True)).reason == ANOTHER_FLEET


def test_adopted_the_fleet_id_comes_back_and_the_table_is_taken(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    refused(holder, table(900, fleet=NEW))
    assert holder.apply(table(901, models=2), CP) is True
    assert holder.routes is not None and holder.routes.version == 901


def test_a_proxy_with_no_table_takes_any_fleet(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    assert holder.apply(table(3, fleet=NEW, closed=False), CP) is True
    assert holder.fleet_id == NEW
    assert holder.apply(table(4, fleet=NEW, closed=True), CP) is True


def test_a_table_without_a_fleet_id_is_judged_as_before(tmp_path: Path) -> None:
    """An older control plane's (a rollout or a rollback): taken, and the
    fleet id is kept for the tables that carry one again."""
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    assert holder.apply(table(6, fleet="", models=2), CP) is True
    assert holder.fleet_id == OURS
    assert refused(holder, table(7, fleet=NEW)).reason == ANOTHER_FLEET
    # From nothing, an older plane's table leaves the fleet unknown: any is taken.
    other = TableHolder("us-east", None)
    other.apply(table(5, fleet=""), CP)
    assert other.apply(table(6, fleet=NEW), CP) is True


def test_an_older_planes_table_that_would_open_a_closed_proxy_is_refused(
    tmp_path: Path,
) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    error = refused(holder, table(6, fleet="", closed=False))
    assert error.reason == WOULD_OPEN
    assert str(error).startswith("table would open this proxy")
    assert holder.routes is not None and holder.routes.version == 5
    assert holder.policy is not None and not holder.policy.authenticator.open


def test_a_table_of_the_same_fleet_that_would_open_it_is_refused(tmp_path: Path) -> None:
    """`fleet adopt` then `apply -f export.yaml` (which has no keys): the
    fleet id is the proxies' again, but its table is open."""
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    assert refused(holder, table(6, closed=False)).reason == WOULD_OPEN
    assert holder.refused == {ANOTHER_FLEET: 0, WOULD_OPEN: 1}
    assert holder.apply(table(7, closed=True, models=2), CP) is True


def test_an_open_fleet_may_close_and_stays_served_open_until_then(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5, closed=False), CP)
    assert holder.apply(table(6, closed=False, models=2), CP) is True
    assert holder.apply(table(7, closed=True), CP) is True
    assert holder.closed


def test_the_saved_table_keeps_the_fleet_and_the_guard_across_a_restart(
    tmp_path: Path,
) -> None:
    TableHolder("us-east", tmp_path).apply(table(5), CP)
    again = TableHolder("us-east", tmp_path)
    assert again.load_saved()
    assert again.fleet_id == OURS and again.closed
    assert refused(again, table(900, fleet=NEW, closed=False)).reason == ANOTHER_FLEET
    # Started without its state directory, a proxy has no table: it takes
    # any (the way to open a proxy on purpose, docs/operations.md).
    bare = TableHolder("us-east", None)
    assert bare.apply(table(900, fleet=NEW, closed=False), CP) is True


def test_a_refusal_is_logged_at_error_once_per_fleet_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    caplog.set_level(logging.DEBUG, logger="dataplane.sync.holder")
    for version in (900, 901, 902):
        refused(holder, table(version, fleet=NEW, models=version - 899))
    refused(holder, table(903, fleet="aaaaaaaaaaaaaaaa"))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert NEW in errors[0] and "aaaaaaaaaaaaaaaa" in errors[1]
    assert holder.refused == {ANOTHER_FLEET: 4, WOULD_OPEN: 0}


def test_the_nack_names_the_fleet_served_and_the_metrics_count_it(tmp_path: Path) -> None:
    holder = TableHolder("us-east", tmp_path)
    client = ControlPlaneClient(holder, ["127.0.0.1:1"], pb.ProxyInfo(name="p", region="us-east"))
    ack = client._handle("s", pb.RouteUpdate(table=table(5), nonce="1"))
    assert (ack.error_detail, ack.fleet_id, ack.version_info) == ("", OURS, 5)
    nack = client._handle("s", pb.RouteUpdate(table=table(900, fleet=NEW), nonce="2"))
    assert nack.error_detail.startswith("another fleet's table")
    assert (nack.fleet_id, nack.version_info) == (OURS, 5)
    assert client.nacks == 1

    metrics = Metrics()
    metrics.bind_fleet(lambda: dict(holder.refused), lambda: holder.fleet_id)
    text = generate_latest(metrics.registry).decode()
    assert 'ponto_route_table_refused_total{reason="another_fleet"} 1.0' in text
    assert f'ponto_fleet_info{{fleet_id="{OURS}"}} 1.0' in text


def scrape(holder: TableHolder) -> str:
    metrics = Metrics()
    metrics.bind_fleet(
        lambda: dict(holder.refused), lambda: holder.fleet_id, lambda: holder.refusing
    )
    return generate_latest(metrics.registry).decode()


def test_the_refusal_series_exist_at_zero_before_the_first_refusal(tmp_path: Path) -> None:
    """An increase() of a series that first appears at 1 is 0: the first
    refusal would page no one."""
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    text = scrape(holder)
    for reason in (ANOTHER_FLEET, WOULD_OPEN):
        assert f'ponto_route_table_refused_total{{reason="{reason}"}} 0.0' in text
        assert f'ponto_route_table_refusing{{reason="{reason}"}} 0.0' in text


def test_refusing_is_1_while_the_latest_table_was_refused_and_0_once_one_is_taken(
    tmp_path: Path,
) -> None:
    holder = TableHolder("us-east", tmp_path)
    holder.apply(table(5), CP)
    refused(holder, table(900, fleet=NEW))
    text = scrape(holder)
    assert 'ponto_route_table_refusing{reason="another_fleet"} 1.0' in text
    assert 'ponto_route_table_refusing{reason="would_open"} 0.0' in text
    refused(holder, table(901, closed=False))
    text = scrape(holder)
    assert 'ponto_route_table_refusing{reason="another_fleet"} 0.0' in text
    assert 'ponto_route_table_refusing{reason="would_open"} 1.0' in text
    holder.apply(table(902, models=2), CP)  # adopted, and a key again
    text = scrape(holder)
    for reason in (ANOTHER_FLEET, WOULD_OPEN):
        assert f'ponto_route_table_refusing{{reason="{reason}"}} 0.0' in text
    assert 'ponto_route_table_refused_total{reason="another_fleet"} 1.0' in text


async def test_a_replica_of_another_fleet_gives_no_quota_shares_or_loads() -> None:
    """Its leader computed them from a state without this proxy's limits
    (an empty etcd): the last ones stand, as the table does."""
    script = [
        pb.RouteUpdate(table=table(900, fleet=NEW, closed=False), nonce="1"),
        pb.RouteUpdate(quota=pb.QuotaShares(generation=950)),
        loads(960, 9.0),
        pb.RouteUpdate(table=table(901, models=2), nonce="2"),  # adopted
        pb.RouteUpdate(quota=pb.QuotaShares(generation=970)),
        loads(980, 1.0),
    ]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((ScriptedRouting(script).handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    holder = TableHolder("us-east", None)
    holder.apply(table(5), CP)
    quotas: list[int] = []
    got: list[int] = []
    link = ControlPlaneClient(
        holder,
        [f"127.0.0.1:{port}"],
        pb.ProxyInfo(name="p1", region="us-east", address="127.0.0.1:9", version="test"),
        on_quota=lambda q: quotas.append(q.generation),
        on_loads=lambda pushed: got.append(pushed.generation),
    )
    task = asyncio.create_task(link.run())
    try:
        async with asyncio.timeout(5.0):
            while not got:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(0)
    assert holder.routes is not None and holder.routes.version == 901
    assert (quotas, got) == ([970], [980])
    assert link.nacks == 1
