"""The test receiver's decoding: what tests and benches read from its lines."""

from __future__ import annotations

import json

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from ponto.otlpsink import span_lines


def test_a_span_becomes_one_line_with_its_times_ids_and_attributes() -> None:
    span = Span(
        trace_id=bytes.fromhex("0af7651916cd43dd8448eb211c80319c"),
        span_id=bytes.fromhex("b7ad6b7169203331"),
        name="chat sim-small",
        kind=Span.SpanKind.SPAN_KIND_SERVER,
        start_time_unix_nano=1_000,
        end_time_unix_nano=4_500,
        attributes=[KeyValue(key="ponto.attempts", value=AnyValue(int_value=2))],
    )
    request = tpb.ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(
                    attributes=[KeyValue(key="service.name", value=AnyValue(string_value="p"))]
                ),
                scope_spans=[ScopeSpans(spans=[span])],
            )
        ]
    )
    [line] = span_lines(request)
    record = json.loads(line)
    assert record["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert record["span_id"] == "b7ad6b7169203331" and record["parent_span_id"] == ""
    assert record["kind"] == "SPAN_KIND_SERVER" and record["status"] == "STATUS_CODE_UNSET"
    assert (record["start_unix_nano"], record["end_unix_nano"]) == (1_000, 4_500)
    assert record["attributes"] == {"ponto.attempts": 2}
    assert record["resource"] == {"service.name": "p"}
