"""Traffic counters from a proxy to every replica: the proxy's report message,
the registry keeping them per proxy and writing them to etcd beside (not in)
its ACK summary."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from prometheus_client import generate_latest

from controlplane import catalog as catalog_module
from controlplane.catalog import ACKS, TRAFFIC, Catalog
from controlplane.catalog import Traffic as StoredTraffic
from controlplane.model import OriginEjected
from controlplane.registry import ProxyRegistry
from controlplane.store.memory import MemoryStore
from dataplane.http.boundary import CLIENT_GONE, SEND_TIMEOUT, excused_here, refused_here
from dataplane.http.pipeline import Exchange
from dataplane.metrics import MAX_LIMITED_TENANTS, Metrics
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient, Traffic, traffic_of
from dataplane.upstream.outlier import OutlierDetector
from ponto.v1 import routing_pb2 as pb


def test_traffic_of_the_proxy_request_counter_splits_5xx_and_4xx() -> None:
    m = Metrics()
    for endpoint, code, n in (
        ("chat", "200", 7),
        ("chat", "502", 2),
        ("completions", "503", 1),
        ("chat", "429", 3),
        ("other", "404", 1),
    ):
        m.requests.labels(endpoint, code).inc(n)
    assert traffic_of(m.requests) == Traffic(requests=14, server_errors=3, client_errors=4)
    assert traffic_of(Metrics().requests) == Traffic(0, 0, 0)


def test_probes_and_scrapes_are_not_traffic() -> None:
    m = Metrics()
    m.requests.labels("chat", "200").inc(2)
    for endpoint, code in (
        ("healthz", "200"),
        ("health", "200"),
        ("readyz", "503"),  # unready or draining
        ("metrics", "200"),
    ):
        m.requests.labels(endpoint, code).inc(50)
    assert traffic_of(m.requests) == Traffic(requests=2, server_errors=0, client_errors=0)


def test_served_counts_are_by_the_region_that_answered() -> None:
    m = Metrics()
    for region, error_type, n, refused in (
        ("ap-southeast", "", 3, False),
        ("eu-west", "", 2, False),
        ("eu-west", "502", 1, False),
        ("us-east", "", 1, False),  # a cache answer, in the proxy's region
        ("us-east", "429", 2, False),  # an origin's own 429
        # Refused at the proxy, in its own region, no origin called: its
        # clients' doing, not its origins' failures.
        ("us-east", "429", 4, True),
        ("us-east", "invalid_request", 3, True),
    ):
        for _ in range(n):
            m.operation("chat", "m", error_type, region, "", 0.1, None, None, refused=refused)
    m.requests.labels("chat", "200").inc(16)
    m.requests.labels("models", "200").inc(5)  # answered, and in no region's operations
    assert m.refused == {"us-east": 7}
    traffic = traffic_of(m.requests, m.genai_duration, refused=m.refused)
    assert traffic.served == {"ap-southeast": (3, 0), "eu-west": (3, 1), "us-east": (3, 2)}
    # Every request that arrived (review: the refusals' loop overwrote the
    # total with a region's count, which the status page took for a reset).
    assert traffic.requests == 21
    report = client(traffic=lambda: traffic).report("s-1")
    assert [(s.region, s.requests_total, s.errors_total) for s in report.served] == [
        ("ap-southeast", 3, 0),
        ("eu-west", 3, 1),
        ("us-east", 3, 2),
    ]


def test_only_the_tenants_limited_last_are_kept_for_the_report() -> None:
    # Every report carries them all, into one etcd value per replica: the
    # one limited longest ago is forgotten, and starts from 0 if limited again.
    m = Metrics()
    for i in range(MAX_LIMITED_TENANTS):
        m.limit_refusal(f"t{i}", "requests")
    m.slot_wait("t0", "admitted")  # t0 is now the last limited; t1 the first
    m.limit_refusal("new", "requests")
    assert len(m.limited) == MAX_LIMITED_TENANTS
    assert "t1" not in m.limited and m.limited["t0"] == [1, 1]
    m.limit_refusal("t1", "requests")
    assert m.limited["t1"] == [1, 0] and "t2" not in m.limited


def test_limit_refusals_and_slot_waits_are_reported_by_tenant() -> None:
    m = Metrics()
    m.limit_refusal("acme", "requests")
    m.limit_refusal("acme", "concurrency")
    m.slot_wait("acme", "refused")
    m.slot_wait("beta", "admitted")
    text = generate_latest(m.registry).decode()
    assert 'ponto_ratelimit_refusals_total{limit="concurrency"} 1.0' in text
    assert 'ponto_ratelimit_slot_waits_total{outcome="admitted"} 1.0' in text
    assert "acme" not in text  # per tenant only in the report: no tenant series
    traffic = traffic_of(m.requests, m.genai_duration, m.limited)
    assert traffic.limited == {"acme": (2, 1), "beta": (0, 1)}
    m.limit_refusal("beta", "tokens")
    assert traffic.limited["beta"] == (0, 1)  # a copy, as of the report
    report = client(traffic=lambda: traffic).report("s-1")
    assert [(t.tenant, t.refused_total, t.slot_waits_total) for t in report.limited] == [
        ("acme", 2, 1),
        ("beta", 0, 1),
    ]


def client(**kwargs: object) -> ControlPlaneClient:
    holder = TableHolder("eu-west", None)
    info = pb.ProxyInfo(name="p", region="eu-west", address="127.0.0.1:1")
    return ControlPlaneClient(holder, ["127.0.0.1:1"], info, **kwargs)  # type: ignore[arg-type]


def test_a_report_carries_the_cumulative_counters_and_the_demand() -> None:
    demand = [pb.ScopeDemand(scope="t/a", requests_per_s=3.0)]
    link = client(demand=lambda: demand, traffic=lambda: Traffic(10, 2, 1))
    report = link.report("s-1")
    assert report.is_report and report.session_id == "s-1"
    assert (report.requests_total, report.server_errors_total, report.client_errors_total) == (
        10,
        2,
        1,
    )
    assert list(report.demand) == demand
    assert client(demand=lambda: demand).report("s-1").requests_total == 0


class CountingStore(MemoryStore):
    """A MemoryStore that counts writes by key."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: Counter[str] = Counter()

    async def put(self, key: str, value: bytes, **kwargs: Any) -> int:
        self.puts[key] += 1
        return await super().put(key, value, **kwargs)


async def test_the_registry_writes_reports_under_their_own_key_when_they_change() -> None:
    store = CountingStore()
    catalog = Catalog(store)
    clock = [500.0]
    registry = ProxyRegistry(catalog, "r1", traffic_every=5.0, clock=lambda: clock[0])
    record = await registry.register("p-eu", "eu-west", "127.0.0.1:8080", "1.0")
    assert registry.streaming(record.session_id)  # its route stream is open
    await registry.acked(record.session_id, 3, "")
    registry.reported(record.session_id, 40, 2, 5)
    registry.reported("no-such-session", 1, 1, 1)
    assert registry.traffic() == {"p-eu": (40, 2, 5, 500.0, {}, {}, {})}
    await registry.flush(100.0)
    assert (store.puts[ACKS + "r1"], store.puts[TRAFFIC + "r1"]) == (1, 1)
    (proxy,) = await catalog.list_proxies()
    assert (proxy.requests, proxy.server_errors, proxy.client_errors) == (40, 2, 5)
    assert proxy.heard_at == 500.0 and proxy.acked_version == 3
    assert "traffic" not in orjson.loads((await store.get(ACKS + "r1")).value)  # type: ignore[union-attr]
    # Reports every second: traffic at most every 5 s, and the ACK summary never.
    for second in range(1, 12):
        clock[0] = 500.0 + second
        registry.reported(record.session_id, 40 + second, 2, 5)
        await registry.flush(100.0 + second)
    assert (store.puts[ACKS + "r1"], store.puts[TRAFFIC + "r1"]) == (1, 3)
    # Counters that did not change are not written again: only the change
    # heard at 111 s, written once 5 s have passed since the one at 110 s.
    for second in range(12, 30):
        clock[0] = 500.0 + second
        registry.reported(record.session_id, 51, 2, 5)
        await registry.flush(100.0 + second)
    assert store.puts[TRAFFIC + "r1"] == 4
    (proxy,) = await catalog.list_proxies()
    assert (proxy.requests, proxy.heard_at) == (51, 515.0)  # the latest report then
    # An ACK is written on the next flush.
    await registry.acked(record.session_id, 4, "")
    await registry.flush(130.0)
    assert store.puts[ACKS + "r1"] == 2
    # What regions served is written along, and a change in it alone too.
    clock[0] = 540.0
    registry.reported(record.session_id, 51, 2, 5, {"eu-west": (3, 1)})
    await registry.flush(140.0)
    (proxy,) = await catalog.list_proxies()
    assert proxy.served == (("eu-west", 3, 1),) and proxy.heard_at == 540.0
    # So are the tenants limits held back, and a change in them alone too.
    clock[0] = 550.0
    registry.reported(record.session_id, 51, 2, 5, {"eu-west": (3, 1)}, {"acme": (4, 2)})
    await registry.flush(150.0)
    (proxy,) = await catalog.list_proxies()
    assert proxy.limited == (("acme", 4, 2),) and proxy.heard_at == 550.0
    # Registered again (a restart): the old session's counters are gone.
    again = await registry.register("p-eu", "eu-west", "127.0.0.1:8080", "1.0")
    assert registry.traffic() == {}
    registry.reported(again.session_id, 1, 0, 0)
    record = again
    # A proxy that left takes its counters with it.
    await registry.unregister(record.session_id)
    assert registry.traffic() == {}


async def test_counters_are_read_from_the_proxys_own_replica_only() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    lease = await store.grant_lease(10)
    registry = ProxyRegistry(catalog, "r2")
    await registry.register("p-eu", "eu-west", "127.0.0.1:8080", "1.0")
    # r1's reports still list the proxy's previous session, before it moved to r2.
    await catalog.put_traffic("r1", {"p-eu": (999, 9, 9, 1.0, {}, {}, {})}, lease)
    await catalog.put_traffic("r2", {"p-eu": (5, 0, 1, 2.0, {}, {}, {})}, lease)
    (proxy,) = await catalog.list_proxies()
    assert (proxy.requests, proxy.client_errors, proxy.heard_at) == (5, 1, 2.0)
    # A replica from before served wrote four values: nothing served is known.
    await store.put(TRAFFIC + "r2", orjson.dumps({"p-eu": [6, 0, 1, 3.0]}), lease=lease)
    (proxy,) = await catalog.list_proxies()
    assert (proxy.requests, proxy.served) == (6, ())
    # One from before limited wrote five: no tenant held back is known.
    served = {"eu-west": [6, 0]}
    await store.put(TRAFFIC + "r2", orjson.dumps({"p-eu": [6, 0, 1, 3.0, served]}), lease=lease)
    (proxy,) = await catalog.list_proxies()
    assert (proxy.served, proxy.limited) == ((("eu-west", 6, 0),), ())
    # And one from before ejected wrote six: no origin ejected is known.
    six = [6, 0, 1, 3.0, served, {"acme": [1, 2]}]
    await store.put(TRAFFIC + "r2", orjson.dumps({"p-eu": six}), lease=lease)
    (proxy,) = await catalog.list_proxies()
    assert (proxy.limited, proxy.ejected) == ((("acme", 1, 2),), ())
    # No reports from its replica yet: the zeros.
    await store.delete(TRAFFIC + "r2")
    (proxy,) = await catalog.list_proxies()
    assert (proxy.requests, proxy.heard_at) == (0, 0.0)


# ---------------------------------------------------------------- ejected origins


def test_a_report_names_the_origins_passive_health_ejected() -> None:
    """Trial 49: an origin failing every request passed its /health probes
    and showed healthy; the proxies that eject it now say so."""
    now = [1000.0]
    outliers = OutlierDetector(consecutive=2, base=1.0, clock=lambda: now[0])
    link = client(ejected=outliers.ejected_report)
    assert list(link.report("s-1").ejected) == []
    outliers.failure("o-us", "answered 500")
    now[0] += 0.5
    outliers.failure("o-us", "answered 502")
    now[0] += 0.25
    (e,) = link.report("s-1").ejected
    assert (e.origin, e.ejections, e.last_failure) == ("o-us", 1, "answered 502")
    assert (e.for_s, e.failed_s, e.ejected_s) == (0.25, 0.25, 0.75)


async def test_the_registry_keeps_ejections_in_its_clock_and_writes_their_changes() -> None:
    store = CountingStore()
    catalog = Catalog(store)
    clock = [500.0]
    registry = ProxyRegistry(catalog, "r1", traffic_every=5.0, clock=lambda: clock[0])
    record = await registry.register("p-eu", "eu-west", "127.0.0.1:8080", "1.0")
    assert registry.streaming(record.session_id)
    ejected = pb.OriginEjected(
        origin="o-us",
        for_s=40.0,
        ejections=3,
        last_failure="answered 500",
        ejected_s=4.0,
        failed_s=2.0,
    )
    registry.reported(record.session_id, 40, 2, 5, ejected=[ejected])
    await registry.flush(100.0)
    (proxy,) = await catalog.list_proxies()
    assert proxy.ejected == (OriginEjected("o-us", 460.0, 3, "answered 500", 498.0, 504.0),)
    # The same ejection a second later: its times moved, nothing else did, so
    # nothing is written (the counters did not change either).
    clock[0] = 501.0
    later = pb.OriginEjected()
    later.CopyFrom(ejected)
    later.for_s, later.failed_s, later.ejected_s = 41.0, 3.0, 3.0
    registry.reported(record.session_id, 40, 2, 5, ejected=[later])
    await registry.flush(106.0)
    assert store.puts[TRAFFIC + "r1"] == 1
    # Another ejection is written, and an ended one is kept as ending at its failure.
    clock[0] = 510.0
    later.ejections, later.ejected_s, later.failed_s = 4, 0.0, 1.0
    registry.reported(record.session_id, 40, 2, 5, ejected=[later])
    await registry.flush(112.0)
    (proxy,) = await catalog.list_proxies()
    assert store.puts[TRAFFIC + "r1"] == 2
    assert (proxy.ejected[0].ejections, proxy.ejected[0].until) == (4, 509.0)
    # The origin answered: no longer named, and that is written.
    clock[0] = 520.0
    registry.reported(record.session_id, 40, 2, 5)
    await registry.flush(118.0)
    (proxy,) = await catalog.list_proxies()
    assert proxy.ejected == ()


async def test_a_traffic_value_past_its_bound_leaves_out_failures_then_ejections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 199: in a wide outage every proxy names many ejected origins;
    a replica's value past etcd's request size would have been refused, and
    every proxy's counts frozen with it."""
    store = MemoryStore()
    catalog = Catalog(store)
    lease = await store.grant_lease(10)
    registry = ProxyRegistry(catalog, "r1")
    await registry.register("p-eu", "eu-west", "127.0.0.1:8080", "1.0")
    ejected = {f"o{i}": (1.0, 3, "x" * 200, 2.0, 3.0) for i in range(20)}
    traffic: dict[str, StoredTraffic] = {"p-eu": (7, 0, 0, 5.0, {}, {}, ejected)}
    whole = len(orjson.dumps(traffic))
    for bound, failure, origins in ((whole, "x" * 200, 20), (whole - 1, "", 20), (100, "", 0)):
        monkeypatch.setattr(catalog_module, "TRAFFIC_BYTES", bound)
        await catalog.put_traffic("r1", traffic, lease)
        (proxy,) = await catalog.list_proxies()
        assert proxy.requests == 7 and len(proxy.ejected) == origins
        assert all(e.last_failure == failure for e in proxy.ejected)


async def test_an_ejection_that_cannot_be_read_is_left_out_not_its_proxys_counts() -> None:
    store = MemoryStore()
    catalog = Catalog(store)
    lease = await store.grant_lease(10)
    await ProxyRegistry(catalog, "r1").register("p-eu", "eu-west", "127.0.0.1:8080", "1.0")
    entry = [9, 0, 0, 5.0, {}, {}, {"o-bad": [1, 2], "o-ok": [1.0, 3, "x", 2.0, 3.0, "later"]}]
    await store.put(TRAFFIC + "r1", orjson.dumps({"p-eu": entry}), lease=lease)
    (proxy,) = await catalog.list_proxies()
    assert proxy.requests == 9
    assert [e.origin for e in proxy.ejected] == ["o-ok"]  # a later field is ignored


BEGUN, NOT_BEGUN = True, False  # whether the answer's head went out (Exchange.answer)


@pytest.mark.parametrize(
    ("attempts", "begun", "status", "error", "excused"),
    [
        (1, BEGUN, 400, "400", True),  # an origin refused the request as bad
        (1, BEGUN, 499, CLIENT_GONE, True),  # its client left mid-answer
        (2, BEGUN, 499, SEND_TIMEOUT, True),  # its client stopped reading
        # Its client left waiting for an origin that never answered (review:
        # a region whose origins hang read 0 errors a second).
        (1, NOT_BEGUN, 499, CLIENT_GONE, False),
        # Every origin tried lacks the model (review: a wrong own name).
        (2, NOT_BEGUN, 404, "model_not_found", False),
        (1, NOT_BEGUN, 429, "429", False),  # an overloaded origin fails its region
        (1, NOT_BEGUN, 408, "408", False),
        (1, NOT_BEGUN, 502, "502", False),
        (1, BEGUN, 200, "stream_cut", False),  # an origin broke its stream off
        (1, BEGUN, 200, "", False),  # served
        (0, NOT_BEGUN, 400, "invalid_request", False),  # refused at the proxy (refused_here)
        # Its client left the cache's answer (no origin called): served, not
        # the proxy's refusal.
        (0, BEGUN, 499, CLIENT_GONE, True),
        (0, BEGUN, 499, SEND_TIMEOUT, True),
        # The proxy, stopping, cut it off (its grace ran out): a rolling
        # restart is not its region failing. Its 503 goes only to a request
        # whose answer had not begun, waiting on an origin or on anything
        # else (a cache flight's leader, a concurrency slot: review).
        (1, NOT_BEGUN, 503, "proxy_stopping", True),
        (0, NOT_BEGUN, 503, "proxy_stopping", True),
        (1, BEGUN, 499, "cancelled", True),
        (0, BEGUN, 499, "cancelled", True),  # a cache answer the stop cut
        (0, NOT_BEGUN, 499, "cancelled", False),  # nothing served: no region's at all
    ],
)
def test_excused_failures_are_not_their_regions_doing(
    attempts: int, begun: bool, status: int, error: str, excused: bool
) -> None:
    answer = object() if begun else None
    ex = cast(Exchange, SimpleNamespace(attempts=attempts, answer=answer))
    assert excused_here(ex, status, error) is excused
    # Never both: Metrics.operation counts a refusal, else an excuse.
    assert not (excused and refused_here(ex, status, error))
    if error in (CLIENT_GONE, SEND_TIMEOUT, "cancelled") and begun:
        # The same cut before any answer began is the region's, or with no
        # origin called, no region's (the proxy's refusal).
        gone = cast(Exchange, SimpleNamespace(attempts=attempts, answer=None))
        assert excused_here(gone, status, error) is (error == "cancelled" and attempts > 0)
        assert refused_here(gone, status, error) is (attempts == 0)
