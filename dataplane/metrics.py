"""Prometheus metrics of one proxy, in a registry the app owns.

The metrics the request path updates are this module's `Counter` and
`Histogram`: plain numbers in dicts, with no lock and no argument checks per
update (prometheus_client's take a lock on every `inc`). That is safe because
one event loop is their only writer and the scrape runs on the same loop.
They export what prometheus_client's would, without the `_created` series.
Gauges read at scrape time stay prometheus_client's; counts that only grow but
are kept elsewhere (the cache store's evictions, the link's NACKs) are read at
scrape time too, and typed as counters (`ReadCounter`).

The GenAI metrics follow OpenTelemetry's GenAI semantic conventions
(`gen_ai.client.operation.duration`, `gen_ai.client.token.usage`,
`gen_ai.client.operation.time_to_first_chunk`, with the bucket boundaries they
advise, extended upwards for long answers), spelled as Prometheus names, with
Ponto's labels beside theirs:
`ponto_region` (the region of the origin that answered; the proxy's own for
cache answers and refusals) and `ponto_cache` (hit, miss, bypass, or "" when no
cache step ran). Each request records them once, when it is settled
(`Metrics.operation`). Beside them, with the same labels,
ponto_stream_mean_chunk_interval_seconds: not the conventions'
`gen_ai.client.operation.time_per_output_chunk`, which records each gap
between chunks (one value per chunk after the first), but one mean per
stream, which costs nothing per chunk on the relay.

The registry also holds prometheus_client's process and platform collectors
(process_*: CPU, memory, open files, start time of this process; python_info).
In a `--workers` group each worker is its own process: the group's /metrics
gives each worker's with its `worker` label (dataplane.workers); the
supervisor, which serves no traffic, is in no scrape.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from dataplane.streaming.usage import Usage
from ponto.routetable import OPEN_TENANT

if TYPE_CHECKING:
    from dataplane.auth.remote import RemoteKeys

CellT = TypeVar("CellT", "CounterCell", "HistogramCell")

# Up to 10 minutes: a long stream or a reasoning model's answer takes minutes,
# and past the top bucket a quantile says only "more than that".
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)  # fmt: skip
# The boundaries OpenTelemetry's GenAI metrics conventions advise, doubled on
# past their 81.92 s to cover 10 minutes, as LATENCY_BUCKETS does.
GENAI_DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
    163.84, 327.68, 655.36,
)  # fmt: skip
GENAI_TOKEN_BUCKETS = (
    1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864,
)  # fmt: skip
# The conventions' boundaries, then up to 2 minutes: a reasoning model may
# think for a minute before its first chunk (of output, not of thought).
GENAI_FIRST_CHUNK_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 30.0, 60.0, 120.0,
)  # fmt: skip
# ponto_stream_mean_chunk_interval_seconds: the boundaries the GenAI conventions
# advise for time_per_output_token, with 1 and 5 ms below them for fast models.
GENAI_CHUNK_GAP_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# An origin attempt's time from sent to committed (a stream's first chunk, or
# a whole answer's body): whole answers of long generations take minutes.
COMMIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# gen_ai.operation.name of each proxied endpoint (OpenTelemetry's well-known
# values); the Responses API generates as chat does. Rerank has no well-known
# value: its own name, which the conventions allow for an operation they lack.
GENAI_OPERATIONS = {
    "chat.completions": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
    "responses": "chat",
    "rerank": "rerank",
}
EMBEDDINGS = GENAI_OPERATIONS["embeddings"]
RERANK = GENAI_OPERATIONS["rerank"]
# Operations whose answers generate nothing: input tokens only.
INPUT_ONLY = frozenset({EMBEDDINGS, RERANK})
# gen_ai.provider.name, which the conventions require on every GenAI metric:
# the API every origin speaks, OpenAI's.
GENAI_PROVIDER = "openai"
# Tenants whose rate-limit refusals and slot waits a proxy reports (the ones
# limited last): enough for a status page, bounded for the etcd value each
# replica writes for all its proxies (controlplane.registry).
MAX_LIMITED_TENANTS = 100


class CounterCell:
    """One labelled series of a Counter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramCell:
    """One labelled series of a Histogram: counts per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value


class _Family(Collector, Generic[CellT]):
    """A metric's series by label values, registered as a collector."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str],
        registry: CollectorRegistry,
    ) -> None:  # fmt: skip
        self._name = name
        self._doc = documentation
        self._labelnames = list(labelnames)
        # The label values' indexes in the order the text format writes
        # them (generate_latest's: by label name), for `render`.
        self._order = sorted(range(len(self._labelnames)), key=self._labelnames.__getitem__)
        self._cells: dict[tuple[str, ...], CellT] = {}
        if not self._labelnames:
            self._cells[()] = self._new_cell()  # exported from the start, as usual
        registry.register(self)

    def _new_cell(self) -> CellT:
        raise NotImplementedError

    def _empty(self) -> Metric:
        raise NotImplementedError

    def labels(self, *values: str) -> CellT:
        cell = self._cells.get(values)
        if cell is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}, not {values}")
            cell = self._cells[values] = self._new_cell()
        return cell

    def describe(self) -> Iterator[Metric]:
        yield self._empty()

    def collect(self) -> Iterator[Metric]:
        yield _Rendered(self)

    def samples(self) -> Metric:
        """The family with its series as samples, what `collect` gives when
        they are read (`_Rendered`)."""
        raise NotImplementedError

    def render(self, out: list[str]) -> None:
        """Append the family's text exposition to `out`, as generate_latest
        writes what `collect` gives (`exposition`)."""
        raise NotImplementedError

    def _pairs(self, values: tuple[str, ...]) -> list[str]:
        """A series' `name="value"` pairs, sorted by name."""
        names = self._labelnames
        return [f'{names[i]}="{_escaped(values[i])}"' for i in self._order]

    def forget(self, kept: Callable[[tuple[str, ...]], bool]) -> list[tuple[str, ...]]:
        """Drop the series whose label values `kept` refuses (their counts
        end, as a restarted process's do); the label values dropped."""
        gone = [values for values in self._cells if not kept(values)]
        for values in gone:
            del self._cells[values]
        return gone


class Counter(_Family[CounterCell]):
    """A labelled counter, exported as NAME_total."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
        registry: CollectorRegistry,
    ) -> None:  # fmt: skip
        super().__init__(name, documentation, labelnames, registry)

    def _new_cell(self) -> CounterCell:
        return CounterCell()

    def _empty(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._doc, labels=self._labelnames)

    def inc(self, amount: float = 1.0) -> None:
        """For a counter without labels."""
        self.labels().inc(amount)

    def add(self, *values: str) -> None:
        """labels(*values).inc() in one call: the counters every request
        moves (a Python call costs some 450 instructions, bench/instructions.py).
        A subscript, not get(): the cell is nearly always there, and a hit
        costs some 110 instructions less so (callgrind on a loop)."""
        try:
            cell = self._cells[values]
        except KeyError:
            cell = self.labels(*values)
        cell.value += 1.0

    def samples(self) -> Metric:
        family = self._empty()
        for values, cell in list(self._cells.items()):
            family.add_metric(list(values), cell.value)
        return family

    def render(self, out: list[str]) -> None:
        name = self._name + "_total"
        _head(out, name, self._doc, "counter")
        for values, cell in list(self._cells.items()):
            labels = ",".join(self._pairs(values))
            braced = f"{{{labels}}}" if labels else ""
            out.append(f"{name}{braced} {_number(cell.value)}\n")


class Histogram(_Family[HistogramCell]):
    """A labelled histogram with fixed buckets (`le` is inclusive, as Prometheus says)."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
        buckets: Sequence[float], registry: CollectorRegistry,
    ) -> None:  # fmt: skip
        self._bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        self._les = [*(_le(b) for b in self._bounds), "+Inf"]
        # Where `le` goes among the labels sorted by name.
        self._le_at = sum(1 for n in labelnames if n < "le")
        super().__init__(name, documentation, labelnames, registry)

    def _new_cell(self) -> HistogramCell:
        return HistogramCell(self._bounds)

    def observe_at(self, value: float, *values: str) -> None:
        """labels(*values).observe(value) in one call, as Counter.add."""
        try:
            cell = self._cells[values]
        except KeyError:
            cell = self.labels(*values)
        cell.counts[bisect.bisect_left(self._bounds, value)] += 1  # HistogramCell.observe's
        cell.sum += value

    def _empty(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def samples(self) -> Metric:
        family = self._empty()
        for values, cell in list(self._cells.items()):
            cumulative = 0
            buckets = []
            for le, count in zip(self._les, cell.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(list(values), buckets, cell.sum)
        return family

    def render(self, out: list[str]) -> None:
        name = self._name
        _head(out, name, self._doc, "histogram")
        at = self._le_at
        for values, cell in list(self._cells.items()):
            pairs = self._pairs(values)
            before, after = ",".join(pairs[:at]), ",".join(pairs[at:])
            bucket = f'{name}_bucket{{{before}{"," if before else ""}le="'
            rest = f'"{"," if after else ""}{after}}} '
            cumulative = 0
            for le, count in zip(self._les, cell.counts, strict=True):
                cumulative += count
                out.append(f"{bucket}{le}{rest}{_number(cumulative)}\n")
            joined = ",".join(pairs)
            labels = f"{{{joined}}}" if joined else ""
            out.append(f"{name}_count{labels} {_number(cumulative)}\n")
            out.append(f"{name}_sum{labels} {_number(cell.sum)}\n")


def _escaped(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    """A sample's value as prometheus_client writes it (floatToGoString): a
    whole number from 1 to a million (0 for a bucket's count) is its digits
    and ".0", without the call."""
    if type(value) is int:  # a bucket's count
        if 0 <= value < 1_000_000:
            return f"{value}.0"
    elif value.is_integer() and 1 <= value < 1_000_000:
        return f"{int(value)}.0"
    spelled: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return spelled


def _head(out: list[str], name: str, doc: str, kind: str) -> None:
    help_text = doc.replace("\\", "\\\\").replace("\n", "\\n")
    out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")


class _Rendered(Metric):
    """One of this module's families as its `collect` gives it: the samples
    are made when they are first read (generate_latest, get_sample_value),
    while `exposition`, which finds the family here, has it write its text
    itself and makes none."""

    def __init__(self, family: _Family[Any]) -> None:
        empty = family._empty()
        self.name, self.documentation = empty.name, empty.documentation
        self.type, self.unit = empty.type, empty.unit
        self.family = family
        self._samples: list[Sample] | None = None

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = self.family.samples().samples
        return self._samples

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self._samples = samples


class _Given:
    """Metrics already collected, as a collector (for generate_latest)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry's text exposition, what generate_latest gives, byte for
    byte: this module's families write theirs themselves (`render`), the
    other collectors' metrics go through generate_latest, in the order of
    the registry's collect(). With a key label on the tenants' series,
    2,000 keys are some 20,000 series a process, which generate_latest
    wrote at 77,000 instructions each (it checks and escapes every label
    name of every sample): 1.8 billion instructions a scrape, a second in
    which the process's event loop served nothing (trial 96)."""
    out: list[str] = []
    theirs: list[Metric] = []
    for metric in registry.collect():
        if isinstance(metric, _Rendered):
            if theirs:
                out.append(generate_latest(_Given(theirs)).decode())
                theirs = []
            metric.family.render(out)
        else:
            theirs.append(metric)
    if theirs:
        out.append(generate_latest(_Given(theirs)).decode())
    return "".join(out).encode()


class TenantsUnavailable(Collector):
    """ponto_jwt_config_unavailable: one series, value 1, per tenant whose JWT
    config could not be loaded; none when every config loaded."""

    NAME = "ponto_jwt_config_unavailable"
    DOC = (
        "Tenants whose JWT config (JWKS file, HS256 secret) this proxy could not load "
        "from the table it serves, or whose JWKS URL no fetch has brought a usable set "
        "from: their JWTs are answered 503 auth_unavailable"
    )

    def __init__(
        self, problems: Callable[[], Mapping[str, str]], *, registry: CollectorRegistry
    ) -> None:
        self._problems = problems
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.DOC, labels=["tenant"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=["tenant"])
        for tenant in sorted(self._problems()):
            family.add_metric([tenant], 1.0)
        yield family


class JwksSets(Collector):
    """The JWKS URLs this proxy fetches (dataplane.auth.remote), per `url`:
    ponto_jwks_fetches_total and ponto_jwks_fetch_errors_total,
    ponto_jwks_set_held (1 while a set is in use, 0 while there is none: not
    fetched yet, or every fetch failed and no earlier run's set was kept),
    and, once a fetch has brought a set, ponto_jwks_keys (its signing keys)
    and ponto_jwks_age_seconds (since the last good fetch: it grows while the
    fetches fail and the last good set is used)."""

    def __init__(
        self,
        sets: Callable[[], Iterable[RemoteKeys]],
        clock: Callable[[], float],
        *,
        registry: CollectorRegistry,
    ) -> None:
        self._sets = sets
        self._clock = clock
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def _families(
        self,
    ) -> tuple[
        CounterMetricFamily,
        CounterMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
        GaugeMetricFamily,
    ]:
        return (
            CounterMetricFamily(
                "ponto_jwks_fetches", "Fetches of a JWKS URL, good or not", labels=["url"]
            ),
            CounterMetricFamily(
                "ponto_jwks_fetch_errors",
                "Fetches of a JWKS URL that brought no usable key set",
                labels=["url"],
            ),
            # Apart from the age, which a URL with no set has none of: a proxy
            # started while its identity provider was down refused every JWT
            # and exported no age, so PontoJwksStale stayed silent (review
            # finding); an age from the process's start would start again at
            # each restart of the pods, and the alert resolve with it.
            GaugeMetricFamily(
                "ponto_jwks_set_held",
                "1 while the JWKS URL has a key set in use, 0 while it has none (no "
                "fetch has brought one and no earlier run's was kept: its JWTs are refused)",
                labels=["url"],
            ),
            GaugeMetricFamily(
                "ponto_jwks_keys", "Signing keys in the JWKS URL's set in use", labels=["url"]
            ),
            GaugeMetricFamily(
                "ponto_jwks_age_seconds",
                "Seconds since the JWKS URL's set in use was fetched",
                labels=["url"],
            ),
        )

    def collect(self) -> Iterator[Metric]:
        fetches, errors, held, keys, age = families = self._families()
        now = self._clock()
        for remote in sorted(self._sets(), key=lambda r: r.url):
            fetches.add_metric([remote.url], remote.fetches_total)
            errors.add_metric([remote.url], remote.errors_total)
            held.add_metric([remote.url], 0.0 if remote.keys is None else 1.0)
            if remote.keys is not None:
                keys.add_metric([remote.url], len(remote.keys))
                age.add_metric([remote.url], max(0.0, now - remote.fetched_at))
        yield from families


class ReadCounter(Collector):
    """A counter without labels whose value is read at scrape time from a count
    kept elsewhere that only grows (0 until `read` is set)."""

    def __init__(self, name: str, documentation: str, *, registry: CollectorRegistry) -> None:
        self._name = name
        self._doc = documentation
        self.read: Callable[[], float] = lambda: 0.0
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._doc)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._doc, value=self.read())


class ReadCounters(Collector):
    """A counter with one label whose values are read at scrape time, by
    label value, from counts kept elsewhere that only grow (`read`)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        read: Callable[[], Mapping[str, float]],
        *,
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._doc = documentation
        self._label = label
        self._read = read
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self._name, self._doc, labels=[self._label])

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, count in sorted(self._read().items()):
            family.add_metric([value], count)
        yield family


class FleetInfo(Collector):
    """ponto_fleet_info{fleet_id} = 1: the fleet of the route table served,
    which `pontoctl fleet adopt` takes when etcd lost it (none until a table
    with a fleet id is served)."""

    NAME = "ponto_fleet_info"
    DOC = "The fleet id of the route table served (1; none before such a table)"

    def __init__(self, read: Callable[[], str], *, registry: CollectorRegistry) -> None:
        self._read = read
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.DOC, labels=["fleet_id"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=["fleet_id"])
        if fleet := self._read():
            family.add_metric([fleet], 1.0)
        yield family


class Refusing(Collector):
    """ponto_route_table_refusing{reason}: 1 for the reason the guard refused
    the latest table pushed (dataplane.sync.holder), 0 for the other, all 0
    once a table is taken. A gauge, for the alert: it is 1 from the first
    refusal (a counter's first increase from an absent series is lost) and
    drops as soon as adoption works (a counter's increase lingers its window)."""

    NAME = "ponto_route_table_refusing"
    DOC = (
        "1 while the latest route table pushed was refused, by reason (another_fleet, "
        "would_open); 0 once a table is taken"
    )
    REASONS = ("another_fleet", "would_open")

    def __init__(self, read: Callable[[], str], *, registry: CollectorRegistry) -> None:
        self._read = read
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.NAME, self.DOC, labels=["reason"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=["reason"])
        refusing = self._read()
        for reason in self.REASONS:
            family.add_metric([reason], 1.0 if reason == refusing else 0.0)
        yield family


class OriginSlowness(Collector):
    """ponto_origin_slowness{origin} and ponto_origin_slow{origin}, read at
    scrape time: how many times slower than its peers the proxy's placement
    counts each origin the served table names (1 when it is not judged
    slow), and 1 while it is judged slow (dataplane.placement.speed). Every
    origin is exported, so an alert tells "not slow" from "absent"."""

    SLOWNESS = "ponto_origin_slowness"
    SLOWNESS_DOC = (
        "How many times slower than its group's typical origin this proxy judges the origin "
        "(its time to a stream's first event, or a whole answer's per token): 1 while it is "
        "not judged slow, 8 or more while it is (placement then counts it as fuller, "
        "docs/routing.md 'Slow replicas')"
    )
    SLOW = "ponto_origin_slow"
    SLOW_DOC = "1 while this proxy judges the origin slow and moves requests off it, else 0"

    def __init__(
        self,
        slow: Callable[[], Mapping[str, float]],
        origins: Callable[[], Iterable[str]],
        *,
        registry: CollectorRegistry,
    ) -> None:
        self._slow = slow
        self._origins = origins
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.SLOWNESS, self.SLOWNESS_DOC, labels=["origin"])
        yield GaugeMetricFamily(self.SLOW, self.SLOW_DOC, labels=["origin"])

    def collect(self) -> Iterator[Metric]:
        slowness = GaugeMetricFamily(self.SLOWNESS, self.SLOWNESS_DOC, labels=["origin"])
        judged = GaugeMetricFamily(self.SLOW, self.SLOW_DOC, labels=["origin"])
        slow = self._slow()
        for origin in sorted({*self._origins(), *slow}):
            factor = slow.get(origin, 1.0)
            slowness.add_metric([origin], factor)
            judged.add_metric([origin], 1.0 if origin in slow else 0.0)
        yield slowness
        yield judged


class InFlight(Collector):
    """ponto_requests_in_flight and ponto_streams_open, read at scrape time
    from the requests the error boundary holds (`requests`, by id(): it adds
    each as it arrives and removes it once answered and recorded; the proxy's
    probes and scrapes are left out). `is_stream` says whether a request's
    stream has begun (its head and first chunk went out) and not ended."""

    def __init__(self, *, registry: CollectorRegistry) -> None:
        # By id(): an aiohttp request is a mapping, not hashable.
        self.requests: dict[int, Any] = {}
        self.is_stream: Callable[[Any], bool] = lambda request: False
        registry.register(self)

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "ponto_requests_in_flight",
                "Requests this proxy has received and not answered yet (its own probes "
                "and scrapes left out)",
            ),
            GaugeMetricFamily(
                "ponto_streams_open",
                "Of ponto_requests_in_flight, streams under way (begun, not ended)",
            ),
        )

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        requests, streams = self._families()
        live = list(self.requests.values())
        requests.add_metric([], float(len(live)))
        streams.add_metric([], float(sum(1 for r in live if self.is_stream(r))))
        yield requests
        yield streams


def _le(bound: float) -> str:
    # As prometheus_client spells bucket bounds: 0.001 -> "0.001", 1 -> "1.0".
    spelled: str = floatToGoString(bound)  # type: ignore[no-untyped-call]
    return spelled


def key_label(key: str) -> str:
    """The `key` label of a caller's key id: an API key's id as it is (the
    operator made each one), "-" for none (open mode), and `jwt:TENANT` for
    every JWT caller of a tenant. A token's subject is its issuer's to mint,
    any number of them (trial 67: 1,000 subjects made 1,000 series that
    never left, and as many cells kept in memory): per subject, the access
    log's `key_id` names the caller."""
    if not key:
        return "-"
    if key.startswith("jwt:"):
        end = key.find(":", 4)
        return key if end < 0 else key[:end]
    return key


class Metrics:
    """The proxy's metrics. `key_labels=False` leaves the API key id out of the
    per-tenant series (`ponto_tenant_requests`, `ponto_tenant_tokens`): who can
    scrape them then learns tenant names, not the key ids of their callers."""

    def __init__(self, *, key_labels: bool = True) -> None:
        self.key_labels = key_labels
        # Cells every request touches, by their label values: one dict lookup
        # instead of the family's labels(). Each holds no more entries than
        # its family holds series.
        self._requests_of: dict[tuple[str, ...], CounterCell] = {}
        # The same cells by (tenant, key id, status) as account_request is
        # given them, for key ids that are their own label (not a JWT's
        # subject, key_label): no label to work out on the usual request.
        self._requests_by: dict[tuple[str, str, int], CounterCell] = {}
        self._tokens_of: dict[tuple[str, str, str], tuple[HistogramCell, HistogramCell | None]] = {}
        # (endpoint, status): ponto_requests_total's and the request duration's.
        self._answers_of: dict[tuple[str, int], tuple[CounterCell, HistogramCell]] = {}
        # (operation, model, error_type, region, cache): the GenAI duration's.
        self._durations_of: dict[tuple[str, str, str, str, str], HistogramCell] = {}
        # (tenant, key label) or (tenant,): the tenant's prompt and completion
        # token cells, each made when first moved (a series from its first
        # tokens, as labels() made it).
        self._tokens_for: dict[tuple[str, ...], list[CounterCell | None]] = {}
        by_key = ["key"] if key_labels else []
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # process_* (this process's CPU, memory, open files, start time) and
        # python_info: a worker of a group is a process of its own (module docstring).
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.in_flight = InFlight(registry=r)
        self.requests = Counter(
            "ponto_requests",
            "Requests answered, by endpoint and status code",
            ["endpoint", "code"],
            registry=r,
        )
        # Apart, for ponto_requests_total has only the status: an alert on
        # its 5xx subtracts these (charts/ponto/templates/prometheusrule.yaml).
        self.not_cached = Counter(
            "ponto_requests_not_cached",
            "Requests answered 504 not_cached (Cache-Control: only-if-cached and no entry "
            'answers it), by endpoint: in ponto_requests_total{code="504"} too, but the '
            "client's doing, not a server error (each proxied endpoint is exported from 0, "
            "so rate() sees its first one)",
            ["endpoint"],
            registry=r,
        )
        self.duration = Histogram(
            "ponto_request_duration_seconds",
            "Time from request received to response complete",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_attempts = Counter(
            "ponto_upstream_attempts",
            "Attempts to call an origin, by origin and outcome: ok, connect_error, timeout, "
            "http_5xx, http_429, http_408 (the origin timed out waiting for the request), http_3xx "
            "(a redirect: a wrong base URL), credential_refused, account_refused (402), "
            "credential_error, model_missing (a 404: the origin lacks the model), "
            "bad_answer (a 2xx that is not a JSON object or holds no answer: "
            "no choices, no message), error_answer (a 2xx "
            "that is an error and no answer), too_large (a whole "
            "answer past --max-answer-bytes), cut, cut_after_start, "
            "deadline, hedge_cancelled "
            "(sent, then cancelled because the other copy of a hedged request answered), "
            "origin_busy (never sent: no connection to the origin came free within "
            "--origin-queue-timeout), tenant_share (never sent: the tenant had its share of "
            "the connections, --max-origin-connections-per-tenant), "
            "or cancelled (the client left or the proxy stopped during the call: before the "
            "answer was relayed, or during a stream)",
            ["origin", "outcome"],
            registry=r,
        )
        self.ejections = Counter(
            "ponto_origin_ejections",
            "Times an origin was ejected by passive health checking (each origin the "
            "route table names is exported from 0, so increase() sees its first one)",
            ["origin"],
            registry=r,
        )
        self.model_missing = Counter(
            "ponto_origin_model_missing",
            "Attempts whose origin answered 404 that it lacks the request's model, which "
            "the route table lists it for (a LoRA adapter not loaded, a model not pulled), "
            "by origin and model; failed over, and not counted against the origin's health",
            ["origin", "model"],
            registry=r,
        )
        self.usage_rejected = Counter(
            "ponto_origin_usage_rejected",
            "Answers whose usage the proxy did not believe, by origin and reason: invalid "
            "(a count negative or no integer), past_max_tokens (a completion past the "
            "request's max_tokens x n: clamped to it), past_answer (a completion far past "
            "what the answer holds), past_request (a prompt far past what the request "
            "holds), no_prompt (a prompt of 0 tokens for a request that has one); the "
            "proxy's own count or estimate stood instead (docs/rate-limits.md)",
            ["origin", "reason"],
            registry=r,
        )
        self.commit_time = Histogram(
            "ponto_upstream_time_to_commit_seconds",
            "Origin attempts from the request sent to the answer committed to (a stream's "
            "first chunk, or a whole answer's body), by origin and kind (stream, whole); "
            "successful answers only (below 400: refusals come back at once)",
            ["origin", "kind"],
            buckets=COMMIT_BUCKETS,
            registry=r,
        )
        self.hedges = Counter(
            "ponto_hedges",
            "Hedged requests by outcome: started (a second copy was sent), won (the hedge "
            "answered), lost (the first attempt answered), refused (the hedge budget was "
            "spent). Started minus won and lost: both copies failed, or the request ended first",
            ["outcome"],
            registry=r,
        )
        self.retries_refused = Counter(
            "ponto_retries_refused",
            "Retries not made because the retry budget was spent",
            registry=r,
        )
        self.stream_cuts = Counter(
            "ponto_stream_cuts",
            "Streams whose origin failed after bytes reached the client",
            ["origin"],
            registry=r,
        )
        self.continuations = Counter(
            "ponto_stream_continuations",
            "Streams cut after bytes reached the client: continued on another origin (ok), "
            "a continuation that failed, or not continued (refused: off, limit reached, "
            "a tool call under way, no origin that accepts continuations)",
            ["outcome"],
            registry=r,
        )
        self.limit_refusals = Counter(
            "ponto_ratelimit_refusals",
            "Requests refused by a rate limit, by the limit that refused: requests, tokens, "
            "concurrency, tokens_over_limit (an estimate above the whole per-minute limit), "
            "tokens_per_day or tokens_per_month (budgets)",
            ["limit"],
            registry=r,
        )
        self.slot_waits = Counter(
            "ponto_ratelimit_slot_waits",
            "Requests that waited for a concurrency slot held elsewhere in the fleet "
            "(a proxy just joined, or its slots busy while others' are idle), by how the "
            "wait ended: admitted, refused, or abandoned (the client left, or the proxy "
            "stopped the request as it shut down)",
            ["outcome"],
            registry=r,
        )
        # Exported at 0 from the start, so that rate() sees the first one.
        for limit in ("requests", "tokens", "concurrency", "tokens_over_limit"):
            self.limit_refusals.labels(limit)
        for outcome in ("admitted", "refused", "abandoned"):
            self.slot_waits.labels(outcome)
        # The same two per tenant, for the report to the control plane (its
        # status page), not exported: a tenant label would multiply the
        # series. Tenant -> [refused, slot waits] since it was last limited
        # first; the MAX_LIMITED_TENANTS limited last (see _limited).
        self.limited: dict[str, list[int]] = {}
        # Region -> the settled requests of genai_duration that the proxy
        # refused itself, before calling any origin (`operation`'s `refused`),
        # for the report to take out of what the region served: its errors
        # are what its origins failed, not the clients' bad requests.
        self.refused: dict[str, int] = {}
        # Region -> those that origins answered but that failed for their
        # clients' doing (`operation`'s `excused`): served, no region's error.
        self.excused: dict[str, int] = {}
        self.client_disconnects = Counter(
            "ponto_client_disconnects",
            "Requests whose client went away before the response ended",
            registry=r,
        )
        self.routes = Counter(
            "ponto_route_decisions",
            "Why each answered request's origin was chosen: affinity, prefix, load, "
            "weighted, spill, failover, remote, hedge or pinned (a Responses follow-up, to "
            "the origin that stored its previous response); by the origin that answered",
            ["reason", "origin"],
            registry=r,
        )
        self.loads_age = Gauge(
            "ponto_origin_loads_age_seconds",
            "Age of the origins' live load figures the control plane last pushed "
            "(-1 before the first)",
            registry=r,
        )
        self.table_version = Gauge(
            "ponto_route_table_version", "Version of the route table being served", registry=r
        )
        self.cp_connected = Gauge(
            "ponto_control_plane_connected",
            "1 while the proxy holds a live stream to the control plane",
            registry=r,
        )
        self.table_age = Gauge(
            "ponto_route_table_age_seconds",
            "Seconds since the control plane last sent a table (for the saved table "
            "loaded at start, since it was saved)",
            registry=r,
        )
        self.tenant_requests = Counter(
            "ponto_tenant_requests",
            "Requests by tenant, "
            + ("API key id ('-' in open mode) " if by_key else "")
            + "and status code",
            ["tenant", *by_key, "code"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "ponto_tenant_tokens",
            "Tokens by tenant, "
            + ("API key id " if by_key else "")
            + "and kind (prompt, completion), from the origins' usage or, for streams "
            "without it, counted by the proxy",
            ["tenant", *by_key, "kind"],
            registry=r,
        )
        # A counter of its own, not a label of ponto_tenant_tokens: a label
        # would split every existing series (billing trial 76).
        self.tenant_estimated_tokens = Counter(
            "ponto_tenant_estimated_tokens",
            "Of ponto_tenant_tokens, those of answers whose count is the proxy's "
            "estimate in whole or in part (a stream without usage, a hedge's prompt "
            "without the winner's count, an origin's usage not believed), by tenant, "
            + ("API key id " if by_key else "")
            + "and kind",
            ["tenant", *by_key, "kind"],
            registry=r,
        )
        self.origin_prompt_tokens = Counter(
            "ponto_origin_prompt_tokens",
            "Prompt tokens by origin, of answers whose usage says how many of them the "
            "origin's prefix (KV) cache held (prompt_tokens_details.cached_tokens)",
            ["origin"],
            registry=r,
        )
        self.origin_cached_prompt_tokens = Counter(
            "ponto_origin_cached_prompt_tokens",
            "Prompt tokens by origin that its prefix (KV) cache held, as its usage says: "
            "over ponto_origin_prompt_tokens_total, the prefix-cache hit ratio the "
            "routing gets from it",
            ["origin"],
            registry=r,
        )
        self.cache_requests = Counter(
            "ponto_cache_requests",
            "Cache outcomes: result hit|miss|bypass; kind exact|semantic|coalesced, or the "
            "reason of a bypass, or of a miss (verify, no-usage, tools)",
            ["result", "kind"],
            registry=r,
        )
        # 0 from the start, for rate() and for a hit ratio's alert: a series
        # first seen at its first hit (coalesced ones are rare) reads as absent.
        for result, kind in (("hit", "exact"), ("miss", "exact"), ("hit", "coalesced")):
            self.cache_requests.labels(result, kind)
        self.cache_unkept = Counter(
            "ponto_cache_unkept",
            "200 answers of cacheable requests that were not kept: too_large (over "
            "--cache-max-entry-kb), truncated (finish_reason length, unless the tenant "
            "stores truncated answers), continued (a stream spliced from several origin "
            "calls), incomplete (cut, no [DONE], an error or a shape the cache does not know)",
            ["reason"],
            registry=r,
        )
        for reason in ("too_large", "truncated", "continued", "incomplete"):
            self.cache_unkept.labels(reason)  # 0 from the start, for rate()
        self.cache_hits = Counter(
            "ponto_cache_hits",
            "Cache hits by tier: local (this proxy's memory) or region (the region's Redis, "
            "including answers another proxy of the region fetched for an identical request)",
            ["tier"],
            registry=r,
        )
        # Registered by bind_region only: a proxy without --redis has no regional
        # cache to be up or degraded, and must not look degraded to an alert.
        self.region_up = Gauge(
            "ponto_cache_region_up",
            "1 while the regional cache (Redis) answers; 0 when it is degraded (unreachable, "
            "slow or failing: local cache and origins only). Absent without --redis",
            registry=None,
        )
        self.region_errors = Counter(
            "ponto_cache_region_errors",
            "Regional cache (Redis) calls that failed, timed out, were refused or gave an "
            "answer that did not parse (op decode), by operation",
            ["op"],
            registry=r,
        )
        self.region_requests = Counter(
            "ponto_cache_region_requests",
            "Regional cache (Redis) calls by operation and result: ok, error, timeout, "
            "refused (an error reply from a Redis that is up, e.g. full under noeviction: "
            "a miss or a write dropped), skipped (not tried: the circuit breaker is open, or a "
            "write held back after Redis refused writes: see "
            "ponto_cache_region_writes_skipped_total) or "
            "dropped (a background write not made: too many in flight). Op sem_publish "
            "counts semantic-feed entries, not XADD batches, in every result",
            ["op", "result"],
            registry=r,
        )
        self.region_writes_skipped = Counter(
            "ponto_cache_region_writes_skipped",
            "Regional cache (Redis) writes not tried because Redis refused writes lately "
            "(reason full: maxmemory reached; read-only: a replica): held back a few seconds "
            "at a time, then one write tries again. By operation (set, lock, sem_publish: "
            "entries); lock refreshes and purge claims are never held back",
            ["op", "reason"],
            registry=r,
        )
        self.cache_entries = Gauge("ponto_cache_entries", "Entries in the exact cache", registry=r)
        self.cache_bytes = Gauge(
            "ponto_cache_bytes",
            "Bytes held by the cache, exact entries and the semantic index, against --cache-max-mb",
            registry=r,
        )
        self.cache_evictions = ReadCounter(
            "ponto_cache_evictions", "Entries evicted to stay under the memory bound", registry=r
        )
        self.cache_expired = ReadCounter(
            "ponto_cache_expired", "Entries dropped because their TTL passed", registry=r
        )
        self.cache_purged = ReadCounter(
            "ponto_cache_purged", "Entries dropped by purges", registry=r
        )
        self.table_nacks = ReadCounter(
            "ponto_route_table_nacks", "Tables refused since start", registry=r
        )
        # Set by bind_fleet: what the guard of dataplane.sync.holder refused.
        self._fleet_refused: Callable[[], Mapping[str, float]] = dict
        self._fleet_id: Callable[[], str] = str
        ReadCounters(
            "ponto_route_table_refused",
            "Tables refused as another fleet's (reason another_fleet: the control plane's "
            "etcd lost its state, or is not this fleet's) or as opening a proxy whose "
            "table requires a key (would_open); page on any",
            "reason",
            lambda: self._fleet_refused(),  # noqa: PLW0108 - bound later, by bind_fleet
            registry=r,
        )
        FleetInfo(lambda: self._fleet_id(), registry=r)  # noqa: PLW0108 - as above
        self._fleet_refusing: Callable[[], str] = str
        Refusing(lambda: self._fleet_refusing(), registry=r)  # noqa: PLW0108 - as above
        # Set by bind_speeds: the origins the proxy judges slow, of the table's.
        self._slow: Callable[[], Mapping[str, float]] = dict
        self._slow_among: Callable[[], Iterable[str]] = tuple
        OriginSlowness(
            lambda: self._slow(),  # noqa: PLW0108 - bound later, by bind_speeds
            lambda: self._slow_among(),  # noqa: PLW0108 - as above
            registry=r,
        )
        self.access_log_dropped = ReadCounter(
            "ponto_access_log_dropped",
            "Access-log lines dropped because standard output did not take them",
            registry=r,
        )
        self.genai_duration = Histogram(
            "gen_ai_client_operation_duration_seconds",
            "GenAI operation duration (OpenTelemetry gen_ai.client.operation.duration), "
            "from request received to answer complete; error_type is empty when it succeeded",
            ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model",
             "error_type", "ponto_region", "ponto_cache"],
            buckets=GENAI_DURATION_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.genai_tokens = Histogram(
            "gen_ai_client_token_usage",
            "Tokens per operation answered by an origin (OpenTelemetry "
            "gen_ai.client.token.usage), by gen_ai_token_type input or output",
            ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model",
             "gen_ai_token_type", "ponto_region"],
            buckets=GENAI_TOKEN_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.genai_first_chunk = Histogram(
            "gen_ai_client_operation_time_to_first_chunk_seconds",
            "Time from request received to the first chunk of a stream sent to the client "
            "(OpenTelemetry gen_ai.client.operation.time_to_first_chunk)",
            [
                "gen_ai_operation_name",
                "gen_ai_provider_name",
                "gen_ai_request_model",
                "ponto_region",
                "ponto_cache",
            ],
            buckets=GENAI_FIRST_CHUNK_BUCKETS,
            registry=r,
        )
        # Once named gen_ai_client_operation_time_per_output_chunk_seconds, which
        # the conventions define as one value per chunk (each gap): a mean per
        # stream under that name hid a 20 s stall among 1,000 chunks as 20 ms
        # (review finding). Per-chunk gaps would cost the relay a clock read
        # and an observation per chunk; the mean is what it counts anyway.
        self.genai_chunk_gap = Histogram(
            "ponto_stream_mean_chunk_interval_seconds",
            "Per stream an origin answered in full, the mean time between the output "
            "chunks after the first: from the first chunk sent to the stream's end, over "
            "its text chunks less one; streams of fewer than two text chunks are left "
            "out. One value per stream, a mean: a stall within a stream is spread over "
            "its chunks (not OpenTelemetry's per-chunk time_per_output_chunk)",
            [
                "gen_ai_operation_name",
                "gen_ai_provider_name",
                "gen_ai_request_model",
                "ponto_region",
                "ponto_cache",
            ],
            buckets=GENAI_CHUNK_GAP_BUCKETS,
            registry=r,
        )
        self.info = Gauge(
            "ponto_proxy_info",
            "1, labelled with the proxy's name, region and software version",
            ["proxy", "region", "version"],
            registry=r,
        )

    def attempt(self, origin: str, outcome: str) -> CounterCell:
        """The ponto_upstream_attempts counter of one origin and outcome."""
        return self.upstream_attempts.labels(origin, outcome)

    def stream_cut(self, origin: str) -> None:
        """An origin's stream broke after the client had bytes."""
        self.stream_cuts.labels(origin).inc()
        self.attempt(origin, "cut_after_start").inc()

    def _who(self, tenant: str, key: str) -> tuple[str, ...]:
        return (tenant, key_label(key)) if self.key_labels else (tenant,)

    def limit_refusal(self, tenant: str, limit: str) -> None:
        """A request of `tenant` refused by a rate limit (`limit`: the label)."""
        self.limit_refusals.labels(limit).inc()
        self._limited(tenant)[0] += 1

    def slot_wait(self, tenant: str, outcome: str) -> None:
        """A request of `tenant` that waited for a concurrency slot, and how
        the wait ended (admitted, refused, abandoned)."""
        self.slot_waits.labels(outcome).inc()
        self._limited(tenant)[1] += 1

    def _limited(self, tenant: str) -> list[int]:
        """`tenant`'s counts, now the last limited. Past MAX_LIMITED_TENANTS
        the one limited longest ago is forgotten: every report carries them
        all, into one etcd value per replica; one forgotten and limited again
        starts from 0, which the control plane reads as a counter that
        started over."""
        limited = self.limited
        counts = limited.pop(tenant, None)
        if counts is None:
            counts = [0, 0]
            if len(limited) >= MAX_LIMITED_TENANTS:
                del limited[next(iter(limited))]
        limited[tenant] = counts
        return counts

    def forget_callers(self, tenants: Collection[str], keys: Collection[str]) -> None:
        """Drop the per-tenant series of the tenants not in `tenants` and, with
        key labels, those of the API keys not in `keys` (the route table's,
        after each table: a revoked key is not in it), with the cells kept for
        them: a deleted tenant's requests and tokens were exported until the
        proxy restarted (trial 68), and so were a revoked key's (trial 82:
        three series or more per key ever used, per process, for good; a
        fleet that rotates keys grew without bound). The open fleet's tenant,
        open mode's "-" and a tenant's `jwt:TENANT` are never ones to drop."""

        def caller_kept(tenant: str, key: str) -> bool:
            if tenant not in tenants and tenant != OPEN_TENANT:
                return False
            return key in ("", "-") or key.startswith("jwt:") or key in keys

        def kept(values: tuple[str, ...]) -> bool:
            return caller_kept(values[0], values[1] if self.key_labels else "")

        for values in self.tenant_requests.forget(kept):
            self._requests_of.pop(values, None)
        self._requests_by = {
            k: cell for k, cell in self._requests_by.items() if caller_kept(k[0], k[1])
        }
        for values in self.tenant_tokens.forget(kept):
            self._tokens_for.pop(values[:-1], None)  # less the token type
        self.tenant_estimated_tokens.forget(kept)

    def answered(self, endpoint: str, status: int, seconds: float) -> None:
        """An answer of `status` to a request of `endpoint` that took `seconds`:
        ponto_requests_total and ponto_request_duration_seconds (the error
        boundary, once a request). Their cells are kept by what it is given,
        and the observation made in place: callgrind on a loop, 5,300
        instructions a request through Counter.add and Histogram.observe_at
        (with str(status)), 3,200 so."""
        given = (endpoint, status)
        try:  # a subscript, as Counter.add's
            cells = self._answers_of[given]
        except KeyError:
            cells = self._answers_of[given] = (
                self.requests.labels(endpoint, str(status)),
                self.duration.labels(endpoint),
            )
        cells[0].value += 1.0
        cell = cells[1]
        cell.counts[bisect.bisect_left(cell._bounds, seconds)] += 1  # HistogramCell.observe's
        cell.sum += seconds

    def account_request(self, tenant: str, key: str, status: int) -> None:
        # Once a request: its cell by what it is given first (callgrind on a
        # loop: 4,350 instructions a call by its labels, 1,900 so), by its
        # labels for a JWT caller, whose subjects are without bound.
        given = (tenant, key, status)
        cell = self._requests_by.get(given)
        if cell is None:
            code = str(status)
            found = (tenant, key_label(key), code) if self.key_labels else (tenant, code)
            cell = self._requests_of.get(found)
            if cell is None:
                cell = self._requests_of[found] = self.tenant_requests.labels(*found)
            if not key.startswith("jwt:"):
                self._requests_by[given] = cell
        cell.value += 1.0

    def account_tokens(self, tenant: str, key: str, usage: Usage) -> None:
        # The cells kept by their labels, and their values moved here, not
        # through labels(*who, type).inc(): once a request with a usage
        # (callgrind on a loop: 9,830 instructions a call before, 4,300 now).
        who = (tenant, key_label(key)) if self.key_labels else (tenant,)
        try:  # a subscript, as Counter.add's
            cells = self._tokens_for[who]
        except KeyError:
            cells = self._tokens_for[who] = [None, None]
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
        if prompt:
            cell = cells[0]
            if cell is None:
                cell = cells[0] = self.tenant_tokens.labels(*who, "prompt")
            cell.value += prompt
        if completion:
            cell = cells[1]
            if cell is None:
                cell = cells[1] = self.tenant_tokens.labels(*who, "completion")
            cell.value += completion
        if not usage.exact and usage.total:
            # Rare (origins mostly count): through labels(), not cells kept.
            if prompt:
                self.tenant_estimated_tokens.labels(*who, "prompt").inc(prompt)
            if completion:
                self.tenant_estimated_tokens.labels(*who, "completion").inc(completion)

    def account_prefix_cache(self, origin: str, usage: Usage) -> None:
        """Count an answer's prompt tokens at `origin`, and those its prefix
        cache held (`usage.cached_tokens`, which the caller has checked)."""
        assert usage.cached_tokens is not None
        self.origin_prompt_tokens.labels(origin).inc(usage.prompt_tokens)
        if usage.cached_tokens:
            self.origin_cached_prompt_tokens.labels(origin).inc(usage.cached_tokens)

    def operation(
        self,
        operation: str,
        model: str,
        error_type: str,
        region: str,
        cache: str,
        duration_s: float,
        first_chunk_s: float | None,
        usage: Usage | None,
        chunk_gap_s: float | None = None,
        *,
        refused: bool = False,
        excused: bool = False,
    ) -> None:
        """Record one settled request in the GenAI metrics: its duration, the time
        to its first streamed chunk (streams only), the mean time between its
        output chunks after the first (`chunk_gap_s`: once per stream, not per
        chunk; None when there is none to give), and the input and output
        tokens an origin reported or the proxy counted (`usage`; None for answers
        no origin produced, such as cache hits and refusals). Embeddings and
        rerank have input tokens only (the conventions' gen_ai.client.token.usage).
        `refused`: the proxy refused it itself, no origin called (counted in
        `self.refused` too, by region). `excused`: origins were called and
        it failed for its client's doing (counted in `self.excused`, by
        region: served, but none of its region's errors)."""
        if refused:
            self.refused[region] = self.refused.get(region, 0) + 1
        elif excused:
            self.excused[region] = self.excused.get(region, 0) + 1
        provider = GENAI_PROVIDER
        # The cells by their label values, and HistogramCell.observe's steps
        # inline, not Histogram.observe_at's call with its six label values
        # and two calls of observe: this runs once a request (callgrind on a
        # loop of operation: 11,300 instructions a call before, 10,100 now).
        found = (operation, model, error_type, region, cache)
        try:  # a subscript, as Counter.add's
            cell = self._durations_of[found]
        except KeyError:
            cell = self._durations_of[found] = self.genai_duration.labels(
                operation, provider, model, error_type, region, cache
            )
        cell.counts[bisect.bisect_left(cell._bounds, duration_s)] += 1
        cell.sum += duration_s
        if first_chunk_s is not None:
            self.genai_first_chunk.labels(operation, provider, model, region, cache).observe(
                first_chunk_s
            )
        if chunk_gap_s is not None:
            self.genai_chunk_gap.labels(operation, provider, model, region, cache).observe(
                chunk_gap_s
            )
        if usage is not None:
            try:
                cells = self._tokens_of[(operation, model, region)]
            except KeyError:
                tokens = self.genai_tokens
                cells = self._tokens_of[(operation, model, region)] = (
                    tokens.labels(operation, provider, model, "input", region),
                    None
                    if operation in INPUT_ONLY
                    else tokens.labels(operation, provider, model, "output", region),
                )
            prompt, cell = usage.prompt_tokens, cells[0]
            cell.counts[bisect.bisect_left(cell._bounds, prompt)] += 1
            cell.sum += prompt
            output = cells[1]
            if output is not None:
                completion = usage.completion_tokens
                output.counts[bisect.bisect_left(output._bounds, completion)] += 1
                output.sum += completion

    def origins_named(self, origins: Iterable[str]) -> None:
        """The origins a table names (each apply): their ejection and stream
        cut counters are exported from 0, so that increase() in
        PontoOriginFailing sees the first ejection, and rate() in
        PontoOriginCuttingStreams the first cuts (a series born at 1 has no
        increase). Origins a later
        table drops keep their series, as their other per-origin series do
        (ponto_upstream_attempts_total, ...): a series that vanished and came
        back would read as a counter reset."""
        for origin in origins:
            self.ejections.labels(origin)
            self.stream_cuts.labels(origin)

    def endpoints_proxied(self, endpoints: Iterable[str]) -> None:
        """The proxied endpoints (at startup): their ponto_requests_not_cached
        counters are exported from 0. Born at 1, a series has no rate() for
        its first answer while ponto_requests_total{code="504"}, older, counts
        it: the alerts that take the one from the other saw each pod's first
        not_cached answer as a server error (review finding)."""
        for endpoint in endpoints:
            self.not_cached.labels(endpoint)

    def bind_tracing(
        self, failed_exports: Callable[[], float], spans: Callable[[], Mapping[str, float]]
    ) -> None:
        """Export the tracing exporters' failed batches and the spans lost, by
        reason (dataplane.telemetry.tracing.ExportStats), for a proxy that
        traces. `spans` gives every reason each time, 0 or not."""
        ReadCounter(
            "ponto_trace_export_failures",
            "Span batches a tracing exporter failed to export (collector down or refusing, "
            "after the exporter's own retries)",
            registry=self.registry,
        ).read = failed_exports
        ReadCounters(
            "ponto_trace_spans_dropped",
            "Spans lost on their way to the collector, by reason: queue_full (dropped "
            "by the batch processor, its queue full: spans end faster than they are "
            "exported), export_failed (in ponto_trace_export_failures_total's batches)",
            "reason",
            spans,
            registry=self.registry,
        )

    def set_info(self, proxy: str, region: str, version: str) -> None:
        """ponto_proxy_info{proxy, region, version} = 1 (one series: the last set)."""
        self.info.clear()
        self.info.labels(proxy, region, version).set(1)

    def bind_auth(self, problems: Callable[[], Mapping[str, str]]) -> None:
        """Export ponto_jwt_config_unavailable{tenant} = 1 for each tenant whose
        JWT config the served table names but this proxy could not load
        (`problems`: tenant -> why; read at scrape time)."""
        TenantsUnavailable(problems, registry=self.registry)

    def bind_jwks(self, sets: Iterable[RemoteKeys]) -> None:
        """Export the JWKS URLs' fetches and sets (JwksSets) from `sets`, the
        proxy's KeySets (iterated at scrape time)."""
        JwksSets(lambda: sets, time.time, registry=self.registry)

    def bind_transcripts(self, held: Callable[[], int], dropped: Mapping[str, int]) -> None:
        """Export what streams' transcripts hold (`held`, read at scrape time)
        and the transcripts each bound stopped (`dropped`, by bound: a
        TranscriptBudget's)."""
        Gauge(
            "ponto_stream_transcript_bytes",
            "Bytes of relayed events held to continue cut streams, against "
            "--max-transcripts-mb (this process)",
            registry=self.registry,
        ).set_function(lambda: float(held()))
        ReadCounters(
            "ponto_stream_transcripts_dropped",
            "Streams whose transcript was dropped, so that they are not continued if cut: "
            "stream (its events passed 4 MiB) or proxy (all streams' held "
            "--max-transcripts-mb)",
            "bound",
            lambda: dropped,
            registry=self.registry,
        )

    def bind_region(self, available: Callable[[], bool]) -> None:
        """Export ponto_cache_region_up from `available` (a proxy with --redis)."""
        self.region_up.set_function(lambda: 1.0 if available() else 0.0)
        self.registry.register(self.region_up)

    def bind_cache(self, stats: Callable[[], Any], more_bytes: Callable[[], int] = int) -> None:
        """Read the cache store's counters at scrape time; `more_bytes` is what the
        rest of the cache holds against the same bound (the semantic index)."""
        self.cache_entries.set_function(lambda: float(stats().entries))
        self.cache_bytes.set_function(lambda: float(stats().bytes + more_bytes()))
        self.cache_evictions.read = lambda: float(stats().evictions)
        self.cache_expired.read = lambda: float(stats().expired)
        self.cache_purged.read = lambda: float(stats().purged)

    def bind_semantic(self, index: Callable[[], Any]) -> None:
        """Semantic index counters (NAME_total), once the index is loaded (0 before).

        A new index (the model loaded again) starts its counts at 0: Prometheus
        reads that drop as a counter reset."""
        r = self.registry

        def stat(name: str) -> Callable[[], float]:
            def read() -> float:
                current = index()
                return float(getattr(current.stats, name)) if current is not None else 0.0

            return read

        for name, doc in (
            ("lookups", "Semantic lookups"),
            ("hits", "Semantic lookups that found a close enough earlier question"),
            (
                "entity_blocked",
                "Close neighbours refused because numbers or names differed"
                " or the question read the opposite way",
            ),
            ("busy", "Lookups skipped because the embedder was busy"),
            ("verifies", "Would-be hits sent to the origin to check them (error-bounded tenants)"),
            ("checks", "Origin answers compared with a close neighbour's cached answer"),
            ("checks_skipped", "Answer comparisons dropped because lookups were queued"),
            ("wrong_checks", "Compared answers that differed: a hit would have been wrong"),
        ):
            ReadCounter(f"ponto_semantic_{name}", doc, registry=r).read = stat(name)
        Gauge("ponto_semantic_entries", "Entries in the semantic index", registry=r).set_function(
            lambda: float(len(current)) if (current := index()) is not None else 0.0
        )
        Gauge(
            "ponto_semantic_bytes",
            "Bytes held by the semantic index (vectors, graphs, entries), part of "
            "ponto_cache_bytes",
            registry=r,
        ).set_function(lambda: float(current.nbytes) if (current := index()) is not None else 0.0)

    def bind_semantic_feed(self, feed: Callable[[], Any]) -> None:
        """The region's semantic feed counters (NAME_total; 0 without a feed)."""
        r = self.registry

        def stat(*names: str) -> Callable[[], float]:
            def read() -> float:
                current = feed()
                if current is None:
                    return 0.0
                return float(sum(getattr(current.stats, name) for name in names))

            return read

        for name, names, doc in (
            ("published", ("published",), "Semantic entries published to the region"),
            (
                "dropped",
                ("dropped",),
                "Semantic entries not published (queue full, Redis down or failing)",
            ),
            ("applied", ("applied",), "Entries of other proxies added to the semantic index"),
            (
                "skipped",
                ("own", "foreign", "purged", "refused"),
                "Feed messages not added: this proxy's, another embedder's, purged since, "
                "or a key held already",
            ),
            ("malformed", ("malformed",), "Feed messages that did not parse"),
            ("read_errors", ("errors",), "Failed reads of the region's semantic stream"),
            (
                "internal_errors",
                ("internal_errors",),
                "Feed batches (read or published) whose handling failed on a bug in the "
                "proxy, logged with a traceback",
            ),
        ):
            ReadCounter(f"ponto_semantic_feed_{name}", doc, registry=r).read = stat(*names)

    def bind_fleet(
        self,
        refused: Callable[[], Mapping[str, float]],
        fleet_id: Callable[[], str],
        refusing: Callable[[], str] = str,
    ) -> None:
        """The holder's refusals by reason, the fleet id it serves, and the
        reason it refused the latest table pushed for ("" once it took one)."""
        self._fleet_refused = refused
        self._fleet_id = fleet_id
        self._fleet_refusing = refusing

    def bind_speeds(
        self, slow: Callable[[], Mapping[str, float]], origins: Callable[[], Iterable[str]]
    ) -> None:
        """The origins judged slow (`slow`: origin -> factor, those only)
        among those the served table names (`origins`)."""
        self._slow = slow
        self._slow_among = origins

    def bind(
        self,
        version: Callable[[], float],
        connected: Callable[[], float],
        last_heard: Callable[[], float],
        nacks: Callable[[], float],
        loads_age: Callable[[], float] = lambda: float("inf"),
    ) -> None:
        """Read state at scrape time instead of updating gauges on the hot path."""
        self.loads_age.set_function(lambda: -1.0 if math.isinf(age := loads_age()) else age)
        self.table_version.set_function(version)
        self.cp_connected.set_function(connected)
        self.table_age.set_function(
            lambda: max(0.0, time.time() - last_heard()) if last_heard() else -1.0
        )
        self.table_nacks.read = nacks
