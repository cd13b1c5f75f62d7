"""The control plane's metrics: each instrument against the in-memory store,
an injected clock, and the parts that feed it (no sleeping, no timings).

The same series with a real etcd, real proxies and two replicas are in
tests/e2e/test_control_metrics_e2e.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from controlplane.api.admin import AdminService
from controlplane.api.guard import TokenGuard
from controlplane.api.metered import AdminCalls
from controlplane.api.routing import RoutingService
from controlplane.app import ControlPlane
from controlplane.audit import AuditLog
from controlplane.catalog import Catalog
from controlplane.compile import compile_table
from controlplane.distribute import Publisher
from controlplane.health import Prober, ProbeSettings
from controlplane.metrics import ControlMetrics
from controlplane.model import Limits, Origin, OriginHealth, Region, State, Tenant
from controlplane.registry import ProxyRegistry
from controlplane.settings import parse
from controlplane.store import Conflict, Fence, StoreUnavailable
from controlplane.store.instrumented import InstrumentedStore
from controlplane.store.memory import MemoryStore
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb

# The shared contract of issue 14 (the chart's dashboards and alerts use these).
CONTRACT = {
    "ponto_control_table_version": ("gauge", set()),
    "ponto_control_pushes": ("counter", {"result"}),
    "ponto_control_push_latency_seconds": ("histogram", set()),
    "ponto_control_proxies": ("gauge", {"state"}),
    "ponto_control_etcd_request_duration_seconds": ("histogram", {"op"}),
    "ponto_control_etcd_errors": ("counter", {"op"}),
    "ponto_control_leader": ("gauge", set()),
    "ponto_control_leader_terms": ("counter", set()),
    "ponto_control_probes": ("counter", {"origin", "region", "result"}),
    "ponto_control_origin_healthy": ("gauge", {"origin", "region"}),
    "ponto_control_origin_drained": ("gauge", {"origin", "region"}),
    "ponto_control_region_drained": ("gauge", {"region"}),
    "ponto_control_origin_load_age_seconds": ("gauge", {"origin", "region"}),
    "ponto_control_origin_requests_running": ("gauge", {"origin", "region"}),
    "ponto_control_origin_requests_waiting": ("gauge", {"origin", "region"}),
    "ponto_control_origin_kv_cache_usage_ratio": ("gauge", {"origin", "region"}),
    "ponto_control_origin_prefix_cache_hit_ratio": ("gauge", {"origin", "region"}),
    "ponto_control_budget_spent_tokens": ("gauge", {"scope", "period"}),
    "ponto_control_budget_tokens": ("gauge", {"scope", "period"}),
    "ponto_control_admin_calls": ("counter", {"method", "code"}),
    "ponto_control_routing_refusals": ("counter", {"method", "code"}),
    "ponto_control_info": ("gauge", {"replica", "version"}),
    "ponto_control_fleet_replaced": ("gauge", set()),
    "ponto_control_proxies_other_fleet": ("gauge", {"fleet_id"}),
    "ponto_control_proxies_withheld": ("gauge", set()),
    # prometheus_client's process and platform collectors
    "process_virtual_memory_bytes": ("gauge", set()),
    "process_resident_memory_bytes": ("gauge", set()),
    "process_start_time_seconds": ("gauge", set()),
    "process_cpu_seconds": ("counter", set()),
    "process_open_fds": ("gauge", set()),
    "process_max_fds": ("gauge", set()),
    "python_info": ("gauge", {"implementation", "major", "minor", "patchlevel", "version"}),
}

ADMIN_TOKEN = "admin-token-0123456789"


class Clock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(metrics: ControlMetrics) -> Samples:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain;")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: ControlMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, frozenset(labels.items())))


async def until(check: Callable[[], bool], what: str) -> None:
    """Let the event loop run until check() holds (bounded by turns, not time)."""
    for _ in range(10_000):
        if check():
            return
        await asyncio.sleep(0)
    pytest.fail(f"never happened: {what}")


# ---------------------------------------------------------------- exposition


def test_every_contract_metric_is_exported_with_its_type_and_labels() -> None:
    metrics = ControlMetrics(replica="cp-1")
    metrics.etcd_call("get", 0.001, failed=True)
    metrics.probed("o1", "eu", ok=True)
    metrics.admin_call("ListRegions", "OK")
    metrics.bind(
        table=lambda: compile_table(
            State(7, (Region("eu", 1.0, 2.0),), (Origin("o1", "http://o/v1", "eu", ("m",)),))
        ),
        acked_versions=lambda: [7],
        is_leader=lambda: True,
        loads=lambda: pb.OriginLoads(
            loads=[pb.OriginLoad(origin="o1", running=1, kv_cache_usage=0.5, prefix_hit_rate=0.2)]
        ),
        budgets=lambda: [("t/acme", "day", 10.0, 1000)],
    )
    body, _ = metrics.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert set(families) == set(CONTRACT)
    for name, (kind, labels) in CONTRACT.items():
        family = families[name]
        assert family.type == kind, name
        for s in family.samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
    assert "_created" not in body.decode()
    # names() is what the chart's checks compare dashboards against.
    assert metrics.names() == sorted(
        name + ("_total" if kind == "counter" else "") for name, (kind, _) in CONTRACT.items()
    )


def test_the_leader_exports_each_origins_scraped_load() -> None:
    """Trial 60: what placement reads was on the status page only. Figures
    an origin does not report (-1) and origins not in the table are left
    out; a replica that does not lead exports none."""
    metrics = ControlMetrics(replica="cp-1")
    leading = [True]
    origins = (
        Origin("o1", "http://o/v1", "eu", ("m",)),
        Origin("o2", "http://p/v1", "us", ("m",)),
    )
    metrics.bind(
        table=lambda: compile_table(
            State(7, (Region("eu", 1.0, 2.0), Region("us", 3.0, 4.0)), origins)
        ),
        acked_versions=list,
        is_leader=lambda: leading[0],
        loads=lambda: pb.OriginLoads(
            loads=[
                pb.OriginLoad(
                    origin="o1", running=3, waiting=2, kv_cache_usage=0.75, prefix_hit_rate=-1
                ),
                pb.OriginLoad(
                    origin="o2", running=0, waiting=0, kv_cache_usage=-1, prefix_hit_rate=0.25
                ),
                pb.OriginLoad(origin="gone", running=9),
            ]
        ),
    )
    eu, us = {"origin": "o1", "region": "eu"}, {"origin": "o2", "region": "us"}
    assert value(metrics, "ponto_control_origin_requests_running", **eu) == 3.0
    assert value(metrics, "ponto_control_origin_requests_waiting", **eu) == 2.0
    assert value(metrics, "ponto_control_origin_kv_cache_usage_ratio", **eu) == 0.75
    assert value(metrics, "ponto_control_origin_prefix_cache_hit_ratio", **eu) is None
    assert value(metrics, "ponto_control_origin_requests_running", **us) == 0.0
    assert value(metrics, "ponto_control_origin_kv_cache_usage_ratio", **us) is None
    assert value(metrics, "ponto_control_origin_prefix_cache_hit_ratio", **us) == 0.25
    running = [k for k in samples(metrics) if k[0] == "ponto_control_origin_requests_running"]
    assert len(running) == 2  # not the origin the table no longer has
    leading[0] = False
    assert value(metrics, "ponto_control_origin_requests_running", **eu) is None


def test_the_leader_exports_each_budgets_use() -> None:
    """Trial 56: nothing to alert on before a budget's requests were
    refused. A replica that does not lead exports none (its counts were a
    term's)."""
    metrics = ControlMetrics(replica="cp-1")
    leading = [True]
    metrics.bind(
        table=lambda: None,
        acked_versions=list,
        is_leader=lambda: leading[0],
        budgets=lambda: [
            ("t/acme", "day", 750.0, 1000),
            ("t/acme", "month", 4900.0, 5000),
            ("k/abc", "month", 0.0, 20),
            # A ledger with an older proxy's fractions: exported whole (trial:
            # 1411.0000000000002).
            ("k/old", "day", 1411.0000000000002, 2000),
        ],
    )
    assert value(metrics, "ponto_control_budget_spent_tokens", scope="k/old", period="day") == 1411
    day = {"scope": "t/acme", "period": "day"}
    month = {"scope": "t/acme", "period": "month"}
    assert value(metrics, "ponto_control_budget_spent_tokens", **day) == 750.0
    assert value(metrics, "ponto_control_budget_tokens", **day) == 1000.0
    assert value(metrics, "ponto_control_budget_spent_tokens", **month) == 4900.0
    key = {"scope": "k/abc", "period": "month"}
    assert value(metrics, "ponto_control_budget_tokens", **key) == 20.0
    assert value(metrics, "ponto_control_budget_spent_tokens", **key) == 0.0
    leading[0] = False
    assert not any(name.startswith("ponto_control_budget") for name, _ in samples(metrics))


def test_an_unbound_replica_reads_as_empty() -> None:
    metrics = ControlMetrics()
    got = samples(metrics)
    assert got[("ponto_control_table_version", frozenset())] == 0
    assert got[("ponto_control_leader", frozenset())] == 0
    assert got[("ponto_control_proxies", frozenset({("state", "latest")}))] == 0
    assert got[("ponto_control_proxies", frozenset({("state", "behind")}))] == 0
    for result in ("sent", "acked", "nacked"):
        assert got[("ponto_control_pushes_total", frozenset({("result", result)}))] == 0
    assert not any(name == "ponto_control_region_drained" for name, _ in got)
    info = [labels for name, labels in got if name == "ponto_control_info"]
    assert len(info) == 1 and dict(info[0])["replica"] == ""


def test_two_instances_do_not_share_series() -> None:
    a, b = ControlMetrics(), ControlMetrics()
    a.admin_call("ListRegions", "OK")
    assert value(a, "ponto_control_admin_calls_total", method="ListRegions", code="OK") == 1
    assert value(b, "ponto_control_admin_calls_total", method="ListRegions", code="OK") is None


# ---------------------------------------------------------------- scrape-time state


def test_table_state_proxies_and_leader_are_read_at_scrape_time() -> None:
    metrics = ControlMetrics()
    table: list[pb.RouteTable] = []
    acked: list[int] = []
    leader = [False]
    metrics.bind(
        table=lambda: table[-1] if table else None,
        acked_versions=lambda: acked,
        is_leader=lambda: leader[0],
        leader_terms=lambda: 3,
    )
    state = State(
        10,
        (Region("eu", 53.0, -6.0), Region("us", 39.0, -77.0, drained=True)),
        (
            Origin("o1", "http://o1/v1", "eu", ("m",)),
            Origin("o2", "http://o2/v1", "us", ("m",), drained=True),
        ),
        {"o1": OriginHealth("o1", healthy=False)},
    )
    table.append(compile_table(state))
    acked.extend([10, 10, 9, 0])
    leader[0] = True
    got = samples(metrics)
    assert got[("ponto_control_table_version", frozenset())] == 10
    assert got[("ponto_control_leader", frozenset())] == 1
    assert got[("ponto_control_leader_terms_total", frozenset())] == 3
    assert got[("ponto_control_proxies", frozenset({("state", "latest")}))] == 2
    assert got[("ponto_control_proxies", frozenset({("state", "behind")}))] == 2
    assert got[("ponto_control_region_drained", frozenset({("region", "us")}))] == 1
    assert got[("ponto_control_region_drained", frozenset({("region", "eu")}))] == 0
    eu_o1 = frozenset({("origin", "o1"), ("region", "eu")})
    us_o2 = frozenset({("origin", "o2"), ("region", "us")})
    assert got[("ponto_control_origin_healthy", eu_o1)] == 0
    assert got[("ponto_control_origin_healthy", us_o2)] == 1
    assert got[("ponto_control_origin_drained", eu_o1)] == 0
    assert got[("ponto_control_origin_drained", us_o2)] == 1

    # The next scrape sees the next table: nothing had to be updated.
    table.append(compile_table(State(11, state.regions[:1], state.origins[:1])))
    acked[:] = [11]
    got = samples(metrics)
    assert got[("ponto_control_proxies", frozenset({("state", "latest")}))] == 1
    assert got[("ponto_control_proxies", frozenset({("state", "behind")}))] == 0
    assert ("ponto_control_region_drained", frozenset({("region", "us")})) not in got


# ---------------------------------------------------------------- etcd calls


class BrokenWatch(MemoryStore):
    """A store whose watch fails after one revision."""

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[int]:
        yield 1
        raise StoreUnavailable("watch stream broke")


class SlowPuts(MemoryStore):
    """Each put takes `delay` seconds of the injected clock, as etcd's latency would."""

    def __init__(self, clock: Clock, delay: float) -> None:
        super().__init__(clock)
        self._moved = clock
        self._delay = delay

    async def put(
        self,
        key: str,
        value: bytes,
        *,
        lease: int = 0,
        if_absent: bool = False,
        if_mod_revision: int | None = None,
        fence: Fence | None = None,
    ) -> int:
        self._moved.now += self._delay
        return await super().put(
            key,
            value,
            lease=lease,
            if_absent=if_absent,
            if_mod_revision=if_mod_revision,
            fence=fence,
        )


async def test_store_calls_are_timed_and_failures_counted_by_operation() -> None:
    clock = Clock()
    metrics = ControlMetrics(clock=clock)
    memory = SlowPuts(clock, delay=0.003)
    store = InstrumentedStore(memory, metrics)
    await store.put("/k", b"v")
    kv = await store.get("/k")
    assert kv is not None and kv.value == b"v"
    with pytest.raises(Conflict):
        await store.put("/k", b"w", if_absent=True)  # an answer, not a failure
    memory.available = False
    with pytest.raises(StoreUnavailable):
        await store.list("/")
    with pytest.raises(StoreUnavailable):
        await store.get("/k")

    got = samples(metrics)
    count = "ponto_control_etcd_request_duration_seconds_count"
    total = "ponto_control_etcd_request_duration_seconds_sum"
    assert got[(count, frozenset({("op", "put")}))] == 2
    assert got[(total, frozenset({("op", "put")}))] == pytest.approx(0.006)
    # 3 ms falls in the 5 ms bucket, not the 2.5 ms one.
    bucket = "ponto_control_etcd_request_duration_seconds_bucket"
    assert got[(bucket, frozenset({("op", "put"), ("le", "0.0025")}))] == 0
    assert got[(bucket, frozenset({("op", "put"), ("le", "0.005")}))] == 2
    assert got[(count, frozenset({("op", "get")}))] == 2
    assert got[(count, frozenset({("op", "list")}))] == 1
    errors = "ponto_control_etcd_errors_total"
    assert got[(errors, frozenset({("op", "list")}))] == 1
    assert got[(errors, frozenset({("op", "get")}))] == 1
    assert got[(errors, frozenset({("op", "put")}))] == 0


async def test_every_operation_s_errors_are_exported_from_zero() -> None:
    # A counter that appears at its first failure is missed by rate(), and so by
    # the PontoEtcdErrors alert.
    metrics = ControlMetrics()
    errors = "ponto_control_etcd_errors_total"
    at_zero = {dict(labels)["op"] for (n, labels), v in samples(metrics).items() if n == errors}
    memory = MemoryStore()
    memory.available = False
    store = InstrumentedStore(memory, metrics)
    for call in (
        store.get("/k"),
        store.list("/"),
        store.scan("/", "0"),
        store.count("/", "0"),
        store.put("/k", b""),
        store.delete("/k"),
        store.delete_range("/", "0"),
        store.commit([]),
        store.grant_lease(5),
        store.refresh_lease(1),
        store.revoke_lease(1),
        store.compact(1),
    ):
        with pytest.raises(StoreUnavailable):
            await call
    got = samples(metrics)
    failed = {dict(labels)["op"] for (n, labels), v in got.items() if n == errors and v}
    assert failed | {"watch"} == at_zero
    help_text = metrics.render()[0].decode()
    assert all(op in help_text.split("# HELP " + errors)[1].split("\n")[0] for op in failed)


async def test_leases_and_commits_are_timed_too() -> None:
    metrics = ControlMetrics(clock=Clock())
    store = InstrumentedStore(MemoryStore(), metrics)
    lease = await store.grant_lease(5)
    await store.refresh_lease(lease)
    await store.revoke_lease(lease)
    await store.commit([])
    assert await store.delete("/absent") is False
    got = samples(metrics)
    for op in ("grant_lease", "refresh_lease", "revoke_lease", "commit", "delete"):
        assert got[("ponto_control_etcd_request_duration_seconds_count", frozenset({("op", op)}))]


async def test_a_failed_watch_counts_as_a_watch_error() -> None:
    metrics = ControlMetrics()
    store = InstrumentedStore(BrokenWatch(), metrics)
    seen = []
    with pytest.raises(StoreUnavailable):
        async for revision in store.watch("/", 0):
            seen.append(revision)
    assert seen == [1]
    assert value(metrics, "ponto_control_etcd_errors_total", op="watch") == 1


async def test_a_watch_its_consumer_leaves_is_closed_and_not_an_error() -> None:
    metrics = ControlMetrics()
    memory = MemoryStore()
    store = InstrumentedStore(memory, metrics)
    revision = await memory.put("/a", b"1")
    watch = store.watch("/", revision - 1)
    assert await anext(watch) == revision
    await watch.aclose()  # type: ignore[attr-defined]
    assert value(metrics, "ponto_control_etcd_errors_total", op="watch") == 0


# ---------------------------------------------------------------- pushes


class Stream:
    """RouteStream's two ends as the servicer sees them: the proxy's requests
    (fed by the test) and the context it writes pushes to."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[pb.RouteRequest | None] = asyncio.Queue()
        self.pushed: asyncio.Queue[pb.RouteUpdate] = asyncio.Queue()

    async def incoming(self) -> AsyncIterator[pb.RouteRequest]:
        while (req := await self.requests.get()) is not None:
            yield req

    async def write(self, payload: bytes) -> None:
        self.pushed.put_nowait(pb.RouteUpdate.FromString(payload))

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def next_table(self) -> pb.RouteUpdate:
        while True:
            update = await asyncio.wait_for(self.pushed.get(), 10)
            if update.HasField("table"):
                return update


def table(version: int) -> pb.RouteTable:
    return compile_table(State(version, (Region(f"r{version}", 1.0, 2.0),), ()))


async def test_pushes_acks_nacks_and_latency_from_publish_or_subscribe() -> None:
    clock = Clock(100.0)
    metrics = ControlMetrics(clock=clock)
    publisher = Publisher("cp", clock=clock)
    registry = ProxyRegistry(Catalog(MemoryStore()), "cp")
    routing = RoutingService(registry, publisher, metrics=metrics)
    metrics.bind(
        table=lambda: publisher.latest.table if publisher.latest else None,
        acked_versions=lambda: [r.acked_version for r in registry.sessions.values()],
        is_leader=lambda: False,
    )
    record = await registry.register("p1", "eu", "127.0.0.1:9", "test")
    publisher.publish(table(10))  # published at 100

    def count(result: str) -> float | None:
        return value(metrics, "ponto_control_pushes_total", result=result)

    def latency() -> tuple[float | None, float | None]:
        got = samples(metrics)
        return (
            got[("ponto_control_push_latency_seconds_count", frozenset())],
            got[("ponto_control_push_latency_seconds_sum", frozenset())],
        )

    def proxies(state: str) -> float | None:
        return value(metrics, "ponto_control_proxies", state=state)

    stream = Stream()
    clock.now = 130.0  # the proxy subscribes long after the publish
    task = asyncio.create_task(routing.route_stream(stream.incoming(), stream))  # type: ignore[arg-type]
    try:
        await stream.requests.put(pb.RouteRequest(session_id=record.session_id))
        first = await stream.next_table()
        assert first.table.version == 10
        await until(lambda: count("sent") == 1, "first push counted")
        assert proxies("behind") == 1 and proxies("latest") == 0

        clock.now = 130.5
        await stream.requests.put(
            pb.RouteRequest(
                session_id=record.session_id, version_info=10, response_nonce=first.nonce
            )
        )
        await until(lambda: count("acked") == 1, "ACK counted")
        # From the subscribe (130), not the publish (100): the proxy could not
        # have had the table earlier.
        assert latency() == (1, 0.5)
        assert proxies("latest") == 1 and proxies("behind") == 0

        clock.now = 200.0
        publisher.publish(table(11))
        second = await stream.next_table()
        clock.now = 200.25
        await stream.requests.put(
            pb.RouteRequest(
                session_id=record.session_id,
                version_info=10,
                response_nonce=second.nonce,
                error_detail="cannot read jwks",
            )
        )
        await until(lambda: count("nacked") == 1, "NACK counted")
        assert latency() == (1, 0.5)  # a NACK is no delivery
        assert proxies("behind") == 1

        clock.now = 300.0
        publisher.publish(table(12))
        third = await stream.next_table()
        clock.now = 302.0
        await stream.requests.put(
            pb.RouteRequest(
                session_id=record.session_id, version_info=12, response_nonce=third.nonce
            )
        )
        await until(lambda: count("acked") == 2, "second ACK counted")
        assert latency() == (2, 2.5)
        assert count("sent") == 3
        # An answer to a push this stream never made is not counted.
        await stream.requests.put(
            pb.RouteRequest(session_id=record.session_id, version_info=12, response_nonce="x-9")
        )
        await stream.requests.put(pb.RouteRequest(session_id=record.session_id, is_report=True))
        await until(stream.requests.empty, "requests read")
        assert (count("acked"), count("nacked")) == (2, 1)
        assert value(metrics, "ponto_control_push_latency_seconds_bucket", le="2.5") == 2
        assert value(metrics, "ponto_control_push_latency_seconds_bucket", le="1.0") == 1
    finally:
        await stream.requests.put(None)
        await asyncio.wait_for(task, 10)


# ---------------------------------------------------------------- probes


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_probes_are_counted_by_origin_region_and_result() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", ok)
    server = TestServer(app, host="127.0.0.1")
    await asyncio.wait_for(server.start_server(), 10)
    metrics = ControlMetrics()
    try:
        catalog = Catalog(MemoryStore())
        await catalog.put_region(Region("eu", 53.0, -6.0), allow_update=False)
        await catalog.put_region(Region("us", 39.0, -77.0), allow_update=False)
        await catalog.put_origin(
            Origin("up", str(server.make_url("/v1")), "eu", ("m",)), allow_update=False
        )
        dead = f"http://127.0.0.1:{closed_port()}/v1"
        await catalog.put_origin(Origin("down", dead, "us", ("m",)), allow_update=False)
        prober = Prober(
            catalog, ProbeSettings(rise=1, fall=1, timeout=2, metrics_path=""), metrics=metrics
        )
        async with aiohttp.ClientSession() as session:
            for _ in range(2):
                await asyncio.wait_for(prober.probe_all(session), 10)
    finally:
        await asyncio.wait_for(server.close(), 10)
    probes = "ponto_control_probes_total"
    assert value(metrics, probes, origin="up", region="eu", result="ok") == 2
    assert value(metrics, probes, origin="down", region="us", result="fail") == 2
    assert value(metrics, probes, origin="up", region="eu", result="fail") is None
    assert value(metrics, probes, origin="down", region="us", result="ok") is None


# ---------------------------------------------------------------- admin calls


def test_every_admin_method_answers_once() -> None:
    """AdminCalls counts a call when its behaviour returns: true of unary responses only."""
    service = apb.DESCRIPTOR.services_by_name["Admin"]
    streaming = [m.name for m in service.methods if m.client_streaming or m.server_streaming]
    assert streaming == []


@contextlib.asynccontextmanager
async def admin_server(metrics: ControlMetrics) -> AsyncIterator[admin_pb2_grpc.AdminAsyncStub]:
    """The Admin service behind AdminCalls and the TokenGuard, as controlplane.app wires them."""
    store = MemoryStore()
    catalog = Catalog(store)
    await catalog.put_region(Region("eu", 53.0, -6.0), allow_update=False)
    server = grpc.aio.server(
        interceptors=[
            AdminCalls(metrics),
            TokenGuard(bootstrap_token="", admin_token=ADMIN_TOKEN),
        ]
    )
    admin_pb2_grpc.add_AdminServicer_to_server(
        AdminService(catalog, Publisher("cp"), AuditLog(store, replica="cp"), token_required=True),
        server,
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield admin_pb2_grpc.AdminStub(channel)
    finally:
        await server.stop(None)


async def test_admin_calls_are_counted_with_their_status_refusals_included() -> None:
    metrics = ControlMetrics()
    auth = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    async with admin_server(metrics) as admin:
        await admin.ListRegions(apb.ListRequest(), metadata=auth, timeout=10)
        await admin.DrainRegion(
            apb.DrainRequest(name="eu", drained=True), metadata=auth, timeout=10
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin.DrainRegion(apb.DrainRequest(name="eu", drained=False), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await admin.DrainRegion(apb.DrainRequest(name="mars"), metadata=auth, timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await admin.PutRegion(apb.PutRegionRequest(), metadata=auth, timeout=10)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    calls = "ponto_control_admin_calls_total"
    assert value(metrics, calls, method="ListRegions", code="OK") == 1
    assert value(metrics, calls, method="DrainRegion", code="OK") == 1
    assert value(metrics, calls, method="DrainRegion", code="UNAUTHENTICATED") == 1
    assert value(metrics, calls, method="DrainRegion", code="NOT_FOUND") == 1
    assert value(metrics, calls, method="PutRegion", code="INVALID_ARGUMENT") == 1
    total = sum(v for (name, _), v in samples(metrics).items() if name == calls)
    assert total == 5


# ---------------------------------------------------------------- the replica's wiring


async def test_a_replica_wires_its_store_tables_and_election_into_its_metrics() -> None:
    clock = Clock()
    metrics = ControlMetrics(replica="cp-7", clock=clock)
    settings = parse(["--listen", "127.0.0.1:0", "--id", "cp-7"])
    plane = ControlPlane(settings, MemoryStore(), metrics=metrics)
    assert plane.metrics is metrics

    await plane.catalog.put_region(Region("eu", 53.0, -6.0), allow_update=False)
    await plane.catalog.set_region_drained("eu", True)
    budgeted = Tenant("acme", limits=Limits(tokens_per_month=5000))
    await plane.catalog.put_tenant(budgeted, allow_update=False)
    assert await plane.builder.build_once()
    got = samples(metrics)
    assert got[("ponto_control_region_drained", frozenset({("region", "eu")}))] == 1
    latest = plane.publisher.latest
    assert latest is not None
    assert got[("ponto_control_table_version", frozenset())] == latest.version
    assert latest.published_at == clock.now
    count = "ponto_control_etcd_request_duration_seconds_count"
    assert got[(count, frozenset({("op", "put")}))] >= 2
    assert got[(count, frozenset({("op", "list")}))] >= 1
    info = [dict(labels) for name, labels in got if name == "ponto_control_info"]
    assert info[0]["replica"] == "cp-7" and info[0]["version"]

    assert got[("ponto_control_leader", frozenset())] == 0

    async def lead() -> None:
        await asyncio.Event().wait()

    election = asyncio.create_task(plane.leadership.run(lead))
    try:
        await until(lambda: plane.leadership.is_leader, "elected")
        assert value(metrics, "ponto_control_leader") == 1
        await plane.rebalancer.round()
        month = {"scope": "t/acme", "period": "month"}
        assert value(metrics, "ponto_control_budget_tokens", **month) == 5000
        assert value(metrics, "ponto_control_budget_spent_tokens", **month) == 0
    finally:
        election.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await election
    assert value(metrics, "ponto_control_leader") == 0
    count_samples = samples(metrics)
    assert count_samples[(count, frozenset({("op", "grant_lease")}))] >= 1
