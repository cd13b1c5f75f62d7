"""The tracer and the spans of one proxied request (OpenTelemetry SDK).

Imported only when tracing is on (dataplane.telemetry.config decides). Spans
follow OpenTelemetry's GenAI semantic conventions (gen_ai.*), the HTTP ones
for status and errors, and add Ponto's own (ponto.*):

    {op} {model}          SERVER, the request from arrival to its last byte
      ponto.auth          INTERNAL
      ponto.limits        INTERNAL, admission under the caller's limits
      ponto.cache.lookup  INTERNAL, with the cache's outcome
      {op} {model}        CLIENT, one per origin call (first try, failover,
                          hedge, stream continuation), with its outcome

Parents are passed explicitly, never through the current context: a hedge
runs in its own task, and nothing here depends on which task is current.
A client's W3C `traceparent` (and `tracestate`) makes the request span its
child; each origin call carries a `traceparent` naming its own span (in a
request the sampler dropped, which makes no spans, the request's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import TracebackType
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import (
    INVALID_SPAN,
    NonRecordingSpan,
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from yarl import URL

from dataplane import jsonio
from dataplane.http.errors import NOT_SERVER_ERRORS
from dataplane.metrics import GENAI_OPERATIONS, GENAI_PROVIDER, INPUT_ONLY
from dataplane.streaming.usage import rerank_usage_of, usage_of
from dataplane.telemetry.config import TraceConfig, drops_roots
from ponto.logs import Every

if TYPE_CHECKING:
    from dataplane.cache.entry import CachedResponse
    from dataplane.http.pipeline import Exchange
    from dataplane.routes import Target
    from dataplane.upstream.forwarder import OriginAnswer

__all__ = [
    "AttemptSpan",
    "CountingBatchProcessor",
    "CountingExporter",
    "ExportLogThrottle",
    "ExportStats",
    "RequestTrace",
    "RequestTracer",
    "Tracing",
    "resource",
    "start",
]

DEFAULT_SERVICE_NAME = "ponto-proxy"
SCOPE = "ponto.dataplane"

PROVIDER = GENAI_PROVIDER
# Request fields recorded when present, and their attribute, once the request
# has been validated (never a refused body's). The first of max_tokens,
# max_completion_tokens and max_output_tokens present is the limit.
_REQUEST_FIELDS = (
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("seed", "gen_ai.request.seed"),
    ("n", "gen_ai.request.choice.count"),
    ("stream", "gen_ai.request.stream"),
)
_DOUBLES = frozenset(("gen_ai.request.temperature", "gen_ai.request.top_p"))
_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# OTLP carries integers as int64: a JSON integer past it is clamped.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The first "model" member of a JSON answer or stream chunk. A "model" inside a
# string value has escaped quotes and cannot match.
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
# Likewise its first "id" member: an answer's (or chunk's) own id comes first.
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_PROPAGATOR = TraceContextTextMapPropagator()
# The loggers the SDK's export path writes to: its batch processor's and the
# OTLP exporters'. With the collector down they write a line per retry and per
# failed batch (trial: 12 lines in 45 s), each their own: ExportLogThrottle.
EXPORT_LOGGERS = (
    "opentelemetry.sdk._shared_internal",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._internal",
)
EXPORT_LOG_EVERY_S = 60.0


class ExportStats:
    """Spans lost on their way to the collector, read at scrape time on the
    loop (ponto_trace_export_failures_total, ponto_trace_spans_dropped_total):
    failed exports and their spans, counted by CountingExporter in the
    exporters' threads, and spans the batch processors dropped from a full
    queue (CountingBatchProcessor, in whichever thread ended the span). The
    counters add under `lock`; a scrape reads ints, each atomic."""

    __slots__ = ("batches", "lock", "queue_full", "spans")

    def __init__(self) -> None:
        self.batches = 0
        self.spans = 0  # of the failed batches
        self.queue_full = 0
        self.lock = threading.Lock()

    def failed_batches(self) -> float:
        return float(self.batches)

    def dropped_spans(self) -> dict[str, float]:
        """Spans lost, by reason: `queue_full` (dropped by a batch processor,
        never exported) and `export_failed` (in a failed export)."""
        return {"queue_full": float(self.queue_full), "export_failed": float(self.spans)}


class CountingExporter(SpanExporter):
    """`inner`, with the batches it fails to export (a FAILURE result, or an
    exception, which the batch processor would log and forget) and their
    spans counted in `stats`. The SDK's own counts of dropped spans are
    metrics of an OpenTelemetry meter, which a proxy does not run; spans the
    batch processor drops from a full queue never reach an exporter:
    CountingBatchProcessor counts those."""

    def __init__(self, inner: SpanExporter, stats: ExportStats) -> None:
        self.inner = inner
        self._stats = stats

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:
            self._failed(len(spans))
            raise
        if result is not SpanExportResult.SUCCESS:
            self._failed(len(spans))
        return result

    def _failed(self, spans: int) -> None:
        stats = self._stats
        with stats.lock:
            stats.batches += 1
            stats.spans += spans

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class CountingBatchProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor whose spans dropped from a full queue are counted
    in `stats.queue_full`: under load, with the collector slow or down, the
    most common loss, which the SDK only logs (once a minute through
    ExportLogThrottle) and counts in a meter a proxy does not run (review
    finding: ponto_trace_spans_dropped_total counted failed exports only).

    The count comes from the SDK's own drop report (its batch processor's
    `drop_items`, called as it drops; OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED
    or not), taken over here: a private hook of opentelemetry-sdk (1.45),
    which tests/unit/test_tracing_setup.py checks against a real queue. A
    version without it counts no queue drops rather than failing."""

    def __init__(self, exporter: SpanExporter, stats: ExportStats) -> None:
        super().__init__(exporter)
        batches = getattr(self, "_batch_processor", None)
        inner = getattr(batches, "_metrics", None)
        if inner is not None:
            batches._metrics = _QueueDrops(inner, stats)  # type: ignore[union-attr]


class _QueueDrops:
    """The SDK's processor metrics (`inner`), with the items it drops from a
    full queue also counted in `stats` (CountingBatchProcessor)."""

    def __init__(self, inner: Any, stats: ExportStats) -> None:
        self._inner = inner
        self._stats = stats

    def register_queue_size(self, get_queue_size: Callable[[], int]) -> None:
        self._inner.register_queue_size(get_queue_size)

    def __getattr__(self, name: str) -> Any:
        # Whatever else a later SDK asks of its metrics goes to them as it
        # did: this runs where spans end, on requests' paths (review).
        return getattr(self._inner, name)

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        # The other reason the SDK gives, "already_shutdown", is the proxy's
        # own stop: spans ended after the provider's shutdown.
        if error_type == "queue_full" and isinstance(count, int):
            with self._stats.lock:
                self._stats.queue_full += count
        self._inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        self._inner.finish_items(count)


class ExportLogThrottle(logging.Filter):
    """A filter for the SDK's export loggers (EXPORT_LOGGERS, all of them
    sharing one): at most one line per `every_s` among them, the next line
    written saying how many were not: the rate of ponto.logs.Throttled
    (ponto.logs.Every), for lines the SDK writes. Thread-safe: the
    exporters log from their threads, shutdown from the loop's. Lines at
    ERROR count the same: a collector that stays down has nothing new to
    say; ponto_trace_export_failures_total counts."""

    def __init__(
        self, every_s: float = EXPORT_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._every = Every(every_s, clock)
        self._lock = threading.Lock()

    @property
    def unlogged(self) -> int:
        """Lines not written since the last one."""
        return self._every.unlogged

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            unlogged = self._every.due()
        if unlogged is None:
            return False
        if unlogged:
            record.msg = f"{record.msg} ({unlogged} more tracing export lines not logged)"
        return True

    def attach(self, names: Sequence[str] = EXPORT_LOGGERS) -> Callable[[], None]:
        """Filter the loggers `names`; returns what takes the filter off them."""
        loggers = [logging.getLogger(name) for name in names]
        for logger in loggers:
            logger.addFilter(self)

        def detach() -> None:
            for logger in loggers:
                logger.removeFilter(self)

        return detach


def start(config: TraceConfig, *, proxy: str, region: str, version: str) -> Tracing:
    """A provider exporting through a BatchSpanProcessor to the exporters
    `config` names; the SDK reads the OTEL_* variables for the rest (endpoint,
    headers, sampler, batch sizes, resource). Each exporter's failures are
    counted (CountingExporter), and its spans dropped from a full queue
    (CountingBatchProcessor), and the export path's log lines throttled
    (ExportLogThrottle). Call `Tracing.shutdown` at stop."""
    processors: list[SpanProcessor] = []
    stats = ExportStats()
    for name in config.exporters:
        exporter: SpanExporter
        if name == "console":
            # Standard error: standard output is the access log's
            # (dataplane.http.accesslog), one JSON object per line. One line
            # per span too: the SDK's default indents each over some 40.
            exporter = ConsoleSpanExporter(out=sys.stderr, formatter=_one_line)
        elif config.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter as GrpcExporter,
            )

            exporter = GrpcExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter as HttpExporter,
            )

            exporter = HttpExporter()
        processors.append(CountingBatchProcessor(CountingExporter(exporter, stats), stats))
    tracing = Tracing(resource(proxy=proxy, region=region, version=version), processors, region)
    tracing.tracer.exports = stats
    tracing.quiet_exports = ExportLogThrottle().attach()
    return tracing


def resource(*, proxy: str, region: str, version: str) -> Resource:
    """The proxy's resource: OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME as
    the SDK reads them (the service name defaults to ponto-proxy), plus the
    proxy's name (a worker's own, e.g. p1-w0) and region, which the proxy knows
    better than the environment."""
    res = Resource.create(
        {
            "ponto.proxy": proxy,
            "ponto.region": region,
            "service.instance.id": proxy,
            "service.version": version,
        }
    )
    if str(res.attributes.get("service.name", "")).startswith("unknown_service"):
        res = res.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    return res


class Tracing:
    """The process's tracer provider and the request tracer on it. Owned by the
    proxy's entry point (one per process, hence per worker)."""

    def __init__(self, resource: Resource, processors: list[SpanProcessor], region: str) -> None:
        # sampler=None: the SDK builds it from OTEL_TRACES_SAMPLER(_ARG), and
        # the request tracer reads the same variables to skip it for roots.
        self.provider = TracerProvider(resource=resource)
        for processor in processors:
            self.provider.add_span_processor(processor)
        self.tracer = RequestTracer(
            self.provider.get_tracer(SCOPE), region, drops_roots=drops_roots(os.environ)
        )
        # Takes `start`'s log throttle off the SDK's loggers at shutdown.
        self.quiet_exports: Callable[[], None] = lambda: None

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporters. Blocks (network)."""
        try:
            self.provider.shutdown()
        finally:
            self.quiet_exports()


class RequestTracer:
    """Starts one RequestTrace per proxied request. Safe on one event loop."""

    def __init__(self, tracer: Tracer, region: str, *, drops_roots: bool = False) -> None:
        self._tracer = tracer
        self.region = region  # the proxy's own
        # The sampler drops every request without a parent (see unsampled_root).
        self.drops_roots = drops_roots
        # The exporters' failures (set by `start`; none counted without it).
        self.exports = ExportStats()

    def unsampled_root(self, headers: Mapping[str, str]) -> str | None:
        """The `traceparent` for the origin calls of a request the sampler is
        known to drop without asking it: one with no `traceparent` of its own,
        under a sampler that drops every root. A new trace, not sampled, so
        the origin need not record either, as the SDK would have said; no
        span, no SDK call. None: the request may be sampled; `begin` it."""
        if not self.drops_roots or "traceparent" in headers:
            return None
        ids = os.urandom(24).hex()
        return f"00-{ids[:32]}-{ids[32:]}-00"

    def begin(
        self,
        endpoint: str,
        method: str,
        route: str,
        headers: Mapping[str, str],
        request_id: str,
    ) -> RequestTrace:
        """The SERVER span of a request to `endpoint`, a child of the client's
        `traceparent` when it sent a valid one. Named by the HTTP route until
        the model is known."""
        parent = _PROPAGATOR.extract(headers)
        op = GENAI_OPERATIONS[endpoint]
        span = self._tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": op,
                "gen_ai.provider.name": PROVIDER,
                "http.request.method": method,
                "http.route": route,
                "ponto.request_id": request_id,
            },
        )
        return RequestTrace(self._tracer, span, op, self.region)


class RequestTrace:
    """One request's spans. Owned by the request's task; its origin calls
    (hedges in their own tasks) add attempt spans on the same event loop."""

    __slots__ = (
        "_ctx",
        "_open",
        "_tracer",
        "model",
        "op",
        "origin",
        "recording",
        "region",
        "root",
    )

    def __init__(self, tracer: Tracer, root: Span, op: str, region: str) -> None:
        self._tracer = tracer
        self.root = root
        # A request the sampler dropped makes no child spans: they would be
        # dropped too (parent-based sampling), at the cost of making them.
        self.recording = root.is_recording()
        self._ctx: Context = set_span_in_context(root)
        self.op = op
        self.region = region
        self.model = ""
        self.origin: OriginSeen | None = None
        self._open: dict[str, AttemptSpan] = {}  # by origin name, until they end

    @property
    def name(self) -> str:
        return f"{self.op} {self.model}" if self.model else self.op

    def ids(self) -> tuple[str, str]:
        """The request span's trace id and span id, in hex as `traceparent`
        spells them (the access log's trace_id and span_id). A request the
        sampler dropped has them too: its origin calls carried them."""
        ctx = self.root.get_span_context()
        return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")

    def step(self, name: str) -> Step:
        """An INTERNAL child span around a pipeline step (a context manager)."""
        if not self.recording:
            return Step(INVALID_SPAN)
        return Step(self._tracer.start_span(name, context=self._ctx, kind=SpanKind.INTERNAL))

    def cache_step(self, ex: Exchange) -> CacheStep:
        """The cache lookup's span; it records the cache's outcome when it ends.
        The model is known by then: the request span takes its GenAI name."""
        self.model = ex.model
        if not self.recording:
            return CacheStep(INVALID_SPAN, ex)
        self.root.update_name(self.name)
        span = self._tracer.start_span(
            "ponto.cache.lookup", context=self._ctx, kind=SpanKind.INTERNAL
        )
        return CacheStep(span, ex)

    def attempt(self, target: Target, number: int) -> AttemptSpan:
        """A CLIENT span for one call to `target` (the `number`th of the request).

        In a request the sampler dropped, no span: the call carries the
        request span's own (unsampled) context, which is all an origin can use."""
        if not self.recording:
            return AttemptSpan(self, NonRecordingSpan(self.root.get_span_context()), target.name)
        host, port = _server(target.base_url)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": self.op,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": self.model,
            "ponto.origin": target.name,
            "ponto.region": target.region,
            "ponto.attempt": number,
        }
        if host is not None:
            attributes["server.address"] = host
        if port is not None:
            attributes["server.port"] = port
        span = self._tracer.start_span(
            self.name, context=self._ctx, kind=SpanKind.CLIENT, attributes=attributes
        )
        attempt = self._open[target.name] = AttemptSpan(self, span, target.name)
        return attempt

    def hedge_lost(self, target: Target) -> None:
        """The call to `target` is about to be cancelled: another one answered first."""
        attempt = self._open.get(target.name)
        if attempt is not None:
            attempt.outcome = "hedge_cancelled"

    def ended(self, attempt: AttemptSpan) -> None:
        """`attempt` has ended: no later hedge_lost applies to it."""
        if self._open.get(attempt.name) is attempt:
            del self._open[attempt.name]

    def answered(self, origin: OriginAnswer) -> None:
        """The origin that answers (after failover or hedging), and the model
        its answer names (recorded only on a sampled request)."""
        if not self.recording:
            return
        answer = origin.body if origin.body is not None else origin.first
        found = _MODEL.search(answer)
        model = found.group(1).decode(errors="replace") if found else ""
        answer_id = ""
        finishes: tuple[bytes, ...] = ()
        if origin.status < 400 and self.op not in INPUT_ONLY:
            if origin.body is not None:
                # A whole answer: its own members, parsed (a traced request's
                # cost only), not the first "id" of the text (a tool call's).
                answer_id, finishes = _answer_id_and_finishes(origin.body)
            else:  # a stream's first chunk, whose own id leads it
                found = _ID.search(answer)
                answer_id = found.group(1).decode(errors="replace") if found else ""
        self.origin = OriginSeen(
            origin.target.name, origin.target.region, model, answer_id, finishes
        )

    def finish(self, ex: Exchange | None, status: int, error: str | None) -> None:
        """End the request span with what the request became. `error` is the
        refusal's code (or the failure's type); without one, how a stream that
        started well ended (the Exchange's stream_error), else an answer of
        400 and up is named by its status. The origin and region are those
        that finished the answer (after a continuation, the last origin), as
        in the access log; the attempts are the Exchange's."""
        root = self.root
        if root.is_recording():
            attrs: dict[str, Any] = {"http.response.status_code": status}
            if error is None and ex is not None:
                if ex.stream_error:
                    error = ex.stream_error
                elif ex.held_status:
                    error = str(ex.held_status)  # as boundary._record's metrics
            if error is None and status >= 400:
                error = str(status)
            if error is not None:
                attrs["error.type"] = error
            seen = self.origin
            region = self.region
            if ex is not None and ex.origin:
                region = ex.region
                attrs["ponto.origin"] = ex.origin
            elif seen is not None:
                region = seen.region
                attrs["ponto.origin"] = seen.name
            if seen is not None:
                if seen.model:
                    attrs["gen_ai.response.model"] = seen.model
                if seen.answer_id:
                    attrs["gen_ai.response.id"] = seen.answer_id
                finishes = seen.finishes
                if ex is not None and ex.counter is not None and ex.counter.finishes:
                    finishes = tuple(ex.counter.finishes)  # a stream's, as relayed
                if finishes:
                    attrs["gen_ai.response.finish_reasons"] = [
                        reason.decode() for reason in finishes
                    ]
            attrs["ponto.region"] = region
            if ex is not None:
                attrs["ponto.attempts"] = ex.attempts
                self._exchange_attributes(ex, attrs)
            root.set_attributes(attrs)
            # A server span's 4xx is the client's error, not ours, and so is
            # a 504 not_cached (NOT_SERVER_ERRORS); a cut stream is ours,
            # whatever its status said.
            if (status >= 500 and error not in NOT_SERVER_ERRORS) or error == "stream_cut":
                root.set_status(Status(StatusCode.ERROR, error))
        root.end()

    def _exchange_attributes(self, ex: Exchange, attrs: dict[str, Any]) -> None:
        # ex.model is set once the body was validated and its model found
        # served: before that, nothing in the body is the span's (a refused
        # body's values may be anything, of any size).
        model = ex.model
        if model:
            attrs["gen_ai.request.model"] = model
            if not self.model:  # refused after assembly, before the cache step
                self.model = model
                self.root.update_name(self.name)
            _request_fields(ex.body, attrs)
        if ex.authenticated:
            attrs["ponto.tenant"] = ex.principal.tenant
        if ex.route:
            attrs["ponto.route"] = ex.route
        plan = ex.cache
        if plan is not None:
            attrs["ponto.cache"] = plan.outcome
            if plan.reason:
                attrs["ponto.cache.reason"] = plan.reason
            if plan.entry is not None:
                attrs["gen_ai.response.model"] = plan.entry.model
                usage = _entry_usage(plan.entry)
                if usage is not None:
                    attrs["gen_ai.usage.input_tokens"] = usage[0]
                    attrs["gen_ai.usage.cache_read.input_tokens"] = usage[0]
                    if self.op not in INPUT_ONLY:
                        attrs["gen_ai.usage.output_tokens"] = usage[1]
                elif ex.estimate:
                    # A stream recorded without usage (the client did not ask
                    # for it): the prompt's size as admission estimated it.
                    attrs["gen_ai.usage.input_tokens"] = ex.estimate
                    attrs["gen_ai.usage.cache_read.input_tokens"] = ex.estimate
                    attrs["ponto.usage.estimated"] = True
            if plan.outcome == "hit":
                # Answered from the cache or another request's call: ex.usage
                # is the zero the origins spent, not what the answer holds.
                return
        if ex.usage is not None:
            attrs["gen_ai.usage.input_tokens"] = ex.usage.prompt_tokens
            if ex.usage.cached_tokens is not None:
                # Of them, those the origin's prefix cache held (the
                # conventions' provider-managed cache; trial 33).
                attrs["gen_ai.usage.cache_read.input_tokens"] = ex.usage.cached_tokens
            if self.op not in INPUT_ONLY:  # nor does a ranking
                attrs["gen_ai.usage.output_tokens"] = ex.usage.completion_tokens
            if not ex.usage.exact and ex.usage.total:
                # The proxy's count, in whole or in part (the access log's
                # `tokens_estimated`; billing trial 76).
                attrs["ponto.usage.estimated"] = True


def _request_fields(body: dict[str, Any], attrs: dict[str, Any]) -> None:
    """The request fields of a validated body (a JSON integer may still be
    past int64, a float infinite or NaN)."""
    for name, attr in _REQUEST_FIELDS:
        value = _attribute_number(body.get(name))
        if value is not None:
            # Doubles in the conventions, whatever the JSON wrote (0 or 0.0):
            # a backend that types attributes would see two types otherwise.
            attrs[attr] = float(value) if attr in _DOUBLES else value
    for name in _MAX_TOKENS_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            attrs["gen_ai.request.max_tokens"] = min(max(value, _INT64_MIN), _INT64_MAX)
            break


def _attribute_number(value: object) -> bool | int | float | None:
    """`value` as an OTLP attribute: a bool, an int clamped to int64, a
    finite float; None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return min(max(value, _INT64_MIN), _INT64_MAX)
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _answer_id_and_finishes(body: bytes) -> tuple[str, tuple[bytes, ...]]:
    """A whole answer's own `id` ("" without one) and each choice's
    finish_reason, from its parsed top level."""
    parsed = jsonio.loads_or_none(body)
    if not isinstance(parsed, dict):
        return "", ()
    answer_id = parsed.get("id")
    choices = parsed.get("choices")
    finishes = tuple(
        reason.encode()
        for choice in (choices if isinstance(choices, list) else ())
        if isinstance(choice, dict) and isinstance(reason := choice.get("finish_reason"), str)
    )
    return (answer_id if isinstance(answer_id, str) else ""), finishes


def _one_line(span: ReadableSpan) -> str:
    return str(span.to_json(indent=None)) + "\n"


@dataclass(frozen=True, slots=True)
class OriginSeen:
    name: str
    region: str
    model: str  # as the origin's answer names it; "" when it names none
    answer_id: str = ""  # the answer's own id; "" when it has none
    # Each choice's finish_reason in a whole answer (a stream's are counted
    # as it is relayed: UsageCounter.finishes).
    finishes: tuple[bytes, ...] = ()


@lru_cache(maxsize=1024)
def _server(base_url: str) -> tuple[str | None, int | None]:
    """An origin's host and port, parsed once per base URL."""
    url = URL(base_url)
    return url.host, url.port


def _entry_usage(entry: CachedResponse) -> tuple[int, int] | None:
    """The (input, output) tokens a cached answer's usage states, if it has one."""
    read = rerank_usage_of if entry.kind == "rerank" else usage_of
    for raw in (entry.body,) if entry.body is not None else reversed(entry.chunks or ()):
        if b'"usage"' not in raw:
            continue
        try:
            usage = read(jsonio.loads(raw))
        except jsonio.JSONDecodeError:
            continue
        if usage is not None and not usage.rejected:
            return usage.prompt_tokens, usage.completion_tokens
    return None


def _error_type(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) and code else type(exc).__qualname__


class Step:
    """A pipeline step's span: ended on exit, an error when the step raised."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            error = _error_type(exc)
            self.span.set_attribute("error.type", error)
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class CacheStep(Step):
    """The cache lookup's span: its outcome (hit, miss, bypass) and a bypass's reason."""

    __slots__ = ("ex",)

    def __init__(self, span: Span, ex: Exchange) -> None:
        super().__init__(span)
        self.ex = ex

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        plan = self.ex.cache
        if plan is not None:
            self.span.set_attribute("ponto.cache", plan.outcome)
            if plan.reason:
                self.span.set_attribute("ponto.cache.reason", plan.reason)
            if plan.similarity is not None:
                self.span.set_attribute("ponto.cache.similarity", plan.similarity)
        super().__exit__(exc_type, exc, tb)


class AttemptSpan:
    """One origin call's CLIENT span. The forwarder injects it into the call's
    headers, then ends it with the call's outcome (`committed` or `failed`)."""

    __slots__ = ("_trace", "name", "outcome", "span")

    def __init__(self, trace: RequestTrace, span: Span, name: str) -> None:
        self._trace = trace
        self.span = span
        self.name = name
        self.outcome = ""  # set ahead of a cancellation whose cause is known

    def inject(self, headers: CIMultiDict[str]) -> CIMultiDict[str]:
        """A copy of `headers` whose trace context names this span, and only it:
        the client's own traceparent and tracestate are replaced."""
        out = headers.copy()
        out.popall("traceparent", None)
        out.popall("tracestate", None)
        _PROPAGATOR.inject(out, set_span_in_context(self.span))
        return out

    def committed(self, status: int) -> None:
        self._end("ok", status, None)

    def failed(self, exc: BaseException) -> None:
        """`exc` ended the call: a retryable failure (its `outcome`, and its
        `status` when the origin answered), a cancellation (its cause set
        ahead in `outcome`: a lost hedge, the deadline; else the client
        gone), or a bug."""
        outcome = getattr(exc, "outcome", None)
        if not isinstance(outcome, str):
            cancelled = isinstance(exc, asyncio.CancelledError)
            outcome = self.outcome or ("cancelled" if cancelled else "error")
        status = getattr(exc, "status", None)
        self._end(
            outcome,
            status if isinstance(status, int) else None,
            outcome if outcome != "hedge_cancelled" else None,
        )

    def _end(self, outcome: str, status: int | None, error: str | None) -> None:
        self._trace.ended(self)
        span = self.span
        if span.is_recording():
            span.set_attribute("ponto.outcome", outcome)
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if error is not None:
                span.set_attribute("error.type", error)
                span.set_status(Status(StatusCode.ERROR, error))
        span.end()
