"""OpenTelemetry traces of proxied requests (off unless the OTEL_* variables ask).

Off by default and then free: `dataplane.telemetry.config` imports no
OpenTelemetry code; `dataplane.telemetry.tracing` does, and is imported only
when tracing is on. The request path holds a `RequestTrace | None` and pays
one `is None` check per traced step when off.
"""
