"""Prometheus metrics of one control-plane replica, in a registry it owns.

Two kinds of series:

- events, counted or timed where they happen (pushes and their ACKs, etcd
  calls, probes, Admin calls), with the data plane's Counter and Histogram:
  plain numbers updated without a lock, safe because the replica's event loop
  is their only writer and the scrape runs on the same loop; counters export
  no `_created` series;
- state, read at scrape time from the parts that own it (the latest route
  table, the proxies connected here, the election), so nothing has to keep a
  gauge in step. Until `bind` is called these read as an empty replica.

Besides, prometheus_client's process and platform collectors: process_* (the
replica's CPU, memory, open files, start time) and python_info.

The names and labels are a contract with the chart's dashboards and alerts;
`names()` lists them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.fleetid import FleetWatch
from dataplane.metrics import Counter, Histogram
from ponto.v1 import routing_pb2 as pb
from ponto.version import software_version

# From a sub-second push on loopback to a proxy that took a minute to answer.
PUSH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# etcd answers in about a millisecond on loopback; calls time out after 3 s.
ETCD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

PUSH_RESULTS = ("sent", "acked", "nacked")
# The state store's operations (controlplane/store/instrumented.py labels its calls
# by them), and the watch, whose failures are counted too.
STORE_OPS = (
    "get",
    "list",
    "scan",
    "count",
    "put",
    "delete",
    "delete_range",
    "commit",
    "grant_lease",
    "refresh_lease",
    "revoke_lease",
    "compact",
)
ETCD_ERROR_OPS = (*STORE_OPS, "watch")

Series = Iterable[tuple[Sequence[str], float]]


class _Reading(Collector):
    """A gauge family whose series `read()` returns at each scrape."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        read: Callable[[], Series],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = list(labelnames)
        self._read = read
        registry.register(self)

    def _empty(self) -> GaugeMetricFamily | CounterMetricFamily:
        return GaugeMetricFamily(self._name, self._doc, labels=self._labelnames)

    def describe(self) -> Iterator[Metric]:
        yield self._empty()

    def collect(self) -> Iterator[Metric]:
        family = self._empty()
        for labels, value in self._read():
            family.add_metric(list(labels), value)
        yield family


class _Count(_Reading):
    """A counter family (NAME_total) whose series `read()` returns at each scrape."""

    def _empty(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._doc, labels=self._labelnames)


class ControlMetrics:
    """The replica's metrics; see the module docstring.

    `clock` (monotonic seconds) times etcd calls and push latency; the
    Publisher stamps snapshots with the same clock (ControlPlane wires both).
    """

    def __init__(self, *, replica: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._table: Callable[[], pb.RouteTable | None] = lambda: None
        self._acked: Callable[[], Iterable[int]] = tuple
        self._leader: Callable[[], bool] = lambda: False
        self._terms: Callable[[], int] = lambda: 0
        self._load_ages: Callable[[], Mapping[str, float]] = dict
        self._loads: Callable[[], pb.OriginLoads | None] = lambda: None
        self._budgets: Callable[[], Iterable[tuple[str, str, float, int]]] = tuple
        self._fleet = FleetWatch()
        info = ((replica, software_version()), 1.0)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.pushes = Counter(
            "ponto_control_pushes",
            "Route tables written to proxy streams (sent), and the proxies' answers: "
            "acked, or nacked (refused; the proxy keeps its previous table)",
            ["result"],
            registry=r,
        )
        for result in PUSH_RESULTS:
            self.pushes.labels(result)  # exported at 0, so rate() sees the first one
        self.push_latency = Histogram(
            "ponto_control_push_latency_seconds",
            "From a table version being published (or the proxy subscribing, if later) "
            "to the proxy's ACK of it",
            buckets=PUSH_BUCKETS,
            registry=r,
        )
        self.etcd_duration = Histogram(
            "ponto_control_etcd_request_duration_seconds",
            f"etcd calls by state-store operation ({', '.join(STORE_OPS)}), failed ones included",
            ["op"],
            buckets=ETCD_BUCKETS,
            registry=r,
        )
        self.etcd_errors = Counter(
            "ponto_control_etcd_errors",
            f"etcd calls that got no answer (unreachable, timed out), by operation "
            f"({', '.join(STORE_OPS)}); op=watch counts watches that failed and were "
            "restarted",
            ["op"],
            registry=r,
        )
        for op in ETCD_ERROR_OPS:
            self.etcd_errors.labels(op)  # exported at 0, so rate() sees the first one
        self.probes = Counter(
            "ponto_control_probes",
            "Health probes of origins by the leader, by result (ok, fail)",
            ["origin", "region", "result"],
            registry=r,
        )
        self.admin_calls = Counter(
            "ponto_control_admin_calls",
            "Admin API calls by method and gRPC status code, refused ones included",
            ["method", "code"],
            registry=r,
        )
        self.routing_refusals = Counter(
            "ponto_control_routing_refusals",
            "Routing API calls (proxies) refused for their bootstrap token or certificate "
            "role, by method and gRPC status code",
            ["method", "code"],
            registry=r,
        )
        _Reading(
            "ponto_control_table_version",
            "Version of the latest route table this replica publishes (0 before the first)",
            (),
            lambda: [((), float(self._version()))],
            r,
        )
        _Reading(
            "ponto_control_proxies",
            "Proxies connected to this replica whose last ACK is of the latest version "
            "(latest) or not (behind)",
            ("state",),
            self._proxies,
            r,
        )
        _Reading(
            "ponto_control_leader",
            "1 while this replica is the leader (it probes origins), else 0",
            (),
            lambda: [((), 1.0 if self._leader() else 0.0)],
            r,
        )
        # The gauge above misses terms shorter than a scrape interval, and its
        # "no leader for 2m" alert is reset by each (SRE trial: 5 s terms on
        # one replica after another with an etcd member stalled).
        _Count(
            "ponto_control_leader_terms",
            "Terms this replica has begun as the leader",
            (),
            lambda: [((), float(self._terms()))],
            r,
        )
        _Reading(
            "ponto_control_origin_healthy",
            "1 if the origin passes its health probes, as in the latest table",
            ("origin", "region"),
            lambda: self._origins(lambda o: o.healthy),
            r,
        )
        _Reading(
            "ponto_control_origin_drained",
            "1 if the origin is drained, as in the latest table",
            ("origin", "region"),
            lambda: self._origins(lambda o: o.drained),
            r,
        )
        _Reading(
            "ponto_control_origin_load_age_seconds",
            "Leader only: seconds since the origin's metrics page last gave its load "
            "figures, for the healthy, undrained origins read since this term began",
            ("origin", "region"),
            self._origin_load_ages,
            r,
        )
        # What placement reads (docs/routing.md), as the leader scraped it:
        # trial 60 found these on the status page only.
        for name, doc, field, ratio in (
            (
                "ponto_control_origin_requests_running",
                "requests running",
                "running",
                False,
            ),
            (
                "ponto_control_origin_requests_waiting",
                "requests waiting",
                "waiting",
                False,
            ),
            (
                "ponto_control_origin_kv_cache_usage_ratio",
                "share of its KV cache in use (0 to 1)",
                "kv_cache_usage",
                True,
            ),
            (
                "ponto_control_origin_prefix_cache_hit_ratio",
                "prefix-cache hits over queries, in tokens, between its last two scrapes",
                "prefix_hit_rate",
                True,
            ),
        ):
            _Reading(
                name,
                f"Leader only: the origin's {doc}, from its metrics page's last scrape "
                "(a figure it does not report is left out)",
                ("origin", "region"),
                functools.partial(self._origin_figures, field, ratio),
                r,
            )
        # Trial 56: a budget's use was in `pontoctl get tenants` and `key
        # list` only, with nothing to alert on before requests are refused.
        _Reading(
            "ponto_control_budget_spent_tokens",
            "Leader only: tokens the fleet spent of a budgeted scope (t/<tenant> or "
            "k/<key id>) in the UTC day or month (period), as the leader last counted",
            ("scope", "period"),
            lambda: self._budget_figures(spent=True),
            r,
        )
        _Reading(
            "ponto_control_budget_tokens",
            "Leader only: a budgeted scope's token budget for the UTC day or month (period)",
            ("scope", "period"),
            lambda: self._budget_figures(spent=False),
            r,
        )
        _Reading(
            "ponto_control_region_drained",
            "1 if the region is drained, as in the latest table",
            ("region",),
            self._regions,
            r,
        )
        _Reading(
            "ponto_control_fleet_replaced",
            "1 while this replica publishes tables of a fleet id it made for a store "
            "without one after it served another (etcd lost its data, or is another): "
            "proxies refuse them until the fleet id is adopted (pontoctl fleet adopt)",
            (),
            lambda: [((), 1.0 if self._fleet.replaced else 0.0)],
            r,
        )
        _Reading(
            "ponto_control_proxies_withheld",
            "Proxies connected to this replica that hold no route table and are sent "
            "none while the fleet id is in question (proxies refuse the tables as "
            "another fleet's, or as opening them): unready until it is settled",
            (),
            lambda: [((), float(len(self._fleet.waiting)))],
            r,
        )
        _Reading(
            "ponto_control_proxies_other_fleet",
            "Proxies connected to this replica that refuse its route tables as another "
            "fleet's, by the fleet id they serve (the id `pontoctl fleet adopt` takes)",
            ("fleet_id",),
            self._other_fleets,
            r,
        )
        _Reading(
            "ponto_control_info",
            "Always 1: the replica's id and software version",
            ("replica", "version"),
            lambda: [info],
            r,
        )

    def bind(
        self,
        *,
        table: Callable[[], pb.RouteTable | None],
        acked_versions: Callable[[], Iterable[int]],
        is_leader: Callable[[], bool],
        load_ages: Callable[[], Mapping[str, float]] = dict,
        leader_terms: Callable[[], int] = lambda: 0,
        loads: Callable[[], pb.OriginLoads | None] = lambda: None,
        budgets: Callable[[], Iterable[tuple[str, str, float, int]]] = tuple,
        fleet: FleetWatch | None = None,
    ) -> None:
        """Where scrape-time state is read: the latest published table, the
        versions last ACKed by the proxies connected here, the election (and
        how many terms it has begun), the age of each origin's load figures
        (LoadScraper.ages), the origins' loads last scraped (LoadHub.loads), the
        budgets' use (Rebalancer.budget_use)."""
        self._table = table
        self._acked = acked_versions
        self._leader = is_leader
        self._terms = leader_terms
        self._load_ages = load_ages
        self._loads = loads
        self._budgets = budgets
        self._fleet = fleet or FleetWatch()

    # ------------------------------------------------------------ events

    def push_sent(self) -> None:
        self.pushes.labels("sent").inc()

    def push_answered(self, *, acked: bool, latency: float) -> None:
        """A proxy answered a push; latency (seconds) is observed for ACKs only."""
        if acked:
            self.pushes.labels("acked").inc()
            self.push_latency.labels().observe(latency)
        else:
            self.pushes.labels("nacked").inc()

    def etcd_call(self, op: str, seconds: float, *, failed: bool) -> None:
        self.etcd_duration.labels(op).observe(seconds)
        if failed:
            self.etcd_error(op)

    def etcd_error(self, op: str) -> None:
        self.etcd_errors.labels(op).inc()

    def probed(self, origin: str, region: str, *, ok: bool) -> None:
        self.probes.labels(origin, region, "ok" if ok else "fail").inc()

    def admin_call(self, method: str, code: str) -> None:
        self.admin_calls.labels(method, code).inc()

    def routing_refused(self, method: str, code: str) -> None:
        self.routing_refusals.labels(method, code).inc()

    # ------------------------------------------------------------ scrape

    def render(self) -> tuple[bytes, str]:
        """The exposition (body, content type) for a GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _version(self) -> int:
        table = self._table()
        return table.version if table is not None else 0

    def _proxies(self) -> Series:
        latest = self._version()
        acked = list(self._acked())
        at_latest = sum(1 for v in acked if latest and v == latest)
        return [(("latest",), float(at_latest)), (("behind",), float(len(acked) - at_latest))]

    def _origins(self, flag: Callable[[pb.Origin], bool]) -> Series:
        table = self._table()
        if table is None:
            return []
        return [((o.name, o.region), 1.0 if flag(o) else 0.0) for o in table.origins]

    def _origin_load_ages(self) -> Series:
        table = self._table()
        if table is None or not self._leader():
            return []  # a replica that no longer leads keeps its last figures
        ages = self._load_ages()
        return [((o.name, o.region), ages[o.name]) for o in table.origins if o.name in ages]

    def _origin_figures(self, field: str, ratio: bool) -> Series:
        """One figure of each origin's last scraped load; a ratio of -1 is
        one the origin does not report."""
        table, loads = self._table(), self._loads()
        if table is None or loads is None or not self._leader():
            return []
        regions = {o.name: o.region for o in table.origins}
        out = []
        for load in loads.loads:
            value = float(getattr(load, field))
            if load.origin in regions and not (ratio and value < 0):
                out.append(((load.origin, regions[load.origin]), value))
        return out

    def _budget_figures(self, *, spent: bool) -> Series:
        if not self._leader():
            return []  # the rebalancer's counts are a term's
        return [
            # Whole tokens (older proxies' counts held an estimate's fractions).
            ((scope, period), float(round(used)) if spent else float(budget))
            for scope, period, used, budget in self._budgets()
        ]

    def _other_fleets(self) -> Series:
        counts: dict[str, int] = {}
        for served in self._fleet.refusing.values():
            counts[served] = counts.get(served, 0) + 1
        return [((served,), float(n)) for served, n in sorted(counts.items())]

    def _regions(self) -> Series:
        table = self._table()
        if table is None:
            return []
        return [((r.name,), 1.0 if r.drained else 0.0) for r in table.regions]

    def names(self) -> list[str]:
        """Every metric family this registry exports (counters with their _total)."""
        out = []
        for collector in self.registry.collect():
            suffix = "_total" if collector.type == "counter" else ""
            out.append(collector.name + suffix)
        return sorted(out)
