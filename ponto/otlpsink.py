"""`python -m ponto.otlpsink`: a minimal OTLP trace receiver, for tests and benches.

Accepts ExportTraceServiceRequest over OTLP/HTTP (POST /v1/traces, protobuf)
or OTLP/gRPC (the TraceService), decodes it with opentelemetry-proto's
classes, and writes one JSON line per span to --out (standard output by
default), flushed as it arrives:

    {"trace_id", "span_id", "parent_span_id", "name", "kind", "status",
     "start_unix_nano", "end_unix_nano", "attributes": {...}, "resource": {...}}

Ids are lower-case hex ("" for no parent); `kind` and `status` are the
protocol's enum names (SPAN_KIND_SERVER, STATUS_CODE_ERROR). It keeps nothing
in memory and checks nothing: it is a test receiver, not a collector.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from ponto.cliargs import hostport, listen_address
from ponto.writefile import write_atomic

PROTOCOLS = ("http/protobuf", "grpc")


def value_of(v: AnyValue) -> Any:
    """An OTLP attribute value as plain JSON."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes_of(v.kvlist_value.values)
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind is not None else None


def attributes_of(kvs: Any) -> dict[str, Any]:
    pairs: list[KeyValue] = list(kvs)
    return {kv.key: value_of(kv.value) for kv in pairs}


def span_lines(request: tpb.ExportTraceServiceRequest) -> list[str]:
    """One JSON line per span of `request`."""
    lines = []
    for rs in request.resource_spans:
        resource = attributes_of(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                record = {
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "name": span.name,
                    "kind": Span.SpanKind.Name(span.kind),
                    "status": Status.StatusCode.Name(span.status.code),
                    "start_unix_nano": span.start_time_unix_nano,
                    "end_unix_nano": span.end_time_unix_nano,
                    "attributes": attributes_of(span.attributes),
                    "resource": resource,
                }
                lines.append(json.dumps(record, sort_keys=True) + "\n")
    return lines


class Sink:
    """Writes the spans of each export to `out`, one line each. One event loop."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self.exports = 0

    def take(self, request: tpb.ExportTraceServiceRequest) -> None:
        self._out.writelines(span_lines(request))
        self._out.flush()
        self.exports += 1


def http_app(sink: Sink) -> web.Application:
    """OTLP/HTTP's trace route, protobuf encoding (aiohttp undoes a gzip coding)."""

    async def traces(request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="only application/x-protobuf\n")
        message = tpb.ExportTraceServiceRequest()
        try:
            message.ParseFromString(await request.read())
        except Exception:  # protobuf's DecodeError is not exported under one name
            return web.Response(status=400, text="not an ExportTraceServiceRequest\n")
        sink.take(message)
        return web.Response(
            body=tpb.ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    return app


class TraceService(tgrpc.TraceServiceServicer):
    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    async def Export(
        self, request: tpb.ExportTraceServiceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tpb.ExportTraceServiceResponse:
        self._sink.take(request)
        return tpb.ExportTraceServiceResponse()


async def serve(
    protocol: str, host: str, port: int, sink: Sink, ready: Callable[[int], None]
) -> None:
    """Receive until SIGTERM or SIGINT; `ready` gets the bound port."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if protocol == "grpc":
        server = grpc.aio.server()
        tgrpc.add_TraceServiceServicer_to_server(TraceService(sink), server)  # type: ignore[no-untyped-call]
        bound = server.add_insecure_port(f"{host}:{port}")
        await server.start()
        ready(bound)
        await stop.wait()
        await server.stop(grace=1.0)
        return
    runner = web.AppRunner(http_app(sink), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    assert site._server is not None
    ready(site._server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
    await stop.wait()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ponto.otlpsink", description=__doc__.split("\n")[0])
    p.add_argument(
        "--listen",
        type=listen_address,
        default="127.0.0.1:4318",
        help="HOST:PORT (port 0: any free one)",
    )
    p.add_argument("--protocol", choices=PROTOCOLS, default="http/protobuf")
    p.add_argument("--out", type=Path, help="JSON lines file (default: standard output)")
    p.add_argument("--ready-file", type=Path, help="written with HOST:PORT once listening")
    args = p.parse_args(argv)
    host, port = args.listen
    out = args.out.open("a", encoding="utf-8") if args.out else sys.stdout

    def ready(port: int) -> None:
        if args.ready_file is not None:
            write_atomic(args.ready_file, hostport(host, port).encode())

    try:
        asyncio.run(serve(args.protocol, host, port, Sink(out), ready))
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
