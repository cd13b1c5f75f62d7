"""The tracer provider a proxy builds from its settings and the OTEL_* variables."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)

from dataplane.telemetry.config import TraceConfig
from dataplane.telemetry.tracing import (
    EXPORT_LOGGERS,
    CountingBatchProcessor,
    CountingExporter,
    ExportLogThrottle,
    ExportStats,
    Tracing,
    _answer_id_and_finishes,
    resource,
    start,
)


def exporters(tracing: Tracing) -> list[type]:
    processors = tracing.provider._active_span_processor._span_processors
    assert all(isinstance(p, BatchSpanProcessor) for p in processors)
    counted = [p._batch_processor._exporter for p in processors]  # type: ignore[attr-defined]
    assert all(isinstance(e, CountingExporter) for e in counted)
    return [type(e.inner) for e in counted]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (TraceConfig(("otlp",), "http/protobuf"), [Http]),
        (TraceConfig(("otlp",), "grpc"), [Grpc]),
        (TraceConfig(("console", "otlp"), "grpc"), [ConsoleSpanExporter, Grpc]),
    ],
)
def test_each_exporter_gets_a_batch_processor(config: TraceConfig, expected: list[type]) -> None:
    tracing = start(config, proxy="p1", region="eu", version="1.2.3")
    try:
        assert exporters(tracing) == expected
    finally:
        tracing.shutdown()


def test_the_resource_names_the_proxy_and_its_region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=prod,ponto.region=x"
    )
    attrs = resource(proxy="p1-w0", region="eu", version="1.2.3").attributes
    assert attrs["service.name"] == "ponto-proxy"
    assert attrs["service.instance.id"] == "p1-w0"
    assert attrs["service.version"] == "1.2.3"
    assert attrs["deployment.environment.name"] == "prod"
    assert attrs["ponto.region"] == "eu"  # the proxy knows its region better
    assert attrs["ponto.proxy"] == "p1-w0"


@pytest.mark.parametrize(
    ("variable", "value"),
    [("OTEL_SERVICE_NAME", "edge"), ("OTEL_RESOURCE_ATTRIBUTES", "service.name=edge")],
)
def test_the_service_name_is_the_environments_when_it_names_one(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.setenv(variable, value)
    assert resource(proxy="p", region="r", version="v").attributes["service.name"] == "edge"


def test_the_console_exporter_writes_to_standard_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Standard output is the access log's: one JSON object per line, nothing else.
    tracing = start(TraceConfig(("console",), "http/protobuf"), proxy="p", region="r", version="v")
    trace = tracing.tracer.begin("chat.completions", "POST", "/v1/chat/completions", {}, "id-1")
    trace.finish(None, 200, None)
    tracing.shutdown()  # exports what is buffered
    out, err = capsys.readouterr()
    assert out == ""
    # One line per span, as every other line on standard error (trial 25:
    # the SDK's default indented each over some 40 lines).
    [line] = err.splitlines()
    span = json.loads(line)
    assert span["name"] == "POST /v1/chat/completions"
    assert span["attributes"]["ponto.request_id"] == "id-1"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # An origin that writes its choices first, with a tool call's id: the
        # answer's own id is its top-level one (review 43).
        (
            b'{"choices":[{"index":0,"message":{"tool_calls":[{"id":"call_1"}]},'
            b'"finish_reason":"tool_calls"},{"index":1,"finish_reason":"length"}],'
            b'"id":"chatcmpl-9"}',
            ("chatcmpl-9", (b"tool_calls", b"length")),
        ),
        (b'{"choices":[{"finish_reason":null}],"object":"list"}', ("", ())),
        (b"[1, 2]", ("", ())),
        (b"not json", ("", ())),
    ],
)
def test_a_whole_answers_id_and_finish_reasons_are_its_own(
    body: bytes, expected: tuple[str, tuple[bytes, ...]]
) -> None:
    assert _answer_id_and_finishes(body) == expected


class Collector(SpanExporter):
    """An exporter whose collector is up or down, as the test says."""

    def __init__(self) -> None:
        self.result = SpanExportResult.SUCCESS
        self.raises = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.raises:
            raise ConnectionError("collector gone")
        return self.result


def test_failed_exports_and_their_spans_are_counted() -> None:
    inner, stats = Collector(), ExportStats()
    exporter = CountingExporter(inner, stats)
    spans: list[ReadableSpan] = [ReadableSpan(name=f"s{i}") for i in range(3)]
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    assert stats.failed_batches() == 0
    assert stats.dropped_spans() == {"queue_full": 0, "export_failed": 0}
    inner.result = SpanExportResult.FAILURE
    assert exporter.export(spans) is SpanExportResult.FAILURE
    inner.raises = True
    with pytest.raises(ConnectionError):
        exporter.export(spans[:1])
    assert stats.failed_batches() == 2
    assert stats.dropped_spans() == {"queue_full": 0, "export_failed": 4}


class Stuck(SpanExporter):
    """A collector that takes the first batch and holds it until `release`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(10)
        return SpanExportResult.SUCCESS


def test_spans_dropped_from_a_full_queue_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # The most common loss under load, which only the SDK's log told of
    # (review finding); a real batch processor: the count is its own report.
    # A queue of 1, exported as soon as it holds one.
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "1")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1")
    inner, stats = Stuck(), ExportStats()
    processor = CountingBatchProcessor(CountingExporter(inner, stats), stats)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    try:
        tracer.start_span("exporting").end()
        assert inner.entered.wait(10)  # the worker holds it, the queue is empty
        for name in ("queued", "dropped", "dropped too"):
            tracer.start_span(name).end()
        assert stats.dropped_spans() == {"queue_full": 2, "export_failed": 0}
    finally:
        inner.release.set()
        provider.shutdown()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_exporters_log_lines_are_throttled_to_one_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = ExportLogThrottle(every_s=60.0, clock=clock)
    detach = throttle.attach()
    grpc = logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter")
    batch = logging.getLogger("opentelemetry.sdk._shared_internal")
    try:
        with caplog.at_level(logging.WARNING):
            # A collector down: a retry line every few seconds, then the failure.
            # (Each its own text: the SDK drops a repeated one within 20 s itself.)
            for i in range(12):
                grpc.warning(f"Transient error UNAVAILABLE, retry {i}")
                clock.now += 4
            batch.error("Failed to export span batch")
            shown = [r.getMessage() for r in caplog.records]
            assert shown == ["Transient error UNAVAILABLE, retry 0"]
            clock.now += 60
            grpc.error("Failed to export traces to %s", "collector:4317")
            shown = [r.getMessage() for r in caplog.records]
            assert shown[1] == (
                "Failed to export traces to collector:4317 "
                "(12 more tracing export lines not logged)"
            )
    finally:
        detach()
    assert all(throttle not in logging.getLogger(n).filters for n in EXPORT_LOGGERS)


def test_start_counts_and_throttles_until_shutdown() -> None:
    tracing = start(TraceConfig(("console",), "grpc"), proxy="p1", region="eu", version="1")
    try:
        assert any(
            isinstance(f, ExportLogThrottle) for f in logging.getLogger(EXPORT_LOGGERS[0]).filters
        )
        counted = tracing.provider._active_span_processor._span_processors[0]
        exporter = counted._batch_processor._exporter  # type: ignore[attr-defined]
        assert exporter._stats is tracing.tracer.exports
    finally:
        tracing.shutdown()
    assert not any(
        isinstance(f, ExportLogThrottle) for f in logging.getLogger(EXPORT_LOGGERS[0]).filters
    )
